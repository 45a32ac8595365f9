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
