"""``--out/step_times.json``: the training step of every method of the long run at every K, timed side by side, for the
report's equal-compute view (:func:`eval.long_run.equal_compute.equal_compute`).

Usage:
    python -m eval.long_run.step_times --out reports/long_run                  # every K and method of the records
    python -m eval.long_run.step_times --out reports/long_run --num-codes 512 --steps 3 --rounds 1   # a quick look

Which models: one per K and method of the finished records in ``--out/runs/`` (``--num-codes`` and ``--methods``
keep some), each built as :func:`eval.long_run.train_run` builds it from the settings its records hold (the bottleneck
:func:`eval.harness.build` gives today, the VQ-VAE's width, residual blocks, D, learning rate and batch size). A method
whose layer cannot be built here (the ``vqp_*`` peers without vector-quantize-pytorch) is listed as not timed, with
why.

Timing: :func:`eval.bench_train.time_steps`, the training benchmark's own harness, on all the models in one process:
Lightning fits every model for ``--warmup`` + ``--steps`` steps on the same in-memory random batches, one model after
the other, ``--rounds`` interleaved rounds; a callback times each step from its batch-start hook to its batch-end hook
(forward, backward, the optimizer step and the metric updates), the warm-up steps of every fit dropped (DDCL's
temperature calibration on its first batch among them). No data loading, no validation pass. ``--threads`` torch
threads, 1 by default: the records were trained with ``--threads 1``.

Time on quiet cores: another process on the same cores slows every method alike only roughly (caches, memory
bandwidth), and its load changes during the timing. The file records the commit (``+``: ``softvq/`` or ``eval/``
differ from it, the files named), torch, the CPU, the threads, the date and the load average before the timing.
"""

from __future__ import annotations

import argparse
import datetime
import importlib.util
import json
import os
import platform
import statistics
import subprocess
import sys
import warnings
from pathlib import Path
from typing import Any

import torch

from eval import bench_train, harness
from eval._provenance import ROOT, code_commit, cpu_model, git, study_command
from eval.long_run.equal_compute import STEP_TIMES
from eval.long_run.report import load_records
from softvq.cli.common import quiet_lightning, run_command
from softvq.models import VQVAE
from softvq.models.files import write_atomic


def dirty_files() -> list[str]:
    """The files under ``softvq/`` and ``eval/`` that differ from the commit (what a ``+`` on it stands for)."""
    try:
        return git("diff", "--name-only", "HEAD", "--", "softvq", "eval").splitlines()
    except (OSError, subprocess.CalledProcessError):
        return []


def selection(records: list[dict[str, Any]], num_codes: list[int] | None = None,
              methods: list[str] | None = None) -> dict[int, dict[str, dict[str, Any]]]:
    """``{K: {method: settings}}`` of the finished records (the first seed's settings per K and method), kept to the
    ``num_codes`` and ``methods`` given (``None``: all)."""
    out: dict[int, dict[str, dict[str, Any]]] = {}
    for rec in records:
        k, method = rec["num_codes"], rec["method"]
        if (num_codes is None or k in num_codes) and (methods is None or method in methods):
            out.setdefault(k, {}).setdefault(method, rec["settings"])
    return dict(sorted(out.items()))


def build_model(method: str, num_codes: int, settings: dict[str, Any], seed: int = 0) -> VQVAE:
    """The VQ-VAE of ``method`` at ``num_codes`` as :func:`eval.long_run.train_run` builds it from ``settings``."""
    return harness.vqvae_of(method, {**settings, "num_codes": num_codes}, seed)


def model_key(num_codes: int, method: str) -> str:
    return f"K{num_codes} {method}"


def measure(args: argparse.Namespace) -> dict[str, Any]:
    """Build the selected models, time them (:func:`eval.bench_train.time_steps`) and return the results file's
    content."""
    chosen = selection(load_records(args.out), args.num_codes, args.methods)
    if not chosen:
        raise FileNotFoundError(f"no finished record in {args.out / 'runs'} with K in {args.num_codes} and methods "
                                f"{args.methods}")
    batch_sizes = {s["batch_size"] for per_k in chosen.values() for s in per_k.values()}
    if len(batch_sizes) != 1:
        raise ValueError(f"the records differ in batch size ({sorted(batch_sizes)}); time them in separate runs")
    batch_size = batch_sizes.pop()
    models: dict[str, VQVAE] = {}
    not_timed: dict[str, dict[str, str]] = {}
    for k, per_k in chosen.items():
        for method, settings in per_k.items():
            if method.startswith("vqp_") and importlib.util.find_spec("vector_quantize_pytorch") is None:
                not_timed.setdefault(str(k), {})[method] = "vector-quantize-pytorch is not installed here"
                continue
            models[model_key(k, method)] = build_model(method, k, settings, args.seed)
    if not models:
        raise ValueError(f"no selected method builds here: {not_timed}")
    timing = argparse.Namespace(seed=args.seed, steps=args.steps, warmup=args.warmup, rounds=args.rounds,
                               accelerator="cpu")
    load_before = os.getloadavg()
    with harness.study_run(args.threads), quiet_lightning(), warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*does not have many workers.*")
        start = datetime.datetime.now(datetime.timezone.utc)
        seconds = bench_train.time_steps(timing, models, batch_size)
        threads = torch.get_num_threads()
    times: dict[str, dict[str, Any]] = {}
    for k, per_k in chosen.items():
        for method in per_k:
            key = model_key(k, method)
            if key not in seconds:
                continue
            median = statistics.median(seconds[key])
            times.setdefault(str(k), {})[method] = {
                "median_ms": round(median * 1e3, 2), "images_per_s": round(batch_size / median, 1),
                "steps_ms": [round(s * 1e3, 2) for s in seconds[key]]}
    return {
        "what": "median training step (forward, backward, optimizer, metric updates) per K and method, timed side by "
                "side by eval.bench_train.time_steps in one process",
        "command": args.command, "code": code_commit(), "dirty": dirty_files(), "torch": torch.__version__,
        "python": platform.python_version(), "cpu": cpu_model(), "cores": os.cpu_count(), "threads": threads,
        "date": start.isoformat(timespec="seconds"), "load_before": [round(x, 2) for x in load_before],
        "batch_size": batch_size, "steps": args.steps, "warmup": args.warmup, "rounds": args.rounds,
        "seed": args.seed, "note": args.note, "times": times, "not_timed": not_timed,
    }


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    paragraphs = __doc__.split("\n\n")
    p = argparse.ArgumentParser(prog="python -m eval.long_run.step_times", description=paragraphs[0],
                                epilog="\n\n".join(paragraphs[1:]),
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", type=Path, default=Path("reports/long_run"),
                   help="the study's records (--out/runs/) and where step_times.json goes (default: reports/long_run)")
    p.add_argument("--num-codes", type=int, nargs="+", default=None, help="time only these K")
    p.add_argument("--methods", nargs="+", choices=harness.METHODS, default=None, help="time only these methods")
    p.add_argument("--steps", type=int, default=6, help="timed steps per fit (default 6)")
    p.add_argument("--warmup", type=int, default=2, help="untimed steps at the start of every fit (default 2)")
    p.add_argument("--rounds", type=int, default=3, help="interleaved rounds (default 3)")
    p.add_argument("--threads", type=int, default=1, help="torch threads (default 1, as the runs trained)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--note", default=None, help="a remark the report prints beside the machine (how it was kept quiet)")
    p.add_argument("--json", type=Path, default=None, help=f"the results file (default: --out/{STEP_TIMES})")
    args = p.parse_args(argv)
    for name in ("steps", "rounds", "threads"):
        if getattr(args, name) < 1:
            p.error(f"--{name} must be positive, got {getattr(args, name)}")
    if args.warmup < 0:
        p.error(f"--warmup must be non-negative, got {args.warmup}")
    args.json = args.json or args.out / STEP_TIMES
    raw = list(argv) if argv is not None else sys.argv[1:]
    args.command = study_command("eval.long_run.step_times", raw)
    return args


def main(argv: list[str] | None = None) -> dict[str, Any]:
    args = parse_args(argv)
    result = measure(args)
    write_atomic(args.json, json.dumps(result, indent=1) + "\n")
    print(f"{result['code']}, torch {result['torch']}, {result['cpu']}, {result['threads']} thread(s), batch "
          f"{result['batch_size']}: median ms per step (images/s)")
    for k, per_k in result["times"].items():
        print(f"  K = {k}: " + ", ".join(f"{m} {t['median_ms']:.1f} ({t['images_per_s']:.0f})"
                                         for m, t in per_k.items()))
    print(f"wrote {Path(os.path.relpath(os.path.abspath(args.json), ROOT)).as_posix()}")
    return result


def cli(argv: list[str] | None = None) -> int:
    return run_command(main, argv)


if __name__ == "__main__":
    raise SystemExit(cli())
