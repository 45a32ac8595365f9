"""Seed statistics and the one rule every report uses to say that two methods differ (a leaf module).

:func:`beyond_spread` is the rule: the difference of means counts when both methods have at least :data:`MIN_SEEDS`
seeds, it exceeds the sum of the two sample standard deviations, and every seed's paired difference has its sign;
otherwise it is "within the spread". :func:`by_seed` pairs two methods' per-seed values before applying it, and
:func:`verdict` / :func:`describe` put its result into the words the reports print.
"""

from __future__ import annotations

import math
import statistics
import warnings
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

MIN_SEEDS = 3


def mean_std(values: np.ndarray, axis: int = 0) -> tuple[np.ndarray, np.ndarray]:
    """Mean and sample standard deviation (ddof 1; 0 for a single run) over ``axis``, ignoring NaN."""
    values = np.asarray(values, dtype=float)
    with np.errstate(invalid="ignore"), warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)  # an all-NaN column, or one value (no spread)
        mean = np.nanmean(values, axis=axis)
        count = np.sum(~np.isnan(values), axis=axis)
        std = np.where(count > 1, np.nanstd(values, axis=axis, ddof=1) if values.shape[axis] > 1 else 0.0, 0.0)
    return mean, std


def format_mean_std(mean: float, std: float, fmt: str, n: int) -> str:
    """``mean ± std`` in ``fmt`` (the spread only for ``n`` > 1 seeds); ``n/a`` for a mean that is not finite."""
    if not math.isfinite(mean):
        return "n/a"
    return fmt.format(mean) + (f" ± {fmt.format(std)}" if n > 1 else "")


def summarize(values: list[float]) -> dict[str, Any]:
    """Mean, sample standard deviation (0 for one value) and the values themselves."""
    return {"mean": statistics.fmean(values), "std": statistics.stdev(values) if len(values) > 1 else 0.0,
            "values": values}


def beyond_spread(a: Sequence[float], b: Sequence[float], *, exact_b: bool = False) -> dict[str, Any]:
    """Whether ``mean(a) - mean(b)`` counts beyond the seed spread: ``a`` and ``b`` are the two methods' values on
    the same seeds, in seed order.

    ``exact_b``: ``b`` is one value of a deterministic reference (e.g. a convex bound fitted once), which has no
    spread; it is compared with every seed of ``a``.

    Returns ``margin`` (the difference of means), ``spread`` (the sum of the two sample stds), ``counts`` and
    ``reason``: the words for why it does not count, ``""`` when it does.
    """
    a, b = [float(x) for x in a], [float(x) for x in b]
    if not a or not b:
        raise ValueError(f"beyond_spread needs values of both methods, got {len(a)} and {len(b)}")
    if exact_b:
        if len(b) != 1:
            raise ValueError(f"exact_b: one reference value expected, got {len(b)}")
        b = b * len(a)
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
        reason = f"the margin {margin:+.3g} is within the spread {spread:.3g}"  # no "|": it sits in tables
    elif not same_sign:
        reason = "the seeds' paired differences change sign"
    else:
        reason = ""
    return {"margin": margin, "spread": spread, "counts": not reason, "reason": reason}


def by_seed(a: Mapping[int, float], b: Mapping[int, float]) -> dict[str, Any]:
    """:func:`beyond_spread` on the seeds both methods have (``{seed: value}`` each), paired by seed; adds
    ``seeds`` (those used). The means in ``margin`` are over those common seeds only."""
    seeds = sorted(set(a) & set(b))
    if not seeds:
        raise ValueError(f"no seed in common: {sorted(a)} and {sorted(b)}")
    return {**beyond_spread([a[s] for s in seeds], [b[s] for s in seeds]), "seeds": seeds}


def verdict(result: Mapping[str, Any]) -> str:
    """``"higher"`` / ``"lower"`` (``a`` against ``b``) when the margin counts, else ``"within spread"``."""
    if not result["counts"]:
        return "within spread"
    return "higher" if result["margin"] > 0 else "lower"


def describe(result: Mapping[str, Any]) -> str:
    """The report's words: "beyond the seed spread" or "within the seed spread (<reason>)"."""
    return "beyond the seed spread" if result["counts"] else f"within the seed spread ({result['reason']})"
