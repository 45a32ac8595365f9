"""Loading trained LightningModules (:class:`softvq.models.VQVAE`, the code prior) from their checkpoints without
running code from the file, with errors that name the file."""

from __future__ import annotations

import os
from pathlib import Path
from typing import TYPE_CHECKING

import lightning as L
import torch

from softvq.models.checkpoint_io import UnsafeCheckpointError, checkpoint_classes, load_torch_file

if TYPE_CHECKING:
    from softvq.models.vqvae import VQVAE


def load_module(cls: type[L.LightningModule], path: str | os.PathLike, what: str,
                map_location: str | torch.device = "cpu") -> L.LightningModule:
    """``cls.load_from_checkpoint(path, weights_only=True)`` in eval mode, with errors that name the file.

    Nothing in the file runs: it is read with ``weights_only=True`` (:mod:`softvq.models.checkpoint_io`). The module
    gets ``class_names``: the data set's class names recorded in the checkpoint
    (:func:`softvq.models.checkpoint_io.checkpoint_classes`), or ``None`` for a checkpoint that records none.

    Raises:
        FileNotFoundError: ``path`` is not a file.
        UnsafeCheckpointError: the file holds objects other than tensors and plain containers (a ValueError).
        ValueError: the file is truncated, corrupt or not a checkpoint of ``cls`` (``what`` names it in the message).
    """
    path = Path(path)
    try:
        checkpoint = load_torch_file(path, f"{what} checkpoint", map_location="cpu")
    except UnsafeCheckpointError:
        raise
    except ValueError as err:
        raise ValueError(f"{what} checkpoint {path} is truncated, corrupt or not a models.{cls.__name__} "
                         f"checkpoint ({err.__cause__.__class__.__name__}: {err.__cause__})") from err
    try:
        module = cls.load_from_checkpoint(path, map_location=map_location, weights_only=True)
    except Exception as err:  # missing keys, another model's checkpoint, ...
        raise ValueError(f"{what} checkpoint {path} is truncated, corrupt or not a models.{cls.__name__} "
                         f"checkpoint ({type(err).__name__}: {' '.join(str(err).split())[:300]})") from err
    module.class_names = checkpoint_classes(checkpoint)
    return module.eval()


def load_vqvae(path: str | os.PathLike, map_location: str | torch.device = "cpu", freeze: bool = True) -> VQVAE:
    """A trained :class:`VQVAE` from a Lightning checkpoint of ``train_vqvae.py``, in eval mode.

    Args:
        path: the ``.ckpt`` file (read with ``weights_only=True``: loading it runs no code).
        map_location: where to load the tensors.
        freeze: also set ``requires_grad=False`` on every parameter.

    Returns:
        The model, with ``class_names`` (the training data's classes, or ``None`` if the checkpoint records none).

    Raises:
        FileNotFoundError: ``path`` is not a file (naming it).
        ValueError: the file is unsafe to load, truncated, corrupt or not a VQVAE checkpoint (naming it and the cause).
    """
    from softvq.models.vqvae import VQVAE  # here, not at the top: vqvae.py re-exports this module's functions

    model = load_module(VQVAE, path, "VQ-VAE", map_location)
    return model.requires_grad_(False) if freeze else model
