"""Evaluate a trained VQ-VAE checkpoint on the CIFAR-10 test split: reconstruction quality and codebook health.

Usage:
    python -m eval.evaluate runs/cifar10/ddcl/checkpoints/last.ckpt --data-root ../shared/data/cifar10-jpeg.tar.gz
    python -m eval.evaluate CKPT --data-root data --download --out test_metrics.json

Prints one JSON object: ``mse``, ``psnr``, ``ssim`` of the soft reconstruction, the same of the reconstruction
decoded from hard indices (``*_hard``; equal to the soft ones for a hard quantizer), and ``utilization``,
``dead_codes``, ``perplexity`` of the hard codes over the split, plus what was evaluated (checkpoint, its sha256,
epochs trained, images). PSNR is per image, then averaged; reconstructions are clamped to ``[0, 1]`` before PSNR and
SSIM, as in training's validation. ``--out`` also saves ``code_counts`` (tokens per code, for usage histograms).
"""

from __future__ import annotations

import argparse
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
from torch.utils.data import Subset

from softvq.cli.common import HelpFormatter, quiet_lightning, run_command
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
    data = test_data(model, checkpoint, data_root, batch_size, limit, num_workers, download)
    with warnings.catch_warnings(), contextlib.nullcontext() if progress else quiet_lightning():
        warnings.filterwarnings("ignore", message=".*does not have many workers.*")
        warnings.filterwarnings("ignore", message=".*isinstance\\(treespec, LeafSpec\\)` is deprecated")
        trainer = L.Trainer(accelerator=accelerator, devices=1, logger=False, enable_checkpointing=False,
                            enable_model_summary=False, enable_progress_bar=progress)
        with contextlib.redirect_stdout(sys.stderr):  # Lightning's bar writes to stdout, which is the JSON
            trainer.test(model, datamodule=data, verbose=False)
    result = test_result(model, checkpoint, images=len(data.test_set))
    result["seconds"] = round(time.perf_counter() - start, 2)
    result["code_counts"] = [int(c) for c in model.test_code_counts]
    return result


def test_data(model: VQVAE, checkpoint: Path, data_root: str | Path, batch_size: int, limit: int | None,
              num_workers: int, download: bool) -> CIFAR10DataModule:
    """The test split (its first ``limit`` images), checked to hold the classes the model was trained on."""
    data = CIFAR10DataModule(data_root, batch_size=batch_size, val_size=0, num_workers=num_workers,
                             download=download)
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


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=HelpFormatter)
    p.add_argument("checkpoint", type=Path, help="a train_vqvae.py checkpoint (e.g. <run>/checkpoints/last.ckpt)")
    p.add_argument("--data-root", type=Path, default=Path("data"), help="CIFAR-10 directory or .tar.gz archive")
    p.add_argument("--download", action="store_true", help="download the official CIFAR-10 if none is found")
    p.add_argument("--batch-size", type=int, default=256, help="test images per batch")
    p.add_argument("--limit", type=int, default=None, help="only the first N test images (default: all 10,000)")
    p.add_argument("--num-workers", type=int, default=2, help="DataLoader worker processes")
    p.add_argument("--accelerator", default="auto", help="Lightning accelerator")
    p.add_argument("--out", type=Path, default=None, help="also write the JSON (with code_counts) to this file")
    p.add_argument("--no-progress-bar", action="store_true", help="disable the progress bar")
    return p


def main(argv: list[str] | None = None) -> dict[str, Any]:
    args = build_parser().parse_args(argv)
    for name in ("batch_size", "limit"):
        value = getattr(args, name)
        if value is not None and value < 1:
            raise ValueError(f"--{name.replace('_', '-')} must be a positive integer, got {value}")
    if args.num_workers < 0:
        raise ValueError(f"--num-workers must be >= 0, got {args.num_workers}")
    if args.out is not None:
        check_output_file(args.out)
    result = evaluate(args.checkpoint, args.data_root, batch_size=args.batch_size, limit=args.limit,
                      num_workers=args.num_workers, download=args.download, accelerator=args.accelerator,
                      progress=not args.no_progress_bar)
    if args.out is not None:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        write_atomic(args.out, json.dumps(result, indent=2) + "\n")
    print(json.dumps({k: v for k, v in result.items() if k != "code_counts"}, indent=2))
    return result


def cli(argv: Sequence[str] | None = None) -> int:
    """:func:`main` as a command: expected failures print one ``error:`` line and return 2."""
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    return run_command(main, argv)


if __name__ == "__main__":
    sys.exit(cli())
