"""Where a report's numbers come from: the code commit a study ran at (a leaf module: git only, no torch)."""

from __future__ import annotations

import shlex
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def git(*args: str, cwd: Path = ROOT) -> str:
    """``git args`` in the repository; raises ``OSError`` / ``CalledProcessError`` outside a clone."""
    return subprocess.run(["git", *args], cwd=cwd, capture_output=True, text=True, check=True).stdout.strip()


def code_commit() -> str:
    """The repository's commit, ``+`` when ``softvq/`` or ``eval/`` differ from it; ``"unknown"`` outside a clone."""
    try:
        head = git("rev-parse", "--short", "HEAD")
        dirty = subprocess.run(["git", "diff", "--quiet", "HEAD", "--", "softvq", "eval"], cwd=ROOT).returncode != 0
    except (OSError, subprocess.CalledProcessError):
        return "unknown"
    return head + ("+" if dirty else "")


def study_command(module: str, argv: list[str] | None) -> str:
    """The command line that reruns ``python -m <module>`` with ``argv`` (this process's own when ``None``)."""
    return shlex.join(["python", "-m", module, *(sys.argv[1:] if argv is None else argv)])
