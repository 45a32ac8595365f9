"""Forward+backward time and peak memory of DDCLQuantizer, HardVQ and vector-quantize-pytorch, side by side.

    python -m eval.bench_codebook                      # N=8192 tokens, D=64, K in 64..4096
    python -m eval.bench_codebook --codes 512 --reps 20 --json bench.json

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

from eval._bench import markdown_table, sweep, sync

METHODS = ("ddcl", "ddcl_plain", "hard", "vqp")
LABELS = {"ddcl": "DDCLQuantizer (its defaults: the in-layer recipe)",
          "ddcl_plain": "DDCLQuantizer(recipe='plain'), gradient-trained prototypes",
          "hard": "HardVQ (EMA)", "vqp": "vector-quantize-pytorch VectorQuantize"}


def build(method: str, num_codes: int, dim: int) -> nn.Module:
    """The three quantizers in comparable settings: each trains its codebook and returns an auxiliary loss."""
    if method == "ddcl":
        from softvq import DDCLQuantizer

        return DDCLQuantizer(num_codes, dim, temperature=1.0, check_finite=False)
    if method == "ddcl_plain":
        from softvq import DDCLQuantizer

        return DDCLQuantizer(num_codes, dim, temperature=1.0, recipe="plain", check_finite=False)
    if method == "hard":
        from softvq import HardVQ

        return HardVQ(num_codes, dim, ema_decay=0.8, check_finite=False)
    if method == "vqp":
        try:
            from vector_quantize_pytorch import VectorQuantize
        except ImportError as err:
            raise SystemExit("vector-quantize-pytorch is not installed: pip install -e '.[bench]'") from err
        return VectorQuantize(dim=dim, codebook_size=num_codes, decay=0.8, commitment_weight=1.0)
    raise ValueError(f"unknown method {method!r}; choose from {METHODS}")


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
    steps = {}
    for method in args.methods:
        module = build(method, num_codes, args.dim).to(device).train()
        steps[method] = make_step(module, z)
        for _ in range(args.warmup):
            steps[method]()
    sync(device)
    return steps


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tokens", type=int, default=8192, help="N, tokens per step (default 8192)")
    parser.add_argument("--dim", type=int, default=64, help="D, token dimension (default 64)")
    parser.add_argument("--codes", type=int, nargs="+", default=[64, 128, 256, 512, 1024, 2048, 4096],
                        help="K values to sweep (default 64..4096)")
    parser.add_argument("--methods", nargs="+", choices=METHODS, default=list(METHODS),
                        help="quantizers to compare; ratios are to HardVQ when it is included")
    parser.add_argument("--reps", type=int, default=10, help="timed rounds per configuration (default 10)")
    parser.add_argument("--warmup", type=int, default=3, help="untimed steps per method first (default 3)")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu",
                        help="device (default: cuda if available, else cpu)")
    parser.add_argument("--no-memory", action="store_true", help="skip the peak-memory measurement")
    parser.add_argument("--json", metavar="FILE", help="also write the results as JSON to FILE")
    args = parser.parse_args(argv)
    if args.tokens < 1 or args.dim < 1 or args.reps < 1 or min(args.codes) < 1:
        parser.error("--tokens, --dim, --reps and every --codes value must be positive")
    if args.tokens > 1024 and args.tokens % 1024:
        parser.error(f"--tokens above 1024 must be a multiple of 1024 (batches of 1024), got {args.tokens}")
    return args


def format_table(rows: list[dict], methods: list[str], with_memory: bool) -> str:
    base = "hard" if "hard" in methods else methods[0]
    both = "ddcl" in methods and "vqp" in methods
    head = ["K"] + [f"{m} ms" for m in methods] + [f"{m}/{base}" for m in methods if m != base]
    head += ["ddcl/vqp"] if both else []
    head += [f"{m} MiB" for m in methods] if with_memory else []
    cells = []
    for row in rows:
        ms = row["ms"]
        line = [str(row["K"])] + [f"{ms[m]:.1f}" for m in methods]
        line += [f"{ms[m] / ms[base]:.2f}x" for m in methods if m != base]
        line += [f"{ms['ddcl'] / ms['vqp']:.2f}x"] if both else []
        line += [f"{row['peak_mib'][m]:.0f}" for m in methods] if with_memory else []
        cells.append(line)
    return markdown_table(head, cells)


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    device = torch.device(args.device)
    print(f"torch {torch.__version__}, device {device}, threads {torch.get_num_threads()}, "
          f"N={args.tokens} tokens, D={args.dim}, median of {args.reps} interleaved fwd+bwd steps")
    rows = sweep("K", args.codes, lambda k: prepare(k, args, device), args.reps, device, not args.no_memory)
    print(format_table(rows, args.methods, not args.no_memory))
    print("methods: " + "; ".join(f"{m} = {LABELS[m]}" for m in args.methods))
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"device": str(device), "tokens": args.tokens, "dim": args.dim, "rows": rows}, f, indent=2)


if __name__ == "__main__":
    main()
