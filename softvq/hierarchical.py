"""Hierarchical DDCL: a stack of DDCL codebooks, each quantizing the pooled soft centroids of the level below.

docs/design.md, "Stacked codebooks", and the paper's hierarchical claim. Level 0 quantizes the input tokens
``z^(0) = z``; level ``l > 0`` quantizes ``z^(l) = pool_l(mu^(l-1))``, the window averages of level ``l - 1``'s soft
centroids over the token grid (2x2 windows of an image grid, windows of a sequence; window 1 = no pooling), with its
own ``K_l`` prototypes::

    z^(0)   = z                                   (B, *grid_0, D)
    mu^(l)  = DDCL_l(z^(l))                       soft centroid of level l
    z^(l+1) = mean over each window of mu^(l)     (B, *grid_{l+1}, D), grid_{l+1} = grid_l / window_{l+1}

Every level is a :class:`~softvq.DDCLQuantizer` with its own temperature and terms, so the identity
``L_q^(l) = L_OLS^(l) + V^(l)`` and ``V^(l) >= 0`` are reported per level. The levels are the plain layer unless the
options say otherwise (no standardisation, gradient-trained prototypes, a fixed temperature, no dead-code restart):
``recipe="auto"`` gives every level the in-layer recipe, its own entropy control, EMA prototypes and restarts.
Gradients reach every level's prototypes through its own loss and, for levels below the top, through the pooled input
of the level above (``d mu / d z = (2 / T) C``, no straight-through estimator anywhere).
"""

from __future__ import annotations

import math
import numbers
from collections.abc import Sequence
from typing import Any, NamedTuple

import torch
from torch import Tensor, nn

from softvq import _compat
from softvq._checks import check_finite_state, check_positive_int
from softvq._recipe import fixed_option, layer_option
from softvq.ddcl import DDCLQuantizer
from softvq.types import QuantizerOutput

Window = int | tuple[int, ...]


class HierarchicalOutput(NamedTuple):
    """What :class:`HierarchicalDDCL` returns: one entry per level (level 0 first) in every tuple field.

    For an input ``z`` of shape ``(B, *grid, D)`` and level ``l`` with ``K_l`` codes on the grid ``grid_l`` (the
    input grid divided by the product of the pooling windows up to ``l``):

    Attributes:
        quantized: ``(B, *grid_l, D)`` per level, the soft centroids ``mu^(l)`` (dtype of ``z``).
        indices: ``(B, *grid_l)`` int64 per level, ``argmax_k`` of the level's assignments.
        probs: ``(B, *grid_l, K_l)`` per level, the assignments; rows sum to 1.
        inputs: ``(B, *grid_l, D)`` per level, the tokens the level quantized (``z`` itself at level 0, the pooled
            soft centroids of the level below above it).
        losses: scalar per level, the level's weighted auxiliary objective (:attr:`QuantizerOutput.loss`).
        loss: scalar, the sum of ``losses``; add it to the task loss.
        terms: per level the detached diagnostics of :class:`~softvq.DDCLQuantizer` (``l_q``, ``l_ols``, ``v``,
            ``identity_residual``).
    """

    quantized: tuple[Tensor, ...]
    indices: tuple[Tensor, ...]
    probs: tuple[Tensor, ...]
    inputs: tuple[Tensor, ...]
    losses: tuple[Tensor, ...]
    loss: Tensor
    terms: tuple[dict[str, Tensor], ...]

    def level(self, index: int) -> QuantizerOutput:
        """Level ``index`` as the :class:`~softvq.QuantizerOutput` a single :class:`~softvq.DDCLQuantizer` returns."""
        return QuantizerOutput(self.quantized[index], self.indices[index], self.probs[index], self.losses[index],
                               self.terms[index])


def pool_tokens(z: Tensor, window: Sequence[int]) -> Tensor:
    """Average channel-last tokens ``(B, *grid, D)`` over non-overlapping windows: ``(B, *(grid / window), D)``.

    ``window`` has one entry per grid axis and must divide it (:meth:`HierarchicalDDCL.level_grids` checks).
    """
    grid = z.shape[1:-1]
    split: list[int] = []
    for size, w in zip(grid, window, strict=True):
        split += [size // w, w]
    blocks = z.reshape(z.shape[0], *split, z.shape[-1])  # (B, g1/w1, w1, g2/w2, w2, ..., D)
    return blocks.mean(dim=tuple(range(2, 2 * len(grid) + 1, 2)))


def unpool_tokens(z: Tensor, window: Sequence[int]) -> Tensor:
    """Repeat every token of ``(B, *grid, D)`` over its window: ``(B, *(grid * window), D)`` (nearest upsampling,
    the inverse layout of :func:`pool_tokens`)."""
    for axis, w in enumerate(window, start=1):
        if w > 1:
            z = z.repeat_interleave(w, dim=axis)
    return z


class HierarchicalDDCL(nn.Module):
    """``L`` stacked DDCL codebooks; level ``l`` quantizes the window-pooled soft centroids of level ``l - 1``.

    Input: channel-last tokens ``(B, *grid, D)`` with at least one grid axis (``(B, T, D)`` for sequences,
    ``(B, h, w, D)`` for images); the last dimension is the space in which to quantize. Output: a
    :class:`HierarchicalOutput` with the per-level soft centroids, indices, assignments and terms.

    Example:
        >>> hier = HierarchicalDDCL([512, 128], dim=64, pool=2)   # 8x8 bottom grid, 4x4 top grid
        >>> out = hier(torch.randn(2, 8, 8, 64))
        >>> [tuple(q.shape) for q in out.quantized]
        [(2, 8, 8, 64), (2, 4, 4, 64)]

    Args:
        num_codes: ``(K_0, ..., K_{L-1})``, the prototypes of every level (each >= 1); its length is ``L``.
        dim: ``D``, the token dimension, shared by every level.
        pool: the pooling window of every level above 0: an ``int`` (the same window at every level and on every
            grid axis: ``2`` is 2x2 on an image grid), or a sequence of ``L - 1`` windows, each an ``int`` (every
            axis) or a tuple with one entry per grid axis. ``1`` = no pooling. Each window must divide the grid of
            the level below (checked per input).
        **ddcl_kwargs: options of :class:`~softvq.DDCLQuantizer` (``temperature``, ``distance``, ``prototype_update``,
            ``restart``, ...), the same for every level; ``recipe`` is ``"plain"`` unless given (no restarts:
            ``recipe="auto"`` or ``restart=softvq.Restart()`` for them). Set a level's temperature afterwards
            with ``hier.levels[l].temperature = t``.

    Raises:
        ValueError: ``num_codes`` empty or with a ``K_l < 1``, ``pool`` of the wrong length or with a window < 1,
            an invalid DDCL option; at call time a wrong input shape or a window that does not divide the grid.
    """

    def __init__(self, num_codes: Sequence[int], dim: int, pool: Window | Sequence[Window] = 1,
                 **ddcl_kwargs: Any) -> None:
        super().__init__()
        if isinstance(num_codes, int | str) or not isinstance(num_codes, Sequence) or len(num_codes) == 0:
            raise ValueError(f"num_codes must be a non-empty sequence with one codebook size per level, "
                             f"got {num_codes!r}")
        for level, k in enumerate(num_codes):
            check_positive_int(f"num_codes[{level}] (K_{level}, the codes of level {level})", k)
        self._num_codes = tuple(int(k) for k in num_codes)
        self._dim = check_positive_int("dim", dim)
        self.pool = pool  # checked by its property's setter (below), as an assignment is
        try:
            # Each level is the plain layer unless ddcl_kwargs say otherwise: upper levels quantize the soft centroids
            # of the level below, and the per-level temperature is set by the caller (models.VQVAE).
            ddcl_kwargs = {"recipe": "plain", **ddcl_kwargs}
            self.levels = nn.ModuleList([DDCLQuantizer(k, dim, **ddcl_kwargs) for k in self.num_codes])
        except TypeError as err:  # an option DDCLQuantizer does not have (one the layer refuses says so itself)
            if isinstance(err, ValueError):
                raise
            raise ValueError(f"invalid DDCLQuantizer option for HierarchicalDDCL: {err}") from err

    # ---- options: ``pool`` checked on assignment as the constructor checks it (the levels' own options are theirs:
    # ``hier.levels[l].<option> = ...``) ---------------------------------------------------------------------------
    num_codes = fixed_option("num_codes", "build a new HierarchicalDDCL(num_codes, dim, ...): each K sizes its "
                             "level's codebook", "``(K_0, ..., K_{L-1})``, the codes of every level (fixed).")
    dim = fixed_option("dim", "build a new HierarchicalDDCL(num_codes, dim, ...): D sizes every level",
                       "``D``, the token dimension (fixed).")
    pool = layer_option("pool", lambda hier, value: hier._check_pool(value, len(hier.num_codes)),
                        "The pooling window of every level above 0 (one per level; checked per input against the "
                        "grid).")

    @staticmethod
    def _check_pool(pool: Window | Sequence[Window], num_levels: int) -> tuple[Window, ...]:
        if isinstance(pool, numbers.Integral) and not isinstance(pool, bool):
            windows = [int(pool)] * (num_levels - 1)
        elif isinstance(pool, Sequence) and not isinstance(pool, str):
            windows = list(pool)
        else:
            raise ValueError(f"pool must be an int >= 1 or a sequence of windows, one per level above 0, got {pool!r}")
        if len(windows) != num_levels - 1:
            raise ValueError(f"pool must be an int or hold one window per level above 0 ({num_levels - 1} for "
                             f"{num_levels} levels), got {pool!r}")
        out: list[Window] = []
        for level, window in enumerate(windows, start=1):
            sizes = (window,) if not isinstance(window, Sequence) else tuple(window)
            if len(sizes) == 0 or any(isinstance(w, bool) or not isinstance(w, int) or w < 1 for w in sizes):
                raise ValueError(f"pool window of level {level} must be an int >= 1 or a tuple of them, "
                                 f"got {window!r}")
            out.append(window if isinstance(window, int) else sizes)
        return tuple(out)

    @property
    def num_levels(self) -> int:
        """``L``, the number of levels."""
        return len(self.levels)

    @property
    def restarts(self) -> int:
        """Dead-code restarts so far, summed over the levels (per level: ``levels[l].restarts``)."""
        return sum(level.restarts for level in self.levels)

    def _load_from_state_dict(self, state_dict: dict[str, Any], prefix: str, *args: Any, **kwargs: Any) -> None:
        # every level's state checked before the first one loads: a refused file leaves the whole stack as it was
        _compat.check_state_settings(  # a level saved with other settings: refused
            {name: (type(m).__name__, m._settings()) for name, m in self.named_modules()
             if callable(getattr(m, "_settings", None))},
            state_dict, prefix)
        check_finite_state(state_dict, prefix, "HierarchicalDDCL")
        super()._load_from_state_dict(state_dict, prefix, *args, **kwargs)

    def extra_repr(self) -> str:
        return f"num_codes={self.num_codes}, dim={self.dim}, pool={self.pool}"

    def windows(self, grid_ndim: int) -> tuple[tuple[int, ...], ...]:
        """The pooling window of every level above 0 as one size per grid axis."""
        out = []
        for level, window in enumerate(self.pool, start=1):
            sizes = (window,) * grid_ndim if isinstance(window, int) else window
            if len(sizes) != grid_ndim:
                raise ValueError(f"pool window {window} of level {level} has {len(sizes)} axes but the token grid "
                                 f"has {grid_ndim}")
            out.append(sizes)
        return tuple(out)

    def level_grids(self, grid: Sequence[int]) -> tuple[tuple[int, ...], ...]:
        """The token grid of every level for an input grid (e.g. ``(8, 8)`` -> ``((8, 8), (4, 4))`` with 2x2 pooling).

        Raises:
            ValueError: a window does not divide the grid of the level below (naming the level, window and grid).
        """
        grids = [tuple(int(g) for g in grid)]
        for level, window in enumerate(self.windows(len(grids[0])), start=1):
            below = grids[-1]
            if any(g % w for g, w in zip(below, window, strict=True)):
                raise ValueError(f"level {level}: pooling window {window} does not divide the grid {below} of level "
                                 f"{level - 1}")
            grids.append(tuple(g // w for g, w in zip(below, window, strict=True)))
        return tuple(grids)

    def upsample_factors(self, grid_ndim: int) -> tuple[tuple[int, ...], ...]:
        """Per level, how many level-0 tokens one token covers along each grid axis (the product of the windows)."""
        factors = [(1,) * grid_ndim]
        for window in self.windows(grid_ndim):
            factors.append(tuple(f * w for f, w in zip(factors[-1], window, strict=True)))
        return tuple(factors)

    def forward(self, z: Tensor) -> HierarchicalOutput:
        """Quantize ``z (B, *grid, D)`` at every level.

        Returns:
            :class:`HierarchicalOutput`; level ``l``'s tensors live on ``level_grids(grid)[l]``.
        """
        if not isinstance(z, Tensor) or z.ndim < 3 or z.shape[-1] != self.dim:
            shape = tuple(z.shape) if isinstance(z, Tensor) else type(z).__name__
            raise ValueError(f"expected channel-last tokens (B, *grid, {self.dim}) with at least one grid axis, "
                             f"got {shape}")
        self.level_grids(z.shape[1:-1])
        windows = self.windows(z.ndim - 2)
        outputs: list[QuantizerOutput] = []
        inputs: list[Tensor] = []
        x = z
        for level, quantizer in enumerate(self.levels):
            if level > 0:
                x = pool_tokens(outputs[-1].quantized, windows[level - 1])
            inputs.append(x)
            outputs.append(quantizer(x))
        losses = tuple(o.loss for o in outputs)
        return HierarchicalOutput(
            quantized=tuple(o.quantized for o in outputs),
            indices=tuple(o.indices for o in outputs),
            probs=tuple(o.dense_probs(q.num_codes) for o, q in zip(outputs, self.levels, strict=True)),
            inputs=tuple(inputs),
            losses=losses,
            loss=losses[0] if len(losses) == 1 else torch.stack(losses).sum(),
            terms=tuple(o.terms for o in outputs),
        )

    def decode_indices(self, indices: Sequence[Tensor]) -> tuple[Tensor, ...]:
        """Per level, code indices ``(...)`` -> their prototypes ``(..., D)`` (the hard decode of every level).

        Raises:
            ValueError: not one index tensor per level, or indices out of a level's range.
        """
        if isinstance(indices, Tensor) or len(indices) != self.num_levels:
            got = "a single tensor" if isinstance(indices, Tensor) else f"{len(indices)}"
            raise ValueError(f"decode_indices needs one index tensor per level ({self.num_levels}), got {got}")
        return tuple(level.decode_indices(idx) for level, idx in zip(self.levels, indices, strict=True))


def combine_levels(quantized: Sequence[Tensor], factors: Sequence[Sequence[int]]) -> Tensor:
    """Concatenate per-level tokens on the level-0 grid: level ``l`` ``(B, *grid_l, D)`` is repeated by
    ``factors[l]`` (nearest upsampling) and the levels are stacked on the channel axis: ``(B, *grid_0, L * D)``.

    What a decoder conditioned on every level consumes (:class:`models.VQVAE` with ``levels > 1``).
    """
    if len(quantized) != len(factors):
        raise ValueError(f"one upsampling factor per level needed: {len(quantized)} levels, {len(factors)} factors")
    parts = [unpool_tokens(q, f) if math.prod(f) > 1 else q for q, f in zip(quantized, factors, strict=True)]
    return torch.cat(parts, dim=-1)
