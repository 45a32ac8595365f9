"""``reports/rate_distortion``: the table, the comparison at matched PSNR, the target and the plot of
:mod:`eval.rate_distortion`.

Matched PSNR: a method's points (its codebook sizes) define a line, ``log(bits per image) = a + b * PSNR``, fitted
through the per-size means (least squares; through both points when there are two). A peer's bits at DDCL's PSNR
are read off the peer's line. DDCL's PSNR must lie within the peer's measured PSNR range widened on each side by
:data:`TOLERANCE_DB` or the range's own width, whichever is less (a line through two points 0.05 dB apart says
nothing about the bits 0.3 dB away), or the reading is an extrapolation and is reported as such, not compared.
Beside the lines, :func:`dominated_by` lists the peer points that reach at least DDCL's PSNR with at most its bits.
"""

from __future__ import annotations

import json
import math
import statistics
from pathlib import Path
from typing import Any

import numpy as np

from eval._provenance import code_commit, portable
from eval._spread import beyond_spread
from eval.harness import former_entropy_target
from softvq.models.files import write_atomic

TOLERANCE_DB = 0.5  # how far outside a peer's measured PSNR range its line may be read
TARGET_SAVING = 0.05  # DDCL's codes cost at least 5% fewer prior bits per image than every peer's at matched PSNR
REFERENCE = "ddcl"


def psnr_bits(run: dict[str, Any], split: str = "test") -> tuple[float, float]:
    """A point's ``(hard-index PSNR, prior bits per image)`` on ``split`` (``"test"`` or ``"val"``)."""
    psnr = run["test"]["psnr_hard"] if split == "test" else run["history"][-1]["val_psnr_hard"]
    return float(psnr), float(run["prior"][split]["bits_per_image"])


def group(results: list[dict[str, Any]]) -> dict[str, dict[int, list[dict[str, Any]]]]:
    """The main points (no sweep): method -> nominal K -> runs in seed order."""
    groups: dict[str, dict[int, list[dict[str, Any]]]] = {}
    for run in results:
        if run.get("target_entropy") is None:
            groups.setdefault(run["method"], {}).setdefault(run["settings"]["num_codes"], []).append(run)
    for sizes in groups.values():
        for runs in sizes.values():
            runs.sort(key=lambda r: r["seed"])
    return groups


def fit_line(points: list[tuple[float, float]]) -> tuple[float, float] | None:
    """``(a, b)`` of ``log(bits) = a + b * psnr`` through ``(psnr, bits)`` points; ``None`` with fewer than two
    distinct PSNRs."""
    if len({round(p, 9) for p, _ in points}) < 2:
        return None
    x = np.array([p for p, _ in points])
    y = np.log([b for _, b in points])
    b, a = np.polyfit(x, y, 1)
    return float(a), float(b)


def bits_at(line: tuple[float, float], psnr: float) -> float:
    return math.exp(line[0] + line[1] * psnr)


def size_means(sizes: dict[int, list[dict[str, Any]]], split: str = "test") -> dict[int, tuple[float, float]]:
    """Per codebook size, the mean ``(PSNR, bits per image)`` over its seeds."""
    out = {}
    for k, runs in sizes.items():
        figures = [psnr_bits(r, split) for r in runs]
        out[k] = (statistics.fmean(p for p, _ in figures), statistics.fmean(b for _, b in figures))
    return out


def matched(groups: dict[str, dict[int, list[dict[str, Any]]]], split: str = "test") -> list[dict[str, Any]]:
    """For each size of DDCL and each peer: the peer's bits at DDCL's mean PSNR, read off the peer's line, and
    DDCL's saving ``1 - bits_DDCL / bits_peer``; at a size with >= 3 paired seeds also the seed-spread verdict."""
    if REFERENCE not in groups:
        return []
    ours = groups[REFERENCE]
    our_means = size_means(ours, split)
    our_line = fit_line(list(our_means.values()))
    rows = []
    for peer, sizes in groups.items():
        if peer == REFERENCE:
            continue
        means = size_means(sizes, split)
        line = fit_line(list(means.values()))
        low, high = min(p for p, _ in means.values()), max(p for p, _ in means.values())
        for k, (psnr, bits) in sorted(our_means.items()):
            row: dict[str, Any] = {"peer": peer, "num_codes": k, "psnr": psnr, "bits": bits,
                                   "peer_range": [low, high]}
            if line is None:
                row.update(reason="the peer has one PSNR: no line")
                rows.append(row)
                continue
            peer_bits = bits_at(line, psnr)
            tolerance = min(TOLERANCE_DB, high - low)  # a line through close points says little far from them
            inside = low - tolerance <= psnr <= high + tolerance
            row.update(peer_bits=peer_bits, saving=1.0 - bits / peer_bits, inside=inside,
                       reason="" if inside else f"DDCL's {psnr:.2f} dB is more than {tolerance:.2f} dB outside the "
                                                f"peer's {low:.2f}-{high:.2f} dB")
            row["spread"] = seed_verdict(ours, sizes, k, psnr, our_line, split)
            rows.append(row)
    return rows


def seed_verdict(ours: dict[int, list[dict[str, Any]]], theirs: dict[int, list[dict[str, Any]]], k: int, psnr: float,
                 our_line: tuple[float, float] | None, split: str) -> dict[str, Any] | None:
    """Seed by seed at size ``k``: each method's bits of that seed moved along the method's own line (its slope) to
    DDCL's mean PSNR, judged by :func:`eval._spread.beyond_spread` (margin > 0: the peer's codes cost more).
    ``None`` when a side has fewer than two seeds at ``k`` or no line."""
    their_line = fit_line(list(size_means(theirs, split).values()))
    if k not in theirs or our_line is None or their_line is None:
        return None
    seeds = sorted({r["seed"] for r in ours[k]} & {r["seed"] for r in theirs[k]})
    if len(seeds) < 2:
        return None

    def moved(runs: list[dict[str, Any]], seed: int, line: tuple[float, float]) -> float:
        p, b = psnr_bits(next(r for r in runs if r["seed"] == seed), split)
        return b * math.exp(line[1] * (psnr - p))

    ddcl = [moved(ours[k], seed, our_line) for seed in seeds]
    peer = [moved(theirs[k], seed, their_line) for seed in seeds]
    return {"seeds": seeds, "ddcl_bits": ddcl, "peer_bits": peer, **beyond_spread(peer, ddcl)}


def dominated_by(groups: dict[str, dict[int, list[dict[str, Any]]]], split: str = "test") -> list[str]:
    """Per DDCL size: the peers' points (per-size means) with at least DDCL's mean PSNR and at most its bits, which
    beat it on both axes whatever line is drawn."""
    if REFERENCE not in groups:
        return []
    lines = []
    for k, (psnr, bits) in sorted(size_means(groups[REFERENCE], split).items()):
        better = [f"{method} K = {size} ({p:.2f} dB, {b:.1f} bits)" for method, sizes in groups.items()
                  if method != REFERENCE for size, (p, b) in sorted(size_means(sizes, split).items())
                  if p >= psnr and b <= bits]
        lines.append(f"- DDCL K = {k} ({psnr:.2f} dB, {bits:.1f} bits): " + (
            "beaten on both axes by " + ", ".join(better) if better else "no peer point beats it on both axes") + ".")
    return lines


def _pm(values: list[float], fmt: str) -> str:
    if len(values) == 1:
        return fmt.format(values[0])
    return f"{fmt.format(statistics.fmean(values))} ± {fmt.format(statistics.stdev(values))}"


def main_table(groups: dict[str, dict[int, list[dict[str, Any]]]], labels: dict[str, str]) -> list[str]:
    columns = ["bottleneck", "K (codes)", "seeds", "PSNR hard (dB)", "SSIM", "test util %", "perplexity",
               "prior bits / image", "bits / position", "unigram bits / position", "context gain (bits / pos)",
               "border / interior bits", "neighbours: same code", "neighbours: within 8 nearest"]
    lines = ["| " + " | ".join(columns) + " |", "|" + "---|" * len(columns)]
    for method, sizes in groups.items():
        for k, runs in sorted(sizes.items()):
            t = [r["test"] for r in runs]
            pr = [r["prior"]["test"] for r in runs]
            nb = [r["neighbours"]["test"] for r in runs]
            cells = [labels.get(method, method), f"{k} ({runs[0]['num_codes']})", str(len(runs)),
                     _pm([x["psnr_hard"] for x in t], "{:.2f}"), _pm([x["ssim_hard"] for x in t], "{:.3f}"),
                     _pm([100 * x["utilization"] for x in t], "{:.1f}"), _pm([x["perplexity"] for x in t], "{:.0f}"),
                     _pm([x["bits_per_image"] for x in pr], "{:.1f}"),
                     _pm([x["bits_per_position"] for x in pr], "{:.3f}"),
                     _pm([x["unigram_bits_per_position"] for x in pr], "{:.3f}"),
                     _pm([x["unigram_bits_per_position"] - x["bits_per_position"] for x in pr], "{:.3f}"),
                     f"{statistics.fmean(x['border_bits_per_position'] for x in pr):.3f} / "
                     f"{statistics.fmean(x['interior_bits_per_position'] for x in pr):.3f}",
                     _pm([x["same_code"] for x in nb], "{:.3f}"),
                     _pm([x[f"within_{x['k']}_nearest"] for x in nb], "{:.3f}")]
            lines.append("| " + " | ".join(cells) + " |")
    return lines


def matched_lines(rows: list[dict[str, Any]], labels: dict[str, str]) -> list[str]:
    lines = ["| DDCL at K | DDCL PSNR (dB) | DDCL bits / image | peer | peer's PSNR range (dB) | peer bits at that PSNR"
             " | DDCL saving | seed by seed |", "|---|---|---|---|---|---|---|---|"]
    for r in rows:
        if "peer_bits" not in r:
            lines.append(f"| {r['num_codes']} | {r['psnr']:.2f} | {r['bits']:.1f} | {labels.get(r['peer'], r['peer'])}"
                         f" | {r['peer_range'][0]:.2f}-{r['peer_range'][1]:.2f} | n/a | n/a | {r['reason']} |")
            continue
        spread = r.get("spread")
        if spread is None:
            seeds = "one seed: no margin claim"
        else:
            seeds = (f"{'beyond' if spread['counts'] else 'within'} the spread: peer − DDCL "
                     f"{spread['margin']:+.1f} bits, spread {spread['spread']:.1f}"
                     + ("" if spread["counts"] else f" ({spread['reason']})"))
        saving = f"{100 * r['saving']:+.1f}%" + ("" if r["inside"] else " (extrapolated: not compared)")
        lines.append(f"| {r['num_codes']} | {r['psnr']:.2f} | {r['bits']:.1f} | {labels.get(r['peer'], r['peer'])} | "
                     f"{r['peer_range'][0]:.2f}-{r['peer_range'][1]:.2f} | {r['peer_bits']:.1f} | {saving} | {seeds} |")
    return lines


def target_lines(rows: list[dict[str, Any]], small: int) -> list[str]:
    """The study's target, per DDCL size: >= 5% fewer bits than every peer at matched PSNR (beyond the spread at the
    small size, the figure alone at the large one)."""
    lines = []
    for k in sorted({r["num_codes"] for r in rows}):
        at_k = [r for r in rows if r["num_codes"] == k]
        comparable = [r for r in at_k if r.get("inside")]
        if not comparable:
            why = ("no peer has points at two PSNRs yet" if all("peer_bits" not in r for r in at_k)
                   else "no peer's line reaches DDCL's PSNR")
            lines.append(f"- K = {k}: {why}: **not measured**.")
            continue
        worst = min(comparable, key=lambda r: r["saving"])
        saving_ok = all(r["saving"] >= TARGET_SAVING for r in comparable) and len(comparable) == len(at_k)
        if k == small:
            spread_ok = all(r.get("spread") and r["spread"]["counts"] and r["spread"]["margin"] > 0
                            for r in comparable)
            met = saving_ok and spread_ok
            extra = "" if spread_ok else "; not every margin is beyond the seed spread"
        else:
            met, extra = saving_ok, " (one seed: the figure, no margin claim)"
        lines.append(f"- K = {k}: smallest saving {100 * worst['saving']:+.1f}% (against {worst['peer']}){extra} → "
                     f"**{'met' if met else 'not met'}**" + (f"; {len(at_k) - len(comparable)} peer(s) not "
                                                             f"comparable" if len(comparable) < len(at_k) else ""))
    return lines


def held_entropy(run: dict[str, Any], k: int) -> float | None:
    """The entropy target a DDCL point's layer held: its sweep value, else the one it recorded; a result from before
    results recorded it trained at the layer's default then, ``min(2.5, log K / 2)``."""
    if run.get("target_entropy") is not None:
        return run["target_entropy"]
    return run["held_entropy"] if "held_entropy" in run else former_entropy_target(k)


def sweep_lines(results: list[dict[str, Any]], small: int) -> list[str]:
    """The target-entropy sweep on validation: DDCL at K = small, first seed, each target beside the default."""
    default = [r for r in results if r["method"] == REFERENCE and r.get("target_entropy") is None
               and r["settings"]["num_codes"] == small]
    sweep = [r for r in results if r.get("target_entropy") is not None]
    if not sweep or not default:
        return []
    seed = min(r["seed"] for r in sweep)
    base = next((r for r in default if r["seed"] == seed), None)
    rows = sorted(sweep + ([base] if base else []), key=lambda r: held_entropy(r, small))
    lines = ["| target entropy (nats) | val PSNR hard (dB) | val prior bits / image | val bits / position | "
             "val perplexity | val neighbours within 8 nearest |", "|---|---|---|---|---|---|"]
    for r in rows:
        psnr, bits = psnr_bits(r, "val")
        target = r.get("target_entropy")
        name = f"default ({held_entropy(r, small):.3g})" if target is None else f"{target:g}"
        nb = r["neighbours"]["val"]
        within = nb[f"within_{nb['k']}_nearest"]
        lines.append(f"| {name} | {psnr:.2f} | {bits:.1f} | {r['prior']['val']['bits_per_position']:.3f} | "
                     f"{r['history'][-1]['val_perplexity']:.0f} | {within:.3f} |")
    return lines


def plot(groups: dict[str, dict[int, list[dict[str, Any]]]], results: list[dict[str, Any]], labels: dict[str, str],
         path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(11, 4.2))
    for ax, split in zip(axes, ("test", "val"), strict=True):
        for i, (method, sizes) in enumerate(groups.items()):
            colour = f"C{i}"
            for runs in sizes.values():
                xs, ys = zip(*[psnr_bits(r, split)[::-1] for r in runs], strict=True)
                ax.scatter(xs, ys, color=colour, s=18, alpha=0.6)
            means = sorted(size_means(sizes, split).values())
            ax.plot([b for _, b in means], [p for p, _ in means], color=colour, marker="o",
                    label=labels.get(method, method))
        if split == "val":
            for r in results:
                if r.get("target_entropy") is not None:
                    p, b = psnr_bits(r, "val")
                    ax.scatter([b], [p], marker="*", s=90, color="black")
                    ax.annotate(f"H*={r['target_entropy']:g}", (b, p), fontsize=7, xytext=(3, 3),
                                textcoords="offset points")
        ax.set_xscale("log")
        ax.set_xlabel("prior NLL, bits per image (log scale)")
        ax.set_ylabel("PSNR from hard indices (dB)")
        ax.set_title("test split" if split == "test" else "validation split (stars: DDCL target-entropy sweep)",
                     fontsize=9)
        ax.grid(alpha=0.3)
    axes[0].legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=90)
    plt.close(fig)


def write_report(results: list[dict[str, Any]], settings: dict[str, Any], out: Path,
                 missing: list[dict[str, Any]] | None = None) -> dict[str, Any]:
    """``report.md``, ``results.json`` and ``rate_distortion.png`` in ``out``; returns the summary."""
    out.mkdir(parents=True, exist_ok=True)
    labels, small = settings["labels"], settings["num_codes"][0]
    groups = group(results)
    rows = matched(groups)
    commits = sorted({r.get("commit", "not recorded") for r in results})
    v, p = settings["vqvae"], settings["prior"]
    lines = ["# Rate against distortion: the prior's bits for each bottleneck's codes", "",
             f"Regenerate: `{settings['command']}`", "",
             f"Code: report written at {code_commit()}; points trained at {', '.join(commits)}.", "",
             f"VQ-VAE: the peers' setting (`eval/peers/`): width {v['width']}, {v['res_blocks']} residual blocks, "
             f"D = {v['code_dim']}, Adam {v['lr']}, batch {v['batch_size']}, {v['train_subset']} training images, "
             f"{v['epochs']} epochs; K = {settings['num_codes'][0]} (seeds {settings['seeds']}) and "
             f"K = {settings['num_codes'][1]} (seeds {settings['large_seeds']}); FSQ at the FSQ paper's nearest level "
             f"sets, whose code counts are in brackets. Prior, the same for every bottleneck: {p['layers']} layers, "
             f"width {p['dim']}, {p['heads']} heads, dropout {p['dropout']}, AdamW {p['lr']} (weight decay "
             f"{p['weight_decay']}, {p['warmup_steps']} warm-up steps, cosine), batch {p['batch_size']}, "
             f"{p['epochs']} epochs on the training images' codes, seed {p['seed']}.", "",
             "Figures below are on the official test split (10,000 images), read once for this table; the target-"
             "entropy sweep reads the validation split only.", ""]
    if missing:
        lines += [f"**Interim**: {len(results)} of {len(results) + len(missing)} points are finished; the verdicts "
                  f"below read those only.", ""]
        lines += ["Not run: " + ", ".join(f"{m['method']} K={m['num_codes']} seed {m['seed']}"
                                          + (f" target {m['target_entropy']}" if m.get("target_entropy") else "")
                                          for m in missing) + ".", ""]
    lines += ["## Test split", "", *main_table(groups, labels), "",
              "Context gain: the codes' unigram entropy minus the prior's bits per position (what context buys). "
              "Border: the 28 positions on the grid's edge. Neighbours: right and down neighbours carrying the same "
              "code, and carrying one of the code's 8 nearest codes (itself included) in the decoder's space.", "",
              "## Matched PSNR", "",
              f"Each method's line: log(bits per image) linear in PSNR through its per-K means. A peer's bits at "
              f"DDCL's PSNR are read off the peer's line when DDCL's PSNR lies within {TOLERANCE_DB} dB of the "
              f"peer's measured range, or within the range's own width when that is smaller. Seed by seed "
              f"(K = {small}): DDCL's bits moved along its own line to its mean PSNR, against the peer's bits of "
              f"the same seed moved along the peer's line; the margin counts when it exceeds the sum of the two "
              f"sample stds over >= 3 seeds and has one sign on every seed.", "",
              *matched_lines(rows, labels), "", "Points that beat DDCL's on both axes (no line needed):", "",
              *dominated_by(groups), "", "## Target", "",
              f"At matched PSNR, DDCL's codes cost >= {100 * TARGET_SAVING:.0f}% fewer prior bits per image than every "
              f"peer's, beyond the seed spread at K = {small}:", "", *target_lines(rows, small), ""]
    sweep = sweep_lines(results, small)
    if sweep:
        lines += ["## DDCL's entropy target moves the rate (validation split)", "", *sweep, ""]
    lines += ["![rate against distortion](rate_distortion.png)", ""]
    plot(groups, results, labels, out / "rate_distortion.png")
    write_atomic(out / "report.md", "\n".join(lines))
    summary = {"settings": settings, "matched": rows, "results": results, "missing": missing or []}
    write_atomic(out / "results.json", json.dumps(portable(summary), indent=1, default=float))
    return summary
