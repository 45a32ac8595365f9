"""Which VQ-VAE a prior's codes come from, and the check that refuses to pair a prior with a VQ-VAE whose codes it
does not model. A :class:`~softvq.models.CodePrior` records the VQ-VAE (path, SHA-256, ``K``, latent grid) in its
hyperparameters as a plain dict; these names are also importable from :mod:`softvq.models.prior`.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Sequence
from dataclasses import dataclass

from torch import nn

from softvq.models.vqvae import VQVAE

log = logging.getLogger("softvq")


@dataclass(frozen=True)
class VQVAERecord:
    """Which VQ-VAE a prior's codes come from; saved in the prior's hyperparameters."""

    path: str  # the VQ-VAE checkpoint the training codes were extracted from, as it was given
    sha256: str  # that file's SHA-256: the identity sample.py checks (paths move, contents do not)
    num_codes: int  # K, the codebook size
    height: int  # rows of the latent grid
    width: int  # columns of the latent grid
    quantizer: str  # the VQ-VAE's quantizer ("ddcl", "hard", or a class name)
    image_size: int = 32  # side of the square images the codes were extracted from
    classes: list[str] | None = None  # the data's class names in label order (a conditional prior's labels); None: old


def latent_grid(model: VQVAE, image_size: int = 32) -> tuple[int, int]:
    """``(h, w)`` of the code grid ``model.encode`` gives for square images of side ``image_size``."""
    factor = 2 ** model.downsamples
    return image_size // factor, image_size // factor


def vqvae_record(model: VQVAE, path: str | os.PathLike, sha256: str, image_size: int = 32,
                 classes: Sequence[str] | None = None) -> VQVAERecord:
    """The :class:`VQVAERecord` of a loaded VQ-VAE checkpoint (``classes``: the data's class names, label order)."""
    h, w = latent_grid(model, image_size)
    return VQVAERecord(str(path), sha256, int(model.num_codes), h, w, str(model.quantizer_name), image_size,
                       None if classes is None else list(classes))


def check_pairing(prior: nn.Module, vqvae: VQVAE, sha256: str, vqvae_path: str | os.PathLike = "the VQ-VAE",
                  allow_other_vqvae: bool = False) -> None:
    """Refuse to pair a prior with a VQ-VAE whose codes it does not model.

    Args:
        prior: a trained prior (its :attr:`CodePrior.vqvae` record is compared).
        vqvae: the VQ-VAE that will decode the samples.
        sha256: SHA-256 of that VQ-VAE's checkpoint file.
        vqvae_path: its path, for the messages.
        allow_other_vqvae: accept a VQ-VAE of the same ``K`` and grid but another checkpoint (a warning only).

    Raises:
        ValueError: no record in the prior; another ``K``; another latent grid; another checkpoint (unless
            ``allow_other_vqvae``). Each message names both sides.
    """
    rec = prior.vqvae
    if rec is None:
        raise ValueError("this prior holds no record of the VQ-VAE its codes came from (it was not trained by "
                         "train_prior.py), so no VQ-VAE can be checked against it")
    origin = f"the VQ-VAE it was trained on ({rec.path}, sha256 {rec.sha256[:16]}...)"
    if vqvae.num_codes != rec.num_codes:
        raise ValueError(f"the prior models codes of a VQ-VAE with K={rec.num_codes} codes, but {vqvae_path} has "
                         f"K={vqvae.num_codes}; decode its samples with {origin}")
    grid = latent_grid(vqvae, rec.image_size)
    if grid != (rec.height, rec.width):
        raise ValueError(f"the prior models {rec.height}x{rec.width} code grids, but {vqvae_path} encodes "
                         f"{rec.image_size}x{rec.image_size} images into {grid[0]}x{grid[1]} grids; decode its "
                         f"samples with {origin}")
    if sha256 != rec.sha256:
        message = (f"{vqvae_path} (sha256 {sha256[:16]}...) is not {origin}: same K={rec.num_codes} and grid, but "
                   f"other codes, so the samples would be meaningless")
        if not allow_other_vqvae:
            raise ValueError(message + "; pass the original checkpoint (or --allow-other-vqvae to decode anyway)")
        log.warning(message)
