"""DDCL against its peers across codebook sizes: the peers' study (:mod:`eval.peers`) at several K, one table and
one plot of hard-index PSNR against K per method.

Large codebooks are where hard VQ is published to fail (plain hard VQ uses 3% of K = 16384 and its PSNR stops rising
with K), so they are where a collapse-free codebook should lead. Usage (the full setting; each run is the peers'
setting, 5 epochs on 10,000 images):

    pip install -e ".[bench]"   # vector-quantize-pytorch, a benchmark-only extra
    python -m eval.peers_sweep --data-root ../shared/data/cifar10-jpeg.tar.gz
    python -m eval.peers_sweep --num-codes 512 4096 --methods ddcl hard_ema ...   # a part (finished runs are read)

Seeds: every ``--seeds`` at the sizes in ``--full-k`` (512 and 4096 by default), the first seed elsewhere (1024
and 16384: vector-quantize-pytorch's ``VectorQuantize`` takes seconds a step at 16384). FSQ has no level set of
exactly every size: it runs at the FSQ paper's nearest one (:func:`eval.peers.fsq_levels`), whose code count the
table gives in brackets. Runs live in ``--runs/K<K>/<method>/seed<S>/`` (those of :mod:`eval.peers`); the report
(``--out``) has, per K and method, the test split's hard-index PSNR, utilization, perplexity / K, the codes restarted
per training epoch and training images/s, DDCL's margin over the best peer under the reports' one seed-spread rule
(:mod:`eval._spread`), the study's targets checked, and ``psnr_vs_k.png``.
"""

from __future__ import annotations

import argparse
import copy
import json
import sys
from pathlib import Path
from typing import Any

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
import numpy as np  # noqa: E402

from eval import peers  # noqa: E402
from eval._provenance import code_commit, portable  # noqa: E402
from eval._spread import by_seed, describe  # noqa: E402
from eval.compare.report import _fmt, mean_std  # noqa: E402
from softvq.cli.common import run_command  # noqa: E402
from softvq.models.files import write_atomic  # noqa: E402

SIZES = (512, 1024, 4096, 16384)
FULL = (512, 4096)
LABELS = {**peers.LABELS, "vqp_fsq": "vqp FSQ (levels of the FSQ paper)"}
# The study's targets (docs/studies.md, "Large codebooks"): dB over the best peer at 4096, beyond the seed spread.
LEAD_DB = {4096: 0.3}
MIN_UTILIZATION, MIN_PPL_PER_K = 0.99, 0.8


def seeds_at(k: int, args: argparse.Namespace) -> list[int]:
    return list(args.seeds) if k in args.full_k else list(args.seeds[:1])


def run_args(k: int, args: argparse.Namespace) -> argparse.Namespace:
    """The peers' arguments of one codebook size: ``num_codes = k``, runs under ``--runs/K<k>``."""
    one = copy.copy(args)
    one.num_codes, one.runs = k, args.runs / f"K{k}"
    return one


def restarts_per_epoch(run: dict[str, Any]) -> float:
    """Codes a dead-code restart moved, per training epoch (the history's per-epoch counts, averaged)."""
    counts = [row["restarts"] for row in run["history"] if row.get("restarts") is not None]
    return float(np.mean(counts)) if counts else float("nan")


def images_per_s(run: dict[str, Any]) -> float:
    speeds = [row["train_images_per_s"] for row in run["history"] if row.get("train_images_per_s")]
    return float(np.mean(speeds)) if speeds else float("nan")


def metric(run: dict[str, Any], name: str) -> float:
    """One figure of a run: test-split ones by name, ``ppl_per_k`` (perplexity over the layer's code count),
    ``restarts`` per epoch and training ``images_per_s``."""
    if name == "ppl_per_k":
        return run["test"]["perplexity"] / run["test"]["num_codes"]
    if name == "restarts":
        return restarts_per_epoch(run)
    if name == "images_per_s":
        return images_per_s(run)
    value = run["test"].get(name)
    return float("nan") if value is None else float(value)


COLUMNS = (("psnr_hard", "PSNR hard (dB)", "{:.2f}", 1.0), ("utilization", "test util %", "{:.1f}", 100.0),
           ("ppl_per_k", "perplexity / K", "{:.2f}", 1.0), ("restarts", "restarts / epoch", "{:.0f}", 1.0),
           ("images_per_s", "train img/s", "{:.0f}", 1.0))


def grouped(runs: list[dict[str, Any]]) -> dict[int, dict[str, list[dict[str, Any]]]]:
    """``{K: {method: runs}}``, K being the size asked for (FSQ's nearest level set has another code count)."""
    out: dict[int, dict[str, list[dict[str, Any]]]] = {}
    for run in runs:
        out.setdefault(run["settings"]["num_codes"], {}).setdefault(run["method"], []).append(run)
    return dict(sorted(out.items()))


def table(groups: dict[int, dict[str, list]]) -> list[str]:
    lines = ["| K (codes) | bottleneck | seeds | " + " | ".join(c[1] for c in COLUMNS) + " |",
             "|---|---|---|" + "---|" * len(COLUMNS)]
    for k, methods in groups.items():
        for method, runs in methods.items():
            codes = runs[0]["test"]["num_codes"]
            cells = []
            for name, _, fmt, scale in COLUMNS:
                mean, std = mean_std(np.array([metric(r, name) for r in runs]) * scale)
                cells.append(_fmt(float(mean), float(std), fmt, len(runs)))
            lines.append(f"| {k} ({codes}) | {LABELS.get(method, method)} | {len(runs)} | " + " | ".join(cells) + " |")
    return lines


def lead(methods: dict[str, list], ours: str = "ddcl") -> dict[str, Any] | None:
    """DDCL's hard-PSNR margin over the best peer at one K (best by mean), paired by seed."""
    if ours not in methods or len(methods) < 2:
        return None
    means = {m: float(np.mean([metric(r, "psnr_hard") for r in runs])) for m, runs in methods.items()}
    best = max((m for m in means if m != ours), key=means.__getitem__)
    judged = by_seed({r["seed"]: metric(r, "psnr_hard") for r in methods[ours]},
                     {r["seed"]: metric(r, "psnr_hard") for r in methods[best]})
    return {"best": best, "ours": means[ours], "peer": means[best], "judged": judged}


def targets(groups: dict[int, dict[str, list]]) -> list[str]:
    """The targets checked on the measured numbers: DDCL >= the best peer + 0.3 dB beyond the spread at 4096, ahead
    of every peer at the largest K, at the smallest not below the best peer by more than the spread; test
    utilization >= 99% and perplexity / K >= 0.8 at every K."""
    lines = []
    sizes = list(groups)
    for k, methods in groups.items():
        found = lead(methods)
        if found is None:
            continue
        j, diff = found["judged"], found["ours"] - found["peer"]
        head = (f"- K = {k}: DDCL {found['ours']:.2f} dB against the best peer, {LABELS.get(found['best'])}, "
                f"{found['peer']:.2f} ({diff:+.2f} dB; {describe(j)})")
        if k in LEAD_DB:
            ok = diff >= LEAD_DB[k] and j["counts"] and j["margin"] > 0
            lines.append(f"{head}: ≥ +{LEAD_DB[k]} dB beyond the spread → **{'met' if ok else 'not met'}**.")
        elif k == sizes[-1] and k != sizes[0]:
            lines.append(f"{head}: ahead of every peer → **{'met' if diff > 0 else 'not met'}**"
                         f"{' (one seed: no margin claim)' if len(j['seeds']) < 3 else ''}.")
        elif k == sizes[0]:
            ok = diff >= 0 or (len(j["seeds"]) >= 3 and -diff <= j["spread"])
            lines.append(f"{head}: not below the best peer by more than the seed spread → "
                         f"**{'met' if ok else 'not met'}**.")
        else:
            lines.append(f"{head}.")
    for k, methods in groups.items():
        if "ddcl" not in methods:
            continue
        util = min(metric(r, "utilization") for r in methods["ddcl"])
        ppl = min(metric(r, "ppl_per_k") for r in methods["ddcl"])
        lines.append(f"- K = {k}: DDCL's lowest test utilization {100 * util:.1f}% (≥ 99%: "
                     f"**{'met' if util >= MIN_UTILIZATION else 'not met'}**), perplexity / K {ppl:.2f} (≥ 0.8: "
                     f"**{'met' if ppl >= MIN_PPL_PER_K else 'not met'}**).")
    return lines


def plot(groups: dict[int, dict[str, list]], path: Path) -> None:
    fig, axes = plt.subplots(1, 3, figsize=(15, 4))
    methods = sorted({m for per_k in groups.values() for m in per_k}, key=list(LABELS).index)
    for i, method in enumerate(methods):
        for ax, name, scale in zip(axes, ("psnr_hard", "utilization", "ppl_per_k"), (1.0, 100.0, 1.0), strict=True):
            ks = [k for k in groups if method in groups[k]]
            stats = [mean_std(np.array([metric(r, name) for r in groups[k][method]]) * scale) for k in ks]
            ax.errorbar(ks, [float(m) for m, _ in stats], yerr=[float(s) for _, s in stats], marker="o", capsize=3,
                        color=f"C{i}", label=LABELS.get(method, method))
    for ax, title in zip(axes, ("test PSNR from hard indices (dB)", "test utilization %", "test perplexity / K"),
                         strict=True):
        ax.set_xscale("log", base=2)
        ax.set_xticks(list(groups), [str(k) for k in groups])
        ax.set_xlabel("codebook size K")
        ax.set_title(title, fontsize=10)
        ax.grid(alpha=0.3)
    axes[0].legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def write_report(runs: list[dict[str, Any]], settings: dict[str, Any], out: Path) -> dict[str, Any]:
    out.mkdir(parents=True, exist_ok=True)
    groups = grouped(runs)
    plot(groups, out / "psnr_vs_k.png")
    s = settings
    lines = [
        "# DDCL against its peers across codebook sizes", "",
        f"Regenerate: `{s['command']}` (runs are kept in `{s['runs']}`; finished ones are read).", "",
        f"Code: {s.get('code') or code_commit()}", "",
        f"The peers' setting (`eval/peers/`): width {s['width']}, {s['res_blocks']} residual blocks, D = "
        f"{s['code_dim']}, Adam {s['lr']:g}, batch {s['batch_size']}, {s['train_subset']} training images, "
        f"{s['epochs']} epochs; seeds {s['seeds']} at K in {s['full_k']}, the first seed elsewhere. Figures on the "
        f"official test split ({s['test_limit'] or 10000} images), read once for this table. FSQ runs at the FSQ "
        f"paper's nearest level set: its code count is in brackets. Restarts: codes a dead-code replacement moved "
        f"per training epoch (training-epoch utilization counts them, so the table gives test utilization).",
        "",
        *([f"Not run: {', '.join(s['missing'])}."] if s.get("missing") else []),
        *([f"Each run used {s['threads']} torch thread(s), beside another job on the other core: images/s compare "
           f"within a row of the same K only roughly."] if s.get("threads") else []),
        "", "## Test split (mean ± sample std over seeds)", "", *table(groups), "",
        "## Targets", "", *targets(groups), "",
        "![PSNR against K](psnr_vs_k.png)", "",
    ]
    write_atomic(out / "report.md", "\n".join(lines))
    summary = {"settings": settings, "runs": runs}
    write_atomic(out / "results.json", json.dumps(portable(summary), indent=1, default=float))
    return summary


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m eval.peers_sweep", description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--data-root", type=Path, default=Path("data"), help="CIFAR-10 directory or .tar.gz archive")
    p.add_argument("--methods", nargs="+", choices=peers.METHODS, default=["ddcl", "hard_ema", "vqp_vq", "vqp_fsq"])
    p.add_argument("--num-codes", type=int, nargs="+", default=list(SIZES), help="the codebook sizes")
    p.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    p.add_argument("--full-k", type=int, nargs="*", default=list(FULL), help="sizes that get every seed")
    peers.add_vqvae_arguments(p)
    p.add_argument("--runs", type=Path, default=Path("runs/peers_sweep"))
    p.add_argument("--out", type=Path, default=Path("reports/peers_sweep"))
    p.add_argument("--no-train", action="store_true", help="only read finished runs")
    p.add_argument("--no-progress-bar", action="store_true")
    args = p.parse_args(argv)
    for name in ("epochs", "train_subset", "batch_size", "code_dim", "width"):
        if getattr(args, name) < 1:
            p.error(f"--{name.replace('_', '-')} must be positive, got {getattr(args, name)}")
    if any(k < 2 for k in args.num_codes) or len(set(args.num_codes)) != len(args.num_codes):
        p.error(f"--num-codes needs distinct sizes >= 2, got {args.num_codes}")
    if len(set(args.seeds)) != len(args.seeds):
        p.error(f"--seeds repeats a seed: {args.seeds}")
    if "vqp_fsq" in args.methods:
        for k in args.num_codes:
            try:
                peers.fsq_levels(k)
            except ValueError as err:
                p.error(str(err))
    args.num_codes = sorted(args.num_codes)
    args.command = "python -m eval.peers_sweep " + " ".join(argv if argv is not None else sys.argv[1:])
    return args


def main(argv: list[str] | None = None) -> dict[str, Any]:
    args = parse_args(argv)
    runs, missing = [], []
    with peers.study_run(args.threads):
        for k in args.num_codes:  # size-major, seed-major: an interrupted sweep has every method at the first sizes
            one = run_args(k, args)
            for seed in seeds_at(k, args):
                for method in args.methods:
                    run = peers.load_or_train(method, seed, one)
                    (runs.append(run) if run is not None else missing.append(f"{method} K={k} seed {seed}"))
    if not runs:
        raise FileNotFoundError(f"no finished run in {args.runs} for these settings, and --no-train forbids training")
    settings = {**peers.settings_of(args), "num_codes": args.num_codes, "seeds": args.seeds, "full_k": args.full_k,
                "runs": str(args.runs), "command": args.command, "missing": missing}
    return write_report(runs, settings, args.out)


def cli(argv: list[str] | None = None) -> int:
    return run_command(main, argv)


if __name__ == "__main__":
    raise SystemExit(cli())
