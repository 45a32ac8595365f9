"""Input validation and small distributed helpers shared by the quantizers and metrics."""

from __future__ import annotations

import math
import numbers
from collections.abc import Callable
from typing import Any

import numpy as np
import torch
import torch.distributed as dist
from torch import Tensor

from softvq.types import QuantizerOutput


def _is_integer(value: object) -> bool:
    """An integer of any integral type (``int``, ``numpy.int64``, ...), not a bool."""
    return isinstance(value, numbers.Integral) and not isinstance(value, bool)


def check_positive_int(name: str, value: int) -> int:
    """``value`` as a plain ``int`` if it is an integer >= 1 (numpy integers too, bools not), else a ValueError."""
    if not _is_integer(value) or value < 1:
        raise ValueError(f"{name} must be a positive integer, got {value!r}")
    return int(value)


def check_non_negative_int(name: str, value: int) -> int:
    """``value`` as a plain ``int`` if it is an integer >= 0 (numpy integers too, bools not), else a ValueError."""
    if not _is_integer(value) or value < 0:
        raise ValueError(f"{name} must be a non-negative integer, got {value!r}")
    return int(value)


def check_float(name: str, value: float, *, allow_zero: bool = False) -> float:
    """A finite float that is > 0 (or >= 0 with ``allow_zero``), else a ValueError naming ``name`` and ``value``."""
    kind = "non-negative" if allow_zero else "positive"
    if isinstance(value, bool | np.bool_):  # float(True) is 1.0: a flag passed where a number belongs
        raise ValueError(f"{name} must be a {kind} finite number, got {value!r}")
    try:
        value_f = float(value)
    except (TypeError, ValueError):
        raise ValueError(f"{name} must be a {kind} finite number, got {value!r}") from None
    if not math.isfinite(value_f) or value_f < 0 or (value_f == 0 and not allow_zero):
        raise ValueError(f"{name} must be a {kind} finite number, got {value!r}")
    return value_f


def check_bool(name: str, value: object) -> bool:
    """``value`` if it is ``True`` or ``False`` (not 0, 1 or None), else a ValueError."""
    if not isinstance(value, bool):
        raise ValueError(f"{name} must be True or False, got {value!r}")
    return value


def check_unit(name: str, value: float) -> float:
    """A float strictly inside (0, 1), else a ValueError."""
    value_f = check_float(name, value)
    if not value_f < 1.0:
        raise ValueError(f"{name} must be in (0, 1), got {value!r}")
    return value_f


def check_choice(name: str, value: str, choices: tuple[str, ...]) -> str:
    if value not in choices:
        raise ValueError(f"{name} must be one of {choices}, got {value!r}")
    return value


def max_token_magnitude(dim: int, dtype: torch.dtype, temperature: float = 1.0) -> float:
    """The largest ``|z_i|`` for which the squared distances of ``dim``-dimensional tokens (and, divided by a
    ``temperature`` below 1, the Boltzmann logits) cannot overflow in the compute dtype of ``dtype``.

    With every coordinate of the tokens and the codes at most ``M`` in magnitude, the quantizers centre both on the
    codes' mean (coordinates up to ``2M``) and expand ``|z|^2 - 2 z.e + |e|^2``: each partial sum is at most
    ``4 D M^2 + 8 D M^2 + 4 D M^2 = 16 D M^2``. Requiring ``16 D M^2 / min(1, T) <= finfo.max`` gives
    ``M = sqrt(finfo.max * min(1, T) / (16 D))`` (about ``1.6e18`` for float32 and ``D = 8``).
    """
    finfo = torch.finfo(compute_dtype(dtype))
    return math.sqrt(finfo.max * min(1.0, temperature) / (16.0 * dim))


def flatten_tokens(z: Tensor, dim: int, check_finite: bool = True, temperature: float = 1.0) -> Tensor:
    """Validate channel-last tokens ``(..., dim)`` and flatten them to ``(N, dim)``.

    With ``check_finite``, NaN/Inf and finite tokens too large for the squared distances to be computed
    (:func:`max_token_magnitude`; pass the Boltzmann ``temperature`` when it divides them) raise a ValueError, except
    inside ``torch.compile`` (the check is one device synchronisation per call and would break the graph).
    """
    if not isinstance(z, Tensor):
        raise TypeError(f"expected a torch.Tensor of shape (..., {dim}), got {type(z).__name__}")
    if z.ndim == 0 or z.shape[-1] != dim:
        raise ValueError(
            f"expected channel-last tokens of shape (..., {dim}), got shape {tuple(z.shape)}; "
            f"the last dimension is the space in which to quantize (move channels last, "
            f"e.g. einops.rearrange(z, 'b d h w -> b h w d'))"
        )
    if not z.is_floating_point():
        raise ValueError(f"expected a floating-point tensor, got dtype {z.dtype}")
    # Under torch.compile the check is skipped: it needs the value on the host (a graph break and a device sync per
    # call), so a compiled layer leaves it to the model (softvq.models.VQVAE checks its latents every step).
    if check_finite and z.numel() > 0 and not torch.compiler.is_compiling():
        largest = float(z.detach().abs().amax())  # one reduction and one sync: NaN and Inf propagate into it
        if not math.isfinite(largest):
            bad = int((~torch.isfinite(z)).sum())
            raise ValueError(f"z contains {bad} non-finite value(s) (NaN or Inf) out of {z.numel()}")
        limit = max_token_magnitude(dim, z.dtype, temperature)
        if largest > limit:
            raise ValueError(f"z has a value of magnitude {largest:.3g}, above {limit:.3g}, the largest whose squared "
                             f"distances over {dim} dimensions fit in {compute_dtype(z.dtype)}; rescale the tokens")
    return z.reshape(-1, dim)


def check_finite_state(state_dict: dict[str, Any], prefix: str, layer: str) -> None:
    """A ValueError naming the first floating-point tensor under ``prefix`` in a state dict being loaded that holds
    NaN or Inf (a layer's state is finite after any sequence of finite training batches, so such a file is corrupt:
    loading it would make evaluation return NaN codes and index 0 everywhere). Loading is not a training step: the
    check's host read costs nothing per step."""
    for key, value in state_dict.items():
        if key.startswith(prefix) and isinstance(value, Tensor) and value.is_floating_point() and value.numel() > 0:
            bad = int((~torch.isfinite(value)).sum())
            if bad:
                raise ValueError(f"{layer} state {key!r} holds {bad} non-finite value(s) (NaN or Inf) out of "
                                 f"{value.numel()}; the checkpoint is corrupt, refused")


def check_indices(indices: Tensor, num_codes: int) -> None:
    if not isinstance(indices, Tensor) or indices.dtype not in (torch.int64, torch.int32, torch.int16,
                                                                  torch.int8, torch.uint8):
        raise ValueError(f"indices must be an integer tensor, got {getattr(indices, 'dtype', type(indices))}")
    if indices.numel() > 0:
        lo, hi = int(indices.min()), int(indices.max())
        if lo < 0 or hi >= num_codes:
            raise ValueError(f"indices must lie in [0, {num_codes}), got values in [{lo}, {hi}]")


def squared_distances(z: Tensor, codebook: Tensor) -> Tensor:
    """``||z_n - e_k||^2`` for ``z (N, D)`` and ``codebook (K, D)`` with one matmul: ``(N, K)``, clamped at 0.

    The expansion ``|z|^2 - 2 z.e + |e|^2`` cancels badly when both sides sit far from the origin: callers centre
    them first (e.g. on the codebook's mean), which changes no distance.
    """
    d = torch.addmm(codebook.square().sum(1), z, codebook.t(), alpha=-2.0)
    return d.add_(z.square().sum(1, keepdim=True)).clamp_(min=0.0)


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


_BLOCK = 32


@torch.no_grad()
def restart_dead_codes_(codebook: Tensor, usage: Tensor, z: Tensor, threshold: float | Tensor) -> Tensor:
    """Replace the rows of ``codebook (K, D)`` whose running ``usage (K,)`` is below ``threshold`` by random tokens of
    ``z (N, D)`` and set their usage to ``threshold``; returns the ``(K,)`` mask of restarted rows. Nothing is
    restarted while ``usage`` still holds the -1 of "no batch seen yet", or when there are no tokens.

    Without a host-device synchronisation (no ``.item()``, no data-dependent shape): every code draws a candidate
    token (:func:`random_tokens`) and the dead ones take theirs, so a GPU step never waits on the CPU and
    ``torch.compile`` traces it whole. Under ``torch.distributed`` the tokens are drawn from every process's batch
    together, so the result is the same on every process and equals a single process's restart on the concatenated
    batch with rank 0's random state.
    """
    rows, any_token = random_tokens(z, codebook.shape[0])
    dead = (usage < threshold) & (usage >= 0).all()  # usage is summed across processes: every process agrees
    if any_token is False:
        return torch.zeros_like(dead)
    if any_token is not True:
        dead &= any_token
    codebook.copy_(torch.where(dead[:, None], rows.to(codebook.dtype), codebook))
    usage.copy_(torch.where(dead, threshold, usage))
    return dead


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


def empty_output(z: Tensor, num_codes: int, anchor: Tensor, term_names: tuple[str, ...]) -> QuantizerOutput:
    """What a quantizer returns for zero tokens: empty tensors of the right shapes and a zero loss that is still
    connected to ``anchor`` (a parameter or buffer), so ``loss.backward()`` works."""
    lead = z.shape[:-1]
    ctype = compute_dtype(z.dtype)
    zero = (anchor.sum() * 0.0).to(ctype)
    terms = {k: torch.zeros((), dtype=ctype, device=z.device) for k in term_names}
    return QuantizerOutput(
        quantized=z.clone(),
        indices=torch.zeros(lead, dtype=torch.long, device=z.device),
        probs=z.new_zeros((*lead, num_codes), dtype=ctype),
        loss=zero,
        terms=terms,
    )


_LOW_PRECISION = (torch.float16, torch.bfloat16)


def apply_keeping_precision(module: torch.nn.Module, apply: Callable[[], object],
                            float64: tuple[str, ...] = ()) -> None:
    """Run ``apply()`` (``nn.Module._apply``: ``.to()``, ``.half()``, ``.bfloat16()``, ``.cuda()``, ...) on a
    quantizer and keep its state in full precision: every floating tensor of ``module`` and its submodules that the
    call turned into float16 or bfloat16 becomes float32 again, from its value before the call (so nothing is
    rounded), on the new device; the buffers named in ``float64`` (dotted names) keep their float64 value whatever
    the call does. Device moves and float32 / float64 casts are kept as they are.

    Why: a quantizer's state moves by small steps (an EMA step of 1% of a count, a running moment), below the
    resolution of a 16-bit float, so a bf16 codebook stops moving; its arithmetic runs in float32 anyway
    (:func:`compute_dtype`), so a 16-bit copy of the state would save nothing.
    """
    before = {}
    for prefix, sub in module.named_modules():
        for kind in ("_parameters", "_buffers"):
            for name, tensor in getattr(sub, kind).items():
                if tensor is not None and tensor.is_floating_point():
                    before[(prefix, kind, name)] = tensor.data
    apply()
    for (prefix, kind, name), old in before.items():
        sub = module.get_submodule(prefix)
        new = getattr(sub, kind)[name]
        dotted = f"{prefix}.{name}" if prefix else name
        if dotted in float64 and new.dtype != torch.float64:
            dtype = torch.float64
        elif new.dtype in _LOW_PRECISION:
            dtype = torch.float32
        else:
            continue
        restored = old.to(device=new.device, dtype=dtype)
        if kind == "_parameters":
            new.data = restored  # the same Parameter object: optimizers and hooks holding it stay valid
            if new.grad is not None:
                new.grad = new.grad.to(dtype)
        else:
            sub._buffers[name] = restored


def compute_dtype(dtype: torch.dtype) -> torch.dtype:
    """float64 stays float64; everything else (bf16, fp16, fp32) is computed in float32."""
    return torch.float64 if dtype == torch.float64 else torch.float32


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


def check_feature_maps(z: object, dim: int) -> None:
    """``z`` must be feature maps ``(B, dim, ...)``, as a ``channel_first`` layer takes them; else a ValueError
    naming the shape it got."""
    if not isinstance(z, Tensor) or z.ndim < 2 or z.shape[1] != dim:
        shape = tuple(z.shape) if isinstance(z, Tensor) else type(z).__name__
        raise ValueError(f"channel_first=True expects feature maps of shape (B, {dim}, ...), got {shape}")
