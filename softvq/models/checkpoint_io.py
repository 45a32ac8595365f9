"""Loading the files this project writes with ``torch.save`` (checkpoints, code caches) without running code, and
the global RNG states a VQ-VAE checkpoint carries in plain types (:func:`save_rng_state`, :func:`load_rng_state`).

A ``.ckpt`` or ``.pt`` file is a pickle: unpickled in full it can execute anything its author chose. Every loader
here passes ``weights_only=True`` explicitly (so ``TORCH_FORCE_NO_WEIGHTS_ONLY_LOAD=1`` cannot turn it off): tensors,
numbers, strings and plain containers load, anything else is refused with one line that names the file. This
project's own files hold only those types.
"""

from __future__ import annotations

import os
import pickle
import random
import re
from pathlib import Path
from typing import Any

import numpy as np
import torch

# Lightning saves a data module's ``state_dict()`` under its class name; CIFAR10DataModule's holds the class names.
DATA_STATE_KEY = "CIFAR10DataModule"


def checkpoint_classes(checkpoint: dict[str, Any]) -> tuple[str, ...] | None:
    """The class names a training checkpoint records (the CIFAR-10 data module's state), ``None`` if none."""
    state = checkpoint.get(DATA_STATE_KEY) if isinstance(checkpoint, dict) else None
    classes = state.get("classes") if isinstance(state, dict) else None
    return tuple(str(c) for c in classes) if isinstance(classes, list | tuple) else None


class UnsafeCheckpointError(ValueError):
    """A file that ``torch.load(weights_only=True)`` refuses: it holds Python objects that loading would construct
    (and so could run code)."""


def _one_line(err: BaseException) -> str:
    """The error's message on one line, without torch's weights_only boilerplate around the actual reason."""
    text = " ".join(str(err).split())
    reason = (re.search(r"WeightsUnpickler error: (.*?) Check the documentation", text)
              or re.search(r"trusted source\. (.*?) Check the documentation", text))
    text = reason.group(1) if reason else text
    return text if len(text) <= 200 else text[:197] + "..."


def _builds_objects(err: pickle.UnpicklingError) -> bool:
    """Whether torch's weights-only unpickler refused the file for naming a function or class to call (a GLOBAL
    such as ``os.system``, or an object to construct): an unsafe file, as opposed to an unreadable one."""
    text = str(err)
    return "Weights only load failed" in text and ("GLOBAL" in text or "Can only" in text)


def load_torch_file(path: str | os.PathLike, what: str = "checkpoint",
                    map_location: str | torch.device = "cpu") -> Any:
    """``torch.load(path, weights_only=True)`` with errors that name the file.

    Args:
        path: the file.
        what: what it is, for the messages (``"checkpoint"``, ``"VQ-VAE checkpoint"``, ``"code cache"``).
        map_location: where to load the tensors.

    Raises:
        FileNotFoundError: ``path`` is not a file.
        UnsafeCheckpointError: the file holds objects other than tensors and plain containers; nothing in it ran.
        ValueError: the file is truncated or corrupt (not a ``torch.save`` file at all).
    """
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"{what} not found: {path}")
    try:
        return torch.load(path, map_location=map_location, weights_only=True)
    except pickle.UnpicklingError as err:
        if not _builds_objects(err):  # garbage, or a pickle that is not a torch.save file: refused all the same
            raise ValueError(f"{what} {path} is truncated or corrupt ({type(err).__name__}: {_one_line(err)})") \
                from err
        raise UnsafeCheckpointError(
            f"{what} {path} is unsafe to load: it holds Python objects other than tensors and plain containers "
            f"({_one_line(err)}), which loading would construct and which could run code; refused, nothing in it ran "
            f"(this project writes no such files)") from err
    except Exception as err:  # truncated zip, not a torch file, ...
        raise ValueError(f"{what} {path} is truncated or corrupt ({type(err).__name__}: {_one_line(err)})") from err


def save_rng_state(checkpoint: dict[str, Any]) -> None:
    """Put the global RNG states (torch, Python, NumPy) into a Lightning ``checkpoint`` under ``"softvq_rng"``, so a
    resumed run draws the same data order and restarts as an uninterrupted one (exactly so with num_workers=0 or
    non-persistent workers on CPU; Lightning does not save them itself). Plain types only, so that Lightning's
    weights_only loading accepts the checkpoint."""
    name, keys, pos, has_gauss, cached = np.random.get_state()
    checkpoint["softvq_rng"] = {"torch": torch.get_rng_state(), "python": random.getstate(),
                                "numpy": [name, torch.from_numpy(keys.astype(np.int64)), int(pos),
                                          int(has_gauss), float(cached)]}


def load_rng_state(checkpoint: dict[str, Any]) -> None:
    """Restore the global RNG states :func:`save_rng_state` put into ``checkpoint`` (nothing if it has none)."""
    state = checkpoint.get("softvq_rng")
    if state is not None:
        torch.set_rng_state(state["torch"])
        random.setstate(state["python"])
        name, keys, pos, has_gauss, cached = state["numpy"]
        np.random.set_state((name, keys.numpy().astype(np.uint32), pos, has_gauss, cached))
