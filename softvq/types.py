"""The one return type shared by every softvq quantizer."""

from __future__ import annotations

from typing import NamedTuple

from torch import Tensor


class QuantizerOutput(NamedTuple):
    """What every softvq quantizer returns. The fields never change with constructor flags.

    For an input ``z`` of shape ``(..., D)`` with ``K`` codes:

    Attributes:
        quantized: ``(..., D)``, same shape and dtype as ``z``. For :class:`~softvq.DDCLQuantizer` with its
            defaults the argmax code in the layer's standardised space, carrying the soft centroid's gradient
            (``output_scale="input"``: mapped back to the input's scale; ``hard_output=False`` and
            ``recipe="plain"``: the soft centroid ``mu = probs @ codebook``); for :class:`~softvq.HardVQ` the nearest
            code with a straight-through gradient (in training, the code before that step's EMA update).
        indices: ``(...)`` int64, the nearest code (``argmax_k probs``) of every token.
        probs: ``(..., K)`` float, the assignments; rows sum to 1. One-hot of ``indices`` for ``HardVQ``.
        loss: scalar, the weighted auxiliary objective the layer contributes; add it to the task loss. Exactly 0
            for a :class:`~softvq.DDCLQuantizer` with its defaults (EMA prototypes, no commitment term).
        terms: ``dict[str, Tensor]`` of detached scalar diagnostics (unweighted means). Its keys are fixed per
            quantizer class; see each class's docstring.
    """

    quantized: Tensor
    indices: Tensor
    probs: Tensor
    loss: Tensor
    terms: dict[str, Tensor]
