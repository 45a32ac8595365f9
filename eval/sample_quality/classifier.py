"""A CIFAR-10 classifier trained here, and the Fréchet distance of its features: sample quality without downloads.

No Inception weights can be fetched on this machine, so samples are scored with a small ResNet trained once on the
training split. Its penultimate features (global-average-pooled, ``FEATURES`` wide) feed torchmetrics'
``FrechetInceptionDistance`` as a custom feature extractor: the library computes the statistic. The number is a
*classifier Fréchet distance* (called so in every report), not Inception FID, and is comparable only between runs
that use the same classifier file, whose SHA-256 each report records.

The classifier is cached under ``cache_dir`` by the hash of its training settings; beside the weights
(``classifier-<key>.pt``, loaded with ``weights_only=True``) a record (``classifier-<key>.json``) holds the file's
SHA-256 and its accuracies. A weights file whose hash is not the recorded one is refused.
"""

from __future__ import annotations

import hashlib
import json
import logging
import time
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.utils.data import DataLoader, Dataset, Subset
from torchmetrics.image.fid import FrechetInceptionDistance

from softvq.data.archive import sha256_file
from softvq.models.checkpoint_io import load_torch_file
from softvq.models.files import write_atomic

log = logging.getLogger("eval.classifier")
CACHE_VERSION = 1


class _Block(nn.Module):
    def __init__(self, c_in: int, c_out: int, stride: int) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(c_in, c_out, 3, stride, 1, bias=False)
        self.bn1 = nn.BatchNorm2d(c_out)
        self.conv2 = nn.Conv2d(c_out, c_out, 3, 1, 1, bias=False)
        self.bn2 = nn.BatchNorm2d(c_out)
        self.skip = (nn.Sequential(nn.Conv2d(c_in, c_out, 1, stride, bias=False), nn.BatchNorm2d(c_out))
                     if stride != 1 or c_in != c_out else nn.Identity())

    def forward(self, x: Tensor) -> Tensor:
        y = F.relu(self.bn1(self.conv1(x)))
        return F.relu(self.bn2(self.conv2(y)) + self.skip(x))


class SmallResNet(nn.Module):
    """A ResNet of three stages (``width``, ``2 width``, ``4 width`` channels, one basic block each) for 32x32 RGB in
    ``[0, 1]``. :meth:`features` is the ``4 width`` global-average-pooled penultimate layer."""

    def __init__(self, width: int = 32, num_classes: int = 10) -> None:
        super().__init__()
        self.width, self.num_classes = width, num_classes
        self.stem = nn.Sequential(nn.Conv2d(3, width, 3, 1, 1, bias=False), nn.BatchNorm2d(width), nn.ReLU())
        self.stages = nn.Sequential(_Block(width, width, 1), _Block(width, 2 * width, 2),
                                    _Block(2 * width, 4 * width, 2))
        self.head = nn.Linear(4 * width, num_classes)
        # CIFAR-10 channel statistics: inputs are [0, 1] images, as the VQ-VAE decodes them
        self.register_buffer("mean", torch.tensor([0.4914, 0.4822, 0.4465]).view(1, 3, 1, 1))
        self.register_buffer("std", torch.tensor([0.2470, 0.2435, 0.2616]).view(1, 3, 1, 1))

    @property
    def num_features(self) -> int:
        return 4 * self.width

    def features(self, x: Tensor) -> Tensor:
        if x.ndim != 4 or x.shape[1] != 3:
            raise ValueError(f"expected images of shape (B, 3, H, W), got {tuple(x.shape)}")
        return self.stages(self.stem((x.float() - self.mean) / self.std)).mean((2, 3))

    def forward(self, x: Tensor) -> Tensor:
        return self.head(self.features(x))


class FeatureExtractor(nn.Module):
    """The classifier's penultimate features as torchmetrics' custom ``feature`` network (``num_features`` set, so
    torchmetrics runs no probe image through it); frozen, in eval mode."""

    def __init__(self, classifier: SmallResNet) -> None:
        super().__init__()
        self.classifier = classifier.eval().requires_grad_(False)
        self.num_features = classifier.num_features

    def forward(self, x: Tensor) -> Tensor:
        return self.classifier.features(x).double()

    def train(self, mode: bool = True) -> FeatureExtractor:  # torchmetrics may call .train(); stay frozen
        super().train(False)
        return self


class _Given(nn.Module):
    """Features already computed, passed through: lets the bootstrap resample features, not images."""

    def __init__(self, num_features: int) -> None:
        super().__init__()
        self.num_features = num_features

    def forward(self, x: Tensor) -> Tensor:
        return x.double()


def frechet_distance(real: Tensor, fake: Tensor) -> float:
    """The Fréchet distance between the Gaussians fitted to feature sets ``real (N, d)`` and ``fake (M, d)``, as
    torchmetrics' ``FrechetInceptionDistance`` computes it (float64)."""
    for name, x in (("real", real), ("fake", fake)):
        if x.ndim != 2 or x.shape[0] < 2:
            raise ValueError(f"{name} features must be (N >= 2, d), got {tuple(x.shape)}")
        if not torch.isfinite(x).all():
            raise ValueError(f"{name} features hold NaN or Inf")
    if real.shape[1] != fake.shape[1]:
        raise ValueError(f"feature widths differ: {real.shape[1]} and {fake.shape[1]}")
    metric = FrechetInceptionDistance(feature=_Given(real.shape[1]), normalize=True)
    metric.update(real.double(), real=True)
    metric.update(fake.double(), real=False)
    return float(metric.compute())


def bootstrap_frechet(real: Tensor, fake: Tensor, replicates: int = 50, seed: int = 0,
                      level: float = 0.95) -> dict[str, float]:
    """The distance and a percentile bootstrap interval: both sets resampled with replacement ``replicates`` times."""
    if replicates < 2:
        raise ValueError(f"replicates must be at least 2, got {replicates}")
    g = torch.Generator().manual_seed(seed)
    draws = []
    for _ in range(replicates):
        i = torch.randint(real.shape[0], (real.shape[0],), generator=g)
        j = torch.randint(fake.shape[0], (fake.shape[0],), generator=g)
        draws.append(frechet_distance(real[i], fake[j]))
    values = torch.tensor(draws, dtype=torch.float64)
    tail = (1.0 - level) / 2
    return {"value": frechet_distance(real, fake), "low": float(values.quantile(tail)),
            "high": float(values.quantile(1 - tail)), "replicates": replicates, "level": level}


@torch.no_grad()
def features_of(classifier: SmallResNet, images: Tensor, batch_size: int = 500) -> Tensor:
    """``(N, num_features)`` float64 penultimate features of images ``(N, 3, 32, 32)`` in ``[0, 1]``."""
    extractor = FeatureExtractor(classifier)
    return torch.cat([extractor(images[i:i + batch_size]) for i in range(0, len(images), batch_size)])


@torch.no_grad()
def predict(classifier: SmallResNet, images: Tensor, batch_size: int = 500) -> Tensor:
    classifier.eval()
    return torch.cat([classifier(images[i:i + batch_size]).argmax(-1) for i in range(0, len(images), batch_size)])


def images_of(dataset: Dataset, limit: int | None = None) -> tuple[Tensor, Tensor]:
    """``(images (N, 3, 32, 32) float in [0, 1], labels (N,))`` of a dataset of ``(image, label)`` items; with
    ``limit``, a fixed random subset of that many (seed 0, in dataset order). Not the first ``limit``: the official
    test split is sorted by class, so its first 5,000 images hold only the first five classes."""
    if limit is not None and limit < len(dataset):
        keep = torch.randperm(len(dataset), generator=torch.Generator().manual_seed(0))[:limit].sort().values
        dataset = Subset(dataset, keep.tolist())
    xs, ys = [], []
    for x, y in DataLoader(dataset, batch_size=500, shuffle=False):
        xs.append(x)
        ys.append(torch.as_tensor(y))
    return torch.cat(xs), torch.cat(ys)


def study_settings(width: int, epochs: int, data_root: Path | str, val_size: int) -> dict[str, Any]:
    """The classifier's settings as the sample-quality study trains it (and as its cache key names it): ``width`` and
    ``epochs`` from ``--classifier-width`` / ``--classifier-epochs``, the data as ``--data-root`` spells it, and the
    validation hold-out it was trained without (a classifier trained beside another hold-out has seen validation
    images, so it is another cache entry)."""
    return {"width": width, "epochs": epochs, "batch_size": 128, "lr": 0.1, "seed": 0, "data": str(data_root),
            "val_size": val_size}


def settings_key(settings: dict[str, Any]) -> str:
    text = json.dumps({**settings, "version": CACHE_VERSION}, sort_keys=True)
    return hashlib.sha256(text.encode()).hexdigest()[:16]


def load_classifier(path: Path) -> tuple[SmallResNet, dict[str, Any]]:
    """The cached classifier at ``path`` and its record; refuses a file whose SHA-256 is not the recorded one."""
    record_path = path.with_suffix(".json")
    if not path.is_file() or not record_path.is_file():
        raise FileNotFoundError(f"no cached classifier at {path} (weights and {record_path.name} expected)")
    record = json.loads(record_path.read_text())
    digest = sha256_file(path)
    if digest != record.get("sha256"):
        raise ValueError(f"classifier {path} has sha256 {digest[:16]}..., but its record {record_path.name} says "
                         f"{str(record.get('sha256'))[:16]}...: the file was changed or replaced; delete both to "
                         f"retrain it")
    state = load_torch_file(path, "classifier")  # weights_only=True: nothing in the file runs
    model = SmallResNet(**record["architecture"])
    model.load_state_dict(state)
    return model.eval(), record


def train_classifier(train: Dataset, val: Dataset, test: Dataset, settings: dict[str, Any], out: Path,
                     progress: bool = True) -> tuple[SmallResNet, dict[str, Any]]:
    """Train :class:`SmallResNet` (random crops with 4-pixel padding and horizontal flips; SGD with Nesterov momentum,
    one-cycle learning rate) and write ``out`` and its record. Returns the model and the record."""
    torch.manual_seed(settings["seed"])
    model = SmallResNet(settings["width"])
    epochs, batch = settings["epochs"], settings["batch_size"]
    loader = DataLoader(train, batch_size=batch, shuffle=True, drop_last=True,
                        generator=torch.Generator().manual_seed(settings["seed"]))
    optimizer = torch.optim.SGD(model.parameters(), lr=settings["lr"], momentum=0.9, nesterov=True,
                                weight_decay=5e-4)
    schedule = torch.optim.lr_scheduler.OneCycleLR(optimizer, settings["lr"], total_steps=epochs * len(loader))
    history = []
    begin = time.perf_counter()
    for epoch in range(epochs):
        model.train()
        total, correct = 0.0, 0
        for x, y in loader:
            x = augment(x)
            logits = model(x)
            loss = F.cross_entropy(logits, y)
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            optimizer.step()
            schedule.step()
            total += float(loss.detach()) * len(y)
            correct += int((logits.argmax(-1) == y).sum())
        val_x, val_y = images_of(val)
        row = {"epoch": epoch + 1, "train_loss": total / (len(loader) * batch),
               "train_accuracy": correct / (len(loader) * batch),
               "val_accuracy": float((predict(model, val_x) == val_y).double().mean()),
               "seconds": time.perf_counter() - begin}
        history.append(row)
        if progress:
            print(f"[classifier] epoch {row['epoch']}/{epochs}: train acc {row['train_accuracy']:.3f}, val acc "
                  f"{row['val_accuracy']:.3f} ({row['seconds']:.0f} s)", flush=True)
    test_x, test_y = images_of(test)
    model.eval()
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_suffix(".tmp")
    torch.save(model.state_dict(), tmp)
    tmp.replace(out)
    record = {"settings": settings, "architecture": {"width": settings["width"]}, "sha256": sha256_file(out),
              "test_accuracy": float((predict(model, test_x) == test_y).double().mean()), "history": history}
    write_atomic(out.with_suffix(".json"), json.dumps(record, indent=1))
    return model, record


def augment(x: Tensor) -> Tensor:
    """Random 32x32 crops of the 4-pixel reflection-padded batch and random horizontal flips (one draw per image)."""
    n, c, h, w = x.shape
    padded = F.pad(x, (4, 4, 4, 4), mode="reflect")
    rows = (torch.randint(0, 9, (n,))[:, None] + torch.arange(h))[:, None, :, None]  # (n, 1, h, 1)
    cols = (torch.randint(0, 9, (n,))[:, None] + torch.arange(w))[:, None, None, :]  # (n, 1, 1, w)
    flip = torch.rand(n) < 0.5
    cols = torch.where(flip[:, None, None, None], cols.flip(-1), cols)
    return padded[torch.arange(n)[:, None, None, None], torch.arange(c)[None, :, None, None], rows, cols]


def load_or_train(train: Dataset, val: Dataset, test: Dataset, settings: dict[str, Any], cache_dir: Path,
                  progress: bool = True) -> tuple[SmallResNet, dict[str, Any], Path]:
    """The classifier of these settings from ``cache_dir``, trained first when it is not there."""
    path = cache_dir / f"classifier-{settings_key(settings)}.pt"
    if path.is_file() and path.with_suffix(".json").is_file():
        model, record = load_classifier(path)
        log.info("classifier: read %s (test accuracy %.3f)", path, record["test_accuracy"])
        return model, record, path
    model, record = train_classifier(train, val, test, settings, path, progress)
    return model, record, path


def interval_text(x: dict[str, float], sign: str = "") -> str:
    """``value [low, high]`` of an interval (:func:`bootstrap_frechet`'s form), two decimals; ``sign="+"`` signs
    them."""
    return f"{x['value']:{sign}.2f} [{x['low']:{sign}.2f}, {x['high']:{sign}.2f}]"


def describe(c: dict[str, Any]) -> str:
    """A report's paragraph on the classifier of record ``c`` (its ``sha256`` and ``test_accuracy``) and on what the
    distance is."""
    return (f"Scored with a CIFAR-10 classifier trained here (a small ResNet; test accuracy {c['test_accuracy']:.3f}, "
            f"sha256 {c['sha256'][:16]}...): the **classifier Fréchet distance** (CFD) of its penultimate features, "
            f"computed by torchmetrics' FrechetInceptionDistance with that network as its feature extractor. It is "
            f"not Inception FID and compares only with runs of the same classifier file. Intervals: 95% bootstrap "
            f"percentiles.")
