"""Data for the VQ-VAE trainer (needs the ``train`` extra): offline-capable CIFAR-10 (:mod:`softvq.data.cifar10`) and
``GlobalBatchSampler`` (:mod:`softvq.data.sampling`: one process's share of global batches, in an order set by seed
and epoch, so N processes see the batches of one process with N times the batch size)."""

from softvq.data.cifar10 import (
    CLASSES,
    BadImageError,
    CIFAR10DataModule,
    ClassMismatchError,
    CorruptArchiveError,
    DataNotFoundError,
    UnsafeArchiveError,
    check_same_classes,
    extract_archive,
    resolve_cifar10,
    sha256_file,
)
from softvq.data.sampling import GlobalBatchSampler

__all__ = ["CLASSES", "BadImageError", "CIFAR10DataModule", "ClassMismatchError", "CorruptArchiveError",
           "DataNotFoundError", "GlobalBatchSampler", "UnsafeArchiveError", "check_same_classes", "extract_archive",
           "resolve_cifar10", "sha256_file"]
