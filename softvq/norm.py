"""Token standardisation inside the codebook: the token scale that DDCL needs, without the user's model providing it.

A soft codebook collapses when the encoder can shrink its tokens (docs/design.md, "Collapse-free defaults"): the
Jacobian of the soft centroid,
``(2/T) C_n``, vanishes with the tokens' spread. :class:`TokenStandardizer` fixes that scale inside the layer, so any
encoder works: per-dimension mean and variance over the batch's tokens in training (over every process's batch under
``torch.distributed``), running averages in evaluation, the first batch taken whole.

Why not ``nn.BatchNorm1d``: its running variance starts at 1 and moves 10% per step while a fresh encoder's tokens
have a variance near 1e-4, so after a short run evaluation divides by a stale, far too large variance (measured in the
project's VQ-VAE: 2% test utilization after 16 steps, against 98% in training); and ``nn.SyncBatchNorm`` refuses CPU
tensors, so it cannot give the same statistics across gloo processes.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Literal

import torch
from torch import Tensor, nn

from softvq._checks import STANDARDIZED_MAX, check_choice, check_code_scale, check_float, check_positive_int
from softvq._collectives import all_reduce_sum, all_reduce_sum_
from softvq.parts._settings import from_mapping


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
        self.renorm = bool(renorm)
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

    def _load_from_state_dict(self, state_dict: dict, prefix: str, *args, **kwargs) -> None:
        # A state dict saved before the applied statistics were kept has none: evaluation starts from the running
        # moments it used then (so the loaded layer evaluates as it did when saved) and follows training from there.
        running_mean, running_var = state_dict.get(prefix + "running_mean"), state_dict.get(prefix + "running_var")
        if prefix + "applied_mean" not in state_dict and running_mean is not None:
            state_dict[prefix + "applied_mean"] = running_mean.clone()
        if prefix + "applied_var" not in state_dict and running_var is not None:
            state_dict[prefix + "applied_var"] = self._std(running_var.to(self.running_var.dtype)).square()
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
