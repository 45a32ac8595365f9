"""Evaluate a trained VQ-VAE checkpoint on the CIFAR-10 test split: reconstruction quality and codebook health.

Usage:
    softvq-evaluate runs/cifar10/ddcl/checkpoints/last.ckpt --data.data_root ../shared/data/cifar10-jpeg.tar.gz
    softvq-evaluate CKPT --data.data_root data --data.download true --out test_metrics.json
    softvq-evaluate --config eval.yaml          # the settings from a file (write one with --print_config)

Prints one JSON object: ``mse``, ``psnr``, ``ssim`` of the soft reconstruction, the same of the reconstruction
decoded from hard indices (``*_hard``; equal to the soft ones for a hard quantizer), and ``utilization``,
``dead_codes``, ``perplexity`` of the hard codes over the split, plus what was evaluated (checkpoint, its sha256,
epochs trained, images). PSNR is per image, then averaged; reconstructions are clamped to ``[0, 1]`` before PSNR and
SSIM, as in training's validation. ``--out`` also saves ``code_counts`` (tokens per code, for usage histograms) and
``config``, the settings as resolved (a file for ``--config``).
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import re
import sys
import time
import warnings
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import lightning as L
from jsonargparse import ArgumentParser
from jsonargparse.typing import PositiveInt
from torch.utils.data import Subset

from softvq.cli.common import Hardware, quiet_lightning, run_command
from softvq.cli.parsing import command_parser, parse, resolved
from softvq.data.cifar10 import CIFAR10DataModule, check_same_classes, sha256_file
from softvq.models.checkpoint_io import load_torch_file
from softvq.models.files import write_atomic
from softvq.models.vqvae import VQVAE, load_vqvae

log = logging.getLogger("eval.evaluate")
METRICS = ("mse", "psnr", "ssim", "mse_hard", "psnr_hard", "ssim_hard", "utilization", "dead_codes", "perplexity")


def checkpoint_epochs(path: Path) -> tuple[int, int]:
    """(training epochs completed, optimizer steps) recorded in a Lightning checkpoint saved at an epoch's end."""
    ckpt = load_torch_file(path, "checkpoint")  # weights_only=True: nothing in the file runs
    return int(ckpt.get("epoch", -1)) + 1, int(ckpt.get("global_step", 0))


def evaluate(
    checkpoint: str | Path,
    data_root: str | Path,
    *,
    batch_size: int = 256,
    limit: int | None = None,
    num_workers: int = 2,
    download: bool = False,
    accelerator: str = "auto",
    progress: bool = True,
    precision: str = "32-true",
    cache_dir: str | Path | None = None,
) -> dict[str, Any]:
    """Test-split metrics of a ``train_vqvae.py`` checkpoint.

    Args:
        checkpoint: a Lightning checkpoint of :class:`models.VQVAE`.
        data_root: CIFAR-10 directory or archive (see :class:`softvq.data.CIFAR10DataModule`).
        batch_size: test images per forward pass.
        limit: evaluate only the first ``limit`` test images (quick runs); ``None`` = all 10,000.
        num_workers: DataLoader worker processes.
        download: allow torchvision to download the official release when nothing is found locally.
        accelerator: Lightning accelerator (``"auto"``, ``"cpu"``, ``"gpu"``, ...).
        progress: show Lightning's progress bar and its informational lines.
        precision: Lightning precision (``"32-true"``, ``"bf16-mixed"``, ...).
        cache_dir: where an archive ``data_root`` is extracted (default :func:`softvq.data.default_cache_dir`).

    Returns:
        ``METRICS`` plus ``checkpoint``, ``checkpoint_sha256``, ``quantizer``, ``num_codes``, ``epochs``,
        ``global_step``, ``split``, ``images``, ``seconds``, ``code_counts`` (a list of ``num_codes`` ints) and
        ``levels``; a hierarchical model (``levels > 1``) adds ``utilization_l<l>``, ``dead_codes_l<l>`` and
        ``perplexity_l<l>`` for every level (the plain keys and ``code_counts`` are level 0's).

    Raises:
        FileNotFoundError: the checkpoint or the data is missing (naming it).
        ValueError: the checkpoint is unsafe to load, truncated or not a VQVAE checkpoint (naming it); the data's
            classes differ from those the checkpoint records; ``limit`` < 1.
    """
    checkpoint = Path(checkpoint)
    if limit is not None and limit < 1:
        raise ValueError(f"limit must be a positive number of images, got {limit}")
    start = time.perf_counter()
    model = load_vqvae(checkpoint)  # clear errors for a missing or truncated file
    data = test_data(model, checkpoint, data_root, batch_size, limit, num_workers, download, cache_dir)
    with warnings.catch_warnings(), contextlib.nullcontext() if progress else quiet_lightning():
        warnings.filterwarnings("ignore", message=".*does not have many workers.*")
        warnings.filterwarnings("ignore", message=".*isinstance\\(treespec, LeafSpec\\)` is deprecated")
        trainer = L.Trainer(accelerator=accelerator, devices=1, precision=precision, logger=False,
                            enable_checkpointing=False, enable_model_summary=False, enable_progress_bar=progress)
        with contextlib.redirect_stdout(sys.stderr):  # Lightning's bar writes to stdout, which is the JSON
            trainer.test(model, datamodule=data, verbose=False)
    result = test_result(model, checkpoint, images=len(data.test_set))
    result["seconds"] = round(time.perf_counter() - start, 2)
    result["code_counts"] = [int(c) for c in model.test_code_counts]
    return result


def test_data(model: VQVAE, checkpoint: Path, data_root: str | Path, batch_size: int, limit: int | None,
              num_workers: int, download: bool, cache_dir: str | Path | None = None) -> CIFAR10DataModule:
    """The test split (its first ``limit`` images), checked to hold the classes the model was trained on."""
    data = CIFAR10DataModule(data_root, batch_size=batch_size, val_size=0, num_workers=num_workers,
                             download=download, cache_dir=cache_dir)
    data.prepare_data()
    data.setup("test")
    if model.class_names is not None:  # labels and codes must mean the classes the model was trained on
        check_same_classes(model.class_names, data.classes, f"checkpoint {checkpoint}", f"the data at {data_root}")
    if limit is not None:
        data.test_set = Subset(data.test_set, range(min(limit, len(data.test_set))))
    return data


def test_result(model: VQVAE, checkpoint: Path, images: int) -> dict[str, Any]:
    """:func:`evaluate`'s record from the model's test summary (without ``seconds`` and ``code_counts``)."""
    epochs, step = checkpoint_epochs(checkpoint)
    summary = model.test_summary
    result: dict[str, Any] = {
        "checkpoint": str(checkpoint), "checkpoint_sha256": sha256_file(checkpoint), "quantizer": model.quantizer_name,
        "num_codes": model.num_codes, "epochs": epochs, "global_step": step, "split": "test", "images": images}
    result.update({name: summary[f"test_{name}"] for name in METRICS})
    result["levels"] = model.levels
    if model.levels > 1:  # every level's usage: utilization_l0, dead_codes_l1, perplexity_l1, ...
        result.update({key.removeprefix("test_"): value for key, value in summary.items()
                       if re.fullmatch(r"test_\w+_l\d+", key)})
    return result


def check_output_file(path: Path) -> None:
    """Refuse an ``--out`` that cannot become a file before the evaluation runs, not after: a directory, a path below a
    file, or an unwritable folder (naming it)."""
    if path.is_dir():
        raise IsADirectoryError(f"--out {path} is a directory; give a file name, e.g. {path / 'test_metrics.json'}")
    parent = path.parent
    while not parent.exists():  # the folders that mkdir would create
        parent = parent.parent
    if not parent.is_dir():
        raise NotADirectoryError(f"--out {path} cannot be written: {parent} is a file, not a directory")
    if not os.access(parent, os.W_OK | os.X_OK):
        raise PermissionError(f"--out {path} cannot be written: no write permission in {parent}")


PROG = "softvq-evaluate"
# What of the shared sections a test-split evaluation uses: the data's location and loader, and one device.
DATA_SKIP = {"val_size", "train_subset", "seed"}
TRAINER_KEEP = {"accelerator", "precision", "progress_bar"}


def build_parser() -> ArgumentParser:
    """The ``softvq-evaluate`` parser: ``--data.*`` from :class:`~softvq.data.CIFAR10DataModule`, ``--trainer.*``
    from :class:`~softvq.cli.common.Hardware`, as in ``softvq-train``."""
    p = command_parser(PROG, __doc__.split("\n\n")[0],
                       epilog="Write a config file with --print_config > eval.yaml and run from it with --config "
                              "eval.yaml (the checkpoint may be given there too).")
    p.add_argument("checkpoint", type=Path, help="a softvq-train checkpoint (e.g. <run>/checkpoints/last.ckpt)")
    p.add_argument("--limit", type=PositiveInt | None, default=None,
                   help="only the first N test images (default: all 10,000)")
    p.add_argument("--out", type=Path | None, default=None,
                   help="also write the JSON (with code_counts and the resolved config) to this file")
    p.add_class_arguments(CIFAR10DataModule, "data", skip=DATA_SKIP)
    p.set_defaults({"data.batch_size": 256})
    p.add_class_arguments(Hardware, "trainer", skip=set(Hardware.__dataclass_fields__) - TRAINER_KEEP)
    return p


def main(argv: list[str] | None = None) -> dict[str, Any]:
    cfg = parse(build_parser(), argv)
    data = CIFAR10DataModule(**cfg.data.as_dict())  # the data module's own checks, before anything runs
    hardware = Hardware(**cfg.trainer.as_dict())
    if cfg.out is not None:
        check_output_file(cfg.out)
    result = evaluate(cfg.checkpoint, data.data_root, batch_size=data.batch_size, limit=cfg.limit,
                      num_workers=data.num_workers, download=data.download, accelerator=hardware.accelerator,
                      progress=hardware.progress_bar, precision=hardware.precision, cache_dir=cfg.data.cache_dir)
    if cfg.out is not None:
        cfg.out.parent.mkdir(parents=True, exist_ok=True)
        write_atomic(cfg.out, json.dumps({**result, "config": resolved(cfg)}, indent=2) + "\n")
    print(json.dumps({k: v for k, v in result.items() if k != "code_counts"}, indent=2))
    return result


def cli(argv: Sequence[str] | None = None) -> int:
    """:func:`main` as a command: expected failures print one ``error:`` line and return 2."""
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    return run_command(main, argv)


if __name__ == "__main__":
    sys.exit(cli())
