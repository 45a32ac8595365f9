"""A DDCL layer whose commitment is held at a ratio of the decoder's gradient (a prototype of eval/, not yet the
library's): the candidates ``ddcl_rho`` and ``ddcl_rhoz*`` of the small-autoencoder study (what they measured:
docs/design.md, "Beyond conv VQ-VAEs").

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

``against="tokens"`` holds the pull at ``rho`` of the gradient the layer passes to its tokens, ``J^T G`` (the soft
centroid's Jacobian applied to ``G``) instead of ``G``: what HardVQ's measured ratio compares with, since
straight-through passes ``G`` to the tokens unchanged. Where ``||J^T G||`` is far below ``||G||``, the output's ratio
makes the pull dominate what the encoder learns from its decoder. ``surgery=True`` (with ``against="tokens"``) then
drops, per token, the part of the pull that opposes that gradient (PCGrad's projection: where ``pull . g_n < 0``, the
pull loses its component along ``g_n``), so the pull moves a token toward its code only in directions the
reconstruction does not push against.
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


class _TokenPull(torch.autograd.Function):
    """Identity on the tokens ``zf``; its backward adds ``rho * ||g_z|| / ||zf - codes|| * (zf - codes)`` to the
    gradient ``g_z`` that reaches them (the soft centroid's Jacobian applied to the decoder's gradient). The codes are
    known only after the forward that reads ``zf``: the layer puts them in ``slot`` (a dict) once it has them."""

    @staticmethod
    def forward(ctx: FunctionCtx, zf: Tensor, slot: dict[str, Tensor], rho: float, surgery: bool) -> Tensor:
        ctx.save_for_backward(zf)
        ctx.slot, ctx.rho, ctx.surgery = slot, rho, surgery
        return zf.view_as(zf)

    @staticmethod
    def backward(ctx: Any, g: Tensor) -> tuple[Tensor, None, None, None]:
        (zf,) = ctx.saved_tensors
        diff = zf - ctx.slot.pop("codes")
        tiny = torch.finfo(diff.dtype).tiny
        pull = diff * (ctx.rho * g.norm() / diff.norm().clamp_min(tiny))
        if ctx.surgery:  # per token, drop the part of the pull that opposes the reconstruction's gradient (PCGrad)
            dot = (pull * g).sum(-1, keepdim=True)
            pull = pull - dot.clamp(max=0) / g.square().sum(-1, keepdim=True).clamp_min(tiny) * g
        return g + pull, None, None, None


class RatioCommitDDCL(softvq.DDCLQuantizer):
    """``DDCLQuantizer`` with a commitment held at ``rho`` of a gradient's norm (module docstring): of the decoder's
    gradient at the layer's output (``against="output"``), or of the gradient the layer passes to its tokens
    (``against="tokens"``: the soft centroid's Jacobian applied to the decoder's gradient, what HardVQ's measured
    ratio compares with, since straight-through passes the output's gradient to the tokens unchanged)."""

    def __init__(self, num_codes: int, dim: int, *, rho: float = 0.2, against: str = "output",
                 surgery: bool = False, **kwargs: Any) -> None:
        super().__init__(num_codes, dim, **kwargs)
        if not rho >= 0:
            raise ValueError(f"rho must be >= 0, got {rho!r}")
        if against not in ("output", "tokens"):
            raise ValueError(f"against must be 'output' or 'tokens', got {against!r}")
        if surgery and against != "tokens":
            raise ValueError("surgery needs against='tokens' (the gradient it compares the pull with)")
        self.rho, self.against, self.surgery = float(rho), against, bool(surgery)
        self._slot: dict[str, Tensor] | None = None

    def _pulls(self) -> bool:
        return self.training and self.rho > 0 and torch.is_grad_enabled()

    def _codebook_space(self, zf: Tensor, update: bool, update_codebook: bool) -> tuple[Tensor, Tensor | None,
                                                                                        Tensor | None]:
        zf, mean, std = super()._codebook_space(zf, update, update_codebook)
        self._slot = None
        if self.against == "tokens" and self._pulls() and zf.requires_grad:
            self._slot = {}
            zf = _TokenPull.apply(zf, self._slot, self.rho, self.surgery)
        return zf, mean, std

    def _output_codes(self, zf: Tensor, p: Tensor, mu: Tensor, indices: Tensor, loss: Tensor, mean: Tensor | None,
                      std: Tensor | None) -> tuple[Tensor, Tensor]:
        if self._pulls():
            codes = torch.nn.functional.embedding(indices, p.detach())
            if self.against == "output":
                mu = _RatioPull.apply(mu, zf, codes, self.rho)
            elif self._slot is not None:
                self._slot["codes"] = codes.detach()
                self._slot = None
        return super()._output_codes(zf, p, mu, indices, loss, mean, std)
