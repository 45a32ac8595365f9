"""The first temperature's calibration: the ``T`` at which a batch's mean assignment entropy meets the target
(:func:`calibrate_temperature`, safeguarded Newton in log T on a fixed schedule, no host-device synchronisation), which
:meth:`softvq.parts.TemperatureControl.calibrate` runs on the first training batch
(softvq/parts/temperature.py, where ``T`` lives).
"""

from __future__ import annotations

import torch
from torch import Tensor

from softvq._collectives import all_reduce_sum_
from softvq._kernels import nearest_k_codes, squared_distances
from softvq._soft_centroid import softmax_floor

# The calibration's schedule, coarse to fine: (tokens of the sample a level sees, ``None`` for all of them; its steps of
# safeguarded Newton in log T). The coarse level finds the root for a strided subsample of 256 tokens from the middle of
# the bracket, a sixteenth of a full step's cost each (were every step a bisection, 16 of them would still leave it
# within 20.7 / 2^16 = 3e-4 of that root in log T). That root is 1% off the whole sample's in T typically, 26% at worst
# measured; Newton on the whole sample squares the error each step: two steps left up to 2.7e-4, three reached the
# float32 resolution of the entropy in every case measured, the fourth is a margin. Calibrating on 256 to 1024 tokens
# alone was 0.5-1% off typically, 12-26% at worst: measurements in eval/bench_calibration.py's docstring.
_SCHEDULE: tuple[tuple[int | None, int], ...] = ((256, 16), (None, 4))
# The rows of one block of the calibration's passes on a CPU: 1 MiB, in cache across them (faster than 256 KiB
# or 8 MiB at K = 16384).
_BLOCK_BYTES = 2**20
# The width of the calibration bracket around the mean squared distance: T in [1e-6, 1e3] times it.
_BRACKET = (1e-6, 1e3)


def _entropy_terms(d: Tensor, beta: Tensor, rows: int) -> Tensor:
    """``(sum of H, sum of dH/dlog T)`` over the tokens of ``d (n, K)`` (squared distances, each row shifted to its
    minimum 0), a float64 ``(2,)`` tensor, at ``1 / T = beta``: ``H`` the entropy of ``q ∝ exp(-beta d)`` with the
    shifted logits floored at :func:`softvq._soft_centroid.softmax_floor` as the layer's own softmax is, and
    ``dH/dlog T = Var_q(beta d)`` (the heat capacity). One ``exp`` pass in ``d``'s dtype, a block of ``rows`` rows
    at a time (on a CPU the block stays in cache across the passes); each row's sums in ``d``'s dtype (torch's
    cascade summation), the rows' in float64."""
    floor = softmax_floor(d.dtype)
    neg_beta = -beta.to(d.dtype)
    sums = [d.new_zeros(2, dtype=torch.float64)]  # a process without tokens adds nothing
    for start in range(0, d.shape[0], rows):
        x = (d[start:start + rows] * neg_beta).clamp_(min=floor)  # the shifted logits: each row's largest is 0
        e = x.exp()
        z = e.sum(1).double()  # >= 1
        m1 = e.mul_(x).sum(1).double() / z  # E_q[x]
        m2 = e.mul_(x).sum(1).double() / z  # E_q[x^2]
        sums.append(torch.stack([(z.log() - m1).sum(), (m2 - m1.square()).sum()]))
    return torch.stack(sums).sum(0)


def _newton_in_log_t(d: Tensor, count: Tensor, target_entropy: float, u: Tensor, lo0: Tensor, hi0: Tensor,
                     steps: int, rows: int) -> Tensor:
    """``steps`` steps of safeguarded Newton on ``H(u) = target_entropy`` in ``u = log T`` from ``u``, over the
    tokens of ``d`` (``count`` of them over every process; the sums all-reduced, so every process takes the same
    steps): ``u <- u - (H - H*) / (dH/du)`` while that lands inside the bracket the signs of ``H - H*`` seen so far
    leave inside ``[lo0, hi0]`` (H rises monotonically with ``u``), else the bracket's midpoint. A Newton step beyond
    ``lo0`` or ``hi0`` stops there: a root outside the bracket gives its edge, as a bisection of it would. No
    host-device synchronisation: a fixed number of steps, decisions by ``torch.where``."""
    lo, hi = lo0, hi0
    for _ in range(steps):
        sums = all_reduce_sum_(_entropy_terms(d, torch.exp(-u), rows))
        error, slope = sums[0] / count - target_entropy, sums[1] / count
        above = error > 0
        hi = torch.where(above, u, hi)
        lo = torch.where(above, lo, u)
        newton = (u - error / slope).clamp(lo0, hi0)
        inside = (slope > 0) & (newton >= lo) & (newton <= hi)  # False for a NaN
        u = torch.where(inside, newton, 0.5 * (lo + hi))
    return u


# A custom op so that torch.compile sees one opaque call instead of tracing (and compiling) the unrolled root finding:
# it runs once, on the first training batch, and tracing the bisection it replaced cost a minute of compilation on 2
# CPU cores.
@torch.library.custom_op("softvq::calibrate_temperature", mutates_args=())
def calibrate_temperature(z: Tensor, prototypes: Tensor, target_entropy: float, top_k: int = 0) -> Tensor:
    """The temperature ``T`` (a ``()`` float64 tensor) at which the mean assignment entropy of tokens ``z (n, D)``
    over ``prototypes (K, D)`` equals ``target_entropy``, summed over processes under ``torch.distributed``. With
    ``0 < top_k < K`` it is the entropy of the distribution truncated to each token's ``top_k`` nearest prototypes
    (``DDCLQuantizer(top_k=k)``'s): the distances are then computed a block of rows at a time and only each row's
    ``top_k`` smallest kept (:func:`softvq._kernels.nearest_k_codes`), so memory is ``O(n top_k)`` plus one block.

    H(Q) rises monotonically with ``u = log T``, with slope ``dH/du = Var_q(d / T)`` averaged over tokens, so the root
    is found by Newton's method in ``u``, safeguarded by bisection, inside a bracket of a factor 1e9 in ``T`` around
    the mean squared distance (``T`` in ``[1e-6, 1e3]`` times it; a root outside gives the bracket's edge). The
    distances are one matmul, in float32 (float64 for float64 tokens), each row shifted to its minimum once; each step
    is one ``exp`` pass over them, with the layer's softmax floor. :data:`_SCHEDULE`: 16 steps on a strided
    subsample of 256 tokens, then 4 on all ``n``. ``T`` equals that of the calibration before it (a 34-halving
    bisection of the same bracket in float64 arithmetic over the same float32 distances) within a relative 1e-6 (at
    most 9e-8 measured over 45 cases and DDCL's first batches at K = 1024 to 16384): float32 arithmetic resolves the
    mean entropy to about 1e-7 nats. At K = 16384, 4096 tokens, one thread: 0.7-0.85 s where the bisection took
    52-94 s (``python -m eval.bench_calibration``: DDCL's first batch 1.5x a later step there, 33-59x before). A fixed
    number of steps on tensors: no host-device synchronisation; under ``torch.distributed`` every sum is all-reduced,
    so every process takes the same steps to the same ``T``.
    """
    center = prototypes.mean(0)
    zc, pc = z - center, prototypes - center
    # (n, K), or with top_k each token's top_k nearest (n, top_k), a block of tokens at a time
    d = nearest_k_codes(zc, pc, top_k)[0] if 0 < top_k < pc.shape[0] else squared_distances(zc, pc)
    if d.dtype not in (torch.float32, torch.float64):
        d = d.float()
    n, k = d.shape
    samples = [d if m is None or m >= n else d[:: n // m] for m, _ in _SCHEDULE]  # strided rows: views of d
    # The bracket's centre, the mean squared distance over every process's tokens: centred on the prototypes' mean,
    # it is the tokens' mean |z - c|^2 plus the prototypes' (the cross term is 0), O((n + K) D) in float64. With the
    # token counts of each level, all-reduced: the same bracket and the same steps on every process.
    sums = [zc.double().square().sum()]
    sums += [torch.full((), float(sample.shape[0]), dtype=torch.float64, device=d.device) for sample in samples]
    total = all_reduce_sum_(torch.stack(sums))
    scale = (total[0] / total[-1] + pc.double().square().sum(1).mean()).clamp_min(1e-12)  # last level: all tokens
    d.sub_(d.amin(1, keepdim=True))  # each row's nearest code at 0: the logits' row maxima, once for every step
    lo0, hi0 = torch.log(scale * _BRACKET[0]), torch.log(scale * _BRACKET[1])
    rows = max(1, _BLOCK_BYTES // (k * d.element_size())) if d.device.type == "cpu" else n
    u = 0.5 * (lo0 + hi0)
    for (_, steps), sample, count in zip(_SCHEDULE, samples, total[1:], strict=True):
        u = _newton_in_log_t(sample, count, target_entropy, u, lo0, hi0, steps, rows)
    return torch.exp(u)


@calibrate_temperature.register_fake
def _(z: Tensor, prototypes: Tensor, target_entropy: float, top_k: int = 0) -> Tensor:
    return z.new_empty((), dtype=torch.float64)
