"""Per second: which DDCL layer wins on a seconds axis against the strongest hard VQ (the short setting, validation).

Usage:
    pip install -e ".[dev]"
    python -m eval.per_second --data-root ../shared/data/cifar10-jpeg.tar.gz --num-codes 4096 \\
        --methods ddcl_k16 ddcl_k32 ddcl_anneal ddcl_exact hard_ema --seeds 0 --threads 1 [--commit]
    python -m eval.per_second.step_cost --num-codes 512 4096 16384 --methods ddcl_k16 ... hard_ema   # quiet cores
    python -m eval.per_second.report            # the report from the finished runs and the step costs

The setting: the peers' short setting (:func:`eval.harness.add_vqvae_arguments`: the project's VQ-VAE, width 128, two
residual blocks, D = 64, Adam 3e-4, batch 128, 10,000 training images, 5 epochs), scored on the **validation** split
(5,000 held-out training images) after every epoch; the test split is never read here (``fit_run(test=False)``): the
candidates are chosen on validation, and the test split is read once, by the long runs of the chosen default.

Seconds: a run's own clock is not used (two runs share the machine's two cores). Every method's VQ-VAE training step
is timed side by side in one process on quiet cores (:mod:`eval.per_second.step_cost`), and a run's seconds at the end
of an epoch are its optimizer steps times that cost (for ``ddcl_anneal``, each phase's steps times its k's cost).

Each finished run is written to ``--out/runs/K<K>_<method>_seed<S>.json`` (settings, per-epoch history, the code commit
it trained at) and, with ``--commit``, committed alone; a run with a record is not trained again. Two processes (one
per core) can share the work: a run another process holds (its lock in ``--runs``) is skipped.
"""

from __future__ import annotations

import argparse
import json
import logging
import subprocess
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from eval import harness
from eval._provenance import ROOT, loaded_code, repo_relative
from eval.per_second.plan import BASELINES, CANDIDATES, OUT
from softvq.models.files import RunLock, RunLockedError, write_atomic

log = logging.getLogger("eval.per_second")



def record_path(out: Path, num_codes: int, method: str, seed: int) -> Path:
    return out / "runs" / f"K{num_codes}_{method}_seed{seed}.json"


def train_one(num_codes: int, method: str, seed: int, args: argparse.Namespace) -> dict[str, Any] | None:
    """Train one run unless its record exists or another process holds it; its record, or ``None`` if skipped."""
    path = record_path(args.out, num_codes, method, seed)
    if path.exists():
        return json.loads(path.read_text())
    directory = args.runs / f"K{num_codes}" / method / f"seed{seed}"
    try:
        with RunLock(directory):
            if path.exists():  # another process finished it between the check above and taking the lock
                return json.loads(path.read_text())
            one = argparse.Namespace(**{**vars(args), "num_codes": num_codes})
            code = loaded_code()  # what this process imported: the tree may have moved on since, and may in training
            log.info("training K=%d %s seed %d at %s", num_codes, method, seed, code)
            _, _, record = harness.fit_run(method, seed, one, directory, test=False, echo=True,
                                           callbacks=harness.method_callbacks(method))
    except RunLockedError:
        log.info("K=%d %s seed %d is held by another process: skipped", num_codes, method, seed)
        return None
    record.update(num_codes=num_codes, label=harness.LABELS[method], code=code,
                  settings={**record["settings"], "data": repo_relative(args.data_root), "split": "validation"},
                  steps_per_epoch=[row.get("step") for row in record["history"]])
    path.parent.mkdir(parents=True, exist_ok=True)
    write_atomic(path, json.dumps(record, indent=1) + "\n")
    if args.commit:
        last = record["history"][-1]
        subprocess.run(["git", "-C", str(ROOT), "add", "--", str(path)], check=False)
        subprocess.run(["git", "-C", str(ROOT), "commit", "-q", "-m",
                        f"per_second: {method} K={num_codes} seed {seed}: validation hard PSNR "
                        f"{last['val_psnr_hard']:.2f} dB after {len(record['history'])} epochs", "--", str(path)],
                       check=False)
    return record


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m eval.per_second", description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--data-root", type=Path, default=Path("data"))
    p.add_argument("--num-codes", type=int, nargs="+", default=[4096, 16384, 512])
    p.add_argument("--methods", nargs="+", choices=harness.METHODS, default=[*CANDIDATES, *BASELINES])
    p.add_argument("--seeds", type=int, nargs="+", default=[0])
    p.add_argument("--runs", type=Path, default=ROOT.parent / "runs" / "per_second",
                   help="where runs train (default: ../runs/per_second beside the clone)")
    p.add_argument("--out", type=Path, default=OUT, help="where finished records go (default: reports/per_second)")
    p.add_argument("--commit", action="store_true", help="git-commit each finished run's record (that file alone)")
    p.add_argument("--no-progress-bar", action="store_true")
    p.add_argument("--quick", action="store_true", help="a smoke run: 1 epoch of 256 images, a tiny model")
    harness.add_vqvae_arguments(p)
    args = p.parse_args(argv)
    if args.quick:
        args.epochs, args.train_subset, args.val_size = 1, 256, 64
        args.width, args.res_blocks, args.res_hidden = 16, 1, 8
        args.batch_size = 32
    for name in ("epochs", "train_subset", "val_size", "batch_size"):
        if getattr(args, name) < 1:
            p.error(f"--{name.replace('_', '-')} must be positive, got {getattr(args, name)}")
    if min(args.num_codes) < 2:
        p.error(f"--num-codes must be at least 2, got {args.num_codes}")
    return args


def main(argv: Sequence[str] | None = None) -> list[dict[str, Any]]:
    args = parse_args(argv)
    records = []
    with harness.study_run(args.threads):
        for num_codes in args.num_codes:
            for seed in args.seeds:
                for method in args.methods:
                    record = train_one(num_codes, method, seed, args)
                    if record is not None:
                        records.append(record)
    return records
