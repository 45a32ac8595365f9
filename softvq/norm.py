"""Per-dimension moments of a batch of tokens over every process's rows: what the token standardiser
(:class:`softvq.parts.TokenStandardizer`) and the model-side standardisation of :mod:`softvq.models` estimate their
statistics from, so that ``N`` processes standardise as one process with all their rows.
"""

from __future__ import annotations

import torch
from torch import Tensor

from softvq._collectives import all_reduce_sum, all_reduce_sum_


def batch_moments(x: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    """Per-column mean and biased variance of ``x (N, D)`` over every process's rows, and the total row count (a
    ``()`` int64 tensor on ``x``'s device).

    Differentiable (the sums are all-reduced with :func:`softvq.utils.all_reduce_sum`, whose backward sums the
    gradients of every process), so ``N`` processes with ``n`` rows each standardise as one process with ``N * n``.
    The count is reduced as an integer (a float32 count is exact only to 2^24) and stays on the device: reading it
    on the host would synchronise every training step.
    """
    count = all_reduce_sum_(torch.full((), x.shape[0], dtype=torch.long, device=x.device))
    acc = torch.float64 if x.dtype == torch.float32 else x.dtype  # a float32 sum of N large squares overflows
    mean = (all_reduce_sum(x.sum(0, dtype=acc)) / count).to(x.dtype)
    var = (all_reduce_sum((x - mean).square().sum(0, dtype=acc)) / count).to(x.dtype)
    return mean, var, count


def bessel(count: Tensor) -> Tensor:
    """``n / (n - 1)`` (1 for ``n <= 1``) of a ``()`` integer count, in float64 on its device: the factor that turns
    a biased variance into the unbiased one that running statistics keep."""
    n = count.to(torch.float64)
    return n / (n - 1).clamp_min(1)
