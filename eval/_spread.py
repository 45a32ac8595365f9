"""Seed statistics of the paradigm-1 study: a mean and sample std, and whether one method's margin over another
counts beyond the seed spread."""

from __future__ import annotations

import statistics
from typing import Any


def summarize(values: list[float]) -> dict[str, float]:
    return {"mean": statistics.fmean(values), "std": statistics.stdev(values) if len(values) > 1 else 0.0,
            "values": values}


def judge(a: list[float], b: list[float]) -> dict[str, Any]:
    """``a`` vs ``b`` over the same seeds (a single value = a deterministic method, repeated): the margin
    ``mean(a) - mean(b)`` counts when it exceeds twice the larger sample std and every paired difference has its
    sign. Verdict: ``"higher"``, ``"lower"`` or ``"within spread"``."""
    if len(a) == 1:
        a = a * len(b)
    if len(b) == 1:
        b = b * len(a)
    margin = statistics.fmean(a) - statistics.fmean(b)
    spread = max(statistics.stdev(a) if len(a) > 1 else 0.0, statistics.stdev(b) if len(b) > 1 else 0.0)
    diffs = [x - y for x, y in zip(a, b, strict=True)]
    same_sign = all(d > 0 for d in diffs) or all(d < 0 for d in diffs)
    counts = abs(margin) > 2 * spread and same_sign
    return {"margin": margin, "spread": spread, "verdict": ("higher" if margin > 0 else "lower") if counts
            else "within spread"}
