"""Lightning callbacks of the VQ-VAE trainer: per-epoch history.jsonl and reconstruction grids."""

from __future__ import annotations

import json
import logging
import math
import os
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

import lightning as L
import torch
from lightning.pytorch.loggers import TensorBoardLogger
from torchvision.utils import make_grid, save_image

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


def write_atomic(path: str | os.PathLike, text: str) -> None:
    """Write ``text`` to ``path`` through a temporary file and a rename, so no reader sees half a file."""
    path = Path(path)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", dir=path.parent)
    try:
        os.chmod(tmp, 0o644)  # mkstemp creates the file private; these are ordinary outputs
        with os.fdopen(fd, "w") as f:
            f.write(text)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def _json_value(value: Any) -> Any:
    if isinstance(value, float) and not math.isfinite(value):
        return None  # JSON has no NaN/Inf
    return value


def format_record(record: dict[str, Any]) -> str:
    """One human-readable line for an epoch record."""
    parts = [f"epoch {record['epoch']:>3}", f"{record['quantizer']:<5}",
             f"util {100 * record['utilization']:5.1f}%", f"dead {record['dead_codes']:>4}",
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


class ReconstructionGrid(L.Callback):
    """Saves originals / soft reconstructions / hard-decoded reconstructions of the first validation batch.

    Written as ``<directory>/recon_epochNN.png`` (rows: originals, soft, hard) and logged to TensorBoard.
    """

    def __init__(self, directory: str | os.PathLike) -> None:
        self.directory = Path(directory)

    def on_validation_batch_end(self, trainer: L.Trainer, pl_module: L.LightningModule, outputs: Any, batch: Any,
                                batch_idx: int, dataloader_idx: int = 0) -> None:
        if batch_idx != 0 or not trainer.is_global_zero or trainer.sanity_checking or not isinstance(outputs, dict):
            return
        rows = [outputs["images"], outputs["reconstruction"], outputs["reconstruction_hard"]]
        images = torch.cat([r.detach().float().clamp(0, 1).cpu() for r in rows])
        grid = make_grid(images, nrow=rows[0].shape[0], padding=2, pad_value=1.0)
        epoch = trainer.current_epoch + 1
        self.directory.mkdir(parents=True, exist_ok=True)
        save_image(grid, self.directory / f"recon_epoch{epoch:02d}.png")
        for logger in trainer.loggers:
            if isinstance(logger, TensorBoardLogger):
                logger.experiment.add_image("val/reconstructions", grid, global_step=trainer.global_step)
