"""Distance kernels: squared distances of tokens to a codebook in one matmul, and a row-wise max with its index that
is fast on a CPU."""

from __future__ import annotations

import torch
from torch import Tensor


def squared_distances(z: Tensor, codebook: Tensor) -> Tensor:
    """``||z_n - e_k||^2`` for ``z (N, D)`` and ``codebook (K, D)`` with one matmul: ``(N, K)``, clamped at 0.

    The expansion ``|z|^2 - 2 z.e + |e|^2`` cancels badly when both sides sit far from the origin: callers centre
    them first (e.g. on the codebook's mean), which changes no distance.
    """
    d = torch.addmm(codebook.square().sum(1), z, codebook.t(), alpha=-2.0)
    return d.add_(z.square().sum(1, keepdim=True)).clamp_(min=0.0)


_BLOCK = 32


def max_rows(x: Tensor, largest: bool = True) -> tuple[Tensor, Tensor]:
    """``x.max(1)`` (``largest=False``: ``x.min(1)``) of an ``(N, K)`` matrix: the values and the first index of each
    row's extreme, the same result, faster on a CPU.

    Why by hand: on a CPU torch's reductions that return an index run about 15x slower than the value-only ones here
    (2.0 ms against 0.14 ms at 8192 x 512), so the rows are split in blocks of 32: the blocks' extremes (value-only),
    the first block holding the row's extreme (an index reduction over K / 32 entries) and the first position inside
    it (over 32). Elsewhere, and when ``K`` is not a multiple of 32, it is ``x.max(1)`` itself.
    """
    n, k = x.shape
    if x.device.type != "cpu" or k % _BLOCK or k < 2 * _BLOCK:
        return x.max(1) if largest else x.min(1)
    blocks = x.view(n, k // _BLOCK, _BLOCK)
    extremes = blocks.amax(2) if largest else blocks.amin(2)  # (N, K / 32)
    values, block = extremes.max(1) if largest else extremes.min(1)
    inside = blocks[torch.arange(n, device=x.device), block]  # (N, 32) the block of each row's extreme
    return values, block * _BLOCK + (inside.argmax(1) if largest else inside.argmin(1))
