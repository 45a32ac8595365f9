"""CVQ-VAE's reconstruction metric: the mean over test images of the per-image PSNR of 8-bit images.

:func:`psnr_8bit` is the pure function; :class:`EightBitPSNR` applies it to every batch ``Trainer.test`` reads, with
the model's hard codes decoded (``model.decode_indices(model.encode(x))``).
"""

from __future__ import annotations

import math
from typing import Any

import lightning as L
import torch
from torch import Tensor

LEVELS = 255  # the largest 8-bit value, the PSNR's peak


def psnr_8bit(reconstruction: Tensor, target: Tensor) -> Tensor:
    """Per-image PSNR of the 8-bit versions of two image batches, in dB.

    Both batches are clamped to ``[0, 1]`` and rounded to the 256 levels ``round(255 x)`` (round half to even, as
    ``torch.round``); each image's PSNR is ``10 log10(255^2 / MSE)`` over its ``C * H * W`` level values.

    A perfect image (MSE 0) would score infinity. It scores as if one of its values were one level off instead,
    ``10 log10(255^2 * C * H * W)`` (83.0 dB at 3 x 32 x 32): the highest score of any imperfect 8-bit image, so
    the mean over images stays finite and no image scores above a perfect one.

    Args:
        reconstruction: ``(B, ...)`` images in ``[0, 1]`` units (not clamped); all dimensions after the first are one
            image.
        target: the reference images, the same shape.

    Returns:
        ``(B,)`` float64, one PSNR per image.

    Raises:
        ValueError: the shapes differ, or a batch has no image dimension.
    """
    if reconstruction.shape != target.shape:
        raise ValueError(f"reconstruction and target must have the same shape, got {tuple(reconstruction.shape)} "
                         f"and {tuple(target.shape)}")
    if reconstruction.ndim < 2 or reconstruction[0].numel() == 0:
        raise ValueError(f"expected a batch of images (B, ...), got shape {tuple(reconstruction.shape)}")
    rec = torch.round(reconstruction.detach().double().clamp(0.0, 1.0) * LEVELS)  # integer levels 0..255
    ref = torch.round(target.detach().double().clamp(0.0, 1.0) * LEVELS)
    mse = (rec - ref).square().flatten(1).mean(1)  # (B,)
    values = rec[0].numel()
    mse = mse.clamp_min(1.0 / values)  # the smallest non-zero MSE of integer images: one value one level off
    return 10.0 * torch.log10(LEVELS**2 / mse)


def perfect_psnr_8bit(values: int) -> float:
    """The score :func:`psnr_8bit` gives a perfect image of ``values`` level values (``C * H * W``)."""
    return 10.0 * math.log10(LEVELS**2 * values)


class EightBitPSNR(L.Callback):
    """:func:`psnr_8bit` of every image ``Trainer.test`` reads, the reconstruction decoded from the model's hard codes
    (``pl_module.decode_indices(pl_module.encode(x))``, the model in eval mode as the test loop leaves it).

    After the test, :attr:`mean` is the mean over the images (CVQ-VAE's metric) and :attr:`images` their number.
    """

    def __init__(self) -> None:
        self._total = 0.0
        self.images = 0

    def on_test_epoch_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self._total, self.images = 0.0, 0

    def on_test_batch_end(self, trainer: L.Trainer, pl_module: L.LightningModule, outputs: Any, batch: Any,
                          batch_idx: int, dataloader_idx: int = 0) -> None:
        x = batch[0]
        values = psnr_8bit(pl_module.decode_indices(pl_module.encode(x)), x)
        self._total += float(values.sum())
        self.images += values.numel()

    @property
    def mean(self) -> float:
        """The mean per-image 8-bit PSNR over the test images read (NaN before any)."""
        return self._total / self.images if self.images else float("nan")
