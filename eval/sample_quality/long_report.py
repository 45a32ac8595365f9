"""The report of the long runs' sample-quality study (:mod:`eval.sample_quality.long_runs`): each method over its seeds,
the study's targets (:func:`targets`) judged from the test rows' intervals, and ``report.md``."""

from __future__ import annotations

import statistics
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from eval import render
from eval._spread import MIN_SEEDS, summarize
from eval.sample_quality.classifier import describe
from eval.sample_quality.classifier import interval_text as _fd

# the figures the report summarises per method and judges: (name, path into a row)
FIGURES = (("PSNR hard (the run's)", ("psnr_hard",)),
           ("reconstructions CFD", ("reconstruction_fd", "value")),
           ("reconstructions classified right", ("reconstruction_accuracy",)),
           ("samples CFD, one-hot prior", ("one_hot", "samples_fd", "value")),
           ("bits / image, one-hot prior", ("one_hot", "bits_per_image", "value")),
           ("guided samples CFD", ("conditional", "samples_fd", "value")),
           ("guided samples classified as their class", ("conditional", "samples_accuracy")))
# the target's comparisons: DDCL against every peer, each point's interval (lower is better)
JUDGED = (("reconstructions CFD", "reconstruction_fd"), ("samples CFD, one-hot prior", "one_hot"),
          ("guided samples CFD", "conditional"))
BITS_TOLERANCE = 0.02  # the soft prior may raise bits per image by at most this share of the one-hot prior's


def _get(row: dict[str, Any], path: tuple[str, ...]) -> Any:
    for key in path:
        if not isinstance(row, dict) or key not in row:
            return None
        row = row[key]
    return row


def by_method(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Per codebook size and method: the seeds and each :data:`FIGURES` figure's mean, sample std and values over
    them (:func:`eval._spread.summarize`), for the figures its rows have."""
    out = []
    for k, method in sorted({(r["num_codes"], r["method"]) for r in rows}):
        mine = sorted((r for r in rows if (r["num_codes"], r["method"]) == (k, method)), key=lambda r: r["seed"])
        figures = {}
        for name, path in FIGURES:
            values = [_get(r, path) for r in mine]
            if all(v is not None for v in values):
                figures[name] = summarize([float(v) for v in values])
        out.append({"num_codes": k, "method": method, "seeds": [r["seed"] for r in mine], "figures": figures})
    return out


def _fd_of(row: dict[str, Any], key: str) -> dict[str, float] | None:
    return row.get(key) if key == "reconstruction_fd" else _get(row, (key, "samples_fd"))


def targets(rows: list[dict[str, Any]], ours: str = "ddcl") -> list[dict[str, Any]]:
    """The study's targets, judged per codebook size from the test rows.

    - For each :data:`JUDGED` distance and each peer method: ``met`` when the highest upper end of ``ours``'s points'
      intervals lies below the lowest lower end of the peer's (no interval overlaps; every seed of both counted) and
      ``ours`` has at least :data:`~eval._spread.MIN_SEEDS` seeds.
    - The soft-target prior against the one-hot prior on the same codes: ``met`` when every point's soft samples
      interval lies below its one-hot interval, the paired bits difference is at most :data:`BITS_TOLERANCE` of the
      one-hot bits at every point, and there are at least ``MIN_SEEDS`` points.
    """
    out = []
    for k in sorted({r["num_codes"] for r in rows}):
        mine = [r for r in rows if r["num_codes"] == k and r["method"] == ours]
        if not mine:
            continue
        enough = len(mine) >= MIN_SEEDS
        for label, key in JUDGED:
            if any(_fd_of(r, key) is None for r in mine):
                continue
            high = max(_fd_of(r, key)["high"] for r in mine)
            for peer in sorted({r["method"] for r in rows if r["num_codes"] == k and r["method"] != ours}):
                theirs = [_fd_of(r, key) for r in rows if r["num_codes"] == k and r["method"] == peer]
                if any(x is None for x in theirs):
                    continue
                low = min(x["low"] for x in theirs)
                out.append({"num_codes": k, "target": f"{label}: {ours} below {peer}", "ours_high": high,
                            "theirs_low": low, "seeds": [len(mine), len(theirs)], "met": high < low and enough,
                            "why": "" if enough else f"{len(mine)} {ours} seed(s), fewer than {MIN_SEEDS}"})
        soft = [r for r in mine if "soft" in r]
        if soft:
            apart = [r["soft"]["samples_fd"]["high"] < r["one_hot"]["samples_fd"]["low"] for r in soft]
            rise = [r["soft_minus_one_hot_bits"]["value"] / r["one_hot"]["bits_per_image"]["value"] for r in soft]
            ok = all(apart) and max(rise) <= BITS_TOLERANCE and len(soft) >= MIN_SEEDS
            out.append({"num_codes": k, "target": "soft-target prior: samples CFD below the one-hot prior's, bits "
                        f"+{BITS_TOLERANCE:.0%} at most", "points_apart": sum(apart), "points": len(soft),
                        "largest_bits_rise": max(rise), "met": ok,
                        "why": "" if len(soft) >= MIN_SEEDS else f"{len(soft)} point(s), fewer than {MIN_SEEDS}"})
    return out


TARGETS_RULE = (f"DDCL's distances against every peer's: met when the highest upper end of DDCL's points' intervals "
                f"lies below the lowest lower end of the peer's, with at least {MIN_SEEDS} DDCL seeds. The soft-target "
                f"prior: met when at every DDCL point its samples' interval lies below the one-hot prior's and its "
                f"bits per image rise by at most {BITS_TOLERANCE:.0%}, at {MIN_SEEDS} points or more.")


def methods_table(methods: list[dict[str, Any]]) -> list[str]:
    """The lines of the by-method table (:func:`by_method`'s rows): mean ± sample std of each figure; the value alone
    for a method of one seed (it has no spread to show)."""
    lines = ["| K | method | seeds | " + " | ".join(name for name, _ in FIGURES) + " |",
             "|---|---|---|" + "---|" * len(FIGURES)]

    def cell(name: str, f: dict[str, Any] | None, seeds: int) -> str:
        if f is None:
            return "-"
        digits = 3 if "classified" in name else 2
        return f"{f['mean']:.{digits}f}" + (f" ± {f['std']:.{digits}f}" if seeds > 1 else "")

    for m in methods:
        cells = [cell(name, m["figures"].get(name), len(m["seeds"])) for name, _ in FIGURES]
        lines.append(f"| {m['num_codes']} | {m['method']} | {len(m['seeds'])} | " + " | ".join(cells) + " |")
    return lines


def targets_table(found: list[dict[str, Any]]) -> list[str]:
    """The lines of the targets table (:func:`targets`' verdicts, :data:`TARGETS_RULE`)."""
    lines = ["| K | target | figures | verdict |", "|---|---|---|---|"]
    for t in found:
        figures = (f"DDCL's highest {t['ours_high']:.2f}, the peer's lowest {t['theirs_low']:.2f} (seeds "
                   f"{t['seeds'][0]} and {t['seeds'][1]})" if "ours_high" in t else
                   f"{t['points_apart']} of {t['points']} points apart; largest bits rise "
                   f"{t['largest_bits_rise']:+.1%}")
        verdict = "**met**" if t["met"] else "**not met**" + (f" ({t['why']})" if t["why"] else "")
        lines.append(f"| {t['num_codes']} | {t['target']} | {figures} | {verdict} |")
    return lines


def _mean(values: dict[str, list[float]]) -> str:
    return ", ".join(f"{k}: {statistics.fmean(v):.2f}" for k, v in values.items())


def trained_at(rows: list[dict[str, Any]]) -> list[str]:
    """The commits the points' VQ-VAEs were trained at, sorted (records from before they were kept name none): what
    the report's ``Code:`` line and the README's ``Source:`` line name beside the study's commit."""
    return sorted({c for r in rows if (c := r.get("code"))})


def _codes(rows: list[dict[str, Any]]) -> str:
    codes = trained_at(rows)
    return f"VQ-VAEs trained at {', '.join(codes)}; " if codes else ""


def report(summary: dict[str, Any]) -> str:
    """``report.md``: what was scored and how (budget, protocol, splits), then the test tables, the priors'
    validation figures and the wall times."""
    proto, prior, rows = summary["protocol"], summary["prior"], summary["rows"]
    s, a, w = prior["settings"], proto["soft_targets"], proto["guidance"]
    sizes = "; ".join(sorted({f"{r['train_images']:,} images, {r['prior_steps']:,} steps" for r in rows}))
    lines = ["# Sample quality of the long runs' VQ-VAEs", "", f"Regenerate: `{summary['command']}`", "",
             f"Code: {_codes(rows)}study run at {summary['commit']}. Runs: `{summary['runs']}` (each its kept final "
             f"checkpoint, hashed below); "
             f"what is derived from them (codes, priors): `{summary['work']}`.", "",
             describe(summary["classifier"]) + " Bits per image: the mean over every test image of the "
             "prior's NLL of the image's hard code grid (summed over positions), with the same interval over images.",
             "", f"Prior budget, the same for every VQ-VAE and every prior: a transformer of {s['layers']} layers, "
             f"width {s['dim']}, {s['heads']} heads, dropout {s['dropout']:g}, {s['epochs']} epochs over the codes of "
             f"the run's training images ({sizes}; batches of {s['batch_size']}), AdamW lr {s['lr']:g} (weight decay "
             f"{s['weight_decay']:g}, {s['warmup_steps']} warmup steps, cosine decay), seed {s['seed']}."]
    if prior["soft_targets"]:
        lines[-1] += (f" Soft-target priors (DDCL points), A in {prior['soft_targets']}: the same network, seed, "
                      f"batches and steps, trained on (1 - A) x the cross-entropy to the hard code + A x the "
                      f"cross-entropy to the token's {prior['soft_top_k']} largest assignments (renormalised); their "
                      f"bits are the hard codes'.")
    if prior["conditional"]:
        lines[-1] += " The class-conditional prior: the same, with label dropout 0.1 (the null class of guidance)."
    lines += ["", f"Protocol, chosen on the **validation split** ({proto['samples']} samples per prior, seed "
                  f"{proto['seed']}, against the validation images; the test split is read after): temperature "
                  f"{proto['temperature']:g}, no top-k (mean validation CFD of the one-hot priors' samples by "
                  f"temperature: {_mean(proto['validation_fd'])})"]
    if a is not None:
        by_at = {f"A {k} at {t}": fd for k, v in proto["validation_soft"].items() for t, fd in v["fd"].items()}
        lines[-1] += (f"; for the soft-target priors, A = {a:g} at temperature {proto['soft_temperature']:g}, chosen "
                      f"together among the same temperatures (mean validation CFD of the DDCL points' soft priors: "
                      f"{_mean(by_at)}; validation bits per image: "
                      f"{_mean({k: v['bits'] for k, v in proto['validation_soft'].items()})}; a tie goes to the fewer "
                      f"bits)")
    if w is not None:
        lines[-1] += (f"; guidance {w:g} for class-conditional samples at temperature 1 (mean validation CFD: "
                      f"{_mean({k: [r['fd'] for r in v] for k, v in proto['validation_guidance'].items()})})")
    lines[-1] += (f". Test figures: fresh draws (seed {proto['test_seed']}) against {proto['samples']} test images (a "
                  f"fixed random subset, every class). Real test images are classified right "
                  f"{summary['real_test_accuracy']:.3f} of the time.")
    lines += ["", "## By method (test split)", "", "Mean ± sample std over the seeds (the values in results.json).",
              "", *methods_table(summary["methods"]), "", "## Targets (test split)", "", TARGETS_RULE, "",
              *targets_table(summary["targets"]), "", "## VQ-VAEs (test split)", "",
              "| point | checkpoint sha256 | epochs | PSNR hard (the run's) | "
              "reconstructions CFD (the floor) | reconstructions classified right |", "|---|---|---|---|---|---|"]
    lines += [f"| {r['point']} | {r['checkpoint_sha256'][:16]} | {r['epochs']} | {r['psnr_hard']:.2f} | "
              f"{_fd(r['reconstruction_fd'])} | {r['reconstruction_accuracy']:.3f} |" for r in rows]
    lines += ["", "## Unconditional samples, one-hot prior (test split)", "", "| point | bits / image | samples CFD |",
              "|---|---|---|"]
    lines += [f"| {r['point']} | {_fd(r['one_hot']['bits_per_image'])} | {_fd(r['one_hot']['samples_fd'])} |"
              for r in rows]
    soft = [r for r in rows if "soft" in r]
    if soft:
        lines += ["", f"## Soft-target prior (A = {a:g}, temperature {proto['soft_temperature']:g}, chosen on "
                      "validation) against the one-hot prior (test split)",
                  "", "| point | bits / image, one-hot | bits / image, soft | soft - one-hot, paired | samples CFD, "
                  "one-hot | samples CFD, soft |", "|---|---|---|---|---|---|"]
        lines += [f"| {r['point']} | {_fd(r['one_hot']['bits_per_image'])} | {_fd(r['soft']['bits_per_image'])} "
                  f"| {_fd(r['soft_minus_one_hot_bits'], '+')} | {_fd(r['one_hot']['samples_fd'])} | "
                  f"{_fd(r['soft']['samples_fd'])} |" for r in soft]
        bits = statistics.fmean(r["soft_minus_one_hot_bits"]["value"] for r in soft)
        fd = statistics.fmean(r["soft"]["samples_fd"]["value"] - r["one_hot"]["samples_fd"]["value"] for r in soft)
        lines += ["", f"- Mean over the {len(soft)} point(s), soft - one-hot: {bits:+.2f} bits per image, samples "
                      f"CFD {fd:+.2f}."]
    if w is not None:
        lines += ["", f"## Guided class-conditional samples (guidance {w:g}, chosen on validation; test split)", "",
                  "| point | classified as their class | samples CFD | bits / image given the class | "
                  "reconstructions classified right |", "|---|---|---|---|---|"]
        lines += [f"| {r['point']} | {r['conditional']['samples_accuracy']:.3f} | "
                  f"{_fd(r['conditional']['samples_fd'])} | {_fd(r['conditional']['bits_per_image'])} | "
                  f"{r['reconstruction_accuracy']:.3f} |" for r in rows]
    lines += ["", "## Priors (validation split)", "", "| point | prior | fit seconds | bits / image |",
              "|---|---|---|---|"]
    lines += [f"| {r['point']} | {name} | {p['fit_seconds']:.0f} | {p['val_bits_per_image']:.2f} |"
              for r in rows for name, p in r["priors"].items()]
    t = summary["wall_s"]
    lines += ["", "## Wall time", "", f"This invocation: {t['prepare']:.0f} s preparing the points (VQ-VAEs from "
              f"their checkpoints; codes and priors read from the work directory where it held them, else derived: "
              f"each prior's fit seconds above, recorded when it was trained), {t['select']:.0f} s choosing the "
              f"protocol on validation, {t['test']:.0f} s scoring on the test split."]
    return "\n".join(lines) + "\n"


def render_test(sources: Sequence[tuple[Path, str]], flags: Sequence[str] = ()) -> list[str]:
    """The README/docs block ``generative_test`` (:mod:`eval.render`): the long runs' sample-quality study's by-method
    table and its targets' verdicts, from its ``results.json``."""
    lines: list[str] = []
    for path, rel in sources:
        data = render.load(path)
        s = data["prior"]["settings"]
        setting = (f"K = {', '.join(str(k) for k in sorted({r['num_codes'] for r in data['rows']}))}, the long runs' "
                   f"final checkpoints; priors of {s['layers']} layers, width {s['dim']}, {s['epochs']} epochs; "
                   f"protocol chosen on validation")
        lines += [*methods_table(data["methods"]), "", *targets_table(data["targets"]), "", TARGETS_RULE, "",
                  render.source_line(rel, [*trained_at(data["rows"]), data["commit"]], setting, "test"), ""]
    return lines[:-1]
