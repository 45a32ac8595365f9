"""Hard code indices of CIFAR-10 under a trained VQ-VAE, extracted once per checkpoint and data selection and cached.

The cache file is keyed by the checkpoint's SHA-256 (not its path: a checkpoint may be copied or overwritten) and by
the data selection (source, split sizes, the fixed split seed), and is written atomically; a stale, foreign or
unreadable cache file is recomputed.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import time
from pathlib import Path
from typing import NamedTuple

import torch
from torch import Tensor
from torch.utils.data import DataLoader, Dataset
from tqdm.auto import tqdm

from softvq._checks import check_non_negative_int, check_positive_int
from softvq.data.cifar10 import SPLIT_SEED, CIFAR10DataModule, default_cache_dir
from softvq.models.checkpoint_io import load_torch_file
from softvq.models.vqvae import VQVAE

log = logging.getLogger("softvq")
SPLITS = ("train", "val", "test")
CACHE_VERSION = 1  # bump when what is cached changes meaning


class CodeSet(NamedTuple):
    """Code grids of one data split.

    Attributes:
        codes: ``(N, h, w)`` int64 hard indices (``model.encode`` of each image), in the split's order.
        labels: ``(N,)`` int64 CIFAR-10 class indices.
    """

    codes: Tensor
    labels: Tensor


@torch.no_grad()
def extract_codes(model: VQVAE, dataset: Dataset, batch_size: int = 256, num_workers: int = 0,
                  progress: bool = False, desc: str = "encoding") -> CodeSet:
    """``model.encode`` of every image of ``dataset`` (items ``(image (3, H, W) in [0, 1], label)``), in order.

    Args:
        model: a VQ-VAE in eval mode (:func:`models.load_vqvae` gives one).
        dataset: the images.
        batch_size: images per forward pass.
        num_workers: DataLoader worker processes.
        progress: show a tqdm progress bar.
        desc: its label.

    Returns:
        A :class:`CodeSet` with ``codes (N, h, w)`` and ``labels (N,)``.
    """
    check_positive_int("batch_size", batch_size)
    check_non_negative_int("num_workers", num_workers)
    if getattr(model, "num_quantizers", 1) > 1:
        raise ValueError(f"extract_codes models one code per position; this VQ-VAE's {model.quantizer_name} has "
                         f"{model.num_quantizers} residual levels (a prior over several codes per position is not "
                         f"implemented)")
    if getattr(model, "levels", 1) > 1:
        raise ValueError(f"extract_codes models one code grid; this VQ-VAE has {model.levels} levels (a prior over "
                         f"hierarchical codes is not implemented)")
    if model.training:
        raise ValueError("extract_codes needs a VQ-VAE in eval mode (call model.eval()): in training mode the latent "
                         "norm uses batch statistics and the codebook may restart codes")
    codes, labels = [], []
    loader = DataLoader(dataset, batch_size=batch_size, shuffle=False, num_workers=num_workers)
    for x, y in tqdm(loader, desc=desc, disable=not progress, leave=False):
        codes.append(model.encode(x.to(model.device)).cpu())
        labels.append(torch.as_tensor(y))
    if not codes:
        return CodeSet(torch.zeros(0, 0, 0, dtype=torch.long), torch.zeros(0, dtype=torch.long))
    return CodeSet(torch.cat(codes).long(), torch.cat(labels).long())


def cache_key(sha256: str, data: CIFAR10DataModule) -> dict[str, object]:
    """What identifies a set of cached codes: the checkpoint and the exact image selection (after ``setup()``)."""
    if data.source is None or data.train_set is None or data.test_set is None:
        raise RuntimeError("call data.setup() before cache_key")
    kind, root = data.source
    return {"version": CACHE_VERSION, "checkpoint_sha256": sha256, "source": kind, "root": str(Path(root).resolve()),
            "split_seed": SPLIT_SEED, "val_size": data.val_size, "train_subset": data.train_subset,
            "sizes": {"train": len(data.train_set), "val": len(data.val_set), "test": len(data.test_set)}}


def cache_path(key: dict[str, object], cache_dir: str | os.PathLike | None = None) -> Path:
    """``<cache_dir>/codes/codes-<sha256[:16]>-<hash of the data selection>.pt`` (default cache: the data's)."""
    selection = hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()[:12]
    base = Path(cache_dir) if cache_dir is not None else default_cache_dir() / "codes"
    return base / f"codes-{str(key['checkpoint_sha256'])[:16]}-{selection}.pt"


def code_splits(model: VQVAE, sha256: str, data: CIFAR10DataModule, cache_dir: str | os.PathLike | None = None,
                batch_size: int = 256, progress: bool = False) -> dict[str, CodeSet]:
    """Codes of the train, val and official test splits of ``data`` under ``model``, from the cache when it holds
    exactly this checkpoint and selection, else encoded and cached.

    Args:
        model: the VQ-VAE in eval mode.
        sha256: SHA-256 of its checkpoint file (the cache key).
        data: a :class:`~softvq.data.cifar10.CIFAR10DataModule`; ``setup()`` is called here.
        cache_dir: directory of the cache files (default ``$SOFTVQ_CACHE/codes``).
        batch_size: images per forward pass while encoding.
        progress: progress bars while encoding.

    Returns:
        ``{"train": CodeSet, "val": CodeSet, "test": CodeSet}`` (``val`` is empty when ``data.val_size == 0``).
    """
    data.setup()
    key = cache_key(sha256, data)
    path = cache_path(key, cache_dir)
    if path.is_file():
        try:
            saved = load_torch_file(path, "code cache")  # weights_only=True: nothing in the file runs
            if saved.get("key") == key:
                log.info("codes from the cache %s", path)
                return {split: CodeSet(saved[split]["codes"].long(), saved[split]["labels"].long())
                        for split in SPLITS}
            log.warning("the code cache %s holds another selection; encoding again", path)
        except Exception as err:  # an unreadable, unsafe or foreign file: recompute (and replace it)
            log.warning("ignoring the code cache %s: %s", path, err)
    begin = time.perf_counter()
    datasets = {"train": data.train_set, "val": data.val_set, "test": data.test_set}
    out = {split: extract_codes(model, ds, batch_size, data.num_workers, progress, desc=f"encoding {split}")
           for split, ds in datasets.items()}
    log.info("encoded %s images in %.1f s", " + ".join(str(len(s.labels)) for s in out.values()),
             time.perf_counter() - begin)
    path.parent.mkdir(parents=True, exist_ok=True)
    partial = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    small = torch.int16 if model.num_codes <= torch.iinfo(torch.int16).max else torch.int32
    try:
        torch.save({"key": key, **{split: {"codes": s.codes.to(small), "labels": s.labels.to(torch.int16)}
                                   for split, s in out.items()}}, partial)
        os.replace(partial, path)
    except BaseException:
        partial.unlink(missing_ok=True)
        raise
    return out
