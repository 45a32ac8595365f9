"""Token standardisation inside the codebook: the part that gives DDCL the token scale it needs, without the user's
model providing it, and its settings (:class:`Standardize`, the layers' ``standardize`` option).

A soft codebook collapses when the encoder can shrink its tokens (docs/design.md, "Collapse-free defaults"): the
Jacobian of the soft centroid, ``(2/T) C_n``, vanishes with the tokens' spread. :class:`TokenStandardizer` fixes that
scale inside the layer, so any encoder works: per-dimension mean and variance over the batch's tokens in training (over
every process's batch under ``torch.distributed``: :func:`softvq.norm.batch_moments`), running averages in
evaluation, the first batch taken whole. Why not ``nn.BatchNorm1d`` or ``nn.SyncBatchNorm``: docs/design.md,
"Anatomy of the layer".
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Literal

import torch
from torch import Tensor, nn

from softvq._checks import STANDARDIZED_MAX, check_bool, check_choice, check_code_scale, check_float, check_positive_int
from softvq._compat.state import upgrade_standardizer_state
from softvq.norm import batch_moments, bessel
from softvq.parts._settings import from_mapping, is_auto


def check_renorm_clip(value: object, name: str = "renorm_clip") -> tuple[float, float]:
    """``(r_max, d_max)`` with ``r_max >= 1`` and ``d_max > 0``, else a ``ValueError`` naming ``name``."""
    if not isinstance(value, (tuple, list)) or len(value) != 2:
        raise ValueError(f"{name} must be a pair (r_max, d_max), got {value!r}")
    r_max, d_max = (check_float(name, v) for v in value)
    if r_max < 1.0:
        raise ValueError(f"{name}[0] (r_max) must be >= 1, got {r_max!r}")
    return (r_max, d_max)


def check_output_scale(value: object, dim: int | None = None,
                       name: str = "standardize.output_scale") -> Literal["standardized", "input"] | float:
    """``"standardized"``, ``"input"`` or a positive number; with ``dim``, a number small enough that codes in the
    standardised space (coordinates within :data:`STANDARDIZED_MAX`) times it keep finite squared distances in float32
    (:func:`softvq._checks.check_code_scale`). Else a ``ValueError`` naming ``name`` and ``value``."""
    if isinstance(value, str):
        return check_choice(name, value, ("input", "standardized"))
    scale = check_float(name, value)
    if dim is not None:
        check_code_scale(name, scale, dim, STANDARDIZED_MAX,
                         "a coordinate of N standardised tokens is at most sqrt(N - 1) (Samuelson's inequality), below "
                         "2^16 for fewer than 2^32 tokens")
    return scale


@dataclass(frozen=True)
class Standardize:
    """How :class:`softvq.DDCLQuantizer` standardises its tokens, as its ``standardize`` option takes it (``True``:
    ``Standardize()``; ``False``: no standardisation).

    Args:
        renorm_clip: ``(r_max, d_max)``, the clip of batch renormalisation's corrections in training (within 10% in
            scale, 0.1 std in shift; docs/design.md, "Batch renormalisation, clipped tight: the default"), or
            ``None``: plain batch standardisation.
        output_scale: codes in the standardised space (``"standardized"``: unit variance per dimension), on the
            input's scale (``"input"``: ``code * std + mean``) or times a number
            (docs/design.md, "Training to the end").
    """

    renorm_clip: tuple[float, float] | None = (1.1, 0.1)
    output_scale: Literal["standardized", "input"] | float = "standardized"

    def __post_init__(self) -> None:
        if self.renorm_clip is not None:
            object.__setattr__(self, "renorm_clip", check_renorm_clip(self.renorm_clip, "standardize.renorm_clip"))
        object.__setattr__(self, "output_scale", check_output_scale(self.output_scale))  # its bound: the layer's D

    @classmethod
    def of(cls, value: object) -> Any:
        """``True`` as ``Standardize()``, a mapping of the fields (a config file's) as a :class:`Standardize`;
        anything else as it is."""
        if value is True:
            return cls()
        return from_mapping(cls, value, "standardize") if isinstance(value, Mapping) else value


# One opaque operator for batch renormalisation's correction factors. Written as ops inside the module, they read the
# running statistics just after the same forward updated them in place, and torch.compile's partitioner (measured on
# torch 2.14) recomputes them in the backward from the buffers, which by then hold the update applied a second time:
# the compiled gradient came out up to 2% off eager's. The partitioner saves an operator's output instead of
# recomputing it, so the factors are computed once, in the forward, whether compiled or not.
@torch.library.custom_op("softvq::renorm_factors", mutates_args=())
def renorm_factors(batch_mean: Tensor, batch_std: Tensor, running_mean: Tensor, running_std: Tensor, r_max: float,
                   d_max: float) -> tuple[Tensor, Tensor]:
    """Batch renormalisation's ``r = clip(std_B / std, 1 / r_max, r_max)`` and
    ``d = clip((mean_B - mean) / std, -d_max, d_max)`` (constants to autograd), in ``batch_std``'s dtype."""
    r = (batch_std / running_std).clamp(1.0 / r_max, r_max)
    d = ((batch_mean - running_mean) / running_std).clamp(-d_max, d_max)
    return r, d


@renorm_factors.register_fake
def _renorm_factors_fake(batch_mean: Tensor, batch_std: Tensor, running_mean: Tensor, running_std: Tensor,
                         r_max: float, d_max: float) -> tuple[Tensor, Tensor]:
    return torch.empty_like(batch_std), torch.empty_like(batch_std)


class TokenStandardizer(nn.Module):
    """Per-dimension standardisation of tokens ``(N, D)``: ``(z - mean) / sqrt(var + eps * mean(var))``, without
    affine terms. The ``eps`` is relative to the tokens' mean variance, so the result does not depend on their scale
    (an absolute ``eps`` like batch normalisation's 1e-5 distorts tokens of variance 1e-4, which a fresh encoder
    produces).

    Training mode uses the batch's statistics (with their gradient, as batch normalisation does) and updates the
    running ones: the first training batch sets them whole (momentum 1), later batches move them by ``momentum``; a
    batch of one token, or of tokens that are all equal, cannot estimate a variance and moves neither.
    Evaluation uses the statistics named by ``eval_statistics`` (:meth:`evaluation_statistics`). :meth:`forward`
    returns the mean and standard deviation it used, so a caller can map codes back to the input's scale
    (``codes * std + mean``). With ``frozen = True`` the evaluation statistics are used in training mode too, and
    never change (a trained codebook reused as a fixed feature map).

    Which statistics evaluation uses (``eval_statistics``, an attribute that can be switched at any time: both kinds
    are kept in every training step):

    - ``"applied"`` (the default): a running average, with weight ``eval_momentum`` per step, of the shift and scale
      training *applied* (the batch's own, or batch renormalisation's clipped ones). With batch statistics the
      encoder can move its tokens' per-dimension shift and scale faster than the running moments (``momentum``)
      follow; evaluation then standardises with statistics no training step used, and codes that training never
      saw are picked. Averaging what training applied over the last few steps follows the encoder.
    - ``"running"``: the running moments (weight ``momentum``), as batch normalisation evaluates; they are also
      the reference batch renormalisation clips to.

    docs/design.md, "Which evaluation statistics", has the measurements behind the default.

    With ``renorm=True`` training mode standardises *in value* with the running statistics (just moved by the batch),
    as evaluation does, while the gradient is batch standardisation's (batch renormalisation, Ioffe 2017:
    ``(z - mean_B) / std_B * r + d`` with ``r = sg(std_B / std)`` and ``d = sg((mean_B - mean) / std)``, clipped to
    ``[1 / renorm_clip[0], renorm_clip[0]]`` and ``[-renorm_clip[1], renorm_clip[1]]``). Batch standardisation
    makes the tokens' per-dimension scale a direction the loss cannot see, so the encoder can drift along it faster
    than running averages follow, and evaluation then standardises with statistics training never used.

    Inside a layer (:meth:`from_setting`) the part also holds the layer's ``standardize`` option whole: whether the
    layer standardises at all (:attr:`on`), batch renormalisation and its clip, and the scale of the codes the layer
    outputs (:attr:`output_scale`, applied by :meth:`output` and :meth:`evaluation_output`); :attr:`settings` reads and
    assigns them together as a :class:`Standardize`. Built directly, the part standardises (``on``), with the
    ``renorm`` and ``renorm_clip`` given.

    Args:
        dim: ``D``.
        momentum: weight of each new batch in the running statistics, in ``(0, 1]``.
        eps: added to the variance, relative to the mean variance over dimensions.
        renorm: batch renormalisation in training (see above).
        renorm_clip: ``(r_max, d_max)``, the clipping of ``r`` and ``d``.
        eval_statistics: ``"applied"`` or ``"running"`` (see above).
        eval_momentum: weight of each training step's applied shift and scale in the ``"applied"`` statistics, in
            ``(0, 1]`` (1: the last step's alone; docs/design.md, "Which evaluation statistics", chose the default).
    """

    def __init__(self, dim: int, momentum: float = 0.1, eps: float = 1e-5, renorm: bool = False,
                 renorm_clip: tuple[float, float] = (3.0, 5.0), eval_statistics: str = "applied",
                 eval_momentum: float = 0.85) -> None:
        super().__init__()
        self.dim = check_positive_int("dim", dim)
        self.momentum = check_float("momentum", momentum)
        if self.momentum > 1.0:
            raise ValueError(f"momentum must be in (0, 1], got {momentum!r}")
        self.eps = check_float("eps", eps)
        self.on = True  # a layer's standardize=False: the layer passes its tokens through unstandardised
        self._renorm = check_bool("renorm", renorm)
        self.renorm_clip = check_renorm_clip(renorm_clip)
        self.eval_statistics = eval_statistics
        self.eval_momentum = check_float("eval_momentum", eval_momentum)
        if self.eval_momentum > 1.0:
            raise ValueError(f"eval_momentum must be in (0, 1], got {eval_momentum!r}")
        self.register_buffer("running_mean", torch.zeros(dim))
        self.register_buffer("running_var", torch.ones(dim))
        # the running average of the shift and of the squared scale training applied (the scale includes eps)
        self.register_buffer("applied_mean", torch.zeros(dim))
        self.register_buffer("applied_var", torch.ones(dim))
        self.register_buffer("num_batches_tracked", torch.zeros((), dtype=torch.long))
        self.frozen = False
        self._output_scale: Literal["standardized", "input"] | float = "standardized"
        # what a layer's standardize="auto" means (its recipe's Standardize, or False); None: "auto" is refused
        self.auto: Standardize | bool | None = None

    @classmethod
    def from_setting(cls, dim: int, value: object, auto: Standardize | bool) -> TokenStandardizer:
        """The standardiser of a layer whose ``standardize`` option is ``value`` (:attr:`settings`; ``"auto"``: the
        recipe's ``auto``). Off, or without a clip of its own, it keeps :class:`Standardize`'s default clip, which
        ``renorm = True`` then uses."""
        part = cls(dim, renorm_clip=Standardize().renorm_clip)
        part.auto = auto
        part.settings = value
        return part

    @property
    def settings(self) -> Standardize | None:
        """What the part does, as a layer's ``standardize`` option takes it: a :class:`Standardize` (its
        ``renorm_clip`` ``None`` without batch renormalisation), or ``None``: off.

        Assigning takes what the option takes: a :class:`Standardize` or a mapping of its fields, ``True``
        (``Standardize()``), ``False`` (off) or ``"auto"`` (:attr:`auto`); ``None`` is refused (nothing to switch off
        that ``False`` does not). The output scale is checked against ``dim`` (:func:`check_output_scale`)."""
        if not self.on:
            return None
        return Standardize(self.renorm_clip if self.renorm else None, self._output_scale)

    @settings.setter
    def settings(self, value: object) -> None:
        if value is None:
            raise ValueError("standardize=None: pass 'auto' for the recipe's value (the layer has no standardize to "
                             "switch off)")
        if is_auto(value) and self.auto is not None:
            value = self.auto
        value = Standardize.of(value)
        if not isinstance(value, Standardize):
            check_bool("standardize", value)  # False: no standardisation (True is Standardize())
            self.on, self._output_scale, self._renorm = False, "standardized", False
            return
        check_output_scale(value.output_scale, self.dim)
        self.on, self._output_scale = True, value.output_scale
        self._renorm = value.renorm_clip is not None
        if value.renorm_clip is not None:
            self.renorm_clip = value.renorm_clip

    @property
    def renorm(self) -> bool:
        """Batch renormalisation in training (with :attr:`renorm_clip`), or plain batch standardisation. ``True``
        only on a part that standardises (:attr:`on`)."""
        return self._renorm

    @renorm.setter
    def renorm(self, value: bool) -> None:
        value = check_bool("renorm", value)
        if value:
            self._needs_on("renorm", value)
        self._renorm = value

    @property
    def output_scale(self) -> Literal["standardized", "input"] | float:
        """The scale of a layer's codes: the standardised space (``"standardized"``), the input's (``"input"``) or
        times a number; assigning is checked as :attr:`settings` checks it, and anything but ``"standardized"`` only on
        a part that standardises."""
        return self._output_scale

    @output_scale.setter
    def output_scale(self, value: object) -> None:
        value = check_output_scale(value, self.dim, "output_scale")
        if value != "standardized":
            self._needs_on("output_scale", value)
        self._output_scale = value

    def _needs_on(self, name: str, value: object) -> None:
        if not self.on:
            raise ValueError(f"{name}={value!r} acts on standardised tokens, and this layer does not standardise "
                             f"(standardize=False): assign standardize=softvq.parts.Standardize(...) with it instead")

    def output(self, codes: Tensor, mean: Tensor | None, std: Tensor | None) -> Tensor:
        """Codes ``(N, D)`` of tokens this part standardised with ``mean`` and ``std`` (:meth:`forward`'s; ``None``
        while it is off), on :attr:`output_scale`."""
        if std is not None and self._output_scale == "input":
            return codes * std + mean
        if std is not None and not isinstance(self._output_scale, str):
            return codes * self._output_scale
        return codes

    def evaluation_output(self, codes: Tensor) -> Tensor:
        """Codes ``(K, D)`` in the standardised space, on :attr:`output_scale` as :meth:`output` puts them in
        evaluation (with :meth:`evaluation_statistics`)."""
        if self.on and self._output_scale == "input":
            mean, std = self.evaluation_statistics()
            return codes * std.to(codes.dtype) + mean.to(codes.dtype)
        if self.on and not isinstance(self._output_scale, str):
            return codes * self._output_scale
        return codes

    @property
    def eval_statistics(self) -> str:
        """Which statistics evaluation (and ``frozen`` training) uses: ``"applied"`` or ``"running"``."""
        return self._eval_statistics

    @eval_statistics.setter
    def eval_statistics(self, value: str) -> None:
        if value not in ("applied", "running"):
            raise ValueError(f"eval_statistics must be 'applied' or 'running', got {value!r}")
        self._eval_statistics = value

    def forward(self, z: Tensor, update: bool = True) -> tuple[Tensor, Tensor, Tensor]:
        """``z (N, D)`` -> ``(standardised z, mean (D,), std (D,))`` in ``z``'s dtype. ``update=False``: training
        mode's batch statistics without moving the running ones (a recomputed forward pass)."""
        if not self.training or self.frozen:
            mean, std = (s.to(z.dtype) for s in self.evaluation_statistics())
            return (z - mean) / std, mean, std
        mean, var, count = batch_moments(z)
        weight = self._weight(var.detach(), count) if update else None
        if weight is not None:
            self._track(mean.detach(), var.detach(), count, weight)
        if self.renorm:
            shift, scale = self._renormalise(mean, var)
        else:
            shift, scale = mean, self._std(var)
        if weight is not None:
            self._track_applied(shift.detach(), scale.detach(), weight)
            self.num_batches_tracked.add_((weight > 0).to(self.num_batches_tracked.dtype))
        return (z - shift) / scale, shift, scale

    def _renormalise(self, mean: Tensor, var: Tensor) -> tuple[Tensor, Tensor]:
        """Batch renormalisation's shift and scale: ``s = std_B / r``, ``m = mean_B - d s``, which equal the running
        statistics in value (unless clipped) and carry the batch statistics' gradient."""
        std = self._std(var)
        r, d = renorm_factors(mean.detach(), std.detach(), self.running_mean.to(mean.dtype),
                              self._std(self.running_var.to(var.dtype)), *self.renorm_clip)
        scale = std / r
        return mean - d * scale, scale

    @torch.no_grad()
    def _weight(self, var: Tensor, count: Tensor) -> Tensor:
        """A training batch's weight in the statistics, as a ``()`` tensor (tensor tests, not ``int()``: no device
        sync): 1 for the first batch, which sets them whole, 0 for a batch that cannot estimate a variance (fewer
        than two tokens, or tokens that are all equal: zero variance in every dimension), else 1 (the momenta are
        applied by :meth:`_track` and :meth:`_track_applied`). A batch of weight 0 moves no statistic and does not
        count as tracked, so the next batch that can is still the first: running variances of zero would make
        evaluation divide by ``sqrt(eps * 0)``."""
        return ((count >= 2) & (var.amax() > 0)).to(self.running_mean.dtype)

    def _momentum(self, weight: Tensor, momentum: float) -> Tensor:
        first = (self.num_batches_tracked == 0).to(weight.dtype)
        return (first + (1.0 - first) * momentum) * weight

    @torch.no_grad()
    def _track(self, mean: Tensor, var: Tensor, count: Tensor, weight: Tensor) -> None:
        """Move the running moments toward a training batch's (the variance unbiased, as batch normalisation's)."""
        momentum = self._momentum(weight, self.momentum)
        unbiased = var.to(torch.float64) * bessel(count)
        self.running_mean.lerp_(mean.to(self.running_mean.dtype), momentum)
        self.running_var.lerp_(unbiased.to(self.running_var.dtype), momentum)

    @torch.no_grad()
    def _track_applied(self, shift: Tensor, scale: Tensor, weight: Tensor) -> None:
        """Move the ``"applied"`` evaluation statistics toward the shift and scale this step used."""
        momentum = self._momentum(weight, self.eval_momentum)
        self.applied_mean.lerp_(shift.to(self.applied_mean.dtype), momentum)
        self.applied_var.lerp_(scale.to(self.applied_var.dtype).square(), momentum)

    def evaluation_statistics(self) -> tuple[Tensor, Tensor]:
        """The ``(mean, std)`` evaluation standardises with (``eval_statistics``), in the buffers' dtype."""
        if self.eval_statistics == "applied":
            return self.applied_mean, self.applied_var.sqrt()
        return self.running_mean, self._std(self.running_var)

    def _load_from_state_dict(self, state_dict: dict[str, Any], prefix: str, *args: Any, **kwargs: Any) -> None:
        upgrade_standardizer_state(state_dict, prefix, lambda var: self._std(var.to(self.running_var.dtype)))
        super()._load_from_state_dict(state_dict, prefix, *args, **kwargs)

    @torch.no_grad()
    def standardize(self, z: Tensor) -> Tensor:
        """``z (N, D)`` standardised as the codebook sees it, without changing any statistic: with the evaluation
        statistics once a training batch has set them (or when ``frozen``), else with ``z``'s own moments (as the
        first training batch will be)."""
        if self.frozen or int(self.num_batches_tracked) > 0:
            mean, std = (s.to(z.dtype) for s in self.evaluation_statistics())
            return (z - mean) / std
        mean, var, _ = batch_moments(z)
        return (z - mean) / self._std(var)

    def _std(self, var: Tensor) -> Tensor:
        return (var + self.eps * var.detach().mean().clamp_min(torch.finfo(var.dtype).tiny)).sqrt()

    def running_std(self) -> Tensor:
        """The scale of the running moments (the reference batch renormalisation clips to)."""
        return self._std(self.running_var)

    def extra_repr(self) -> str:
        return (f"dim={self.dim}, momentum={self.momentum:g}, eps={self.eps:g}"
                + (f", renorm={self.renorm_clip}" if self.renorm else "")
                + f", eval_statistics={self.eval_statistics!r}"
                + (f", eval_momentum={self.eval_momentum:g}" if self.eval_statistics == "applied" else ""))
