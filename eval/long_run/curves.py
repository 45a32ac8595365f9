"""The long study's validation curves, shared by its report (:mod:`eval.long_run.report`) and its equal-compute view
(:mod:`eval.long_run.equal_compute`): a run's curve, a method's mean over seeds, and their plot against optimizer steps
or training seconds."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
import numpy as np  # noqa: E402

from eval._spread import mean_std  # noqa: E402

THRESHOLDS_DB = (23.0, 24.0, 25.0)  # validation hard-index PSNRs whose first crossing the report gives


def _label(run: dict[str, Any]) -> str:
    return run.get("label") or run["method"]


def _curve(run: dict[str, Any], key: str = "val_psnr_hard") -> tuple[list[int], list[float | None]]:
    return [row["step"] for row in run["history"]], [row.get(key) for row in run["history"]]


def mean_curve(runs: list[dict[str, Any]]) -> tuple[list[int], list[int], np.ndarray]:
    """A method's validation hard PSNR averaged over its seeds (``runs``), at the epochs every seed has reached: the
    epochs' optimizer steps (the first seed's), the epochs, and the mean (NaN where no seed has a figure)."""
    common = min(len(r["history"]) for r in runs)
    values = np.array([[np.nan if p is None else p for p in _curve(r)[1][:common]] for r in runs], dtype=float)
    mean, _ = mean_std(values)
    history = runs[0]["history"][:common]
    return [row["step"] for row in history], [row["epoch"] for row in history], np.asarray(mean, dtype=float)


def plot_curves(methods: dict[str, list[dict[str, Any]]], k: int, path: Path,
                thresholds: Sequence[float] = THRESHOLDS_DB, step_seconds: dict[str, float] | None = None) -> None:
    """Validation hard PSNR against optimizer steps: per method a thin line per seed (dashed while in progress) and
    the mean over its seeds (:func:`mean_curve`). With ``step_seconds`` (seconds per step, per method) against
    training seconds instead, each method's steps times its step time; methods without one are left out."""
    fig, ax = plt.subplots(figsize=(8, 5))
    for i, (method, runs) in enumerate(methods.items()):
        color = f"C{i}"
        if step_seconds is not None and method not in step_seconds:
            continue
        scale = step_seconds[method] if step_seconds is not None else 1
        for run in runs:
            steps, psnrs = _curve(run)
            ax.plot([s * scale for s in steps], [np.nan if p is None else p for p in psnrs], color=color, lw=0.8,
                    alpha=0.45, ls="--" if run.get("in_progress") else "-")
        steps, _, mean = mean_curve(runs)
        ax.plot([s * scale for s in steps], mean, color=color, lw=2, marker="o", ms=3,
                label=f"{_label(runs[0])} (mean of {len(runs)})")
    for t in thresholds:
        ax.axhline(t, color="grey", lw=0.6, ls=":")
    ax.set_xlabel("optimizer steps" if step_seconds is None else
                  "training seconds (optimizer steps x the measured median step time)")
    ax.set_ylabel("validation PSNR from hard indices (dB)")
    ax.set_title(f"K = {k}", fontsize=10)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
