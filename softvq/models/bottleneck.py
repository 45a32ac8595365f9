"""The bottleneck pieces of :class:`softvq.models.VQVAE`: which quantizers it builds by name and with which defaults,
and :class:`LatentNorm`, the optional per-channel standardisation of the latents in front of the quantizer."""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor, nn

import softvq
from softvq._checks import check_choice
from softvq._collectives import is_distributed
from softvq.norm import batch_moments, bessel

QUANTIZERS: tuple[str, ...] = ("ddcl", "hard")
# Residual stacks (VQVAE(num_quantizers=Q)): Q DDCL levels, or Q HardVQ levels with EMA + restart (softvq.residual).
RESIDUAL_QUANTIZERS: tuple[str, ...] = ("rddcl", "rhard")
LATENT_NORMS: tuple[str, ...] = ("none", "batch")
# A single-level DDCL bottleneck uses the layer's own recipe (softvq.DDCLQuantizer, recipe="auto": standardised
# tokens, entropy-controlled T, EMA prototypes, dead-code restart, hard output). The hierarchical VQ-VAE (levels > 1)
# keeps the recipe that lives in the VQVAE model: latents standardised by LatentNorm (squared distances between two
# random tokens average 2 * code_dim = 128), T = 4 at the start (about e^2.5 ~ 12 prototypes in play per token),
# restarts below one token per batch, and the temperature held at H(Q) = DDCL_TARGET_ENTROPY = 2.5 nats by the model
# (softvq.adapt_temperature).
HIERARCHY_DEFAULTS: dict[str, Any] = {"temperature": 4.0, "restart": softvq.Restart()}
DDCL_TARGET_ENTROPY = 2.5


def build_quantizer(name: str, num_codes: int, dim: int, num_quantizers: int = 1, **kwargs: Any) -> nn.Module:
    """``"ddcl"`` -> :class:`softvq.DDCLQuantizer` (the layer's own defaults unless overridden), ``"hard"`` ->
    :class:`softvq.HardVQ`, ``"rddcl"`` / ``"rhard"`` -> :class:`softvq.ResidualDDCL` / :class:`softvq.ResidualHardVQ`
    of ``num_quantizers`` levels, with ``kwargs``."""
    check_choice("quantizer", name, QUANTIZERS + RESIDUAL_QUANTIZERS)
    if name in RESIDUAL_QUANTIZERS:
        cls = softvq.ResidualDDCL if name == "rddcl" else softvq.ResidualHardVQ
        try:
            return cls(num_quantizers, num_codes, dim, **kwargs)
        except TypeError as err:
            raise ValueError(f"invalid option for quantizer {name!r}: {err}") from err
    if num_quantizers != 1:
        raise ValueError(f"num_quantizers={num_quantizers} stacks residual codebooks: use quantizer 'rddcl' or "
                         f"'rhard', not {name!r}")
    cls = softvq.DDCLQuantizer if name == "ddcl" else softvq.HardVQ
    try:
        return cls(num_codes, dim, **kwargs)
    except TypeError as err:  # an option the chosen quantizer does not have
        raise ValueError(f"invalid option for quantizer {name!r}: {err}") from err


class LatentNorm(nn.BatchNorm2d):
    """Per-channel standardisation of the latents: a non-affine ``BatchNorm2d`` whose running statistics start from
    the first training batch, and whose batch statistics span every process under ``torch.distributed``.

    ``nn.BatchNorm2d`` starts its running variance at 1 and moves it 10% per step. A fresh encoder's latents have a
    variance near 1e-4, so after a short run (tens of steps) evaluation divided by a stale, far too large variance and
    sent every token to one code (measured: 2% test utilization after 16 steps, against 98% in training). Taking the
    first batch's statistics whole (momentum 1, once) removes that start-up bias; later steps are the usual
    exponential average. Outputs in training (batch statistics) are unchanged, and so is the state dict.

    Under DDP the mean and variance are those of all processes' batches together (two differentiable all-reduces),
    so N processes with batch B normalise as one process with batch N * B would. This replaces Lightning's
    ``sync_batchnorm``: ``nn.SyncBatchNorm`` refuses CPU tensors, and converting to it would drop the first-batch start.
    """

    def __init__(self, channels: int) -> None:
        super().__init__(channels, affine=False)

    def forward(self, x: Tensor) -> Tensor:
        first = self.training and self.track_running_stats and int(self.num_batches_tracked) == 0
        if self.training and is_distributed():
            return self._global_batch_norm(x, 1.0 if first else self.momentum)
        if first:
            momentum, self.momentum = self.momentum, 1.0
            try:
                return super().forward(x)
            finally:
                self.momentum = momentum
        return super().forward(x)

    def _global_batch_norm(self, x: Tensor, momentum: float) -> Tensor:
        self._check_input_dim(x)
        xf = x.float() if x.dtype in (torch.float16, torch.bfloat16) else x
        # the library's cross-process moments (softvq.norm, the DDCL layer's standardiser), over (B, H, W) per channel
        mean, var, total = batch_moments(xf.movedim(1, -1).reshape(-1, xf.shape[1]))  # biased, as batch_norm uses
        centered = xf - mean[:, None, None]
        if self.track_running_stats:
            with torch.no_grad():
                self.running_mean.lerp_(mean.detach().to(self.running_mean.dtype), momentum)
                unbiased = var.detach().double() * bessel(total)
                self.running_var.lerp_(unbiased.to(self.running_var.dtype), momentum)
                self.num_batches_tracked.add_(1)
        return (centered * torch.rsqrt(var + self.eps)[:, None, None]).to(x.dtype)
