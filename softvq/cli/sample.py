"""Sample new CIFAR-10 images: draw code grids from a trained prior, decode them with its VQ-VAE, save a PNG grid.

Examples:
    softvq-sample --prior runs/prior-ddcl/checkpoints/last.ckpt --n 64 --out samples.png
    softvq-sample --prior runs/prior-cond/checkpoints/last.ckpt --label horse --temperature 0.9 --top_k 100
    softvq-sample --prior runs/prior-cond/checkpoints/last.ckpt --guidance 3    # classifier-free guidance

``--vqvae`` defaults to the checkpoint recorded in the prior; a VQ-VAE of another codebook size or latent grid is
refused, and so is another checkpoint of the same shape (its codes mean something else) unless
``--allow_other_vqvae``. A class-conditional prior without ``--label`` draws every class in turn, in contiguous
blocks of ``n / 10`` images (row by row in the grid).
"""

from __future__ import annotations

import json
import logging
import math
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch
from jsonargparse import ArgumentParser
from jsonargparse.typing import NonNegativeFloat, PositiveFloat, PositiveInt
from torchvision.utils import make_grid, save_image

from softvq.cli.common import run_command
from softvq.cli.parsing import command_parser, parse, resolved
from softvq.data.cifar10 import CLASSES, sha256_file
from softvq.models.files import write_atomic
from softvq.models.prior import check_pairing, class_index, load_prior
from softvq.models.vqvae import load_vqvae

log = logging.getLogger("softvq")


PROG = "softvq-sample"


def build_parser() -> ArgumentParser:
    """The ``softvq-sample`` parser: ``--config``, ``--print_config`` and the flags below; nothing here trains, so it
    has no ``--data.*``, ``--model.*`` or ``--trainer.*`` section."""
    p = command_parser(PROG, __doc__.split("\n\n")[0],
                       epilog="Write a config file with --print_config > sample.yaml and draw from it with --config "
                              "sample.yaml.")
    p.add_argument("--prior", type=Path | None, default=None, help="a prior checkpoint of softvq-prior (required)")
    p.add_argument("--vqvae", type=Path | None, default=None,
                   help="the VQ-VAE checkpoint that decodes the codes (default: the one recorded in the prior)")
    p.add_argument("--n", type=PositiveInt, default=64, help="images to draw")
    p.add_argument("--temperature", type=PositiveFloat, default=1.0,
                   help="divide the logits by this (< 1: sharper, more typical images; > 1: more varied)")
    p.add_argument("--top_k", type=PositiveInt | None, default=None,
                   help="sample each code among the K most likely only (1 = greedy); default: all codes")
    p.add_argument("--guidance", type=NonNegativeFloat, default=1.0,
                   help="classifier-free guidance weight w of a class-conditional prior: logits l_null + w (l_class - "
                        "l_null); 1 = plain conditional sampling, > 1 = more typical of the class")
    p.add_argument("--label", type=str | None, default=None, metavar="NAME|INDEX",
                   help=f"class of a class-conditional prior: one of {', '.join(CLASSES)} or 0-{len(CLASSES) - 1}")
    p.add_argument("--seed", type=int, default=0, help="seed of the draws")
    p.add_argument("--out", type=Path, default=Path("samples.png"),
                   help="the PNG grid to write; the resolved settings go beside it (<out> with .json)")
    p.add_argument("--nrow", type=PositiveInt | None, default=None,
                   help="images per grid row (default: about sqrt(n))")
    p.add_argument("--allow_other_vqvae", action="store_true",
                   help="decode with a VQ-VAE of the same K and grid that is not the prior's own (a warning only)")
    p.add_argument("--device", type=str, default="cpu", help="torch device, e.g. cpu or cuda")
    return p


def sample_labels(n: int, label: str | None, num_classes: int,
                  classes: tuple[str, ...] = CLASSES) -> torch.Tensor | None:
    """The ``(n,)`` labels to condition on: ``label`` (a name of ``classes`` or an index) for every image, or every
    class in contiguous blocks; ``None`` for an unconditional prior (``num_classes == 0``)."""
    if num_classes == 0:
        if label is not None:
            raise ValueError(f"--label {label!r} given, but this prior is unconditional (trained without "
                             f"--model.class_conditional true)")
        return None
    if label is not None:
        return torch.full((n,), class_index(label, classes[:num_classes]), dtype=torch.long)
    return torch.arange(n) * num_classes // n


def main(argv: Sequence[str] | None = None) -> dict[str, Any]:
    args = parse(build_parser(), argv)
    if args.prior is None:
        raise ValueError("--prior is required: a prior checkpoint of softvq-prior")
    device = torch.device(args.device)
    prior = load_prior(args.prior, map_location=device)
    if args.top_k is not None and args.top_k > prior.num_codes:
        raise ValueError(f"--top_k must be at most K = {prior.num_codes} (the prior's codebook size), got {args.top_k}")
    # the class names the prior's training data had (when it recorded them), else CIFAR-10's
    classes = tuple(prior.vqvae.classes) if prior.vqvae is not None and prior.vqvae.classes else CLASSES
    labels = sample_labels(args.n, args.label, prior.config.num_classes, classes)
    if args.guidance != 1.0 and not prior.config.has_null_class:
        raise ValueError(f"--guidance {args.guidance} needs a class-conditional prior trained with label dropout "
                         f"(softvq-prior --model.class_conditional true); {args.prior} has no null class")
    vqvae_path = args.vqvae if args.vqvae is not None else Path(prior.vqvae.path) if prior.vqvae else None
    if vqvae_path is None:
        raise ValueError("this prior records no VQ-VAE; pass --vqvae")
    vqvae = load_vqvae(vqvae_path, map_location=device)
    check_pairing(prior, vqvae, sha256_file(vqvae_path), vqvae_path, allow_other_vqvae=args.allow_other_vqvae)
    generator = torch.Generator(device=device).manual_seed(args.seed)
    codes = prior.sample(args.n, None if labels is None else labels.to(device), temperature=args.temperature,
                         top_k=args.top_k, generator=generator, guidance=args.guidance)
    images = vqvae.decode_indices(codes).clamp(0.0, 1.0).cpu()  # (n, 3, H, W)
    nrow = args.nrow or math.ceil(math.sqrt(args.n))
    args.out.parent.mkdir(parents=True, exist_ok=True)
    save_image(make_grid(images, nrow=nrow, padding=2, pad_value=1.0), args.out)
    write_atomic(args.out.with_suffix(".json"), json.dumps(resolved(args), indent=2) + "\n")
    used = int(torch.unique(codes).numel())
    print(f"wrote {args.n} samples to {args.out} ({used} distinct codes of {prior.num_codes} in the draws"
          + ("" if labels is None else f"; classes {sorted({classes[i] for i in labels.tolist()})}") + ")")
    return {"codes": codes.cpu(), "labels": labels, "images": images, "out": args.out}


def cli(argv: Sequence[str] | None = None) -> int:
    """:func:`main` as a command: expected failures print one ``error:`` line and return 2."""
    return run_command(main, argv)


if __name__ == "__main__":
    sys.exit(cli())
