"""Each row's k largest scores: the two-stage selection against torch.topk and an argmax pass, side by side.

    python -m eval.bench_selection                                  # N = 8192 rows, K = 4096 .. 65536, k = 8 .. 64
    python -m eval.bench_selection --codes 16384 --k 16 --groups 4 8 16 32

What DDCL's top-k forward pass does to every block of scores (``softvq._soft_centroid``: blocks of
``max(128, 2^19 / K)`` rows on a CPU), timed over ``--tokens`` rows: ``topk`` is ``torch.topk(k, sorted=False)``,
``two-stage`` is :func:`softvq._kernels.top_k_rows` at its default group size (and at each ``--groups`` value),
``argmax`` is :func:`softvq._kernels.max_rows`, the nearest-code pass HardVQ makes over the same scores. Every
configuration runs in ``--reps`` interleaved rounds; the median is printed, with each selection checked against
``torch.topk`` (the same set of values).
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable

import torch

from eval._bench import markdown_table
from softvq._kernels import max_rows, selection_group, top_k_rows


def timed(steps: dict[str, Callable[[], object]], reps: int) -> dict[str, float]:
    """Median ms of every step over ``reps`` interleaved rounds."""
    times: dict[str, list[float]] = {name: [] for name in steps}
    for _ in range(reps):
        for name, step in steps.items():
            start = time.perf_counter()
            step()
            times[name].append((time.perf_counter() - start) * 1e3)
    return {name: statistics.median(t) for name, t in times.items()}


def main(argv: list[str] | None = None) -> list[list[str]]:
    p = argparse.ArgumentParser(prog="python -m eval.bench_selection", description=__doc__.split("\n\n")[0])
    p.add_argument("--tokens", type=int, default=8192)
    p.add_argument("--codes", type=int, nargs="+", default=[4096, 16384, 65536])
    p.add_argument("--k", type=int, nargs="+", default=[8, 16, 32, 64])
    p.add_argument("--groups", type=int, nargs="*", default=[], help="also these group sizes")
    p.add_argument("--reps", type=int, default=5)
    args = p.parse_args(argv)
    if min(args.tokens, args.reps, *args.codes, *args.k) < 1:
        p.error("--tokens, --reps, --codes and --k must be positive")
    print(f"torch {torch.__version__}, threads {torch.get_num_threads()}, {args.tokens} rows, median of {args.reps}")
    rows = []
    for num_codes in args.codes:
        block = max(128, (1 << 19) // num_codes)
        s = torch.randn(min(block, args.tokens), num_codes, generator=torch.Generator().manual_seed(num_codes))
        blocks = max(1, args.tokens // s.shape[0])
        for k in args.k:
            if k >= num_codes:
                continue
            steps: dict[str, Callable[[], object]] = {
                "topk": lambda s=s, k=k, n=blocks: [s.topk(k, dim=1, sorted=False) for _ in range(n)],
                "two-stage": lambda s=s, k=k, n=blocks: [top_k_rows(s, k) for _ in range(n)],
                "argmax": lambda s=s, n=blocks: [max_rows(s) for _ in range(n)]}
            for g in args.groups:
                steps[f"G={g}"] = lambda s=s, k=k, g=g, n=blocks: [top_k_rows(s, k, g) for _ in range(n)]
            ms = timed(steps, args.reps)
            exact = torch.equal(top_k_rows(s, k)[0].sort(1).values, s.topk(k, dim=1).values.sort(1).values)
            rows.append([str(num_codes), str(k), str(selection_group(num_codes, k)), f"{ms['topk']:.1f}",
                         f"{ms['two-stage']:.1f}", f"{ms['argmax']:.1f}", f"{ms['topk'] / ms['two-stage']:.2f}x",
                         f"{ms['two-stage'] / ms['argmax']:.2f}x", "yes" if exact else "NO"]
                        + [f"{ms[f'G={g}']:.1f}" for g in args.groups])
    print(markdown_table(["K", "k", "G", "topk ms", "two-stage ms", "argmax ms", "topk / two-stage",
                          "two-stage / argmax", "same set"] + [f"G={g} ms" for g in args.groups], rows))
    return rows


if __name__ == "__main__":
    main()
