"""The training commands' progress bar: Lightning's tqdm bars, with the epochs counted as the run's files count them."""

from __future__ import annotations

import sys
from typing import Any

import lightning as L
from lightning.pytorch.callbacks import TQDMProgressBar
from lightning.pytorch.callbacks.progress.tqdm_progress import Tqdm, convert_inf

# Bar updates per epoch when the output is a file or a pipe (a log), where every update is kept as text.
LOG_UPDATES_PER_EPOCH = 20


class EpochProgressBar(TQDMProgressBar):
    """Lightning's :class:`TQDMProgressBar` with three changes for a console that reads as the run's files do:

    - epochs count from 1 (``Epoch 1/3``), as ``history.jsonl``, the checkpoints and the PNGs count them (Lightning's
      bar counts from 0);
    - each training epoch's bar is left on its own line when the epoch ends (``leave=True``), so a line printed then
      (the epoch's summary, :class:`~softvq.models.callbacks.HistoryWriter`) starts a line of its own instead of
      following the bar's last ``\\r`` update. Put this callback before the one that prints: Lightning calls
      callbacks in their order;
    - when the output is not a terminal, the bar is redrawn about :data:`LOG_UPDATES_PER_EPOCH` times an epoch, not
      after every batch (``batches_per_epoch``; a log keeps every redraw).
    """

    def __init__(self, batches_per_epoch: int = 1) -> None:
        isatty = getattr(sys.stdout, "isatty", lambda: False)()
        super().__init__(refresh_rate=1 if isatty else max(1, batches_per_epoch // LOG_UPDATES_PER_EPOCH), leave=True)

    def on_train_start(self, *_: Any) -> None:
        pass  # Lightning opens a bar here that the first epoch replaces (leave=True) and never closes

    @property
    def train_description(self) -> str:
        return f"Epoch {self.trainer.current_epoch + 1}/{self.trainer.max_epochs}"

    def on_train_epoch_start(self, trainer: L.Trainer, *_: Any) -> None:
        # Lightning's, without its 0-based description (which a log keeps as a redraw before this one)
        self.train_progress_bar = self.init_train_tqdm()  # described by train_description
        self.train_progress_bar.reset(total=convert_inf(self.total_train_batches))
        self.train_progress_bar.initial = 0

    def print(self, *args: Any, sep: str = " ", **kwargs: Any) -> None:
        """``tqdm.write`` of the bars' class: the line goes above any open bar (which is redrawn below it), or alone
        when none is open (Lightning's own ``print`` drops the line when every bar is closed, as after an epoch)."""
        Tqdm.write(sep.join(map(str, args)), file=sys.stdout, **kwargs)
