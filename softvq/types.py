"""The one return type shared by every softvq quantizer, and its value for zero tokens."""

from __future__ import annotations

from collections.abc import Callable
from typing import NamedTuple

import torch
from torch import Tensor

from softvq._checks import check_feature_maps
from softvq._precision import compute_dtype


class QuantizerOutput(NamedTuple):
    """What every softvq quantizer returns. The fields never change with constructor flags (only the shape of
    ``probs`` does, under DDCL's ``top_k``).

    For an input ``z`` of shape ``(..., D)`` with ``K`` codes:

    Attributes:
        quantized: ``(..., D)``, same shape and dtype as ``z``. For :class:`~softvq.DDCLQuantizer` with its
            defaults the argmax code in the layer's standardised space, carrying the soft centroid's gradient
            (``output_scale="input"``: mapped back to the input's scale; ``hard_output=False`` and
            ``recipe="plain"``: the soft centroid ``mu = probs @ codebook``); for :class:`~softvq.HardVQ` the nearest
            code with a straight-through gradient (in training, the code before that step's EMA update).
        indices: ``(...)`` int64, the nearest code (``argmax_k probs``) of every token.
        probs: ``(..., K)`` float, the assignments; rows sum to 1. One-hot of ``indices`` for ``HardVQ``. Under
            ``DDCLQuantizer(top_k=k)`` with ``k < K``: ``(..., k)``, each token's assignments to its ``k`` nearest
            prototypes, whose codes are ``prob_codes`` (top-k never builds the dense ``(..., K)`` array;
            :meth:`dense_probs` builds it where it is needed).
        loss: scalar, the weighted auxiliary objective the layer contributes; add it to the task loss. Exactly 0
            for a :class:`~softvq.DDCLQuantizer` with its defaults (EMA prototypes, no commitment term).
        terms: ``dict[str, Tensor]`` of detached scalar diagnostics (unweighted means). Its keys are fixed per
            quantizer class; see each class's docstring.
        prob_codes: ``None`` where ``probs`` covers every code; under top-k ``(..., k)`` int64, the code of each
            entry of ``probs``.
    """

    quantized: Tensor
    indices: Tensor
    probs: Tensor
    loss: Tensor
    terms: dict[str, Tensor]
    prob_codes: Tensor | None = None

    def dense_probs(self, num_codes: int | None = None) -> Tensor:
        """``probs`` over all ``num_codes`` codes, ``(..., K)``: ``probs`` itself where it is dense, else the top-k
        assignments scattered into zeros (``num_codes`` is then required)."""
        if self.prob_codes is None:
            return self.probs
        if num_codes is None:
            raise ValueError("dense_probs() of top-k assignments needs num_codes (the K they are scattered into)")
        return scatter_top_k(self.probs, self.prob_codes, num_codes)


def scatter_top_k(probs: Tensor, codes: Tensor, num_codes: int) -> Tensor:
    """Top-k assignments ``probs (..., k)`` of the codes ``codes (..., k)`` as the dense ``(..., num_codes)`` array,
    zero elsewhere."""
    return probs.new_zeros(*probs.shape[:-1], num_codes).scatter(-1, codes, probs)


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


def channel_first_forward(forward_tokens: Callable[[Tensor], QuantizerOutput], z: Tensor, dim: int) -> QuantizerOutput:
    """A channel-last layer's ``forward_tokens`` on feature maps ``z (B, dim, *spatial)``: the tokens are ``z``'s
    channels moved last, and ``quantized`` comes back in ``z``'s layout (``indices`` and ``probs`` stay
    ``(B, *spatial, ...)``)."""
    check_feature_maps(z, dim)
    out = forward_tokens(z.movedim(1, -1))
    return out._replace(quantized=out.quantized.movedim(-1, 1))
