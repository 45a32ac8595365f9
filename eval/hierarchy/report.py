"""The report of :mod:`eval.hierarchy`: 1-level vs 2-level DDCL vs hard VQ per epoch and on the test split, per-level
decomposition tables, and the verdict on the paper's hierarchical claim. Reuses :mod:`eval.compare.report`."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import matplotlib.pyplot as plt
import numpy as np

from eval._provenance import code_commit, portable
from eval.compare import report as rep
from softvq.models.files import write_atomic

PLOTS = ("health.png", "levels.png")
TWO_LEVEL = "ddcl_2level"


def _groups(runs: list[dict[str, Any]]) -> dict[str, list[dict[str, Any]]]:
    order = ("ddcl", TWO_LEVEL, "hard", "hard_ema")
    return {k: rep._by_key(runs, k) for k in order if rep._by_key(runs, k)}


def _levels(runs: list[dict[str, Any]]) -> int:
    return max((int(r["test"].get("levels", 1)) for r in runs), default=1)


def _codes(runs: list[dict[str, Any]], level: int) -> str:
    """K of a level of these runs: level 0 from the test metrics, the levels above from ``--model.level_codes``
    (one int, or a list ``[4,8]``, one per level above 0)."""
    if not runs:
        return "?"
    if level == 0:
        return str(runs[0]["test"]["num_codes"])
    flags = runs[0]["flags"]
    if "--model.level_codes" not in flags or flags.index("--model.level_codes") + 1 == len(flags):
        return "?"
    values = [v.strip() for v in flags[flags.index("--model.level_codes") + 1].strip("[]").split(",")]
    return values[min(level - 1, len(values) - 1)]


def plot_levels(groups: dict[str, list], labels: dict[str, str], epochs: int, path: Path) -> None:
    """Per-level terms, identity residual, utilization and perplexity (2-level runs), beside 1-level DDCL."""
    fig, axes = plt.subplots(2, 2, figsize=(10, 7))
    two, one = groups.get(TWO_LEVEL, []), groups.get("ddcl", [])
    levels = _levels(two)
    styles = ("-", "--", ":", "-.")
    for level in range(levels):
        suffix, ls = f"_l{level}", styles[level % len(styles)]
        for i, (metric, name) in enumerate((("l_q", "L_q"), ("l_ols", "L_OLS"), ("v", "V"))):
            rep._band(axes[0, 0], two, metric + suffix, epochs, f"{name}, level {level}", ls=ls, color=f"C{i + 1}")
        rep._band(axes[0, 1], two, "identity_residual" + suffix, epochs, f"2 levels, level {level}", ls=ls,
                  color="C0")
        rep._band(axes[1, 0], two, "utilization" + suffix, epochs, f"2 levels, level {level}", 100.0, ls=ls,
                  color="C0")
        rep._band(axes[1, 1], two, "perplexity" + suffix, epochs, f"2 levels, level {level}", ls=ls, color="C0")
    if one:
        rep._band(axes[0, 0], one, "v", epochs, "V, 1 level", color="grey")
        rep._band(axes[0, 1], one, "identity_residual", epochs, "1 level", color="grey")
        rep._band(axes[1, 0], one, "utilization", epochs, "1 level", 100.0, color="grey")
        rep._band(axes[1, 1], one, "perplexity", epochs, "1 level", color="grey")
    axes[0, 0].set_title("DDCL terms per token, train-epoch mean (log scale)", fontsize=10)
    axes[0, 0].set_yscale("log")
    for ax in np.ravel(axes)[1:]:
        ax.legend(fontsize=7)
    axes[0, 1].set_title("identity residual |L_q - L_OLS - V| / L_q, largest batch", fontsize=10)
    axes[0, 1].set_yscale("log")
    axes[1, 0].set_title("utilization % (train epoch)", fontsize=10)
    axes[1, 1].set_title("perplexity of hard codes (train epoch)", fontsize=10)
    axes[1, 1].set_yscale("log")
    rep._finish(fig, axes, path)


def claim_lines(checks: list[dict[str, Any]], labels: dict[str, str], tolerance: float) -> list[str]:
    """The verdict on "V^(l) >= 0 and L_q = L_OLS + V at every level and every epoch", and its table."""
    if not checks:
        return ["No DDCL run to check."]
    failed = [c for c in checks if not c["holds"]]
    multi = [c for c in checks if c["key"] == TWO_LEVEL]
    levels = sorted({c["level"] for c in multi})
    if failed:
        verdict = ("**Refuted** (or not measurable) for: " + "; ".join(
            f"{labels[c['key']]} seed {c['seed']} level {c['level']} (smallest V {c['v_min']:.3g}, largest residual "
            f"{c['max_residual']:.1e}{', keys missing' if c['missing'] else ''})" for c in failed) + ".")
    else:
        v_low = min(c["v_min"] for c in multi) if multi else float("nan")
        worst = max(c["max_residual"] for c in checks)
        verdict = (f"**Confirmed.** In every run, at every level ({', '.join(map(str, levels)) or '0'} of the 2-level "
                   f"stack, and the single level of 1-level DDCL) and every epoch, V >= 0 and the identity held: the "
                   f"smallest batch V of any 2-level epoch was {v_low:.3g}, the largest relative identity residual of "
                   f"any batch {worst:.1e} (tolerance {tolerance:.0e}, float32 rounding).")
    lines = [verdict, "",
             "Both statements are algebraic (V is a weighted variance; the cross term of L_q vanishes because "
             "sum_k q_nk (p_k - mu_n) = 0), so this checks that every level computes them consistently on real "
             "training batches, not a property training could lose. What training could lose is V > 0 itself (all "
             "prototypes a token sees on one point: no gradient through the soft centroid); the smallest V below shows "
             "how far each level stayed from that.", "",
             "| run | seed | level | epochs | smallest V | largest residual | holds |", "|---|---|---|---|---|---|---|"]
    for c in checks:
        kind = "batch" if c["v_key"].startswith("v_min") else "epoch mean"
        lines.append(f"| {labels[c['key']]} | {c['seed']} | {c['level']} | {c['epochs']} | {c['v_min']:.3f} ({kind}) "
                     f"| {c['max_residual']:.1e} | {'yes' if c['holds'] else '**no**'} |")
    return lines


def level_test_table(runs: list[dict[str, Any]], levels: int) -> list[str]:
    header = ["level", "K", "util %", "dead", "perplexity"]
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    for level in range(levels):
        cells = [str(level), _codes(runs, level)]
        for metric, fmt, scale in (("utilization", "{:.1f}", 100.0), ("dead_codes", "{:.1f}", 1.0),
                                   ("perplexity", "{:.1f}", 1.0)):
            values = np.array([r["test"].get(f"{metric}_l{level}", np.nan) for r in runs], dtype=float) * scale
            mean, std = rep.mean_std(values)
            cells.append(rep._fmt(float(mean), float(std), fmt, len(values)))
        lines.append("| " + " | ".join(cells) + " |")
    return lines


def _intro(runs: list[dict[str, Any]], settings: dict[str, Any], seconds: dict[str, float]) -> list[str]:
    """Title, the command that regenerates the report, what every run and the 2-level model were, this invocation's
    time, and the reference runs left out."""
    two = _groups(runs).get(TWO_LEVEL, [])
    minutes = rep.train_minutes(runs)
    subset = settings["train_subset"] or 45000
    limit = settings["test_limit"]
    missing = settings.get("missing_references") or []
    ref_seeds = settings.get("reference_seeds") or settings["seeds"]
    lines = [
        "# Hierarchical DDCL: 1 level vs 2 levels vs hard VQ on CIFAR-10", "",
        f"Regenerate: `{settings['command']}`", "", f"Code: {code_commit()}", "",
        f"Every run: {int(settings['epochs'])} epochs on {subset:,} training images, {settings['val_size']:,} "
        f"validation images, test metrics on {'all 10,000' if limit is None else f'the first {limit:,}'} test images "
        f"from the last epoch's checkpoint; 2-level seeds {settings['seeds']}, reference seeds {ref_seeds}; extra "
        f"trainer flags `{settings['train_args'] or 'none'}`. The 2-level model: {_codes(two, 0)} codes on the 8x8 "
        f"latent grid (level 0, the same codebook as 1-level DDCL) and {_codes(two, 1)} codes on the 2x2 averages of "
        "level 0's soft centroids (level 1, a 4x4 grid); the decoder sees both levels (level 1 upsampled, "
        "concatenated). ± is the sample standard deviation over seeds; plain columns of the 2-level model are its "
        "level 0.", "",
        f"This invocation: {seconds['total'] / 60:.1f} min of wall time, {seconds['train_2level'] / 60:.1f} min of it "
        f"training 2-level runs ({settings['jobs']} at a time; existing runs were read, not retrained). Training time "
        f"per run (sum of its epochs, minutes): " + ", ".join(f"{k} {v}" for k, v in minutes.items()) + ".", "",
    ]
    if missing:
        lines += ["Reference runs missing or unfinished when this report was written, left out: "
                  + ", ".join(f"`{m}`" for m in missing) + ".", ""]
    return lines


def _claim_and_test(groups: dict[str, list], labels: dict[str, str], checks: list[dict[str, Any]],
                    tolerance: float) -> list[str]:
    """The verdict on the hierarchical claim, the test table and its winners, and every level of the 2-level model
    on the test split."""
    two = groups.get(TWO_LEVEL, [])
    lines = [
        "## The paper's hierarchical claim: V^(l) >= 0 and L_q = L_OLS + V at every level and every epoch", "",
        *claim_lines(checks, labels, tolerance), "",
        "## Test split, last epoch", "", *rep.test_table(groups, labels), "",
        "*hard* decodes the argmax codes (for 2 levels: both levels' codes); utilization, dead codes and perplexity "
        "are level 0's (the bottom codebook, the same size in both DDCL models).", "",
        *rep.winners(groups, labels), "",
    ]
    if two:
        lines += ["2-level DDCL, every level on the test split:", "", *level_test_table(two, _levels(two)), ""]
    return lines


def _level_epoch_table(two: list[dict[str, Any]], level: int, epochs: int) -> list[str]:
    """One level of the 2-level model per epoch: its terms, smallest V, residual, usage and T."""
    s = f"_l{level}"
    return [f"2-level DDCL, level {level} (epoch means; smallest batch V; largest batch residual; T at the "
            f"epoch's last step):", "",
            *rep.epoch_table({TWO_LEVEL: two}, {TWO_LEVEL: f"level {level}"},
                             (("l_q" + s, "L_q", "{:.3f}", 1.0), ("l_ols" + s, "L_OLS", "{:.3f}", 1.0),
                              ("v" + s, "V", "{:.3f}", 1.0), ("v_min" + s, "min V", "{:.3f}", 1.0),
                              ("identity_residual" + s, "max residual", "{:.1e}", 1.0),
                              ("utilization" + s, "util %", "{:.1f}", 100.0),
                              ("perplexity" + s, "ppl", "{:.0f}", 1.0),
                              ("temperature" + s, "T", "{:.2f}", 1.0)), epochs), ""]


def _per_epoch(groups: dict[str, list], labels: dict[str, str], epochs: int) -> list[str]:
    """Codebook health and validation PSNR per epoch (``health.png``), then the decomposition per epoch
    (``levels.png``): 1-level DDCL, and each level of the 2-level model."""
    two = groups.get(TWO_LEVEL, [])
    columns = (("utilization", "util %", "{:.1f}", 100.0), ("perplexity", "ppl", "{:.0f}", 1.0),
               ("val_psnr_hard", "val PSNR hard", "{:.2f}", 1.0))
    lines = [
        "## Codebook health and validation PSNR per epoch", "", "![health](health.png)", "",
        *rep.epoch_table(groups, labels, columns, epochs), "",
        "## Per-level decomposition per epoch", "", "![levels](levels.png)", "",
    ]
    if "ddcl" in groups:
        lines += ["1-level DDCL (epoch means; residual: largest batch):", "",
                  *rep.epoch_table({"ddcl": groups["ddcl"]}, labels,
                                   (("l_q", "L_q", "{:.3f}", 1.0), ("l_ols", "L_OLS", "{:.3f}", 1.0),
                                    ("v", "V", "{:.3f}", 1.0), ("identity_residual", "max residual", "{:.1e}", 1.0)),
                                   epochs), ""]
    for level in range(_levels(two) if two else 0):
        lines += _level_epoch_table(two, level, epochs)
    return lines


def write_report(runs: list[dict[str, Any]], checks: list[dict[str, Any]], settings: dict[str, Any], out: Path,
                 seconds: dict[str, float]) -> dict[str, Any]:
    """Write ``report.md``, ``results.json`` and :data:`PLOTS` into ``out``; returns the results."""
    out.mkdir(parents=True, exist_ok=True)
    epochs = int(settings["epochs"])
    groups = _groups(runs)
    labels = {r["key"]: r["label"] for r in runs}
    rep.plot_health(groups, labels, epochs, out / "health.png")
    plot_levels(groups, labels, epochs, out / "levels.png")
    lines = [*_intro(runs, settings, seconds),
             *_claim_and_test(groups, labels, checks, float(settings["identity_tolerance"])),
             *_per_epoch(groups, labels, epochs)]
    write_atomic(out / "report.md", "\n".join(lines))
    results = {"settings": settings, "seconds": seconds, "claim": checks, "runs": rep.runs_for_json(runs)}
    write_atomic(out / "results.json", json.dumps(portable(results), indent=1, default=str) + "\n")
    return results
