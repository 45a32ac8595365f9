"""Lightning callbacks and plugins of the trainers: per-epoch history.jsonl, reconstruction grids, checkpoints written
atomically, and a check that DDP processes hold the same codebook."""

from __future__ import annotations

import json
import logging
import math
import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

import lightning as L
import torch
import torch.distributed as dist
from lightning.pytorch.callbacks import ModelCheckpoint
from lightning.pytorch.loggers import TensorBoardLogger
from lightning.pytorch.plugins.io import TorchCheckpointIO
from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.figure import Figure
from torch import nn
from torchvision.utils import make_grid

from softvq._collectives import is_distributed
from softvq.models.checkpoint_io import load_torch_file
from softvq.models.files import write_atomic

log = logging.getLogger("softvq")


def read_history(path: str | os.PathLike) -> list[dict[str, Any]]:
    """The records of a ``history.jsonl`` file, oldest first ([] if it does not exist).

    Raises:
        ValueError: a line is not a JSON object (naming the file and line).
    """
    path = Path(path)
    if not path.exists():
        return []
    rows = []
    for number, line in enumerate(path.read_text().splitlines(), start=1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except json.JSONDecodeError as err:
            raise ValueError(f"{path}:{number} is not valid JSON ({err}); the history file is corrupt") from err
        if not isinstance(row, dict):
            raise ValueError(f"{path}:{number} is not a JSON object")
        rows.append(row)
    return rows


class AtomicCheckpointIO(TorchCheckpointIO):
    """Lightning's ``torch.save`` checkpoint IO, but through :func:`write_atomic`: a run killed while saving keeps its
    previous checkpoint intact; and loading always with ``weights_only=True``.

    Lightning's own local save goes through an fsspec transaction whose temporary file lives in the system temp
    directory: when that is another file system the final move is a copy (a kill mid-copy truncates the checkpoint),
    it does not ``fsync``, and a kill leaves the temporary file behind there.
    """

    def save_checkpoint(self, checkpoint: dict[str, Any], path: str | os.PathLike,
                        storage_options: Any | None = None) -> None:
        if storage_options is not None:
            raise TypeError(f"{type(self).__name__} does not take storage_options")
        Path(path).parent.mkdir(parents=True, exist_ok=True)
        write_atomic(path, lambda f: torch.save(checkpoint, f))

    def load_checkpoint(self, path: str | os.PathLike, map_location: Any | None = None,
                        weights_only: bool | None = None) -> dict[str, Any]:
        """The checkpoint at ``path``, always with ``weights_only=True`` (whatever is asked): a resumed file never runs
        code. Errors name the file (:func:`models.checkpoint_io.load_torch_file`)."""
        return load_torch_file(path, "checkpoint", map_location=map_location or "cpu")


def _json_value(value: Any) -> Any:
    if isinstance(value, float) and not math.isfinite(value):
        return None  # JSON has no NaN/Inf
    return value


def format_record(record: dict[str, Any]) -> str:
    """One human-readable line for an epoch record. The codebook figures on held-out images (``val ...``) lead when
    the epoch was validated; the training epoch's (``train ...``) count restarted codes as used, so they are labelled
    and come second."""
    parts = [f"epoch {record['epoch']:>3}", f"{record['quantizer']:<5}"]
    if record.get("val_utilization") is not None:
        parts.append(f"val util {100 * record['val_utilization']:5.1f}% dead {record['val_dead_codes']:>4} "
                     f"ppl {record['val_perplexity']:7.1f}")
    parts += [f"train util {100 * record['utilization']:5.1f}% dead {record['dead_codes']:>4} "
              f"ppl {record['perplexity']:7.1f}", f"train_mse {record['train_mse']:.4f}"]
    if record.get("val_psnr") is not None:
        parts.append(f"val_psnr {record['val_psnr']:.2f} (hard {record['val_psnr_hard']:.2f})")
        parts.append(f"ssim {record['val_ssim']:.3f}")
    if "identity_residual" in record:
        parts.append(f"V {record['v']:.3g} residual {record['identity_residual']:.1e}")
    if "temperature" in record:
        parts.append(f"T {record['temperature']:.3g}")
    parts.append(f"{record['time_s']:.0f}s")
    return " | ".join(parts)


class HistoryWriter(L.Callback):
    """Appends ``pl_module.epoch_summary()`` to ``path`` (one JSON object per line) after every training epoch.

    The file is rewritten atomically each time. When a run resumes, records of epochs at or after the resumed
    epoch (written after the checkpoint it resumes from) are dropped, so the file never holds an epoch twice.
    Each record is also logged (``logging`` logger ``"softvq"``) and printed above the progress bar, as one line
    made by ``formatter`` (default :func:`format_record`, the VQ-VAE's figures).
    """

    def __init__(self, path: str | os.PathLike, echo: bool = True,
                 formatter: Callable[[dict[str, Any]], str] | None = None) -> None:
        self.path = Path(path)
        self.echo = echo
        self.formatter = formatter or format_record

    def on_train_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        if not trainer.is_global_zero:
            return
        rows = read_history(self.path)
        kept = [row for row in rows if row.get("epoch", 0) <= trainer.current_epoch]
        if len(kept) != len(rows):
            write_atomic(self.path, "".join(json.dumps(row) + "\n" for row in kept))

    def on_train_epoch_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        record = pl_module.epoch_summary()  # every rank: the metrics synchronise
        if not trainer.is_global_zero or trainer.sanity_checking:
            return
        rows = read_history(self.path)
        rows.append({k: _json_value(v) for k, v in record.items()})
        write_atomic(self.path, "".join(json.dumps(row) + "\n" for row in rows))
        line = self.formatter(record)
        log.info(line)
        if self.echo:
            pl_module.print(line)


ROW_LABELS = ("original", "soft\nreconstruction", "hard codes\ndecoded")


def labelled_rows_png(rows: list[torch.Tensor], labels: tuple[str, ...], title: str, file: Any) -> None:
    """Rows of ``(N, C, H, W)`` images in ``[0, 1]``, each row labelled, enlarged (nearest) to a readable size, as PNG.

    matplotlib's object API (``Figure``), not pyplot: no global backend or figure state is touched.
    """
    n = rows[0].shape[0]
    cell = 0.8  # inches per 32-pixel image: about 2.5x its pixels at 100 dpi
    fig = Figure(figsize=(1.4 + cell * n, 0.35 + cell * len(rows)), dpi=100)
    axes = fig.subplots(len(rows), 1, squeeze=False)[:, 0]
    for ax, row, label in zip(axes, rows, labels, strict=True):
        strip = make_grid(row, nrow=n, padding=2, pad_value=1.0)
        ax.imshow(strip.permute(1, 2, 0).numpy(), interpolation="nearest")
        ax.set_xticks([])
        ax.set_yticks([])
        ax.set_ylabel(label, rotation=0, ha="right", va="center", fontsize=9)
    fig.suptitle(title, fontsize=10)
    FigureCanvasAgg(fig)
    fig.savefig(file, format="png", bbox_inches="tight")


class EpochCheckpoint(ModelCheckpoint):
    """A ``ModelCheckpoint`` whose ``{epoch}`` in file names counts from 1, as history.jsonl, the PNGs and the logs
    do (Lightning's counts from 0): ``best-epoch03.ckpt`` is the checkpoint after the third epoch."""

    def format_checkpoint_name(self, metrics: dict[str, torch.Tensor], *args: Any, **kwargs: Any) -> str:
        if "epoch" in metrics:
            metrics = {**metrics, "epoch": metrics["epoch"] + 1}
        return super().format_checkpoint_name(metrics, *args, **kwargs)


class ReconstructionGrid(L.Callback):
    """Saves originals / soft reconstructions / hard-decoded reconstructions of the first validation batch (for a
    residual stack also the reconstructions decoded from its first 1, 2, ... levels).

    Written as ``<directory>/recon_epochNN.png`` (rows: originals, soft, hard, levels) and logged to TensorBoard.
    """

    def __init__(self, directory: str | os.PathLike) -> None:
        self.directory = Path(directory)

    def on_validation_batch_end(self, trainer: L.Trainer, pl_module: L.LightningModule, outputs: Any, batch: Any,
                                batch_idx: int, dataloader_idx: int = 0) -> None:
        if batch_idx != 0 or not trainer.is_global_zero or trainer.sanity_checking or not isinstance(outputs, dict):
            return
        rows = [outputs[k].detach().float().clamp(0, 1).cpu() for k in ("images", "reconstruction",
                                                                       "reconstruction_hard")]
        levels = [r.detach().float().clamp(0, 1).cpu() for r in outputs.get("reconstruction_levels", [])]
        labels = (*ROW_LABELS, *(f"first {q} level{'s' * (q > 1)}" for q in range(1, len(levels) + 1)))
        rows += levels
        grid = make_grid(torch.cat(rows), nrow=rows[0].shape[0], padding=2, pad_value=1.0)
        epoch = trainer.current_epoch + 1
        self.directory.mkdir(parents=True, exist_ok=True)
        title = f"{getattr(pl_module, 'quantizer_name', '')} validation images, epoch {epoch}".strip()
        write_atomic(self.directory / f"recon_epoch{epoch:02d}.png",
                     lambda f: labelled_rows_png(rows, labels, title, f))
        for logger in trainer.loggers:
            if isinstance(logger, TensorBoardLogger):
                logger.experiment.add_image("val/reconstructions", grid, global_step=trainer.global_step)


def replica_differences(module: nn.Module) -> dict[str, int]:
    """Under ``torch.distributed``: the tensors of ``module`` (parameters, buffers, and each submodule's
    ``temperature``) that differ on any process from rank 0's, with the number of differing entries; the same dict on
    every process. Compares bit for bit (one broadcast and one all-reduce in all); ``{}`` when not distributed.
    """
    if not is_distributed():
        return {}
    named = [(name, t.detach()) for name, t in (*module.named_parameters(), *module.named_buffers())]
    named += [(f"{name}.temperature" if name else "temperature", torch.tensor(m.temperature, dtype=torch.float64))
              for name, m in module.named_modules() if isinstance(getattr(m, "temperature", None), (int, float))]
    device = named[0][1].device if named else torch.device("cpu")
    # float64 holds every float32/bf16 value and every count below 2^53 exactly
    flat = torch.cat([t.reshape(-1).to(device=device, dtype=torch.float64) for _, t in named])
    reference = flat.clone()
    dist.broadcast(reference, src=0)
    differs = (flat != reference) & ~(flat.isnan() & reference.isnan())
    counts = torch.stack([part.sum() for part in differs.split([t.numel() for _, t in named])])
    dist.all_reduce(counts, op=dist.ReduceOp.MAX)
    return {name: int(c) for (name, _), c in zip(named, counts.tolist(), strict=True) if c}


class ReplicaCheck(L.Callback):
    """Under DDP, checks every ``every_n_steps`` training steps that the codebook (``pl_module.quantizer``'s
    parameters, buffers and temperatures) is bit-identical on every process, and stops training otherwise.

    DDP keeps the weights in step by averaging gradients, and broadcasts buffers from rank 0 before each forward;
    state that a quantizer changes itself during a step (data initialisation, dead-code restarts, EMA updates,
    temperature control) stays in step only if the quantizer synchronises it. This checks that it did.

    Raises:
        RuntimeError: naming the step and the differing tensors (on every process, so none is left waiting).
    """

    def __init__(self, every_n_steps: int = 1) -> None:
        if every_n_steps < 1:
            raise ValueError(f"every_n_steps must be a positive integer, got {every_n_steps}")
        self.every_n_steps = every_n_steps
        self.checks = 0

    def on_train_batch_end(self, trainer: L.Trainer, pl_module: L.LightningModule, outputs: Any, batch: Any,
                           batch_idx: int) -> None:
        if trainer.world_size <= 1 or trainer.global_step % self.every_n_steps:
            return
        differences = replica_differences(pl_module.quantizer)
        if differences:
            listed = ", ".join(f"{name} ({count} entries)" for name, count in differences.items())
            raise RuntimeError(f"after global step {trainer.global_step} the codebook differs between the "
                               f"{trainer.world_size} processes: {listed}")
        self.checks += 1

    def on_train_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        if self.checks and trainer.is_global_zero:
            message = (f"replica check: the codebook was identical on all {trainer.world_size} processes after each "
                       f"of {self.checks} checked steps (every {self.every_n_steps})")
            log.info(message)
            pl_module.print(message)
