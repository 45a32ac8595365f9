"""A training run's directory, as ``softvq-train`` keeps it: refusing to start over an old run, config.json and
invocations.jsonl, what --resume continues from (the checkpoint and the settings it may change), the run locks, and
what is kept when a run fails. The names are also importable from :mod:`softvq.cli.train`.
"""

from __future__ import annotations

import contextlib
import datetime
import json
import logging
import os
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from jsonargparse import Namespace
from lightning.pytorch.utilities import rank_zero_only

from softvq._compat import upgrade_settings
from softvq.cli import config
from softvq.cli.common import claim_run_directory, remove_entries
from softvq.models.checkpoint_io import load_torch_file
from softvq.models.files import RunLock, remove_stale_temporaries, write_atomic

log = logging.getLogger("softvq")

INVOCATIONS = "invocations.jsonl"  # one line per start or resume of a run: when, which pid, the argv, what changed
# What --overwrite removes of an old run, so that its artefacts do not mix with the new run's.
STALE = ("history.jsonl", INVOCATIONS, "config.json", "checkpoints", "tb", "recon_epoch*.png", "comparison.png")



def check_checkpoint(path: Path, model: dict[str, Any], ignore: set[str] = frozenset()) -> dict[str, Any]:
    """A readable Lightning checkpoint (loaded with ``weights_only=True``: nothing in it runs) whose model
    hyperparameters match ``model`` (the VQVAE's constructor arguments; ``ignore``: keys that do not count,
    none by default); returns it, else a clear error with the per-key differences."""
    if not path.is_file():
        raise FileNotFoundError(f"checkpoint to resume from not found: {path}")
    ckpt = load_torch_file(path, "checkpoint")  # UnsafeCheckpointError / ValueError naming the file
    if not isinstance(ckpt, dict) or "state_dict" not in ckpt:
        raise ValueError(f"{path} is not a Lightning checkpoint of this trainer (no state_dict)")
    saved, now = upgrade_settings(config.flat(ckpt.get("hyper_parameters") or {})), config.flat(model)
    diff = [f"{k}: checkpoint {saved[k]!r} vs now {now[k]!r}" for k in now
            if k in saved and saved[k] != now[k] and k not in ignore]
    if diff:
        raise ValueError(f"checkpoint {path} was trained with another model configuration; pass the same "
                         f"settings to resume it:\n  " + "\n  ".join(diff))
    return ckpt


def resume_changes(run: dict[str, Any], out: Path, ignore: set[str] = frozenset()) -> dict[str, list[Any]]:
    """The settings that differ from the run's config.json, ``{dotted key: [recorded, now]}``; only
    :data:`~softvq.cli.config.RESUME_SAFE` ones may. A run without config.json (resumed from a checkpoint file into a
    new --out) has none to compare. Not counted: the keys in ``ignore`` and
    options newer than the run's config.json left at their defaults.

    Raises:
        ValueError: a setting outside ``RESUME_SAFE`` differs (listing every difference), or config.json is unreadable.
    """
    path = out / "config.json"
    if not path.is_file():
        return {}
    try:
        recorded = json.loads(path.read_text())
    except (OSError, ValueError) as err:
        raise ValueError(f"{path} is unreadable ({err}); the run's settings cannot be checked") from err
    changed = config.config_changes(recorded, run, ignore, config.default_values())
    refused = {k: v for k, v in changed.items() if k not in config.RESUME_SAFE}
    if refused:
        lines = [f"--{k}: run {old!r} vs now {new!r}" for k, (old, new) in refused.items()]
        safe = ", ".join(f"--{k}" for k in config.RESUME_SAFE if k != "out")
        raise ValueError(f"--resume would change settings of the run in {out} (its config.json), so it would no "
                         f"longer describe the epochs already trained; nothing was written. Resume with the run's "
                         f"settings (only {safe} may change) or start a new run in another --out:\n  "
                         + "\n  ".join(lines))
    return changed


def prepare_out(cfg: Namespace, run: dict[str, Any], out: Path, changed: dict[str, list[Any]] | None = None,
                argv: Sequence[str] | None = None) -> None:
    """Refuse to start afresh over an old run (unless --overwrite, which clears it); write config.json for a new run
    (a resumed one keeps its own) and append this invocation to invocations.jsonl. Call with the run's lock held."""
    claim_run_directory(out, cfg.resume, cfg.overwrite, STALE)
    for directory in (out, out / "checkpoints"):  # a killed run's half-written temporaries, never its outputs
        remove_stale_temporaries(directory)
    record = {"time": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
              "pid": os.getpid(), "argv": list(sys.argv[1:] if argv is None else argv),
              "resume": cfg.resume, "changed": changed or {}}
    try:
        out.mkdir(parents=True, exist_ok=True)
        if cfg.resume is None or not (out / "config.json").exists():
            write_atomic(out / "config.json", json.dumps(run, indent=2) + "\n")
        log_path = out / INVOCATIONS
        previous = log_path.read_bytes() if log_path.exists() else b""
        write_atomic(log_path, previous + (json.dumps(record) + "\n").encode())
    except OSError as err:
        raise OSError(f"cannot write to the output directory {out}: {err}") from err


def resume_point(cfg: Namespace, out: Path, model: dict[str, Any],
                 ignore: set[str] = frozenset()) -> tuple[Path | None, dict[str, Any] | None]:
    """The checkpoint this run continues from and its contents, or ``(None, None)`` for a fresh start."""
    if cfg.resume is None:
        return None, None
    path = out / "checkpoints" / "last.ckpt" if cfg.resume == "last" else Path(cfg.resume)
    if cfg.resume == "last" and not path.exists() and not (out / "history.jsonl").exists():
        # Stopped before its first checkpoint, or (several quantizers) never started: nothing to resume.
        log.warning("%s holds no checkpoint to resume: this run starts from the beginning", out)
        return None, None
    return path, check_checkpoint(path, model, ignore)


def discard_unstarted(out: Path) -> None:
    """Remove what a new run wrote into ``out`` when it failed before its first checkpoint: a directory that holds only
    a config.json would look like a run and make the next attempt need --overwrite. A run with a checkpoint is kept."""
    if not (out / "checkpoints" / "last.ckpt").exists():
        remove_entries(out, STALE)


def last_good_checkpoint(out: Path, advice: str = "fix the cause and continue with --resume") -> str:
    """Where a failed run can continue from: its ``last.ckpt`` (untouched by the failure), or that there is none."""
    last = out / "checkpoints" / "last.ckpt"
    if not last.is_file():
        return f"Training stopped before its first checkpoint; nothing was saved in {out / 'checkpoints'}."
    try:
        epoch = int(load_torch_file(last, "checkpoint")["epoch"]) + 1
    except Exception as err:  # noqa: BLE001 - a message, not a check
        return f"Training stopped; the last checkpoint is {last}, but it cannot be read: {err}"
    return f"Training stopped; the last good checkpoint, {last} (end of epoch {epoch}), is kept: {advice}."


def run_locks(cfg: Namespace) -> contextlib.ExitStack:
    """The exclusive :class:`~softvq.models.files.RunLock` of every run directory (and of --out itself with several
    quantizers, for comparison.md), taken at once, before anything is read or written; none under DDP's other
    processes, whose rank 0 holds them."""
    stack = contextlib.ExitStack()
    if rank_zero_only.rank != 0:
        return stack
    out, several = Path(cfg.out), len(cfg.quantizer) > 1
    directories = ([out] if several else []) + [out / q if several else out for q in cfg.quantizer]
    with stack:
        for directory in directories:
            lock = stack.enter_context(RunLock(directory))
            if lock.stale_pid is not None:
                log.warning("%s: recovered the lock of run pid %d, which ended without releasing it", directory,
                            lock.stale_pid)
        return stack.pop_all()
