"""The report of :mod:`eval.compare`: per-epoch curves with seed bands, usage histograms, tables, results.json."""

from __future__ import annotations

import json
import math
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

import matplotlib

matplotlib.use("Agg")  # files only; no display needed
import matplotlib.pyplot as plt  # noqa: E402
import numpy as np  # noqa: E402

from eval._provenance import code_commit, portable
from eval._spread import by_seed, describe
from softvq.models.files import write_atomic  # noqa: E402

PLOTS = ("health.png", "ddcl_terms.png", "usage.png", "eps.png", "temperature.png")  # the last two with their runs
TEST_COLUMNS = (("mse", "MSE soft", "{:.5f}"), ("mse_hard", "MSE hard", "{:.5f}"), ("psnr", "PSNR soft", "{:.2f}"),
                ("psnr_hard", "PSNR hard", "{:.2f}"),
                ("ssim", "SSIM soft", "{:.3f}"), ("ssim_hard", "SSIM hard", "{:.3f}"),
                ("utilization", "util %", "{:.1f}"), ("dead_codes", "dead", "{:.1f}"),
                ("perplexity", "perplexity", "{:.1f}"))
# A codebook "collapses" here when the hard codes of the last epoch use less than half of the codebook or have a
# perplexity below K / 10 (one code in ten carries the data).
COLLAPSE_UTILIZATION, COLLAPSE_PERPLEXITY_SHARE = 0.5, 0.1


def _by_key(runs: list[dict[str, Any]], key: str) -> list[dict[str, Any]]:
    return sorted((r for r in runs if r["key"] == key), key=lambda r: r["seed"])


def series(runs: list[dict[str, Any]], metric: str, epochs: int) -> np.ndarray:
    """``(runs, epochs)`` values of a history key; NaN where a run lacks the epoch or the key."""
    out = np.full((len(runs), epochs), np.nan)
    for i, run in enumerate(runs):
        for row in run["history"]:
            value = row.get(metric)
            if value is not None and 1 <= row["epoch"] <= epochs:
                out[i, row["epoch"] - 1] = value
    return out


def mean_std(values: np.ndarray, axis: int = 0) -> tuple[np.ndarray, np.ndarray]:
    """Mean and sample standard deviation (ddof 1; 0 for a single run) over ``axis``, ignoring NaN."""
    values = np.asarray(values, dtype=float)
    with np.errstate(invalid="ignore"), warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)  # an all-NaN column, or one value (no spread)
        mean = np.nanmean(values, axis=axis)
        count = np.sum(~np.isnan(values), axis=axis)
        std = np.where(count > 1, np.nanstd(values, axis=axis, ddof=1) if values.shape[axis] > 1 else 0.0, 0.0)
    return mean, std


def _fmt(mean: float, std: float, fmt: str, n: int) -> str:
    if not math.isfinite(mean):
        return "n/a"
    return fmt.format(mean) + (f" ± {fmt.format(std)}" if n > 1 else "")


def _band(ax: plt.Axes, runs: list[dict[str, Any]], metric: str, epochs: int, label: str, scale: float = 1.0,
          **style: Any) -> None:
    mean, std = mean_std(series(runs, metric, epochs) * scale)
    x = np.arange(1, epochs + 1)
    line, = ax.plot(x, mean, marker="o", ms=3, label=label, **style)
    if len(runs) > 1:
        ax.fill_between(x, mean - std, mean + std, color=line.get_color(), alpha=0.2, lw=0)


def _finish(fig: plt.Figure, axes: np.ndarray, path: Path) -> None:
    for ax in np.ravel(axes):
        ax.set_xlabel("epoch")
        ax.grid(alpha=0.3)
        ax.xaxis.get_major_locator().set_params(integer=True)
    np.ravel(axes)[0].legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def draw_panels(axes: np.ndarray, groups: dict[str, list], labels: dict[str, str], epochs: int,
                panels: tuple[tuple[str, str, float], ...]) -> None:
    """One panel per ``(metric, title, scale)``: every group's mean ± std band over its seeds, and beside the hard
    validation PSNR DDCL's soft output."""
    for ax, (metric, title, scale) in zip(axes.ravel(), panels, strict=True):
        for key, runs in groups.items():
            _band(ax, runs, metric, epochs, labels[key], scale)
        if metric == "val_psnr_hard" and "ddcl" in groups:
            _band(ax, groups["ddcl"], "val_psnr", epochs, "DDCL soft output", ls="--", color="grey")
        ax.set_title(title, fontsize=10)


def plot_health(groups: dict[str, list], labels: dict[str, str], epochs: int, path: Path) -> None:
    fig, axes = plt.subplots(2, 2, figsize=(10, 7))
    draw_panels(axes, groups, labels, epochs, (
        ("utilization", "utilization % (train epoch)", 100.0), ("dead_codes", "dead codes (train epoch)", 1.0),
        ("perplexity", "perplexity of hard codes (train epoch)", 1.0),
        ("val_psnr_hard", "val PSNR dB, decoded from hard indices", 1.0)))
    axes[0, 1].set_yscale("symlog", linthresh=1)
    axes[1, 0].set_yscale("log")
    _finish(fig, axes, path)


def plot_terms(runs: list[dict[str, Any]], epochs: int, path: Path) -> None:
    fig, axes = plt.subplots(1, 2, figsize=(10, 3.8))
    for metric, label in (("l_q", "L_q"), ("l_ols", "L_OLS"), ("v", "V")):
        _band(axes[0], runs, metric, epochs, label)
    axes[0].set_title("DDCL terms per token, train-epoch mean (L_q = L_OLS + V)", fontsize=10)
    _band(axes[1], runs, "identity_residual", epochs, "max |L_q - L_OLS - V| / L_q")
    axes[1].set_yscale("log")
    axes[1].set_title("identity residual, largest batch of the epoch", fontsize=10)
    axes[1].legend(fontsize=8)
    _finish(fig, axes, path)


def plot_usage(groups: dict[str, list], labels: dict[str, str], path: Path) -> None:
    fig, axes = plt.subplots(1, len(groups), figsize=(4.2 * len(groups), 3.6), sharey=True, squeeze=False)
    for ax, (key, runs) in zip(axes[0], groups.items(), strict=True):
        for i, run in enumerate(runs):
            counts = np.sort(np.asarray(run["test"]["code_counts"], dtype=float))[::-1]
            share = counts / counts.sum()
            if i == 0:
                ax.bar(np.arange(len(share)), np.where(share > 0, share, np.nan), width=1.0, color="C0",
                       label=f"seed {run['seed']}")
            else:
                ax.plot(np.arange(len(share)), share, lw=0.8, color=f"C{i}", label=f"seed {run['seed']}")
        test = runs[0]["test"]
        ax.set_title(f"{labels[key]}\nseed {runs[0]['seed']}: {test['num_codes'] - test['dead_codes']} of "
                     f"{test['num_codes']} codes used, perplexity {test['perplexity']:.0f}", fontsize=9)
        ax.set_yscale("log")
        ax.set_xlabel("code, by rank of use")
        ax.grid(alpha=0.3)
    axes[0, 0].set_ylabel("share of test tokens")
    axes[0, 0].legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def plot_study(groups: dict[str, list], labels: dict[str, str], panels: tuple, epochs: int, path: Path) -> None:
    fig, axes = plt.subplots(1, len(panels), figsize=(4.2 * len(panels), 3.6))
    for ax, (metric, title, scale) in zip(axes, panels, strict=True):
        for key, runs in groups.items():
            if metric == "gap":
                gap = [{**r, "history": [{**row, "gap": _gap(row)} for row in r["history"]]} for r in runs]
                _band(ax, gap, "gap", epochs, labels[key])
            else:
                _band(ax, runs, metric, epochs, labels[key], scale)
        ax.set_title(title, fontsize=10)
    _finish(fig, axes, path)


def _gap(row: dict[str, Any]) -> float | None:
    if row.get("val_psnr") is None or row.get("val_psnr_hard") is None:
        return None
    return row["val_psnr"] - row["val_psnr_hard"]


def summary_table(groups: dict[str, list], labels: dict[str, str], columns: tuple,
                  record: Callable[[dict[str, Any]], dict[str, Any]]) -> list[str]:
    """Mean ± std over seeds of each run group's figures in ``record(run)`` (utilization in %; a missing one is n/a)."""
    lines = ["| run | seeds | " + " | ".join(c[1] for c in columns) + " |", "|---|---|" + "---|" * len(columns)]
    for key, runs in groups.items():
        cells = []
        for metric, _, fmt in columns:
            scale = 100.0 if metric.endswith("utilization") else 1.0
            values = np.array([np.nan if record(r).get(metric) is None else record(r)[metric] * scale for r in runs],
                              dtype=float)
            mean, std = mean_std(values)
            cells.append(_fmt(float(mean), float(std), fmt, len(runs)))
        lines.append(f"| {labels[key]} | {len(runs)} | " + " | ".join(cells) + " |")
    return lines


def test_table(groups: dict[str, list], labels: dict[str, str]) -> list[str]:
    """The methods' table: the test split, from the last epoch's checkpoint."""
    return summary_table(groups, labels, TEST_COLUMNS, lambda run: run["test"])


def epoch_table(groups: dict[str, list], labels: dict[str, str], columns: tuple, epochs: int) -> list[str]:
    header = ["epoch"] + [f"{labels[k]}: {title}" for k in groups for _, title, _, _ in columns]
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    for e in range(epochs):
        cells = [str(e + 1)]
        for runs in groups.values():
            for metric, _, fmt, scale in columns:
                if metric == "gap":
                    values = np.array([_gap(r["history"][e]) if e < len(r["history"]) else None for r in runs],
                                      dtype=float)
                else:
                    values = series(runs, metric, epochs)[:, e] * scale
                mean, std = mean_std(values)
                cells.append(_fmt(float(mean), float(std), fmt, len(runs)))
        lines.append("| " + " | ".join(cells) + " |")
    return lines


VAL_COLUMNS = tuple((f"val_{m}", f"val {t}", f) for m, t, f in TEST_COLUMNS)


def val_table(groups: dict[str, list], labels: dict[str, str]) -> list[str]:
    """An ablation's table: the last epoch's validation figures (the test split is for the methods' table only)."""
    return ["Validation split, last epoch (an ablation is read on validation; the test split is for the methods' "
            "table):", "", *summary_table(groups, labels, VAL_COLUMNS, lambda run: run["history"][-1])]


def collapsed(run: dict[str, Any]) -> bool:
    last = run["history"][-1]
    k = run["num_codes"]
    return last["utilization"] < COLLAPSE_UTILIZATION or last["perplexity"] < COLLAPSE_PERPLEXITY_SHARE * k


def claims(groups: dict[str, list], labels: dict[str, str], eps: dict[str, list], epochs: int) -> list[str]:
    """Measured statements next to the paper's claims, computed from the runs."""
    lines = []
    if "ddcl" in groups:
        util = series(groups["ddcl"], "utilization", epochs) * 100
        lines.append(f"- Paper: DDCL at 100% codebook utilization from epoch 1. Here: {np.nanmin(util[:, 0]):.1f}% at "
                     f"epoch 1 (lowest seed), lowest over all epochs and seeds {np.nanmin(util):.1f}%.")
    if "hard" in groups:
        util = series(groups["hard"], "utilization", epochs) * 100
        full = [e + 1 for e in range(epochs) if np.all(util[:, e] >= 100.0)]
        reach = f"reached 100% at epoch {full[0]}" if full else f"did not reach 100% within {epochs} epochs"
        lines.append(f"- Paper: hard VQ-VAE started at 18.8% and needed 44 epochs to reach 100%. Here plain hard VQ "
                     f"started at {np.nanmean(util[:, 0]):.1f}% (mean over seeds), ended at "
                     f"{np.nanmean(util[:, -1]):.1f}% at epoch {epochs}, and {reach}.")
    for key, runs in eps.items():
        verdict = ["collapsed" if collapsed(r) else "did not collapse" for r in runs]
        last = [r["history"][-1] for r in runs]
        parts = [f"seed {r['seed']} {v} (epoch {row['epoch']}: utilization {100 * row['utilization']:.1f}%, "
                 f"perplexity {row['perplexity']:.1f} of K = {r['num_codes']})"
                 for r, v, row in zip(runs, verdict, last, strict=True)]
        lines.append(f"- {labels[key]}: " + "; ".join(parts) + ".")
    if eps:
        lines.append(f"- Paper: eps ≤ 0.1 stable, eps = 1.0 collapses. Collapse here means utilization below "
                     f"{COLLAPSE_UTILIZATION:.0%} or perplexity below {COLLAPSE_PERPLEXITY_SHARE:.0%} of K at the last "
                     f"epoch.")
    return lines


def winners(groups: dict[str, list], labels: dict[str, str]) -> list[str]:
    """Which method is best on each test metric, and whether its margin over the second counts beyond the seed
    spread (:func:`eval._spread.beyond_spread`, paired by seed)."""
    lines = []
    higher = {"mse": False, "mse_hard": False, "dead_codes": False}
    for metric, title, fmt in TEST_COLUMNS:
        stats = {k: mean_std(np.array([r["test"][metric] for r in runs], dtype=float)) for k, runs in groups.items()}
        order = sorted(stats, key=lambda k: float(stats[k][0]), reverse=higher.get(metric, True))
        if len(order) < 2:
            continue
        best, second = order[0], order[1]
        judged = by_seed(*({r["seed"]: float(r["test"][metric]) for r in groups[k]} for k in (best, second)))
        scale = 100.0 if metric == "utilization" else 1.0
        lines.append(f"- {title}: {labels[best]} ({fmt.format(scale * float(stats[best][0]))}) ahead of "
                     f"{labels[second]} ({fmt.format(scale * float(stats[second][0]))}), "
                     f"{describe(judged)}.")
    return lines


def train_minutes(runs: list[dict[str, Any]]) -> dict[str, float]:
    """Training minutes per run (``key/seedN``), summed over the epochs of its history."""
    return {f"{r['key']}/seed{r['seed']}": round(sum(row.get("time_s", 0) for row in r["history"]) / 60, 2)
            for r in runs}


def runs_for_json(runs: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The runs as ``results.json`` keeps them: everything but the test split's per-code counts."""
    return [{k: v for k, v in r.items() if k != "test"}
            | {"test": None if r["test"] is None else {k: v for k, v in r["test"].items() if k != "code_counts"}}
            for r in runs]


def _intro(runs: list[dict[str, Any]], settings: dict[str, Any], seconds: dict[str, float]) -> list[str]:
    """Title, the command that regenerates the report, what every run was, and this invocation's time."""
    minutes = train_minutes(runs)
    subset = settings["train_subset"] or 45000
    limit = settings["test_limit"]
    test_images = "all 10,000" if limit is None else f"the first {limit:,}"
    return [
        "# Head-to-head: DDCL vs hard VQ-VAE on CIFAR-10", "",
        f"Regenerate: `{settings['command']}`", "", f"Code: {code_commit()}", "",
        f"Every run: {int(settings['epochs'])} epochs on {subset:,} training images, {settings['val_size']:,} held-out "
        f"validation images; the methods' test metrics on {test_images} "
        f"test images from the last epoch's checkpoint, the ablations' on the validation split (read once, for the "
        f"final table, the test split judges the methods only). Method seeds {settings['seeds']}, ablation seeds "
        f"{settings['ablation_seeds']}. Extra trainer flags: `{settings['train_args'] or 'none'}`. ± is the sample "
        f"standard deviation over seeds.", "",
        f"This invocation: {seconds['total'] / 60:.1f} min of wall time, {seconds['train'] / 60:.1f} min of it "
        f"training ({settings['jobs']} runs at a time; runs that already existed were read, not retrained). "
        f"Training time summed over the runs' epochs: {sum(minutes.values()):.1f} min; per run (minutes): "
        + ", ".join(f"{k} {v}" for k, v in minutes.items()) + ".", "",
    ]


def _head_to_head(groups: dict[str, list], labels: dict[str, str], eps: dict[str, list], epochs: int) -> list[str]:
    """The methods' sections: the paper's claims, the test table and its winners, codebook health per epoch, DDCL's
    decomposition per epoch, prototype usage (the plots of :func:`plot_health`, :func:`plot_terms`,
    :func:`plot_usage`)."""
    return [
        "## Against the paper's claims", "", *claims(groups, labels, eps, epochs), "",
        "## Test split, last epoch", "", *test_table(groups, labels), "",
        "PSNR is per image, averaged; *hard* decodes the argmax codes (for hard VQ it is the model's output itself). "
        "Utilization, dead codes and perplexity are of the hard codes over the test split.", "",
        *winners(groups, labels), "",
        "## Codebook health and validation PSNR per epoch", "", "![health](health.png)", "",
        *epoch_table(groups, labels, (("utilization", "util %", "{:.1f}", 100.0), ("dead_codes", "dead", "{:.0f}", 1.0),
                                      ("perplexity", "ppl", "{:.0f}", 1.0),
                                      ("val_psnr_hard", "val PSNR hard", "{:.2f}", 1.0)), epochs), "",
        "Codebook health is counted over each training epoch (hard codes); validation PSNR is decoded from hard "
        "indices (DDCL's soft output is the dashed line in the plot).", "",
        "## DDCL decomposition per epoch", "", "![terms](ddcl_terms.png)", "",
        *epoch_table({"ddcl": groups.get("ddcl", [])}, labels,
                     (("l_q", "L_q", "{:.3f}", 1.0), ("l_ols", "L_OLS", "{:.3f}", 1.0), ("v", "V", "{:.3f}", 1.0),
                      ("identity_residual", "max residual", "{:.1e}", 1.0)), epochs), "",
        "## Prototype usage at the last epoch (test split)", "", "![usage](usage.png)", "",
    ]


def _eps_study(eps_all: dict[str, list], labels: dict[str, str], epochs: int, out: Path) -> list[str]:
    """``eps.png`` and the eps ablation's section: the reference layer at eps = 0.01 beside the other eps."""
    plot_study(eps_all, labels, (("separation", "S(P), mean prototype separation", 1.0),
                                 ("utilization", "utilization %", 100.0),
                                 ("perplexity", "perplexity of hard codes", 1.0)), epochs, out / "eps.png")
    return [
        "## eps ablation (DDCL, eps = encoder lr / prototype lr)", "", "![eps](eps.png)", "",
        *epoch_table(eps_all, labels, (("separation", "S(P)", "{:.2f}", 1.0),
                                       ("utilization", "util %", "{:.1f}", 100.0),
                                       ("perplexity", "ppl", "{:.0f}", 1.0),
                                       ("val_psnr_hard", "PSNR hard", "{:.2f}", 1.0)), epochs), "",
        *val_table(eps_all, labels), ""]


def _temperature_study(temp_all: dict[str, list], labels: dict[str, str], epochs: int, out: Path) -> list[str]:
    """``temperature.png`` and the temperature study's section: entropy-controlled T beside fixed and annealed."""
    plot_study(temp_all, labels, (("temperature", "T at the epoch's last step", 1.0),
                                  ("gap", "val PSNR gap, soft - hard (dB)", 1.0),
                                  ("val_psnr_hard", "val PSNR from hard indices (dB)", 1.0)), epochs,
               out / "temperature.png")
    return [
        "## Temperature: entropy-controlled, fixed, annealed", "", "![temperature](temperature.png)", "",
        *epoch_table(temp_all, labels, (("temperature", "T", "{:.2f}", 1.0),
                                        ("val_psnr", "PSNR soft", "{:.2f}", 1.0),
                                        ("val_psnr_hard", "PSNR hard", "{:.2f}", 1.0),
                                        ("gap", "gap dB", "{:.2f}", 1.0)), epochs), "",
        *val_table(temp_all, labels), ""]


def write_report(runs: list[dict[str, Any]], settings: dict[str, Any], out: Path,
                 seconds: dict[str, float]) -> dict[str, Any]:
    """Write ``report.md``, ``results.json`` and the plots of :data:`PLOTS` into ``out``; returns the results."""
    out.mkdir(parents=True, exist_ok=True)
    epochs = int(settings["epochs"])
    labels = {r["key"]: r["label"] for r in runs}
    by_key = {k: _by_key(runs, k) for k in dict.fromkeys(r["key"] for r in runs)}
    groups = {k: rs for k, rs in by_key.items() if rs[0]["group"] == "methods"}
    # The studies' reference is the plain layer at eps = 0.01 with entropy-controlled T ("ddcl_plain", in the eps
    # group); the method "ddcl" is the layer's own recipe, whose prototypes no optimizer trains.
    eps_all = {k: rs for k, rs in by_key.items() if rs[0]["group"] == "eps"}
    eps = {k: rs for k, rs in eps_all.items() if k != "ddcl_plain"}
    temp = {k: rs for k, rs in by_key.items() if rs[0]["group"] == "temperature"}
    default = [r for r in eps_all.get("ddcl_plain", []) if r["seed"] in set(settings["ablation_seeds"])]

    plot_health(groups, labels, epochs, out / "health.png")
    plot_terms(groups.get("ddcl", []), epochs, out / "ddcl_terms.png")
    plot_usage(groups, labels, out / "usage.png")
    lines = [*_intro(runs, settings, seconds), *_head_to_head(groups, labels, eps, epochs)]
    if eps:
        lines += _eps_study(eps_all, {**labels, "ddcl_plain": "plain layer, eps = 0.01 (plain-layer recipe)"},
                            epochs, out)
    if temp:
        lines += _temperature_study({"ddcl_plain": default, **temp} if default else temp,
                                    {**labels, "ddcl_plain": "plain layer, T entropy-controlled (plain-layer recipe)"},
                                    epochs, out)
    write_atomic(out / "report.md", "\n".join(lines))
    results = {"settings": settings, "seconds": seconds, "runs": runs_for_json(runs)}
    write_atomic(out / "results.json", json.dumps(portable(results), indent=1, default=str) + "\n")
    return results
