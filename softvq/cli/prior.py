"""Train an autoregressive transformer prior over the code grids of a trained VQ-VAE (CIFAR-10).

Examples:
    # codes of 10,000 training images under a DDCL VQ-VAE, a 4-layer 256-wide prior, 10 epochs:
    softvq-prior --vqvae runs/ddcl/checkpoints/last.ckpt --data.train_subset 10000 \
        --data.data_root ../shared/data/cifar10-jpeg.tar.gz --out runs/prior-ddcl
    # class-conditional, and continue a run to more epochs:
    softvq-prior --vqvae CKPT --model.class_conditional true --out runs/prior-cond --epochs 20 --resume
    # the same settings from a file (write one with --print_config > prior.yaml):
    softvq-prior --config prior.yaml

The VQ-VAE encodes the training images (``--data.train_subset`` of the 45,000 left after the fixed validation
hold-out), the ``--data.val_size`` validation images and the official 10,000 test images once; their hard code
indices are cached under ``--codes_cache`` (default ``$SOFTVQ_CACHE/codes``) keyed by the checkpoint's SHA-256 and
the data selection. The prior models each ``h x w`` grid (8 x 8 for the default VQ-VAE) in raster order.

``--out`` holds ``history.jsonl`` (per epoch: ``train_bits`` and ``val_bits``, the NLL in bits per code position),
``checkpoints/last.ckpt`` (every epoch) and ``checkpoints/best-epochNN.ckpt`` (lowest validation NLL; Lightning
numbers NN from 0), ``config.json`` (the resolved settings, a file for ``--config``), TensorBoard logs in ``tb/``,
and ``test.json``: the final prior's NLL on the official test split's codes (bits per position, overall and per
grid position) beside the context-free baselines (the entropy of the test codes, ``log2`` of their perplexity, and
the cross-entropy of the training codes' frequencies on them).

The command's flags are the fields of :class:`~softvq.cli.prior_settings.PriorRun` and
:class:`~softvq.cli.prior_settings.PriorModel` (``softvq/cli/prior_settings.py``), with ``--data.*`` and
``--trainer.*``.
"""

from __future__ import annotations

import argparse
import json
import logging
import math
import signal
import sys
import time
import warnings
from collections.abc import Sequence
from dataclasses import asdict
from pathlib import Path
from typing import Any

import lightning as L
import torch
from jsonargparse import ArgumentParser
from lightning.pytorch.callbacks import ModelCheckpoint
from lightning.pytorch.loggers import TensorBoardLogger
from torch.utils.data import DataLoader, TensorDataset

from softvq._compat import upgrade_prior_config, upgrade_prior_hparams
from softvq.cli.common import GracefulStop, Hardware, Interrupted, claim_run_directory, run_command
from softvq.cli.parsing import command_parser, parse, resolved
from softvq.cli.prior_settings import PROG, TRAINER_SKIP, PriorModel, PriorRun, cfg_section
from softvq.data.cifar10 import CIFAR10DataModule, check_same_classes, sha256_file
from softvq.models.callbacks import EpochCheckpoint, HistoryWriter, read_history
from softvq.models.checkpoint_io import load_torch_file
from softvq.models.codes import CodeSet, code_splits
from softvq.models.files import RunLock, write_atomic
from softvq.models.prior import (
    CodePrior,
    VQVAERecord,
    evaluate_prior,
    format_prior_record,
    unigram_bits,
    unigram_cross_entropy_bits,
    vqvae_record,
)
from softvq.models.transformer import PriorConfig
from softvq.models.vqvae import load_vqvae

log = logging.getLogger("softvq")


def build_parser() -> ArgumentParser:
    """The ``softvq-prior`` parser: top-level :class:`PriorRun` and ``--resume`` / ``--overwrite`` (as in
    ``softvq-train``), ``--data.*`` from :class:`~softvq.data.CIFAR10DataModule` (the images the VQ-VAE encodes),
    ``--model.*`` from :class:`PriorModel`, ``--trainer.*`` from :class:`~softvq.cli.common.Hardware`."""
    p = command_parser(PROG, __doc__.split("\n\n")[0],
                       epilog="Write a config file with --print_config > prior.yaml and train from it with --config "
                              "prior.yaml.")
    p.add_class_arguments(PriorRun, None)
    p.add_argument("--resume", nargs="?", const="last", default=None, metavar="CKPT",
                   help="continue from a checkpoint: a path, or without a value <out>/checkpoints/last.ckpt")
    p.add_argument("--overwrite", action="store_true",
                   help="start afresh in an --out that already holds a run (its files are removed)")
    p.add_class_arguments(CIFAR10DataModule, "data", skip={"seed"})
    p.set_defaults({"data.batch_size": 256, "data.num_workers": 0})
    p.add_class_arguments(PriorModel, "model")
    p.add_class_arguments(Hardware, "trainer", skip=TRAINER_SKIP)
    return p


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    """The command's settings, checked by their constructors, as one flat namespace (``args.data_root``,
    ``args.lr``, ...; ``args.hardware`` the :class:`Hardware`, ``args.config`` the resolved configuration that
    ``config.json`` records)."""
    cfg = parse(build_parser(), argv)
    run, model, hardware = PriorRun(**cfg_section(cfg, PriorRun)), PriorModel(**cfg.model.as_dict()), \
        Hardware(**cfg.trainer.as_dict())
    data = CIFAR10DataModule(**cfg.data.as_dict())  # its checks, before anything is read
    return argparse.Namespace(
        **asdict(run), resume=cfg.resume, overwrite=cfg.overwrite, **asdict(model), hardware=hardware,
        data_root=cfg.data.data_root, download=data.download, train_subset=data.train_subset,
        val_size=data.val_size, num_workers=data.num_workers, encode_batch_size=data.batch_size,
        data_cache_dir=cfg.data.cache_dir, progress=hardware.progress_bar,
        config=resolved(cfg, exclude=("resume", "overwrite")))


def check_prior_checkpoint(path: Path, config: PriorConfig, sha256: str, soft_targets: float = 0.0) -> None:
    """A readable checkpoint of a prior with this ``config`` and training loss (``soft_targets``) over codes of this
    VQ-VAE; else a clear error."""
    if not path.is_file():
        raise FileNotFoundError(f"checkpoint to resume from not found: {path}")
    ckpt = load_torch_file(path, "checkpoint")  # weights_only=True; UnsafeCheckpointError / ValueError naming it
    # in today's fields, a checkpoint saved before the null class or soft_targets included (softvq._compat)
    saved = upgrade_prior_hparams(ckpt.get("hyper_parameters", {}) if isinstance(ckpt, dict) else {})
    if not isinstance(saved.get("config"), dict) or "state_dict" not in ckpt:
        raise ValueError(f"{path} is not a checkpoint of train_prior.py (no prior config in it)")
    now = config.to_dict()
    before = saved["config"]
    diff = [f"{k}: checkpoint {before.get(k)!r} vs now {v!r}" for k, v in now.items() if before.get(k) != v]
    if diff:
        raise ValueError(f"checkpoint {path} is a prior of another configuration; pass the same flags to resume "
                         f"it:\n  " + "\n  ".join(diff))
    if float(saved["soft_targets"]) != float(soft_targets):
        raise ValueError(f"checkpoint {path} trained with --model.soft_targets {saved['soft_targets']}, not "
                         f"{soft_targets}; pass the same value to resume it")
    old = (saved.get("vqvae") or {}).get("sha256")
    if old != sha256:
        raise ValueError(f"checkpoint {path} models the codes of another VQ-VAE (sha256 {str(old)[:16]}...), not "
                         f"of --vqvae (sha256 {sha256[:16]}...)")


def saved_null_class(path: Path) -> bool:
    """Whether the prior checkpoint at ``path`` has the null class (``False`` for one saved before it existed)."""
    if not path.is_file():
        raise FileNotFoundError(f"checkpoint to resume from not found: {path}")
    ckpt = load_torch_file(path, "checkpoint")
    config = (ckpt.get("hyper_parameters", {}) if isinstance(ckpt, dict) else {}).get("config") or {}
    return bool(upgrade_prior_config(config)["null_class"])  # softvq._compat


def prepare_out(args: argparse.Namespace) -> None:
    """Refuse to start afresh over an old run (unless --overwrite, which clears it); write config.json."""
    claim_run_directory(args.out, args.resume, args.overwrite, ("history.jsonl", "test.json", "checkpoints", "tb"))
    try:
        args.out.mkdir(parents=True, exist_ok=True)
        write_atomic(args.out / "config.json", json.dumps(args.config, indent=2))
    except OSError as err:
        raise OSError(f"cannot write to the output directory {args.out}: {err}") from err


def loader(split: CodeSet, batch_size: int, shuffle: bool, soft: bool = False) -> DataLoader:
    """Batches ``(codes, labels)``, with ``soft`` also the split's soft assignments ``(probs, prob_codes)``."""
    tensors = (split.codes, split.labels, *((split.soft.probs, split.soft.codes) if soft else ()))
    return DataLoader(TensorDataset(*tensors), batch_size=batch_size, shuffle=shuffle)


def test_report(prior: CodePrior, splits: dict[str, CodeSet]) -> dict[str, Any]:
    """The prior's NLL on the test codes beside the context-free baselines, in bits per code position."""
    test, train = splits["test"], splits["train"]
    k = prior.num_codes
    evaluation = evaluate_prior(prior, test.codes, test.labels)
    entropy = unigram_bits(test.codes, k)
    return {
        "test_bits_per_position": evaluation.bits_per_position,
        "test_bits_per_image": evaluation.bits_per_position * prior.config.length,
        "test_position_bits": [[round(v, 4) for v in row] for row in evaluation.position_bits.tolist()],
        "test_sequences": evaluation.sequences,
        "test_unigram_entropy_bits": entropy,  # log2(perplexity) of the test codes
        "test_code_perplexity": 2.0 ** entropy,
        "test_codes_used": int(torch.unique(test.codes).numel()),
        "train_unigram_cross_entropy_bits": unigram_cross_entropy_bits(train.codes, test.codes, k),
        "log2_num_codes": math.log2(k),
    }


def main(argv: Sequence[str] | None = None) -> dict[str, Any]:
    args = parse_args(argv)
    # One run per --out (a second is refused naming the holder's pid); SIGTERM/SIGINT stop at the next batch and
    # exit 143/130 with the last checkpoint kept (docs/training.md, "Run directories, resuming, exit codes").
    with GracefulStop() as stop, RunLock(args.out):
        return train(args, stop)


def encode(args: argparse.Namespace) -> tuple[VQVAERecord, dict[str, CodeSet], tuple[str, ...], float]:
    """The VQ-VAE's record, its code grids of every split (cached), the data's classes and the seconds it took."""
    vqvae = load_vqvae(args.vqvae)  # FileNotFoundError / ValueError naming the file
    sha256 = sha256_file(args.vqvae)
    data = CIFAR10DataModule(args.data_root, batch_size=args.encode_batch_size, val_size=args.val_size,
                             train_subset=args.train_subset, num_workers=args.num_workers, download=args.download,
                             cache_dir=args.data_cache_dir)
    begin = time.perf_counter()
    splits = code_splits(vqvae, sha256, data, args.codes_cache, args.encode_batch_size, args.progress,
                         soft_top_k=args.soft_top_k if args.soft_targets > 0 else None)
    seconds = time.perf_counter() - begin
    if vqvae.class_names is not None:  # the labels of the codes must mean the classes the VQ-VAE was trained on
        check_same_classes(vqvae.class_names, data.classes, f"--vqvae {args.vqvae}", f"the data at {args.data_root}")
    record = vqvae_record(vqvae, args.vqvae, sha256, image_size=int(data.test_set[0][0].shape[-1]),
                          classes=data.classes)
    if tuple(splits["train"].codes.shape[1:]) != (record.height, record.width):
        raise ValueError(f"the VQ-VAE encodes these images into {tuple(splits['train'].codes.shape[1:])} grids, "
                         f"not the {record.height}x{record.width} its downsampling implies")
    return record, splits, data.classes, seconds


def build_trainer(args: argparse.Namespace, has_val: bool, steps_per_epoch: int) -> L.Trainer:
    """The prior's Lightning Trainer: history, ``last.ckpt`` and (with validation) ``best-epochNN.ckpt``."""
    checkpoints = [ModelCheckpoint(dirpath=args.out / "checkpoints", filename="last", monitor=None, save_top_k=1,
                                   save_on_train_epoch_end=True, enable_version_counter=False)]
    if has_val:
        checkpoints.append(EpochCheckpoint(dirpath=args.out / "checkpoints", filename="best-epoch{epoch:02d}",
                                           auto_insert_metric_name=False, monitor="val/bits_per_position",
                                           mode="min", save_top_k=1, save_on_train_epoch_end=True))
    # Each epoch's line goes to the "softvq" logger (the script logs at INFO), not print: it would show twice.
    return L.Trainer(
        max_epochs=args.epochs, default_root_dir=args.out, **args.hardware.trainer_kwargs(),
        logger=TensorBoardLogger(save_dir=str(args.out), name="tb", version=""),
        callbacks=[HistoryWriter(args.out / "history.jsonl", echo=False, formatter=format_prior_record),
                   *checkpoints],
        num_sanity_val_steps=0, limit_val_batches=1.0 if has_val else 0,
        log_every_n_steps=max(1, min(50, steps_per_epoch)), enable_model_summary=False)


def fit(trainer: L.Trainer, prior: CodePrior, splits: dict[str, CodeSet], args: argparse.Namespace,
        ckpt_path: Path | None, stop: GracefulStop) -> float:
    """``trainer.fit`` of the prior; returns its seconds. A signal ends it with :class:`Interrupted`."""
    begin = time.perf_counter()
    has_val = len(splits["val"].labels) > 0
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*does not have many workers.*")  # in-memory codes
        warnings.filterwarnings("ignore", message="Checkpoint directory .* exists and is not empty")
        warnings.filterwarnings("ignore", message=".*no `val_dataloader`")  # --val-size 0
        warnings.filterwarnings("ignore", message=".*isinstance\\(treespec, LeafSpec\\)` is deprecated")
        stop.trainer = trainer
        try:
            trainer.fit(prior, loader(splits["train"], args.batch_size, shuffle=True, soft=prior.soft_targets > 0),
                        loader(splits["val"], 500, shuffle=False) if has_val else None,
                        ckpt_path=str(ckpt_path) if ckpt_path else None, weights_only=True)
        except (Exception, SystemExit) as err:  # Lightning ends a stopped fit with SystemExit (SIGTERMException)
            if stop.signum is None:
                raise
            last = args.out / "checkpoints" / "last.ckpt"
            kept = (f"its last checkpoint, {last}, is kept: run the same command with --resume" if last.is_file()
                    else "it had saved no checkpoint yet")
            raise Interrupted(stop.signum, f"{signal.Signals(stop.signum).name} stopped the training of {args.out} "
                                           f"in epoch {trainer.current_epoch + 1}; {kept}") from err
        finally:
            stop.trainer = None
    return time.perf_counter() - begin


def train(args: argparse.Namespace, stop: GracefulStop) -> dict[str, Any]:
    """The prior run of :func:`main`'s flags, with ``args.out``'s lock held; writes and returns ``test.json``."""
    record, splits, classes, encode_seconds = encode(args)
    ckpt_path = None
    null_class, label_dropout = True, args.label_dropout if args.class_conditional else None
    if args.resume is not None:
        ckpt_path = args.out / "checkpoints" / "last.ckpt" if args.resume == "last" else Path(args.resume)
        null_class = saved_null_class(ckpt_path)
        if not null_class and args.class_conditional:
            log.warning("%s was saved before the null class existed: it trains on without label dropout (and "
                        "samples without guidance)", ckpt_path)
            label_dropout = 0.0
    config = PriorConfig(num_codes=record.num_codes, height=record.height, width=record.width,
                         num_classes=len(classes) if args.class_conditional else 0, null_class=null_class,
                         layers=args.layers, heads=args.heads, dim=args.dim, mlp_ratio=args.mlp_ratio,
                         dropout=args.dropout)
    if ckpt_path is not None:
        check_prior_checkpoint(ckpt_path, config, record.sha256, args.soft_targets)
    prepare_out(args)

    L.seed_everything(args.seed, workers=True, verbose=False)
    prior = CodePrior(config, record, lr=args.lr, weight_decay=args.weight_decay, warmup_steps=args.warmup_steps,
                      min_lr_ratio=args.min_lr_ratio, label_dropout=label_dropout, soft_targets=args.soft_targets)
    steps_per_epoch = math.ceil(len(splits["train"].labels) / args.batch_size)
    trainer = build_trainer(args, len(splits["val"].labels) > 0, steps_per_epoch)
    fit_seconds = fit(trainer, prior, splits, args, ckpt_path, stop)
    history = read_history(args.out / "history.jsonl")
    results = {"vqvae": asdict(record),
               "class_conditional": args.class_conditional, "label_dropout": prior.label_dropout,
               "soft_targets": prior.soft_targets,
               **({"soft_top_k": args.soft_top_k,  # the share of the assignments the kept codes held, mean
                   "soft_mass_kept": float(splits["train"].soft.mass.mean())} if prior.soft_targets > 0 else {}),
               "config": config.to_dict(),
               "parameters": sum(p.numel() for p in prior.parameters()),
               "train_sequences": len(splits["train"].labels), "val_sequences": len(splits["val"].labels),
               "epochs": args.epochs, "fit_seconds": round(fit_seconds, 1), "encode_seconds": round(encode_seconds, 1),
               "threads": torch.get_num_threads(),
               "val_bits_per_position": history[-1]["val_bits"] if history else None,
               **test_report(prior, splits)}
    write_atomic(args.out / "test.json", json.dumps(results, indent=2) + "\n")
    print(f"{args.out}: test NLL {results['test_bits_per_position']:.4f} bits per code position "
          f"({results['test_bits_per_image']:.1f} bits per image); the test codes' unigram entropy "
          f"log2(perplexity) is {results['test_unigram_entropy_bits']:.4f} bits ({results['test_codes_used']} of "
          f"{config.num_codes} codes used); log2 K = {results['log2_num_codes']:.4f}")
    return results


def cli(argv: Sequence[str] | None = None) -> int:
    """:func:`main` as a command: expected failures print one ``error:`` line and return 2."""
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    return run_command(main, argv)


if __name__ == "__main__":
    sys.exit(cli())
