"""Synthetic data sets for softvq's studies."""

from softvq.datasets.debris import (
    FEATURES,
    REGIMES,
    DebrisConfig,
    OrbitalDebris,
    classify_regime,
    make_orbital_debris,
    orbital_period,
)

__all__ = [
    "FEATURES",
    "REGIMES",
    "DebrisConfig",
    "OrbitalDebris",
    "classify_regime",
    "make_orbital_debris",
    "orbital_period",
]
