"""Data sets: CIFAR-10 for the VQ-VAE trainer (``cifar10``), the synthetic orbital-debris catalogue (``debris``) and
``GlobalBatchSampler`` (``sampling``: one process's share of global batches, in an order set by seed and epoch).

``CIFAR10DataModule`` and its helpers are imported on first use, so that the debris generator does not pull in
Lightning and torchvision.
"""

from softvq.datasets.debris import (
    FEATURES,
    REGIMES,
    DebrisConfig,
    OrbitalDebris,
    classify_regime,
    make_orbital_debris,
    orbital_period,
)
from softvq.datasets.sampling import GlobalBatchSampler

_CIFAR10 = ("BadImageError", "CIFAR10DataModule", "ClassMismatchError", "CorruptArchiveError", "DataNotFoundError",
            "UnsafeArchiveError", "extract_archive", "resolve_cifar10")


def __getattr__(name: str):
    if name in _CIFAR10:
        from softvq.datasets import cifar10

        return getattr(cifar10, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


__all__ = [
    *_CIFAR10,
    "FEATURES",
    "GlobalBatchSampler",
    "REGIMES",
    "DebrisConfig",
    "OrbitalDebris",
    "classify_regime",
    "make_orbital_debris",
    "orbital_period",
]
