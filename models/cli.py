"""How every script of this project ends: expected failures become one ``error:`` line and exit status 2."""

from __future__ import annotations

import sys
from collections.abc import Callable, Sequence
from typing import Any

from softvq.datasets.cifar10 import CorruptArchiveError

# Missing or bad data, checkpoints and output directories, invalid settings, NaN/Inf in training. Each message names
# what is wrong, so a traceback would add nothing. (FileExistsError and FileNotFoundError are OSErrors.)
EXPECTED_ERRORS: tuple[type[BaseException], ...] = (OSError, ValueError, FloatingPointError, CorruptArchiveError)


def run_command(main: Callable[..., Any], argv: Sequence[str] | None = None,
                errors: tuple[type[BaseException], ...] = EXPECTED_ERRORS) -> int:
    """``main(argv)`` as a command: 0 when it returns; on one of ``errors`` print ``error: <message>`` to stderr and
    return 2 (argparse exits 2 on bad flags itself)."""
    try:
        main(argv)
    except errors as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    return 0
