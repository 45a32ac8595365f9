"""``reports/residual``: the residual quantizers' test table, per-level health, margins, targets and the PSNR by
levels used (:mod:`eval.residual`); with ``probe``, the validation table of the scale decision."""

from __future__ import annotations

import json
import statistics
from pathlib import Path
from typing import Any

from eval._provenance import code_commit
from eval._spread import beyond_spread
from softvq.models.files import write_atomic

RESIDUAL = ("rddcl", "rddcl_per_level", "rddcl_dropout", "rhard", "vqp_rvq", "vqp_rfsq")
PEERS = ("rhard", "vqp_rvq", "vqp_rfsq")


def group(runs: list[dict[str, Any]]) -> dict[str, list[dict[str, Any]]]:
    groups: dict[str, list[dict[str, Any]]] = {}
    for run in sorted(runs, key=lambda r: r["seed"]):
        groups.setdefault(run["method"], []).append(run)
    return groups


def _pm(values: list[float], fmt: str = "{:.2f}") -> str:
    if len(values) == 1:
        return fmt.format(values[0])
    return f"{fmt.format(statistics.fmean(values))} ± {fmt.format(statistics.stdev(values))}"


def level_figures(run: dict[str, Any], stage: str = "test") -> list[tuple[float, float]]:
    """``(utilization, perplexity)`` of every level on ``stage`` (the test record, or the last validation epoch)."""
    record = run["test"] if stage == "test" else {k.removeprefix("val_"): v for k, v in run["history"][-1].items()}
    return [(record[f"utilization_l{q}"], record[f"perplexity_l{q}"]) for q in range(run["levels"])] \
        if run["levels"] > 1 else [(record["utilization"], record["perplexity"])]


def test_table(groups: dict[str, list[dict[str, Any]]], labels: dict[str, str]) -> list[str]:
    lines = ["| bottleneck | bits / position | seeds | PSNR hard (dB) | SSIM | PSNR from levels 1, 2, ... | "
             "test util % per level (lowest seed) | perplexity / K per level (lowest seed) |",
             "|---|---|---|---|---|---|---|---|"]
    for method, runs in groups.items():
        k = runs[0]["test"]["num_codes"]
        by_level = [statistics.fmean(r["psnr_by_levels"][q] for r in runs) for q in range(runs[0]["levels"])]
        figures = [level_figures(r) for r in runs]
        util = [min(f[q][0] for f in figures) for q in range(runs[0]["levels"])]
        ppl = [min(f[q][1] for f in figures) / k for q in range(runs[0]["levels"])]
        lines.append(f"| {labels.get(method, method)} | {runs[0]['bits_per_position']:.1f} | {len(runs)} | "
                     f"{_pm([r['test']['psnr_hard'] for r in runs])} | "
                     f"{_pm([r['test']['ssim_hard'] for r in runs], '{:.3f}')} | "
                     f"{', '.join(f'{v:.2f}' for v in by_level)} | {', '.join(f'{100 * u:.1f}' for u in util)} | "
                     f"{', '.join(f'{p:.2f}' for p in ppl)} |")
    return lines


def epoch_table(runs: list[dict[str, Any]]) -> list[str]:
    """Validation utilization % of every level per epoch (mean over seeds)."""
    levels = runs[0]["levels"]
    lines = ["| epoch | " + " | ".join(f"level {q} val util %" for q in range(levels)) + " |",
             "|---|" + "---|" * levels]
    for e in range(len(runs[0]["history"])):
        cells = []
        for q in range(levels):
            key = f"val_utilization_l{q}" if levels > 1 else "val_utilization"
            values = [r["history"][e].get(key) for r in runs if r["history"][e].get(key) is not None]
            cells.append(f"{100 * statistics.fmean(values):.1f}" if values else "n/a")
        lines.append(f"| {e + 1} | " + " | ".join(cells) + " |")
    return lines


def targets(groups: dict[str, list[dict[str, Any]]], labels: dict[str, str]) -> list[str]:
    lines = []
    ours = groups.get("rddcl")
    if not ours:
        return ["- no ResidualDDCL run: targets not measured"]
    k = ours[0]["test"]["num_codes"]
    test_util = min(u for r in ours for u, _ in level_figures(r))
    test_ppl = min(p for r in ours for _, p in level_figures(r))
    lines.append(f"- Every DDCL level >= 99% used on the test split: lowest {100 * test_util:.1f}% → "
                 f"**{'met' if test_util >= 0.99 else 'not met'}**.")
    lines.append(f"- Perplexity >= 0.8 K = {0.8 * k:.0f} at every level: lowest {test_ppl:.0f} → "
                 f"**{'met' if test_ppl >= 0.8 * k else 'not met'}**.")
    for key, what, goal, fmt in (("utilization", ">= 99% used", 0.99, "{:.1%}"),
                                 ("perplexity", f"perplexity >= 0.8 K = {0.8 * k:.0f}", 0.8 * k, "{:.0f}")):
        val = [r["history"][e].get(f"val_{key}_l{q}") for r in ours for e in range(1, len(r["history"]))
               for q in range(r["levels"])]
        val = [v for v in val if v is not None]
        if val:
            lines.append(f"- Every DDCL level {what} on validation from epoch 2 on: lowest {fmt.format(min(val))} → "
                         f"**{'met' if min(val) >= goal else 'not met'}**.")
    peers = {m: g for m, g in groups.items() if m in PEERS}
    if peers:
        best = max(peers, key=lambda m: statistics.fmean(r["test"]["psnr_hard"] for r in peers[m]))
        a = [r["test"]["psnr_hard"] for r in ours]
        b = [r["test"]["psnr_hard"] for r in peers[best]]
        verdict = beyond_spread(a, b)
        met = verdict["counts"] and verdict["margin"] >= 0.5
        lines.append(f"- Hard-index PSNR >= best residual peer ({labels.get(best, best)}) + 0.5 dB beyond the seed "
                     f"spread: margin {verdict['margin']:+.2f} dB, spread {verdict['spread']:.2f} "
                     f"({verdict['reason'] or 'beyond the spread'}) → **{'met' if met else 'not met'}**.")
    for method, runs in groups.items():
        if method in RESIDUAL:
            means = [statistics.fmean(r["psnr_by_levels"][q] for r in runs) for q in range(runs[0]["levels"])]
            rising = all(b > a for a, b in zip(means, means[1:], strict=False))
            lines.append(f"- PSNR rises with every level used, {labels.get(method, method)}: "
                         f"{' < '.join(f'{v:.2f}' for v in means)} → **{'yes' if rising else 'no'}**.")
    single = groups.get("ddcl512")
    if single:
        gain = statistics.fmean(r["test"]["psnr_hard"] for r in ours) - statistics.fmean(
            r["test"]["psnr_hard"] for r in single)
        bits = ours[0]["bits_per_position"] - single[0]["bits_per_position"]
        lines.append(f"- Against one DDCL codebook of K = 512: {gain:+.2f} dB for {bits:.0f} more bits per position, "
                     f"{gain / bits:.3f} dB per added bit.")
    return lines


def probe_lines(groups: dict[str, list[dict[str, Any]]], labels: dict[str, str]) -> list[str]:
    lines = ["| scale | val PSNR hard (dB), last epoch | val util % per level | val perplexity per level |",
             "|---|---|---|---|"]
    scores = {}
    for method in ("rddcl", "rddcl_per_level"):
        for r in groups.get(method, []):
            last = r["history"][-1]
            scores[method] = last["val_psnr_hard"]
            figures = level_figures(r, "val")
            lines.append(f"| {labels.get(method, method)} | {last['val_psnr_hard']:.2f} | "
                         f"{', '.join(f'{100 * u:.1f}' for u, _ in figures)} | "
                         f"{', '.join(f'{p:.0f}' for _, p in figures)} |")
    if len(scores) == 2:
        better = max(scores, key=scores.get)
        lines += ["", f"Better on validation: **{labels.get(better, better)}** "
                      f"({scores[better] - min(scores.values()):+.2f} dB)."]
    return lines


def plot_levels(groups: dict[str, list[dict[str, Any]]], labels: dict[str, str], path: Path) -> None:
    """Test PSNR against the number of levels decoded, one line per residual method (mean over seeds)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 4))
    for method, runs in groups.items():
        levels = runs[0]["levels"]
        means = [statistics.fmean(r["psnr_by_levels"][q] for r in runs) for q in range(levels)]
        if levels > 1:
            ax.plot(range(1, levels + 1), means, marker="o", label=labels.get(method, method))
        else:
            ax.axhline(means[0], linestyle="--", color="grey", label=labels.get(method, method))
    ax.set_xlabel("levels decoded")
    ax.set_ylabel("test PSNR from hard indices (dB)")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=90)
    plt.close(fig)


def write_report(runs: list[dict[str, Any]], settings: dict[str, Any], out: Path, probe: bool = False
                 ) -> dict[str, Any]:
    out.mkdir(parents=True, exist_ok=True)
    labels = settings["labels"]
    groups = group(runs)
    commits = sorted({r.get("commit", "not recorded") for r in runs})
    head = [f"Regenerate: `{settings['command']}`", "",
            f"Code: report written at {code_commit()}; runs trained at {', '.join(commits)}.", "",
            f"The project's VQ-VAE (`eval/peers/` setting): {settings['epochs']} epochs on "
            f"{settings['train_subset']} training images, D = {settings['code_dim']}, Q = "
            f"{settings['num_quantizers']} levels of K = {settings['num_codes']} unless the row says otherwise; "
            f"seeds {settings['seeds']}.", ""]
    if probe:
        lines = ["# ResidualDDCL: where the scale lives (validation split)", "", *head, *probe_lines(groups, labels)]
        name = "scale_probe.md"
    else:
        lines = ["# Residual quantizers at equal bits", "", *head,
                 "Test split (10,000 images), read once for this table.", "", "## Test split", "",
                 *test_table(groups, labels), "", "## Targets", "", *targets(groups, labels), "",
                 "## Validation utilization per level and epoch", ""]
        for method, method_runs in groups.items():
            lines += [f"**{labels.get(method, method)}**", "", *epoch_table(method_runs), ""]
        lines += ["![PSNR by levels decoded](psnr_by_levels.png)", ""]
        plot_levels(groups, labels, out / "psnr_by_levels.png")
        name = "report.md"
    write_atomic(out / name, "\n".join(lines) + "\n")
    summary = {"settings": settings, "runs": runs}
    write_atomic(out / name.replace(".md", ".json"), json.dumps(summary, indent=1, default=str))
    return summary
