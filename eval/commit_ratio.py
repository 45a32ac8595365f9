"""A DDCL layer whose commitment is held at a ratio of the decoder's gradient (a prototype of eval/, not yet the
library's): the candidate ``ddcl_rho`` of the small-autoencoder study.

Why. HardVQ's commitment ``beta * ||z - sg(c)||^2 / D`` acts on the encoder's raw tokens, whose scale the encoder
chooses; measured at its weight 0.25, the commitment's gradient on the tokens was 0.15-0.19 of the reconstruction's
in the project's conv VQ-VAE (reports/long_run/probes/commitment_ratio.jsonl) and 0.66 -> 0.17 over 3,000 steps of
the quickstart's MLP autoencoder. DDCL's commitment acts on standardised tokens, so one weight means 18x the
reconstruction's gradient per unit weight in the conv VQ-VAE and about 0.7x in the MLP: no single weight is hard VQ's
balance in both. This layer sets the commitment's gradient itself, each step, to ``rho`` times the norm of the
gradient reaching the layer's output:

    d/dz_n += rho * ||G||_F / ||Z - C||_F * (z_n - c_n)        (z standardised, c_n its argmax code, G = dL/d out)

the gradient of a commitment term whose weight is ``rho * ||G||_F * D / (2 ||Z - C||_F)``, detached, chosen on the
same batch (VQGAN's adaptive weight, a ratio of gradient norms, applied to the commitment). The forward pass, the
output, ``L_q = L_OLS + V`` and every statistic are the parent's; only the encoder's gradient gains the pull.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor
from torch.autograd.function import FunctionCtx

import softvq


class _RatioPull(torch.autograd.Function):
    """Identity on ``mu``; its backward also sends ``rho * ||g|| / ||zf - codes|| * (zf - codes)`` to ``zf``."""

    @staticmethod
    def forward(ctx: FunctionCtx, mu: Tensor, zf: Tensor, codes: Tensor, rho: float) -> Tensor:
        ctx.save_for_backward(zf, codes)
        ctx.rho = rho
        return mu.view_as(mu)

    @staticmethod
    def backward(ctx: Any, g: Tensor) -> tuple[Tensor, Tensor | None, None, None]:
        zf, codes = ctx.saved_tensors
        diff = zf - codes
        tiny = torch.finfo(diff.dtype).tiny
        pull = diff * (ctx.rho * g.norm() / diff.norm().clamp_min(tiny))
        return g, pull if ctx.needs_input_grad[1] else None, None, None


class RatioCommitDDCL(softvq.DDCLQuantizer):
    """``DDCLQuantizer`` with a commitment held at ``rho`` of the decoder's gradient (module docstring)."""

    def __init__(self, num_codes: int, dim: int, *, rho: float = 0.2, **kwargs: Any) -> None:
        super().__init__(num_codes, dim, **kwargs)
        if not rho >= 0:
            raise ValueError(f"rho must be >= 0, got {rho!r}")
        self.rho = float(rho)

    def _output_codes(self, zf: Tensor, p: Tensor, mu: Tensor, indices: Tensor, loss: Tensor, mean: Tensor | None,
                      std: Tensor | None) -> tuple[Tensor, Tensor]:
        if self.training and self.rho > 0 and torch.is_grad_enabled():
            codes = torch.nn.functional.embedding(indices, p.detach())
            mu = _RatioPull.apply(mu, zf, codes, self.rho)
        return super()._output_codes(zf, p, mu, indices, loss, mean, std)
