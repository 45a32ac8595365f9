"""``comparison.png``: the per-epoch curves of every quantizer a ``softvq-train`` command trained, side by side."""

from __future__ import annotations

import itertools
import os
from typing import Any

from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.figure import Figure

from softvq.models.files import write_atomic

# (title, history key on the validation split, key of the training epoch when the run has no validation, scale)
PANELS = (
    ("PSNR from hard indices (dB)", "val_psnr_hard", None, 1.0),
    ("utilization (%)", "val_utilization", "utilization", 100.0),
    ("dead codes", "val_dead_codes", "dead_codes", 1.0),
    ("perplexity", "val_perplexity", "perplexity", 1.0),
)


def curve(rows: list[dict[str, Any]], key: str | None) -> tuple[list[int], list[float]]:
    """``(epochs, values)`` of ``key`` over the history ``rows``, the epochs without a value left out."""
    points = [(row["epoch"], row[key]) for row in rows if key is not None and row.get(key) is not None]
    return [e for e, _ in points], [float(v) for _, v in points]


def comparison_figure(histories: dict[str, list[dict[str, Any]]]) -> Figure:
    """One panel per figure of :data:`PANELS` (validation PSNR, utilization, dead codes, perplexity) against the
    epoch, one line per quantizer, and the validation PSNR once more against the run's seconds. A figure the runs
    have on the validation split is drawn from it; a run without validation draws its training epoch's (restarted
    codes count as used there), and the panel's title says so.

    matplotlib's object API (``Figure``), not pyplot: no global backend or figure state is touched.
    """
    fig = Figure(figsize=(4.2 * (len(PANELS) + 1), 3.4), dpi=100, layout="constrained")
    *axes, timed = fig.subplots(1, len(PANELS) + 1)
    for ax, (title, val_key, train_key, scale) in zip(axes, PANELS, strict=True):
        train_only = False
        for name, rows in histories.items():
            epochs, values = curve(rows, val_key)
            if not epochs:
                epochs, values = curve(rows, train_key)
                train_only = train_only or bool(epochs)
            if epochs:
                ax.plot(epochs, [scale * v for v in values], marker="o", label=name)
        ax.set_title(f"{title}, {'training epoch' if train_only else 'validation'}", fontsize=10)
        ax.set_xlabel("epoch")
        ax.xaxis.get_major_locator().set_params(integer=True)
        ax.grid(alpha=0.3)
        if ax.lines:
            ax.legend(fontsize=8)
        else:
            ax.text(0.5, 0.5, "no validation split", ha="center", va="center", transform=ax.transAxes)
    # the first panel again against the seconds each run took (its epochs' recorded time_s, summed): a method whose
    # steps cost more is drawn where a user's clock would put it
    for name, rows in histories.items():
        points = [(row.get("time_s"), row.get("val_psnr_hard")) for row in rows]
        if points and all(t is not None and v is not None for t, v in points):
            timed.plot(list(itertools.accumulate(t for t, _ in points)), [v for _, v in points], marker="o", label=name)
    timed.set_title("PSNR from hard indices (dB), validation", fontsize=10)
    timed.set_xlabel("seconds (training and validation, summed over epochs)")
    timed.grid(alpha=0.3)
    if timed.lines:
        timed.legend(fontsize=8)
    else:
        timed.text(0.5, 0.5, "no validation split or no times", ha="center", va="center", transform=timed.transAxes)
    return fig


def write_comparison_png(histories: dict[str, list[dict[str, Any]]], path: str | os.PathLike) -> None:
    """:func:`comparison_figure` as a PNG at ``path``, written atomically."""
    fig = comparison_figure(histories)
    FigureCanvasAgg(fig)
    write_atomic(path, lambda f: fig.savefig(f, format="png"))
