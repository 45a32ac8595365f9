"""Compare code priors trained by ``train_prior.py`` on different codebooks: test NLL against unigram baselines.

    python -m eval.prior_report --run ddcl=runs/prior/ddcl --run hard=runs/prior/hard --out reports/prior

Each ``NAME=DIR`` is a ``train_prior.py`` output directory (its ``test.json`` and ``history.jsonl`` are read).
When the prior's VQ-VAE checkpoint sits in a ``train_vqvae.py`` run (``<run>/checkpoints/<file>.ckpt`` beside
``<run>/history.jsonl``), the VQ-VAE's last validation figures are added. Writes ``results.json`` (everything),
``table.md`` (one row per codebook) and ``position_bits.png`` (the test NLL at each grid position) to ``--out``.

Why the baselines: the NLL of a prior is bounded by the information in the codes. A collapsed codebook that uses
a handful of codes has little to predict, so its bits per position are low for a trivial reason. The entropy of
the test codes' own distribution, ``log2(perplexity)``, is what a context-free model that knew those frequencies
would pay; the prior's gain over it is what context (the transformer) buys.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

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
        raise FileNotFoundError(f"{test} not found: is {directory} a finished train_prior.py run?")
    result = json.loads(test.read_text())
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


def main(argv: list[str] | None = None) -> dict[str, Any]:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--run", type=_run, action="append", required=True, metavar="NAME=DIR",
                   help="a train_prior.py output directory and the name to show for it (repeat)")
    p.add_argument("--out", type=Path, default=Path("reports/prior"), help="where results.json and table.md go")
    args = p.parse_args(argv)
    runs = [load_run(name, directory) for name, directory in args.run]
    args.out.mkdir(parents=True, exist_ok=True)
    text = table(runs)
    write_atomic(args.out / "table.md", text)
    write_atomic(args.out / "results.json", json.dumps({"runs": runs}, indent=2) + "\n")
    position_figure(runs, args.out / "position_bits.png")
    print(text)
    return {"runs": runs, "table": text}


if __name__ == "__main__":
    sys.exit(run_command(main))
