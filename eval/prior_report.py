"""Compare code priors trained by ``softvq-prior`` on different codebooks: test NLL against unigram baselines.

    python -m eval.prior_report --run ddcl=runs/prior/ddcl --run hard=runs/prior/hard --out reports/prior

Each ``NAME=DIR`` is a ``softvq-prior`` output directory (its ``test.json``, ``history.jsonl`` and ``config.json``
are read). When the prior's VQ-VAE checkpoint sits in a ``softvq-train`` run (``<run>/checkpoints/<file>.ckpt``
beside ``<run>/history.jsonl``), the VQ-VAE's last validation figures are added. Writes ``report.md`` (header with
the commands that made every run and the code commit, setup, tables, what the numbers say), ``results.json``
(everything), ``table.md`` (one row per codebook) and ``position_bits.png`` (the test NLL at each grid position) to
``--out``. Sample grids that ``softvq-sample`` wrote into ``--out`` (``samples_*.png``, with the settings it saved
beside each) are listed with the command that drew them.

Why the baselines: the NLL of a prior is bounded by the information in the codes. A collapsed codebook that uses
a handful of codes has little to predict, so its bits per position are low for a trivial reason. The entropy of
the test codes' own distribution, ``log2(perplexity)``, is what a context-free model that knew those frequencies
would pay; the prior's gain over it is what context (the transformer) buys.
"""

from __future__ import annotations

import argparse
import json
import shlex
import sys
from pathlib import Path
from typing import Any

from eval._provenance import code_commit, portable, study_command
from softvq.cli.common import run_command
from softvq.models.callbacks import read_history
from softvq.models.files import write_atomic


def _run(text: str) -> tuple[str, Path]:
    name, sep, path = text.partition("=")
    if not sep or not name or not path:
        raise argparse.ArgumentTypeError(f"expected NAME=DIR, got {text!r}")
    return name, Path(path)


def load_run(name: str, directory: Path) -> dict[str, Any]:
    """``test.json`` and ``history.jsonl`` of one prior run, and its VQ-VAE's last history record if found."""
    test = directory / "test.json"
    if not test.is_file():
        raise FileNotFoundError(f"{test} not found: is {directory} a finished softvq-prior run?")
    result = json.loads(test.read_text())
    config = directory / "config.json"
    result["run_config"] = json.loads(config.read_text()) if config.is_file() else None
    vqvae_history = Path(result["vqvae"]["path"]).parent.parent / "history.jsonl"
    vqvae_last = read_history(vqvae_history)[-1:] if vqvae_history.is_file() else []
    return {"name": name, "dir": str(directory), **result, "history": read_history(directory / "history.jsonl"),
            "vqvae_last_epoch": vqvae_last[0] if vqvae_last else None}


def table(runs: list[dict[str, Any]]) -> str:
    header = ["codebook", "K", "test codes used", "test code perplexity", "unigram entropy = log2 ppl (bits)",
              "train-unigram cross-entropy (bits)", "prior test NLL (bits/position)", "gain over unigram (bits)",
              "prior / unigram", "prior bits per image", "VQ-VAE val PSNR (hard)", "prior fit (s)"]
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    for r in runs:
        unigram, prior = r["test_unigram_entropy_bits"], r["test_bits_per_position"]
        ratio = f"{prior / unigram:.3f}" if unigram > 0 else "n/a"
        last = r["vqvae_last_epoch"] or {}
        psnr = f"{last['val_psnr_hard']:.2f}" if last.get("val_psnr_hard") is not None else "n/a"
        cells = [r["name"], str(r["vqvae"]["num_codes"]), str(r["test_codes_used"]), f"{r['test_code_perplexity']:.1f}",
                 f"{unigram:.3f}", f"{r['train_unigram_cross_entropy_bits']:.3f}", f"{prior:.3f}",
                 f"{unigram - prior:.3f}", ratio, f"{r['test_bits_per_image']:.1f}", psnr, f"{r['fit_seconds']:.0f}"]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def sample_grids(out: Path) -> list[tuple[str, str | None]]:
    """The ``samples_*.png`` grids in ``out`` and the ``softvq-sample`` command that drew each (from the settings
    saved beside it; ``None`` when there are none)."""
    from softvq.cli.sample import build_parser as sample_parser

    grids = []
    for png in sorted(out.glob("samples_*.png")):
        saved = png.with_suffix(".json")
        config = json.loads(saved.read_text()) if saved.is_file() else None
        grids.append((png.name, command_of(config, sample_parser(), "softvq-sample", ("prior", "n"))))
    return grids


def position_figure(runs: list[dict[str, Any]], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, len(runs), figsize=(3.2 * len(runs), 3.0), squeeze=False)
    top = max(max(max(row) for row in r["test_position_bits"]) for r in runs)
    for ax, r in zip(axes[0], runs, strict=True):
        image = ax.imshow(r["test_position_bits"], vmin=0, vmax=top, cmap="viridis")
        ax.set_title(f"{r['name']}: {r['test_bits_per_position']:.2f} bits/pos", fontsize=9)
        ax.set_xticks([])
        ax.set_yticks([])
    fig.colorbar(image, ax=axes[0].tolist(), shrink=0.8, label="test NLL (bits)")
    fig.savefig(path, dpi=80)
    plt.close(fig)


def _flag_value(value: Any) -> str:
    return "true" if value is True else "false" if value is False else "null" if value is None else str(value)


def command_of(config: dict[str, Any] | None, parser: Any, program: str, first: tuple[str, ...] = ()) -> str | None:
    """The command line that repeats a run from its saved settings: ``program`` with every setting that differs from
    the parser's default (``first`` keys lead). ``None`` for a run saved before the settings were recorded nested."""
    from softvq.cli.config import flat

    if not config or (program == "softvq-prior" and "model" not in config):
        return None
    defaults = flat(json.loads(json.dumps(parser.get_defaults().as_dict(), default=str)))
    given = flat(config)
    switches = {action.dest for action in parser._actions if action.nargs == 0}  # flags that take no value
    keys = [k for k in first if k in given] + [k for k in given if k not in first]
    words = [program]
    for key in keys:
        if key in defaults and given[key] != defaults[key] and key != "config":
            words += [f"--{key}"] if key in switches else [f"--{key}", _flag_value(given[key])]
    return shlex.join(words)


def position_split(bits: list[list[float]]) -> dict[str, float]:
    """Mean test NLL of the first position, the border (every other position on the grid's edge) and the interior."""
    h, w = len(bits), len(bits[0])
    edge = [(i, j) for i in range(h) for j in range(w) if i in (0, h - 1) or j in (0, w - 1)]
    border = [bits[i][j] for i, j in edge if (i, j) != (0, 0)]
    interior = [bits[i][j] for i in range(1, h - 1) for j in range(1, w - 1)]
    return {"first": bits[0][0], "border": sum(border) / len(border), "interior": sum(interior) / len(interior),
            "border_positions": len(border), "interior_positions": len(interior)}


def readings(runs: list[dict[str, Any]]) -> list[str]:
    """What the numbers say, computed from them: context gain per run, and what a class label buys where a
    conditional prior has an unconditional twin on the same VQ-VAE."""
    lines = []
    for r in runs:
        gain = r["test_unigram_entropy_bits"] - r["test_bits_per_position"]
        lines.append(f"- **{r['name']}**: {r['test_bits_per_position']:.3f} bits per position "
                     f"({r['test_bits_per_image']:.1f} per image) against a unigram entropy of "
                     f"{r['test_unigram_entropy_bits']:.3f}: context buys {gain:.3f} bits per position; "
                     f"{r['test_codes_used']} of {r['vqvae']['num_codes']} codes appear in the test codes.")
    for r in runs:
        if not r.get("class_conditional"):
            continue
        twins = [u for u in runs if not u.get("class_conditional") and u["vqvae"]["sha256"] == r["vqvae"]["sha256"]]
        for u in twins:
            saved = u["test_bits_per_position"] - r["test_bits_per_position"]
            lines.append(f"- **The class label** ({r['name']} against {u['name']}, the same VQ-VAE): {saved:+.3f} bits "
                         f"per position, {saved * r['config']['height'] * r['config']['width']:+.1f} per image, of "
                         f"the log2 {r['config']['num_classes']} bits a label can carry.")
    return lines


def render(runs: list[dict[str, Any]], argv: list[str] | None, samples: list[tuple[str, str | None]]) -> str:
    """``report.md``: a generated report, every number from the runs."""
    from softvq.cli.prior import build_parser as prior_parser

    commands = [command_of(r.get("run_config"), prior_parser(), "softvq-prior", ("vqvae", "out"))
                or f"# {r['name']}: settings saved before they were recorded nested; see results.json" for r in runs]
    first = runs[0]
    c, hist = first["config"], first["history"]
    lines = ["# A generative prior over VQ-VAE codes: bits per position against the unigram baselines", "",
             f"Regenerate: `{study_command('eval.prior_report', argv)}`, after training each prior and drawing its "
             "samples:", "",
             *[f"    {cmd}" for cmd in commands], *[f"    {cmd}" for _, cmd in samples if cmd], "",
             f"Code: {code_commit()} (this report; the priors were trained from the commands above)", "",
             "One autoregressive transformer prior (`softvq-prior`, `softvq.models.CodePrior`) per codebook, the same "
             f"settings for all: {c['layers']} layers, width {c['dim']}, {c['heads']} heads, MLP {c['mlp_ratio']}x, "
             f"dropout {c['dropout']} ({first['parameters']:,} parameters), {first['epochs']} epochs on the code "
             f"grids of {first['train_sequences']:,} training images ({hist[-1]['step'] if hist else '?'} steps), "
             f"validation on {first['val_sequences']:,} held-out images. The test NLL is measured once, on the codes "
             f"of the official {first['test_sequences']:,} test images, with the final weights. Single seed.", "",
             "| codebook | VQ-VAE (quantizer, last.ckpt sha256) | VQ-VAE val PSNR (hard) | prior fit (s) | threads |",
             "|---|---|---|---|---|"]
    for r in runs:
        last = r["vqvae_last_epoch"] or {}
        psnr = f"{last['val_psnr_hard']:.2f} dB" if last.get("val_psnr_hard") is not None else "n/a"
        lines.append(f"| {r['name']} | {r['vqvae']['quantizer']}, `{r['vqvae']['sha256'][:16]}...` | {psnr} | "
                     f"{r['fit_seconds']:.0f} | {r['threads']} |")
    lines += ["", "## Test split", "", table(runs), "",
              "Unigram entropy: the entropy of the test codes' own frequencies (log2 of their perplexity), what a "
              "context-free model that knew them would pay; a unigram fitted on the training codes pays the "
              "train-unigram cross-entropy. The gain over it is what context (the transformer) buys. "
              "A collapsed codebook has little to predict, so its bits per position are low for a trivial reason.", "",
              "| codebook | first position (no context) | border positions | interior positions | val NLL per epoch |",
              "|---|---|---|---|---|"]
    for r in runs:
        split = position_split(r["test_position_bits"])
        val = ", ".join(f"{row['val_bits']:.2f}" for row in r["history"] if row.get("val_bits") is not None)
        lines.append(f"| {r['name']} | {split['first']:.2f} | {split['border']:.2f} ({split['border_positions']}) | "
                     f"{split['interior']:.2f} ({split['interior_positions']}) | {val} |")
    lines += ["", "![bits per grid position](position_bits.png)", "", "## What the numbers say", "", *readings(runs)]
    if samples:
        lines += ["", "## Samples", "", "Decoded from hard indices by each prior's own VQ-VAE: " +
                  ", ".join(f"`{name}`" for name, _ in samples) + "."]
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> dict[str, Any]:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--run", type=_run, action="append", required=True, metavar="NAME=DIR",
                   help="a softvq-prior output directory and the name to show for it (repeat)")
    p.add_argument("--out", type=Path, default=Path("reports/prior"), help="where results.json and table.md go")
    args = p.parse_args(argv)
    runs = [load_run(name, directory) for name, directory in args.run]
    args.out.mkdir(parents=True, exist_ok=True)
    text = table(runs)
    header = (f"Regenerate: `{study_command('eval.prior_report', argv)}` (the table of [report.md](report.md))\n\n"
              f"Code: {code_commit()}\n\n")
    write_atomic(args.out / "table.md", header + text)
    write_atomic(args.out / "results.json", json.dumps(portable({"runs": runs}), indent=2) + "\n")
    position_figure(runs, args.out / "position_bits.png")
    write_atomic(args.out / "report.md", render(runs, argv, sample_grids(args.out)))
    print(text)
    return {"runs": runs, "table": text}


if __name__ == "__main__":
    sys.exit(run_command(main))
