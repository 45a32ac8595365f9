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
import datetime
import json
import os
import statistics
import sys
import warnings
from pathlib import Path
from typing import Any

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
import numpy as np  # noqa: E402
import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

from eval import bench_train, peers  # noqa: E402
from eval._bench import peak_memory_mib, serve_large_blocks_with_mmap  # noqa: E402
from eval._provenance import code_commit, cpu_model, portable  # noqa: E402
from eval._spread import by_seed, describe  # noqa: E402
from eval.compare.report import _fmt, mean_std  # noqa: E402
from softvq.cli.common import quiet_lightning, run_command  # noqa: E402
from softvq.models.files import write_atomic  # noqa: E402

SIZES = (512, 1024, 4096, 16384)
FULL = (512, 4096)
LABELS = {**peers.LABELS, "vqp_fsq": "vqp FSQ (levels of the FSQ paper)"}
# The study's targets (docs/studies.md, "Large codebooks"): dB over the best peer at 4096, beyond the seed spread.
LEAD_DB = {4096: 0.3}
MIN_UTILIZATION, MIN_PPL_PER_K = 0.99, 0.8
STEP_COST = "step_cost.json"  # --out's measured training step and peak memory (--step-cost), read by the report


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


def codes_of(run: dict[str, Any]) -> int:
    """The code count of a run's layer (FSQ's level set can differ from the size asked for)."""
    if run.get("test"):
        return int(run["test"]["num_codes"])
    k = int(run["settings"]["num_codes"])
    return int(np.prod(peers.fsq_levels(k))) if run["method"] == "vqp_fsq" else k


# a run judged on validation (``--split validation``) has no test figures: the last epoch's validation ones stand in
VALIDATION = {"psnr_hard": "val_psnr_hard", "utilization": "val_utilization", "perplexity": "val_perplexity"}


def metric(run: dict[str, Any], name: str) -> float:
    """One figure of a run: held-out ones by name (the test split's, or for a run that never read it the last
    epoch's validation figures), ``ppl_per_k`` (perplexity over the layer's code count), ``restarts`` per epoch and
    training ``images_per_s``."""
    if name == "ppl_per_k":
        return metric(run, "perplexity") / codes_of(run)
    if name == "restarts":
        return restarts_per_epoch(run)
    if name == "images_per_s":
        return images_per_s(run)
    value = run["test"].get(name) if run.get("test") else run["history"][-1].get(VALIDATION.get(name, name))
    return float("nan") if value is None else float(value)


COLUMNS = (("psnr_hard", "PSNR hard (dB)", "{:.2f}", 1.0), ("utilization", "{split} util %", "{:.1f}", 100.0),
           ("ppl_per_k", "perplexity / K", "{:.2f}", 1.0), ("restarts", "restarts / epoch", "{:.0f}", 1.0),
           ("images_per_s", "train img/s", "{:.0f}", 1.0))


def grouped(runs: list[dict[str, Any]]) -> dict[int, dict[str, list[dict[str, Any]]]]:
    """``{K: {method: runs}}``, K being the size asked for (FSQ's nearest level set has another code count)."""
    out: dict[int, dict[str, list[dict[str, Any]]]] = {}
    for run in runs:
        out.setdefault(run["settings"]["num_codes"], {}).setdefault(run["method"], []).append(run)
    return dict(sorted(out.items()))


def table(groups: dict[int, dict[str, list]], split: str = "test") -> list[str]:
    lines = ["| K (codes) | bottleneck | seeds | " + " | ".join(c[1].format(split=split) for c in COLUMNS) + " |",
             "|---|---|---|" + "---|" * len(COLUMNS)]
    for k, methods in groups.items():
        for method, runs in methods.items():
            codes = codes_of(runs[0])
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


def targets(groups: dict[int, dict[str, list]], split: str = "test") -> list[str]:
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
        lines.append(f"- K = {k}: DDCL's lowest {split} utilization {100 * util:.1f}% (≥ 99%: "
                     f"**{'met' if util >= MIN_UTILIZATION else 'not met'}**), perplexity / K {ppl:.2f} (≥ 0.8: "
                     f"**{'met' if ppl >= MIN_PPL_PER_K else 'not met'}**).")
    return lines


def plot(groups: dict[int, dict[str, list]], path: Path, split: str = "test") -> None:
    fig, axes = plt.subplots(1, 3, figsize=(15, 4))
    methods = sorted({m for per_k in groups.values() for m in per_k}, key=list(LABELS).index)
    for i, method in enumerate(methods):
        for ax, name, scale in zip(axes, ("psnr_hard", "utilization", "ppl_per_k"), (1.0, 100.0, 1.0), strict=True):
            ks = [k for k in groups if method in groups[k]]
            stats = [mean_std(np.array([metric(r, name) for r in groups[k][method]]) * scale) for k in ks]
            ax.errorbar(ks, [float(m) for m, _ in stats], yerr=[float(s) for _, s in stats], marker="o", capsize=3,
                        color=f"C{i}", label=LABELS.get(method, method))
    titles = (f"{split} PSNR from hard indices (dB)", f"{split} utilization %", f"{split} perplexity / K")
    for ax, title in zip(axes, titles, strict=True):
        ax.set_xscale("log", base=2)
        ax.set_xticks(list(groups), [str(k) for k in groups])
        ax.set_xlabel("codebook size K")
        ax.set_title(title, fontsize=10)
        ax.grid(alpha=0.3)
    axes[0].legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def step_cost(args: argparse.Namespace) -> dict[str, Any]:
    """Every K and method asked for (trained or not), its training step timed side by side in one process and its
    peak memory.

    Time: :func:`eval.bench_train.time_steps` (the training benchmark's harness: Lightning fits every model for
    ``--cost-warmup`` + ``--cost-steps`` steps on the same in-memory random batches, one model after the other,
    ``--cost-rounds`` interleaved rounds; the median step, forward to optimizer step, warm-up steps dropped).
    Memory: after all timing, one training forward + backward of each (reconstruction MSE + the bottleneck's loss) on
    a fresh batch, measured by :func:`eval._bench.peak_memory_mib` (on CPU the rise of the resident set's high-water
    mark). The models are the runs' (:func:`eval.peers.vqvae_of` with the runs' settings), freshly initialised."""
    models, settings = {}, {}
    for k in args.num_codes:
        for method in args.methods:
            settings[f"K{k} {method}"] = peers.settings_of(run_args(k, args))
            models[f"K{k} {method}"] = peers.vqvae_of(method, settings[f"K{k} {method}"], args.seeds[0])
    batch_size = args.batch_size
    harness = argparse.Namespace(seed=args.seeds[0], steps=args.cost_steps, warmup=args.cost_warmup,
                                 rounds=args.cost_rounds, accelerator="cpu")
    load_before = os.getloadavg()
    start = datetime.datetime.now(datetime.timezone.utc)
    with quiet_lightning(), warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*does not have many workers.*")
        seconds = bench_train.time_steps(harness, models, batch_size)
    serve_large_blocks_with_mmap()  # after all timing: it slows allocation down
    x = torch.rand(batch_size, 3, 32, 32, generator=torch.Generator().manual_seed(args.seeds[0]))

    def one_step(model: torch.nn.Module) -> None:
        out = model(x)
        (F.mse_loss(out.reconstruction, x) + out.quantizer.loss).backward()
        model.zero_grad(set_to_none=True)

    cost = {}
    for key, model in models.items():
        model.train()
        median = statistics.median(seconds[key])
        cost[key] = {"median_ms": round(median * 1e3, 1), "images_per_s": round(batch_size / median, 2),
                     "steps_ms": [round(t * 1e3, 1) for t in seconds[key]],
                     "peak_mib": round(peak_memory_mib(lambda m=model: one_step(m), torch.device("cpu")), 1)}
        print(f"  {key}: median step {cost[key]['median_ms']:.0f} ms, peak {cost[key]['peak_mib']:.0f} MiB",
              file=sys.stderr)
    return {"what": "median training step (forward, backward, optimizer, metric updates) and the peak extra memory of "
                    "one training forward + backward, per K and method, measured side by side in one process",
            "command": args.command, "code": code_commit(), "torch": torch.__version__, "cpu": cpu_model(),
            "threads": torch.get_num_threads(), "date": start.isoformat(timespec="seconds"),
            "load_before": [round(v, 2) for v in load_before], "batch_size": batch_size,
            "steps": args.cost_steps, "warmup": args.cost_warmup, "rounds": args.cost_rounds, "cost": cost}


def cost_section(cost: dict[str, Any] | None) -> list[str]:
    """The step-cost table (``step_cost.json``), each step's ratio to DDCL's at its K; nothing without the file."""
    if not cost:
        return []
    lines = ["## Training step and memory, measured side by side", "",
             f"`{cost['command']}` at {cost['code']}, torch {cost['torch']}, {cost['cpu']}, {cost['threads']} "
             f"thread(s), batch {cost['batch_size']}, {cost['date']} (load average before: {cost['load_before']}); "
             f"the median of {cost['rounds']} interleaved rounds of {cost['steps']} steps after {cost['warmup']} "
             f"warm-up step(s) per fit, freshly initialised models. Peak: the extra memory of one training forward + "
             f"backward.", "",
             "| K | bottleneck | step (ms) | images/s | step / DDCL's | peak memory (MiB) |",
             "|---|---|---|---|---|---|"]
    for key, c in cost["cost"].items():
        size, method = key.split(" ", 1)
        ours = cost["cost"].get(f"{size} ddcl")
        ratio = f"{c['median_ms'] / ours['median_ms']:.2f}" if ours else "–"
        lines.append(f"| {size[1:]} | {LABELS.get(method, method)} | {c['median_ms']:.0f} | {c['images_per_s']:.1f} | "
                     f"{ratio} | {c['peak_mib']:.0f} |")
    return [*lines, ""]


def write_report(runs: list[dict[str, Any]], settings: dict[str, Any], out: Path) -> dict[str, Any]:
    out.mkdir(parents=True, exist_ok=True)
    groups = grouped(runs)
    split = settings.get("split", "test")
    plot(groups, out / "psnr_vs_k.png", split)
    cost_file = out / STEP_COST
    cost = json.loads(cost_file.read_text()) if cost_file.is_file() else None
    s = settings
    held_out = (f"Figures on the official test split ({s['test_limit'] or 10000} images), read once for this table."
                if split == "test" else
                f"Figures on the validation split ({s['val_size']} held-out training images) after the last epoch; "
                f"the test split was not read.")
    lines = [
        "# DDCL against its peers across codebook sizes", "",
        f"Regenerate: `{s['command']}` (runs are kept in `{s['runs']}`; finished ones are read).", "",
        f"Code: report written at {s.get('code') or code_commit()}; runs trained at "
        f"{', '.join(sorted({r['code'] for r in runs if r.get('code')})) or 'commits their records do not name'}.",
        "",
        f"The peers' setting (`eval/peers/`): width {s['width']}, {s['res_blocks']} residual blocks, D = "
        f"{s['code_dim']}, Adam {s['lr']:g}, batch {s['batch_size']}, {s['train_subset']} training images, "
        f"{s['epochs']} epochs; seeds {s['seeds']} at K in {s['full_k']}, the first seed elsewhere. {held_out} FSQ "
        f"runs at the FSQ paper's nearest level set: its code count is in brackets. Restarts: codes a dead-code "
        f"replacement moved per training epoch (training-epoch utilization counts them, so the table gives "
        f"{split} utilization).",
        "",
        *([f"Not run: {', '.join(s['missing'])}."] if s.get("missing") else []),
        *([f"Each run used {s['threads']} torch thread(s), beside another job on the other core: images/s compare "
           f"within a row of the same K only roughly."] if s.get("threads") else []),
        "", f"## {split.capitalize()} split (mean ± sample std over seeds)", "", *table(groups, split), "",
        "## Targets", "", *targets(groups, split), "",
        *cost_section(cost),
        "![PSNR against K](psnr_vs_k.png)", "",
    ]
    write_atomic(out / "report.md", "\n".join(lines))
    summary = {"settings": settings, "runs": runs, **({"step_cost": cost} if cost else {})}
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
    p.add_argument("--split", choices=("test", "validation"), default="test",
                   help="the split the table reads: the official test split, or the validation split (the last "
                        "epoch's figures; the test split is then never read)")
    p.add_argument("--no-train", action="store_true", help="only read finished runs")
    p.add_argument("--step-cost", action="store_true",
                   help=f"also time every K and method's training step side by side and measure its peak memory "
                        f"(--out/{STEP_COST}, which the report reads; run it on quiet cores)")
    p.add_argument("--cost-steps", type=int, default=3, help="timed steps per fit of --step-cost")
    p.add_argument("--cost-warmup", type=int, default=1, help="untimed steps at the start of every --step-cost fit")
    p.add_argument("--cost-rounds", type=int, default=2, help="interleaved rounds of --step-cost")
    p.add_argument("--no-progress-bar", action="store_true")
    args = p.parse_args(argv)
    for name in ("epochs", "train_subset", "batch_size", "code_dim", "width", "cost_steps", "cost_rounds"):
        if getattr(args, name) < 1:
            p.error(f"--{name.replace('_', '-')} must be positive, got {getattr(args, name)}")
    if args.cost_warmup < 0:
        p.error(f"--cost-warmup must be non-negative, got {args.cost_warmup}")
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
        if args.step_cost:
            args.out.mkdir(parents=True, exist_ok=True)
            write_atomic(args.out / STEP_COST, json.dumps(portable(step_cost(args)), indent=1) + "\n")
    if not runs:
        raise FileNotFoundError(f"no finished run in {args.runs} for these settings, and --no-train forbids training")
    settings = {**peers.settings_of(args), "num_codes": args.num_codes, "seeds": args.seeds, "full_k": args.full_k,
                "runs": str(args.runs), "command": args.command, "missing": missing}
    return write_report(runs, settings, args.out)


def cli(argv: list[str] | None = None) -> int:
    return run_command(main, argv)


if __name__ == "__main__":
    raise SystemExit(cli())
