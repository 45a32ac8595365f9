"""Hierarchical DDCL on CIFAR-10: 1-level DDCL vs 2-level DDCL vs hard VQ at equal epochs, and the paper's hierarchical
claim (docs/design.md, "Stacked codebooks"): ``V^(l) >= 0`` and ``L_q^(l) = L_OLS^(l) + V^(l)`` at every level and
every epoch.

Usage (the head-to-head's settings: 5 epochs, 10,000 training and 5,000 validation images, all 10,000 test images):
    python -m eval.hierarchy --runs runs/compare --data-root ../shared/data/cifar10-jpeg.tar.gz --jobs 2
    python -m eval.hierarchy --quick --data-root ../shared/data/cifar10-jpeg.tar.gz          # a few minutes

Only the 2-level runs (``train_vqvae.py --model.levels 2``: 512 codes on the 8x8 latent grid, 128 codes on its 2x2
averages, a 4x4 grid; the decoder sees both) are trained here, into ``--runs/ddcl_2level/seed<S>`` (resumed or read like
:mod:`eval.compare`'s runs). The 1-level DDCL and hard VQ runs are read from ``--runs/{ddcl,hard,hard_ema}/seed<S>``,
the directories :mod:`eval.compare` writes; a reference run that is missing or unfinished is left out of the report
(and named there) unless ``--train-references`` trains it. Its test metrics are read from its ``test_metrics.json`` or
computed without writing into its directory. ``--out`` receives ``report.md``, ``results.json`` and the plots.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch

from eval import compare
from eval.hierarchy.report import write_report
from softvq.cli import evaluate
from softvq.data.cifar10 import sha256_file
from softvq.models.files import write_atomic

log = logging.getLogger("eval.hierarchy")

LEVELS = 2
LEVEL_CODES = 128  # K_1: a quarter of K_0 = 512 for a quarter of the tokens
TWO_LEVEL = ("ddcl_2level", "DDCL, 2 levels", ("--quantizer", "ddcl", "--model.levels", str(LEVELS),
                                               "--model.level_codes", str(LEVEL_CODES), "--model.level_pool", "2"))
REFERENCES = tuple((key, label, flags) for key, label, flags in compare.METHODS)


def plan(seeds: list[int], references: list[str], reference_seeds: list[int] | None = None
         ) -> tuple[list[compare.RunSpec], list[compare.RunSpec]]:
    """(the 2-level runs to train on ``seeds``, the reference runs to read on ``reference_seeds``, default the same)."""
    new = [compare.RunSpec("hierarchy", TWO_LEVEL[0], TWO_LEVEL[1], s, TWO_LEVEL[2]) for s in seeds]
    refs = [compare.RunSpec("methods", key, label, s, flags) for key, label, flags in REFERENCES
            for s in (seeds if reference_seeds is None else reference_seeds) if key in references]
    return new, refs


def reference_test_metrics(spec: compare.RunSpec, args: argparse.Namespace) -> dict[str, Any]:
    """A reference run's test metrics: its own cached ``test_metrics.json`` (eval.compare's) if it matches the
    checkpoint and the test limit, else this script's cache under ``--new-runs/ddcl_2level/reference_tests/``, else
    evaluated here and cached there. Nothing is written into the reference run's directory."""
    out = spec.directory(args.runs)
    checkpoint = out / "checkpoints" / "last.ckpt"
    digest = sha256_file(checkpoint)
    ours = args.new_runs / TWO_LEVEL[0] / "reference_tests" / f"{spec.key}-seed{spec.seed}.json"
    for cache in (out / "test_metrics.json", ours):
        if cache.exists():
            saved = json.loads(cache.read_text())
            if saved.get("checkpoint_sha256") == digest and saved.get("limit") == args.test_limit:
                return saved
    result = evaluate.evaluate(checkpoint, args.data_root, limit=args.test_limit, num_workers=args.num_workers,
                               download=args.download, accelerator="cpu", progress=False)
    result["limit"] = args.test_limit
    ours.parent.mkdir(parents=True, exist_ok=True)
    write_atomic(ours, json.dumps(result) + "\n")
    return result


def claim_check(runs: list[dict[str, Any]], tolerance: float) -> list[dict[str, Any]]:
    """Per DDCL run and level: the smallest ``V`` and the largest identity residual over all its epochs, and whether
    ``V >= 0`` and ``residual <= tolerance`` held at every epoch.

    For 2-level runs ``V`` is the smallest *batch* value of each epoch (``v_min_l<l>``); 1-level runs record only the
    epoch mean ``v`` (they were trained before ``v_min`` existed), which is >= 0 whenever every batch is.
    """
    checks = []
    for run in runs:
        rows = run["history"]
        levels = int(run["test"].get("levels", 1))
        if run["key"] not in ("ddcl", TWO_LEVEL[0]) or not rows:
            continue
        for level in range(levels):
            suffix = f"_l{level}" if levels > 1 else ""
            v_key = f"v_min{suffix}" if levels > 1 else "v"
            values = [row.get(v_key) for row in rows]
            residuals = [row.get(f"identity_residual{suffix}") for row in rows]
            missing = any(v is None for v in values + residuals)
            v_min = float(np.nanmin(np.array(values, dtype=float)))
            worst = float(np.nanmax(np.array(residuals, dtype=float)))
            checks.append({"key": run["key"], "seed": run["seed"], "level": level, "epochs": len(rows),
                           "v_key": v_key, "v_min": v_min, "max_residual": worst, "missing": missing,
                           "holds": not missing and v_min >= 0 and worst <= tolerance})
    return checks


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m eval.hierarchy", description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    compare.add_run_args(p, ", references trained if missing (explicit flags win)")
    p.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2], help="seeds of the 2-level runs")
    p.add_argument("--reference-seeds", type=int, nargs="+", default=None,
                   help="seeds of the 1-level reference runs (default: --seeds)")
    p.add_argument("--runs", type=Path, default=None,
                   help="the head-to-head's runs directory, where ddcl_2level/ is added (default runs/compare, "
                        "runs/compare-quick with --quick)")
    p.add_argument("--new-runs", type=Path, default=None,
                   help="where the 2-level runs (ddcl_2level/seed<S>) are trained (default: --runs)")
    p.add_argument("--out", type=Path, default=None,
                   help="report directory (default reports/hierarchy, reports/hierarchy-quick with --quick)")
    p.add_argument("--references", nargs="+", choices=[r[0] for r in REFERENCES], default=[r[0] for r in REFERENCES],
                   help="the 1-level runs of eval.compare to compare with")
    p.add_argument("--train-references", action=argparse.BooleanOptionalAction, default=None,
                   help="also train missing or unfinished 1-level reference runs (default: only with --quick)")
    p.add_argument("--no-train", action="store_true", help="only read existing runs; fail if a 2-level run is missing")
    p.add_argument("--identity-tolerance", type=float, default=1e-5,
                   help="largest relative identity residual |L_q - L_OLS - V| / L_q that counts as 'holds' (float32 "
                        "rounding is ~1e-7)")
    args = p.parse_args(argv)
    compare.finish_run_args(args, p, argv, "eval.hierarchy", "hierarchy", ("seeds", "reference_seeds"))
    args.new_runs = args.new_runs or args.runs
    if args.train_references is None:
        args.train_references = args.quick
    if not args.identity_tolerance > 0:
        p.error(f"argument --identity-tolerance: must be > 0, got {args.identity_tolerance}")
    return args


def main(argv: list[str] | None = None) -> dict[str, Any]:
    args = parse_args(argv)
    start = time.perf_counter()
    new, refs = plan(args.seeds, args.references, args.reference_seeds)
    new_args = argparse.Namespace(**{**vars(args), "runs": args.new_runs})  # where the 2-level runs live
    ready = [s for s in refs if compare.run_state(s, args) == "done"]
    if args.train_references:
        compare.train_all(refs, args)
        ready = refs
    missing = [s for s in refs if s not in ready]
    for spec in missing:
        log.warning("reference run %s is missing or unfinished: left out", spec.directory(args.runs))
    train_start = time.perf_counter()
    compare.train_all(new, new_args)
    trained = time.perf_counter() - train_start
    torch.set_num_threads(os.cpu_count() or 1)
    runs = compare.collect(ready, args, reference_test_metrics) + compare.collect(new, new_args)
    settings = {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()}
    settings["missing_references"] = [str(s.directory(args.runs)) for s in missing]
    checks = claim_check(runs, args.identity_tolerance)
    results = write_report(runs, checks, settings, args.out,
                           seconds={"train_2level": trained, "total": time.perf_counter() - start})
    log.info("report: %s", args.out / "report.md")
    return results
