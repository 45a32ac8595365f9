"""How a layer's prototypes start: from the first training batch's tokens (``init="data"``), or drawn from a normal
distribution (``init=NormalInit(scale)``; ``init="normal"`` is ``NormalInit()``)."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

from softvq._checks import check_float
from softvq.parts._settings import from_mapping


@dataclass(frozen=True)
class NormalInit:
    """Prototypes drawn from ``N(0, scale^2)`` when the layer is built (no data initialisation).

    Args:
        scale: the standard deviation (``> 0``).
    """

    scale: float = 1.0

    def __post_init__(self) -> None:
        object.__setattr__(self, "scale", check_float("init.scale", self.scale))

    @classmethod
    def of(cls, value: object, name: str = "init") -> NormalInit | str:
        """``value`` as a layer's ``init`` option takes it: ``"data"``, ``"normal"`` (``NormalInit()``), a
        :class:`NormalInit` or a mapping of its fields (a config file's); anything else is a ``ValueError`` naming
        ``name``."""
        if isinstance(value, cls) or (isinstance(value, str) and value == "data"):
            return value
        if isinstance(value, str) and value == "normal":
            return cls()
        if isinstance(value, Mapping):
            return from_mapping(cls, value, name)
        raise ValueError(f"{name} must be 'data', 'normal', a softvq.parts.NormalInit or a mapping of its fields, "
                         f"got {value!r}")
