"""Forward+backward time and peak memory of DDCLQuantizer, HardVQ and vector-quantize-pytorch, side by side.

    python -m eval.bench_codebook                      # N=8192 tokens, D=64, K in 64..4096
    python -m eval.bench_codebook --codes 512 --reps 20 --json bench.json
    python -m eval.bench_codebook --codes 512 --compile    # also torch.compile(fullgraph=True) of DDCL and HardVQ
    python -m eval.bench_codebook --codes 4096 16384 --methods ddcl ddcl_top_k hard vqp_recipe   # top-k assignments

Each method is one training step of the layer alone, in training mode, with its in-layer updates (EMA, restarts,
temperature control) and the finite check off: ``ddcl`` is ``DDCLQuantizer``'s defaults (the in-layer recipe),
``hard`` is ``HardVQ`` with an EMA codebook and dead-code restart (the strongest hard VQ here, configured as the
DDCL layer's recipe: decay 0.99, threshold 1), ``vqp`` vector-quantize-pytorch's ``VectorQuantize`` (EMA decay 0.8,
commitment 1) and ``vqp_recipe`` the settings its README gives against dead codes (k-means init, EMA dead-code
threshold a tenth of the mean cluster size, rotation trick). ``--compile`` adds ``ddcl_compiled`` and ``hard_compiled``.

Every configuration times the three quantizers in interleaved rounds in one process (so machine noise hits all
of them alike) and reports the median; peak memory is the extra memory of one step (see ``eval/_bench.py``).
vector-quantize-pytorch is a benchmark-only dependency: ``pip install -e .[bench]``.
"""

from __future__ import annotations

import argparse
import json
from collections.abc import Callable

import torch
from torch import nn

from eval._bench import markdown_table, peak_memory_mib, serve_large_blocks_with_mmap, sweep, sync
from eval._hard import HARD_RESTART, VQP_RECIPE

METHODS = ("ddcl", "ddcl_plain", "hard", "vqp", "vqp_recipe")
# DDCLQuantizer(top_k=k) (not in the default sweep: --methods ddcl_top_k ...); k from --top-k, else top_k_bound(K)
TOP_K = ("ddcl_top_k",)
# Residual stacks of RESIDUAL_LEVELS levels of K codes each (not in the default sweep: --methods rddcl rhard vqp_rvq)
RESIDUAL = ("rddcl", "rhard", "vqp_rvq")
RESIDUAL_LEVELS = 4
COMPILED = ("ddcl_compiled", "hard_compiled")
# The per-second candidates of eval.per_second, as eval.harness builds them (not in the default sweep)
CANDIDATES = ("ddcl_k16", "ddcl_k32", "ddcl_n16", "ddcl_n32", "ddcl_c16", "ddcl_amortised")
LABELS = {"ddcl": "DDCLQuantizer (its defaults: the in-layer recipe)",
          "ddcl_plain": "DDCLQuantizer(recipe='plain'), gradient-trained prototypes",
          "hard": "HardVQ (EMA 0.99 + dead-code restart 1)", "vqp": "vector-quantize-pytorch VectorQuantize",
          "vqp_recipe": "VectorQuantize(kmeans_init, dead_code_threshold_ratio=0.1, rotation_trick)",
          "ddcl_top_k": "DDCLQuantizer(top_k=k), its defaults otherwise",
          "ddcl_compiled": "torch.compile(DDCLQuantizer, fullgraph=True)",
          "ddcl_k16": "DDCLQuantizer(top_k=16, target_entropy=log(16) - 0.5) (eval.harness)",
          "ddcl_k32": "DDCLQuantizer(top_k=32, target_entropy=log(32) - 0.5) (eval.harness)",
          "ddcl_n16": "DDCL truncated to the 16 codes nearest each token's code (eval/neighbour.py)",
          "ddcl_n32": "DDCL truncated to the 32 codes nearest each token's code (eval/neighbour.py)",
          "ddcl_c16": "DDCL truncated to the token's 16 nearest of the 64 codes nearest its code (eval/neighbour.py)",
          "ddcl_amortised": "DDCL with an amortised Jacobian, 16 neighbours per code (eval/amortised.py)",
          "hard_compiled": "torch.compile(HardVQ, fullgraph=True)",
          "rddcl": f"ResidualDDCL({RESIDUAL_LEVELS} levels, its defaults)",
          "rhard": f"ResidualHardVQ({RESIDUAL_LEVELS} levels, EMA 0.99 + restart 1)",
          "vqp_rvq": f"vector-quantize-pytorch ResidualVQ({RESIDUAL_LEVELS} levels, kmeans init, dead-code ratio 0.1, "
                     f"rotation trick)"}


def top_k_bound(num_codes: int) -> int:
    """The smallest k within the accuracy bound measured at the default entropy target (mean mass left out <= 1e-4,
    encoder-gradient error <= 1e-3; docs/scaling.md, "Top-k assignments"): a quarter of K = 512, an eighth of
    K = 4096; beyond 4096 an eighth, not measured."""
    return max(1, num_codes // 4 if num_codes <= 512 else num_codes // 8)


def build(method: str, num_codes: int, dim: int, top_k: int | None = None) -> nn.Module:
    """The quantizers in comparable settings: each trains its codebook and returns an auxiliary loss."""
    if method.endswith("_compiled"):
        module = build(method.removesuffix("_compiled"), num_codes, dim, top_k)
        module.compile(fullgraph=True)  # in place: the module keeps its state-dict names
        return module
    if method == "ddcl":
        from softvq import DDCLQuantizer

        return DDCLQuantizer(num_codes, dim, check_finite=False)
    if method == "ddcl_top_k":
        from softvq import DDCLQuantizer

        return DDCLQuantizer(num_codes, dim, check_finite=False, top_k=top_k or top_k_bound(num_codes))
    if method in CANDIDATES:
        from eval.harness import build as build_candidate

        return build_candidate(method, num_codes, dim, {"check_finite": False})
    if method == "ddcl_plain":
        from softvq import DDCLQuantizer

        return DDCLQuantizer(num_codes, dim, temperature=1.0, recipe="plain", check_finite=False)
    if method == "hard":
        from softvq import HardVQ

        return HardVQ(num_codes, dim, ema_decay=0.99, restart=HARD_RESTART, check_finite=False)
    if method in ("rddcl", "rhard"):
        from softvq import ResidualDDCL, ResidualHardVQ

        cls = ResidualDDCL if method == "rddcl" else ResidualHardVQ
        return cls(RESIDUAL_LEVELS, num_codes, dim, check_finite=False)
    if method == "vqp_rvq":
        from vector_quantize_pytorch import ResidualVQ

        return ResidualVQ(dim=dim, num_quantizers=RESIDUAL_LEVELS, codebook_size=num_codes, **VQP_RECIPE)
    if method in ("vqp", "vqp_recipe"):
        try:
            from vector_quantize_pytorch import VectorQuantize
        except ImportError as err:
            raise SystemExit("vector-quantize-pytorch is not installed: pip install -e '.[bench]'") from err
        if method == "vqp":
            return VectorQuantize(dim=dim, codebook_size=num_codes, decay=0.8, commitment_weight=1.0)
        return VectorQuantize(dim=dim, codebook_size=num_codes, **VQP_RECIPE)
    raise ValueError(f"unknown method {method!r}; choose from {METHODS + TOP_K + COMPILED + RESIDUAL + CANDIDATES}")


def make_step(module: nn.Module, z: torch.Tensor) -> Callable[[], None]:
    """One training step of the quantizer alone: forward, a stand-in decoder loss on the output, backward."""

    def step() -> None:
        x = z.detach().requires_grad_(True)
        out = module(x)
        if hasattr(out, "quantized"):  # softvq QuantizerOutput
            quantized, aux = out.quantized, out.loss
        else:  # vector-quantize-pytorch: (quantized, indices, loss)
            quantized, aux = out[0], out[2].sum()
        (quantized.square().mean() + aux).backward()

    return step


def prepare(num_codes: int, args: argparse.Namespace, device: torch.device) -> dict[str, Callable[[], None]]:
    """A warmed-up training step of every method, all on the same input ``(N / 1024, 1024, D)``."""
    torch.manual_seed(0)
    z = torch.randn(max(args.tokens // 1024, 1), min(args.tokens, 1024), args.dim, device=device)
    if any(m.endswith("_compiled") for m in args.methods):
        # every K is a new model: drop the previous K's graphs (a compiled DDCL layer holds 2: its first batch and
        # every later step), or torch's recompile limit of 8 stops the sweep
        torch._dynamo.reset()
    steps = {}
    for method in args.methods:
        module = build(method, num_codes, args.dim, args.top_k).to(device).train()
        steps[method] = make_step(module, z)
        for _ in range(args.warmup):
            steps[method]()
    steps.update(floors(num_codes, args, device))
    sync(device)
    return steps


def floors(num_codes: int, args: argparse.Namespace, device: torch.device) -> dict[str, Callable[[], None]]:
    """What bounds the methods, timed in the same rounds: one ``(N, D) x (D, K)`` float32 matmul (``mm``; HardVQ
    does one, DDCL four: scores, soft centroid, and two in its backward pass) and one in-place pass over an ``(N, K)``
    array (``pass``; memory bandwidth)."""
    a = torch.randn(args.tokens, args.dim, device=device)
    b = torch.randn(args.dim, num_codes, device=device)
    out = torch.empty(args.tokens, num_codes, device=device)
    return {"mm": lambda: torch.mm(a, b, out=out), "pass": lambda: out.mul_(1.0)}


def first_step_memory(args: argparse.Namespace, device: torch.device) -> dict[int, dict[str, float]]:
    """The peak extra memory (MiB) of every method's first training step on a fresh layer, per K."""
    if device.type == "cpu":
        serve_large_blocks_with_mmap()
    torch.manual_seed(0)
    z = torch.randn(max(args.tokens // 1024, 1), min(args.tokens, 1024), args.dim, device=device)
    out: dict[int, dict[str, float]] = {}
    for num_codes in args.codes:
        out[num_codes] = {}
        for method in args.methods:
            module = build(method, num_codes, args.dim, args.top_k).to(device).train()
            out[num_codes][method] = peak_memory_mib(make_step(module, z), device)
            del module
    return out


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tokens", type=int, default=8192, help="N, tokens per step (default 8192)")
    parser.add_argument("--dim", type=int, default=64, help="D, token dimension (default 64)")
    parser.add_argument("--codes", type=int, nargs="+", default=[64, 128, 256, 512, 1024, 2048, 4096],
                        help="K values to sweep (default 64..4096)")
    parser.add_argument("--methods", nargs="+", choices=METHODS + TOP_K + COMPILED + RESIDUAL + CANDIDATES,
                        default=list(METHODS), help="quantizers to compare; ratios are to HardVQ when it is included")
    parser.add_argument("--top-k", type=int, default=None,
                        help="k of ddcl_top_k (default: top_k_bound(K), the measured accuracy bound)")
    parser.add_argument("--compile", action="store_true",
                        help="add the torch.compile(fullgraph=True) versions of ddcl and hard (compiling takes a "
                             "minute or so on a CPU)")
    parser.add_argument("--reps", type=int, default=10, help="timed rounds per configuration (default 10)")
    parser.add_argument("--warmup", type=int, default=3, help="untimed steps per method first (default 3)")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu",
                        help="device (default: cuda if available, else cpu)")
    parser.add_argument("--no-memory", action="store_true", help="skip the peak-memory measurement")
    parser.add_argument("--first-step", action="store_true",
                        help="also the peak memory of a fresh layer's first training step (initialisation and "
                             "temperature calibration included)")
    parser.add_argument("--json", metavar="FILE", help="also write the results as JSON to FILE")
    args = parser.parse_args(argv)
    if args.compile:
        args.methods += [m for m in COMPILED if m not in args.methods]
    if args.tokens < 1 or args.dim < 1 or args.reps < 1 or min(args.codes) < 1 or (args.top_k or 1) < 1:
        parser.error("--tokens, --dim, --reps, --top-k and every --codes value must be positive")
    if args.tokens > 1024 and args.tokens % 1024:
        parser.error(f"--tokens above 1024 must be a multiple of 1024 (batches of 1024), got {args.tokens}")
    return args


# The ratios the targets are about (numerator, denominator), printed where both were measured.
RATIOS = (("ddcl", "hard"), ("ddcl_top_k", "hard"), ("ddcl_k16", "hard"), ("ddcl_k32", "hard"),
          ("ddcl_amortised", "hard"), ("ddcl_top_k", "ddcl"), ("ddcl", "vqp"), ("ddcl", "vqp_recipe"),
          ("ddcl_compiled", "hard_compiled"),
          ("ddcl_compiled", "ddcl"), ("hard_compiled", "hard"), ("ddcl_plain", "hard"), ("rddcl", "rhard"),
          ("rddcl", "vqp_rvq"), ("rddcl", "ddcl"))


def format_table(rows: list[dict], methods: list[str], with_memory: bool) -> str:
    """Milliseconds per method, the ratios of :data:`RATIOS`, and (with ``with_memory``) the peak MiB per method."""
    ratios = [(a, b) for a, b in RATIOS if a in methods and b in methods]
    head = ["K"] + [f"{m} ms" for m in methods] + ["1 mm ms", "1 pass ms"]
    cells = [[str(row["K"])] + [f"{row['ms'][m]:.1f}" for m in methods]
             + [f"{row['ms']['mm']:.2f}", f"{row['ms']['pass']:.2f}"] for row in rows]
    tables = [markdown_table(head, cells)]
    bound = [m for m in ("ddcl", "hard", "ddcl_compiled", "hard_compiled") if m in methods]
    if bound:  # how far each is from its matmul floor: DDCL 4 matmuls, HardVQ 1
        cells = [[str(row["K"])] + [f"{row['ms'][m] / (row['ms']['mm'] * (1 if m.startswith('hard') else 4)):.2f}x"
                                    for m in bound] for row in rows]
        tables.append(markdown_table(["K"] + [f"{m} / its matmuls" for m in bound], cells))
    if ratios:
        cells = [[str(row["K"])] + [f"{row['ms'][a] / row['ms'][b]:.2f}x" for a, b in ratios] for row in rows]
        tables.append(markdown_table(["K"] + [f"{a}/{b}" for a, b in ratios], cells))
    if with_memory:
        cells = [[str(row["K"])] + [f"{row['peak_mib'][m]:.0f}" for m in methods] for row in rows]
        tables.append(markdown_table(["K"] + [f"{m} MiB" for m in methods], cells))
    return "\n\n".join(tables)


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    device = torch.device(args.device)
    print(f"torch {torch.__version__}, device {device}, threads {torch.get_num_threads()}, "
          f"N={args.tokens} tokens, D={args.dim}, median of {args.reps} interleaved fwd+bwd steps")
    rows = sweep("K", args.codes, lambda k: prepare(k, args, device), args.reps, device, not args.no_memory)
    print(format_table(rows, args.methods, not args.no_memory))
    if args.first_step:
        first = first_step_memory(args, device)
        print(markdown_table(["K"] + [f"{m} first step MiB" for m in args.methods],
                             [[str(k)] + [f"{first[k][m]:.0f}" for m in args.methods] for k in args.codes]))
        for row in rows:
            row["first_step_mib"] = first[row["K"]]
    print("methods: " + "; ".join(f"{m} = {LABELS[m]}" for m in args.methods))
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"device": str(device), "tokens": args.tokens, "dim": args.dim, "rows": rows}, f, indent=2)


if __name__ == "__main__":
    main()
