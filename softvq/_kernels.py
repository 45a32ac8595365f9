"""Distance kernels: squared distances of tokens to a codebook in one matmul, a row-wise max with its index that is
fast on a CPU, the nearest code of every token computed in row blocks (no ``(N, K)`` array), and each row's k largest
entries selected in two exact stages. Their measured costs: docs/scaling.md, "Throughput"."""

from __future__ import annotations

import math

import torch
from torch import Tensor


def squared_distances(z: Tensor, codebook: Tensor, *, norms: Tensor | None = None, out: Tensor | None = None) -> Tensor:
    """``||z_n - e_k||^2`` for ``z (N, D)`` and ``codebook (K, D)`` with one matmul: ``(N, K)``, clamped at 0; written
    into ``out`` when given, with the codes' squared norms ``norms (K,)`` when the caller has them (a block of rows at
    a time: :func:`nearest_codes`).

    The expansion ``|z|^2 - 2 z.e + |e|^2`` cancels badly when both sides sit far from the origin: callers centre
    them first (e.g. on the codebook's mean), which changes no distance.
    """
    norms = codebook.square().sum(1) if norms is None else norms
    d = torch.addmm(norms, z, codebook.t(), alpha=-2.0, out=out)
    return d.add_(z.square().sum(1, keepdim=True)).clamp_(min=0.0)


_BLOCK = 32


def max_rows(x: Tensor, largest: bool = True) -> tuple[Tensor, Tensor]:
    """``x.max(1)`` (``largest=False``: ``x.min(1)``) of an ``(N, K)`` matrix: the values and the first index of each
    row's extreme, the same result, faster on a CPU.

    Why by hand: on a CPU torch's reductions that return an index run far slower than the value-only ones
    (docs/scaling.md, "Throughput"), so the rows are split in blocks of 32: the blocks' extremes (value-only),
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


# The bytes of one block of scores in nearest_codes. On a CPU the block stays in cache between the matmul that writes it
# and the passes that read it, which made the search faster than the matmul writing one (N, K) array (measured:
# docs/scaling.md, "Throughput"). On an accelerator the blocks only bound the memory.
CPU_BLOCK_BYTES = 8 * 2**20
DEVICE_BLOCK_BYTES = 256 * 2**20


def block_rows(num_codes: int, dtype: torch.dtype, device: torch.device) -> int:
    """The rows of a block of scores ``(rows, num_codes)`` in ``dtype`` that fit the device's block budget (at least
    one)."""
    budget = CPU_BLOCK_BYTES if device.type == "cpu" else DEVICE_BLOCK_BYTES
    return max(1, budget // (num_codes * torch.empty((), dtype=dtype).element_size()))


@torch.no_grad()
def nearest_codes(z: Tensor, codebook: Tensor, rows: int | None = None) -> Tensor:
    """The nearest code of every token, ``(N,)`` int64: ``argmin_k ||z_n - e_k||^2`` for ``z (N, D)`` and ``codebook
    (K, D)``, the first index on a tie, as ``max_rows(squared_distances(z, codebook), largest=False)[1]`` gives it.

    Computed in blocks of ``rows`` tokens (default: :func:`block_rows`): per block the same operations on a
    ``(rows, K)`` buffer, so the extra memory is ``rows * K`` scores, never ``N * K``. The blocks' matmuls may round a
    score otherwise than one matmul over all ``N`` rows (BLAS kernels differ with the row count), so a token whose two
    nearest codes tie to the last bits may get the other one: ties aside, the indices are those of the unblocked
    computation. Inside ``torch.compile``, and when one block holds every token, it is that computation (the compiler
    fuses it; a Python loop would be unrolled into the graph). No host-device synchronisation: the blocks are slices of
    known sizes."""
    n, num_codes = z.shape[0], codebook.shape[0]
    rows = rows or block_rows(num_codes, z.dtype, z.device)
    if rows >= n or torch.compiler.is_compiling():
        return max_rows(squared_distances(z, codebook), largest=False)[1]
    norms = codebook.square().sum(1)
    out = torch.empty(n, dtype=torch.long, device=z.device)
    buffer = z.new_empty(rows, num_codes)
    for start in range(0, n, rows):
        block = z[start:start + rows]
        scores = squared_distances(block, codebook, norms=norms, out=buffer[:block.shape[0]])
        out[start:start + block.shape[0]] = max_rows(scores, largest=False)[1]
    return out


@torch.no_grad()
def nearest_k_codes(z: Tensor, codebook: Tensor, k: int) -> tuple[Tensor, Tensor]:
    """The ``k`` nearest codes of every token: their squared distances and indices, ``(N, k)`` each, in no particular
    order, for ``z (N, D)`` and ``codebook (K, D)``; computed as :func:`nearest_codes` is, a block of
    :func:`block_rows` tokens at a time (no ``(N, K)`` array), each block's ``k`` by :func:`top_k_rows`."""
    n, num_codes = z.shape[0], codebook.shape[0]
    rows = block_rows(num_codes, z.dtype, z.device)
    norms = codebook.square().sum(1)
    parts = [top_k_rows(squared_distances(z[a:a + rows], codebook, norms=norms).neg_(), k) for a in range(0, n, rows)]
    if not parts:
        return z.new_empty(0, k), torch.empty(0, k, dtype=torch.long, device=z.device)
    return torch.cat([v for v, _ in parts]).neg_(), torch.cat([i for _, i in parts])


def selection_group(num_codes: int, k: int) -> int:
    """The group size ``G`` of :func:`top_k_rows` for ``k`` of ``num_codes`` entries per row: ``sqrt(K / k)`` (which
    balances its two top-k passes, over the ``K / G`` group maxima and over the ``k G`` candidates) rounded down to a
    power of two, within ``[4, 16]``: on a CPU 16 was as fast as 32 or faster at large K (``python -m
    eval.bench_selection --groups 8 16 32``; docs/scaling.md, "Two-stage selection")."""
    target = math.sqrt(max(num_codes, 1) / max(k, 1))
    return int(min(16, max(4, 2 ** math.floor(math.log2(max(target, 1.0))))))


def top_k_rows(s: Tensor, k: int, group: int | None = None) -> tuple[Tensor, Tensor]:
    """The ``k`` largest entries of every row of ``s (n, K)`` and their columns, ``(n, k)`` each, in no particular
    order: the set ``s.topk(k, dim=1)`` returns (ties aside), at a fraction of its cost where ``K`` is large.

    Why by hand: on a CPU ``torch.topk`` over rows of ``K`` entries costs several argmax passes over them, and this
    a fraction of that from K = 16384 on (``python -m eval.bench_selection``; docs/scaling.md, "Two-stage selection").
    Here, in two stages, with ``M = K // G`` groups of ``G`` columns (``group``, default :func:`selection_group`),
    group ``j`` the columns ``j, j + M, j + 2M, ...`` (strided, so that its maximum is an elementwise max of ``G``
    contiguous slices: one vectorised, value-only pass over ``s``);
    then the ``k`` groups with the largest maxima, and the ``k`` largest among their entries. It is exact: each of
    the row's ``k`` largest entries lies in a group whose maximum is at least the ``k``-th largest value, and at most
    ``k`` groups have such a maximum (a tie there may swap an entry for an equal one). Where ``G`` does not divide
    ``K`` the last ``K - G M`` columns join groups ``0, 1, ...`` as one more member each (read as ``-inf`` by the
    other groups). Shapes depend on ``n``, ``K``, ``k`` and ``G`` only (no host-device synchronisation, nothing
    data-dependent), so it compiles with ``fullgraph=True``. Where the stages would not save work it is ``s.topk``:
    where ``k G >= K``, and by default (``group=None``) below ``K`` = 8192 with ``k`` < 32, where ``torch.topk`` was
    as fast or faster on a CPU."""
    n, num_codes = s.shape
    g = group or selection_group(num_codes, k)
    m = num_codes // max(g, 1)
    small = group is None and num_codes < 8192 and k < 32
    if small or k >= num_codes or g < 2 or k >= m or k * (g + 1) >= num_codes:
        return s.topk(k, dim=1, sorted=False)
    rest = num_codes - g * m  # 0 <= rest < m: columns g m + j join group j
    blocks = s[:, : g * m].reshape(n, g, m)  # blocks[:, a, j] = s[:, a m + j], member a of group j
    maxima = blocks.amax(1)  # (n, M): group j's maximum
    if rest:
        maxima[:, :rest] = torch.maximum(maxima[:, :rest], s[:, g * m:])
    groups = maxima.topk(k, dim=1, sorted=False).indices  # (n, k): the groups that can hold the k largest
    # member a of group j at a k + j
    candidates = blocks.gather(2, groups[:, None, :].expand(n, g, k)).reshape(n, g * k)
    if rest:  # the extra member g m + j exists for groups j below `rest` only: elsewhere -inf
        extra = s[:, g * m:].gather(1, groups.clamp(max=rest - 1)).masked_fill_(groups >= rest, float("-inf"))
        candidates = torch.cat([candidates, extra], dim=1)
    values, where = candidates.topk(k, dim=1, sorted=False)
    return values, (where // k) * m + groups.gather(1, where % k)
