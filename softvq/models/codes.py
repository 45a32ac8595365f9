"""Hard code indices of CIFAR-10 under a trained VQ-VAE, extracted once per checkpoint and data selection and cached;
optionally each token's soft assignments too (its ``k`` most probable codes and their renormalised probabilities:
the targets of a prior that learns from the layer's distribution, ``CodePrior(soft_targets=...)``).

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
from einops import rearrange
from torch import Tensor
from torch.utils.data import DataLoader, Dataset
from tqdm.auto import tqdm

from softvq._checks import check_non_negative_int, check_positive_int
from softvq.data.cifar10 import SPLIT_SEED, CIFAR10DataModule, default_cache_dir
from softvq.models.checkpoint_io import load_torch_file
from softvq.models.vqvae import VQVAE
from softvq.types import QuantizerOutput

log = logging.getLogger("softvq")
SPLITS = ("train", "val", "test")
CACHE_VERSION = 1  # bump when what is cached changes meaning


class SoftCodes(NamedTuple):
    """Each token's ``k`` most probable codes under the quantizer and their assignments, renormalised to sum to 1.

    Attributes:
        probs: ``(N, h, w, k)`` float32, descending along ``k``; rows sum to 1 (entries past a layer's own support,
            e.g. HardVQ's one code, are 0).
        codes: ``(N, h, w, k)`` int64, the code of each entry of ``probs`` (``codes[..., 0]`` is the hard index).
        mass: ``(N, h, w)`` float32, the share of the layer's distribution the ``k`` entries held before
            renormalising (1 where nothing was left out).
    """

    probs: Tensor
    codes: Tensor
    mass: Tensor


class CodeSet(NamedTuple):
    """Code grids of one data split.

    Attributes:
        codes: ``(N, h, w)`` int64 hard indices (``model.encode`` of each image), in the split's order.
        labels: ``(N,)`` int64 CIFAR-10 class indices.
        soft: the tokens' top-k assignments (:class:`SoftCodes`) where they were extracted, else ``None``.
    """

    codes: Tensor
    labels: Tensor
    soft: SoftCodes | None = None


def top_k_assignments(out: QuantizerOutput, k: int) -> SoftCodes:
    """The ``k`` largest assignments of every token of a quantizer's output, renormalised, with their codes.

    Works on dense ``probs (..., K)`` and on the top-k form (``prob_codes``; HardVQ's ``(..., 1)``); fewer than ``k``
    entries are padded with probability 0 on the token's hard code. Ties keep ``torch.topk``'s order; the first entry
    is the largest assignment, which is the hard index except between exactly tied codes.
    """
    check_positive_int("k", k)
    probs = out.probs.detach().float()
    take = min(k, probs.shape[-1])
    values, where = probs.topk(take, dim=-1)
    codes = where if out.prob_codes is None else out.prob_codes.gather(-1, where)
    if take < k:  # pad with zero-probability entries on the hard code
        pad = k - take
        values = torch.cat([values, values.new_zeros(*values.shape[:-1], pad)], -1)
        codes = torch.cat([codes, out.indices.unsqueeze(-1).expand(*codes.shape[:-1], pad)], -1)
    mass = values.sum(-1)
    return SoftCodes(values / mass.unsqueeze(-1), codes.long(), mass)


@torch.no_grad()
def extract_codes(model: VQVAE, dataset: Dataset, batch_size: int = 256, num_workers: int = 0,
                  progress: bool = False, desc: str = "encoding", soft_top_k: int | None = None) -> CodeSet:
    """``model.encode`` of every image of ``dataset`` (items ``(image (3, H, W) in [0, 1], label)``), in order.

    Args:
        model: a VQ-VAE in eval mode (:func:`models.load_vqvae` gives one).
        dataset: the images.
        batch_size: images per forward pass.
        num_workers: DataLoader worker processes.
        progress: show a tqdm progress bar.
        desc: its label.
        soft_top_k: also keep every token's ``soft_top_k`` largest assignments (:func:`top_k_assignments`) from the
            same forward pass; ``None``: hard indices only.

    Returns:
        A :class:`CodeSet` with ``codes (N, h, w)``, ``labels (N,)`` and, with ``soft_top_k``, ``soft``.
    """
    check_positive_int("batch_size", batch_size)
    check_non_negative_int("num_workers", num_workers)
    if soft_top_k is not None:
        check_positive_int("soft_top_k", soft_top_k)
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
    codes, labels, soft = [], [], []
    loader = DataLoader(dataset, batch_size=batch_size, shuffle=False, num_workers=num_workers)
    for x, y in tqdm(loader, desc=desc, disable=not progress, leave=False):
        # what model.encode does, keeping the whole output: the assignments come with the indices
        out = model.quantizer(rearrange(model.latents(x.to(model.device)), "b d h w -> b h w d"))
        codes.append(out.indices.cpu())
        labels.append(torch.as_tensor(y))
        if soft_top_k is not None:
            soft.append(SoftCodes(*(t.cpu() for t in top_k_assignments(out, soft_top_k))))
    if not codes:
        empty = CodeSet(torch.zeros(0, 0, 0, dtype=torch.long), torch.zeros(0, dtype=torch.long))
        if soft_top_k is None:
            return empty
        return empty._replace(soft=SoftCodes(torch.zeros(0, 0, 0, soft_top_k), torch.zeros(0, 0, 0, soft_top_k,
                                                                                            dtype=torch.long),
                                             torch.zeros(0, 0, 0)))
    return CodeSet(torch.cat(codes).long(), torch.cat(labels).long(),
                   SoftCodes(*(torch.cat(parts) for parts in zip(*soft, strict=True))) if soft else None)


def cache_key(sha256: str, data: CIFAR10DataModule, soft_top_k: int | None = None) -> dict[str, object]:
    """What identifies a set of cached codes: the checkpoint, the exact image selection (after ``setup()``) and, where
    they are kept, how many soft assignments per token."""
    if data.source is None or data.train_set is None or data.test_set is None:
        raise RuntimeError("call data.setup() before cache_key")
    kind, root = data.source
    return {"version": CACHE_VERSION, "checkpoint_sha256": sha256, "source": kind, "root": str(Path(root).resolve()),
            "split_seed": SPLIT_SEED, "val_size": data.val_size, "train_subset": data.train_subset,
            "sizes": {"train": len(data.train_set), "val": len(data.val_set), "test": len(data.test_set)},
            # absent for hard codes alone, so the caches written before soft assignments existed still match
            **({"soft_top_k": soft_top_k} if soft_top_k is not None else {})}


def cache_path(key: dict[str, object], cache_dir: str | os.PathLike | None = None) -> Path:
    """``<cache_dir>/codes/codes-<sha256[:16]>-<hash of the data selection>.pt`` (default cache: the data's)."""
    selection = hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()[:12]
    base = Path(cache_dir) if cache_dir is not None else default_cache_dir() / "codes"
    return base / f"codes-{str(key['checkpoint_sha256'])[:16]}-{selection}.pt"


def _stored(split: CodeSet, index_dtype: torch.dtype) -> dict[str, Tensor]:
    """A split as the cache file holds it: indices in ``index_dtype``, labels int16, soft assignments float16 (half
    the bytes; renormalised in float32 when read)."""
    out = {"codes": split.codes.to(index_dtype), "labels": split.labels.to(torch.int16)}
    if split.soft is not None:
        out.update(soft_probs=split.soft.probs.half(), soft_codes=split.soft.codes.to(index_dtype),
                   soft_mass=split.soft.mass.half())
    return out


def _loaded(saved: dict[str, Tensor]) -> CodeSet:
    soft = None
    if "soft_probs" in saved:
        probs = saved["soft_probs"].float()
        soft = SoftCodes(probs / probs.sum(-1, keepdim=True), saved["soft_codes"].long(), saved["soft_mass"].float())
    return CodeSet(saved["codes"].long(), saved["labels"].long(), soft)


def code_splits(model: VQVAE, sha256: str, data: CIFAR10DataModule, cache_dir: str | os.PathLike | None = None,
                batch_size: int = 256, progress: bool = False, soft_top_k: int | None = None) -> dict[str, CodeSet]:
    """Codes of the train, val and official test splits of ``data`` under ``model``, from the cache when it holds
    exactly this checkpoint and selection, else encoded and cached.

    Args:
        model: the VQ-VAE in eval mode.
        sha256: SHA-256 of its checkpoint file (the cache key).
        data: a :class:`~softvq.data.cifar10.CIFAR10DataModule`; ``setup()`` is called here.
        cache_dir: directory of the cache files (default ``$SOFTVQ_CACHE/codes``).
        batch_size: images per forward pass while encoding.
        progress: progress bars while encoding.
        soft_top_k: also each token's ``soft_top_k`` largest assignments (:class:`SoftCodes`; stored in float16,
            renormalised when read); ``None``: hard indices only.

    Returns:
        ``{"train": CodeSet, "val": CodeSet, "test": CodeSet}`` (``val`` is empty when ``data.val_size == 0``).
    """
    if soft_top_k is not None:
        check_positive_int("soft_top_k", soft_top_k)
    data.setup()
    key = cache_key(sha256, data, soft_top_k)
    path = cache_path(key, cache_dir)
    if path.is_file():
        try:
            saved = load_torch_file(path, "code cache")  # weights_only=True: nothing in the file runs
            if saved.get("key") == key:
                log.info("codes from the cache %s", path)
                return {split: _loaded(saved[split]) for split in SPLITS}
            log.warning("the code cache %s holds another selection; encoding again", path)
        except Exception as err:  # an unreadable, unsafe or foreign file: recompute (and replace it)
            log.warning("ignoring the code cache %s: %s", path, err)
    begin = time.perf_counter()
    datasets = {"train": data.train_set, "val": data.val_set, "test": data.test_set}
    out = {split: extract_codes(model, ds, batch_size, data.num_workers, progress, desc=f"encoding {split}",
                                soft_top_k=soft_top_k)
           for split, ds in datasets.items()}
    log.info("encoded %s images in %.1f s", " + ".join(str(len(s.labels)) for s in out.values()),
             time.perf_counter() - begin)
    path.parent.mkdir(parents=True, exist_ok=True)
    partial = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    small = torch.int16 if model.num_codes <= torch.iinfo(torch.int16).max else torch.int32
    stored = {split: _stored(s, small) for split, s in out.items()}
    try:
        torch.save({"key": key, **stored}, partial)
        os.replace(partial, path)
    except BaseException:
        partial.unlink(missing_ok=True)
        raise
    # what a later call reads from the cache (float16 assignments, renormalised), so both calls train alike
    return {split: _loaded(s) for split, s in stored.items()}
