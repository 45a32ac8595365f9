"""Where a report's numbers come from: the code commit a study ran at (a leaf module: git only, no torch)."""

from __future__ import annotations

import os
import platform
import re
import shlex
import subprocess
import sys
from pathlib import Path
from typing import Any

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


_LOADED: list[str] = []


def loaded_code() -> str:
    """:func:`code_commit` as it was when this process first asked: the code a long-lived process runs is what it
    imported at its start, whatever the tree holds by the time one of its runs ends (a study's modules ask at their
    import, so its records name the code it loaded)."""
    if not _LOADED:
        _LOADED.append(code_commit())
    return _LOADED[0]


def cpu_model() -> str:
    """The CPU's model name (``/proc/cpuinfo``; else what :mod:`platform` says): which machine a timing ran on."""
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def study_command(module: str, argv: list[str] | None) -> str:
    """The command line that reruns ``python -m <module>`` with ``argv`` (this process's own when ``None``)."""
    return shlex.join(["python", "-m", module, *(sys.argv[1:] if argv is None else argv)])


def repo_relative(path: str | os.PathLike) -> str:
    """``path`` relative to the repository root (``../`` for one beside it): no record holds an absolute path, which
    would name the machine it ran on."""
    return Path(os.path.relpath(os.path.abspath(path), ROOT)).as_posix()


# An absolute path inside a text: after its start, a space or "=" (``--out=/x``), at least two parts, up to a space
# or a quote.
_ABSOLUTE_WORD = re.compile(r"(?:(?<=^)|(?<=[\s=]))(/[^\s'\"/]+/[^\s'\"]*)")


def portable(value: Any) -> Any:
    """A JSON-able record with every absolute path made :func:`repo_relative`: string values that are absolute paths,
    and absolute paths inside texts (a command line's ``--data-root /x/y`` or ``--out=/x/y``, a note quoting one);
    anything else unchanged."""
    if isinstance(value, dict):
        return {k: portable(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [portable(v) for v in value]
    if isinstance(value, os.PathLike):
        value = os.fspath(value)
    if not isinstance(value, str):
        return value
    return _ABSOLUTE_WORD.sub(lambda m: repo_relative(m.group(1)), value)
