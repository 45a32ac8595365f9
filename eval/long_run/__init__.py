"""Long training: the project's VQ-VAE (the model :func:`eval.harness.fit_run` trains) on all 45,000 CIFAR-10 training
images for 10 epochs, per bottleneck method, codebook size K and seed; runs that take hours, so every run resumes.

Usage:
    pip install -e ".[bench]"   # vector-quantize-pytorch, for the vqp_* peers
    python -m eval.long_run --data-root ../shared/data/cifar10-jpeg.tar.gz --runs runs/long_run \\
        --out reports/long_run --threads 1 [--num-codes 512] [--methods ddcl hard_ema] [--seeds 0 1 2] [--commit]
    python -m eval.long_run --no-train --runs runs/long_run --out reports/long_run   # the report alone
    python -m eval.long_run --quick --data-root ../shared/data/cifar10-jpeg.tar.gz   # a smoke run, minutes

Which runs: :data:`PLAN`, filtered. ``--num-codes``, ``--methods`` and ``--seeds`` each keep the plan's runs with
one of the values given (a flag not given keeps all); a selection that holds none of the plan's runs is an error.
``--off-plan`` runs every combination of the values given instead, in the plan or not (a flag not given then takes
every value the plan uses). Order: K as given, then seed, then method, so an interrupted study has every method at
its first seeds.

Settings: :func:`eval.harness.add_vqvae_arguments` (the peers' model) with this study's defaults: 10 epochs, every
training image (``--train-subset`` None: 45,000 after the 5,000 of ``--val-size`` held out). The validation split is
scored after every epoch, the official test split once, when a run has finished its epochs.

Every run lives in ``--runs/K<K>/<method>/seed<S>/``: ``settings.json`` (what its result depends on: a later start
with other settings is refused, naming them), ``invocations.jsonl`` (code commit, command and start epoch of every
start or resume), ``history.jsonl`` (one record per epoch, ``step`` the optimizer steps done at its end),
``checkpoints/last.ckpt`` (every epoch end; a start with it resumes, with the global random states the checkpoint
holds, so a resumed run ends bit for bit as an uninterrupted one on CPU) and, when finished, ``result.json``
(then read, not retrained). The finished record is copied to ``--out/runs/K<K>_<method>_seed<S>.json``, the
committed copy (``--commit``: ``git commit`` of that file alone), and the report (:mod:`eval.long_run.report`) is
rewritten. Paths in a record are relative to the repository root; a run directory is locked while a process
trains it, so two processes (one per core) can share ``--runs``: the second skips a run the first holds.
"""

from __future__ import annotations

import argparse
import copy
import datetime
import importlib.util
import json
import logging
import subprocess
import sys
import time
import warnings
from collections.abc import Sequence
from pathlib import Path
from typing import Any, NamedTuple

import lightning as L

from eval import fingerprint, harness, render
from eval._provenance import ROOT, code_commit, git, repo_relative, study_command
from eval.long_run.metrics import EightBitPSNR, psnr_8bit
from eval.long_run.report import write_report
from eval.reports import report_fingerprints
from softvq.cli.common import run_command
from softvq.cli.train import checkpoint_callbacks
from softvq.data.cifar10 import CIFAR10DataModule
from softvq.models import VQVAE
from softvq.models.callbacks import AtomicCheckpointIO, HistoryWriter, read_history
from softvq.models.checkpoint_io import load_torch_file
from softvq.models.files import RunLock, RunLockedError, remove_stale_temporaries, write_atomic

__all__ = ["PLAN", "EightBitPSNR", "Run", "check_settings", "main", "psnr_8bit", "select_runs", "settings_of",
           "train_run"]

log = logging.getLogger("eval.long_run")

# {K: {method: seeds}}: the full study. Every method at 512 (the three VQ peers with 3 seeds, FSQ and SimVQ with one);
# at 4096 and 16384 DDCL and HardVQ, where hard codebooks are published to collapse; there DDCL's default truncates
# (top_k="auto"), and the exact layer that was the default before it, ddcl_exact, keeps its runs.
PLAN: dict[int, dict[str, tuple[int, ...]]] = {
    512: {"ddcl": (0, 1, 2), "hard_ema": (0, 1, 2), "vqp_vq": (0, 1, 2), "vqp_fsq": (0,), "vqp_simvq": (0,)},
    4096: {"ddcl": (0, 1), "ddcl_exact": (0, 1), "hard_ema": (0, 1), "vqp_vq": (0,)},
    16384: {"ddcl": (0,), "ddcl_exact": (0,), "hard_ema": (0,)},
}
PATH_FLAGS = ("--data-root", "--runs", "--out")  # recorded relative to the repository root


class Run(NamedTuple):
    """One run of the study: codebook size, bottleneck method (:func:`eval.harness.build`) and seed."""

    num_codes: int
    method: str
    seed: int

    @property
    def name(self) -> str:
        """``K<K>_<method>_seed<S>``, the name of its record in ``--out/runs/``."""
        return f"K{self.num_codes}_{self.method}_seed{self.seed}"

    def directory(self, runs: Path) -> Path:
        return runs / f"K{self.num_codes}" / self.method / f"seed{self.seed}"


def select_runs(num_codes: Sequence[int] | None = None, methods: Sequence[str] | None = None,
                seeds: Sequence[int] | None = None, off_plan: bool = False,
                plan: dict[int, dict[str, tuple[int, ...]]] = PLAN) -> list[Run]:
    """The runs of ``plan`` whose K, method and seed are among those given (``None``: any), or with ``off_plan`` every
    combination of the values given (``None``: every value the plan uses); ordered K, seed, method.

    Raises:
        ValueError: the selection holds no run (naming the filters).
    """
    ks = list(num_codes) if num_codes is not None else list(plan)
    all_methods = [m for m in harness.METHODS if any(m in per_k for per_k in plan.values())]
    names = [m for m in harness.METHODS if m in methods] if methods is not None else all_methods
    all_seeds = sorted({s for per_k in plan.values() for seeds_ in per_k.values() for s in seeds_})
    wanted_seeds = sorted(seeds) if seeds is not None else all_seeds
    runs = [Run(k, m, s) for k in ks for s in wanted_seeds for m in names
            if off_plan or s in plan.get(k, {}).get(m, ())]
    if not runs:
        raise ValueError(f"the plan has no run with K in {ks}, methods {names} and seeds {wanted_seeds}; "
                         f"--off-plan runs those combinations anyway")
    return runs


def relative_argv(argv: Sequence[str]) -> list[str]:
    """``argv`` with the values of :data:`PATH_FLAGS` made :func:`repo_relative`."""
    out, after_flag = [], False
    for token in argv:
        flag, eq, value = token.partition("=")
        if after_flag:
            out.append(repo_relative(token))
        elif eq and flag in PATH_FLAGS:
            out.append(f"{flag}={repo_relative(value)}")
        else:
            out.append(token)
        after_flag = token in PATH_FLAGS
    return out


def settings_of(args: argparse.Namespace, num_codes: int) -> dict[str, Any]:
    """What a run's numbers depend on besides method and seed (:func:`eval.harness.settings_of` at ``num_codes``, the
    data path repository-relative)."""
    one = copy.copy(args)
    one.num_codes = num_codes
    return {**harness.settings_of(one), "data": repo_relative(args.data_root)}


def check_settings(directory: Path, settings: dict[str, Any]) -> bool:
    """Whether ``directory`` records ``settings`` (``False``: it records none and holds no run yet).

    Raises:
        ValueError: the directory holds a run with other settings (naming each), or one without ``settings.json``.
    """
    path = directory / "settings.json"
    if path.is_file():
        recorded = json.loads(path.read_text())
        diff = [f"{key}: run {recorded.get(key)!r} vs now {settings.get(key)!r}"
                for key in sorted(recorded.keys() | settings.keys()) if recorded.get(key) != settings.get(key)]
        if diff:
            raise ValueError(f"{directory} holds a run with other settings; it is neither resumed nor retrained "
                             f"over. Pass its settings, choose another --runs, or delete the directory:\n  "
                             + "\n  ".join(diff))
        return True
    if any((directory / name).exists() for name in ("checkpoints", "history.jsonl", "result.json")):
        raise ValueError(f"{directory} holds a run without settings.json, whose settings are unknown; delete it to "
                         f"train this run")
    return False


def _note_invocation(directory: Path, args: argparse.Namespace, from_epoch: int, method: str) -> None:
    name = fingerprint.canonical(method)  # the numerics this start or resume trains with (eval.reports --check)
    record = {"time": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
              "code": args.code, "command": args.command, "from_epoch": from_epoch,
              "fingerprint": fingerprint.fingerprint(name) if name else None}
    path = directory / "invocations.jsonl"
    write_atomic(path, (path.read_text() if path.exists() else "") + json.dumps(record) + "\n")


def train_run(run: Run, args: argparse.Namespace, directory: Path,
              callbacks: Sequence[L.Callback] = ()) -> dict[str, Any] | None:
    """Train ``run`` in ``directory`` (resuming from ``checkpoints/last.ckpt`` when there is one) and, once it has
    finished its ``args.epochs``, score it on the test split: the run's record, also written to ``result.json``;
    ``None`` when training stopped earlier (a callback set ``trainer.should_stop``): it resumes next time.

    The model is built as :func:`eval.harness.fit_run` builds it (the same seeding between data, bottleneck and
    autoencoder). ``callbacks``: extra Lightning callbacks (the tests stop a run with one).
    """
    ckpt = directory / "checkpoints" / "last.ckpt"
    remove_stale_temporaries(directory / "checkpoints")
    resume = ckpt.is_file()
    from_epoch = int(load_torch_file(ckpt, "checkpoint")["epoch"]) + 1 if resume else 0
    _note_invocation(directory, args, from_epoch, run.method)
    L.seed_everything(run.seed, workers=True, verbose=False)
    data = CIFAR10DataModule(args.data_root, batch_size=args.batch_size, val_size=args.val_size,
                             train_subset=args.train_subset, num_workers=args.num_workers, seed=run.seed)
    quantizer = harness.build(run.method, run.num_codes, args.code_dim)
    L.seed_everything(run.seed, workers=True, verbose=False)
    model = VQVAE(quantizer=quantizer, code_dim=args.code_dim, width=args.width, res_blocks=args.res_blocks,
                  res_hidden=args.res_hidden, lr=args.lr)
    # A fresh run draws from here; a resumed one from the random states its checkpoint holds (VQVAE.on_load_checkpoint)
    L.seed_everything(run.seed, workers=True, verbose=False)
    eight_bit = EightBitPSNR()
    test_batches = (args.test_limit // args.batch_size) or 1 if args.test_limit else 1.0  # as eval.harness.fit_run
    trainer = L.Trainer(
        max_epochs=args.epochs, accelerator="cpu", logger=False, default_root_dir=directory,
        plugins=[AtomicCheckpointIO()], enable_progress_bar=not args.no_progress_bar, enable_model_summary=False,
        num_sanity_val_steps=0, limit_test_batches=test_batches,
        callbacks=[HistoryWriter(directory / "history.jsonl", echo=False),
                   *checkpoint_callbacks(directory / "checkpoints", validation=False), eight_bit, *callbacks])
    log.info("%s: %s -> %s", run.name, f"resuming after epoch {from_epoch}" if resume else "training", directory)
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="Checkpoint directory .* exists and is not empty")
        trainer.fit(model, datamodule=data, ckpt_path=str(ckpt) if resume else None, weights_only=True)
    history = read_history(directory / "history.jsonl")
    if not history or history[-1]["epoch"] < args.epochs:
        log.info("%s stopped after epoch %d of %d; it resumes from there", run.name,
                 history[-1]["epoch"] if history else 0, args.epochs)
        return None
    start = time.perf_counter()
    trainer.test(model, datamodule=data, verbose=False)
    test = {k.removeprefix("test_"): v for k, v in model.test_summary.items()}
    test.update(num_codes=model.num_codes, ppl_per_k=test["perplexity"] / model.num_codes, psnr_8bit=eight_bit.mean,
                images=eight_bit.images)
    invocations = read_history(directory / "invocations.jsonl")
    record = {"method": run.method, "num_codes": run.num_codes, "seed": run.seed, "label": harness.LABELS[run.method],
              "settings": settings_of(args, run.num_codes), "history": history, "test": test,
              "wall_s": sum(row["time_s"] for row in history) + time.perf_counter() - start,
              "code": args.code, "command": args.command, "invocations": invocations,
              "fingerprints": sorted({i["fingerprint"] for i in invocations if i.get("fingerprint")})}
    write_atomic(directory / "result.json", json.dumps(record, indent=1))
    return record


def publish(run: Run, record: dict[str, Any], out: Path, commit: bool) -> None:
    """Write ``record`` to ``out/runs/<run.name>.json`` unless it holds it already; with ``commit`` git-commit that
    file alone, with the fingerprint store and, for the committed study, every README or docs page whose rendered
    tables it changes (:mod:`eval.render`) and that has no other uncommitted change (a failing git is logged, not
    raised)."""
    path = out / "runs" / f"{run.name}.json"
    if path.is_file() and "fingerprints" not in record:  # a result.json from before records held their prints
        held = json.loads(path.read_text()).get("fingerprints")
        record = {**record, **({"fingerprints": held} if held else {})}
    text = json.dumps(record, indent=1) + "\n"
    if path.is_file() and path.read_text() == text:
        return
    path.parent.mkdir(parents=True, exist_ok=True)
    write_atomic(path, text)
    if not commit:
        return
    # the numerics this run was made with, for eval.reports --check (the committed report's fingerprints)
    inside = fingerprint.STORE.parent in out.resolve().parents or out.resolve() == fingerprint.STORE.parent
    store = fingerprint.STORE if inside else out / "fingerprints.json"  # a study written elsewhere keeps its own
    report = repo_relative(out / "report.md")
    fingerprint.record(report, report_fingerprints(out / "runs", fingerprint.load(store).get(report, {})), store)
    message = (f"long_run: {run.method} K={run.num_codes} seed {run.seed}: test hard PSNR "
               f"{record['test']['psnr_hard']:.2f} dB after {record['settings']['epochs']} epochs")
    try:
        files = [str(path.resolve()), str(store)]
        if inside:  # the README's and docs' tables rendered from these records (eval.render), where nobody edits them
            files += [str(path) for path in render.render_files(ROOT, only_unedited=True)]
        git("add", "--", *files)
        git("commit", "--only", "-m", message, "--", *files)
    except (OSError, subprocess.CalledProcessError) as err:
        log.warning("git commit of %s failed (%s); the file is written", path,
                    getattr(err, "stderr", None) or err)


def load_or_train(run: Run, args: argparse.Namespace, callbacks: Sequence[L.Callback] = ()) -> dict[str, Any] | None:
    """The record of ``run``: read from its ``result.json``, else trained (or resumed) now; ``None`` when it did not
    finish here (stopped, or another process holds its directory)."""
    directory = run.directory(args.runs)
    try:
        with RunLock(directory):
            settings = settings_of(args, run.num_codes)
            if not check_settings(directory, settings):
                write_atomic(directory / "settings.json", json.dumps(settings, indent=1) + "\n")
            path = directory / "result.json"
            if path.is_file():
                log.info("%s: read %s", run.name, path)
                return json.loads(path.read_text())
            return train_run(run, args, directory, callbacks)
    except RunLockedError as err:
        log.warning("%s skipped: %s", run.name, err)
        return None


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    paragraphs = __doc__.split("\n\n")
    p = argparse.ArgumentParser(prog="python -m eval.long_run", description=paragraphs[0],
                                epilog="\n\n".join(paragraphs[2:4]), allow_abbrev=False,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--data-root", type=Path, default=Path("data"),
                   help="CIFAR-10 directory or .tar.gz archive (default: data)")
    p.add_argument("--num-codes", type=int, nargs="+", default=None, help="keep the plan's runs at these K")
    p.add_argument("--methods", nargs="+", choices=harness.METHODS, default=None, help="keep these methods' runs")
    p.add_argument("--seeds", type=int, nargs="+", default=None, help="keep these seeds' runs")
    p.add_argument("--off-plan", action="store_true",
                   help="run every combination of --num-codes x --methods x --seeds, also those the plan lacks")
    harness.add_vqvae_arguments(p)
    # this study's defaults (--epochs 10, every training image, 5,000 validation images), said in the epilog
    p.set_defaults(epochs=10, train_subset=None, val_size=5000)
    p.add_argument("--runs", type=Path, default=None,
                   help="run directories (default: runs/long_run; with --quick runs/long_run_quick)")
    p.add_argument("--out", type=Path, default=None,
                   help="records and report (default: reports/long_run; with --quick runs/long_run_quick/report)")
    p.add_argument("--no-train", action="store_true", help="only write the report from finished and partial runs")
    p.add_argument("--commit", action="store_true", help="git-commit each finished run's record (that file alone)")
    p.add_argument("--no-progress-bar", action="store_true")
    p.add_argument("--quick", action="store_true",
                   help="a smoke run: 2 epochs on 512 images, K=64, D=16, width 32, ddcl and hard_ema, seed 0, "
                        "in runs/long_run_quick/")
    args = p.parse_args(argv)
    raw = list(argv) if argv is not None else None
    if args.quick:
        args.epochs, args.train_subset, args.val_size, args.code_dim = 2, 512, 256, 16
        args.width, args.res_blocks, args.res_hidden, args.test_limit = 32, 1, 8, 512
        args.num_codes, args.methods, args.seeds, args.off_plan = [64], ["ddcl", "hard_ema"], [0], True
        args.runs = args.runs or Path("runs/long_run_quick")
        args.out = args.out or Path("runs/long_run_quick/report")
    args.runs = args.runs or Path("runs/long_run")
    args.out = args.out or Path("reports/long_run")
    for name in ("epochs", "batch_size", "code_dim", "width"):
        if getattr(args, name) < 1:
            p.error(f"--{name.replace('_', '-')} must be positive, got {getattr(args, name)}")
    if args.train_subset is not None and args.train_subset < 1:
        p.error(f"--train-subset must be positive, got {args.train_subset}")
    for flag, values in (("--seeds", args.seeds), ("--num-codes", args.num_codes), ("--methods", args.methods)):
        if values is not None and len(set(values)) != len(values):
            p.error(f"{flag} repeats a value: {values}")
    if args.num_codes is not None and min(args.num_codes) < 2:
        p.error(f"--num-codes needs sizes >= 2, got {args.num_codes}")
    try:
        args.selection = select_runs(args.num_codes, args.methods, args.seeds, args.off_plan)
        for run in args.selection:
            if run.method == "vqp_fsq":
                harness.fsq_levels(run.num_codes)
    except ValueError as err:
        p.error(str(err))
    if not args.no_train and any(run.method.startswith("vqp_") for run in args.selection) and \
            importlib.util.find_spec("vector_quantize_pytorch") is None:
        p.error("the vqp_* methods need vector-quantize-pytorch: pip install -e '.[bench]'")
    args.command = study_command("eval.long_run", relative_argv(raw if raw is not None else sys.argv[1:]))
    args.code = code_commit()  # at the start: the code this process imported, whatever changes while it trains
    return args


def main(argv: list[str] | None = None, callbacks: Sequence[L.Callback] = ()) -> dict[str, Any]:
    """Train (or resume, or read) the selected runs one after another, publishing each finished one and rewriting
    the report after it; returns the report's summary. ``callbacks``: extra Lightning callbacks for every run."""
    args = parse_args(argv)
    planned = [run.name for run in args.selection]
    if not args.no_train:
        for run in args.selection:  # before any training: a clash is reported now, not hours into the study
            check_settings(run.directory(args.runs), settings_of(args, run.num_codes))
        with harness.study_run(args.threads):
            for run in args.selection:
                record = load_or_train(run, args, callbacks)
                if record is not None:
                    publish(run, record, args.out, args.commit)
                    write_report(args.out, args.runs, planned)
    return write_report(args.out, args.runs, planned)


def cli(argv: list[str] | None = None) -> int:
    return run_command(main, argv)
