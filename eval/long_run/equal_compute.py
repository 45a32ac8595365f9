"""The long study's equal-compute view: each method's validation curve on an axis of training seconds (its optimizer
steps times its training step, timed side by side by :mod:`eval.long_run.step_times`), the seconds each reaches 24 /
25 / 26 dB, and who is ahead at the hard VQ's budget. :func:`equal_compute` writes the section and its plots for
:func:`eval.long_run.report.write_report`.
"""

from __future__ import annotations

import json
import math
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from eval._spread import by_seed, describe
from eval.long_run.curves import _curve, _label, mean_curve, plot_curves

EQUAL_THRESHOLDS_DB = (24.0, 25.0, 26.0)  # the PSNRs whose seconds to reach the view gives
STEP_TIMES = "step_times.json"  # the measured step times (eval.long_run.step_times) in --out


def reach_interpolated(xs: Sequence[float], psnrs: Sequence[float | None], threshold: float) -> float | None:
    """Where the curve through ``(xs[i], psnrs[i])`` first reaches ``threshold``, linear between consecutive points:
    ``xs[0]`` when its first point is at or above it already (nothing is known before it), ``None`` when no point is.
    ``None`` or NaN entries are skipped (the line runs from the point before to the point after them).

    Raises:
        ValueError: the two sequences differ in length.
    """
    if len(xs) != len(psnrs):
        raise ValueError(f"xs and psnrs must have the same length, got {len(xs)} and {len(psnrs)}")
    before: tuple[float, float] | None = None
    for x, psnr in zip(xs, psnrs, strict=True):
        if psnr is None or math.isnan(psnr):
            continue
        if psnr >= threshold:
            if before is None:
                return float(x)
            x0, p0 = before  # p0 < threshold <= psnr
            return float(x0 + (threshold - p0) / (psnr - p0) * (x - x0))
        before = (float(x), float(psnr))
    return None


def value_at(xs: Sequence[float], psnrs: Sequence[float | None], x: float) -> float | None:
    """The curve through ``(xs[i], psnrs[i])`` (``None``/NaN entries skipped) at ``x``, linear between points;
    ``None`` outside its first and last points."""
    points = [(float(a), float(p)) for a, p in zip(xs, psnrs, strict=True) if p is not None and not math.isnan(p)]
    for (x0, p0), (x1, p1) in zip(points, points[1:], strict=False):
        if x0 <= x <= x1:
            return p0 if x1 == x0 else p0 + (x - x0) / (x1 - x0) * (p1 - p0)
    return points[0][1] if len(points) == 1 and points[0][0] == x else None


def load_step_times(out: Path) -> dict[str, Any] | None:
    """``out/step_times.json`` (:mod:`eval.long_run.step_times`), ``None`` when there is none."""
    path = out / STEP_TIMES
    return json.loads(path.read_text()) if path.is_file() else None


def _seconds(s: float) -> str:
    return f"{s:,.0f} s"


def is_hard(method: str) -> bool:
    """softvq's HardVQ (EMA + restart, capped or not): the hard VQ the relative speeds are against."""
    return method.startswith("hard_")


def equal_compute_rows(methods: dict[str, list[dict[str, Any]]], times: dict[str, dict[str, Any]],
                       thresholds: Sequence[float] = EQUAL_THRESHOLDS_DB) -> list[dict[str, Any]]:
    """Per method with a measured step (``times``: :mod:`eval.long_run.step_times`' entries at this K): its step
    time, and the seconds and epochs at which its mean curve (:func:`mean_curve`) first reaches each threshold
    (:func:`reach_interpolated`; seconds = optimizer steps x the median step time)."""
    rows = []
    for method, runs in methods.items():
        if method not in times:
            continue
        step_s = times[method]["median_ms"] / 1e3
        steps, epochs, mean = mean_curve(runs)
        seconds = [s * step_s for s in steps]
        psnrs = [float(p) for p in mean]
        per_seed = {r["seed"]: ([s * step_s for s in _curve(r)[0]], _curve(r)[1]) for r in runs}
        rows.append({"method": method, "label": _label(runs[0]), "n": len(runs), "step_s": step_s,
                     "images_per_s": times[method]["images_per_s"], "seconds": seconds, "psnrs": psnrs,
                     "per_seed": per_seed,
                     "epochs": epochs, "in_progress": any(r.get("in_progress") for r in runs),
                     "reach": {t: (reach_interpolated(seconds, psnrs, t), reach_interpolated(epochs, psnrs, t))
                               for t in thresholds}})
    return rows


def _ratio(a: float, b: float) -> str:
    return f"{a / b:.2f}x"


def equal_compute_table(methods: dict[str, list[dict[str, Any]]], step_times: dict[str, Any], k: int,
                        thresholds: Sequence[float] = EQUAL_THRESHOLDS_DB) -> tuple[list[str], list[dict[str, Any]]]:
    """The table of one K (every method, a method without a measured step marked not timed), a line naming the
    first method to reach each threshold, and the rows (:func:`equal_compute_rows`)."""
    times = step_times.get("times", {}).get(str(k), {})
    skipped = step_times.get("not_timed", {}).get(str(k), {})
    rows = equal_compute_rows(methods, times, thresholds)
    hard = [r["step_s"] for r in rows if is_hard(r["method"])]
    base = min(hard) if hard else min((r["step_s"] for r in rows), default=None)
    versus = "the fastest hard VQ" if hard else "the fastest method"
    lines = [f"| bottleneck | n | step ms (median) | images/s | speed vs {versus} | "
             + " | ".join(f"≥ {t:g} dB: seconds (epochs)" for t in thresholds) + " |",
             "|---|---|---|---|---|" + "---|" * len(thresholds)]
    by_method = {r["method"]: r for r in rows}
    for method, runs in methods.items():
        if method not in by_method:
            why = skipped.get(method, "no step time in the results file")
            lines.append(f"| {_label(runs[0])} | {len(runs)} | not timed ({why}) | | |" + " |" * len(thresholds))
            continue
        r = by_method[method]
        cells = []
        for t in thresholds:
            sec, ep = r["reach"][t]
            cells.append(f"{_seconds(sec)} ({ep:.2f})" if sec is not None else
                         f"not yet (epoch {r['epochs'][-1]})" if r["in_progress"] else "not reached")
        lines.append(f"| {r['label']} | {r['n']} | {r['step_s'] * 1e3:.1f} | {r['images_per_s']:.0f} | "
                     f"{_ratio(base, r['step_s'])} | " + " | ".join(cells) + " |")
    firsts = []
    for t in thresholds:
        reached = sorted((r["reach"][t][0], r["label"]) for r in rows if r["reach"][t][0] is not None)
        if not reached:
            firsts.append(f"{t:g} dB: none")
        elif len(reached) > 1:
            firsts.append(f"{t:g} dB: {reached[0][1]} ({_seconds(reached[0][0])}; next {reached[1][1]}, "
                          f"{_ratio(reached[1][0], reached[0][0])} its seconds)")
        else:
            firsts.append(f"{t:g} dB: {reached[0][1]} ({_seconds(reached[0][0])}; no other)")
    return lines + ["", "First to reach (mean curves): " + "; ".join(firsts) + "."], rows


_LEADS = {"mine": "DDCL ahead", "other": "the hard VQ ahead", "neither": "level"}


def at_budget(mine: dict[str, Any], other: dict[str, Any]) -> dict[str, Any]:
    """Two methods' rows (:func:`equal_compute_rows`) at the shorter of their two full budgets (the seconds of the
    faster one's last epoch): each mean curve there (:func:`value_at`; ``None`` where one has no figure), which is
    ahead (``"mine"``, ``"other"``, ``"neither"``), by how much, and whether that counts beyond the seed spread
    (each seed's curve at the budget, paired by seed: :func:`eval._spread.by_seed`)."""
    budget = min(mine["seconds"][-1], other["seconds"][-1])
    a, b = value_at(mine["seconds"], mine["psnrs"], budget), value_at(other["seconds"], other["psnrs"], budget)
    seeds_a = {s: value_at(x, p, budget) for s, (x, p) in mine["per_seed"].items()}
    seeds_b = {s: value_at(x, p, budget) for s, (x, p) in other["per_seed"].items()}
    try:
        judged = describe(by_seed({s: v for s, v in seeds_a.items() if v is not None},
                                  {s: v for s, v in seeds_b.items() if v is not None}))
    except ValueError:  # no seed in common
        judged = "no seed in common"
    lead = None if a is None or b is None else "mine" if a > b else "other" if b > a else "neither"
    return {"budget": budget, "epochs": min(mine["epochs"][-1], other["epochs"][-1]), "mine": a, "other": b,
            "lead": lead, "margin": None if a is None or b is None else abs(a - b), "judged": judged,
            "budget_of": "mine" if mine["seconds"][-1] <= other["seconds"][-1] else "other"}


def equal_compute_verdict(rows: list[dict[str, Any]], thresholds: Sequence[float] = EQUAL_THRESHOLDS_DB,
                          ours: str = "ddcl") -> tuple[list[str], list[tuple[dict[str, Any], dict[str, Any]]]]:
    """One paragraph per hard VQ: DDCL's (``ours``) step against its, who reaches each threshold first and by what
    factor of seconds, and the two mean curves at the shorter of their two full budgets (:func:`at_budget`): the one
    higher there is ahead at equal compute. Also each hard VQ's row with its :func:`at_budget`."""
    mine = next((r for r in rows if r["method"] == ours), None)
    if mine is None:
        return [], []
    lines, compared = [], []
    for other in (r for r in rows if is_hard(r["method"])):
        parts = []
        for t in thresholds:
            a, b = mine["reach"][t][0], other["reach"][t][0]
            if a is None and b is None:
                parts.append(f"{t:g} dB neither")
            elif b is None or (a is not None and a < b):
                parts.append(f"{t:g} dB DDCL first" + (f" (the hard VQ takes {_ratio(b, a)} its seconds)"
                                                      if b is not None else
                                                      f" (the hard VQ never, in {other['epochs'][-1]} epochs)"))
            elif a is None or b < a:
                parts.append(f"{t:g} dB the hard VQ first" + (f" (DDCL takes {_ratio(a, b)} its seconds)"
                                                              if a is not None else
                                                              f" (DDCL never, in {mine['epochs'][-1]} epochs)"))
            else:
                parts.append(f"{t:g} dB together")
        v = at_budget(mine, other)
        if v["lead"] is None:
            ahead = f"at {_seconds(v['budget'])} one of the curves has no figure yet"
        else:
            lead = {"mine": "DDCL", "other": "the hard VQ", "neither": "neither"}[v["lead"]]
            short = "DDCL's" if v["budget_of"] == "mine" else "the hard VQ's"
            ahead = (f"at {_seconds(v['budget'])} ({short} {v['epochs']} epochs) DDCL's mean curve is at "
                     f"{v['mine']:.2f} dB, the hard VQ's at {v['other']:.2f} dB: **{lead} ahead at equal compute by "
                     f"{v['margin']:.2f} dB** ({v['judged']})")
        lines += [f"DDCL against {other['label']}: its step takes {_ratio(mine['step_s'], other['step_s'])} the hard "
                  f"VQ's ({mine['step_s'] * 1e3:.0f} ms against {other['step_s'] * 1e3:.0f} ms); "
                  + ", ".join(parts) + f"; {ahead}.", ""]
        compared.append((other, v))
    return lines, compared


def equal_compute(groups: dict[int, dict[str, list[dict[str, Any]]]], step_times: dict[str, Any], out: Path,
                  thresholds: Sequence[float] = EQUAL_THRESHOLDS_DB) -> list[str]:
    """The report's equal-compute section: where the step times come from, and per K the validation curves against
    training seconds (``out/val_psnr_seconds_K<K>.png``), the table of :func:`equal_compute_table` and the verdict of
    :func:`equal_compute_verdict`."""
    st = step_times
    first = next(r for methods in groups.values() for runs in methods.values() for r in runs)["history"][0]
    per_epoch = f"{first['step'] // first['epoch']:,}"
    dirty = f" (uncommitted changes in {', '.join(st['dirty'])})" if st.get("dirty") else ""
    skipped = sorted({m for per_k in st.get("not_timed", {}).values() for m in per_k})
    lines = [
        "## Equal compute: validation PSNR against training seconds", "",
        f"Step times: measured at {st['code']}{dirty} on {st['date']}, {st['cpu']} ({st['cores']} cores), "
        f"{st['threads']} torch thread(s) (the runs trained with one), torch {st['torch']}, by `{st['command']}`"
        + (f"; {st['note']}" if st.get("note") else "") + f" (load average before: {st['load_before'][0]:.2f}). "
        f"The training step of every model of the study (the VQ-VAE and bottleneck as the runs build them, batch "
        f"{st['batch_size']}: forward, backward, the optimizer step and the metric updates; no data loading, no "
        f"validation pass), timed side by side in one process by `eval.bench_train`'s harness: "
        f"{st['rounds']} interleaved rounds of {st['steps']} timed steps per model after {st['warmup']} warm-up "
        f"steps; the median per model. Results file: [`{STEP_TIMES}`]({STEP_TIMES})."
        + (f" Not timed: {', '.join(skipped)} (see the tables)." if skipped else ""), "",
        f"The seconds axis is each epoch's optimizer steps ({per_epoch} an epoch) times the method's *measured* "
        "median step, not the runs' recorded wall time: the runs trained on different machines, under different "
        "loads and at different commits (header), so their wall times compare neither with each other nor with "
        "a user's. The step time is today's code's; the curves are the records'. Mean curves over the seeds, at "
        "the epochs every seed has reached; a threshold's seconds and epochs interpolate linearly between epoch "
        "ends (a curve already above it at epoch 1 reaches it at epoch 1).", ""]
    intro, summary = len(lines), []
    for k, methods in groups.items():
        if str(k) not in st.get("times", {}):
            continue
        table, rows = equal_compute_table(methods, st, k, thresholds)
        plot_curves(methods, k, out / f"val_psnr_seconds_K{k}.png", thresholds,
                    {r["method"]: r["step_s"] for r in rows})
        lines += [f"### K = {k}", "",
                  f"![validation PSNR against training seconds, K = {k}](val_psnr_seconds_K{k}.png)", "",
                  "Mean validation hard PSNR against cumulative training seconds: epoch e at its optimizer steps "
                  f"(e x {per_epoch}) x the method's measured median step time (this table), not the runs' recorded "
                  "wall time.", "", *table, ""]
        verdict, compared = equal_compute_verdict(rows, thresholds)
        lines += verdict
        summary += [f"K = {k}: " + "; ".join(
            f"against {other['label']} " + (f"{_LEADS[v['lead']]} by {v['margin']:.2f} dB at "
                                            f"{_seconds(v['budget'])}, {v['judged']}"
                                            if v["lead"] is not None else "not yet comparable")
            for other, v in compared)]
    if summary:
        lines[intro:intro] = ["**Who is ahead at equal compute** (DDCL's mean validation curve against each hard VQ's "
                              "at the shorter of their two whole runs' seconds): " + ". ".join(summary) + ".", ""]
    return lines
