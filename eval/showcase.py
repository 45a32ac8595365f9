"""The showcase generative model: a DDCL VQ-VAE and a guided class-conditional prior on the full training split, and a
labelled grid of samples per class beside real test images of that class.

    python -m eval.showcase --data-root ../shared/data/cifar10-jpeg.tar.gz --runs runs/showcase --out reports/showcase

Three steps, each kept in ``--runs`` and skipped when finished (an interrupted step resumes from its last
checkpoint): ``softvq-train --quantizer ddcl`` for ``--vqvae-epochs`` epochs on all 45,000 training images,
``softvq-prior --model.class_conditional true`` (label dropout 0.1, for classifier-free guidance) on their codes, then
``--per-class`` samples of every class with ``--guidance`` beside the first ``--per-class`` test images of the class.
The commands are the library's own, with their defaults except the flags named here (``--vqvae-args`` and
``--prior-args`` pass more). Writes ``samples.png`` and ``showcase.json`` (commands, commit, timings, the VQ-VAE's
validation PSNR and the prior's test NLL) to ``--out``. With ``--vqvae CKPT --prior RUN`` it trains nothing and draws
the grid from those runs (a class-conditional ``softvq-prior`` run with label dropout, on that VQ-VAE's codes).
"""

from __future__ import annotations

import argparse
import json
import shlex
import sys
import time
from pathlib import Path
from typing import Any

import torch

from eval._provenance import code_commit
from softvq.cli import prior as train_prior
from softvq.cli import train as train_vqvae
from softvq.cli.common import run_command
from softvq.data.cifar10 import CIFAR10DataModule
from softvq.models.callbacks import read_history
from softvq.models.files import write_atomic
from softvq.models.prior import load_prior
from softvq.models.vqvae import load_vqvae


def vqvae_step(args: argparse.Namespace) -> tuple[Path, list[str], float]:
    out = args.runs / "vqvae"
    ckpt = out / "checkpoints" / "last.ckpt"  # one --quantizer: the run is --out itself
    history = out / "history.jsonl"
    argv = ["--quantizer", "ddcl", "--epochs", str(args.vqvae_epochs), "--data.data_root", str(args.data_root),
            "--out", str(out), *shlex.split(args.vqvae_args)]
    done = history.is_file() and len(read_history(history)) >= args.vqvae_epochs and ckpt.is_file()
    begin = time.perf_counter()
    if not done:
        train_vqvae.main([*argv, *(["--resume"] if ckpt.is_file() else [])])
    return ckpt, argv, time.perf_counter() - begin


def prior_step(args: argparse.Namespace, vqvae: Path) -> tuple[Path, list[str], float]:
    out = args.runs / "prior"
    argv = ["--vqvae", str(vqvae), "--model.class_conditional", "true", "--epochs", str(args.prior_epochs),
            "--model.dim", str(args.prior_dim), "--data.data_root", str(args.data_root), "--out", str(out),
            *shlex.split(args.prior_args)]
    begin = time.perf_counter()
    if not (out / "test.json").is_file():
        last = out / "checkpoints" / "last.ckpt"
        train_prior.main([*argv, *(["--resume"] if last.is_file() else [])])
    return out, argv, time.perf_counter() - begin


@torch.no_grad()
def grid(args: argparse.Namespace, vqvae_path: Path, prior_dir: Path) -> dict[str, Any]:
    """``samples.png``: one row per class, ``per_class`` guided samples, then real test images of the class."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    prior, vqvae = load_prior(prior_dir / "checkpoints" / "last.ckpt"), load_vqvae(vqvae_path)
    classes = tuple(prior.vqvae.classes)
    data = CIFAR10DataModule(args.data_root, num_workers=0)
    data.setup("test")
    n = args.per_class
    real: dict[int, list[torch.Tensor]] = {c: [] for c in range(len(classes))}
    for x, y in data.test_set:
        if len(real[y]) < n:
            real[y].append(x)
        if all(len(v) == n for v in real.values()):
            break
    labels = torch.arange(len(classes)).repeat_interleave(n)
    codes = prior.sample(len(labels), labels, guidance=args.guidance, temperature=args.temperature,
                         generator=torch.Generator().manual_seed(args.seed))
    samples = vqvae.decode_indices(codes).clamp(0, 1)
    fig, axes = plt.subplots(len(classes), 2 * n + 1, figsize=((2 * n + 1) * 0.75, len(classes) * 0.8))
    for c, name in enumerate(classes):
        row = [*samples[c * n:(c + 1) * n], None, *real[c]]
        for ax, image in zip(axes[c], row, strict=True):
            ax.axis("off")
            if image is not None:
                ax.imshow(image.permute(1, 2, 0).numpy())
        axes[c][0].text(-4, 16, name, ha="right", va="center", fontsize=8)
    axes[0][n // 2].set_title(f"samples (guidance {args.guidance:g})", fontsize=8)
    axes[0][n + 1 + n // 2].set_title("real test images", fontsize=8)
    fig.subplots_adjust(left=0.1, wspace=0.05, hspace=0.05)
    args.out.mkdir(parents=True, exist_ok=True)
    fig.savefig(args.out / "samples.png", dpi=100, bbox_inches="tight")
    plt.close(fig)
    return {"classes": list(classes), "per_class": n, "guidance": args.guidance, "temperature": args.temperature,
            "seed": args.seed, "distinct_codes": int(torch.unique(codes).numel())}


def main(argv: list[str] | None = None) -> dict[str, Any]:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--data-root", type=Path, default=Path("data"))
    p.add_argument("--runs", type=Path, default=Path("runs/showcase"))
    p.add_argument("--out", type=Path, default=Path("reports/showcase"))
    p.add_argument("--vqvae-epochs", type=int, default=20)
    p.add_argument("--prior-epochs", type=int, default=8)
    p.add_argument("--prior-dim", type=int, default=192)
    p.add_argument("--vqvae-args", default="", help="more softvq-train flags, one string")
    p.add_argument("--prior-args", default="", help="more softvq-prior flags, one string, e.g. '--model.layers 6'")
    p.add_argument("--per-class", type=int, default=8)
    p.add_argument("--guidance", type=float, default=2.0)
    p.add_argument("--temperature", type=float, default=1.0)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--vqvae", type=Path, default=None,
                   help="with --prior: draw the grid from these runs (a VQ-VAE checkpoint and the softvq-prior run "
                        "directory of a class-conditional prior on its codes) instead of training the showcase's")
    p.add_argument("--prior", type=Path, default=None, help="see --vqvae")
    args = p.parse_args(argv)
    if (args.vqvae is None) != (args.prior is None):
        p.error("--vqvae and --prior go together")
    if args.vqvae_epochs < 1 or args.prior_epochs < 1 or args.per_class < 1 or args.guidance < 0:
        p.error("epochs and --per-class must be positive and --guidance non-negative")
    command = "python -m eval.showcase " + " ".join(argv if argv is not None else sys.argv[1:])
    if args.vqvae is not None:  # the grid of given runs
        if not (args.prior / "checkpoints" / "last.ckpt").is_file():
            p.error(f"--prior {args.prior} holds no checkpoints/last.ckpt of softvq-prior")
        summary = {"command": command, "commit": code_commit(), "vqvae": str(args.vqvae), "prior": str(args.prior),
                   **grid(args, args.vqvae, args.prior)}
        write_atomic(args.out / "showcase.json", json.dumps(summary, indent=1))
        return summary
    vqvae, vqvae_argv, vqvae_s = vqvae_step(args)
    prior_dir, prior_argv, prior_s = prior_step(args, vqvae)
    figure = grid(args, vqvae, prior_dir)
    last = read_history(vqvae.parent.parent / "history.jsonl")[-1]
    test = json.loads((prior_dir / "test.json").read_text())
    summary = {"command": command, "commit": code_commit(), "vqvae_command": "softvq-train " + " ".join(vqvae_argv),
               "prior_command": "softvq-prior " + " ".join(prior_argv), "vqvae_seconds": vqvae_s,
               "prior_seconds": prior_s, "vqvae_val_psnr_hard": last.get("val_psnr_hard"),
               "prior_test_bits_per_image": test["test_bits_per_image"], "prior_fit_seconds": test["fit_seconds"],
               **figure}
    write_atomic(args.out / "showcase.json", json.dumps(summary, indent=1))
    return summary


def cli(argv: list[str] | None = None) -> int:
    return run_command(main, argv)


if __name__ == "__main__":
    raise SystemExit(cli())
