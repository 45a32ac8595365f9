"""Head-to-head on CIFAR-10: DDCL vs hard VQ-VAE (plain and EMA + dead-code restart), an eps ablation and a
temperature study, over several seeds at equal epochs, written up as ``report.md`` with plots.

Usage (the full setting: 14 runs of 5 epochs; its run time is in docs/studies.md, "Head-to-head report"):
    python -m eval.compare --data-root ../shared/data/cifar10-jpeg.tar.gz
    python -m eval.compare --quick --data-root ../shared/data/cifar10-jpeg.tar.gz    # a few minutes

Every training run is ``train_vqvae.py`` in its own process (``--jobs`` at a time, the cores split between them),
into ``--runs/<run>/seed<S>``. A run that already has every epoch is read, not retrained; an unfinished one is
resumed from its ``last.ckpt``, so an interrupted comparison continues where it stopped. Each method run's final
checkpoint is then evaluated on the test split (:mod:`eval.evaluate`, cached in the run's ``test_metrics.json``); the
ablations (eps, temperature) are read on the validation split only, from their last epoch. ``--out`` receives
``report.md``, ``results.json`` and the PNG plots.

Runs:
    methods      ``ddcl`` (the collapse-free defaults), ``hard`` (straight-through, commitment weight 0.25) and
                 ``hard_ema`` (EMA codebook, decay 0.99, and dead-code restart below 1 token per batch: the recipe
                 vector-quantize-pytorch recommends against collapse), every seed
    eps          the plain layer (``--ddcl.recipe plain``) with eps = 0.1 and 1.0 beside its 0.01
                 (``--ablation-seeds``)
    temperature  the plain layer with T fixed at 4 and annealed exponentially 4 -> 0.5, beside its
                 entropy-controlled T (``--ablation-seeds``)
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import shlex
import subprocess
import sys
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor, as_completed
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from eval._hard import HARD_RESTART_FLAGS
from eval._provenance import ROOT
from eval.compare.report import write_report
from softvq.cli import config as train_config
from softvq.cli import evaluate
from softvq.data.cifar10 import sha256_file
from softvq.models import QUANTIZERS
from softvq.models.callbacks import read_history
from softvq.models.files import write_atomic

log = logging.getLogger("eval.compare")
TRAIN_SCRIPT = ROOT / "train_vqvae.py"


@dataclass(frozen=True)
class RunSpec:
    """One training run of the comparison."""

    group: str  # "methods", "eps" or "temperature": the section of the report it belongs to
    key: str  # directory name under --runs, e.g. "ddcl" or "ddcl_eps1.0"
    label: str  # legend text
    seed: int
    flags: tuple[str, ...]  # train_vqvae.py flags beyond the shared ones

    def directory(self, runs: Path) -> Path:
        return runs / self.key / f"seed{self.seed}"


METHODS = (("ddcl", "DDCL", ("--quantizer", "ddcl")),
           ("hard", "hard VQ", ("--quantizer", "hard")),
           ("hard_ema", "hard VQ, EMA + restart", ("--quantizer", "hard", "--hard.ema_decay", "0.99",
                                                  *HARD_RESTART_FLAGS)))
# The eps and temperature studies are about the paper's layer, whose prototypes the optimizer trains: they run on the
# plain-layer recipe (LatentNorm, T from 4 held at H(Q) = 2.5 by the model, restarts below 1), whose default
# eps (0.01) and entropy-controlled T are the "ddcl_plain" runs.
PLAIN = ("--quantizer", "ddcl", "--ddcl.recipe", "plain", "--model.latent_norm", "batch", "--ddcl.temperature", "4",
         "--ddcl.restart.threshold", "1")
EPS = (("ddcl_plain", "plain layer, eps = 0.01", PLAIN),
       ("ddcl_eps0.1", "plain layer, eps = 0.1", (*PLAIN, "--model.eps", "0.1")),
       ("ddcl_eps1.0", "plain layer, eps = 1.0", (*PLAIN, "--model.eps", "1.0")))
TEMPERATURE = (("ddcl_fixedT", "plain layer, T fixed at 4", (*PLAIN, "--model.target_entropy", "null")),
               ("ddcl_annealT", "plain layer, T annealed 4 -> 0.5", (*PLAIN, "--model.temperature_schedule",
                                                                     "exponential", "--model.temperature_final",
                                                                     "0.5")))

# --quick: small model, 1,000 images, 2 epochs (a few minutes on 2 cores).
QUICK = {"epochs": 2, "train_subset": 1000, "val_size": 500, "test_limit": 1000,
         "train_args": "--model.width 32 --model.res_hidden 16 --model.res_blocks 1 --model.num_codes 128 "
                       "--model.code_dim 32"}
FULL = {"epochs": 5, "train_subset": 10000, "val_size": 5000, "test_limit": None, "train_args": ""}
# config.json keys (dotted) that may differ between an existing run and this comparison without making it another
# run: those a resume may change (where the run and the data are, how long and how it runs).
NOT_MODEL = frozenset(train_config.RESUME_SAFE)


GROUPS = ("methods", "eps", "temperature")


# The studies that ablate one setting: read on the validation split (the history's last epoch), never on test.
ABLATIONS = ("eps", "temperature")


def plan(seeds: list[int], ablation_seeds: list[int], groups: tuple[str, ...] = GROUPS) -> list[RunSpec]:
    """The runs of the comparison: the methods on every seed, each study in ``groups`` on the ablation seeds."""
    runs = [RunSpec("methods", key, label, seed, flags) for key, label, flags in METHODS for seed in seeds]
    for group, table in (("eps", EPS), ("temperature", TEMPERATURE)):
        if group in groups:
            runs += [RunSpec(group, key, label, seed, flags) for key, label, flags in table
                     for seed in ablation_seeds]
    return runs


def train_argv(spec: RunSpec, args: argparse.Namespace) -> list[str]:
    argv = [*spec.flags, "--seed", str(spec.seed), "--epochs", str(args.epochs), "--data.val_size",
            str(args.val_size), "--data.data_root", str(args.data_root), "--data.num_workers", str(args.num_workers),
            "--trainer.progress_bar", "false", "--out", str(spec.directory(args.runs)), *shlex.split(args.train_args)]
    if args.train_subset is not None:
        argv += ["--data.train_subset", str(args.train_subset)]
    if args.download:
        argv += ["--data.download", "true"]
    return argv


def resolved_configs(argv: list[str]) -> tuple[Any, dict[str, dict[str, Any]]]:
    """The trainer's parsed flags ``argv`` and, per ``--quantizer``, the resolved configuration the run would save
    in its config.json (flattened to dotted keys). Every constructor's checks run (the model, the data module's
    settings, the run options and the hardware), so a bad setting fails here, before any training.

    Raises:
        SystemExit: a flag of the wrong type or choice (jsonargparse's usage error, status 2).
        ValueError: a setting out of range (the constructor's message).
    """
    cfg = train_config.parse(argv)
    models = train_config.check_all(cfg)
    return cfg, {q: train_config.flat(train_config.resolved_config(cfg, q, m)) for q, m in models.items()}


def run_state(spec: RunSpec, args: argparse.Namespace) -> str:
    """``"done"`` (every epoch and its checkpoint are there), ``"resume"`` (started, unfinished) or ``"new"``.

    Raises:
        ValueError: the directory holds a run with other settings, or with more epochs than asked for.
    """
    out = spec.directory(args.runs)
    if not (out / "config.json").exists():
        return "new"
    saved = train_config.flat(json.loads((out / "config.json").read_text()))
    cfg, configs = resolved_configs(train_argv(spec, args))
    quantizer = cfg.quantizer[0]
    wanted = configs[quantizer]
    # A setting newer than the run (not in its config.json) counts as matching when it is not given here: the run
    # trained at its default.
    defaults = train_config.parse(["--quantizer", quantizer])
    changed = train_config.config_changes(saved, wanted)
    diff = []
    for key in sorted(wanted.keys() - NOT_MODEL):
        if key not in saved:
            if key in cfg and cfg[key] != defaults[key]:
                diff.append(f"{key}: not in its config.json (default {defaults[key]!r}), {cfg[key]!r} here")
        elif key in changed:
            diff.append(f"{key}: {changed[key][0]!r} there, {changed[key][1]!r} here")
    if diff:
        raise ValueError(f"{out} holds a run with other settings ({'; '.join(diff)}); use another --runs directory "
                         f"or remove it")
    rows = read_history(out / "history.jsonl")
    epochs = max((row["epoch"] for row in rows), default=0)
    if epochs > args.epochs:
        raise ValueError(f"{out} was trained for {epochs} epochs, more than --epochs {args.epochs}: its checkpoint "
                         f"is not at equal epochs; use another --runs directory")
    last = out / "checkpoints" / "last.ckpt"
    if epochs == args.epochs and last.is_file() and evaluate.checkpoint_epochs(last)[0] == args.epochs:
        return "done"
    return "resume" if last.is_file() else "new"


def train(spec: RunSpec, args: argparse.Namespace, threads: int, state: str) -> float:
    """Train (``state`` ``"new"``) or resume (``"resume"``, see :func:`run_state`) one run in its own process; its
    output goes to ``<run>/train.log``. Returns seconds."""
    out = spec.directory(args.runs)
    out.mkdir(parents=True, exist_ok=True)
    argv = train_argv(spec, args) + (["--resume"] if state == "resume" else ["--overwrite"])
    env = {**os.environ, "OMP_NUM_THREADS": str(threads), "MKL_NUM_THREADS": str(threads)}
    start = time.perf_counter()
    with open(out / "train.log", "a") as logfile:
        logfile.write(f"$ {shlex.join([sys.executable, str(TRAIN_SCRIPT), *argv])}\n")
        logfile.flush()
        proc = subprocess.run([sys.executable, str(TRAIN_SCRIPT), *argv], cwd=ROOT, env=env, stdout=logfile,
                              stderr=subprocess.STDOUT)
    if proc.returncode != 0:
        tail = "\n".join((out / "train.log").read_text().splitlines()[-15:])
        raise RuntimeError(f"training {out} failed (exit {proc.returncode}); end of {out / 'train.log'}:\n{tail}")
    return time.perf_counter() - start


def train_all(specs: list[RunSpec], args: argparse.Namespace) -> None:
    states = {spec: run_state(spec, args) for spec in specs}
    todo = [spec for spec in specs if states[spec] != "done"]
    log.info("%d runs: %d to train, %d already done", len(specs), len(todo), len(specs) - len(todo))
    if args.no_train and todo:
        raise FileNotFoundError("--no-train, but these runs are missing or unfinished: "
                                + ", ".join(str(s.directory(args.runs)) for s in todo))
    threads = max(1, (os.cpu_count() or 1) // args.jobs)
    failures = []
    with ThreadPoolExecutor(max_workers=args.jobs) as pool:
        futures = {pool.submit(train, spec, args, threads, states[spec]): spec for spec in todo}
        for done, future in enumerate(as_completed(futures), start=1):
            spec = futures[future]
            try:
                seconds = future.result()
            except Exception as err:  # keep the other runs going; report every failure at the end
                failures.append(str(err))
                log.error("[%d/%d] %s seed %d failed", done, len(todo), spec.key, spec.seed)
                continue
            log.info("[%d/%d] trained %s seed %d in %.0f s", done, len(todo), spec.key, spec.seed, seconds)
    if failures:
        raise RuntimeError("\n\n".join(failures))


def test_metrics(spec: RunSpec, args: argparse.Namespace) -> dict[str, Any]:
    """The run's final checkpoint on the test split, cached in ``<run>/test_metrics.json`` (keyed by sha256)."""
    out = spec.directory(args.runs)
    checkpoint = out / "checkpoints" / "last.ckpt"
    cache = out / "test_metrics.json"
    digest = sha256_file(checkpoint)
    if cache.exists():
        saved = json.loads(cache.read_text())
        if saved.get("checkpoint_sha256") == digest and saved.get("limit") == args.test_limit:
            return saved
    result = evaluate.evaluate(checkpoint, args.data_root, limit=args.test_limit, num_workers=args.num_workers,
                               download=args.download, accelerator="cpu", progress=False)
    result["limit"] = args.test_limit
    write_atomic(cache, json.dumps(result) + "\n")
    return result


def collect(specs: list[RunSpec], args: argparse.Namespace,
            metrics: Callable[[RunSpec, argparse.Namespace], dict[str, Any]] | None = None) -> list[dict[str, Any]]:
    """Per run: its spec, its history (first ``--epochs`` rows) and its test metrics (``metrics``, default
    :func:`test_metrics`)."""
    metrics = metrics or test_metrics
    runs = []
    for i, spec in enumerate(specs, start=1):
        directory = spec.directory(args.runs)
        if spec.group in ABLATIONS:  # an ablation is judged on validation: the test split is for final tables only
            test = None
        else:
            start = time.perf_counter()
            test = metrics(spec, args)
            log.info("[%d/%d] test split: %s seed %d (%.0f s)", i, len(specs), spec.key, spec.seed,
                     time.perf_counter() - start)
        history = [row for row in read_history(directory / "history.jsonl") if row["epoch"] <= args.epochs]
        config = json.loads((directory / "config.json").read_text())
        runs.append({"group": spec.group, "key": spec.key, "label": spec.label, "seed": spec.seed,
                     "flags": list(spec.flags), "num_codes": config["model"]["num_codes"], "history": history,
                     "test": test})
    return runs


def add_run_args(p: argparse.ArgumentParser, quick_help: str) -> None:
    """The flags every training study shares (data, run size, parallelism); :func:`finish_run_args` applies them."""
    p.add_argument("--data-root", type=Path, default=Path("data"), help="CIFAR-10 directory or .tar.gz archive")
    p.add_argument("--download", action="store_true", help="download the official CIFAR-10 if none is found")
    p.add_argument("--quick", action="store_true", help=f"a few minutes on 2 cores: {QUICK}{quick_help}")
    p.add_argument("--epochs", type=int, default=None, help=f"training epochs of every run (default {FULL['epochs']})")
    p.add_argument("--train-subset", type=int, default=None,
                   help=f"training images per run (default {FULL['train_subset']}; 0 = all 45,000)")
    p.add_argument("--val-size", type=int, default=None, help=f"held-out validation images (default "
                                                              f"{FULL['val_size']})")
    p.add_argument("--test-limit", type=int, default=None,
                   help="evaluate on the first N test images (default: all 10,000; --quick: 1,000)")
    p.add_argument("--train-args", default=None,
                   help="extra train_vqvae.py (softvq-train) flags for every run, e.g. '--model.num_codes 1024' "
                        "(quoted)")
    p.add_argument("--jobs", type=int, default=2, help="training runs at a time (the CPU cores are split)")
    p.add_argument("--num-workers", type=int, default=1, help="DataLoader workers per run")


def finish_run_args(args: argparse.Namespace, p: argparse.ArgumentParser, argv: list[str] | None, prog: str,
                    report: str, seed_flags: tuple[str, ...]) -> None:
    """Fill the ``--quick`` / full presets, the default ``--runs`` and ``--out``, check the shared flags, and set
    ``args.command``, the command that regenerates the report from scratch."""
    preset = QUICK if args.quick else FULL
    for name, value in preset.items():
        if getattr(args, name) is None:
            setattr(args, name, value)
    if args.train_subset == 0:
        args.train_subset = None
    suffix = "-quick" if args.quick else ""
    args.runs = args.runs or Path(f"runs/compare{suffix}")
    args.out = args.out or Path(f"reports/{report}{suffix}")
    for name, minimum in (("epochs", 1), ("jobs", 1), ("num_workers", 0), ("train_subset", 0), ("test_limit", 1)):
        value = getattr(args, name)
        if value is not None and value < minimum:
            p.error(f"argument --{name.replace('_', '-')}: must be >= {minimum}, got {value}")
    if args.val_size < 1:
        p.error("argument --val-size: the report plots validation PSNR per epoch; it needs a validation set")
    for name in seed_flags:
        seeds = getattr(args, name) or []
        if len(set(seeds)) != len(seeds):
            p.error(f"argument --{name.replace('_', '-')}: repeated seeds {seeds}")
    # Every run's flags must parse, and every constructor accept them, before hours of training start.
    try:
        train_args = shlex.split(args.train_args)
        if "--quantizer" not in train_args and train_config.parse(train_args).model.levels == 1:
            train_args += ["--quantizer", *QUANTIZERS]  # they are given to every run: check them with each quantizer
        resolved_configs(train_args)
    except SystemExit:
        p.error(f"argument --train-args: train_vqvae.py rejects {args.train_args!r} (its message above)")
    except ValueError as err:
        p.error(f"argument --train-args: train_vqvae.py rejects {args.train_args!r}: {err}")
    # --no-train only says that the runs existed already.
    args.command = f"python -m {prog} " + shlex.join(a for a in (sys.argv[1:] if argv is None else argv)
                                                     if a != "--no-train")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m eval.compare", description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    add_run_args(p, " (flags given explicitly still win)")
    p.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2], help="seeds of the method runs")
    p.add_argument("--ablation-seeds", type=int, nargs="+", default=None,
                   help="seeds of the eps and temperature runs (default: the first of --seeds)")
    p.add_argument("--studies", nargs="*", choices=GROUPS[1:], default=list(GROUPS[1:]),
                   help="the DDCL studies to run beside the methods (none: the head-to-head alone)")
    p.add_argument("--runs", type=Path, default=None,
                   help="where the training runs live (default runs/compare, runs/compare-quick with --quick)")
    p.add_argument("--out", type=Path, default=None,
                   help="report directory (default reports/compare, reports/compare-quick with --quick)")
    p.add_argument("--no-train", action="store_true", help="only read existing runs; fail if one is missing")
    args = p.parse_args(argv)
    args.ablation_seeds = args.ablation_seeds or args.seeds[:1]
    finish_run_args(args, p, argv, "eval.compare", "compare", ("seeds", "ablation_seeds"))
    return args


def main(argv: list[str] | None = None) -> dict[str, Any]:
    args = parse_args(argv)
    start = time.perf_counter()
    specs = plan(args.seeds, args.ablation_seeds, ("methods", *args.studies))
    train_all(specs, args)
    trained = time.perf_counter() - start
    torch.set_num_threads(os.cpu_count() or 1)
    runs = collect(specs, args)
    settings = {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()}
    results = write_report(runs, settings, args.out, seconds={"train": trained,
                                                              "total": time.perf_counter() - start})
    log.info("report: %s", args.out / "report.md")
    return results

