"""``reports/peers``: tables, margins against the seed spread, and plots for :mod:`eval.peers` (and its drop-in twin,
:mod:`eval.dropin`, which shares the test table and the margin rule)."""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
import numpy as np  # noqa: E402

from eval import render
from eval._provenance import code_commit, portable
from eval._spread import by_seed, describe, format_mean_std, mean_std
from eval.harness import LABELS
from softvq.models.files import write_atomic  # noqa: E402

TEST_COLUMNS = (("psnr_hard", "PSNR from hard indices (dB)", "{:.2f}", 1.0), ("ssim_hard", "SSIM", "{:.3f}", 1.0),
                ("utilization", "test util %", "{:.1f}", 100.0), ("dead_codes", "dead", "{:.0f}", 1.0),
                ("perplexity", "perplexity", "{:.0f}", 1.0))
EPOCH_COLUMNS = (("val_utilization", "val util %", "{:.1f}", 100.0), ("val_dead_codes", "val dead", "{:.0f}", 1.0),
                 ("val_perplexity", "val ppl", "{:.0f}", 1.0), ("val_psnr_hard", "val PSNR hard", "{:.2f}", 1.0),
                 ("utilization", "train util %", "{:.1f}", 100.0), ("restarts", "restarts", "{:.0f}", 1.0),
                 ("train_images_per_s", "img/s", "{:.0f}", 1.0))


def series(runs: list[dict[str, Any]], metric: str, epochs: int) -> np.ndarray:
    """``(runs, epochs)`` values of a history key; NaN where a run lacks the epoch or the key."""
    out = np.full((len(runs), epochs), np.nan)
    for i, run in enumerate(runs):
        for row in run["history"]:
            value = row.get(metric)
            if value is not None and 1 <= row["epoch"] <= epochs:
                out[i, row["epoch"] - 1] = value
    return out


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


# A soft-hard PSNR difference below this is float rounding of one tensor decoded twice, not a measurement.
BY_CONSTRUCTION_DB = 1e-6


def group(runs: list[dict[str, Any]]) -> dict[str, list[dict[str, Any]]]:
    groups: dict[str, list[dict[str, Any]]] = {}
    for run in runs:
        groups.setdefault(run["method"], []).append(run)
    return groups


def values(runs: list[dict[str, Any]], metric: str) -> np.ndarray:
    return np.array([np.nan if r["test"].get(metric) is None else r["test"][metric] for r in runs], dtype=float)


def test_table(groups: dict[str, list], labels: dict[str, str], columns: tuple = TEST_COLUMNS) -> list[str]:
    lines = ["| bottleneck | seeds | " + " | ".join(c[1] for c in columns) + " |",
             "|---|---|" + "---|" * len(columns)]
    for key, runs in groups.items():
        cells = []
        for metric, _, fmt, scale in columns:
            mean, std = mean_std(values(runs, metric) * scale)
            cells.append(format_mean_std(float(mean), float(std), fmt, len(runs)))
        lines.append(f"| {labels[key]} | {len(runs)} | " + " | ".join(cells) + " |")
    return lines


def margins(groups: dict[str, list], labels: dict[str, str], metric: str = "psnr_hard",
            ours: str = "ddcl") -> list[str]:
    """DDCL's lead over every other method on ``metric``, judged by the reports' one rule
    (:func:`eval._spread.beyond_spread`, paired by seed)."""
    if ours not in groups:
        return []
    m0 = float(mean_std(values(groups[ours], metric))[0])
    mine = {r["seed"]: float(r["test"][metric]) for r in groups[ours]}
    lines = []
    for key, runs in groups.items():
        if key == ours:
            continue
        m = float(mean_std(values(runs, metric))[0])
        judged = by_seed(mine, {r["seed"]: float(r["test"][metric]) for r in runs})
        diff = m0 - m
        lines.append(f"- {labels[ours]} {'+' if diff >= 0 else '−'}{abs(diff):.2f} dB against {labels[key]} "
                     f"({m0:.2f} vs {m:.2f}); {describe(judged)}.")
    return lines


def epoch_table(groups: dict[str, list], labels: dict[str, str], epochs: int) -> list[str]:
    lines = []
    for key, runs in groups.items():
        lines += [f"**{labels[key]}**", "", "| epoch | " + " | ".join(c[1] for c in EPOCH_COLUMNS) + " |",
                  "|---|" + "---|" * len(EPOCH_COLUMNS)]
        for e in range(epochs):
            cells = []
            for metric, _, fmt, scale in EPOCH_COLUMNS:
                mean, std = mean_std(series(runs, metric, epochs)[:, e] * scale)
                cells.append(format_mean_std(float(mean), float(std), fmt, len(runs)))
            lines.append(f"| {e + 1} | " + " | ".join(cells) + " |")
        lines.append("")
    return lines


def plot_health(groups: dict[str, list], labels: dict[str, str], epochs: int, path: Path) -> None:
    fig, axes = plt.subplots(2, 3, figsize=(14, 7))
    draw_panels(axes, groups, labels, epochs, (
        ("val_utilization", "val utilization %", 100.0), ("val_perplexity", "val perplexity (hard codes)", 1.0),
        ("val_psnr_hard", "val PSNR dB from hard indices", 1.0), ("utilization", "train-epoch utilization %", 100.0),
        ("restarts", "codes restarted in the epoch", 1.0), ("train_images_per_s", "train images/s", 1.0)))
    axes[1, 1].set_yscale("symlog", linthresh=1)
    _finish(fig, axes, path)


def plot_test(groups: dict[str, list], labels: dict[str, str], path: Path) -> None:
    fig, axes = plt.subplots(1, 2, figsize=(12, 4))
    names = list(groups)
    for ax, (metric, title, scale) in zip(axes, (("psnr_hard", "test PSNR from hard indices (dB)", 1.0),
                                               ("perplexity", "test perplexity of hard codes", 1.0)), strict=True):
        stats = [mean_std(values(groups[k], metric) * scale) for k in names]
        ax.bar(range(len(names)), [float(m) for m, _ in stats], yerr=[float(s) for _, s in stats], capsize=4,
               color=[f"C{i}" for i in range(len(names))])
        ax.set_xticks(range(len(names)), [labels[k] for k in names], rotation=20, ha="right", fontsize=8)
        ax.set_title(title, fontsize=10)
        ax.grid(alpha=0.3, axis="y")
        finite = [float(m) for m, _ in stats if np.isfinite(m)]
        if metric == "psnr_hard" and finite:
            ax.set_ylim(min(finite) - 1.0, max(finite) + 0.6)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def targets(groups: dict[str, list], settings: dict[str, Any]) -> list[str]:
    """The study's targets, checked on the measured numbers."""
    if "ddcl" not in groups:
        return []
    k = settings["num_codes"]
    ddcl = groups["ddcl"]
    m0 = float(mean_std(values(ddcl, "psnr_hard"))[0])
    peers = {key: [float(x) for x in mean_std(values(runs, "psnr_hard"))] for key, runs in groups.items()
             if key != "ddcl"}
    lines = []
    if peers:
        best = max(peers, key=lambda key: peers[key][0])
        m = peers[best][0]
        judged = by_seed({r["seed"]: float(r["test"]["psnr_hard"]) for r in ddcl},
                         {r["seed"]: float(r["test"]["psnr_hard"]) for r in groups[best]})
        ok = m0 >= m + 0.5 and judged["counts"] and judged["margin"] > 0
        lines.append(f"- DDCL hard-index PSNR ≥ best peer + 0.5 dB, beyond the seed spread: {m0:.2f} vs {best} "
                     f"{m:.2f} + 0.5 → **{'met' if ok else 'not met'}** (margin {m0 - m:+.2f} dB, spread "
                     f"{judged['spread']:.2f}; {describe(judged)}).")
    util = values(ddcl, "utilization") * 100
    ppl = values(ddcl, "perplexity")
    lines.append(f"- Test utilization ≥ 99%: lowest seed {np.nanmin(util):.1f}% → "
                 f"**{'met' if np.nanmin(util) >= 99 else 'not met'}**.")
    lines.append(f"- Perplexity ≥ 0.9·K = {0.9 * k:.0f}: lowest seed {np.nanmin(ppl):.0f} → "
                 f"**{'met' if np.nanmin(ppl) >= 0.9 * k else 'not met'}**.")
    gap = float(np.nanmax(np.abs(values(ddcl, "psnr") - values(ddcl, "psnr_hard"))))
    if gap < BY_CONSTRUCTION_DB:  # the layer's hard output: the model decodes the argmax code, soft or hard alike
        lines.append(f"- Soft→hard gap ≤ 0.2 dB: **holds by construction**, not a measured result: with the layer's "
                     f"hard output the soft and the hard decode are one tensor (largest seed {gap:.1e} dB).")
    else:
        lines.append(f"- Soft→hard gap ≤ 0.2 dB: largest seed {gap:.3f} dB → **{'met' if gap <= 0.2 else 'not met'}**.")
    residual = max((row.get("identity_residual") or 0.0) for r in ddcl for row in r["history"])
    lines.append(f"- Identity residual |L_q − L_OLS − V| / L_q, largest over every epoch and seed: {residual:.2e}.")
    return lines


def write_report(runs: list[dict[str, Any]], settings: dict[str, Any], out: Path,
                 labels: dict[str, str]) -> dict[str, Any]:
    out.mkdir(parents=True, exist_ok=True)
    groups = group(runs)
    epochs = settings["epochs"]
    plot_health(groups, labels, epochs, out / "health.png")
    plot_test(groups, labels, out / "test.png")
    wall = sum(r.get("wall_s", 0.0) for r in runs) / 60
    lines = [
        "# DDCL against its peers in the project's VQ-VAE",
        "",
        f"Regenerate: `{settings['command']}` (runs are kept in `{settings.get('runs', 'runs/peers')}/`; finished "
        f"ones are read).",
        "", f"Code: {settings.get('code') or code_commit()}", "",
        f"Same encoder/decoder (width {settings['width']}, {settings['res_blocks']} residual blocks), K = "
        f"{settings['num_codes']} codes of D = {settings['code_dim']}, Adam {settings['lr']:g}, batch "
        f"{settings['batch_size']}, {settings['train_subset']} training images, {settings['val_size']} validation "
        f"images, {epochs} epochs, seeds {settings['seeds']}; test on the official split "
        f"({settings['test_limit'] or 10000} images). Only the bottleneck changes. Training wall time of all runs: "
        f"{wall:.0f} min on this machine.",
        "",
        *([f"Not run (time): {', '.join(settings['missing'])}; those methods' rows hold the seeds that were."]
          if settings.get("missing") else []),
        *([f"Each run used {settings['threads']} torch thread(s), beside another run on the other core: images/s "
           f"compare within a table only roughly."] if settings.get("threads") else []),
        "",
        "## Test split (mean ± sample std over seeds)",
        "",
        *test_table(groups, labels),
        "",
        "## Margins on PSNR from hard indices",
        "",
        *margins(groups, labels),
        "",
        "## Targets",
        "",
        *targets(groups, settings),
        "",
        "## Per epoch (validation split; train-epoch utilization counts codes that a restart moved, so restarts are "
        "beside it)",
        "",
        *epoch_table(groups, labels, epochs),
        "![health](health.png)",
        "",
        "![test](test.png)",
        "",
    ]
    write_atomic(out / "report.md", "\n".join(lines))
    summary = {"settings": settings, "runs": runs}
    write_atomic(out / "results.json", json.dumps(portable(summary), indent=1, default=float))
    return summary


def render_test(sources: Sequence[tuple[Path, str]], flags: Sequence[str] = ()) -> list[str]:
    """The README/docs block ``peers_test`` (:mod:`eval.render`): the test table of ``eval.peers`` results files."""
    runs, lines = render.merged(sources, render.setting_of, lambda s: "test")
    return [*test_table(group(runs), render.labels_of(LABELS, flags)), "", *lines]
