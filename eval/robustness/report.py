"""``reports/robustness``: the tables, regret, collapses, targets and heat map of :mod:`eval.robustness`."""

from __future__ import annotations

import argparse
import json
import math
from pathlib import Path
from typing import Any

import torch

from eval._provenance import code_commit, portable
from eval.robustness.grid import ALPHA, BASE, COLLAPSE, CONFIGS, OPTIMIZERS, SETTINGS, constructor
from softvq.models.files import write_atomic


def regrets(means: dict[str, dict[str, float | None]]) -> dict[str, dict[str, float]]:
    """``regret[setting][config]``: how many dB the configuration's mean PSNR falls below the best configuration of
    any method in that setting (0 for the best). A configuration that failed (``None`` or NaN) has regret ``inf``."""
    out: dict[str, dict[str, float]] = {}
    for setting, row in means.items():
        finite = [v for v in row.values() if v is not None and math.isfinite(v)]
        best = max(finite) if finite else math.nan
        out[setting] = {c: (best - v if v is not None and math.isfinite(v) else math.inf) for c, v in row.items()}
    return out


def worst_case(regret: dict[str, dict[str, float]]) -> dict[str, tuple[float, str]]:
    """Per configuration, its largest regret over the settings and the setting where it happens."""
    worst: dict[str, tuple[float, str]] = {}
    for setting, row in regret.items():
        for config, value in row.items():
            if config not in worst or value > worst[config][0]:
                worst[config] = (value, setting)
    return worst


def _stats(runs: list[dict[str, Any]], metric: str) -> tuple[float, float, int]:
    """Mean, sample std and count of a test metric over the runs that did not fail (NaN when none)."""
    vals = torch.tensor([r["test"][metric] for r in runs if "test" in r], dtype=torch.float64)
    if len(vals) == 0:
        return math.nan, math.nan, 0
    return float(vals.mean()), float(vals.std()) if len(vals) > 1 else 0.0, len(vals)


def write_report(runs: list[dict[str, Any]], args: argparse.Namespace, wall_s: float | None) -> dict[str, Any]:
    settings = [s for s in SETTINGS if s in args.settings]
    configs = [c for c in CONFIGS if c in args.configs]
    cell: dict[str, dict[str, list]] = {s: {c: [] for c in configs} for s in settings}
    for run in runs:
        cell[run["setting"]][run["config"]].append(run)
    means = {s: {c: (_stats(cell[s][c], "psnr_hard")[0] if len(cell[s][c]) and all("test" in r for r in cell[s][c])
                     else None) for c in configs} for s in settings}
    regret = regrets(means)
    worst = worst_case(regret)

    def fmt(value: float) -> str:
        return "failed" if math.isinf(value) else f"{value:.2f}"

    head = "| setting | " + " | ".join(f"`{c}`" for c in configs) + " |"
    rule = "|---|" + "---|" * len(configs)
    commits: dict[str, int] = {}
    for run in runs:
        commits[run.get("commit", "not recorded")] = commits.get(run.get("commit", "not recorded"), 0) + 1
    lines = ["# Robust by default: every quantizer over a grid of settings, defaults and recipes", "",
             f"Regenerate: `{args.command}`", "",
             f"Code: report written at {code_commit()}; runs trained at " +
             ", ".join(f"{c} ({n} runs)" for c, n in commits.items()) + ".", "",
             f"The foreign autoencoder of `eval/dropin.py` (encoder output D channels on an 8x8 grid), {args.steps} "
             f"optimizer steps per run, L1 + {ALPHA:g}·quantizer loss, seeds {args.seeds}. Trained on the 45,000 "
             f"training images (the 5,000 validation images held out, unused: nothing is tuned here), scored once on "
             f"the official test split ({args.test_limit or 10000} images): PSNR of the images decoded from the hard "
             f"indices alone. One axis changes at a time around the base setting, plus two corners.", ""]
    if wall_s is not None:
        lines += [f"Wall time of the grid: {wall_s / 60:.0f} min with {args.jobs} job(s) of {args.threads} thread(s) "
                  f"each; sum of the runs' training times {sum(r['train_s'] for r in runs) / 60:.0f} min.", ""]
    lines += ["## Configurations", "", "| id | method | role | constructor (base setting) |", "|---|---|---|---|"]
    for c in configs:
        label, role, _, _ = CONFIGS[c]
        lines.append(f"| `{c}` | {label} | {role} | `{constructor(c, BASE.num_codes, BASE.dim)}` |")
    lines += ["", "Each run's exact constructor and optimizer call are in `results.json`. Optimizers: " +
              "; ".join(f"{k}: `{v}`" for k, v in OPTIMIZERS.items()) + ".", "",
              "## Settings", "", "| id | change from base | K | D | optimizer | batch | encoder scale | bf16 | data |",
              "|---|---|---|---|---|---|---|---|---|"]
    for s in settings:
        what, st = SETTINGS[s]
        lines.append(f"| `{s}` | {what} | {st.num_codes} | {st.dim} | {st.optimizer} | {st.batch_size} | "
                     f"{st.encoder_scale:g} | {'on' if st.bf16 else 'off'} | {st.dataset} |")
    for title, metric, scale, fmt_ in (("Test PSNR from hard indices (dB), mean ± std over seeds", "psnr_hard", 1.0,
                                        "{:.2f} ± {:.2f}"),
                                       ("Test utilization (%), mean ± std", "utilization", 100.0, "{:.1f} ± {:.1f}"),
                                       ("Test perplexity / K, mean ± std", "perplexity_per_code", 1.0,
                                        "{:.2f} ± {:.2f}")):
        lines += ["", f"## {title}", "", head, rule]
        for s in settings:
            cells = []
            for c in configs:
                m, sd, n = _stats(cell[s][c], metric)
                failed = sum("failed" in r for r in cell[s][c])
                text = (fmt_ if n > 1 else fmt_.split(" ±")[0]).format(m * scale, sd * scale) if n else "—"
                cells.append(text + (f" ({failed} failed)" if failed else ""))
            lines.append(f"| `{s}` | " + " | ".join(cells) + " |")
    lines += ["", "## Regret (dB below the best configuration of any method in the setting)", "", head, rule]
    for s in settings:
        lines.append(f"| `{s}` | " + " | ".join(("**0.00**" if regret[s][c] == 0 else fmt(regret[s][c]))
                                               for c in configs) + " |")
    lines.append("| **worst case** | " + " | ".join(f"{fmt(worst[c][0])} (`{worst[c][1]}`)" for c in configs) + " |")
    collapses = [(s, r["config"], r["seed"], r["test"]["utilization"]) for s in settings for c in configs
                 for r in cell[s][c] if "test" in r and r["test"]["utilization"] < COLLAPSE]
    failures = [(s, r["config"], r["seed"], r["failed"]) for s in settings for c in configs for r in cell[s][c]
                if "failed" in r]
    lines += ["", f"## Collapses (test utilization < {100 * COLLAPSE:.0f}% on a seed) and failed runs", "",
              "Per configuration, every setting where a seed collapsed: the lowest seed's test utilization and how "
              "many seeds collapsed.", ""]
    for c in configs:
        hits = {}
        for s, config, _, u in collapses:
            if config == c:
                low, n = hits.get(s, (1.0, 0))
                hits[s] = (min(low, u), n + 1)
        if hits:
            where = ", ".join(f"`{s}` {100 * low:.1f}% ({n}/{len(cell[s][c])})" for s, (low, n) in hits.items())
            lines.append(f"- `{c}`, {len(hits)} of {len(settings)} settings: {where}")
    if not collapses:
        lines.append("- no collapse")
    lines += [f"- `{c}` in `{s}`, seed {seed} failed: {why}" for s, c, seed, why in failures]
    verdict = targets(regret, worst, cell, settings, configs)
    lines += ["", "## Targets", "", *verdict, ""]
    args.out.mkdir(parents=True, exist_ok=True)
    plot_regret(regret, settings, configs, args.out / "regret.png")
    lines[lines.index("## Targets"):lines.index("## Targets")] = ["![regret per setting](regret.png)", ""]
    write_atomic(args.out / "report.md", "\n".join(lines))
    summary = {"command": args.command, "steps": args.steps, "seeds": args.seeds, "wall_s": wall_s,
               "regret": regret, "worst_case": worst, "runs": runs}
    write_atomic(args.out / "results.json", json.dumps(portable(summary), indent=1))
    return summary


def plot_regret(regret: dict[str, dict[str, float]], settings: list[str], configs: list[str], path: Path) -> None:
    """A settings x configurations heat map of the regret (dB, clipped at 4; failed runs in black)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    values = torch.tensor([[regret[s][c] for c in configs] for s in settings], dtype=torch.float64)
    shown = torch.where(values.isinf(), 5.0, values.clamp(max=4.0)).numpy()  # only a failed run is over vmax
    cmap = plt.get_cmap("viridis_r").copy()
    cmap.set_over("black")
    fig, ax = plt.subplots(figsize=(1.3 * len(configs) + 2.5, 0.42 * len(settings) + 1.6))
    image = ax.imshow(shown, cmap=cmap, vmin=0.0, vmax=4.0, aspect="auto")
    for i, s in enumerate(settings):
        for j, c in enumerate(configs):
            v = regret[s][c]
            ax.text(j, i, "failed" if math.isinf(v) else f"{v:.2f}", ha="center", va="center", fontsize=7,
                    color="white" if min(v, 4.0) > 2.0 else "black")
    ax.set_xticks(range(len(configs)), configs, rotation=30, ha="right", fontsize=8)
    ax.set_yticks(range(len(settings)), settings, fontsize=8)
    ax.set_title("regret: dB below the best configuration in each setting (test split; black: failed)", fontsize=9)
    fig.colorbar(image, ax=ax, label="dB (clipped at 4)")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def targets(regret, worst, cell, settings, configs) -> list[str]:
    """The study's three targets for DDCL's defaults, each stated with its numbers, true or false."""
    if "ddcl" not in configs:
        return ["- DDCL was not run."]
    others = {c: w for c, w in worst.items() if c != "ddcl"}
    best_other = min(others, key=lambda c: others[c][0]) if others else None
    d_worst, d_where = worst["ddcl"]
    lines = []
    if best_other is not None:
        o_worst, o_where = others[best_other]
        holds = d_worst < o_worst
        lines.append(f"- Smallest worst-case regret: {'met' if holds else 'NOT met'}. DDCL {fmt_db(d_worst)} "
                     f"(in `{d_where}`); the smallest of the others is `{best_other}`, {fmt_db(o_worst)} "
                     f"(in `{o_where}`).")
    over = [s for s in settings if regret[s]["ddcl"] > 0.5]
    lines.append(f"- Regret ≤ 0.5 dB in every setting: {'met' if not over else 'NOT met'}"
                 + ("" if not over else " — over it in " + ", ".join(f"`{s}` ({fmt_db(regret[s]['ddcl'])})"
                                                                  for s in over)) + ".")
    low = [(s, min(r["test"]["utilization"] for r in cell[s]["ddcl"] if "test" in r)) for s in settings
           if any("test" in r for r in cell[s]["ddcl"])]
    under = [(s, u) for s, u in low if u < 0.95]
    lowest = min(low, key=lambda t: t[1]) if low else None
    lines.append(f"- Test utilization ≥ 95% in every setting (lowest seed): {'met' if not under else 'NOT met'}"
                 + (f"; lowest {100 * lowest[1]:.1f}% in `{lowest[0]}`" if lowest else "")
                 + ("" if not under else " — under it in " + ", ".join(f"`{s}` ({100 * u:.1f}%)" for s, u in under))
                 + ".")
    return lines


def fmt_db(value: float) -> str:
    return "failed" if math.isinf(value) else f"{value:.2f} dB"
