"""Paradigm 1 of the paper on frozen encoders: DDCL readout vs k-means clustering vs a logistic-regression bound.

    python -m eval.paradigm1 --checkpoint runs/cifar10/ddcl/checkpoints/last.ckpt \\
        --data-root ../shared/data/cifar10-jpeg.tar.gz                  # both encoders, 3 seeds -> reports/paradigm1
    python -m eval.paradigm1 --checkpoint CKPT --data-root DATA --quick --out /tmp/p1     # a few minutes
    python -m eval.paradigm1 --tokens bert_sst2.pt --out reports/bert                    # your own token features

The paper (arXiv 2604.03850) freezes BERT on SST-2, IMDB and 20 Newsgroups and reports that the DDCL readout beats
k-means clustering of the frozen features and approaches a logistic-regression upper bound; its hierarchical paradigm
stacks two DDCL layers with ``V^(l) >= 0`` at every level. No text encoder or corpus can be downloaded here, so the
frozen encoders are a trained VQ-VAE's encoder (its 8x8 latent grid, 64 tokens) and a small ViT trained on CIFAR-10
labels of other images (64 patch tokens and CLS); ``--tokens`` runs the same study on any token features.

**Own features** (e.g. BERT): save a dict of tensors and pass ``--tokens FILE`` (loaded with ``weights_only=True``)::

    out = bert(**batch)                                       # for each split
    torch.save({"train_tokens": out.last_hidden_state, "train_mask": batch["attention_mask"].bool(),
                "train_labels": y, "train_cls": out.last_hidden_state[:, 0], "test_tokens": ..., ...}, "bert.pt")

or call :func:`run_paradigm1` with :class:`TokenSet` splits. The study (every method on the same standardised
tokens, :func:`standardize`; test split scored once, after training):

- **Unsupervised** (``eval/paradigm1/unsupervised.py``): ``K = C`` and ``K = cluster_mult x C`` clusters of (a) the
  pooled features (mean real token per example) and (b) the tokens. DDCL: the prototypes of a
  :class:`softvq.DDCLReadout` trained on its own DDCL objective only (no labels; ``fit_ddcl_clusters``), an
  example's cluster is the prototype with the largest assignment mass ``sum_t q_tk`` over its real tokens (for
  pooled features: its one token's ``argmax_k q``). k-means: ``sklearn.cluster.KMeans(K, n_init="auto",
  random_state=seed)`` on the same training features; an example's cluster is the one most of its tokens fall in.
  Both fit on the training split and are scored on the test split: ACC (Hungarian; for ``K > C`` the majority map
  from the training split), NMI, ARI (scikit-learn).
- **Supervised** (:mod:`eval.paradigm1.heads`, Adam, fixed epochs): linear probes on the mean token and on CLS,
  DDCL readouts (prototypes trained with the head) with a linear head on ``pooled`` or on ``[pooled, mass, slots]``,
  and ``sklearn.linear_model.LogisticRegression`` on all tokens concatenated (the upper bound; its ``C`` chosen on
  a held-out fifth of the training split, then refit on all of it).
- **Hierarchical**: two stacked readout levels (level 2 reads level 1's soft centroids) with the head on both; V and
  the identity residual per level per epoch, ``min V >= 0`` asserted.

Margins: a difference of means counts only if it exceeds the sum of the two seed standard deviations and has the
same sign on every seed (:func:`eval._spread.beyond_spread`, the rule of every report). Writes ``report.md`` and
``results.json`` to ``--out``.
"""

from __future__ import annotations

import argparse
import logging
import statistics
import sys
import time
from dataclasses import asdict, replace
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import Tensor

from eval._spread import summarize
from eval.paradigm1.config import Paradigm1Config
from eval.paradigm1.encoders import TokenSet, load_token_file
from eval.paradigm1.heads import FeatureProbe, ReadoutHead
from eval.paradigm1.unsupervised import clustering, ddcl_clusters, fit_ddcl_clusters, pair_distance, scores, vote
from eval.readout.heads import fit

log = logging.getLogger("eval.paradigm1")
# re-exported: the study's unsupervised half lives in eval/paradigm1/unsupervised.py
__all__ = ["Paradigm1Config", "TokenSet", "check_inputs", "clustering", "ddcl_clusters", "fit_ddcl_clusters",
           "load_token_file", "main", "pair_distance", "run_paradigm1", "scores", "standardize", "supervised",
           "vote"]


# ---- inputs -------------------------------------------------------------------------------------------------------
def check_inputs(train: TokenSet, test: TokenSet) -> int:
    """Validate both splits and return the number of classes ``C = max(train labels) + 1``.

    Raises:
        ValueError: naming the bad value: tokens that are not 3-D floats, splits with other ``D``, labels that are not
            1-D non-negative integers or whose count differs from the tokens', a mask that is not ``(N, T)`` or a row
            without a real token, NaN/Inf at a real token, CLS features of the wrong shape or in one split only,
            fewer than 2 classes, test labels outside the training classes.
    """
    for name, s in (("train", train), ("test", test)):
        t = s.tokens
        if not isinstance(t, Tensor) or t.ndim != 3 or not t.is_floating_point():
            what = f"shape {tuple(t.shape)}, dtype {t.dtype}" if isinstance(t, Tensor) else type(t).__name__
            raise ValueError(f"{name} tokens must be a float tensor (N, T, D), got {what}")
        y = s.labels
        if not isinstance(y, Tensor) or y.ndim != 1 or y.is_floating_point() or y.dtype == torch.bool:
            what = f"shape {tuple(y.shape)}, dtype {y.dtype}" if isinstance(y, Tensor) else type(y).__name__
            raise ValueError(f"{name} labels must be a 1-D integer tensor, got {what}")
        if y.numel() != t.shape[0]:
            raise ValueError(f"{name}: {y.numel()} labels for {t.shape[0]} token sequences")
        if y.numel() == 0 or int(y.min()) < 0:
            raise ValueError(f"{name} labels must be non-empty and non-negative, got {y.numel()} labels"
                             + (f" with minimum {int(y.min())}" if y.numel() else ""))
        real = torch.ones(t.shape[:2], dtype=torch.bool) if s.mask is None else s.mask
        if s.mask is not None:
            if not isinstance(s.mask, Tensor) or s.mask.dtype != torch.bool or s.mask.shape != t.shape[:2]:
                what = (f"shape {tuple(s.mask.shape)}, dtype {s.mask.dtype}" if isinstance(s.mask, Tensor)
                        else type(s.mask).__name__)
                raise ValueError(f"{name} mask must be a bool tensor of shape {tuple(t.shape[:2])}, got {what}")
            empty = (~s.mask.any(1)).nonzero().flatten()
            if empty.numel():
                raise ValueError(f"{name} row(s) {empty[:10].tolist()} have no real token (mask all False)")
        bad = ~torch.isfinite(t).all(-1) & real
        if bool(bad.any()):
            raise ValueError(f"{name} tokens hold {int(bad.sum())} real token(s) with NaN or Inf, the first in row "
                             f"{int(bad.nonzero()[0, 0])}")
        if s.cls is not None:
            if not isinstance(s.cls, Tensor) or s.cls.shape != (t.shape[0], s.cls.shape[-1]) or s.cls.ndim != 2:
                what = tuple(s.cls.shape) if isinstance(s.cls, Tensor) else type(s.cls).__name__
                raise ValueError(f"{name} cls must be (N, D') = ({t.shape[0]}, D'), got {what}")
            if not bool(torch.isfinite(s.cls).all()):
                raise ValueError(f"{name} cls features hold NaN or Inf")
    if train.tokens.shape[-1] != test.tokens.shape[-1]:
        raise ValueError(f"train and test tokens must share D, got {train.tokens.shape[-1]} and "
                         f"{test.tokens.shape[-1]}")
    if (train.cls is None) != (test.cls is None):
        raise ValueError("cls features must be given for both splits or for neither")
    classes = int(train.labels.max()) + 1
    if classes < 2:
        raise ValueError(f"need at least 2 classes, the training labels hold {classes}")
    if int(test.labels.max()) >= classes:
        raise ValueError(f"test labels go up to {int(test.labels.max())}, beyond the {classes} training classes")
    return classes


def full_mask(s: TokenSet) -> Tensor:
    return torch.ones(s.tokens.shape[:2], dtype=torch.bool) if s.mask is None else s.mask


def standardize(train: TokenSet, test: TokenSet) -> tuple[TokenSet, TokenSet, dict[str, float]]:
    """``z' = (z - m) / s`` for every token and ``(c - m_c) / s_c`` for CLS: ``m`` the mean real training token, ``s``
    the RMS per coordinate of the deviation from it (one scalar, so the geometry is kept); padding set to 0."""

    def stats(x: Tensor) -> tuple[Tensor, float]:
        x = x.double()
        center = x.mean(0)
        scale = float((x - center).square().mean().sqrt())
        return center.float(), scale if scale > 0 else 1.0

    center, scale = stats(train.tokens[full_mask(train)])
    cls_stats = stats(train.cls) if train.cls is not None else None

    def apply(s: TokenSet) -> TokenSet:
        tokens = ((s.tokens - center) / scale).masked_fill(~full_mask(s)[..., None], 0.0)
        cls = None if cls_stats is None else (s.cls - cls_stats[0]) / cls_stats[1]
        return TokenSet(tokens, s.labels.long(), full_mask(s), cls)

    return apply(train), apply(test), {"center_norm": float(center.norm()), "scale": scale}


# ---- supervised ---------------------------------------------------------------------------------------------------
def supervised(train: TokenSet, test: TokenSet, classes: int, seed: int, cfg: Paradigm1Config) -> dict[str, Any]:
    """Adam-trained heads (one seed): mean, CLS, DDCL pooled, DDCL pooled + slots, two-level DDCL."""
    dim = train.tokens.shape[-1]
    t1 = cfg.temperature * pair_distance(train.tokens[train.mask])
    heads: dict[str, Any] = {"mean": lambda: FeatureProbe(dim, classes, "mean"),
                             "ddcl_pooled": lambda: ReadoutHead(dim, classes, (cfg.codes,), t1, cfg.temperature,
                                                                "pooled"),
                             "ddcl_slots": lambda: ReadoutHead(dim, classes, (cfg.codes,), t1, cfg.temperature),
                             "ddcl_2level": lambda: ReadoutHead(dim, classes, (cfg.codes, cfg.codes_level2), t1,
                                                                cfg.temperature)}
    splits = {name: (s.tokens, s.mask, s.labels) for name, s in (("train", train), ("test", test))}
    if train.cls is not None:
        heads = {"cls": lambda: FeatureProbe(train.cls.shape[1], classes, "first"), **heads}
    out: dict[str, Any] = {}
    for name, build in heads.items():
        torch.manual_seed(seed)
        model = build()
        tr, te = splits["train"], splits["test"]
        if name == "cls":
            tr = (train.cls[:, None], torch.ones(len(train.labels), 1, dtype=torch.bool), train.labels)
            te = (test.cls[:, None], torch.ones(len(test.labels), 1, dtype=torch.bool), test.labels)
        epochs: list[dict[str, Any]] = []

        def record(epoch: int, model=model, epochs=epochs) -> None:
            history = getattr(model, "history", None)
            if not history:
                return
            per_level = []
            for level in range(len(history[0])):
                rows = [h[level] for h in history]
                per_level.append({"v_mean": statistics.fmean(r["v"] for r in rows),
                                  "v_min": min(r["v"] for r in rows),
                                  "l_q_mean": statistics.fmean(r["l_q"] for r in rows),
                                  "l_ols_mean": statistics.fmean(r["l_ols"] for r in rows),
                                  "identity_residual_max": max(r["identity_residual"] for r in rows)})
            epochs.append({"epoch": epoch + 1, "levels": per_level})
            history.clear()

        result = fit(model, tr, te, epochs=cfg.epochs, batch_size=cfg.batch_size, lr=cfg.lr, eps=cfg.eps, seed=seed,
                     device=torch.device("cpu"), on_epoch_end=record)
        if epochs:
            result["epochs"] = epochs
            v_min = min(level["v_min"] for e in epochs for level in e["levels"])
            if v_min < 0:
                raise AssertionError(f"{name}: V < 0 at some level ({v_min}): the decomposition is broken")
        out[name] = result
        log.info("  %-12s seed %d: test %.4f train %.4f (%.0f s)", name, seed, result["test_acc"],
                 result["train_acc"], result["seconds"])
    return out


def logreg_bound(train: TokenSet, test: TokenSet, cfg: Paradigm1Config) -> dict[str, Any]:
    """``LogisticRegression`` on all (standardised, zero-padded) tokens concatenated, ``(N, T x D)``: ``C`` chosen
    on the last fifth of the training split (fixed permutation), then refit on the whole training split."""
    from sklearn.linear_model import LogisticRegression

    x_train, x_test = train.tokens.flatten(1).numpy(), test.tokens.flatten(1).numpy()
    y_train, y_test = train.labels.numpy(), test.labels.numpy()
    order = np.random.default_rng(0).permutation(len(y_train))
    cut = len(order) * 4 // 5
    begin = time.perf_counter()
    held: dict[str, float] = {}
    for c in cfg.logreg_c:
        model = LogisticRegression(C=c, max_iter=cfg.logreg_iter).fit(x_train[order[:cut]], y_train[order[:cut]])
        held[str(c)] = float(model.score(x_train[order[cut:]], y_train[order[cut:]]))
        log.info("  logreg C=%g: held-out train accuracy %.4f", c, held[str(c)])
    best = max(cfg.logreg_c, key=lambda c: held[str(c)])
    model = LogisticRegression(C=best, max_iter=cfg.logreg_iter).fit(x_train, y_train)
    return {"test_acc": float(model.score(x_test, y_test)), "train_acc": float(model.score(x_train, y_train)),
            "C": best, "iterations": int(np.max(model.n_iter_)), "held_out_acc": held, "features": x_train.shape[1],
            "seconds": time.perf_counter() - begin}


# ---- the study ----------------------------------------------------------------------------------------------------
def run_paradigm1(train: TokenSet, test: TokenSet, cfg: Paradigm1Config = Paradigm1Config(),
                  logreg: bool = True) -> dict[str, Any]:
    """The whole study on one frozen encoder's tokens.

    Args:
        train: training split: tokens ``(N, T, D)``, labels ``(N,)``, optional mask ``(N, T)`` (True = real) and CLS
            features ``(N, D')``.
        test: test split, same layout (``T`` may differ).
        cfg: settings.
        logreg: fit the logistic-regression bound (the slowest part for long sequences).

    Returns:
        ``{"config", "classes", "scaling", "clustering": {method: {metric: summary}}, "supervised": {head: summary},
        "hierarchy": per-seed per-epoch per-level terms, "logreg", "seconds", "runs": raw per-seed results}``.
    """
    classes = check_inputs(train, test)
    begin = time.perf_counter()
    train, test, scaling = standardize(train, test)
    runs = []
    for seed in cfg.seeds:
        log.info("seed %d: clustering", seed)
        clusters = clustering(train, test, classes, seed, cfg)
        log.info("seed %d: supervised heads", seed)
        runs.append({"seed": seed, "clustering": clusters, "supervised": supervised(train, test, classes, seed, cfg)})
    cluster_summary = {m: {k: summarize([r["clustering"][m][k] for r in runs]) for k in ("acc", "nmi", "ari")}
                       for m in runs[0]["clustering"]}
    head_summary = {h: {k: summarize([r["supervised"][h][k] for r in runs]) for k in ("test_acc", "train_acc")}
                    for h in runs[0]["supervised"]}
    hierarchy = {"per_seed": [r["supervised"]["ddcl_2level"]["epochs"] for r in runs]}
    levels = [level for epochs in hierarchy["per_seed"] for e in epochs for level in e["levels"]]
    hierarchy["v_min"] = min(level["v_min"] for level in levels)
    hierarchy["identity_residual_max"] = max(level["identity_residual_max"] for level in levels)
    result = {"config": asdict(cfg), "classes": classes, "train_examples": len(train.labels),
              "test_examples": len(test.labels), "tokens": train.tokens.shape[1], "dim": train.tokens.shape[2],
              "has_cls": train.cls is not None, "scaling": scaling, "clustering": cluster_summary,
              "supervised": head_summary, "hierarchy": hierarchy, "runs": runs}
    if logreg:
        log.info("logistic-regression bound on %d features", train.tokens.shape[1] * train.tokens.shape[2])
        result["logreg"] = logreg_bound(train, test, cfg)
    result["seconds"] = time.perf_counter() - begin
    return result


# ---- command line -------------------------------------------------------------------------------------------------
QUICK = {"seeds": (0, 1, 2), "cluster_tokens": 32_768, "cluster_steps": 200, "epochs": 3, "logreg_c": (0.1,),
         "logreg_iter": 100}


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m eval.paradigm1", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--encoders", nargs="+", choices=("vqvae", "vit"), default=None,
                   help="frozen encoders to build tokens from (default: vqvae vit; ignored with --tokens)")
    p.add_argument("--checkpoint", type=Path, default=None, help="a models.VQVAE .ckpt (needed by --encoders vqvae)")
    p.add_argument("--tokens", type=Path, default=None,
                   help="a torch.save'd dict of token features instead of the encoders (see the docstring)")
    p.add_argument("--data-root", type=Path, default=Path("data"), help="CIFAR-10 directory or .tar.gz archive")
    p.add_argument("--train-subset", type=int, default=None,
                   help="readout training images, the first of the fixed permutation (default 10000, --quick 2000)")
    p.add_argument("--test-subset", type=int, default=None,
                   help="test images, a fixed subset of the official 10,000 (default all, --quick 2000)")
    p.add_argument("--vit-train", type=int, default=None,
                   help="ViT training images, the last of the permutation (default 20000, --quick 4000)")
    p.add_argument("--vit-epochs", type=int, default=None, help="ViT training epochs (default 12, --quick 2)")
    p.add_argument("--vit-seed", type=int, default=0, help="seed of the ViT's training (default 0)")
    p.add_argument("--seeds", type=int, nargs="+", default=None, help="readout / clustering seeds (default 0 1 2)")
    p.add_argument("--epochs", type=int, default=None, help="epochs of the Adam heads (default 10, --quick 3)")
    p.add_argument("--no-logreg", action="store_true", help="skip the logistic-regression bound")
    p.add_argument("--quick", action="store_true", help="small subsets, short training: a few minutes")
    p.add_argument("--out", type=Path, default=Path("reports/paradigm1"), help="where report.md, results.json go")
    p.add_argument("--cache-dir", type=Path, default=None, help="ViT and token cache (default $SOFTVQ_CACHE/paradigm1)")
    p.add_argument("--num-workers", type=int, default=2, help="DataLoader workers (default 2)")
    p.add_argument("--progress", action="store_true", help="show the ViT's training progress bar")
    p.add_argument("--threads", type=int, default=1,
                   help="torch and scikit-learn CPU threads (default 1: beside another CPU-bound process a readout "
                        "step took 0.98 s with 2 threads and 0.10 s with 1)")
    args = p.parse_args(argv)
    quick = args.quick
    defaults = {"train_subset": (2000, 10_000), "vit_train": (4000, 20_000), "vit_epochs": (2, 12),
                "epochs": (3, 10)}
    for name, (small, full) in defaults.items():
        if getattr(args, name) is None:
            setattr(args, name, small if quick else full)
    if args.test_subset is None and quick:
        args.test_subset = 2000
    for flag in ("train_subset", "vit_train", "vit_epochs", "epochs", "test_subset"):
        value = getattr(args, flag)
        if value is not None and value < 1:
            p.error(f"argument --{flag.replace('_', '-')}: expected a positive integer, got {value}")
    if args.num_workers < 0 or args.threads < 1:
        p.error(f"--num-workers must be >= 0 and --threads >= 1, got {args.num_workers} and {args.threads}")
    if args.encoders is None:
        args.encoders = ["vqvae", "vit"] if args.checkpoint is not None or args.tokens is not None else ["vit"]
    return args


def config_from(args: argparse.Namespace) -> Paradigm1Config:
    base = Paradigm1Config(**QUICK) if args.quick else Paradigm1Config()
    changes = {"epochs": args.epochs}
    if args.seeds is not None:
        changes["seeds"] = tuple(args.seeds)
    return Paradigm1Config(**{**asdict(base), **changes})


def main(argv: list[str] | None = None) -> dict[str, Any]:
    from threadpoolctl import threadpool_limits

    from eval.paradigm1.encoders import vit_tokens, vqvae_tokens
    from eval.paradigm1.report import write_report
    from eval.paradigm1.vit import ViTConfig

    args = parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    cfg = config_from(args)
    torch.set_num_threads(args.threads)
    begin = time.perf_counter()
    sources: dict[str, Any] = {}
    if args.tokens is not None:
        sources["tokens"] = lambda: (*load_token_file(args.tokens), {"file": str(args.tokens)})
    else:
        if "vqvae" in args.encoders:
            sources["vqvae"] = lambda: vqvae_tokens(args)
        if "vit" in args.encoders:
            sources["vit"] = lambda: vit_tokens(args, replace(ViTConfig(), epochs=args.vit_epochs))
    results: dict[str, Any] = {"command": " ".join(["python -m eval.paradigm1", *(argv if argv is not None
                                                                                  else sys.argv[1:])]),
                               "encoders": {}}
    for name, make in sources.items():
        start = time.perf_counter()
        train, test, facts = make()
        log.info("%s: %s training and %s test sequences of %s tokens", name, len(train.labels), len(test.labels),
                 tuple(train.tokens.shape[1:]))
        with threadpool_limits(args.threads):  # scikit-learn's OpenMP and BLAS threads
            study = run_paradigm1(train, test, cfg, logreg=not args.no_logreg)
        results["encoders"][name] = {"encoder": facts, **study, "wall_seconds": time.perf_counter() - start}
    results["seconds"] = time.perf_counter() - begin
    results["threads"] = torch.get_num_threads()
    write_report(results, args.out)
    return results
