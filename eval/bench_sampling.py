"""How long the prior takes to draw code grids: key/value-cached decoding against re-running the prefix each step.

    python -m eval.bench_sampling                       # the default prior (4 layers, width 256), K = 512
    python -m eval.bench_sampling --dim 128 --n 1000 --guidance 2 --threads 2

Both ways draw the same codes (``tests/test_guidance.py`` checks it); this prints their median wall time over
interleaved rounds, samples per second and the ratio, side by side in one run, and what 5,000 samples would take.
"""

from __future__ import annotations

import argparse

import torch

from eval._bench import markdown_table, time_interleaved
from softvq.models.prior import CodePrior
from softvq.models.transformer import PriorConfig


def main(argv: list[str] | None = None) -> dict[str, float]:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--num-codes", type=int, default=512)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--dim", type=int, default=256)
    p.add_argument("--n", type=int, default=256, help="grids drawn per call")
    p.add_argument("--guidance", type=float, default=1.0, help="!= 1: a conditional prior, guided (twice the batch)")
    p.add_argument("--reps", type=int, default=3)
    p.add_argument("--threads", type=int, default=None)
    p.add_argument("--device", default="cpu")
    args = p.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    device = torch.device(args.device)
    torch.manual_seed(0)
    guided = args.guidance != 1.0
    config = PriorConfig(args.num_codes, num_classes=10 if guided else 0, layers=args.layers, dim=args.dim)
    prior = CodePrior(config).to(device).eval()
    labels = (torch.arange(args.n) % 10).to(device) if guided else None

    def draw(cache: bool) -> None:
        prior.sample(args.n, labels, guidance=args.guidance, cache=cache,
                     generator=torch.Generator(device).manual_seed(0))

    ms = time_interleaved({"cached": lambda: draw(True), "uncached": lambda: draw(False)}, args.reps, device)
    rows = [[name, f"{t / 1e3:.2f}", f"{args.n / (t / 1e3):.0f}", f"{5000 / (args.n / (t / 1e3)) / 60:.1f}"]
            for name, t in ms.items()]
    print(f"prior: {args.layers} layers, width {args.dim}, K = {args.num_codes}, {config.length} positions, "
          f"{args.n} grids per call, guidance {args.guidance}, {torch.get_num_threads()} threads, {device}")
    print(markdown_table(["sampling", "s per call", "grids / s", "minutes for 5,000"], rows))
    print(f"cached / uncached speed-up: {ms['uncached'] / ms['cached']:.1f}x")
    return {**ms, "speedup": ms["uncached"] / ms["cached"]}


if __name__ == "__main__":
    main()
