"""Argument and input validation: integers, floats, flags and choices; the bounds that keep a layer's settings finite in
float32 (a loss term's weight, a scale of its codes); channel-last tokens (finite, and small enough for their squared
distances), feature maps, code indices and the state a layer loads."""

from __future__ import annotations

import math
import numbers
from typing import Any

import numpy as np
import torch
from torch import Tensor

from softvq._precision import compute_dtype


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
    """A finite float that is > 0 (or >= 0 with ``allow_zero``), else a ValueError naming ``name`` and ``value``.

    A number of any numeric type (``int``, ``numpy.float32``, a 0-d tensor, ...); not a flag, and not a string or
    bytes, even one that spells a number (``"1"`` is text from somewhere that was never parsed: it is refused, not
    read)."""
    kind = "non-negative" if allow_zero else "positive"
    if isinstance(value, bool | np.bool_):  # float(True) is 1.0: a flag passed where a number belongs
        raise ValueError(f"{name} must be a {kind} finite number, got {value!r}")
    if isinstance(value, str | bytes | bytearray):  # float("1") is 1.0: text where a number belongs
        raise ValueError(f"{name} must be a {kind} finite number, got the {type(value).__name__} {value!r}")
    try:
        value_f = float(value)
    except (TypeError, ValueError):
        raise ValueError(f"{name} must be a {kind} finite number, got {value!r}") from None
    if not math.isfinite(value_f) or value_f < 0 or (value_f == 0 and not allow_zero):
        raise ValueError(f"{name} must be a {kind} finite number, got {value!r}")
    return value_f


def check_int(name: str, value: int) -> int:
    """``value`` as a plain ``int`` if it is an integer (numpy integers too; not a bool or a string), else a
    ValueError."""
    if not _is_integer(value):
        raise ValueError(f"{name} must be an integer, got {value!r}")
    return int(value)


# The largest weight of a term of a layer's loss: a weight and a loss both at most sqrt(finfo(float32).max) multiply to
# a finite float32, so the exponent range is split evenly between them (a loss up to 1.8e19 times any weight admitted).
MAX_WEIGHT = math.sqrt(torch.finfo(torch.float32).max)  # 1.84e19


def check_weight(name: str, value: float, *, allow_zero: bool = True) -> float:
    """A loss term's weight: :func:`check_float` (``>= 0``, or ``> 0`` without ``allow_zero``) and at most
    :data:`MAX_WEIGHT`, else a ValueError naming ``name``, ``value`` and the bound."""
    weight = check_float(name, value, allow_zero=allow_zero)
    if weight > MAX_WEIGHT:
        raise ValueError(f"{name}={value!r} is too large: a loss term's weight must be at most "
                         f"sqrt(finfo(float32).max) = {MAX_WEIGHT:.3g}, so that it times any loss up to that size "
                         f"stays a finite float32")
    return weight


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


# A coordinate of N tokens standardised with their own moments is at most sqrt(N - 1) in magnitude (Samuelson's
# inequality): below 2^16 for any batch of fewer than 2^32 tokens. Standardised codes are drawn from and averaged over
# such tokens.
STANDARDIZED_MAX = 2.0**16


def check_code_scale(name: str, value: float, dim: int, spread: float, why: str) -> float:
    """``value``, a scale of a layer's codes, if codes at that scale have squared distances over ``dim`` dimensions that
    fit in float32: their coordinates, at most ``spread`` times the scale (``why`` says why), must stay within
    :func:`max_token_magnitude` ``(dim, float32)``; else a ValueError naming ``name``, ``value`` and the bound."""
    magnitude = max_token_magnitude(dim, torch.float32)
    limit = magnitude / spread
    if value > limit:
        raise ValueError(f"{name}={value!r} is too large for dim={dim}: the squared distances of {dim}-dimensional "
                         f"codes fit in float32 while their coordinates stay within sqrt(finfo(float32).max / "
                         f"(16 * {dim})) = {magnitude:.3g}, and {why}, so it must be at most {magnitude:.3g} / "
                         f"{spread:g} = {limit:.3g}")
    return value


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


def check_feature_maps(z: object, dim: int) -> None:
    """``z`` must be feature maps ``(B, dim, ...)``, as a ``channel_first`` layer takes them; else a ValueError
    naming the shape it got."""
    if not isinstance(z, Tensor) or z.ndim < 2 or z.shape[1] != dim:
        shape = tuple(z.shape) if isinstance(z, Tensor) else type(z).__name__
        raise ValueError(f"channel_first=True expects feature maps of shape (B, {dim}, ...), got {shape}")
