"""``--out/report.md`` of :mod:`eval.long_run`: per K the test split's table over seeds, the validation curves, the
steps each run took to reach fixed validation PSNRs, and DDCL's per-epoch margin over the best peer against the seed
spread; with ``--out/step_times.json`` (:mod:`eval.long_run.step_times`) an equal-compute view: the mean validation
curves against training seconds at each method's measured step time, and the seconds each takes to reach fixed PSNRs.

Built from the finished records in ``--out/runs/*.json`` and, for runs still training, their ``history.jsonl`` under
``--runs`` (marked "in progress"). Reads files only; imports nothing of the runner.
"""

from __future__ import annotations

import json
import math
import os
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
import numpy as np  # noqa: E402

from eval._provenance import ROOT, code_commit  # noqa: E402
from eval._spread import by_seed, describe  # noqa: E402
from eval.compare.report import _fmt, mean_std  # noqa: E402
from eval.peers import LABELS  # noqa: E402
from softvq.models.callbacks import read_history  # noqa: E402
from softvq.models.files import write_atomic  # noqa: E402

THRESHOLDS_DB = (23.0, 24.0, 25.0)  # validation hard-index PSNRs whose first crossing the report gives
EQUAL_THRESHOLDS_DB = (24.0, 25.0, 26.0)  # the equal-compute view's: seconds to reach them
STEP_TIMES = "step_times.json"  # the measured step times (eval.long_run.step_times) in --out
# CVQ-VAE (Zheng & Vedaldi, "Online Clustered Codebook", ICCV 2023), CIFAR-10 reconstruction, mean per-image PSNR of
# 8-bit images: their own model and their VQ-VAE baseline, with their architecture and 500 epochs.
CVQ_VAE_ANCHORS_DB = {"CVQ-VAE": 24.72, "its VQ-VAE baseline": 23.32}
COLUMNS = (("psnr_hard", "PSNR hard (dB)", "{:.2f}", 1.0), ("ssim_hard", "SSIM hard", "{:.3f}", 1.0),
           ("psnr_8bit", "8-bit per-image PSNR (dB)", "{:.2f}", 1.0), ("utilization", "util %", "{:.1f}", 100.0),
           ("ppl_per_k", "perplexity / K", "{:.2f}", 1.0))
METHOD_ORDER = ("ddcl", "ddcl_h25", "ddcl_wide", "hard_ema", "vqp_vq", "vqp_fsq", "vqp_simvq")


def is_ours(method: str) -> bool:
    """Whether ``method`` is DDCL, its defaults or a candidate setting (``ddcl_*``): never a peer to beat."""
    return method == "ddcl" or method.startswith("ddcl_")


def steps_to_reach(steps: Sequence[int], psnrs: Sequence[float | None], threshold: float) -> int | None:
    """The first of ``steps`` whose PSNR is at least ``threshold`` (a curve that falls back later still reached it
    there); ``None`` when none is. ``psnrs[i]`` is the PSNR after ``steps[i]`` optimizer steps; ``None`` or NaN
    entries (no validation that epoch) never count.

    Raises:
        ValueError: the two sequences differ in length.
    """
    if len(steps) != len(psnrs):
        raise ValueError(f"steps and psnrs must have the same length, got {len(steps)} and {len(psnrs)}")
    for step, psnr in zip(steps, psnrs, strict=True):
        if psnr is not None and not math.isnan(psnr) and psnr >= threshold:
            return int(step)
    return None


def load_records(out: Path) -> list[dict[str, Any]]:
    """The finished runs' records in ``out/runs/``, sorted by K, method and seed."""
    records = [json.loads(p.read_text()) for p in sorted((out / "runs").glob("*.json"))]
    return sorted(records, key=_order)


def _order(run: dict[str, Any]) -> tuple[int, int, int]:
    method = run["method"]
    return run["num_codes"], METHOD_ORDER.index(method) if method in METHOD_ORDER else len(METHOD_ORDER), run["seed"]


def in_progress(runs: Path, finished: set[str]) -> list[dict[str, Any]]:
    """Runs under ``runs`` (``K<K>/<method>/seed<S>/``) with at least one epoch in ``history.jsonl`` that have no
    finished record (named ``K<K>_<method>_seed<S>`` in ``finished``) and no ``result.json``."""
    partial = []
    for history in sorted(runs.glob("K*/*/seed*/history.jsonl")):
        directory = history.parent
        k_name, seed_name = directory.parent.parent.name[1:], directory.name[4:]
        if not (k_name.isdigit() and seed_name.isdigit()):
            continue  # not a run directory of the study
        k, method, seed = int(k_name), directory.parent.name, int(seed_name)
        rows = read_history(history)
        if f"K{k}_{method}_seed{seed}" in finished or (directory / "result.json").exists() or not rows:
            continue
        settings_path = directory / "settings.json"
        settings = json.loads(settings_path.read_text()) if settings_path.is_file() else {}
        partial.append({"method": method, "num_codes": k, "seed": seed, "label": LABELS.get(method, method),
                        "history": rows, "settings": settings, "in_progress": True})
    return sorted(partial, key=_order)


def _groups(runs: list[dict[str, Any]]) -> dict[int, dict[str, list[dict[str, Any]]]]:
    out: dict[int, dict[str, list[dict[str, Any]]]] = {}
    for run in sorted(runs, key=_order):
        out.setdefault(run["num_codes"], {}).setdefault(run["method"], []).append(run)
    return dict(sorted(out.items()))


def _label(run: dict[str, Any]) -> str:
    return run.get("label") or run["method"]


def test_table(methods: dict[str, list[dict[str, Any]]]) -> list[str]:
    """One row per method: mean ± sample std over its seeds (n beside) of the test figures in :data:`COLUMNS`."""
    lines = ["| bottleneck | n | " + " | ".join(c[1] for c in COLUMNS) + " |", "|---|---|" + "---|" * len(COLUMNS)]
    for runs in methods.values():
        cells = []
        for key, _, fmt, scale in COLUMNS:
            values = np.array([np.nan if r["test"].get(key) is None else r["test"][key] for r in runs], dtype=float)
            mean, std = mean_std(values * scale)
            cells.append(_fmt(float(mean), float(std), fmt, len(runs)))
        lines.append(f"| {_label(runs[0])} | {len(runs)} | " + " | ".join(cells) + " |")
    return lines


def _curve(run: dict[str, Any], key: str = "val_psnr_hard") -> tuple[list[int], list[float | None]]:
    return [row["step"] for row in run["history"]], [row.get(key) for row in run["history"]]


def reach_table(runs: list[dict[str, Any]], thresholds: Sequence[float]) -> list[str]:
    """Per method and seed the first step (epoch end) whose validation hard PSNR reaches each threshold."""
    lines = ["| bottleneck | seed | " + " | ".join(f"≥ {t:g} dB" for t in thresholds) + " |",
             "|---|---|" + "---|" * len(thresholds)]
    for run in runs:
        steps, psnrs = _curve(run)
        cells = []
        for t in thresholds:
            step = steps_to_reach(steps, psnrs, t)
            if step is not None:
                epoch = run["history"][steps.index(step)]["epoch"]
                cells.append(f"step {step} (epoch {epoch})")
            else:
                cells.append("not yet" if run.get("in_progress") else "not reached")
        mark = f" (in progress, epoch {_progress(run)})" if run.get("in_progress") else ""
        lines.append(f"| {_label(run)} | {run['seed']}{mark} | " + " | ".join(cells) + " |")
    return lines


def falls(run: dict[str, Any]) -> list[float]:
    """The falls (dB, positive) of a run's validation hard PSNR from one epoch's end to the next, in epoch order;
    an epoch without a figure breaks the chain (no fall is read across it)."""
    _, psnrs = _curve(run)
    return [a - b for a, b in zip(psnrs[:-1], psnrs[1:], strict=True) if a is not None and b is not None and b < a]


def falls_table(methods: dict[str, list[dict[str, Any]]]) -> list[str]:
    """Per method: how far its validation curve falls back between consecutive epochs (the swing a user choosing the
    best checkpoint or stopping early meets), over its seeds: the largest fall, the mean of each seed's largest, and
    how many falls of more than 0.1 dB its seeds had together."""
    lines = ["| bottleneck | n | largest fall (dB) | mean of each seed's largest (dB) | falls > 0.1 dB |",
             "|---|---|---|---|---|"]
    for runs in methods.values():
        per_seed = [falls(r) for r in runs]
        largest = [max(f, default=0.0) for f in per_seed]
        big = sum(1 for f in per_seed for x in f if x > 0.1)
        lines.append(f"| {_label(runs[0])} | {len(runs)} | {max(largest):.2f} | {float(np.mean(largest)):.2f} | "
                     f"{big} |")
    return lines


def _progress(run: dict[str, Any]) -> str:
    return f"{run['history'][-1]['epoch']}/{run['settings'].get('epochs', '?')}"


def epoch_margins(methods: dict[str, list[dict[str, Any]]], ours: str = "ddcl") -> list[str]:
    """Per epoch: DDCL's (``ours``: the defaults or a candidate setting) validation hard PSNR against the best peer's
    (best by mean over its seeds at that epoch; DDCL's candidates are no peers, :func:`is_ours`), the margin, and
    whether it counts beyond the seed spread (:func:`eval._spread.by_seed`, paired by seed)."""
    if ours not in methods or not any(not is_ours(m) for m in methods):
        return []
    lines = ["| epoch | DDCL val PSNR hard | best peer | its val PSNR hard | margin (dB) | seed spread |",
             "|---|---|---|---|---|---|"]
    epochs = sorted({row["epoch"] for runs in methods.values() for r in runs for row in r["history"]})
    for epoch in epochs:
        at = {m: {r["seed"]: row["val_psnr_hard"] for r in runs for row in r["history"]
                  if row["epoch"] == epoch and row.get("val_psnr_hard") is not None} for m, runs in methods.items()}
        peers = {m: v for m, v in at.items() if not is_ours(m) and v}
        if not at[ours] or not peers:
            continue
        best = max(peers, key=lambda m: float(np.mean(list(peers[m].values()))))
        mine, theirs = float(np.mean(list(at[ours].values()))), float(np.mean(list(peers[best].values())))
        try:
            judged = describe(by_seed(at[ours], peers[best]))
        except ValueError:  # no seed in common yet
            judged = "no seed in common"
        lines.append(f"| {epoch} | {mine:.2f} (n={len(at[ours])}) | {_label(methods[best][0])} | {theirs:.2f} "
                     f"(n={len(peers[best])}) | {mine - theirs:+.2f} | {judged} |")
    return lines


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


def _relative(path: Path) -> str:
    return Path(os.path.relpath(os.path.abspath(path), ROOT)).as_posix()


def header(finished: list[dict[str, Any]], partial: list[dict[str, Any]], out: Path, runs: Path,
           step_times: dict[str, Any] | None = None) -> list[str]:
    every = finished + partial
    codes = sorted({r["code"] for r in finished} | {i["code"] for r in finished for i in r.get("invocations", [])})
    commands = sorted({r["command"] for r in finished})
    settings = (finished or partial)[0]["settings"]
    differ = sorted({key for r in every for key in r["settings"] if key not in ("num_codes", "threads")
                     and r["settings"].get(key) != settings.get(key)})
    seeds = "; ".join(f"K = {k}: " + ", ".join(f"{m} {sorted(r['seed'] for r in rs)}" for m, rs in ms.items())
                      for k, ms in _groups(every).items())
    test_images = settings.get("test_limit") or 10000
    train = (f"all but the {settings.get('val_size')} held out for validation (45,000 of CIFAR-10's 50,000)"
             if settings.get("train_subset") is None else f"{settings['train_subset']}")
    return [
        "# Long training: the VQ-VAE on all training images, per bottleneck, K and seed", "",
        f"Regenerate: `python -m eval.long_run --no-train --runs {_relative(runs)} --out {_relative(out)}` (the "
        f"report from the records in `{_relative(out)}/runs/` and the runs in progress under `{_relative(runs)}`)", "",
        f"Code: runs trained at {', '.join(codes) or 'none finished yet'} (a resumed run lists each); "
        + (f"step times measured at {step_times['code']}; " if step_times else "")
        + f"report written at {code_commit()}.", "",
        "Runs trained by: " + ("; ".join(f"`{c}`" for c in commands) or "none finished yet") + ".", "",
        f"Setting: width {settings.get('width')}, residual blocks {settings.get('res_blocks')}, D = "
        f"{settings.get('code_dim')}, Adam {settings.get('lr')}, batch {settings.get('batch_size')}, "
        f"{train} training images, {settings.get('epochs')} epochs. Seeds: {seeds}.", "",
        f"The validation split ({settings.get('val_size')} held-out training images) is scored after every epoch; the "
        f"official test split ({test_images} images) once, at the end of each run.", "",
        *([f"**The records differ in {', '.join(differ)}**: the tables mix settings.", ""] if differ else []),
        *([f"Equal-compute view (last section): step times measured at {step_times['code']} on "
           f"{step_times['date'][:10]}, `{step_times['command']}`.", ""] if step_times else []),
    ]


def write_report(out: Path, runs: Path, planned: Sequence[str] = (),
                 thresholds: Sequence[float] = THRESHOLDS_DB) -> dict[str, Any]:
    """Write ``out/report.md`` and ``out/val_psnr_K<K>.png`` from the records in ``out/runs/`` and the partial runs
    under ``runs``, with ``out/step_times.json`` also the equal-compute section (:func:`equal_compute`) and its
    ``out/val_psnr_seconds_K<K>.png``; ``planned``: run names (``K<K>_<method>_seed<S>``) listed as not started when
    neither exists.
    Returns ``{"finished": records, "in_progress": partial runs, "not_started": names}``.

    Raises:
        FileNotFoundError: there is neither a record nor a partial run.
    """
    finished = load_records(out)
    names = {f"K{r['num_codes']}_{r['method']}_seed{r['seed']}" for r in finished}
    partial = in_progress(runs, names)
    names |= {f"K{r['num_codes']}_{r['method']}_seed{r['seed']}" for r in partial}
    not_started = [name for name in planned if name not in names]
    if not finished and not partial:
        raise FileNotFoundError(f"no finished record in {out / 'runs'} and no run in progress under {runs}")
    out.mkdir(parents=True, exist_ok=True)
    step_times = load_step_times(out)
    lines = header(finished, partial, out, runs, step_times)
    if partial:
        lines += ["In progress: " + ", ".join(f"{r['method']} K={r['num_codes']} seed {r['seed']} (epoch "
                                              f"{_progress(r)})" for r in partial) + ".", ""]
    if not_started:
        lines += [f"Not started: {', '.join(not_started)}.", ""]
    done, every = _groups(finished), _groups(finished + partial)
    for k, methods in every.items():
        lines += [f"## K = {k}", ""]
        if k in done:
            anchors = ", ".join(f"{name} {db:.2f} dB" for name, db in CVQ_VAE_ANCHORS_DB.items())
            lines += ["Test split, finished runs (mean ± sample std over the seeds; n seeds):", "",
                      *test_table(done[k]), "",
                      f"8-bit per-image PSNR is CVQ-VAE's metric (reconstruction and image rounded to 8 bits, PSNR "
                      f"per image, mean over images; a perfect image scores as one level off). Published anchors on "
                      f"CIFAR-10: {anchors}; their encoder, decoder and 500 epochs differ from this study's, so they "
                      f"place the scale and are no like-for-like comparison.", ""]
        plot_curves(methods, k, out / f"val_psnr_K{k}.png", thresholds)
        lines += [f"![validation PSNR, K = {k}](val_psnr_K{k}.png)", "",
                  "Steps to reach a validation hard PSNR (first epoch end at or above it):", "",
                  *reach_table([r for runs_ in methods.values() for r in runs_], thresholds), ""]
        if k in done:
            lines += ["Falls of the validation curve between consecutive epochs (finished runs):", "",
                      *falls_table(done[k]), ""]
        for ours in (m for m in methods if is_ours(m)):
            margins = epoch_margins(methods, ours)
            if margins:
                what = "DDCL" if ours == "ddcl" else f"{_label(methods[ours][0])} (`{ours}`)"
                lines += [f"{what} against the best peer on the validation split, per epoch:", "", *margins, ""]
    if step_times:
        lines += equal_compute(every, step_times, out)
    write_atomic(out / "report.md", "\n".join(lines))
    return {"finished": finished, "in_progress": partial, "not_started": not_started}
