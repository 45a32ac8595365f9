"""Loading trained LightningModules (:class:`softvq.models.VQVAE`, the code prior) from their checkpoints without
running code from the file, with errors that name the file. A leaf: it imports no model module (each model's
loader, e.g. :func:`softvq.models.vqvae.load_vqvae`, lives beside its class and calls :func:`load_module`)."""

from __future__ import annotations

import os
from pathlib import Path

import lightning as L
import torch

from softvq.models.checkpoint_io import UnsafeCheckpointError, _one_line, checkpoint_classes, load_torch_file


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
        cause = err.__cause__ or err  # torch's text is many lines of advice around the reason: keep the reason
        raise ValueError(f"{what} checkpoint {path} is truncated, corrupt or not a models.{cls.__name__} "
                         f"checkpoint ({type(cause).__name__}: {_one_line(cause)})") from err
    try:
        module = cls.load_from_checkpoint(path, map_location=map_location, weights_only=True)
    except Exception as err:  # missing keys, another model's checkpoint, ...
        raise ValueError(f"{what} checkpoint {path} is truncated, corrupt or not a models.{cls.__name__} "
                         f"checkpoint ({type(err).__name__}: {_one_line(err)})") from err
    module.class_names = checkpoint_classes(checkpoint)
    return module.eval()
