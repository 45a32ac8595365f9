"""The steps every settings class of :mod:`softvq.parts` (``Restart``, ``NormalInit``, ``Ema`` / ``Gradient``,
``EntropyControl``, ``Commitment``) shares: a mapping of its fields, as a config file or the trainer's flags give it,
built into the class, with an error that names the option and the fields it takes; and what an option's ``"auto"``
is (:func:`is_auto`)."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import fields
from typing import Any


def from_mapping(cls: type, value: Mapping[str, Any], option: str) -> Any:
    """``cls(**value)``; a ``ValueError`` naming ``option`` and ``cls``'s fields for a key it does not have."""
    names = [f.name for f in fields(cls)]
    unknown = set(value) - set(names)
    if unknown:
        raise ValueError(f"{option}: unknown field(s) {sorted(unknown)}; {cls.__name__} takes {', '.join(names)}")
    return cls(**value)


def is_auto(value: object) -> bool:
    """Whether an option was given ``"auto"`` (the recipe's value): a string equal to it, never a tensor or array."""
    return isinstance(value, str) and value == "auto"
