"""The thin layer of ``eval/paradigm1/`` that makes token features from frozen modules or loads them from a file.

Every source ends in a :class:`TokenSet` per split (tokens ``(N, T, D)``, labels ``(N,)``, an optional padding mask
``(N, T)`` and optional CLS features ``(N, D)``), the input of :func:`eval.paradigm1.run_paradigm1`:

- ``vqvae``: a trained :class:`softvq.models.VQVAE` checkpoint's 8x8 latent grid as 64 tokens (what its quantizer
  sees), extracted and cached by :func:`eval.readout.latents`;
- ``vit``: the small :class:`eval.paradigm1.vit.ViT` trained here on CIFAR-10 labels of training images that the
  readout never sees, then frozen: its 64 patch tokens and its CLS vector, both cached;
- ``--tokens FILE``: a ``torch.save``'d dict of tensors, e.g. BERT features (:func:`load_token_file`).

Images: the readout's training images are the first ``train_subset`` of the data module's fixed permutation of the
official training split (``val_size=0``; the same images ``eval/readout/`` uses); the ViT is trained on the *last*
``vit_train`` images of that permutation, so it never saw a readout training image (like BERT, pretrained on other
text). Test images: the official test split or a fixed seeded subset of it.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import logging
import time
from dataclasses import asdict
from pathlib import Path
from typing import Any, NamedTuple

import torch
from torch import Tensor
from torch.utils.data import DataLoader, Dataset, Subset

from eval.paradigm1.vit import ViT, ViTConfig, train_vit
from softvq.data.cifar10 import CIFAR10DataModule, default_cache_dir
from softvq.models.checkpoint_io import load_torch_file

log = logging.getLogger("eval.paradigm1")


class TokenSet(NamedTuple):
    """One split of frozen token features."""

    tokens: Tensor  # (N, T, D) float32
    labels: Tensor  # (N,) int64 class indices
    mask: Tensor | None = None  # (N, T) bool, True = real token; None = every token is real
    cls: Tensor | None = None  # (N, D) float32, the encoder's CLS feature where it has one


TOKEN_FILE_KEYS = ("train_tokens", "train_labels", "test_tokens", "test_labels")
OPTIONAL_KEYS = ("train_mask", "test_mask", "train_cls", "test_cls")


def load_token_file(path: Path) -> tuple[TokenSet, TokenSet]:
    """Train and test :class:`TokenSet` from a ``torch.save``'d dict of tensors, loaded with ``weights_only=True``.

    Keys: ``train_tokens`` / ``test_tokens`` ``(N, T, D)`` float, ``train_labels`` / ``test_labels`` ``(N,)`` int,
    optionally ``train_mask`` / ``test_mask`` ``(N, T)`` bool or 0/1 (True = real token, e.g. BERT's
    ``attention_mask``) and ``train_cls`` / ``test_cls`` ``(N, D)`` (e.g. ``last_hidden_state[:, 0]``).
    Shapes and values are checked by :func:`eval.paradigm1.check_inputs` when the study runs.

    Raises:
        FileNotFoundError: no such file.
        ValueError: a file torch cannot read (truncated, corrupt, or holding objects that would run code), one that
            is not a dict, a missing key (named), or a value that is not a tensor (named).
    """
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"tokens file not found: {path}")
    data = load_torch_file(path, "tokens file")  # weights_only=True; ValueError naming the file when unreadable
    if not isinstance(data, dict):
        raise ValueError(f"tokens file {path} must hold a dict of tensors with keys {TOKEN_FILE_KEYS}, "
                         f"got {type(data).__name__}")
    missing = [k for k in TOKEN_FILE_KEYS if k not in data]
    if missing:
        raise ValueError(f"tokens file {path} lacks the key(s) {missing}; it has {sorted(map(str, data))}")
    unknown = sorted(str(k) for k in data if k not in TOKEN_FILE_KEYS + OPTIONAL_KEYS)
    if unknown:
        raise ValueError(f"tokens file {path} has unknown key(s) {unknown}; allowed: {TOKEN_FILE_KEYS + OPTIONAL_KEYS}")
    for key, value in data.items():
        if not isinstance(value, Tensor):
            raise ValueError(f"tokens file {path}: {key} must be a tensor, got {type(value).__name__}")

    def split(name: str) -> TokenSet:
        mask = data.get(f"{name}_mask")
        return TokenSet(data[f"{name}_tokens"], data[f"{name}_labels"],
                        None if mask is None else mask.bool() if mask.dtype != torch.bool else mask,
                        data.get(f"{name}_cls"))

    return split("train"), split("test")


def _images(args: argparse.Namespace) -> tuple[CIFAR10DataModule, Dataset, Dataset, Dataset]:
    """The data module and the readout's train images, the ViT's training images, the test images."""
    data = CIFAR10DataModule(args.data_root, batch_size=256, val_size=0, num_workers=args.num_workers)
    data.setup()
    everything = data.train_set  # the fixed permutation of the official training split
    if args.train_subset + args.vit_train > len(everything):
        raise ValueError(f"--train-subset {args.train_subset} + --vit-train {args.vit_train} exceed the "
                         f"{len(everything)} training images: the ViT must not see the readout's images")
    readout_train = Subset(everything, list(range(args.train_subset)))
    vit_train = Subset(everything, list(range(len(everything) - args.vit_train, len(everything))))
    test: Dataset = data.test_set
    if args.test_subset is not None and args.test_subset < len(test):
        order = torch.randperm(len(test), generator=torch.Generator().manual_seed(0))
        test = Subset(test, order[: args.test_subset].tolist())
    return data, readout_train, vit_train, test


def _cached(path: Path, key: dict[str, Any]) -> dict[str, Any] | None:
    if not path.is_file():
        return None
    try:
        saved = load_torch_file(path, "paradigm-1 cache")  # weights_only=True: nothing in the file runs
    except Exception as err:  # an interrupted write, an unsafe file: recompute and replace it
        log.warning("ignoring the cache %s: %s", path, err)
        return None
    return saved if saved.get("key") == json.dumps(key, sort_keys=True) else None


def _save(path: Path, key: dict[str, Any], payload: dict[str, Any]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    partial = path.with_suffix(".tmp")
    torch.save({"key": json.dumps(key, sort_keys=True), **payload}, partial)
    partial.replace(path)


def _digest(key: dict[str, Any]) -> str:
    return hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()[:16]


@torch.no_grad()
def module_tokens(model: ViT, dataset: Dataset, batch_size: int = 256, num_workers: int = 0) -> TokenSet:
    """Frozen patch tokens ``(N, T, D)``, labels and CLS features ``(N, D)`` of a data set, from ``model.tokens``
    (any module with a ``tokens(images) -> (tokens, cls)`` method)."""
    tokens, cls, labels = [], [], []
    for x, y in DataLoader(dataset, batch_size=batch_size, shuffle=False, num_workers=num_workers):
        t, c = model.tokens(x)
        tokens.append(t.float())
        cls.append(c.float())
        labels.append(y)
    return TokenSet(torch.cat(tokens), torch.cat(labels), None, torch.cat(cls))


def vit_tokens(args: argparse.Namespace, cfg: ViTConfig) -> tuple[TokenSet, TokenSet, dict[str, Any]]:
    """Train (or load from the cache) the ViT on its own images, freeze it, and return the readout's train and test
    token sets with facts about the encoder (its test accuracy from its own CLS head, training time)."""
    data, readout_train, vit_train, test = _images(args)
    cache = args.cache_dir or default_cache_dir() / "paradigm1"
    model_key = {"vit": asdict(cfg), "data": str(data.source[1]), "images": "last", "vit_train": len(vit_train),
                 "seed": args.vit_seed}
    model_file = cache / f"vit-{_digest(model_key)}.pt"
    saved = _cached(model_file, model_key)
    model = ViT(cfg)
    if saved is not None:
        model.load_state_dict(saved["state_dict"])
        facts = saved["facts"]
        log.info("ViT from the cache %s", model_file)
    else:
        begin = time.perf_counter()
        model = train_vit(cfg, vit_train, args.vit_seed, args.num_workers, progress=args.progress)
        facts = {"train_seconds": time.perf_counter() - begin, "train_images": len(vit_train)}
        _save(model_file, model_key, {"state_dict": model.state_dict(), "facts": facts})
        log.info("trained the ViT in %.0f s", facts["train_seconds"])
    model.eval().requires_grad_(False)
    token_key = {**model_key, "readout_train": len(readout_train), "test": len(test)}
    token_file = cache / f"vit-tokens-{_digest(token_key)}.pt"
    saved = _cached(token_file, token_key)
    if saved is None:
        begin = time.perf_counter()
        train, tst = module_tokens(model, readout_train), module_tokens(model, test)
        log.info("encoded %d + %d images with the ViT in %.0f s", len(train.labels), len(tst.labels),
                 time.perf_counter() - begin)
        with torch.no_grad():
            facts = {**facts, "test_acc": float((model.head(tst.cls).argmax(1) == tst.labels).float().mean()),
                     "readout_train_acc": float((model.head(train.cls).argmax(1) == train.labels).float().mean())}
        _save(token_file, token_key, {"train": list(train), "test": list(tst), "facts": facts})
    else:
        train, tst, facts = TokenSet(*saved["train"]), TokenSet(*saved["test"]), saved["facts"]
        log.info("ViT tokens from the cache %s", token_file)
    facts = {**facts, "config": asdict(cfg), "parameters": sum(p.numel() for p in model.parameters())}
    return train, tst, facts


def vqvae_tokens(args: argparse.Namespace) -> tuple[TokenSet, TokenSet, dict[str, Any]]:
    """The VQ-VAE checkpoint's frozen latent tokens (after its latent norm), through :func:`eval.readout.latents`
    and its cache (keyed by the checkpoint's SHA-256 and the data selection)."""
    from eval import readout  # the token extraction and cache of the codebook-reuse study
    from softvq.data.cifar10 import sha256_file
    from softvq.models.vqvae import load_vqvae

    if args.checkpoint is None:
        raise ValueError("the vqvae encoder needs --checkpoint (a models.VQVAE .ckpt, e.g. "
                         "runs/cifar10/ddcl/checkpoints/last.ckpt from softvq-train), or leave it out with "
                         "--encoders vit")
    model = load_vqvae(args.checkpoint)
    if model.levels > 1:
        raise ValueError(f"{args.checkpoint} is a {model.levels}-level VQ-VAE; paradigm 1 reads one level of tokens")
    digest = sha256_file(args.checkpoint)
    ns = argparse.Namespace(data_root=args.data_root, train_subset=args.train_subset, test_subset=args.test_subset,
                            num_workers=args.num_workers, checkpoint=args.checkpoint, cache=None)
    train, test = readout.latents(ns, model, digest, torch.device("cpu"))
    facts = {"checkpoint": str(args.checkpoint), "checkpoint_sha256": digest,
             "quantizer": type(model.quantizer).__name__}
    return TokenSet(train[0], train[2]), TokenSet(test[0], test[2]), facts
