"""Fixtures: a tiny CIFAR-10-like data set written to disk in the layouts the data module reads."""

from __future__ import annotations

import tarfile
from pathlib import Path

import numpy as np
import pytest
from PIL import Image

CLASSES = ("airplane", "automobile", "bird", "cat", "deer", "dog", "frog", "horse", "ship", "truck")


def synthetic_images(n: int, seed: int) -> np.ndarray:
    """``n`` smooth 32x32 RGB uint8 images (random colour gradients plus a blob): learnable, not noise."""
    rng = np.random.default_rng(seed)
    yy, xx = np.mgrid[0:32, 0:32] / 31.0
    out = np.empty((n, 32, 32, 3), dtype=np.uint8)
    for i in range(n):
        a, b, c = rng.uniform(-1, 1, size=(3, 3))
        cy, cx, r = rng.uniform(0.2, 0.8), rng.uniform(0.2, 0.8), rng.uniform(0.1, 0.3)
        blob = np.exp(-((yy - cy) ** 2 + (xx - cx) ** 2) / (2 * r * r))
        img = 0.5 + 0.25 * (a[None, None] * yy[..., None] + b[None, None] * xx[..., None]) + 0.3 * c * blob[..., None]
        out[i] = np.clip(img * 255, 0, 255).astype(np.uint8)
    return out


def write_image_folder(root: Path, per_class_train: int, per_class_test: int, seed: int = 0) -> Path:
    """An ImageFolder tree ``root/{train,test}/<class>/NNNN.jpg`` like the shared CIFAR-10 archive."""
    for split, per_class, offset in (("train", per_class_train, 0), ("test", per_class_test, 1000)):
        images = synthetic_images(per_class * len(CLASSES), seed + offset)
        for c, name in enumerate(CLASSES):
            folder = root / split / name
            folder.mkdir(parents=True, exist_ok=True)
            for j in range(per_class):
                Image.fromarray(images[c * per_class + j]).save(folder / f"{j:04d}.jpg", quality=95)
    return root


def write_archive(folder: Path, archive: Path) -> Path:
    with tarfile.open(archive, "w:gz") as tar:
        for split in ("train", "test"):
            tar.add(folder / split, arcname=split)
    return archive


@pytest.fixture(scope="session")
def tiny_cifar(tmp_path_factory) -> dict[str, Path]:
    """300 training and 50 test images as an ImageFolder tree and as a .tar.gz of the same tree."""
    base = tmp_path_factory.mktemp("tiny_cifar")
    folder = write_image_folder(base / "folder", per_class_train=30, per_class_test=5)
    archive = write_archive(folder, base / "tiny-cifar.tar.gz")
    return {"folder": folder, "archive": archive}


@pytest.fixture(autouse=True)
def _private_cache(tmp_path, monkeypatch):
    """Every test extracts archives into its own cache, never into ~/.cache."""
    monkeypatch.setenv("SOFTVQ_CACHE", str(tmp_path / "softvq-cache"))


@pytest.fixture(scope="session")
def uninterrupted_run(tmp_path_factory, tiny_cifar) -> Path:
    """``train_vqvae.py`` with ``helpers.INTERRUPTIBLE`` and DDCL, never interrupted: the reference that the
    interrupt-and-resume tests (SIGKILL, SIGTERM) must end bit-identical to. Trained once per session."""
    import subprocess

    from helpers import INTERRUPTIBLE, train_command, train_env

    out = tmp_path_factory.mktemp("uninterrupted") / "run"
    done = subprocess.run(train_command(tiny_cifar["folder"], out, *INTERRUPTIBLE, "--quantizer", "ddcl"),
                          env=train_env(), capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    return out
