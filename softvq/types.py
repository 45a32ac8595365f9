"""The one return type shared by every softvq quantizer, and its value for zero tokens."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterable, Iterator
from typing import Any, ClassVar

import torch
import torch.utils._pytree as pytree
from torch import Tensor

from softvq._checks import check_feature_maps
from softvq._precision import compute_dtype


@dataclasses.dataclass
class QuantizerOutput:
    """What every softvq quantizer returns. The fields never change with constructor flags (only the shape of
    ``probs`` does, under DDCL's ``top_k``).

    **Read it by name** (``out.quantized``, ``out.loss``, ...; ``out._replace(...)``, ``out._asdict()`` and
    ``QuantizerOutput._fields`` as for a NamedTuple, and positional construction in the field order below). **As a
    sequence it is vector-quantize-pytorch's triple** ``(quantized, indices, loss)``: ``quantized, indices,
    commit_loss = quantizer(x)`` unpacks as ``VectorQuantize``'s output does, ``out[0]``, ``out[1]``, ``out[2]`` and
    ``len(out) == 3`` agree with it (``probs``, ``terms`` and ``prob_codes`` only by name). It is a dataclass
    registered as a ``torch.utils._pytree`` node over all six fields, so ``torch.compile``, DDP and
    ``tree_flatten`` / ``tree_unflatten`` see and rebuild every field (a NamedTuple that iterated as three would not
    round-trip: pytree flattens a NamedTuple by iterating it).

    For an input ``z`` of shape ``(..., D)`` with ``K`` codes:

    Attributes:
        quantized: ``(..., D)``, same shape and dtype as ``z``. For :class:`~softvq.DDCLQuantizer` with its
            defaults the argmax code in the layer's standardised space, carrying the soft centroid's gradient
            (``output_scale="input"``: mapped back to the input's scale; ``hard_output=False`` and
            ``recipe="plain"``: the soft centroid ``mu = probs @ codebook``); for :class:`~softvq.HardVQ` the nearest
            code with a straight-through gradient (in training, the code before that step's EMA update).
        indices: ``(...)`` int64, the nearest code (``argmax_k probs``) of every token.
        probs: ``(..., K)`` float, the assignments; rows sum to 1. Under ``DDCLQuantizer(top_k=k)`` with ``k < K``:
            ``(..., k)``, each token's assignments to its ``k`` nearest prototypes, whose codes are ``prob_codes``
            (top-k never builds the dense ``(..., K)`` array; :meth:`dense_probs` builds it where it is needed).
            For ``HardVQ`` the one-hot of ``indices`` in that form: ``(..., 1)`` ones, ``prob_codes`` the indices.
        loss: scalar, the weighted auxiliary objective the layer contributes; add it to the task loss. Exactly 0
            for a :class:`~softvq.DDCLQuantizer` with its defaults (EMA prototypes, no commitment term).
        terms: ``dict[str, Tensor]`` of detached scalar diagnostics (unweighted means). Its keys are fixed per
            quantizer class; see each class's docstring.
        prob_codes: ``None`` where ``probs`` covers every code; under top-k ``(..., k)`` int64 (``HardVQ``:
            ``(..., 1)``), the code of each entry of ``probs``.
    """

    quantized: Tensor
    indices: Tensor
    probs: Tensor
    loss: Tensor
    terms: dict[str, Tensor]
    prob_codes: Tensor | None = None

    _fields: ClassVar[tuple[str, ...]] = ("quantized", "indices", "probs", "loss", "terms", "prob_codes")

    # ---- vector-quantize-pytorch's (quantized, indices, loss) as the sequence ------------------------------------
    def _triple(self) -> tuple[Tensor, Tensor, Tensor]:
        return (self.quantized, self.indices, self.loss)

    def __iter__(self) -> Iterator[Tensor]:
        return iter(self._triple())

    def __len__(self) -> int:
        return 3

    def __getitem__(self, item: int | slice) -> Any:
        return self._triple()[item]

    # ---- NamedTuple's helpers, kept from when this was one ------------------------------------------------------
    def _replace(self, **changes: Any) -> QuantizerOutput:
        """A copy with the named fields replaced (``NamedTuple._replace``)."""
        return dataclasses.replace(self, **changes)

    def _asdict(self) -> dict[str, Any]:
        """``{field: value}`` over all six fields, the values themselves (not copies; ``NamedTuple._asdict``)."""
        return {name: getattr(self, name) for name in self._fields}

    @classmethod
    def _make(cls, values: Iterable[Any]) -> QuantizerOutput:
        """From the six field values in order (``NamedTuple._make``)."""
        return cls(*values)

    def dense_probs(self, num_codes: int | None = None) -> Tensor:
        """``probs`` over all ``num_codes`` codes, ``(..., K)``: ``probs`` itself where it is dense, else the top-k
        assignments scattered into zeros (``num_codes`` is then required)."""
        if self.prob_codes is None:
            return self.probs
        if num_codes is None:
            raise ValueError("dense_probs() of top-k assignments needs num_codes (the K they are scattered into)")
        return scatter_top_k(self.probs, self.prob_codes, num_codes)


def _flatten(out: QuantizerOutput) -> tuple[list[Any], None]:
    return [getattr(out, name) for name in QuantizerOutput._fields], None


def _flatten_with_keys(out: QuantizerOutput) -> tuple[list[tuple[Any, Any]], None]:
    return [(pytree.GetAttrKey(name), getattr(out, name)) for name in QuantizerOutput._fields], None


def _unflatten(values: Iterable[Any], context: None) -> QuantizerOutput:
    return QuantizerOutput(*values)


# All six fields are the node's children (DDP's output hooks, torch.compile and torch.export flatten outputs with
# torch.utils._pytree; an unregistered class would be one opaque leaf).
pytree.register_pytree_node(QuantizerOutput, _flatten, _unflatten, serialized_type_name="softvq.QuantizerOutput",
                            flatten_with_keys_fn=_flatten_with_keys)


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
