"""Readout cost as the sequence grows: DDCLReadout (O(T·K)) against self-attention pooling (O(T^2)).

    python -m eval.bench_readout                         # T = 256 .. 16384, B = 2, D = 64, K = 64, 4 heads
    OMP_NUM_THREADS=1 python -m eval.bench_readout --out reports/readout/bench.md

What is compared, per step (forward + backward through the readout and into the tokens and its parameters, with a
stand-in task loss on the summary):

- ``ddcl``: :class:`softvq.DDCLReadout` with ``K`` prototypes; its slots ``(B, K, D)``, pooled vector and
  auxiliary loss all enter the loss.
- ``attn``: one ``nn.MultiheadAttention`` self-attention layer over the tokens followed by mean pooling. This is
  the O(T^2) baseline the paper means: a CLS token (or any attention pooling that lets the tokens see each other)
  gets its summary by taking part in a full T x T self-attention, so that is the cost a CLS readout adds on top of
  an encoder. Parameters: ``4 D^2`` against DDCL's ``K D``.
- ``query``: one learned query attending over the tokens (Perceiver/Set-Transformer "PMA" pooling), an O(T)
  attention readout, for scale.

Every ``T`` times the methods in interleaved rounds and reports medians, then the peak extra memory of one step
(``eval/_bench.py``). The check it makes: DDCL's time must grow linearly, ``t(4096) / t(512) <= 9``
(8 would be exactly linear); the script prints PASS or FAIL and exits with status 1 on FAIL.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Callable
from pathlib import Path

import torch
from torch import Tensor, nn

from eval._bench import markdown_table, sweep, sync
from eval._provenance import code_commit, study_command
from softvq import DDCLReadout

METHODS = ("ddcl", "attn", "query")
LABELS = {"ddcl": "DDCLReadout (slots + pooled + aux loss)",
          "attn": "nn.MultiheadAttention self-attention + mean pooling (O(T^2))",
          "query": "one learned query attending over the tokens (O(T))"}
LINEAR_LIMIT = 9.0  # t(4096) / t(512) for an 8x longer sequence; 8 is exactly linear


class SelfAttentionPool(nn.Module):
    """Self-attention over the tokens ``(B, T, D)`` followed by mean pooling -> ``(B, D)``."""

    def __init__(self, dim: int, heads: int) -> None:
        super().__init__()
        self.attn = nn.MultiheadAttention(dim, heads, batch_first=True)

    def forward(self, x: Tensor) -> Tensor:
        return self.attn(x, x, x, need_weights=False)[0].mean(1)


class QueryPool(nn.Module):
    """One learned query attending over the tokens ``(B, T, D)`` -> ``(B, D)``."""

    def __init__(self, dim: int, heads: int) -> None:
        super().__init__()
        self.query = nn.Parameter(torch.randn(1, 1, dim) * dim**-0.5)
        self.attn = nn.MultiheadAttention(dim, heads, batch_first=True)

    def forward(self, x: Tensor) -> Tensor:
        return self.attn(self.query.expand(x.shape[0], -1, -1), x, x, need_weights=False)[0][:, 0]


def make_step(method: str, args: argparse.Namespace, x: Tensor) -> Callable[[], None]:
    """One training step of a readout alone: forward, a stand-in loss on its summary, backward."""
    device = x.device
    if method == "ddcl":
        readout = DDCLReadout(args.codes, args.dim, temperature=float(args.dim), init="normal",
                              check_finite=False).to(device)

        def loss_fn(z: Tensor) -> Tensor:
            out = readout(z)
            return out.pooled.square().mean() + out.slots.square().mean() + out.loss
    else:
        pool = (SelfAttentionPool if method == "attn" else QueryPool)(args.dim, args.heads).to(device)

        def loss_fn(z: Tensor) -> Tensor:
            return pool(z).square().mean()

    def step() -> None:
        loss_fn(x.detach().requires_grad_(True)).backward()

    return step


def prepare(length: int, args: argparse.Namespace, device: torch.device) -> dict[str, Callable[[], None]]:
    """A warmed-up step of every method on the same tokens ``(B, T, D)``."""
    torch.manual_seed(0)
    x = torch.randn(args.batch_size, length, args.dim, device=device)
    steps = {m: make_step(m, args, x) for m in args.methods}
    for step in steps.values():
        for _ in range(args.warmup):
            step()
    sync(device)
    return steps


def _ratio(a: float, b: float) -> str:
    return f"{a / b:.1f}x" if b > 0 else "n/a"  # memory rises below the page granularity read as 0


def format_table(rows: list[dict], methods: list[str], with_memory: bool) -> str:
    others = [m for m in methods if m != "ddcl"]
    head = ["T"] + [f"{m} ms" for m in methods]
    head += [f"{m}/ddcl time" for m in others] if "ddcl" in methods else []
    if with_memory:
        head += [f"{m} MiB" for m in methods] + ([f"{m}/ddcl MiB" for m in others] if "ddcl" in methods else [])
    cells = []
    for row in rows:
        ms, mib = row["ms"], row.get("peak_mib", {})
        line = [str(row["T"])] + [f"{ms[m]:.1f}" for m in methods]
        line += [_ratio(ms[m], ms["ddcl"]) for m in others] if "ddcl" in methods else []
        if with_memory:
            line += [f"{mib[m]:.1f}" for m in methods]
            line += [_ratio(mib[m], mib["ddcl"]) for m in others] if "ddcl" in methods else []
        cells.append(line)
    return markdown_table(head, cells)


def growth_check(rows: list[dict], methods: list[str]) -> tuple[str, bool]:
    """The lines reporting t(4096) / t(512) per method, and whether DDCL's ratio passes (True if not measured)."""
    by_t = {row["T"]: row["ms"] for row in rows}
    if 512 not in by_t or 4096 not in by_t:
        return "t(4096)/t(512): not measured (both T = 512 and T = 4096 are needed)", True
    lines, passed = [], True
    for m in methods:
        ratio = by_t[4096][m] / by_t[512][m]
        if m == "ddcl":
            passed = ratio <= LINEAR_LIMIT
            verdict = f"{'PASS' if passed else 'FAIL'} (limit {LINEAR_LIMIT:g}; 8 = linear, 64 = quadratic)"
        else:
            verdict = "(for comparison)"
        lines.append(f"t(4096)/t(512) {m}: {ratio:.2f} {verdict}")
    return "\n".join(lines), passed


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--lengths", type=int, nargs="+", default=[256 * 2**i for i in range(7)],
                        help="sequence lengths T to sweep (default 256..16384)")
    parser.add_argument("--batch-size", type=int, default=2, help="B, sequences per step (default 2)")
    parser.add_argument("--dim", type=int, default=64, help="D, token dimension (default 64)")
    parser.add_argument("--codes", type=int, default=64, help="K, DDCL prototypes (default 64)")
    parser.add_argument("--heads", type=int, default=4, help="attention heads of the baselines (default 4)")
    parser.add_argument("--methods", nargs="+", choices=METHODS, default=list(METHODS), help="readouts to time")
    parser.add_argument("--reps", type=int, default=5, help="timed rounds per T (default 5)")
    parser.add_argument("--warmup", type=int, default=1, help="untimed steps per method first (default 1)")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu",
                        help="device (default: cuda if available, else cpu)")
    parser.add_argument("--no-memory", action="store_true", help="skip the peak-memory measurement")
    parser.add_argument("--out", type=Path, help="also write the printed report (markdown) to this file")
    parser.add_argument("--json", type=Path, metavar="FILE", help="also write the results as JSON to FILE")
    args = parser.parse_args(argv)
    if min(args.lengths + [args.batch_size, args.dim, args.codes, args.heads, args.reps]) < 1 or args.warmup < 0:
        parser.error("--lengths, --batch-size, --dim, --codes, --heads and --reps must be positive")
    if args.dim % args.heads:
        parser.error(f"--dim ({args.dim}) must be a multiple of --heads ({args.heads})")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    device = torch.device(args.device)
    header = (f"torch {torch.__version__}, device {device}, threads {torch.get_num_threads()}, B={args.batch_size}, "
              f"D={args.dim}, K={args.codes}, heads={args.heads}; median of {args.reps} interleaved fwd+bwd steps")
    print(header)
    rows = sweep("T", args.lengths, lambda length: prepare(length, args, device), args.reps, device,
                 not args.no_memory)
    check, passed = growth_check(rows, args.methods)
    report = "\n".join([header, "", format_table(rows, args.methods, not args.no_memory), "",
                        "methods: " + "; ".join(f"{m} = {LABELS[m]}" for m in args.methods), "", check])
    print("\n" + report)
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(f"Regenerate: `{study_command('eval.bench_readout', argv)}`\n\nCode: {code_commit()}\n\n"
                            f"{report}\n")
    if args.json:
        args.json.write_text(json.dumps({"device": str(device), "args": {k: str(v) for k, v in vars(args).items()},
                                         "rows": rows, "passed": passed}, indent=2))
    return 0 if passed else 1


if __name__ == "__main__":
    sys.exit(main())
