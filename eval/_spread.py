"""Seed statistics: a mean and sample std, and whether one method's margin over another counts beyond the seed
spread (:func:`beyond_spread`, the rule of the reports; :func:`judge`, the paradigm-1 study's older rule)."""

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


MIN_SEEDS = 3


def beyond_spread(a: list[float], b: list[float]) -> dict[str, Any]:
    """The rule a report uses to say that one method's figure differs from another's: ``a`` and ``b`` are the two
    methods' values on the same seeds, in seed order. The difference of means counts when both have at least
    :data:`MIN_SEEDS` seeds, it exceeds the sum of the two sample standard deviations, and every seed's paired
    difference has its sign. Returns the difference, the spread (the sum of the stds), ``counts`` and a
    ``reason`` in words when it does not count."""
    margin = statistics.fmean(a) - statistics.fmean(b)
    spread = (statistics.stdev(a) if len(a) > 1 else 0.0) + (statistics.stdev(b) if len(b) > 1 else 0.0)
    if min(len(a), len(b)) < MIN_SEEDS:
        return {"margin": margin, "spread": spread, "counts": False,
                "reason": f"fewer than {MIN_SEEDS} seeds ({len(a)} and {len(b)})"}
    if len(a) != len(b):
        raise ValueError(f"paired seeds expected, got {len(a)} and {len(b)} values")
    diffs = [x - y for x, y in zip(a, b, strict=True)]
    same_sign = all(d > 0 for d in diffs) or all(d < 0 for d in diffs)
    if abs(margin) <= spread:
        reason = f"|{margin:.4g}| is within the spread {spread:.4g}"
    elif not same_sign:
        reason = "the seeds' paired differences change sign"
    else:
        reason = ""
    return {"margin": margin, "spread": spread, "counts": not reason, "reason": reason}
