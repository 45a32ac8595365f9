"""What a :class:`~softvq.models.VQVAE` refuses: images of the wrong shape or type (:func:`check_images`, on every
call), and a training batch with NaN/Inf pixels or latents (:func:`check_finite_batch`, every training step).
"""

from __future__ import annotations

import torch
from torch import Tensor

from softvq._collectives import all_reduce_sum_


def check_images(x: Tensor, in_channels: int, downsamples: int) -> None:
    """A ValueError unless ``x`` is a batch of float images ``(B, in_channels, H, W)`` whose sides are multiples of
    ``2^downsamples`` (what the encoder's strides divide)."""
    factor = 2 ** downsamples
    if not isinstance(x, Tensor) or x.ndim != 4 or x.shape[1] != in_channels:
        shape = tuple(x.shape) if isinstance(x, Tensor) else type(x).__name__
        raise ValueError(f"expected images of shape (B, {in_channels}, H, W), got {shape}")
    if x.shape[2] % factor or x.shape[3] % factor:
        raise ValueError(f"image height and width must be multiples of {factor} (2^downsamples), "
                         f"got {tuple(x.shape[2:])}")
    if not x.is_floating_point():
        raise ValueError(f"expected float images in [0, 1], got dtype {x.dtype}")


def check_finite_batch(x: Tensor, latents: Tensor, where: str) -> None:
    """Stops on NaN/Inf pixels (corrupt data) or latents (diverged training), naming ``where``.

    Counted over every process (one all-reduce under DDP), so that all of them stop at the same step instead of
    the others waiting forever in the next collective.
    """
    counts = torch.stack([(~torch.isfinite(x)).sum(), (~torch.isfinite(latents)).sum(),
                          torch.tensor(x.numel(), device=x.device), torch.tensor(latents.numel(), device=x.device)])
    bad_pixels, bad_latents, pixels, values = all_reduce_sum_(counts).tolist()
    if bad_pixels:
        raise FloatingPointError(f"{where} holds {bad_pixels} NaN/Inf pixel value(s) out of {pixels}: the "
                                 f"data is corrupt")
    if bad_latents:
        raise FloatingPointError(f"the encoder produced {bad_latents} NaN/Inf latent value(s) out of {values} in "
                                 f"{where}: training diverged (lower --lr?)")
