"""How every script of this project ends: expected failures become one ``error:`` line and exit status 2; SIGTERM and
SIGINT stop it gracefully with status 143 and 130, as a shell reports a process those signals killed."""

from __future__ import annotations

import os
import signal
import sys
import threading
from collections.abc import Callable, Sequence
from types import FrameType
from typing import Any

from softvq.datasets.cifar10 import CorruptArchiveError

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
    (``eval.compare``'s job threads) it does nothing: only the main thread receives signals and may set handlers.
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


def run_command(main: Callable[..., Any], argv: Sequence[str] | None = None,
                errors: tuple[type[BaseException], ...] = EXPECTED_ERRORS) -> int:
    """``main(argv)`` as a command: 0 when it returns; on one of ``errors`` print ``error: <message>`` to stderr and
    return 2 (argparse exits 2 on bad flags itself); on :class:`Interrupted` print its message and return 143
    (SIGTERM) or 130 (SIGINT)."""
    try:
        main(argv)
    except Interrupted as err:
        print(f"error: {err}", file=sys.stderr)
        return err.exit_code
    except errors as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    return 0
