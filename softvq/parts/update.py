"""How a layer's prototypes move: :class:`Ema`, an EMA k-means step the layer takes itself
(:class:`softvq.parts.EmaPrototypes`), or :class:`Gradient`, a term of the layer's loss that the optimizer follows.
:class:`softvq.DDCLQuantizer`'s ``prototype_update`` option takes either (``"ema"``, ``"soft_ema"`` and ``"gradient"``
name them with their defaults), so that the options of the other way are not there to set. And the encoder's side of
the loss: :class:`Commitment`, a commitment term other than VQ-VAE's, as ``commitment_weight`` takes it."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, fields
from typing import Any, Literal

from softvq._checks import check_bool, check_choice, check_unit, check_weight
from softvq.parts._settings import from_mapping

TERMS = ("l_q", "l_ols", "free_energy")  # the terms of the layer's loss a codebook or commitment term may be


@dataclass(frozen=True)
class Ema:
    """Prototypes moved by the layer every training step toward the mean of their tokens (not by the optimizer).

    Args:
        decay: the EMA's decay in ``(0, 1)``.
        soft: weight every token by its assignment ``q`` (the free-energy M-step; ``"soft_ema"``) instead of moving
            each prototype toward the tokens it wins (a k-means step; ``"ema"``).
    """

    decay: float = 0.99
    soft: bool = False

    def __post_init__(self) -> None:
        object.__setattr__(self, "decay", check_unit("prototype_update.decay", self.decay))
        object.__setattr__(self, "soft", check_bool("prototype_update.soft", self.soft))

    @property
    def kind(self) -> str:
        return "soft_ema" if self.soft else "ema"


@dataclass(frozen=True)
class Gradient:
    """Prototypes trained by the optimizer on a term of the layer's loss that reaches only them (then use
    :func:`softvq.param_groups` for their learning rate).

    Args:
        term: ``"free_energy"`` (``-T log sum_k exp(-d_k / T)``, attraction only: soft k-means), ``"l_q"`` (its
            gradient pushes prototypes beyond the average distance plus ``T`` farther away) or ``"l_ols"``; why the
            free energy is the default: docs/design.md, "The plain-layer recipe (the model's help)".
        weight: its weight (``>= 0``, at most :data:`softvq._checks.MAX_WEIGHT`: 1.8e19, so that it times the term
            stays a finite float32).
    """

    term: Literal["free_energy", "l_q", "l_ols"] = "free_energy"
    weight: float = 1.0

    def __post_init__(self) -> None:
        object.__setattr__(self, "term", check_choice("prototype_update.term", self.term, TERMS))
        object.__setattr__(self, "weight", check_weight("prototype_update.weight", self.weight))

    @property
    def kind(self) -> str:
        return "gradient"


@dataclass(frozen=True)
class Commitment:
    """A commitment of the encoder to the codebook by a term other than VQ-VAE's, as
    :class:`softvq.DDCLQuantizer`'s ``commitment_weight`` takes it: ``commitment_weight=Commitment(0.25, "l_ols")``. A
    number alone is the weight of the ``"hard"`` term (0: no commitment).

    Args:
        weight: its weight (``> 0``, at most :data:`softvq._checks.MAX_WEIGHT`).
        term: ``"hard"`` (``||z - sg[p_argmax]||^2``, VQ-VAE's), ``"l_ols"`` (to the soft centroid), ``"l_q"`` or
            ``"free_energy"`` (docs/design.md, "Collapse-free defaults").
    """

    weight: float
    term: Literal["hard", "l_q", "l_ols", "free_energy"] = "hard"

    def __post_init__(self) -> None:
        object.__setattr__(self, "weight", check_weight("commitment_weight.weight", self.weight, allow_zero=False))
        object.__setattr__(self, "term", check_choice("commitment_weight.term", self.term, ("hard", *TERMS)))

    @classmethod
    def of(cls, value: object) -> Any:
        """A mapping of the fields (a config file's) as a :class:`Commitment`; anything else as it is."""
        return from_mapping(cls, value, "commitment_weight") if isinstance(value, Mapping) else value


_NAMED = {"ema": Ema(), "soft_ema": Ema(soft=True), "gradient": Gradient()}


def prototype_update_of(value: object, auto: Ema | Gradient) -> Ema | Gradient:
    """``value`` as ``prototype_update`` takes it: ``"auto"`` (``auto``, the recipe's), a name of :data:`_NAMED`, an
    :class:`Ema` or :class:`Gradient`, or a mapping of one's fields (a config file's); else a ``ValueError``."""
    if isinstance(value, Ema | Gradient):
        return value
    if isinstance(value, str) and (value == "auto" or value in _NAMED):
        return auto if value == "auto" else _NAMED[value]
    if isinstance(value, Mapping):
        for cls in (Ema, Gradient):
            if value and set(value) <= {f.name for f in fields(cls)}:
                return cls(**value)
        raise ValueError(f"prototype_update: the fields {sorted(value)} are neither Ema's (decay, soft) nor "
                         f"Gradient's (term, weight)")
    raise ValueError(f"prototype_update must be 'auto', 'ema', 'soft_ema', 'gradient', a softvq.parts.Ema or "
                     f"Gradient, or a mapping of one's fields, got {value!r}")
