"""How every script of this project ends: expected failures become one ``error:`` line and exit status 2; SIGTERM and
SIGINT stop it gracefully with status 143 and 130, as a shell reports a process those signals killed."""

from __future__ import annotations

import contextlib
import logging
import os
import shutil
import signal
import sys
import threading
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from types import FrameType
from typing import Any

from softvq._checks import check_choice, check_float, check_positive_int
from softvq.data.cifar10 import CorruptArchiveError
from softvq.models.callbacks import AtomicCheckpointIO

# Missing or bad data, checkpoints and output directories, invalid settings, NaN/Inf in training. Each message names
# what is wrong, so a traceback would add nothing. (FileExistsError and FileNotFoundError are OSErrors.)
EXPECTED_ERRORS: tuple[type[BaseException], ...] = (OSError, ValueError, FloatingPointError, CorruptArchiveError)
STOP_SIGNALS = (signal.SIGTERM, signal.SIGINT)


class Interrupted(BaseException):
    """SIGTERM or SIGINT stopped the command. A BaseException, like KeyboardInterrupt, so that no ``except Exception``
    on the way swallows it; :func:`run_command` prints its message and returns :attr:`exit_code` (128 + signal)."""

    def __init__(self, signum: int, message: str = "") -> None:
        self.signum = signum
        self.exit_code = 128 + signum
        name = signal.Signals(signum).name
        super().__init__(message or f"stopped by {name}")


class GracefulStop:
    """While entered in the main thread, SIGTERM and SIGINT ask the Lightning trainer in :attr:`trainer` to stop
    after its current batch, Lightning's own SIGTERM path: nothing is half-written and the last checkpoint is kept.
    With no trainer running, or at a second signal, :class:`Interrupted` is raised at once. :attr:`signum` records the
    first signal, so the caller can tell a stop from a normal end of ``trainer.fit``. Entered in another thread
    (a caller's worker threads) it does nothing: only the main thread receives signals and may set handlers.
    """

    def __init__(self) -> None:
        self.signum: int | None = None
        self.trainer: Any = None
        self._previous: dict[int, Any] = {}
        self._owner = os.getpid()

    def _handle(self, signum: int, frame: FrameType | None) -> None:
        if os.getpid() != self._owner:  # a forked DataLoader worker: the main process stops it
            return
        first = self.signum is None
        if first:
            self.signum = signum
        connector = getattr(self.trainer, "_signal_connector", None)
        if first and connector is not None:
            # Lightning notices SIGTERM itself (its handler runs before this one during fit); SIGINT is told the same
            # way, so both stop at the next batch boundary.
            connector.received_sigterm = True
            return
        raise Interrupted(signum)

    def __enter__(self) -> GracefulStop:
        if threading.current_thread() is not threading.main_thread():
            return self  # only the main thread may set handlers (and receives signals): a no-op in worker threads
        for sig in STOP_SIGNALS:
            self._previous[sig] = signal.signal(sig, self._handle)
        return self

    def __exit__(self, *exc: object) -> None:
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)
        self._previous = {}


@contextlib.contextmanager
def quiet_lightning() -> Iterator[None]:
    """Lightning logs which accelerators exist and advertises its cloud products at INFO on every ``Trainer``; the
    commands print their own summary, so for the duration only Lightning's warnings and errors are kept."""
    loggers = [logging.getLogger(name) for name in ("lightning.pytorch", "lightning.fabric")]
    levels = [logger.level for logger in loggers]
    for logger in loggers:
        logger.setLevel(logging.WARNING)
    try:
        yield
    finally:
        for logger, level in zip(loggers, levels, strict=True):
            logger.setLevel(level)


@contextlib.contextmanager
def data_messages() -> Iterator[None]:
    """The data's INFO messages (logger ``softvq.data``: where an archive was unpacked) shown for the duration: on
    stdout, or through the root logger's handlers where the caller configured logging."""
    logger = logging.getLogger("softvq.data")
    level = logger.level
    handler = None if logging.getLogger().handlers else logging.StreamHandler(sys.stdout)
    logger.setLevel(logging.INFO)
    if handler is not None:
        handler.setFormatter(logging.Formatter("%(message)s"))
        logger.addHandler(handler)
    try:
        yield
    finally:
        logger.setLevel(level)
        if handler is not None:
            logger.removeHandler(handler)


def run_command(main: Callable[..., Any], argv: Sequence[str] | None = None,
                errors: tuple[type[BaseException], ...] = EXPECTED_ERRORS) -> int:
    """``main(argv)`` as a command: 0 when it returns; on one of ``errors`` print ``error: <message>`` to stderr and
    return 2 (a bad flag exits 2 itself, :func:`softvq.cli.parsing.refuse`); on :class:`Interrupted` print its
    message and return 143 (SIGTERM) or 130 (SIGINT). Lightning's start-up lines (available accelerators, adverts)
    are silenced; its warnings still show."""
    try:
        with quiet_lightning():
            main(argv)
    except Interrupted as err:
        print(f"error: {err}", file=sys.stderr)
        return err.exit_code
    except errors as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    return 0


@dataclass
class Hardware:
    """How Lightning runs a command (docs/scaling.md, "Scaling out"); ``--trainer.*`` on every training command.

    Args:
        accelerator: Lightning accelerator: ``auto``, ``cpu``, ``gpu``, ...
        devices: devices per node: a count, a list of indices, or ``auto``; more than one trains data-parallel (DDP),
            the batch size per device.
        num_nodes: machines.
        strategy: Lightning strategy: ``auto`` (DDP for several devices), ``ddp``, ``ddp_spawn``, ...
        precision: ``32-true``, ``bf16-mixed`` (autocast; the codebook computes in float32), ``16-mixed``, ``64-true``.
        progress_bar: show Lightning's progress bar (off in CI logs).
        compile: ``torch.compile`` the model's encoder, decoder and codebook (the codebook with ``fullgraph=True``:
            it has no graph break and no host-device synchronisation per step); the first steps then compile (about
            a minute on a CPU). Measured by ``eval/bench_train.py --compile``.
        accumulate_grad_batches: optimizer steps every this many batches, their gradients summed (Lightning's
            gradient accumulation). The codebook's own state moves per batch (micro-batch), not per optimizer step:
            each batch is standardised with its own moments, moves the EMA prototypes, may restart codes and steps the
            temperature control, as the same batches would without accumulation.
        gradient_clip_val: clip the gradients before every optimizer step to this norm (``gradient_clip_algorithm``
            ``"norm"``) or value (``"value"``); ``None``: no clipping. The layer's EMA prototypes have no gradient
            and are not clipped.
        gradient_clip_algorithm: ``"norm"`` (the global 2-norm of all gradients) or ``"value"`` (each element).
    """

    accelerator: str = "auto"
    devices: int | list[int] | str = 1
    num_nodes: int = 1
    strategy: str = "auto"
    precision: str = "32-true"
    progress_bar: bool = True
    compile: bool = False
    accumulate_grad_batches: int = 1
    gradient_clip_val: float | None = None
    gradient_clip_algorithm: str = "norm"

    def __post_init__(self) -> None:
        self.num_nodes = check_positive_int("trainer.num_nodes", self.num_nodes)
        self.accumulate_grad_batches = check_positive_int("trainer.accumulate_grad_batches",
                                                          self.accumulate_grad_batches)
        if self.gradient_clip_val is not None:
            self.gradient_clip_val = check_float("trainer.gradient_clip_val", self.gradient_clip_val)
        self.gradient_clip_algorithm = check_choice("trainer.gradient_clip_algorithm", self.gradient_clip_algorithm,
                                                    ("norm", "value"))
        if isinstance(self.devices, str) and self.devices != "auto":
            try:  # "2" or "0,1" from an older spelling or a shell variable
                self.devices = [int(t) for t in self.devices.split(",") if t] if "," in self.devices \
                    else int(self.devices)
            except ValueError:
                raise ValueError(f"trainer.devices: expected a count, a list of indices or 'auto', got "
                                 f"{self.devices!r}") from None
        if isinstance(self.devices, int) and not isinstance(self.devices, bool) and self.devices < 1:
            raise ValueError(f"trainer.devices: expected a positive count, got {self.devices}")

    @property
    def devices_per_node(self) -> int:
        """Processes per node (1 for ``auto``, which picks one device on a CPU machine)."""
        return self.devices if isinstance(self.devices, int) else len(self.devices) if isinstance(self.devices, list) \
            else 1

    def trainer_kwargs(self) -> dict[str, Any]:
        """``L.Trainer`` arguments, with checkpoints written atomically (:class:`AtomicCheckpointIO`)."""
        return {"accelerator": self.accelerator, "devices": self.devices, "num_nodes": self.num_nodes,
                "strategy": self.strategy, "precision": self.precision, "enable_progress_bar": self.progress_bar,
                "accumulate_grad_batches": self.accumulate_grad_batches, "gradient_clip_val": self.gradient_clip_val,
                "gradient_clip_algorithm": self.gradient_clip_algorithm, "plugins": [AtomicCheckpointIO()]}


def claim_run_directory(out: Path, resume: str | None, overwrite: bool, stale: Sequence[str]) -> None:
    """The output-directory rule of every training command: refuse to start afresh over an old run (one with a
    ``history.jsonl`` or ``checkpoints/``) unless ``resume`` or ``overwrite``; with ``overwrite`` (and no ``resume``)
    remove the old run's ``stale`` entries (names or glob patterns below ``out``, files or directories), so that its
    artefacts do not mix with the new run's. Call with the run's lock held."""
    if resume is None and not overwrite and ((out / "history.jsonl").exists() or (out / "checkpoints").exists()):
        raise FileExistsError(f"{out} already holds a run; pass --resume to continue it or --overwrite to "
                              f"start afresh (or choose another --out)")
    if overwrite and resume is None:
        remove_entries(out, stale)


def remove_entries(out: Path, patterns: Sequence[str]) -> None:
    """Remove the files and directories below ``out`` that match ``patterns`` (names or glob patterns)."""
    for pattern in patterns:
        for path in out.glob(pattern):
            if path.is_dir() and not path.is_symlink():
                shutil.rmtree(path, ignore_errors=True)
            else:
                path.unlink(missing_ok=True)
