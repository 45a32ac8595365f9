"""The supervised heads of ``eval/paradigm1/`` on frozen tokens, for :func:`eval.readout.heads.fit`.

Every head maps tokens ``(B, T, D)`` and a padding mask ``(B, T)`` (True = real token) to class logits ``(B, C)`` and an
auxiliary loss. Linear heads are :func:`eval.readout.heads.linear_probe` (a non-affine BatchNorm, then a linear map).

- :class:`FeatureProbe`: a linear probe on one vector per example: the mean of the real tokens, or the encoder's CLS
  feature (passed in as a one-token "sequence").
- :class:`ReadoutHead`: one or two stacked :class:`softvq.DDCLReadout` levels, trained with the head (their DDCL losses
  added, prototypes at ``lr / eps``). Level 1 reads the tokens; level 2 reads level 1's per-token soft centroids
  ``mu_t^(1) = sum_k q_tk p_k^(1)`` with the same mask (docs/design.md, "Stacked codebooks": level ``l`` quantizes the
  outputs of level ``l - 1``) and its own, fewer prototypes. The head reads ``pooled`` only, or
  ``[pooled, mass / n, slots]`` of every level. In training mode every forward records each level's ``l_q``,
  ``l_ols``, ``v`` and ``identity_residual``.
"""

from __future__ import annotations

from typing import Literal

import torch
from torch import Tensor, nn

from eval.readout.heads import linear_probe
from softvq import DDCLReadout


def masked_mean(tokens: Tensor, mask: Tensor) -> Tensor:
    """``(B, T, D)``, ``(B, T)`` bool -> ``(B, D)``, the mean of the real tokens (padding may hold anything)."""
    kept = tokens.masked_fill(~mask[..., None], 0.0)
    return kept.sum(1) / mask.sum(1, keepdim=True).to(tokens.dtype)


class FeatureProbe(nn.Module):
    """A linear probe on the mean real token (``pool="mean"``) or on a fixed per-example vector given as the only
    token of the sequence (``pool="first"``: the CLS feature)."""

    def __init__(self, dim: int, classes: int, pool: Literal["mean", "first"]) -> None:
        super().__init__()
        self.pool = pool
        self.head = linear_probe(dim, classes)

    def forward(self, tokens: Tensor, mask: Tensor) -> tuple[Tensor, Tensor]:
        feature = masked_mean(tokens, mask) if self.pool == "mean" else tokens[:, 0]
        return self.head(feature), tokens.new_zeros(())


class ReadoutHead(nn.Module):
    """``levels`` (1 or 2) stacked DDCL readouts and a linear head on their features.

    Args:
        dim: ``D``.
        classes: ``C``.
        num_codes: ``(K_1,)`` or ``(K_1, K_2)``, the prototypes per level.
        temperature: ``T_1`` of level 1, in squared distances of the (standardised) tokens. Level 2's ``T_2`` is set on
            its first training batch to ``temperature_ratio`` times the mean squared distance between two of its input
            tokens (``2 x`` their total variance), as ``T_1`` is for the tokens by the caller.
        temperature_ratio: see ``temperature``.
        features: ``"pooled"`` (the head reads ``pooled`` of every level) or ``"all"`` (``[pooled, mass / n, slots]``).
    """

    def __init__(self, dim: int, classes: int, num_codes: tuple[int, ...], temperature: float,
                 temperature_ratio: float, features: Literal["pooled", "all"] = "all") -> None:
        super().__init__()
        if len(num_codes) not in (1, 2):
            raise ValueError(f"num_codes must give 1 or 2 levels, got {num_codes}")
        self.readouts = nn.ModuleList([DDCLReadout(k, dim, temperature=temperature) for k in num_codes])
        self.temperature_ratio = temperature_ratio
        self.features = features
        width = sum(dim if features == "pooled" else dim + k * (1 + dim) for k in num_codes)
        self.head = linear_probe(width, classes)
        self.history: list[list[dict[str, float]]] = []  # per training forward: per level l_q, l_ols, v, residual
        self.calibrated = len(num_codes) == 1

    def forward(self, tokens: Tensor, mask: Tensor) -> tuple[Tensor, Tensor]:
        parts, losses, terms = [], [], []
        x, out = tokens, None
        for level, readout in enumerate(self.readouts):
            if out is not None:
                prev = self.readouts[level - 1]
                # mu_t of the level below, (B, T, D); 0 at padding, which the mask hides from this level.
                x = torch.einsum("btk,kd->btd", out.assignments.to(x.dtype), prev.prototypes)
                if self.training and not self.calibrated:
                    with torch.no_grad():
                        real = x[mask]
                        readout.quantizer.temperature = float(self.temperature_ratio * 2 * real.var(0).sum())
                    self.calibrated = True
            out = readout(x, mask)
            n = mask.sum(1, keepdim=True).to(x.dtype)
            parts += [out.pooled] if self.features == "pooled" else [out.pooled, out.mass / n, out.slots.flatten(1)]
            losses.append(out.loss)
            terms.append({name: float(value) for name, value in out.terms.items()})
        if self.training:
            self.history.append(terms)
        return self.head(torch.cat(parts, dim=1)), torch.stack(losses).sum()
