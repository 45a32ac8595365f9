"""How a layer's prototypes start: from the first training batch's tokens (``init="data"``), or drawn from a normal
distribution (``init=NormalInit(scale)``; ``init="normal"`` is ``NormalInit()``)."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

from softvq._checks import check_code_scale, check_float
from softvq.parts._settings import from_mapping

# A coordinate of a N(0, s^2) draw lies beyond 8 s with probability 1.2e-15: prototypes drawn at scale s stay within
# 8 s.
INIT_SIGMAS = 8.0


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


def check_init(value: object, dim: int, name: str = "init") -> NormalInit | str:
    """``value`` as a layer of token dimension ``dim`` takes its ``init`` (:meth:`NormalInit.of`), with a scale whose
    draws keep the squared distances finite in float32 (:func:`softvq._checks.check_code_scale`: within
    :data:`INIT_SIGMAS` standard deviations); else a ``ValueError`` naming ``name``."""
    init = NormalInit.of(value, name)
    if isinstance(init, NormalInit):
        check_code_scale(f"{name}.scale", init.scale, dim, INIT_SIGMAS,
                         f"a normal draw stays within {INIT_SIGMAS:g} standard deviations (beyond them with "
                         f"probability 1.2e-15 per coordinate)")
    return init
