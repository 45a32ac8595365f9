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

import numpy as np

from eval import render
from eval._provenance import ROOT, code_commit
from eval._spread import by_seed, describe, format_mean_std, mean_std
from eval.harness import LABELS
from eval.long_run.curves import THRESHOLDS_DB, _curve, _label, plot_curves
from eval.long_run.equal_compute import equal_compute, load_step_times
from softvq.models.callbacks import read_history
from softvq.models.files import write_atomic

# CVQ-VAE (Zheng & Vedaldi, "Online Clustered Codebook", ICCV 2023), CIFAR-10 reconstruction, mean per-image PSNR of
# 8-bit images: their own model and their VQ-VAE baseline, with their architecture and 500 epochs.
CVQ_VAE_ANCHORS_DB = {"CVQ-VAE": 24.72, "its VQ-VAE baseline": 23.32}
COLUMNS = (("psnr_hard", "PSNR hard (dB)", "{:.2f}", 1.0), ("ssim_hard", "SSIM hard", "{:.3f}", 1.0),
           ("psnr_8bit", "8-bit per-image PSNR (dB)", "{:.2f}", 1.0), ("utilization", "util %", "{:.1f}", 100.0),
           ("ppl_per_k", "perplexity / K", "{:.2f}", 1.0))
METHOD_ORDER = ("ddcl", "ddcl_exact", "ddcl_h25", "ddcl_wide", "hard_ema", "vqp_vq", "vqp_fsq", "vqp_simvq")


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


def test_table(methods: dict[str, list[dict[str, Any]]]) -> list[str]:
    """One row per method: mean ± sample std over its seeds (n beside) of the test figures in :data:`COLUMNS`."""
    lines = ["| bottleneck | n | " + " | ".join(c[1] for c in COLUMNS) + " |", "|---|---|" + "---|" * len(COLUMNS)]
    for runs in methods.values():
        cells = []
        for key, _, fmt, scale in COLUMNS:
            values = np.array([np.nan if r["test"].get(key) is None else r["test"][key] for r in runs], dtype=float)
            mean, std = mean_std(values * scale)
            cells.append(format_mean_std(float(mean), float(std), fmt, len(runs)))
        lines.append(f"| {_label(runs[0])} | {len(runs)} | " + " | ".join(cells) + " |")
    return lines


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


def render_test(sources: Sequence[tuple[Path, str]], flags: Sequence[str] = ()) -> list[str]:
    """The README/docs block ``long_run_test`` (:mod:`eval.render`): per K, the test table of the study's finished
    runs (the records in ``<folder>/runs/``). The flags are ignored: the records name their own methods (``ddcl_h25``:
    the former defaults)."""
    lines: list[str] = []
    for path, rel in sources:
        for k, methods in _groups(load_records(path)).items():
            runs = [r for rs in methods.values() for r in rs]
            commits = [r["code"] for r in runs if r.get("code")]
            settings = {**runs[0]["settings"], "num_codes": k}
            lines += [*test_table(methods), "", render.source_line(rel, commits, render.setting_of(settings), "test"),
                      ""]
    return lines[:-1]


def render_curves(sources: Sequence[tuple[Path, str]], flags: Sequence[str] = ()) -> list[str]:
    """The README/docs block ``long_run_curves``: per K, every method's validation hard PSNR after each epoch, the
    mean over its finished seeds."""
    lines: list[str] = []
    for path, rel in sources:
        for k, methods in _groups(load_records(path)).items():
            runs = [r for rs in methods.values() for r in rs]
            epochs = max(len(r["history"]) for r in runs)
            lines += [f"| K = {k} | n | " + " | ".join(str(e + 1) for e in range(epochs)) + " |",
                      "|---|---|" + "---|" * epochs]
            for rs in methods.values():
                cells = []
                for e in range(epochs):
                    vals = [r["history"][e].get("val_psnr_hard") for r in rs if len(r["history"]) > e]
                    vals = [v for v in vals if v is not None]
                    cells.append(f"{sum(vals) / len(vals):.2f}" if vals else "–")
                lines.append(f"| {_label(rs[0])} | {len(rs)} | " + " | ".join(cells) + " |")
            settings = {**runs[0]["settings"], "num_codes": k}
            lines += ["", render.source_line(rel, [r["code"] for r in runs if r.get("code")],
                                             render.setting_of(settings), "validation"), ""]
    return lines[:-1]
