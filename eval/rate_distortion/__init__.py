"""Rate against distortion: what a prior pays, in bits per image, for each bottleneck's codes at its reconstruction.

A VQ-VAE is half of a generative model; the prior over its codes is the other half. This study trains the project's
VQ-VAE with each bottleneck (the peers' setting: ``eval/peers/``, 5 epochs on 10,000 images) at K = 512 and
K = 4096, then the *same* prior (architecture, epochs, optimizer, seed) on those 10,000 images' codes, and reports on
the official test split the hard-index PSNR and SSIM (distortion) and the prior's NLL in bits per image (rate).

Usage:
    pip install -e ".[bench]"   # vector-quantize-pytorch, a benchmark-only extra
    python -m eval.rate_distortion --data-root ../shared/data/cifar10-jpeg.tar.gz
    python -m eval.rate_distortion --quick --data-root ../shared/data/cifar10-jpeg.tar.gz   # a smoke run
    python -m eval.rate_distortion --only ddcl:512:0 hard_ema:4096:0 ...   # a subset (e.g. one per core)
    python -m eval.rate_distortion --sweep-only ...   # the DDCL target-entropy sweep (validation) alone

Points: every method at K = 512 (``--seeds``, 3 by default) and K = 4096 (``--large-seeds``, 1); FSQ at its nearest
level sets ([8, 8, 8] = 512 and [7, 5, 5, 5, 5] = 4,375 codes). Beside them, a sweep of DDCL's ``target_entropy`` at
K = 512 that reads the **validation** split only (it is a tuning study: which entropy target moves the rate).

Each point lives in ``--runs/<method>/K<K>/seed<S>/``: ``result.json`` (the VQ-VAE record of ``eval.harness.fit_run``
plus the prior's figures and the code-neighbourhood statistics), ``codes.pt`` (the code grids of the train, val and
test images, int16), ``vqvae.pt`` and ``prior.pt`` (the VQ-VAE's and the prior's state dicts, for sampling). A point
whose ``result.json`` has the same settings is read, not retrained; ``--no-train`` only reads. The report is
:mod:`eval.rate_distortion.report`.
"""

from __future__ import annotations

import argparse
import json
import logging
import math
import sys
import time
from pathlib import Path
from typing import Any

import lightning as L
import torch
from torch import Tensor
from torch.utils.data import DataLoader, TensorDataset

import softvq
from eval import harness
from eval._provenance import code_commit
from softvq.cli.common import run_command
from softvq.models.codes import SoftCodes, extract_codes
from softvq.models.files import write_atomic
from softvq.models.prior import CodePrior, evaluate_prior, unigram_bits
from softvq.models.transformer import PriorConfig

log = logging.getLogger("eval.rate_distortion")

METHODS = ("ddcl", "hard_ema", "vqp_vq", "vqp_fsq")
LABELS = {m: harness.LABELS[m] for m in METHODS} | {"vqp_fsq": "vqp FSQ (levels of the FSQ paper)"}
SWEEP_TARGETS = (1.5, 3.5)  # nats, beside the default (2.5 at K = 512 when the committed study ran)
NEIGHBOURS_K = 8  # "similar" neighbour: among the code's 8 nearest codes (itself included)


def points_of(args: argparse.Namespace) -> list[tuple[str, int, int, float | None]]:
    """``(method, K, seed, target_entropy)`` of every point the run covers (``target_entropy`` only for the
    sweep's DDCL points; ``None`` = the method's defaults)."""
    main = [(m, k, s, None) for k, seeds in ((args.num_codes[0], args.seeds), (args.num_codes[1], args.large_seeds))
            for s in seeds for m in args.methods]
    sweep = [("ddcl", args.num_codes[0], args.seeds[0], t) for t in args.sweep]
    if args.only:  # in the order given: a worker runs the points that matter most first
        every = {point_key(*point): point for point in main + sweep}
        unknown = [key for key in args.only if key not in every]
        if unknown:
            raise ValueError(f"--only names points this study does not have: {unknown}; it has {sorted(every)}")
        return [every[key] for key in args.only]
    return sweep if args.sweep_only else main + sweep


def point_key(method: str, k: int, seed: int, target: float | None) -> str:
    """``METHOD:K:SEED`` (``:TARGET`` for a sweep point), as ``--only`` names points."""
    return f"{method}:{k}:{seed}" + ("" if target is None else f":{target:g}")


def point_dir(runs: Path, method: str, k: int, seed: int, target: float | None) -> Path:
    name = method if target is None else f"{method}_target{target:g}"
    return runs / name / f"K{k}" / f"seed{seed}"


def vqvae_args(args: argparse.Namespace, k: int) -> argparse.Namespace:
    """The ``eval.peers`` settings of one point: the peers' VQ-VAE with ``K = k``."""
    return argparse.Namespace(**{**vars(args), "num_codes": k})


def settings_of(args: argparse.Namespace, k: int) -> dict[str, Any]:
    """What a point's result depends on besides method, seed and target: a stored point with others is retrained."""
    return {**harness.settings_of(vqvae_args(args, k)), "prior": prior_settings(args)}


def prior_settings(args: argparse.Namespace) -> dict[str, Any]:
    return {"layers": args.prior_layers, "dim": args.prior_dim, "heads": 4, "epochs": args.prior_epochs,
            "batch_size": 128, "lr": 1e-3, "weight_decay": 0.01, "warmup_steps": 100, "dropout": 0.1,
            "seed": args.prior_seed}


def add_prior_arguments(p: argparse.ArgumentParser | argparse._ArgumentGroup) -> None:
    """The prior's flags of :func:`prior_settings`, on a parser or one of its argument groups (every study that trains
    this prior shares them)."""
    p.add_argument("--prior-layers", type=int, default=4, help="the prior's transformer layers")
    p.add_argument("--prior-dim", type=int, default=128, help="its width (4 heads)")
    p.add_argument("--prior-epochs", type=int, default=5, help="its epochs over the training images' codes")
    p.add_argument("--prior-seed", type=int, default=0, help="the one seed of every prior")


def build_quantizer(method: str, k: int, dim: int, target: float | None) -> torch.nn.Module:
    if target is not None:
        return softvq.DDCLQuantizer(k, dim, target_entropy=target)
    return harness.build(method, k, dim)


def fit_prior(codes: dict[str, Tensor], num_codes: int, grid: tuple[int, int], settings: dict[str, Any],
              threads: int | None = None, soft: SoftCodes | None = None,
              soft_targets: float = 0.0) -> tuple[CodePrior, float]:
    """The study's prior, the same for every bottleneck: trained on the training codes with a fixed seed and the
    settings ``settings`` (:func:`prior_settings`); returns it in eval mode and its training seconds.

    With ``soft`` (the training codes' :class:`~softvq.models.codes.SoftCodes`) and ``soft_targets = a > 0`` the loss
    mixes in the cross-entropy to the tokens' soft assignments (``CodePrior(soft_targets=a)``); the network, seed,
    batches and steps are the one-hot prior's."""
    config = PriorConfig(num_codes=num_codes, height=grid[0], width=grid[1], layers=settings["layers"],
                         heads=settings["heads"], dim=settings["dim"], dropout=settings["dropout"])
    L.seed_everything(settings["seed"], workers=True, verbose=False)
    prior = CodePrior(config, lr=settings["lr"], weight_decay=settings["weight_decay"],
                      warmup_steps=settings["warmup_steps"], soft_targets=soft_targets)
    train = codes["train"].long()
    extra = () if soft is None else (soft.probs, soft.codes)  # batches (codes, labels, probs, prob_codes)
    loader = DataLoader(TensorDataset(train, torch.zeros(len(train), dtype=torch.long), *extra),
                        batch_size=settings["batch_size"], shuffle=True,
                        generator=torch.Generator().manual_seed(settings["seed"]))
    trainer = L.Trainer(max_epochs=settings["epochs"], accelerator="cpu", logger=False, enable_checkpointing=False,
                        enable_progress_bar=False, enable_model_summary=False, num_sanity_val_steps=0,
                        limit_val_batches=0)
    begin = time.perf_counter()
    with harness.study_run():
        trainer.fit(prior, loader)
    return prior.eval(), time.perf_counter() - begin


def prior_figures(prior: CodePrior, codes: Tensor, num_codes: int) -> dict[str, Any]:
    """Bits per image (the sum of the per-position NLLs), per position, border against interior, beside the
    codes' unigram entropy (what a prior without context pays)."""
    evaluation = evaluate_prior(prior, codes.long())
    grid = evaluation.position_bits.double()
    border = torch.ones_like(grid, dtype=torch.bool)
    border[1:-1, 1:-1] = False
    return {"bits_per_image": float(grid.sum()), "bits_per_position": evaluation.bits_per_position,
            "border_bits_per_position": float(grid[border].mean()),
            "interior_bits_per_position": float(grid[~border].mean()),
            "position_bits": [[round(float(v), 4) for v in row] for row in grid],
            "unigram_bits_per_position": unigram_bits(codes, num_codes), "sequences": evaluation.sequences}


def neighbour_similarity(codes: Tensor, codebook: Tensor, k: int = NEIGHBOURS_K) -> dict[str, float]:
    """How alike neighbouring positions' codes are: the share of right and down neighbours that carry the same code,
    and that carry one of the code's ``k`` nearest codes (itself included) in the decoder's space."""
    codes = codes.long()
    k = min(k, codebook.shape[0])
    nearest = torch.cdist(codebook.double(), codebook.double()).topk(k, largest=False).indices  # (K, k)
    pairs = torch.cat([torch.stack([codes[:, :, :-1], codes[:, :, 1:]], -1).reshape(-1, 2),
                       torch.stack([codes[:, :-1], codes[:, 1:]], -1).reshape(-1, 2)])
    within = (nearest[pairs[:, 0]] == pairs[:, 1:]).any(-1)
    return {"same_code": float((pairs[:, 0] == pairs[:, 1]).double().mean()),
            f"within_{k}_nearest": float(within.double().mean()), "k": k}


def run_point(method: str, k: int, seed: int, target: float | None, args: argparse.Namespace) -> dict[str, Any]:
    """Train (or read) one point: the VQ-VAE, its codes, the prior; ``result.json`` in the point's directory."""
    out = point_dir(args.runs, method, k, seed, target)
    path = out / "result.json"
    settings = settings_of(args, k)
    if path.is_file():
        try:
            stored = json.loads(path.read_text())
        except json.JSONDecodeError:
            stored = {}
        if stored.get("settings") == settings:
            return stored
        if args.no_train:
            raise ValueError(f"{path} was made with other settings; rerun without --no-train to retrain it")
    elif args.no_train:
        return {"method": method, "num_codes": k, "seed": seed, "target_entropy": target, "missing": True}
    print(f"[rate_distortion] {method} K={k} seed {seed}" + (f" target {target}" if target else "") + f" -> {out}",
          flush=True)
    vargs = vqvae_args(args, k)
    model, data, result = harness.fit_run(method, seed, vargs, out,
                                        quantizer=lambda: build_quantizer(method, k, args.code_dim, target))
    model.eval()
    splits = {"train": data.train_set, "val": data.val_set, "test": data.test_set}
    if args.test_limit:
        splits["test"] = torch.utils.data.Subset(data.test_set, range(min(args.test_limit, len(data.test_set))))
    codes = {name: extract_codes(model, ds, batch_size=256).codes for name, ds in splits.items()}
    num_codes = model.num_codes  # FSQ: the product of its levels
    grid = tuple(codes["train"].shape[1:])
    prior, prior_seconds = fit_prior(codes, num_codes, grid, settings["prior"])
    codebook = model.quantizer.decode_indices(torch.arange(num_codes)[None]).reshape(num_codes, -1)
    held = getattr(model.quantizer, "target_entropy", None)  # the entropy DDCL's control held (the default's too)
    result.update({"settings": settings, "commit": args.commit, "num_codes": num_codes, "target_entropy": target,
                   "held_entropy": held,
                   "prior_seconds": prior_seconds,
                   "prior": {split: prior_figures(prior, codes[split], num_codes) for split in ("val", "test")},
                   "neighbours": {split: neighbour_similarity(codes[split], codebook) for split in ("val", "test")}})
    torch.save({name: c.to(torch.int16) for name, c in codes.items()}, out / "codes.pt")
    torch.save(model.state_dict(), out / "vqvae.pt")
    torch.save({"config": prior.config.to_dict(), "state_dict": prior.state_dict()}, out / "prior.pt")
    write_atomic(path, json.dumps(result, indent=1))
    test = result["prior"]["test"]
    print(f"[rate_distortion] {method} K={k} seed {seed}: test PSNR {result['test']['psnr_hard']:.2f} dB, "
          f"{test['bits_per_image']:.1f} bits/image ({test['bits_per_position']:.3f}/position), prior "
          f"{prior_seconds:.0f} s", flush=True)
    return result


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m eval.rate_distortion", description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--data-root", type=Path, default=Path("data"), help="CIFAR-10 directory or .tar.gz archive")
    p.add_argument("--methods", nargs="+", choices=METHODS, default=list(METHODS))
    p.add_argument("--num-codes", type=int, nargs=2, default=[512, 4096], metavar=("SMALL", "LARGE"),
                   help="the two codebook sizes (FSQ: the nearest level set of each)")
    p.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2], help="VQ-VAE seeds at the small K")
    p.add_argument("--large-seeds", type=int, nargs="+", default=[0], help="VQ-VAE seeds at the large K")
    p.add_argument("--sweep", type=float, nargs="*", default=list(SWEEP_TARGETS),
                   help="DDCL target_entropy values (nats) swept at the small K, first seed (validation only)")
    p.add_argument("--sweep-only", action="store_true", help="only the target-entropy sweep")
    p.add_argument("--only", nargs="+", default=None, metavar="METHOD:K:SEED[:TARGET]",
                   help="train only these points (the report still reads every finished one)")
    harness.add_vqvae_arguments(p)
    add_prior_arguments(p)
    p.add_argument("--runs", type=Path, default=Path("runs/rate_distortion"))
    p.add_argument("--out", type=Path, default=Path("reports/rate_distortion"))
    p.add_argument("--no-train", action="store_true", help="only read finished points")
    p.add_argument("--no-progress-bar", action="store_true")
    p.add_argument("--quick", action="store_true",
                   help="smoke run: 1 epoch on 512 images, K = 64 / 256, D = 16, width 32, a 1-epoch prior")
    args = p.parse_args(argv)
    if args.quick:
        args.epochs, args.train_subset, args.val_size, args.code_dim = 1, 512, 256, 16
        args.width, args.res_blocks, args.res_hidden, args.test_limit = 32, 1, 8, 512
        args.num_codes, args.prior_layers, args.prior_dim, args.prior_epochs = [64, 256], 1, 32, 1
        args.seeds, args.sweep = args.seeds[:2], args.sweep[:1]
    for name in ("epochs", "train_subset", "batch_size", "code_dim", "width", "prior_layers", "prior_dim",
                 "prior_epochs"):
        if getattr(args, name) < 1:
            p.error(f"--{name.replace('_', '-')} must be positive, got {getattr(args, name)}")
    if args.prior_dim % 4:
        p.error(f"--prior-dim must be a multiple of the prior's 4 heads, got {args.prior_dim}")
    if args.num_codes[0] >= args.num_codes[1] or args.num_codes[0] < 2:
        p.error(f"--num-codes needs SMALL < LARGE, both >= 2, got {args.num_codes}")
    for seeds, flag in ((args.seeds, "--seeds"), (args.large_seeds, "--large-seeds")):
        if len(set(seeds)) != len(seeds):
            p.error(f"{flag} repeats a seed: {seeds}")
    for target in args.sweep:
        if not 0 < target < math.log(args.num_codes[0]):
            p.error(f"--sweep target {target} must lie in (0, log K = {math.log(args.num_codes[0]):.3f}) nats")
    if "vqp_fsq" in args.methods:
        for k in args.num_codes:
            try:
                harness.fsq_levels(k)
            except ValueError as err:
                p.error(str(err))
    args.commit = code_commit()  # at the start: the code this process imported, whatever changes while it trains
    args.command = "python -m eval.rate_distortion " + " ".join(argv if argv is not None else sys.argv[1:])
    return args


def main(argv: list[str] | None = None) -> dict[str, Any]:
    args = parse_args(argv)
    with harness.study_run(args.threads):
        trained = [run_point(*point, args) for point in points_of(args)]
    if args.only and not args.no_train:
        return {"trained": len(trained)}  # one worker of several: the report is written by a --no-train pass
    from eval.rate_distortion.report import write_report  # here: a worker pass (--only) needs no report or matplotlib

    every = argparse.Namespace(**{**vars(args), "only": None, "sweep_only": False, "no_train": True})
    results = [run_point(*point, every) for point in points_of(every)]
    settings = {"command": args.command, "num_codes": args.num_codes, "seeds": args.seeds,
                "large_seeds": args.large_seeds, "prior": prior_settings(args), "labels": LABELS,
                "vqvae": {k: v for k, v in harness.settings_of(vqvae_args(args, args.num_codes[0])).items()
                          if k != "num_codes"}}
    return write_report([r for r in results if not r.get("missing")], settings, args.out,
                        missing=[r for r in results if r.get("missing")])


def cli(argv: list[str] | None = None) -> int:
    return run_command(main, argv)
