"""Residual quantization: ``Q`` codebooks in a stack, each quantizing what the levels before it left.

Level ``q`` quantizes ``r_q = x - sum_{j<q} c_j`` (``r_0 = x``) and the output is ``sum_q c_q``; with ``Q`` codebooks
of ``K`` codes a token costs ``Q log2 K`` bits. Its known failure is collapse in the deeper levels, whose residuals
shrink level by level: a fixed-temperature or fixed-scale codebook goes cold there, and hard VQ's deep levels die
without dead-code expiry. :class:`ResidualDDCL` gives every level its own :class:`~softvq.DDCLQuantizer` (temperature
controlled to an entropy target, so it follows each level's distance scale; EMA prototypes; restarts; the hard code
with the soft centroid's Jacobian). :class:`ResidualHardVQ` is the hard baseline, :class:`~softvq.HardVQ` with
EMA and restarts per level.

Gradients: the residual passed to the next level is ``r_q - sg(c_q)`` (as vector-quantize-pytorch's ``ResidualVQ``
does), so each level's gradient path to the input is its own Jacobian (the soft centroid's for DDCL, the identity
for straight-through hard VQ), and the output's gradient is the sum of the levels'.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Literal

import torch
from torch import Tensor, nn

from softvq import _compat
from softvq._checks import (
    check_bool,
    check_choice,
    check_finite_state,
    check_indices,
    check_int,
    check_positive_int,
    flatten_tokens,
)
from softvq._precision import compute_dtype
from softvq._recipe import fixed_option, layer_option
from softvq._replay import in_backward
from softvq.ddcl import DDCLQuantizer
from softvq.hard_vq import HardVQ
from softvq.parts.restart import Restart
from softvq.parts.standardize import Standardize, TokenStandardizer
from softvq.types import QuantizerOutput, channel_first_forward


def _check_min_levels(value: object, num_quantizers: int) -> int:
    """``quantize_dropout_min_levels``: a positive integer, at most ``num_quantizers``."""
    levels = check_positive_int("quantize_dropout_min_levels", value)
    if levels > num_quantizers:
        raise ValueError(f"quantize_dropout_min_levels must be at most num_quantizers={num_quantizers}, got {value!r}")
    return levels


def is_residual(obj: object) -> bool:
    """Whether ``obj`` is a residual stack as :class:`~softvq.models.VQVAE` sees one: a :class:`ResidualQuantizer`,
    or any module with ``num_quantizers``, per-level ``levels`` and :meth:`ResidualQuantizer.level_output` (an
    adapter around another library's residual quantizer)."""
    return isinstance(obj, ResidualQuantizer) or (
        isinstance(getattr(obj, "num_quantizers", None), int) and callable(getattr(obj, "level_output", None))
        and isinstance(getattr(obj, "levels", None), nn.ModuleList))


class ResidualQuantizer(nn.Module):
    """A stack of quantizers of one codebook size and token width applied to successive residuals.

    Args:
        levels: the per-level quantizers (softvq layers: channel-last tokens in, :class:`~softvq.QuantizerOutput`
            out), level 0 first.
        standardize: standardise the input once at the top (:class:`~softvq.parts.TokenStandardizer`) and work and
            sum in that space; the output is then in that standardised space, as a single DDCL layer's default.
        renorm: that standardisation with batch renormalisation (``TokenStandardizer(renorm=True)``): training
            standardises with the running moments in value, within ``renorm_clip`` of the batch's own.
        renorm_clip: ``(r_max, d_max)``, the clip of that standardiser's corrections (:class:`TokenStandardizer`).
        quantize_dropout: in training, run only the first ``n`` levels, ``n`` drawn uniformly from
            ``[quantize_dropout_min_levels, Q]`` per step, so one model serves several bitrates (SoundStream).
            The draw depends only on ``seed`` and the step count, so every DDP process draws the same ``n`` (the
            skipped levels' all-reduces would otherwise deadlock). Skipped levels get index ``-1``, zero ``probs``
            and NaN ``terms``.
        quantize_dropout_min_levels: the fewest levels a training step runs.
        seed: seed of the level-count draws.
        channel_first: take feature maps ``(B, D, *spatial)`` and return ``quantized`` in that layout;
            ``indices`` are ``(B, *spatial, Q)`` either way.

    ``forward`` returns a :class:`~softvq.QuantizerOutput` whose ``quantized`` is the sum of the levels' codes
    (``(..., D)``), ``indices`` ``(..., Q)``, ``probs`` ``(..., Q, K)``, ``loss`` the sum of the levels' losses and
    ``terms`` every level's terms as ``"<name>/level<q>"`` plus ``"levels"`` (how many ran).
    """

    def __init__(self, levels: Sequence[nn.Module], standardize: bool = False, quantize_dropout: bool = False,
                 quantize_dropout_min_levels: int = 1, seed: int = 0, channel_first: bool = False,
                 renorm: bool = False, renorm_clip: tuple[float, float] = (3.0, 5.0)) -> None:
        super().__init__()
        if len(levels) == 0:
            raise ValueError("a residual quantizer needs at least one level")
        self.levels = nn.ModuleList(levels)
        sizes = {(int(m.num_codes), int(m.dim)) for m in levels}
        if len(sizes) != 1:
            raise ValueError(f"every level must have the same num_codes and dim, got {sorted(sizes)}")
        for q, level in enumerate(levels):
            if getattr(level, "channel_first", False):
                raise ValueError(f"level {q} has channel_first=True; pass channel_first to the residual quantizer")
        (self._num_codes, self._dim), = sizes
        self._num_quantizers = len(levels)
        self.standardizer = TokenStandardizer(self.dim, renorm=renorm, renorm_clip=renorm_clip) if standardize else None
        # each option checked by its property's setter (below), as an assignment is
        self.quantize_dropout = quantize_dropout
        self.quantize_dropout_min_levels = quantize_dropout_min_levels
        self.seed = seed
        self.channel_first = channel_first
        self.register_buffer("steps", torch.zeros((), dtype=torch.long))  # training steps: the draws' counter

    # ---- options: checked on assignment as the constructor checks them, read by the next call ---------------------
    # (the levels' own options are theirs: ``stack.levels[q].<option> = ...``)
    num_codes = fixed_option("num_codes", "build a new stack: K sizes every level's codebook",
                             "``K``, every level's number of codes (fixed).")
    dim = fixed_option("dim", "build a new stack: D sizes every level", "``D``, the token dimension (fixed).")
    num_quantizers = fixed_option("num_quantizers", "build a new stack with another number of levels",
                                  "``Q``, the number of levels (fixed).")
    quantize_dropout = layer_option("quantize_dropout", lambda stack, value: check_bool("quantize_dropout", value),
                                    "Run a random number of the first levels in training.")
    quantize_dropout_min_levels = layer_option(
        "quantize_dropout_min_levels", lambda stack, value: _check_min_levels(value, stack.num_quantizers),
        "The fewest levels a training step runs, in ``[1, num_quantizers]``.")
    seed = layer_option("seed", lambda stack, value: check_int("seed", value), "The seed of the level-count draws.")
    channel_first = layer_option("channel_first", lambda stack, value: check_bool("channel_first", value),
                                 "Take feature maps ``(B, D, *spatial)``.")

    def active_levels(self) -> int:
        """How many levels this step runs: all of them, or with ``quantize_dropout`` in training the draw for the
        current step (the same on every process: it depends on ``seed`` and the step count only)."""
        if not (self.training and self.quantize_dropout):
            return self.num_quantizers
        g = torch.Generator().manual_seed(self.seed * 1_000_003 + int(self.steps))
        return int(torch.randint(self.quantize_dropout_min_levels, self.num_quantizers + 1, (), generator=g))

    def forward(self, z: Tensor) -> QuantizerOutput:
        if self.channel_first:
            return channel_first_forward(self._forward_tokens, z, self.dim)
        return self._forward_tokens(z)

    def _forward_tokens(self, z: Tensor) -> QuantizerOutput:
        if not isinstance(z, Tensor) or z.ndim < 1 or z.shape[-1] != self.dim:
            shape = tuple(z.shape) if isinstance(z, Tensor) else type(z).__name__
            raise ValueError(f"expected tokens of shape (..., {self.dim}), got {shape}")
        lead = z.shape[:-1]
        # The whole input is checked here, before the shared standardiser or any level moves its state: a batch a
        # level would refuse must leave the stack as it was (and the error counts the input's bad values, not those
        # of a residual that one NaN spread over after standardisation).
        x = flatten_tokens(z, self.dim, check_finite=any(getattr(level, "check_finite", True) for level in self.levels))
        update = self.training and not in_backward()
        if self.standardizer is not None and x.shape[0] > 0:
            x, _, _ = self.standardizer(x.to(compute_dtype(z.dtype)), update=update)
        active = self.active_levels()
        if update and self.training:
            self.steps.add_(1)
        residual, total = x, torch.zeros_like(x)
        indices, probs, terms = [], [], {}
        loss = x.new_zeros((), dtype=torch.float32)
        for q, level in enumerate(self.levels):
            if q < active:
                out = level(residual)
                total = total + out.quantized
                residual = residual - out.quantized.detach()
                indices.append(out.indices)
                probs.append(out.dense_probs(self.num_codes))  # a level's top-k ones stacked dense
                loss = loss + out.loss
                terms.update({f"{name}/level{q}": value for name, value in out.terms.items()})
            else:
                indices.append(torch.full((x.shape[0],), -1, dtype=torch.long, device=x.device))
                probs.append(probs[0].new_zeros(x.shape[0], self.num_codes))  # level 0 always runs
                names = [k.split("/")[0] for k in terms if k.endswith("/level0")]
                terms.update({f"{name}/level{q}": x.new_full((), float("nan"), dtype=torch.float32)
                              for name in names})
        terms["levels"] = torch.tensor(float(active))
        return QuantizerOutput(
            quantized=total.to(z.dtype).reshape(z.shape),
            indices=torch.stack(indices, -1).reshape(*lead, self.num_quantizers),
            probs=torch.stack(probs, -2).reshape(*lead, self.num_quantizers, self.num_codes),
            loss=loss,
            terms=terms,
        )

    def level_output(self, out: QuantizerOutput, q: int) -> QuantizerOutput:
        """Level ``q`` of ``out`` (this layer's output) as the :class:`~softvq.QuantizerOutput` of a single layer:
        its indices and assignments, its terms under their plain names; ``quantized`` and ``loss`` are the whole
        stack's (a level's own code is ``decode_indices`` of its indices)."""
        suffix = f"/level{q}"
        terms = {k.removesuffix(suffix): v for k, v in out.terms.items() if k.endswith(suffix)}
        return QuantizerOutput(out.quantized, out.indices[..., q], out.probs[..., q, :], out.loss, terms)

    @property
    def codebook(self) -> Tensor:
        """``(Q, K, D)``: every level's codes in the space the levels sum in."""
        return torch.stack([level.codebook for level in self.levels])

    def decode_indices(self, indices: Tensor, levels: int | None = None) -> Tensor:
        """Codes ``(..., Q)`` -> the sum of the first ``levels`` levels' codes ``(..., D)`` (all by default; for
        ``channel_first``, ``(B, *spatial, Q)`` -> ``(B, D, *spatial)``). Index ``-1`` (a level that did not run)
        adds nothing."""
        if not isinstance(indices, Tensor) or indices.ndim < 1 or indices.shape[-1] != self.num_quantizers:
            shape = tuple(indices.shape) if isinstance(indices, Tensor) else type(indices).__name__
            raise ValueError(f"expected indices of shape (..., {self.num_quantizers}), got {shape}")
        levels = self.num_quantizers if levels is None else check_positive_int("levels", levels)
        if levels > self.num_quantizers:
            raise ValueError(f"levels must be at most num_quantizers={self.num_quantizers}, got {levels}")
        total = None
        for q in range(levels):
            codes = self._level_codes(indices[..., q], q)
            total = codes if total is None else total + codes
        return total.movedim(-1, 1) if self.channel_first and total.ndim > 2 else total

    def _level_codes(self, idx: Tensor, q: int) -> Tensor:
        """Level ``q``'s codes ``(..., D)`` of its indices ``idx (...)``; zeros where ``idx`` is ``-1``."""
        check_indices(idx.clamp_min(0), self.num_codes)
        if bool((idx < -1).any()):
            raise ValueError(f"indices must lie in [0, {self.num_codes}) or be -1 (a level that did not run)")
        return self.levels[q].decode_indices(idx.clamp_min(0)) * (idx >= 0).unsqueeze(-1)

    # ---- vector-quantize-pytorch's ResidualVQ names --------------------------------------------------------------
    def _all_levels(self, indices: Tensor) -> Tensor:
        """``indices (..., q)`` with ``q <= Q`` padded to ``(..., Q)`` with ``-1`` (levels that did not run), as
        ``ResidualVQ`` reads coarse indices."""
        if isinstance(indices, Tensor) and indices.ndim >= 1 and 0 < indices.shape[-1] < self.num_quantizers:
            indices = torch.nn.functional.pad(indices, (0, self.num_quantizers - indices.shape[-1]), value=-1)
        return indices

    def get_output_from_indices(self, indices: Tensor) -> Tensor:
        """``ResidualVQ``'s name for :meth:`decode_indices`: the sum of the levels' codes; indices of the first
        ``q < Q`` levels decode those levels."""
        return self.decode_indices(self._all_levels(indices))

    def get_codes_from_indices(self, indices: Tensor) -> Tensor:
        """Every level's code, ``(Q, ..., D)`` (channel-last, as ``ResidualVQ``'s); ``-1`` and levels past the
        given ones are zeros. Their sum over the first dimension is :meth:`get_output_from_indices` (channel-last)."""
        indices = self._all_levels(indices)
        if not isinstance(indices, Tensor) or indices.ndim < 1 or indices.shape[-1] != self.num_quantizers:
            shape = tuple(indices.shape) if isinstance(indices, Tensor) else type(indices).__name__
            raise ValueError(f"expected indices of shape (..., {self.num_quantizers}), got {shape}")
        return torch.stack([self._level_codes(indices[..., q], q) for q in range(self.num_quantizers)])

    @property
    def codebooks(self) -> Tensor:
        """``ResidualVQ``'s name for :attr:`codebook`, ``(Q, K, D)``."""
        return self.codebook

    def _load_from_state_dict(self, state_dict: dict[str, Any], prefix: str, *args: Any, **kwargs: Any) -> None:
        # every level's state checked before the first one loads: a refused file leaves the whole stack as it was
        _compat.check_state_settings(  # a level saved with other settings: refused
            {name: (type(m).__name__, m._settings()) for name, m in self.named_modules()
             if callable(getattr(m, "_settings", None))},
            state_dict, prefix)
        check_finite_state(state_dict, prefix, "ResidualQuantizer")
        super()._load_from_state_dict(state_dict, prefix, *args, **kwargs)

    def extra_repr(self) -> str:
        return (f"num_quantizers={self.num_quantizers}, num_codes={self.num_codes}, dim={self.dim}, "
                f"standardize={self.standardizer is not None}, quantize_dropout={self.quantize_dropout}")


class ResidualDDCL(ResidualQuantizer):
    """``Q`` levels of :class:`~softvq.DDCLQuantizer` (each with its own prototypes, temperature control and restarts)
    on successive residuals.

    Args:
        num_quantizers: ``Q``, the levels.
        num_codes: ``K`` per level.
        dim: ``D``.
        scale: where the levels work. ``"shared"``: the input is standardised once at the top and every level
            quantizes and sums in that space (levels built with ``standardize=False``); the output is in that
            standardised space. ``"per_level"``: every level standardises its own residual and maps its codes back
            to the residual's scale (``standardize=Standardize(output_scale="input")``); the output is on the input's
            scale.
        renorm: standardise with batch renormalisation (:class:`~softvq.parts.TokenStandardizer`): in training the
            tokens are standardised *in value* with the running moments (within ``renorm_clip`` of the batch's own),
            with the batch statistics' gradient; measured in docs/design.md, "Residual codebooks".
        renorm_clip: with ``scale="shared"``, the clip of the shared standardiser: Ioffe's ``(3, 5)``, where the
            stack was measured, not the single layer's tight ``(1.1, 0.1)`` (unmeasured in the stack). With
            ``scale="per_level"`` each level renormalises with the single layer's ``(1.1, 0.1)``.
        quantize_dropout, quantize_dropout_min_levels, seed, channel_first: as :class:`ResidualQuantizer`.
        **ddcl_options: passed to every level's :class:`~softvq.DDCLQuantizer` (the layer's defaults otherwise:
            the same restart threshold and entropy target at every level, no per-level tuning).
    """

    def __init__(self, num_quantizers: int, num_codes: int, dim: int, *,
                 scale: Literal["shared", "per_level"] = "shared", renorm: bool = True,
                 renorm_clip: tuple[float, float] = (3.0, 5.0), quantize_dropout: bool = False,
                 quantize_dropout_min_levels: int = 1, seed: int = 0,
                 channel_first: bool = False, **ddcl_options: Any) -> None:
        check_positive_int("num_quantizers", num_quantizers)
        scale = check_choice("scale", scale, ("shared", "per_level"))
        for name in ("standardize", "channel_first"):
            if name in ddcl_options:
                raise ValueError(f"{name} is set by ResidualDDCL (scale={scale!r}); do not pass it to the levels")
        # per level: each level standardises its residual (renormalised with the single layer's clip) and returns
        # codes on the residual's scale
        renorm = check_bool("renorm", renorm)
        clip = Standardize().renorm_clip if renorm else None
        level_scale = False if scale == "shared" else Standardize(clip, "input")
        levels = [DDCLQuantizer(num_codes, dim, standardize=level_scale, **ddcl_options) for _ in range(num_quantizers)]
        super().__init__(levels, standardize=scale == "shared", quantize_dropout=quantize_dropout,
                         quantize_dropout_min_levels=quantize_dropout_min_levels, seed=seed,
                         channel_first=channel_first, renorm=renorm and scale == "shared",
                         renorm_clip=renorm_clip)
        self._scale = scale

    scale = fixed_option("scale", "it decided where the levels standardise when the stack was built: build a new "
                         "ResidualDDCL(..., scale=...)", "``\"shared\"`` or ``\"per_level\"`` (fixed).")


# every level's restart by default: below one token per batch, the usage decayed at the EMA's 0.99, uncapped
_HARD_RESTART = Restart(1.0, decay=0.99, cap=None)


class ResidualHardVQ(ResidualQuantizer):
    """``Q`` levels of :class:`~softvq.HardVQ` on successive residuals of the raw input, by default each with EMA
    codebooks (decay 0.99) and dead-code restarts (threshold 1, usage decay 0.99, uncapped): the hard baseline of
    docs/design.md, "Residual codebooks".

    Args:
        num_quantizers, num_codes, dim: ``Q``, ``K`` per level, ``D``.
        ema_decay, restart: every level's :class:`~softvq.HardVQ` options (``restart``: a
            :class:`softvq.parts.Restart`, or ``None`` for none).
        quantize_dropout, quantize_dropout_min_levels, seed, channel_first: as :class:`ResidualQuantizer`.
        **hard_options: more :class:`~softvq.HardVQ` options (``commitment_weight``, ``epsilon``, ``check_finite``).
    """

    def __init__(self, num_quantizers: int, num_codes: int, dim: int, *, ema_decay: float | None = 0.99,
                 restart: Restart | None = _HARD_RESTART, quantize_dropout: bool = False,
                 quantize_dropout_min_levels: int = 1, seed: int = 0, channel_first: bool = False,
                 **hard_options: Any) -> None:
        check_positive_int("num_quantizers", num_quantizers)
        levels = [HardVQ(num_codes, dim, ema_decay=ema_decay, restart=restart,
                         **hard_options) for _ in range(num_quantizers)]
        super().__init__(levels, standardize=False, quantize_dropout=quantize_dropout,
                         quantize_dropout_min_levels=quantize_dropout_min_levels, seed=seed,
                         channel_first=channel_first)
