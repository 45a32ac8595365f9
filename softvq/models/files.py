"""Files that a kill at any moment leaves whole: the old content or the new one, never half of either.

Only the standard library, so that any process (a data loader worker, a test's child process) can use it cheaply.
"""

from __future__ import annotations

import os
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import IO, Any

TMP_PREFIX = ".softvq-tmp-"  # every temporary file written here; a kill can leave one behind, never a torn output


def write_atomic(path: str | os.PathLike, text: str | bytes | Callable[[IO[bytes]], Any]) -> None:
    """Write ``path`` through a temporary file in the same directory, ``fsync`` and a rename, so that no reader, and
    no kill at any moment, leaves half a file: ``path`` holds the old content or the new one.

    ``text`` is the content (``str`` or ``bytes``) or a function that writes it to the open binary file.
    """
    path = Path(path)
    fd, tmp = tempfile.mkstemp(prefix=f"{TMP_PREFIX}{path.name}.", dir=path.parent)
    try:
        os.chmod(tmp, 0o644)  # mkstemp creates the file private; these are ordinary outputs
        with os.fdopen(fd, "wb") as f:
            if callable(text):
                text(f)
            else:
                f.write(text.encode() if isinstance(text, str) else text)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    try:  # make the rename itself durable
        dir_fd = os.open(path.parent, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(dir_fd)
    except OSError:
        pass
    finally:
        os.close(dir_fd)


def remove_stale_temporaries(directory: str | os.PathLike) -> list[Path]:
    """Delete the temporary files a killed run left in ``directory`` (not below it); returns them."""
    directory = Path(directory)
    stale = sorted(directory.glob(f"{TMP_PREFIX}*")) if directory.is_dir() else []
    for path in stale:
        path.unlink(missing_ok=True)
    return stale


_HELD_LOCKS: set[int] = set()  # file descriptors of the RunLocks this process holds


def _drop_inherited_locks() -> None:
    """In a forked child (a DataLoader worker): close the inherited lock descriptors without unlocking them. A flock
    belongs to the open file, which the fork shares: a worker that outlived a SIGKILLed parent would otherwise keep
    the run locked until it noticed."""
    for fd in _HELD_LOCKS:
        try:
            os.close(fd)
        except OSError:
            pass
    _HELD_LOCKS.clear()


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_drop_inherited_locks)


class RunLockedError(FileExistsError):
    """Another live process holds the run directory's lock."""


class RunLock:
    """An exclusive lock on a run directory, held while the object is entered: a second process asking for it is
    refused at once (:class:`RunLockedError` naming the holder's pid) instead of writing into the same files.

    The lock is ``fcntl.flock`` on ``<directory>/.lock``, which also holds the holder's pid. The kernel drops a flock
    when its process dies, however it dies (SIGKILL included): the file a killed run leaves behind is stale, and the
    next run takes it over (:attr:`stale_pid` then names the dead holder). Forked children (DataLoader workers) close
    their copy of the descriptor, so they never hold the lock; exec'd ones do not inherit it. The directory is created
    if needed and, if the lock created it and it is still empty on release, removed again; the lock file is removed on
    release.
    """

    NAME = ".lock"

    def __init__(self, directory: str | os.PathLike) -> None:
        self.directory = Path(directory)
        self.path = self.directory / self.NAME
        self.stale_pid: int | None = None
        self._fd: int | None = None
        self._created: list[Path] = []

    def _holder(self) -> str:
        try:
            text = self.path.read_text().strip()
        except OSError:
            return "unknown"
        return text or "unknown"

    def acquire(self) -> RunLock:
        import fcntl

        missing = [p for p in (self.directory, *self.directory.parents) if not p.exists()]
        try:
            self.directory.mkdir(parents=True, exist_ok=True)
        except OSError as err:
            raise OSError(f"cannot write to the output directory {self.directory}: {err}") from err
        self._created = missing
        while True:
            try:
                fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
            except OSError as err:
                self._remove_created()
                raise OSError(f"cannot write to the output directory {self.directory}: {err}") from err
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                os.close(fd)
                raise RunLockedError(f"{self.directory} is in use by another run (pid {self._holder()}, which holds "
                                     f"{self.path}); wait for it to finish or choose another --out") from None
            # The holder may have released and removed the file between our open and flock: then this lock is on an
            # unlinked file that nobody else can see. Lock the file that is at the path now.
            try:
                same = os.stat(self.path).st_ino == os.fstat(fd).st_ino
            except FileNotFoundError:
                same = False
            if same:
                break
            os.close(fd)
        old = os.read(fd, 64).decode(errors="replace").strip()
        self.stale_pid = int(old) if old.isdigit() else None
        os.ftruncate(fd, 0)
        os.lseek(fd, 0, os.SEEK_SET)
        os.write(fd, f"{os.getpid()}\n".encode())
        os.fsync(fd)
        self._fd = fd
        _HELD_LOCKS.add(fd)
        return self

    def release(self) -> None:
        if self._fd is None:
            return
        if self._fd not in _HELD_LOCKS:  # a forked child's copy, already closed: the parent still holds the lock
            self._fd = None
            return
        self.path.unlink(missing_ok=True)  # before closing: whoever opens the path next makes a fresh file
        _HELD_LOCKS.discard(self._fd)
        os.close(self._fd)
        self._fd = None
        self._remove_created()

    def _remove_created(self) -> None:
        for directory in self._created:  # innermost first; only what the lock made and nobody filled
            try:
                directory.rmdir()
            except OSError:
                break
        self._created = []

    def __enter__(self) -> RunLock:
        return self.acquire()

    def __exit__(self, *exc: object) -> None:
        self.release()
