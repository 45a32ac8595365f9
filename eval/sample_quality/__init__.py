"""Sample quality of each bottleneck's generative model, measured offline: a classifier Fréchet distance and accuracy.

For every point of the rate-distortion study (``eval/rate_distortion/``: the same VQ-VAE and the same prior per
bottleneck), draw samples with one protocol, decode them, and score them with a CIFAR-10 classifier trained here
(``eval/sample_quality/classifier.py``; no Inception weights can be downloaded): the Fréchet distance of its
penultimate features between the samples and real images (torchmetrics' ``FrechetInceptionDistance`` with a custom
feature extractor), with a bootstrap interval, beside the same distance for the VQ-VAE's own reconstructions of those
real images (the floor that the codes set for samples). With ``--conditional``, a class-conditional prior with
classifier-free guidance is trained on each seed-0 point's codes, and its samples' classification accuracy is
reported beside the classifier's accuracy on the reconstructions of real images (the ceiling) and on the real images.

Usage:
    python -m eval.sample_quality --data-root ../shared/data/cifar10-jpeg.tar.gz --rd-runs runs/rate_distortion
    python -m eval.sample_quality --data-root ../shared/data/cifar10-jpeg.tar.gz --long-runs runs/long_run \
        --num-codes 512 --methods ddcl hard_ema vqp_fsq --conditional --soft-targets 0.5 1 --out reports/generative

The protocol (temperature; guidance weight for conditional samples) is chosen on the **validation** split: the
value whose samples have the lowest Fréchet distance to the 5,000 validation images, averaged over every bottleneck,
so no bottleneck gets its own. The test split (a fixed random ``--samples`` of its images, every class in
it; ``eval.sample_quality.classifier.images_of``) is read once, for the final table.

With ``--long-runs`` instead, the points are the VQ-VAEs of ``eval/long_run`` (their kept checkpoints), each given
its priors here at one budget, beside a prior trained on the soft assignments: :mod:`eval.sample_quality.long_runs`.
Its priors are most of its compute, and resume per prior: ``--stage prepare`` trains those of the runs finished so far
(no classifier, no report), ``--stage classifier`` trains the classifier alone, and the full study then reads both
back.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path
from typing import Any

import torch

from eval import harness
from eval import rate_distortion as rd
from eval._provenance import code_commit, portable
from eval._spread import MIN_SEEDS
from eval.sample_quality import classifier as clf
from eval.sample_quality import long_report, long_runs
from eval.sample_quality.classifier import interval_text as _fd
from eval.sample_quality.sampling import draw, fit_conditional_prior, reconstruct
from softvq.cli.common import run_command
from softvq.data.cifar10 import CIFAR10DataModule
from softvq.models import VQVAE
from softvq.models.checkpoint_io import load_torch_file
from softvq.models.files import write_atomic
from softvq.models.prior import CodePrior
from softvq.models.transformer import PriorConfig


def load_point(directory: Path) -> tuple[dict[str, Any], VQVAE, CodePrior, dict[str, torch.Tensor]]:
    """A finished rate-distortion point: its record, VQ-VAE, prior (eval mode) and code grids."""
    result = json.loads((directory / "result.json").read_text())
    s = result["settings"]
    quantizer = rd.build_quantizer(result["method"], s["num_codes"], s["code_dim"], result.get("target_entropy"))
    vqvae = VQVAE(quantizer=quantizer, code_dim=s["code_dim"], width=s["width"], res_blocks=s["res_blocks"],
                  res_hidden=s["res_hidden"], lr=s["lr"])
    vqvae.load_state_dict(load_torch_file(directory / "vqvae.pt", "VQ-VAE state"))
    stored = load_torch_file(directory / "prior.pt", "prior state")
    prior = CodePrior(PriorConfig(**stored["config"]))
    prior.load_state_dict(stored["state_dict"])
    codes = {k: v.long() for k, v in load_torch_file(directory / "codes.pt", "codes").items()}
    return result, vqvae.eval(), prior.eval(), codes


def find_points(rd_runs: Path, num_codes: list[int] | None = None, methods: list[str] | None = None) -> list[Path]:
    """The finished rate-distortion points under ``rd_runs`` (``<method>/K<K>/seed<S>/`` with a ``prior.pt``), sorted;
    only codebook sizes in ``num_codes`` and methods in ``methods`` when given. The target-entropy sweep's points (a
    validation study) are left out."""
    points = sorted(p.parent for p in rd_runs.glob("*/K*/seed*/prior.pt"))
    points = [p for p in points if "_target" not in p.parts[-3]]
    if num_codes is not None:
        points = [p for p in points if p.parts[-2] in {f"K{k}" for k in num_codes}]
    if methods is not None:
        points = [p for p in points if p.parts[-3] in methods]
    if not points:
        sizes = "" if num_codes is None else f" at K in {sorted(num_codes)}"
        sizes += "" if methods is None else f" of methods {methods}"
        raise FileNotFoundError(f"no finished rate-distortion point with a prior under {rd_runs}{sizes}")
    return points


def main(argv: list[str] | None = None) -> dict[str, Any]:
    args = parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    if args.stage == "prepare":
        return long_runs.prepare_all(args)
    data = CIFAR10DataModule(args.data_root, val_size=args.val_size, num_workers=0)
    data.setup()
    settings = clf.study_settings(args.classifier_width, args.classifier_epochs, args.data_root, args.val_size)
    classifier, record, path = clf.load_or_train(data.train_set, data.val_set, data.test_set, settings,
                                                 args.classifier_cache)
    header = {"command": args.command, "commit": code_commit(), "classifier": {
        "file": path.name, "sha256": record["sha256"], "test_accuracy": record["test_accuracy"], "settings": settings}}
    if args.stage == "classifier":
        return {**header, "stage": "classifier", "path": str(path)}
    val_x, val_y = clf.images_of(data.val_set)
    val_f = clf.features_of(classifier, val_x)
    if args.long_runs is not None:
        summary = portable({**header, **long_runs.study(args, data, classifier, val_f)})
        args.out.mkdir(parents=True, exist_ok=True)
        write_atomic(args.out / "results.json", json.dumps(summary, indent=1))
        write_atomic(args.out / "report.md", long_report.report(summary))
        return summary
    test_x, test_y = clf.images_of(data.test_set, args.samples)
    test_f = clf.features_of(classifier, test_x)
    points = find_points(args.rd_runs, args.num_codes, args.methods)
    val_fd: dict[float, list[float]] = {t: [] for t in args.temperatures}
    loaded = []
    for directory in points:
        result, vqvae, prior, codes = load_point(directory)
        loaded.append((directory, result, vqvae, prior, codes))
        for t in args.temperatures:  # validation: the protocol's temperature
            val_fd[t].append(clf.frechet_distance(val_f, clf.features_of(classifier, draw(
                vqvae, prior, args.samples, t, args.seed))))
    temperature = min(args.temperatures, key=lambda t: statistics.fmean(val_fd[t]))
    rows = []
    for directory, result, vqvae, prior, _ in loaded:
        samples = draw(vqvae, prior, args.samples, temperature, args.seed)
        recon = reconstruct(vqvae, test_x)
        rows.append({"point": str(directory.relative_to(args.rd_runs)), "method": result["method"],
                     "num_codes": result["settings"]["num_codes"], "seed": result["seed"],
                     "psnr_hard": result["test"]["psnr_hard"],
                     "bits_per_image": result["prior"]["test"]["bits_per_image"],
                     "samples_fd": clf.bootstrap_frechet(test_f, clf.features_of(classifier, samples)),
                     "reconstruction_fd": clf.bootstrap_frechet(test_f, clf.features_of(classifier, recon)),
                     "reconstruction_accuracy": float((clf.predict(classifier, recon) == test_y).double().mean())})
        print(f"[sample_quality] {rows[-1]['point']}: samples FD {rows[-1]['samples_fd']['value']:.2f}, "
              f"reconstructions FD {rows[-1]['reconstruction_fd']['value']:.2f}", flush=True)
    conditional = conditional_study(loaded, classifier, (val_f, val_y), (test_f, test_x, test_y), data, args) \
        if args.conditional else None
    summary = {**header, "real_test_accuracy": float((clf.predict(classifier, test_x) == test_y).double().mean()),
        "protocol": {"temperature": temperature, "top_k": None, "samples": args.samples, "seed": args.seed,
                     "validation_fd": {str(t): v for t, v in val_fd.items()}}, "rows": rows,
        "conditional": conditional}
    args.out.mkdir(parents=True, exist_ok=True)
    write_atomic(args.out / "results.json", json.dumps(portable(summary), indent=1))
    write_atomic(args.out / "report.md", report(summary))
    return summary


def report(summary: dict[str, Any]) -> str:
    """``report.md``: the protocol, the unconditional table (samples against reconstructions), the conditional one,
    and the targets."""
    proto = summary["protocol"]
    lines = ["# Sample quality at the same prior budget", "", f"Regenerate: `{summary['command']}`", "",
             f"Code: {summary['commit']}.", "", clf.describe(summary["classifier"]), "",
             f"Protocol, one for every bottleneck, chosen on validation images (lowest mean CFD): temperature "
             f"{proto['temperature']:g}, no top-k, {proto['samples']} samples, seed {proto['seed']}; validation CFD "
             "by temperature: " + ", ".join(f"{t}: {sum(v) / len(v):.2f}" for t, v in proto["validation_fd"].items())
             + f". Real test images are classified right {summary['real_test_accuracy']:.3f} of the time.", "",
             "## Unconditional samples (test split)", "",
             "| point | PSNR hard | prior bits / image | samples CFD | reconstructions CFD (the floor) | "
             "reconstructions classified right |", "|---|---|---|---|---|---|"]
    for r in summary["rows"]:
        lines.append(f"| {r['point']} | {r['psnr_hard']:.2f} | {r['bits_per_image']:.1f} | {_fd(r['samples_fd'])} | "
                     f"{_fd(r['reconstruction_fd'])} | {r['reconstruction_accuracy']:.3f} |")
    rows = summary["rows"]
    ddcl = [r for r in rows if r["method"] == "ddcl"]
    for k in sorted({r["num_codes"] for r in ddcl}):
        ours = [r for r in ddcl if r["num_codes"] == k]
        others = [r for r in rows if r["method"] != "ddcl" and r["num_codes"] == k]
        if ours and others:
            worst = max(r["samples_fd"]["high"] for r in ours)
            best_other = min(others, key=lambda r: r["samples_fd"]["value"])
            met = worst < min(r["samples_fd"]["low"] for r in others)
            lines += ["", f"- K = {k}: lowest CFD of every bottleneck, intervals not overlapping: DDCL's highest "
                          f"upper end {worst:.2f} against the others' lowest lower end "
                          f"{min(r['samples_fd']['low'] for r in others):.2f} (best other {best_other['point']}) → "
                          f"**{'met' if met else 'not met'}**."]
            if len(ours) < MIN_SEEDS:  # the intervals are over the draws of one model, not over training seeds
                lines[-1] += (f" The intervals cover the draws, not the seeds: {len(ours)} DDCL seed(s), fewer than "
                              f"the {MIN_SEEDS} a margin needs (`eval._spread.beyond_spread`).")
    cond = summary.get("conditional")
    if cond:
        lines += ["", f"## Guided class-conditional samples (guidance {cond['guidance']:g}, chosen on validation)",
                  "", "| point | classified as their class | CFD | reconstructions classified right | half of it |",
                  "|---|---|---|---|---|"]
        for r in cond["rows"]:
            half = r["samples_accuracy"] >= 0.5 * r["reconstruction_accuracy"]
            lines.append(f"| {r['point']} | {r['samples_accuracy']:.3f} | {_fd(r['samples_fd'])} | "
                         f"{r['reconstruction_accuracy']:.3f} | {'met' if half else 'not met'} |")
    return "\n".join(lines) + "\n"


def conditional_study(loaded: list, classifier: clf.SmallResNet, val: tuple, test: tuple,
                      data: CIFAR10DataModule, args: argparse.Namespace) -> dict[str, Any]:
    """Seed-0 points: a guided conditional prior each; guidance chosen on validation, then the test figures."""
    val_f, _ = val
    test_f, test_x, test_y = test
    train_labels = subset_labels(data.train_set, args.train_subset)
    labels = torch.arange(args.samples) % 10
    priors, val_rows = [], {w: [] for w in args.guidance}
    for directory, result, vqvae, _, codes in loaded:
        if result["seed"] != 0:
            continue
        prior = fit_conditional_prior(codes["train"], train_labels, result["settings"]["prior"], vqvae.num_codes)
        priors.append((directory, result, vqvae, prior))
        for w in args.guidance:
            samples = draw(vqvae, prior, args.samples, 1.0, args.seed, labels, w)
            val_rows[w].append({"fd": clf.frechet_distance(val_f, clf.features_of(classifier, samples)),
                                "accuracy": float((clf.predict(classifier, samples) == labels).double().mean())})
    guidance = min(args.guidance, key=lambda w: statistics.fmean(r["fd"] for r in val_rows[w]))
    rows = []
    for directory, result, vqvae, prior in priors:
        samples = draw(vqvae, prior, args.samples, 1.0, args.seed + 1, labels, guidance)
        rows.append({"point": str(directory.relative_to(args.rd_runs)), "method": result["method"],
                     "num_codes": result["settings"]["num_codes"],
                     "samples_accuracy": float((clf.predict(classifier, samples) == labels).double().mean()),
                     "samples_fd": clf.bootstrap_frechet(test_f, clf.features_of(classifier, samples)),
                     "reconstruction_accuracy": float((clf.predict(classifier, reconstruct(vqvae, test_x))
                                                       == test_y).double().mean())})
    return {"guidance": guidance, "validation": {str(w): v for w, v in val_rows.items()}, "rows": rows}


def subset_labels(subset: torch.utils.data.Subset, n: int) -> torch.Tensor:
    """The labels of the first ``n`` images of a training ``Subset`` (the points' training images: the fixed split
    takes the first ``train_subset`` of one order), from the dataset's ``targets`` without decoding images."""
    targets = getattr(subset.dataset, "targets", None)
    if targets is None:
        return clf.images_of(subset, n)[1]
    return torch.as_tensor([targets[i] for i in subset.indices[:n]], dtype=torch.long)


STAGES = ("all", "classifier", "prepare")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m eval.sample_quality", description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--data-root", type=Path, default=Path("data"), help="CIFAR-10 directory or .tar.gz archive")
    source = p.add_mutually_exclusive_group()
    source.add_argument("--rd-runs", type=Path, default=Path("runs/rate_distortion"),
                        help="eval.rate_distortion's runs")
    source.add_argument("--long-runs", type=Path, default=None,
                        help="instead, eval.long_run's runs (K<K>/<method>/seed<S>/ with checkpoints/last.ckpt)")
    p.add_argument("--num-codes", type=int, nargs="+", default=None,
                   help="score only the points of these codebook sizes (default: every size found)")
    p.add_argument("--methods", nargs="+", choices=harness.METHODS, default=None,
                   help="score only the points of these methods (default: every method found)")
    p.add_argument("--samples", type=int, default=5000, help="samples per point, and real test images")
    p.add_argument("--temperatures", type=float, nargs="+", default=[0.9, 1.0], help="chosen among on validation")
    p.add_argument("--guidance", type=float, nargs="+", default=[1.0, 2.0, 3.0], help="chosen among on validation")
    p.add_argument("--conditional", action="store_true", help="also the guided class-conditional study")
    p.add_argument("--train-subset", type=int, default=10_000,
                   help="the training images the --rd-runs points' codes cover")
    p.add_argument("--val-size", type=int, default=5000, help="the validation hold-out (the points' split)")
    p.add_argument("--seed", type=int, default=0, help="seed of the draws")
    p.add_argument("--classifier-width", type=int, default=32)
    p.add_argument("--classifier-epochs", type=int, default=8)
    p.add_argument("--classifier-cache", type=Path, default=Path("runs/classifier"))
    p.add_argument("--threads", type=int, default=None)
    p.add_argument("--stage", choices=STAGES, default="all",
                   help="all: the study; classifier: train (or read) the cached classifier and stop; prepare "
                        "(--long-runs): derive each finished run's codes and priors into --work and stop, without the "
                        "classifier, so that a long study's priors train beside runs still in flight")
    p.add_argument("--out", type=Path, default=None,
                   help="report.md and results.json (default: reports/sample_quality; with --long-runs "
                        "reports/generative)")
    long = p.add_argument_group("--long-runs only", "the priors trained here, one budget for every point")
    long.add_argument("--work", type=Path, default=Path("runs/sample_quality_long"),
                      help="what is derived from each run (codes, priors), read back on a rerun")
    rd.add_prior_arguments(long)
    long.add_argument("--soft-targets", type=float, nargs="+", default=[], metavar="A",
                      help="DDCL points: also a prior per A in (0, 1] trained on the soft assignments "
                           "(CodePrior(soft_targets=A)); one A chosen on validation")
    long.add_argument("--soft-top-k", type=int, default=16, help="assignments kept per token for the soft targets")
    args = p.parse_args(argv)
    args.out = args.out or Path("reports/generative" if args.long_runs is not None else "reports/sample_quality")
    only_long = [name for name in ("work", "prior_layers", "prior_dim", "prior_epochs", "prior_seed", "soft_targets",
                                   "soft_top_k") if getattr(args, name) != p.get_default(name)]
    if args.long_runs is None and only_long:
        p.error(f"{', '.join('--' + d.replace('_', '-') for d in only_long)} apply to --long-runs only")
    if args.stage == "prepare" and args.long_runs is None:
        p.error("--stage prepare derives the priors of --long-runs; it needs --long-runs")
    if args.long_runs is not None and args.train_subset != p.get_default("train_subset"):
        p.error("--train-subset applies to --rd-runs only (a long run's codes cover its own training images)")
    for name in ("prior_layers", "prior_dim", "prior_epochs", "soft_top_k"):
        if getattr(args, name) < 1:
            p.error(f"--{name.replace('_', '-')} must be positive, got {getattr(args, name)}")
    if args.prior_dim % 4:
        p.error(f"--prior-dim must be a multiple of the prior's 4 heads, got {args.prior_dim}")
    for a in args.soft_targets:
        if not 0 < a <= 1:
            p.error(f"--soft-targets must lie in (0, 1], got {a}")
    if len(set(args.soft_targets)) != len(args.soft_targets):
        p.error(f"--soft-targets repeats a value: {args.soft_targets}")
    if args.samples < 2 or args.classifier_width < 1 or args.classifier_epochs < 1:
        p.error("--samples must be >= 2 and --classifier-width / --classifier-epochs positive")
    for t in args.temperatures:
        if not t > 0:
            p.error(f"--temperatures must be positive, got {t}")
    for w in args.guidance:
        if not w >= 0:
            p.error(f"--guidance must be non-negative, got {w}")
    args.command = "python -m eval.sample_quality " + " ".join(argv if argv is not None else sys.argv[1:])
    return args


def cli(argv: list[str] | None = None) -> int:
    return run_command(main, argv)
