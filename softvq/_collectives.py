"""torch.distributed helpers, no-ops in a single process: sums (in place, or differentiable), broadcasts, and rows
drawn from the tokens of every process together."""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.distributed as dist
from torch import Tensor


def is_distributed() -> bool:
    return dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1


def all_reduce_sum_(tensor: Tensor) -> Tensor:
    """In-place sum across processes when running distributed; a no-op otherwise."""
    if is_distributed():
        dist.all_reduce(tensor, op=dist.ReduceOp.SUM)
    return tensor


def broadcast_(tensor: Tensor, src: int = 0) -> Tensor:
    """In-place broadcast from ``src`` when running distributed, so every rank holds the same values."""
    if is_distributed():
        dist.broadcast(tensor, src=src)
    return tensor


class _AllReduceSum(torch.autograd.Function):
    """Sum across processes whose gradient is the sum across processes of the incoming gradients."""

    @staticmethod
    def forward(ctx, tensor: Tensor) -> Tensor:  # type: ignore[override]
        out = tensor.clone(memory_format=torch.contiguous_format)
        dist.all_reduce(out, op=dist.ReduceOp.SUM)
        return out

    @staticmethod
    def backward(ctx, grad: Tensor) -> Tensor:  # type: ignore[override]
        return _AllReduceSum.apply(grad)


def all_reduce_sum(tensor: Tensor) -> Tensor:
    """Differentiable sum across processes (a copy); ``tensor`` itself when not distributed.

    Its backward sums the gradients of every process: with DDP averaging parameter gradients, a statistic built
    from it gets the gradient of the mean of all processes' losses, as one process with all the batches would.
    """
    return _AllReduceSum.apply(tensor) if is_distributed() else tensor


@torch.no_grad()
def random_tokens(z: Tensor, k: int) -> tuple[Tensor, bool | Tensor]:
    """``k`` rows of the tokens ``z (N, D)`` of all processes together, drawn uniformly with replacement, and whether
    there were any tokens at all (the rows are then zeros): a ``bool`` in one process, a ``()`` bool tensor under
    ``torch.distributed`` (where the count is known only on the device).

    No host-device synchronisation: the draw is ``floor(u * n)`` for ``u ~ U[0, 1)`` with the token count ``n`` a
    tensor. Under ``torch.distributed`` ``n`` is the sum over processes, the rows index the concatenation of every
    process's ``z`` in rank order, rank 0's draw is the one used (every process draws, so their random states stay in
    step), and the picked rows reach every process by one all-reduce of ``(k, D)`` values. The result equals a single
    process's draw on ``torch.cat(zs)`` with the same random state.
    """
    u = torch.rand(k, device=z.device, dtype=torch.float32 if z.device.type == "mps" else torch.float64)
    if not is_distributed():
        n = z.shape[0]
        if n == 0:
            return z.new_zeros(k, z.shape[1]), False
        return z[(u * n).long().clamp_(max=n - 1)], True
    sizes = _process_sizes(z)
    total = sizes.sum()
    index = broadcast_((u * total).long().clamp_(max=(total - 1).clamp_(min=0)))
    return _rows_of_all(z, index, sizes), total > 0


@torch.no_grad()
def pick_tokens(z: Tensor, draw: Callable[[int], Tensor]) -> Tensor | None:
    """Rows ``draw(n)`` of the tokens ``z (N, D)`` of all processes together; ``None`` if there are none.

    ``draw`` maps the total token count to a 1-D tensor of row indices (e.g. ``torch.randperm(n)[:k]``). Under
    ``torch.distributed`` the rows index the concatenation of every process's ``z`` in rank order, rank 0's draw is
    the one used, and the picked rows reach every process by one all-reduce of ``(len(rows), D)`` values (the batches
    themselves are not gathered). Every process calls ``draw`` once, so their random states stay in step. The result
    equals ``torch.cat(zs)[draw(sum(n))]`` in a single process holding all the batches, with the same random state.
    """
    if not is_distributed():
        return z[draw(z.shape[0])] if z.shape[0] else None
    sizes = _process_sizes(z)
    total = int(sizes.sum())
    if total == 0:
        return None
    return _rows_of_all(z, broadcast_(draw(total).to(device=z.device, dtype=torch.long).contiguous()), sizes)


def _process_sizes(z: Tensor) -> Tensor:
    """``(world,)`` every process's token count (one all-reduce)."""
    sizes = torch.zeros(dist.get_world_size(), dtype=torch.long, device=z.device)
    sizes[dist.get_rank()] = z.shape[0]
    return all_reduce_sum_(sizes)


def _rows_of_all(z: Tensor, index: Tensor, sizes: Tensor) -> Tensor:
    """Rows ``index`` (the same on every process) of the concatenation of every process's ``z`` in rank order, on
    every process: each takes the rows it holds and one all-reduce of ``(len(index), D)`` values adds them up (every
    row is non-zero on exactly one process). No data-dependent shape, no host sync."""
    local = index - sizes[: dist.get_rank()].sum()
    mine = (local >= 0) & (local < z.shape[0])
    rows = z[local.clamp(0, max(z.shape[0] - 1, 0))] if z.shape[0] else z.new_zeros(index.shape[0], z.shape[1])
    return all_reduce_sum_(torch.where(mine[:, None], rows, torch.zeros_like(rows)))


@torch.no_grad()
def codes_from_tokens(z: Tensor, k: int, dtype: torch.dtype) -> Tensor | None:
    """``k`` random rows of the tokens ``z (N, D)`` of all processes together, in ``dtype``: distinct rows when
    there are at least ``k``, else drawn with replacement and jittered by 1e-3 of their standard deviation, so that
    no two coincide; ``None`` when there are no tokens. The codes every process gets are the ones a single process
    would draw from the concatenated batches (:func:`pick_tokens`); no synchronisation in one process (whether to
    draw with replacement is decided on the token count, a shape)."""
    with_replacement = []

    def draw(n: int) -> Tensor:
        with_replacement.append(n < k)
        return torch.randperm(n, device=z.device)[:k] if n >= k else torch.randint(n, (k,), device=z.device)

    chosen = pick_tokens(z, draw)
    if chosen is None:
        return None
    chosen = chosen.to(dtype)
    if with_replacement[0]:
        spread = chosen.std() if k > 1 else chosen.abs().mean()
        chosen = broadcast_(chosen + torch.randn_like(chosen) * 1e-3 * spread.clamp_min(1e-6))
    return chosen
