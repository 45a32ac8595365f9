"""DDCL's first training batch (data initialisation and temperature calibration) against a later step, and the
calibrated temperature against the bisection the calibration replaced.

    OMP_NUM_THREADS=1 python -m eval.bench_calibration --codes 1024 4096 16384   # N = 8192 tokens, D = 64
    python -m eval.bench_calibration --codes 16384 --later 5 --no-reference         # timing only

For each K, a fresh ``softvq.DDCLQuantizer(K, dim)`` in training mode steps (forward + backward) on N standard normal
tokens: the first batch once, then the median of ``--later`` later steps. The layer's call of
``softvq.parts.calibration.calibrate_temperature`` (by its name in ``softvq.parts.temperature``) is wrapped to keep
its inputs (the strided sample of at most ~4096 standardised tokens, the prototypes drawn from them, the target
log(K) / 2), its ``T`` and its time; the reference is
the calibration before it, written out here (:func:`bisection_temperature`: 34 halvings of log T in float64 over the
same float32 distances), run on those inputs. The table: both times, their ratio, the calibration's time, the
bisection's, and ``T / T_bisection - 1``.

What was tried (float32 calibration inputs; T errors against the bisection with 60 halvings; times of the
calibration alone, one thread of a shared 2-core AMD EPYC, other jobs running):

| method | T error, DDCL first batch K = 1024 / 4096 / 16384 | worst T error, 45 cases | time K = 16384 |
|---|---|---|---|
| 34-halving bisection, float64 (before) | 5e-11 / 4e-10 / 2e-10 | - | 94 s |
| Newton in log T, float32, float64 row sums, 16 steps on 256, 3 on 4096 tokens | 3e-8 / 2e-8 / 8e-9 | 7.9e-8 | 1.54 s |
| same, in blocks of 1 MiB of rows (8 MiB above) | same | same | 1.15 s |
| same, row sums in float32 (rows summed in float64) | 4e-8 / 1e-8 / 7e-9 | - | 0.97 s |
| same, bracket from the moments (no pass over the (n, K) distances) | 4e-8 / 1e-8 / 7e-9 | 7.0e-8 | 0.69 s |
| same, 2 steps on all tokens | - | 2.7e-4 | - |
| same, 4 steps on all tokens (the default) | 2e-8 / 9e-9 / 2e-8 | 6.5e-8 | 0.82 s |
| 12 Newton steps on all 4096 tokens (no coarse level) | - | 6.7e-8 | 2.1x the default's |
| 8 Newton steps on all 4096 tokens | - | 4.4e-4 | - |
| the default on 1024 / 512 / 256 strided tokens only | - | 0.12 / 0.22 / 0.26 (median 0.7% / 0.6% / 1.1%) | - |

The 45 cases: K = 16, 512, 4096; 4096 tokens of dimension 16, spread, clustered, codes drawn from the tokens, 3%
outliers, and spread data 1e3 from the origin; targets min(0.05, log K / 4), log(K) / 2, log K - min(0.05, log K / 10).
Where the root lies outside the bracket (two cases) both stop at its edge. Float32 arithmetic resolves the mean entropy
to about 1e-7 nats (the float32 rounding of 1 / T alone moves T by 6e-8): the stated tolerance is a relative 1e-6 in T
(``tests/test_calibration.py``).
"""

from __future__ import annotations

import argparse
import math
import statistics
import time

import torch

import softvq
import softvq.parts.temperature as temperature_module
from eval._bench import markdown_table, sync
from softvq._kernels import squared_distances
from softvq._soft_centroid import softmax_floor


def bisection_temperature(z: torch.Tensor, prototypes: torch.Tensor, target_entropy: float,
                          halvings: int = 34) -> torch.Tensor:
    """The calibration before (softvq up to this benchmark): bisection of log T over T in [1e-6, 1e3] times the
    mean squared distance, in float64 arithmetic over the float32 distances of the tokens and prototypes centred on
    the prototypes' mean, the logits floored at the float64 softmax floor; ``halvings`` of them."""
    center = prototypes.mean(0)
    d = squared_distances(z - center, prototypes - center).to(torch.float64)
    scale = d.mean(1).mean().clamp_min(1e-12)
    lo, hi = torch.log(scale * 1e-6), torch.log(scale * 1e3)
    for _ in range(halvings):
        mid = 0.5 * (lo + hi)
        x = d * -torch.exp(-mid)
        x = (x - x.amax(1, keepdim=True)).clamp_(min=softmax_floor(x.dtype))
        logq = torch.log_softmax(x, dim=1)
        above = -(logq.exp() * logq).sum() / d.shape[0] > target_entropy
        hi = torch.where(above, mid, hi)
        lo = torch.where(above, lo, mid)
    return torch.exp(0.5 * (lo + hi))


class CalibrationSpy:
    """Wraps ``calibrate_temperature`` as ``softvq.parts.temperature`` names it, while active: keeps its inputs, its
    ``T`` and its time (the temperature part looks the name up in that module at each call)."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.calls: list[dict] = []

    def __enter__(self) -> CalibrationSpy:
        self.original = temperature_module.calibrate_temperature

        def spy(z: torch.Tensor, prototypes: torch.Tensor, target_entropy: float, top_k: int = 0) -> torch.Tensor:
            sync(self.device)
            start = time.perf_counter()
            t = self.original(z, prototypes, target_entropy, top_k)
            sync(self.device)
            self.calls.append({"z": z.clone(), "prototypes": prototypes.clone(), "target": target_entropy,
                               "t": t.clone(), "seconds": time.perf_counter() - start})
            return t

        temperature_module.calibrate_temperature = spy
        return self

    def __exit__(self, *exc: object) -> None:
        temperature_module.calibrate_temperature = self.original


def measure(num_codes: int, args: argparse.Namespace, device: torch.device) -> dict:
    torch.manual_seed(args.seed)
    layer = softvq.DDCLQuantizer(num_codes, args.dim).to(device).train()
    z = torch.randn(args.tokens, args.dim, device=device)

    def step() -> float:
        x = z.clone().requires_grad_(True)
        sync(device)
        start = time.perf_counter()
        out = layer(x)
        (out.quantized.square().mean() + out.loss).backward()
        sync(device)
        return time.perf_counter() - start

    with CalibrationSpy(device) as spy:
        first = step()
    if len(spy.calls) != 1:
        raise RuntimeError(f"expected one calibration on the first batch, saw {len(spy.calls)}")
    later = statistics.median(step() for _ in range(args.later))
    call = spy.calls[0]
    row = {"K": num_codes, "first_s": first, "later_s": later, "calibration_s": call["seconds"],
           "T": float(call["t"]), "sample": tuple(call["z"].shape)}
    if args.reference:
        start = time.perf_counter()
        ref = float(bisection_temperature(call["z"], call["prototypes"], call["target"]))
        sync(device)
        row.update(bisection_s=time.perf_counter() - start, T_bisection=ref, error=row["T"] / ref - 1)
    return row


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--codes", type=int, nargs="+", default=[1024, 4096, 16384], help="K values")
    parser.add_argument("--tokens", type=int, default=8192, help="tokens per batch (N)")
    parser.add_argument("--dim", type=int, default=64, help="token dimension (D)")
    parser.add_argument("--later", type=int, default=3, help="later steps timed (their median is reported)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--reference", action=argparse.BooleanOptionalAction, default=True,
                        help="also run the 34-halving float64 bisection on the same inputs (94 s at K = 16384, one "
                             "thread)")
    parser.add_argument("--device", default="cpu")
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    device = torch.device(args.device)
    print(f"DDCLQuantizer(K, {args.dim}), N = {args.tokens} tokens, training mode, forward + backward; "
          f"{torch.get_num_threads()} thread(s), {device}")
    rows = []
    for k in args.codes:
        row = measure(k, args, device)
        rows.append(row)
        print(f"  K={k}: first {row['first_s']:.3f} s, later {row['later_s']:.3f} s, calibration "
              f"{row['calibration_s']:.3f} s on {row['sample'][0]} tokens", flush=True)
    head = ["K", "first batch s", f"later step s (median of {args.later})", "first / later", "calibration s"]
    if args.reference:
        head += ["old bisection s", "T", "T / T_bisection - 1"]
    table = []
    for r in rows:
        cells = [str(r["K"]), f"{r['first_s']:.3f}", f"{r['later_s']:.3f}", f"{r['first_s'] / r['later_s']:.2f}x",
                 f"{r['calibration_s']:.3f}"]
        if args.reference:
            cells += [f"{r['bisection_s']:.1f}", f"{r['T']:.8g}", f"{r['error']:.1e}"]
        table.append(cells)
    print(markdown_table(head, table))
    worst = max((abs(r["error"]) for r in rows), default=0.0) if args.reference else math.nan
    if args.reference:
        print(f"largest |T / T_bisection - 1|: {worst:.1e}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
