"""DDCL against its peers in the project's VQ-VAE: the same encoder, decoder, data, epochs and seeds, only the
bottleneck changes; ``reports/peers/`` with the test-split figures of the codes a VQ user keeps.

Usage (the full setting: 5 methods x 3 seeds x 5 epochs on 10,000 images; its run time is in the report):
    pip install -e ".[bench]"          # vector-quantize-pytorch, a benchmark-only extra
    python -m eval.peers --data-root ../shared/data/cifar10-jpeg.tar.gz
    python -m eval.peers --quick --data-root ../shared/data/cifar10-jpeg.tar.gz    # a minute, small model

Methods: :data:`eval.harness.LABELS` (each configured as its own documentation recommends, built by
:func:`eval.harness.build`); ``--methods`` picks some, by default ddcl, hard_ema, vqp_vq, vqp_fsq and vqp_simvq.

Every run trains in this process (one at a time: the cores are not shared between runs, so images/s compare) into
``--runs/<method>/seed<S>/`` (``history.jsonl`` and ``result.json``). A run whose ``result.json`` has the same settings
is read, not retrained. Codebooks are judged on the validation split per epoch and on the official test split at the
end: training-epoch utilization counts codes that a dead-code restart moved during the epoch, so restarts are
reported beside it.
"""

from __future__ import annotations

import argparse
import json
import logging
from pathlib import Path
from typing import Any

from eval._provenance import repo_relative
from eval.harness import LABELS, METHODS, add_vqvae_arguments, fit_run, fsq_levels, settings_of, study_run
from eval.peers.report import write_report
from softvq.cli.common import run_command
from softvq.models.files import write_atomic

log = logging.getLogger("eval.peers")

DEFAULT_METHODS = ("ddcl", "hard_ema", "vqp_vq", "vqp_fsq", "vqp_simvq")  # this study's five


def train_run(method: str, seed: int, args: argparse.Namespace, out: Path) -> dict[str, Any]:
    """Train one VQ-VAE with bottleneck ``method`` and score it on the test split (``args.split == "validation"``:
    on the validation split only, the test split unread); ``result.json`` in ``out``."""
    _, _, result = fit_run(method, seed, args, out, test=getattr(args, "split", "test") == "test")
    write_atomic(out / "result.json", json.dumps(result, indent=1))
    return result


def load_or_train(method: str, seed: int, args: argparse.Namespace) -> dict[str, Any] | None:
    """The stored run of ``method`` and ``seed`` with these settings, else a new one (``None`` under ``--no-train``
    when there is none: the report lists it as not run)."""
    out = args.runs / method / f"seed{seed}"
    path = out / "result.json"
    if path.is_file():
        try:
            stored = json.loads(path.read_text())
        except json.JSONDecodeError:
            stored = {}
        if stored.get("settings") == settings_of(args):
            log.info("%s seed %d: read %s", method, seed, path)
            return stored
        if args.no_train:
            raise ValueError(f"{path} was made with other settings; rerun without --no-train to retrain it")
    elif args.no_train:
        return None  # reported as not run
    print(f"[peers] training {method} seed {seed} -> {out}", flush=True)
    return train_run(method, seed, args, out)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m eval.peers", description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--data-root", type=Path, default=Path("data"), help="CIFAR-10 directory or .tar.gz archive")
    p.add_argument("--methods", nargs="+", choices=METHODS, default=list(DEFAULT_METHODS),
                   help="bottlenecks to compare")
    p.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2], help="seeds of every method")
    p.add_argument("--num-codes", type=int, default=512)
    add_vqvae_arguments(p)
    p.add_argument("--runs", type=Path, default=Path("runs/peers"), help="where the runs are kept")
    p.add_argument("--out", type=Path, default=Path("reports/peers"), help="report directory")
    p.add_argument("--no-train", action="store_true",
                   help="only read finished runs (the report lists the ones that are missing)")
    p.add_argument("--no-progress-bar", action="store_true")
    p.add_argument("--quick", action="store_true",
                   help="a small setting for a smoke test: 1 epoch on 512 images, K=64, D=16, width 32, 2 seeds")
    args = p.parse_args(argv)
    if args.quick:
        args.epochs, args.train_subset, args.val_size, args.num_codes, args.code_dim = 1, 512, 256, 64, 16
        args.width, args.res_blocks, args.res_hidden, args.test_limit = 32, 1, 8, 512
        args.seeds = args.seeds[:2]
    for name in ("epochs", "train_subset", "batch_size", "num_codes", "code_dim", "width"):
        if getattr(args, name) < 1:
            p.error(f"--{name.replace('_', '-')} must be positive, got {getattr(args, name)}")
    if len(set(args.seeds)) != len(args.seeds):
        p.error(f"--seeds repeats a seed: {args.seeds}")
    if "vqp_fsq" in args.methods:
        try:
            fsq_levels(args.num_codes)
        except ValueError as err:
            p.error(str(err))
    args.command = "python -m eval.peers " + " ".join(argv if argv is not None else __import__("sys").argv[1:])
    return args


def main(argv: list[str] | None = None) -> dict[str, Any]:
    args = parse_args(argv)
    runs, missing = [], []
    with study_run(args.threads):
        for seed in args.seeds:  # seed-major: an interrupted comparison has every method at the first seeds
            for method in args.methods:
                run = load_or_train(method, seed, args)
                (runs.append(run) if run is not None else missing.append(f"{method} seed {seed}"))
    if not runs:
        raise FileNotFoundError(f"no finished run in {args.runs} for these settings, and --no-train forbids training")
    settings = {**settings_of(args), "seeds": args.seeds, "command": args.command, "missing": missing,
                "runs": repo_relative(args.runs)}
    return write_report(runs, settings, args.out, LABELS)


def cli(argv: list[str] | None = None) -> int:
    return run_command(main, argv)
