"""The per-second report: validation PSNR against seconds for every method and K of eval.per_second.

    python -m eval.per_second.report [--out reports/per_second]

Reads the finished runs (``--out/runs/*.json``) and the step costs (``--out/step_cost.json``, from
:mod:`eval.per_second.step_cost`), writes ``--out/report.md`` (a table per K, then ``--out/reading.txt``, the
hand-written reading, where there is one) and ``--out/psnr_vs_seconds.png``.

A run's seconds at the end of epoch ``e`` are its optimizer steps to then times its method's median step cost measured
side by side (``ddcl_anneal``: the steps of each phase times that phase's k's cost, ``ddcl_anneal@k`` or the same
layer's ``ddcl_k<k>``). The budget at each K is the
seconds the fastest hard VQ (``hard_ema`` or ``hard_ema_cap``) needs for its epochs; every method's validation PSNR
(hard codes) at that budget is read off its curve, linear between epoch ends ("–" where the budget ends before its
first epoch).
"""

from __future__ import annotations

import argparse
import json
import statistics
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np

from eval import harness
from eval._bench import markdown_table
from eval._spread import by_seed, describe, format_mean_std, mean_std
from eval.per_second.plan import OUT

HARD = ("hard_ema", "hard_ema_cap")


def load_runs(out: Path) -> list[dict[str, Any]]:
    return [json.loads(p.read_text()) for p in sorted((out / "runs").glob("K*_seed*.json"))]


def step_seconds(costs: dict[str, list[float]], method: str, num_codes: int, steps: int, total: int) -> float | None:
    """The seconds of a run's first ``steps`` optimizer steps of ``total``; ``None`` without a measured cost."""
    if method == "ddcl_anneal":
        per_k: dict[int, int] = {}
        for step in range(steps):
            k = harness.anneal_k(step, total, num_codes)
            per_k[k] = per_k.get(k, 0) + 1
        names = {k: f"ddcl_anneal@{k}" if f"ddcl_anneal@{k}" in costs else f"ddcl_k{k}" for k in per_k}
        if not all(name in costs for name in names.values()):
            return None
        return sum(count * statistics.median(costs[names[k]]) for k, count in per_k.items())
    return steps * statistics.median(costs[method]) if method in costs else None


def curve(run: dict[str, Any], costs: dict[str, list[float]]) -> list[tuple[float, float]] | None:
    """``(seconds, validation hard PSNR)`` at each epoch end, or ``None`` without the method's cost."""
    steps = [row["step"] for row in run["history"]]
    total = steps[-1] if steps else 0
    points = []
    for step, row in zip(steps, run["history"], strict=True):
        seconds = step_seconds(costs, run["method"], run["num_codes"], step, total)
        if seconds is None:
            return None
        points.append((seconds, row["val_psnr_hard"]))
    return points


def at(points: list[tuple[float, float]], seconds: float) -> float | None:
    """The PSNR at ``seconds`` on a curve, linear between epoch ends; its last value past its end."""
    if not points or seconds < points[0][0]:
        return None
    for (s0, v0), (s1, v1) in zip(points, points[1:], strict=False):
        if s0 <= seconds <= s1:
            return v0 + (v1 - v0) * (seconds - s0) / (s1 - s0)
    return points[-1][1]


def tables(runs: list[dict[str, Any]], cost: dict[str, Any]) -> tuple[str, dict[int, dict[str, list]]]:
    """The report's tables (one per K) and each K's curves for the plot."""
    out, curves = [], {}
    for num_codes in sorted({r["num_codes"] for r in runs}):
        costs = cost.get("steps", {}).get(str(num_codes), {})
        here = [r for r in runs if r["num_codes"] == num_codes]
        lines = {f"{r['method']} s{r['seed']}": curve(r, costs) for r in here}
        hard_ends = [pts[-1][0] for r, pts in zip(here, lines.values(), strict=True) if r["method"] in HARD and pts]
        budget = min(hard_ends) if hard_ends else None
        base = statistics.median(costs["hard_ema"]) if "hard_ema" in costs else None
        rows = []
        for r, pts in zip(here, lines.values(), strict=True):
            last = r["history"][-1]
            method_cost = step_seconds(costs, r["method"], num_codes, 1, last["step"])
            rows.append([
                r["method"], str(r["seed"]), " / ".join(f"{h['val_psnr_hard']:.2f}" for h in r["history"]),
                f"{100 * last['val_utilization']:.1f}", f"{last['val_perplexity'] / num_codes:.3f}",
                "–" if last.get("temperature") is None else f"{last['temperature']:.3g}",
                "–" if last.get("temperature") is None else f"{last.get('entropy', float('nan')):.2f}",
                "–" if method_cost is None else f"{method_cost * 1e3:.0f}",
                "–" if method_cost is None or base is None else f"{base / method_cost:.2f}x",
                "–" if not pts else f"{pts[-1][0]:.0f}",
                "–" if budget is None or not pts or at(pts, budget) is None else f"{at(pts, budget):.2f}",
                r.get("code", "?")])
        head = ["method", "seed", "val PSNR hard per epoch (dB)", "val util %", "val ppl / K", "T end", "H end",
                "step ms", "images/s vs hard_ema", "s for its epochs",
                "val PSNR at the fastest hard VQ's seconds" + ("" if budget is None else f" ({budget:.0f} s)"),
                "code"]
        out.append(f"### K = {num_codes}\n\n" + markdown_table(head, rows))
        summary = seed_summary(here, lines, budget, num_codes)
        if summary:
            out.append(summary)
        curves[num_codes] = {name: pts for name, pts in lines.items() if pts}
    return "\n\n".join(out), curves


def seed_summary(runs: list[dict[str, Any]], lines: dict[str, list | None], budget: float | None,
                 num_codes: int) -> str:
    """Where a method has several seeds: per method the mean ± sample std over its seeds of the final validation PSNR
    and of the PSNR at the fastest hard VQ's seconds, its lowest utilization, and (eval._spread's rule, paired by
    seed) whether each differs from the strongest hard VQ at that K (the hard VQ with the best mean at the budget
    among those run on the most seeds)."""
    final: dict[str, dict[int, float]] = {}
    timed: dict[str, dict[int, float]] = {}
    util: dict[str, list[float]] = {}
    for r, pts in zip(runs, lines.values(), strict=True):
        final.setdefault(r["method"], {})[r["seed"]] = r["history"][-1]["val_psnr_hard"]
        util.setdefault(r["method"], []).append(100 * r["history"][-1]["val_utilization"])
        value = at(pts, budget) if pts and budget is not None else None
        if value is not None:
            timed.setdefault(r["method"], {})[r["seed"]] = value
    if max(len(v) for v in final.values()) < 2:
        return ""
    hard = [m for m in HARD if m in timed]
    # the paired comparison needs seeds: the best mean among the hard VQs run on the most seeds (at K = 512 the capped
    # restart, one seed, is the uncapped one's computation: its cap binds from K = N / 4 on)
    most = max((len(timed[m]) for m in hard), default=0)
    hard = [m for m in hard if len(timed[m]) == most]
    best_hard = max(hard, key=lambda m: statistics.fmean(timed[m].values())) if hard else None

    def cell(values: dict[int, float]) -> str:
        mean, std = mean_std(np.array(list(values.values())))
        return format_mean_std(float(mean), float(std), "{:.2f}", len(values))

    rows = []
    for method, per_seed in final.items():
        against = "–"
        if best_hard is not None and method != best_hard and method in timed:
            result = by_seed(timed[method], timed[best_hard])
            against = f"{result['margin']:+.2f} dB, {describe(result)}"
        rows.append([method, ", ".join(str(s) for s in sorted(per_seed)), cell(per_seed),
                     cell(timed[method]) if method in timed else "–", f"{min(util[method]):.1f}", against])
    head = ["method", "seeds", "final val PSNR (dB)", "at the fastest hard VQ's seconds (dB)", "lowest val util %",
            f"at those seconds vs {best_hard or 'hard VQ'}"]
    return f"Over seeds, K = {num_codes} (mean ± sample std):\n\n" + markdown_table(head, rows)


def plot(curves: dict[int, dict[str, list]], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, max(len(curves), 1), figsize=(5 * max(len(curves), 1), 4), squeeze=False)
    for ax, (num_codes, lines) in zip(axes[0], sorted(curves.items()), strict=False):
        for name, pts in sorted(lines.items()):
            style = "--" if name.startswith("hard") else "-"
            ax.plot([s for s, _ in pts], [v for _, v in pts], style, marker="o", ms=3, label=name)
        ax.set(title=f"K = {num_codes}", xlabel="training seconds (steps x side-by-side step cost)",
               ylabel="validation PSNR, hard codes (dB)")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def write_report(out: Path = OUT) -> str:
    runs = load_runs(out)
    cost_path = out / "step_cost.json"
    cost = json.loads(cost_path.read_text()) if cost_path.exists() else {}
    body, curves = tables(runs, cost)
    per_k = "; ".join(f"K = {k}: code {m.get('code')}, {m.get('rounds')} rounds x {m.get('steps_per_fit')} steps, "
                      f"taking turns every {'step' if m.get('interleave') == 'steps' else 'Lightning fit'}"
                      for k, m in sorted(cost.get("measured", {}).items(), key=lambda kv: int(kv[0])))
    machine = (f"step costs: {cost.get('machine', '?')}, {cost.get('cpu_capability', '?')}, torch "
               f"{cost.get('torch', '?')}, {cost.get('threads', '?')} threads, the median of interleaved rounds "
               f"({per_k or 'code ' + str(cost.get('code')) + ', ' + str(cost.get('rounds')) + ' rounds'})"
               if cost else "step costs: not measured yet")
    codes = sorted({r.get("code", "?") for r in runs})
    measured = cost.get("measured", {})  # per K: the commit and rounds of its step costs
    text = (f"# Per second: DDCL candidates against the strongest hard VQ (short setting, validation)\n\n"
            f"Regenerate: `python -m eval.per_second.report` (from the records in `reports/per_second/runs/`, trained "
            f"by `python -m eval.per_second --data-root ../shared/data/cifar10-jpeg.tar.gz --num-codes K --methods ... "
            f"--seeds 0 --threads 1 --commit`, and `step_cost.json`, from `python -m eval.per_second.step_cost`)\n\n"
            f"Code: runs trained at {', '.join(codes) or '-'}; step costs measured at "
            f"{', '.join(sorted({m.get('code') or '-' for m in measured.values()})) or cost.get('code', '-')}.\n\n"
            f"{machine}. The test split was not read.\n\n{body}\n\n![validation PSNR against seconds]"
            f"(psnr_vs_seconds.png)\n")
    reading = out / "reading.txt"  # the hand-written reading of the numbers above, kept beside them
    if reading.exists():
        text += "\n" + reading.read_text()
    (out / "report.md").write_text(text)
    if curves:
        plot(curves, out / "psnr_vs_seconds.png")
    return text


def main(argv: Sequence[str] | None = None) -> None:
    p = argparse.ArgumentParser(prog="python -m eval.per_second.report", description=__doc__.split("\n\n")[0])
    p.add_argument("--out", type=Path, default=OUT)
    args = p.parse_args(argv)
    print(write_report(args.out))


if __name__ == "__main__":
    main()
