"""Should DDCL's default be its top-k truncation at K = 16384? The finished runs of ``eval/topk_default/train.py`` (DDCL
exact and its top-k truncations at K = 16384), judged on the validation split, with the truncation's error measured
on each trained VQ-VAE.

    python -m eval.topk_default.evaluate --runs ../runs/topk_default \
        --data-root ../shared/data/cifar10-jpeg.tar.gz --out reports/topk_default

From each run's record (``result.json``: the history that ``eval.peers``' callbacks write, per epoch): validation PSNR
(the decode of the hard indices, and the soft output), training images/s, validation utilization and perplexity / K,
the training-epoch assignment entropy (under top-k, of the truncated distribution) and the temperature at the end.

On each kept checkpoint (``vqvae.pt``), with ``eval/topk_bound.py``'s :func:`truncation_errors`: the validation
tokens of ``--images`` images (64 tokens each) standardised as the layer sees them, and at the layer's trained
temperature, in float64, the Boltzmann mass outside each token's k nearest prototypes and the relative error of the
encoder gradient of the top-k soft centroid against the exact one (one random upstream gradient per token), per k.

Equal compute: each run's cumulative training seconds after epoch e is the sum over epochs <= e of
(training images / its recorded images/s); PSNR is compared at the same cumulative seconds by linear interpolation
between epochs (no extrapolation beyond a run's last epoch). The same with the training loop's recorded CPU seconds
(``train_cpu_s``), which pauses of the shared machine do not inflate (contention still does), and with the steps
taken times the per-step CPU cost that ``step_cost.py`` timed for every method in one process, interleaved
(``--step-cost``, when that file exists): the cleanest of the three clocks.
"""

from __future__ import annotations

import argparse
import json
import math
from pathlib import Path
from typing import Any

import numpy as np
import torch

from eval import peers
from eval.topk_bound import GRADIENT_BOUND, MASS_BOUND, truncation_errors
from softvq.models.files import write_atomic

ORDER = ("ddcl", "ddcl_top256", "ddcl_top128")
KS = (64, 128, 256, 512, 1024)


def load_runs(root: Path) -> list[dict[str, Any]]:
    runs = []
    for path in sorted(root.glob("K*/*/seed*/result.json")):
        run = json.loads(path.read_text())
        run["dir"] = str(path.parent)
        runs.append(run)
    return sorted(runs, key=lambda r: (r["settings"]["num_codes"], ORDER.index(r["method"])
                                       if r["method"] in ORDER else 99, r["seed"]))


def cumulative_seconds(run: dict[str, Any]) -> list[float]:
    """Training seconds after each epoch from the recorded wall-clock images/s."""
    n = run["settings"]["train_subset"]
    return [float(v) for v in np.cumsum([n / row["train_images_per_s"] for row in run["history"]])]


def cumulative_cpu(run: dict[str, Any]) -> list[float] | None:
    """Training-loop CPU seconds after each epoch (``None`` where a run did not record them)."""
    cpu = [row.get("train_cpu_s") for row in run["history"]]
    return None if any(v is None for v in cpu) else [float(v) for v in np.cumsum(cpu)]


def cumulative_cost(run: dict[str, Any], cost: dict[str, float] | None) -> list[float] | None:
    """Steps taken after each epoch times the method's interleaved per-step CPU cost (``None`` without one)."""
    if not cost or run["method"] not in cost:
        return None
    return [row["step"] * cost[run["method"]] for row in run["history"]]


def per_run(run: dict[str, Any], cost: dict[str, float] | None = None) -> dict[str, Any]:
    h = run["history"]
    k = run["settings"]["num_codes"]
    last = h[-1]
    return {
        "method": run["method"], "label": peers.LABELS.get(run["method"], run["method"]), "seed": run["seed"],
        "num_codes": k, "top_k": run.get("top_k"), "target_entropy": run.get("target_entropy"),
        "epochs": len(h),
        "val_psnr_hard": [row.get("val_psnr_hard") for row in h],
        "val_psnr_soft": [row.get("val_psnr") for row in h],
        "final_val_psnr_hard": last.get("val_psnr_hard"),
        "train_images_per_s": [row.get("train_images_per_s") for row in h],
        "mean_train_images_per_s": float(np.mean([row["train_images_per_s"] for row in h])),
        "cumulative_train_s": cumulative_seconds(run),
        "train_cpu_s": [row.get("train_cpu_s") for row in h],
        "cumulative_cpu_s": cumulative_cpu(run),
        "step_cost_s": None if not cost else cost.get(run["method"]),
        "cumulative_cost_s": cumulative_cost(run, cost),
        "val_utilization": last.get("val_utilization"),
        "val_perplexity_per_k": None if last.get("val_perplexity") is None else last["val_perplexity"] / k,
        "train_utilization": last.get("utilization"),
        "train_perplexity_per_k": last["perplexity"] / k,
        "temperature": [row.get("temperature") for row in h],
        "assignment_entropy": [row.get("assignment_entropy") for row in h],
        "wall_s": run.get("wall_s"), "code": run.get("code"),
    }


@torch.no_grad()
def truncation(run: dict[str, Any], data_root: Path, images: int) -> dict[str, Any] | None:
    """The mass left out and the gradient error of top-k at the trained T, on ``images`` validation images."""
    path = Path(run["dir"]) / "vqvae.pt"
    if not path.is_file():
        return None
    vqvae = peers.load_trained(run, path)
    x = peers.validation_images(data_root, run["settings"], images)  # the test split is not read
    layer = vqvae.quantizer
    z = layer.standardizer.standardize(vqvae.latents(x).movedim(1, -1).reshape(-1, layer.dim))
    t = float(layer.temperature)
    found = truncation_errors(z, layer.codebook, t, KS)
    return {"temperature": t, "tokens": int(z.shape[0]), "exact_entropy": found["entropy"],
            "by_k": {str(k): v for k, v in found["by_k"].items()}}


def at_seconds(run: dict[str, Any], seconds: float, clock: str = "cumulative_train_s") -> float | None:
    """Validation hard PSNR at ``seconds`` of training on ``clock``, interpolated between epochs (None outside)."""
    xs, ys = run[clock], run["val_psnr_hard"]
    if xs is None or seconds > xs[-1] + 1e-9 or seconds < xs[0] - 1e-9:
        return None
    return float(np.interp(seconds, xs, ys))


CLOCKS = (("cumulative_train_s", "cumulative training seconds from each run's recorded wall-clock images/s"),
          ("cumulative_cpu_s", "cumulative training-loop CPU seconds (recorded per epoch; pauses not counted)"),
          ("cumulative_cost_s", "training steps x the interleaved per-step CPU cost of step_cost.py"))


def budgets_of(rows: list[dict[str, Any]], clock: str) -> list[float]:
    return sorted({r[clock][-1] for r in rows if r[clock] is not None})


def code_line(rows: list[dict[str, Any]]) -> str:
    """The commits the runs were trained at (``+``: the working tree was dirty; its changed files listed)."""
    by: dict[tuple[str, bool, tuple[str, ...]], list[str]] = {}
    for r in rows:
        c = r.get("code") or {"commit": "unknown", "dirty": False, "dirty_files": []}
        files = tuple(f.split()[-1] for f in c["dirty_files"])
        by.setdefault((c["commit"], c["dirty"], files), []).append(r["method"])
    parts = [f"{commit}{'+' if dirty else ''} ({', '.join(methods)}"
             + (f"; uncommitted at launch: {', '.join(files)}" if dirty else "") + ")"
             for (commit, dirty, files), methods in by.items()]
    return "runs trained at " + "; ".join(parts) + " (`+`: working tree dirty; `git rev-parse --short HEAD` at launch)."


def fmt(v: Any, spec: str) -> str:
    return "–" if v is None or (isinstance(v, float) and math.isnan(v)) else format(v, spec)


def write(rows: list[dict[str, Any]], args: argparse.Namespace, notes: str, cost: dict[str, Any] | None) -> None:
    lines = [
        "# Top-k DDCL as the default at K = 16384?", "",
        "Regenerate:", "",
        f"    python -m eval.topk_default.evaluate --runs {args.runs} --data-root {args.data_root} "
        f"--out {args.out}", "",
        f"(it reads the runs kept in `{args.runs}`; they were trained, in this order, one after the other, by", "",
        "    OMP_NUM_THREADS=1 python -m eval.topk_default.train --threads 1 --num-codes 16384 --seeds 0 \\",
        "        --data-root ../shared/data/cifar10-jpeg.tar.gz --methods ddcl_top256 \\",
        "        --runs ../runs/topk_default --no-progress-bar",
        "",
        "and the same with `--methods ddcl`, then `--methods ddcl_top128`; the per-step costs by",
        "`OMP_NUM_THREADS=1 python -m eval.topk_default.step_cost`).", "",
        "Code: " + code_line(rows), "",
        "Setting: the peers' short setting (`eval/peers`: width 128, 2 residual blocks, D = 64, Adam 3e-4, batch "
        "128, 10,000 training images, 5 epochs), K = 16384, seed 0, one torch thread on a 2-core machine shared "
        "with another engineer's benchmarks and tests (processes paused now and then): images/s are as recorded "
        "and noisy. Figures on the **validation** split (5,000 held-out training images); the test split was not "
        "read.", "",
        "## Runs", "",
        "| method | epochs | val PSNR hard per epoch (dB) | final val PSNR hard | final val PSNR soft | train img/s "
        "per epoch (mean) | cumulative train s (wall / CPU) | val util % | val ppl / K | train util % | "
        "train ppl / K | T end | H train end (nats) | target H |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        lines.append(
            f"| {r['method']} | {r['epochs']} | {' / '.join(fmt(v, '.2f') for v in r['val_psnr_hard'])} | "
            f"{fmt(r['final_val_psnr_hard'], '.2f')} | {fmt(r['val_psnr_soft'][-1], '.2f')} | "
            f"{' / '.join(fmt(v, '.1f') for v in r['train_images_per_s'])} ({r['mean_train_images_per_s']:.1f}) | "
            f"{r['cumulative_train_s'][-1]:.0f} / {fmt(r['cumulative_cpu_s'] and r['cumulative_cpu_s'][-1], '.0f')} | "
            f"{fmt(100 * r['val_utilization'], '.1f')} | "
            f"{fmt(r['val_perplexity_per_k'], '.3f')} | {fmt(100 * r['train_utilization'], '.1f')} | "
            f"{r['train_perplexity_per_k']:.3f} | {fmt(r['temperature'][-1], '.4g')} | "
            f"{fmt(r['assignment_entropy'][-1], '.3f')} | {fmt(r['target_entropy'], '.3f')} |")
    lines += ["", "Temperature and training assignment entropy per epoch:", ""]
    for r in rows:
        lines.append(f"- {r['method']}: T {', '.join(fmt(v, '.4g') for v in r['temperature'])}; "
                     f"H {', '.join(fmt(v, '.3f') for v in r['assignment_entropy'])}")
    lines += ["", "## Truncation error on the trained VQ-VAEs", "",
              f"`eval/topk_bound.py`'s `truncation_errors`, float64, at each run's trained T, on the validation tokens "
              f"of {args.images} images ({args.images * 64} tokens); H exact: the entropy of the untruncated "
              f"Boltzmann distribution at that T. Bound of `eval/topk_bound.py`: mean mass <= {MASS_BOUND:g}, "
              f"mean gradient error <= {GRADIENT_BOUND:g}.", "",
              "| checkpoint | T | H exact (nats) | k | mass left out: mean / p99 | gradient error: mean / p99 |",
              "|---|---|---|---|---|---|"]
    for r in rows:
        tr = r.get("truncation")
        if tr is None:
            lines.append(f"| {r['method']} | – | – | – | no checkpoint | – |")
            continue
        for k, e in tr["by_k"].items():
            lines.append(f"| {r['method']} | {tr['temperature']:.4g} | {tr['exact_entropy']:.3f} | {k} | "
                         f"{e['mass_mean']:.1e} / {e['mass_p99']:.1e} | {e['gradient_error_mean']:.1e} / "
                         f"{e['gradient_error_p99']:.1e} |")
    lines += ["", "## Equal compute", ""]
    if cost:
        lines += ["Per-step cost of a training step of this VQ-VAE (`step_cost.py`: one process, one thread, "
                  f"{cost['settings']['rounds']} interleaved rounds of {cost['settings']['steps']} steps, median; "
                  "batch 128, K = 16384):", "",
                  "| method | CPU s / step | wall s / step | rounds (CPU s / step) |", "|---|---|---|---|"]
        for m, v in cost["cpu_s_per_step"].items():
            lines.append(f"| {m} | {v:.3f} | {cost['wall_s_per_step'][m]:.3f} | "
                         f"{', '.join(f'{c:.3f}' for c in cost['cpu_rounds'][m])} |")
        lines.append("")
    for clock, what in CLOCKS:
        budgets = budgets_of(rows, clock)
        if not budgets:
            continue
        lines += [f"Validation hard PSNR at the same {what} (linear between epochs, – outside a run's epochs); the "
                  "columns are the runs' totals:", "",
                  "| method | " + " | ".join(f"{b:.0f} s" for b in budgets) + " |", "|---|" + "---|" * len(budgets)]
        for r in rows:
            lines.append(f"| {r['method']} | " + " | ".join(fmt(at_seconds(r, b, clock), ".2f") for b in budgets)
                         + " |")
        lines.append("")
    lines += ["", "![validation PSNR against training seconds](psnr_vs_seconds.png)", ""]
    if notes:
        lines += ["## Reading", "", notes.strip(), ""]
    write_atomic(args.out / "report.md", "\n".join(lines))


def plot(rows: list[dict[str, Any]], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, len(CLOCKS), figsize=(16, 4))
    for ax, (clock, what) in zip(axes, CLOCKS, strict=True):
        for r in rows:
            if r[clock] is not None:
                ax.plot(r[clock], r["val_psnr_hard"], marker="o", label=r["method"])
        ax.set_xlabel(what.replace(" (", "\n("), fontsize=8)
        ax.set_ylabel("validation PSNR, hard indices (dB)")
        ax.set_title("K = 16384, seed 0, peers' short setting", fontsize=10)
        ax.grid(alpha=0.3)
        ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main(argv: list[str] | None = None) -> dict[str, Any]:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--runs", type=Path, default=Path("../runs/topk_default"))
    p.add_argument("--data-root", type=Path, required=True)
    p.add_argument("--images", type=int, default=64)
    p.add_argument("--out", type=Path, default=Path("reports/topk_default"))
    p.add_argument("--step-cost", type=Path, default=Path("reports/topk_default/step_cost.json"))
    p.add_argument("--notes", type=Path, default=Path("reports/topk_default/reading.txt"))
    args = p.parse_args(argv)
    torch.set_num_threads(1)
    runs = load_runs(args.runs)
    if not runs:
        raise SystemExit(f"no finished run under {args.runs}")
    cost = json.loads(args.step_cost.read_text()) if args.step_cost.is_file() else None
    rows = []
    for run in runs:
        row = per_run(run, cost and cost["cpu_s_per_step"])
        row["truncation"] = truncation(run, args.data_root, args.images)
        rows.append(row)
    args.out.mkdir(parents=True, exist_ok=True)
    plot(rows, args.out / "psnr_vs_seconds.png")
    summary = {"runs_dir": str(args.runs), "images": args.images, "ks": list(KS), "step_cost": cost,
               "bound": {"mass": MASS_BOUND, "gradient": GRADIENT_BOUND}, "runs": rows,
               "equal_compute": {clock: {f"{b:.1f}": {r["method"]: at_seconds(r, b, clock) for r in rows}
                                         for b in budgets_of(rows, clock)} for clock, _ in CLOCKS}}
    write_atomic(args.out / "results.json", json.dumps(summary, indent=1))
    write(rows, args, args.notes.read_text() if args.notes.is_file() else "", cost)
    return summary


if __name__ == "__main__":
    main()
