"""``softvq-train``: train VQ-VAEs on CIFAR-10 with a DDCL soft codebook and/or a hard straight-through VQ, side by
side. Flags and ``--config`` files: :mod:`softvq.cli.config`.

Examples:
    # both quantizers, 10k training images, 5 epochs, offline from the shared archive:
    softvq-train --quantizer ddcl hard --epochs 5 --data.train_subset 10000 \\
        --data.data_root ../shared/data/cifar10-jpeg.tar.gz --out runs/compare
    # the same from a file (write one with --print_config > run.yaml):
    softvq-train --config run.yaml
    # continue a run from its last checkpoint (to a larger epoch count):
    softvq-train --quantizer ddcl --out runs/ddcl --epochs 20 --resume last

Every run directory (``--out``, or ``--out/<quantizer>`` when several quantizers are given) holds
``history.jsonl`` (one JSON object per epoch, epochs counted from 1: codebook health, losses, validation metrics),
``config.json`` (every setting as the run used it), ``checkpoints/last.ckpt`` and ``checkpoints/best-epochNN.ckpt``
(lowest validation MSE, NN the epoch counted from 1), ``recon_epochNN.png`` (originals / soft / hard-decoded
reconstructions) and TensorBoard logs in ``tb/`` (``tensorboard --logdir <out>``). With several quantizers a
per-epoch comparison table is printed at the end and written to ``<out>/comparison.md``; ``<out>/comparison.png``
draws the per-epoch curves (:mod:`softvq.cli.comparison`; one quantizer's too), and a closing block names every file
written. The run directory's
bookkeeping (config.json, invocations.jsonl, --resume, the locks) is :mod:`softvq.cli._run_directory`.
"""

from __future__ import annotations

import math
import signal
import sys
import warnings
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import lightning as L
from jsonargparse import Namespace
from lightning.pytorch.callbacks import ModelCheckpoint
from lightning.pytorch.loggers import TensorBoardLogger
from lightning.pytorch.utilities import rank_zero_only

from softvq.cli import config
from softvq.cli._run_directory import (  # the run directory's bookkeeping; its names are also importable from here
    discard_unstarted,
    last_good_checkpoint,
    prepare_out,
    resume_changes,
    resume_point,
    run_locks,
)
from softvq.cli.common import (
    GracefulStop,
    Interrupted,
    data_messages,
    run_command,
)
from softvq.cli.comparison import write_comparison_png
from softvq.data.cifar10 import CIFAR10DataModule, check_same_classes
from softvq.models import VQVAE
from softvq.models.callbacks import (
    EpochCheckpoint,
    HistoryWriter,
    ReconstructionGrid,
    ReplicaCheck,
    read_history,
)
from softvq.models.checkpoint_io import checkpoint_classes
from softvq.models.files import write_atomic
from softvq.models.progress import EpochProgressBar


def checkpoint_callbacks(dirpath: Path, validation: bool) -> list[ModelCheckpoint]:
    """``last.ckpt`` after every training epoch and, with validation, ``best-epochNN.ckpt`` (lowest val MSE).

    Two callbacks, because Lightning's ``save_last=True`` rewrites ``last.ckpt`` only in an epoch whose top-k
    checkpoint was saved too: after an epoch that did not improve the validation MSE it kept the previous epoch.
    """
    last = ModelCheckpoint(dirpath=dirpath, filename="last", monitor=None, save_top_k=1, save_on_train_epoch_end=True,
                           enable_version_counter=False)
    if not validation:
        return [last]
    best = EpochCheckpoint(dirpath=dirpath, filename="best-epoch{epoch:02d}", auto_insert_metric_name=False,
                           monitor="val/mse", mode="min", save_top_k=1, save_on_train_epoch_end=True)
    return [best, last]


def build_trainer(cfg: Namespace, out: Path, validation: bool, steps_per_epoch: int) -> L.Trainer:
    """The Lightning Trainer of one run: history, reconstruction grids, atomic checkpoints, the DDP replica check."""
    hw = config.hardware(cfg)
    # the bar first: Lightning calls callbacks in order, so each epoch's bar is closed on its own line before
    # HistoryWriter prints the epoch's summary
    bar = [EpochProgressBar(steps_per_epoch * hw.accumulate_grad_batches)] if hw.progress_bar else []
    callbacks = [*bar, HistoryWriter(out / "history.jsonl"), ReconstructionGrid(out),
                 *checkpoint_callbacks(out / "checkpoints", validation=validation)]
    if cfg.check_replicas:
        callbacks.append(ReplicaCheck(cfg.check_replicas))
    return L.Trainer(
        max_epochs=cfg.epochs, default_root_dir=out, **hw.trainer_kwargs(),
        # The data module shards every split itself (GlobalBatchSampler): N processes with batch size B see the
        # batches of one process with N * B. LatentNorm synchronises its batch statistics itself (SyncBatchNorm
        # refuses CPU tensors), so Lightning's sync_batchnorm stays off.
        use_distributed_sampler=False, sync_batchnorm=False,
        logger=TensorBoardLogger(save_dir=str(out), name="tb", version=""), callbacks=callbacks,
        num_sanity_val_steps=0, limit_val_batches=1.0 if validation else 0,
        log_every_n_steps=max(1, min(50, steps_per_epoch)), enable_model_summary=False)


def train_one(cfg: Namespace, quantizer: str, out: Path, stop: GracefulStop | None = None,
              argv: Sequence[str] | None = None) -> list[dict[str, Any]]:
    """Train (or resume) one VQ-VAE into ``out``; returns its history records.

    Everything is checked (every constructor's arguments, the checkpoint, the settings against the run's config.json,
    the data and its classes) before anything is written. Call with ``out``'s :class:`~softvq.models.files.RunLock`
    held.

    Raises:
        FloatingPointError: NaN/Inf in a batch, the latents or the loss; the message names the step and the last
            good checkpoint, which is kept.
        Interrupted: SIGTERM/SIGINT (``stop``) ended training; the last good checkpoint is kept.
    """
    model_args = config.model_kwargs(cfg, quantizer)
    L.seed_everything(cfg.seed, workers=True, verbose=False)
    model = VQVAE(**model_args)  # invalid settings fail here, in the constructor that owns them
    run = config.resolved_config(cfg, quantizer, model)
    ckpt_path, ckpt = resume_point(cfg, out, model_args)
    changed = resume_changes(run, out) if cfg.resume is not None else {}
    data = CIFAR10DataModule(**config.data_kwargs(cfg))
    data.prepare_data()
    data.setup("fit")  # bad or missing data, and train/ and test/ with other classes, fail here, before any write
    saved_classes = checkpoint_classes(ckpt) if ckpt is not None else None
    if saved_classes is not None:
        check_same_classes(saved_classes, data.classes, f"checkpoint {ckpt_path}", f"the data at {cfg.data.data_root}")
    # A new run (or one --overwrite replaces): if it fails before its first checkpoint, nothing of it is kept.
    fresh = ckpt_path is None and (cfg.overwrite or not (out / "history.jsonl").exists())
    if rank_zero_only.rank == 0:  # under DDP the other processes re-run this script: one process owns --out
        prepare_out(cfg, run, out, changed, argv)

    # Lightning's DDP strategies re-seed the global random state when fit starts (reset_seed); do the same in one
    # process, so data initialisation and dead-code restarts draw alike whatever the number of processes.
    L.seed_everything(cfg.seed, workers=True, verbose=False)
    hw = config.hardware(cfg)
    if hw.compile:
        model.compile_parts()
    batches = math.ceil(len(data.train_set) / (cfg.data.batch_size * hw.devices_per_node * hw.num_nodes))
    steps_per_epoch = math.ceil(batches / hw.accumulate_grad_batches)  # optimizer steps
    trainer = build_trainer(cfg, out, validation=cfg.data.val_size > 0, steps_per_epoch=steps_per_epoch)
    try:
        _fit(trainer, model, data, ckpt_path, out, stop)
    except BaseException:
        if fresh and rank_zero_only.rank == 0:
            discard_unstarted(out)
        raise
    return read_history(out / "history.jsonl")


def _fit(trainer: L.Trainer, model: VQVAE, data: CIFAR10DataModule, ckpt_path: Path | None, out: Path,
         stop: GracefulStop | None) -> None:
    """``trainer.fit``, with a failure's or a signal's message naming the last good checkpoint."""
    with warnings.catch_warnings():
        # One core per worker is the right setting on small machines; Lightning's hint does not apply.
        warnings.filterwarnings("ignore", message=".*does not have many workers.*")
        # Resuming writes into the run's own checkpoint directory on purpose.
        warnings.filterwarnings("ignore", message="Checkpoint directory .* exists and is not empty")
        # Lightning's pytree helper against newer torch; harmless.
        warnings.filterwarnings("ignore", message=".*isinstance\\(treespec, LeafSpec\\)` is deprecated")
        if stop is not None:
            stop.trainer = trainer
        try:
            # weights_only=True: resuming never runs code from the checkpoint (AtomicCheckpointIO enforces it too)
            trainer.fit(model, datamodule=data, ckpt_path=str(ckpt_path) if ckpt_path else None, weights_only=True)
        except FloatingPointError as err:
            raise FloatingPointError(f"{err}\n{last_good_checkpoint(out)}") from err
        except (Exception, SystemExit) as err:  # Lightning ends a stopped fit with SystemExit (SIGTERMException)
            if stop is None or stop.signum is None:
                raise
            kept = last_good_checkpoint(out, "run the same command with --resume")
            raise Interrupted(stop.signum, f"{stop_name(stop.signum)} stopped the training of {out} in epoch "
                                           f"{trainer.current_epoch + 1}. {kept}") from err
        finally:
            if stop is not None:
                stop.trainer = None
    if stop is not None and stop.signum is not None:  # the signal came as the last epoch ended: it is complete
        raise Interrupted(stop.signum, f"{stop_name(stop.signum)} arrived as {out} finished its last epoch; the run "
                                       f"is complete.")


def stop_name(signum: int) -> str:
    return signal.Signals(signum).name


def comparison_table(histories: dict[str, list[dict[str, Any]]]) -> str:
    """A markdown table with one row per epoch and, per quantizer, codebook health on the validation split
    (utilization, dead codes, perplexity; training-epoch counts include the codes a restart revived, so they are shown
    only for a run without validation, marked "train"), the training epoch's restarts and the validation PSNR."""
    names = list(histories)
    columns = ("util %", "dead", "ppl", "restarts", "val PSNR (hard)")
    header = ["epoch"] + [f"{n} {col}" for n in names for col in columns]
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    epochs = sorted({row["epoch"] for rows in histories.values() for row in rows})
    for epoch in epochs:
        cells = [str(epoch)]
        for name in names:
            row = next((r for r in histories[name] if r["epoch"] == epoch), None)
            cells += [""] * len(columns) if row is None else _table_cells(row)
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def _table_cells(row: dict[str, Any]) -> list[str]:
    val = row.get("val_utilization") is not None
    util, dead, ppl = ((row["val_utilization"], row["val_dead_codes"], row["val_perplexity"]) if val else
                       (row["utilization"], row["dead_codes"], row["perplexity"]))
    mark = "" if val else " (train)"
    psnr = "n/a" if row.get("val_psnr") is None else f"{row['val_psnr']:.2f} ({row['val_psnr_hard']:.2f})"
    restarts = "n/a" if row.get("restarts") is None else str(row["restarts"])
    return [f"{100 * util:.1f}{mark}", f"{dead}{mark}", f"{ppl:.1f}{mark}", restarts, psnr]


def main(argv: Sequence[str] | None = None) -> dict[str, list[dict[str, Any]]]:
    cfg = config.parse(argv)
    if cfg.resume not in (None, "last") and len(cfg.quantizer) > 1:
        raise ValueError("--resume with a checkpoint path needs a single --quantizer (use --resume alone to resume "
                         "every run from its own last checkpoint)")
    several, out = len(cfg.quantizer) > 1, Path(cfg.out)
    histories = {}
    with GracefulStop() as stop, run_locks(cfg):  # first: a second run into the same --out is refused at once
        config.check_all(cfg)  # every constructor's checks, before any run starts (they read and write nothing)
        for i, quantizer in enumerate(cfg.quantizer):
            try:
                histories[quantizer] = train_one(cfg, quantizer, out / quantizer if several else out, stop, argv)
            except Interrupted as err:
                if not several:
                    raise
                unfinished = ", ".join(f"{q} ({'interrupted' if j == i else 'not started'})"
                                       for j, q in enumerate(cfg.quantizer) if j >= i)
                raise Interrupted(err.signum, f"{err} Runs not finished: {unfinished}; run the same command with "
                                              f"--resume to finish them.") from err
    table = comparison_table(histories)
    if rank_zero_only.rank != 0:
        return histories
    if several:
        write_atomic(out / "comparison.md", table)
    write_comparison_png(histories, out / "comparison.png")
    print("\nPer-epoch codebook health on the validation split, restarts in the training epoch, and validation PSNR "
          "(soft and decoded from hard indices):\n" + table)
    print(outputs_summary(out, {q: out / q if several else out for q in histories}))
    return histories


def outputs_summary(out: Path, runs: dict[str, Path]) -> str:
    """The block printed at the end of a command: every file it leaves in ``out``, as found there (the comparison,
    each run's checkpoints, reconstruction grids, history and settings), and the TensorBoard command."""
    lines = [f"Outputs in {out}/:"]
    compared = [p.name for p in (out / "comparison.md", out / "comparison.png") if p.exists()]
    if compared:
        what = "table and curves" if len(compared) == 2 else "curves" if compared[0].endswith(".png") else "table"
        lines.append(f"  {', '.join(compared)}: the per-epoch {what} of {', '.join(runs)}")
    for name, run in runs.items():
        at = f"{run.relative_to(out)}/" if run != out else ""
        checkpoints = ", ".join(sorted(p.name for p in (run / "checkpoints").glob("*.ckpt")))
        grids = sorted(p.name for p in run.glob("recon_epoch*.png"))
        shown = grids[:1] if len(grids) == 1 else [f"{grids[0]} ... {grids[-1]}"] if grids else []
        lines.append(f"  {name}: {at}checkpoints/ ({checkpoints}), {at}history.jsonl, {at}config.json"
                     + "".join(f", reconstructions {at}{text}" for text in shown))
    lines.append(f"  TensorBoard: tensorboard --logdir {out}")
    return "\n".join(lines)


def cli(argv: Sequence[str] | None = None) -> int:
    """:func:`main` as a command: expected failures (missing or bad data, a bad checkpoint or setting, an unusable or
    busy --out, NaN/Inf in training) print one ``error:`` message and return 2; a bad flag, config key or value exits
    2 with one ``error:`` line naming it (:func:`softvq.cli.parsing.parse`); SIGTERM / SIGINT stop it at the next
    batch, keep the last good checkpoint and return 143 / 130."""
    with data_messages():  # where the data archive was unpacked, the first time
        return run_command(main, argv)


if __name__ == "__main__":
    sys.exit(cli())
