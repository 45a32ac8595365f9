"""Robust by default: every quantizer, with its library's defaults and with its documented recipe, over a grid of
settings a user meets, in the foreign autoencoder of :mod:`eval.dropin`; ``reports/robustness/``.

Usage:
    pip install -e ".[bench]"          # vector-quantize-pytorch, a benchmark-only extra
    python -m eval.robustness --data-root ../shared/data/cifar10-jpeg.tar.gz --jobs 2
    python -m eval.robustness --quick --data-root ../shared/data/cifar10-jpeg.tar.gz    # a smoke run, a minute

The design is one-at-a-time: a base setting (K = 512, D = 32, Adam 3e-4, 128 images a batch, the encoder's output
as built, float32, CIFAR-10), every setting of :data:`SETTINGS` changes one axis of it, and two corners change two
that users hit together (small batches with a large codebook; SGD with wide codes). The full product of the axes
is not run. Every setting trains every configuration of :data:`CONFIGS` for the same number of optimizer steps on
the 45,000 training images (the project's 5,000 validation images are held out and unused: nothing here is tuned,
every configuration is fixed in advance by its own documentation) and scores it once on the official test split:
PSNR of the images decoded from the hard indices alone, utilization and perplexity / K of those indices.

The only line that differs between configurations is the quantizer's constructor, printed in the report exactly as
:func:`build` evaluates it. The loss is ``L1(reconstruction, x) + 10 * quantizer loss``, as in :mod:`eval.dropin`.

Every run is one JSON file under ``--runs``; a run whose file has the same settings is read, not retrained, so an
interrupted grid resumes where it stopped. ``--jobs 2`` trains two runs at a time, one thread each.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
import time
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path
from typing import Any

import lightning as L
import torch
from torch import Tensor, nn
from torch.utils.data import DataLoader
from torchmetrics.image import PeakSignalNoiseRatio

import softvq
from eval._hard import HARD_RESTART
from eval._provenance import code_commit
from eval.dropin import SmallAutoencoder
from eval.robustness.grid import (
    ALPHA,
    BASE,
    CONFIGS,
    OPTIMIZERS,
    SETTINGS,
    VAL_SIZE,
    Setting,
    build,
    constructor,
    make_optimizer,
)
from eval.robustness.report import regrets, worst_case, write_report
from softvq.cli.common import run_command
from softvq.data.cifar10 import CIFAR10DataModule
from softvq.models.files import write_atomic

# The grid (eval/robustness/grid.py) and the report (eval/robustness/report.py) are importable from here.
__all__ = ["BASE", "CONFIGS", "OPTIMIZERS", "SETTINGS", "Setting", "build", "constructor", "gain_at", "gradient_gain",
           "load_images", "main", "regrets", "to_input", "train_and_score", "worst_case", "write_report"]

# ----------------------------------------------------------------------------------------------------------- data
def load_images(data_root: Path, cache: Path | None, val_size: int = VAL_SIZE) -> dict[str, Tensor]:
    """``{"train": (45000, 3, 32, 32) uint8, "test": (10000, 3, 32, 32) uint8}``: the training images less the
    ``val_size`` validation ones, and the test split, decoded once and kept as one tensor file (loaded with
    ``weights_only``), because every run of the grid reads the same images and decoding JPEGs would cost more than
    training the small model."""
    key = f"{data_root.resolve()} val_size={val_size}"
    if cache is not None and cache.is_file():
        stored = torch.load(cache, weights_only=True)
        if stored.get("source") == key:
            return {"train": stored["train"], "test": stored["test"]}
    data = CIFAR10DataModule(data_root, batch_size=1000, val_size=val_size, num_workers=0)
    data.setup("fit")
    data.setup("test")

    def as_uint8(dataset) -> Tensor:
        loader = DataLoader(dataset, batch_size=1000, shuffle=False)
        return torch.cat([(x * 255).round().to(torch.uint8) for x, _ in loader])

    images = {"train": as_uint8(data.train_set), "test": as_uint8(data.test_set)}
    if cache is not None:
        cache.parent.mkdir(parents=True, exist_ok=True)
        tmp = cache.with_suffix(".tmp")
        torch.save({**images, "source": key}, tmp)
        tmp.replace(cache)
    return images


def to_input(batch: Tensor, dataset: str) -> Tensor:
    """uint8 images -> float ``[0, 1]``; ``cifar10-gray`` takes the ITU-R 601 luminance on all three channels."""
    x = batch.float() / 255.0
    if dataset == "cifar10-gray":
        weights = torch.tensor([0.299, 0.587, 0.114]).view(1, 3, 1, 1)
        x = (x * weights).sum(1, keepdim=True).expand(-1, 3, -1, -1).contiguous()
    return x


# ------------------------------------------------------------------------------------------------------------ runs
def train_and_score(config: str, setting: Setting, seed: int, steps: int, images: dict[str, Tensor],
                    test_limit: int = 0) -> dict[str, Any]:
    """Train one configuration in one setting and score it on the test split. A run that raises or whose loss
    stops being finite is returned with ``"failed"`` (the reason) and no test figures."""
    L.seed_everything(seed, verbose=False)
    quantizer = build(config, setting.num_codes, setting.dim)
    model = SmallAutoencoder(CONFIGS[config][2], setting.num_codes, dim=setting.dim, quantizer=quantizer[:2],
                             encoder_scale=setting.encoder_scale)
    run: dict[str, Any] = {"config": config, "seed": seed, "constructor": quantizer[2],
                           "optimizer": OPTIMIZERS[setting.optimizer]}
    optimizer = make_optimizer(setting.optimizer, model)
    train = images["train"]
    order = torch.Generator().manual_seed(seed)
    autocast = torch.autocast("cpu", dtype=torch.bfloat16, enabled=setting.bf16)
    start, step = time.perf_counter(), 0
    model.train()
    try:
        while step < steps:
            permutation = torch.randperm(len(train), generator=order)
            for first in range(0, len(train) - setting.batch_size + 1, setting.batch_size):
                x = to_input(train[permutation[first:first + setting.batch_size]], setting.dataset)
                with autocast:
                    reconstruction, _, loss = model(x)
                    total = (reconstruction.float() - x).abs().mean() + ALPHA * loss.float()
                if not torch.isfinite(total):
                    raise FloatingPointError(f"the loss is {float(total)} at step {step}")
                optimizer.zero_grad(set_to_none=True)
                total.backward()
                optimizer.step()
                step += 1
                if step >= steps:
                    break
    except Exception as err:  # a run that fails is a result of the grid, not the end of it
        return {**run, "failed": f"{type(err).__name__}: {err}".splitlines()[0][:300], "train_s": time.perf_counter()
                - start, "steps_done": step}
    run["train_s"] = time.perf_counter() - start
    run["test"] = score(model, images["test"], setting, test_limit)
    return run


@torch.no_grad()
def score(model: SmallAutoencoder, test: Tensor, setting: Setting, test_limit: int = 0) -> dict[str, float]:
    """Hard-index PSNR (per image, averaged), utilization and perplexity / K of the test split, under the setting's
    autocast as a user of that setting would infer."""
    model.eval()
    psnr = PeakSignalNoiseRatio(data_range=1.0, dim=(1, 2, 3))
    counts = torch.zeros(model.num_codes, dtype=torch.long)
    test = test[:test_limit] if test_limit else test
    for first in range(0, len(test), 500):
        x = to_input(test[first:first + 500], setting.dataset)
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=setting.bf16):
            _, indices, _ = model(x)
            decoded = model.decode_indices(indices)
        psnr.update(decoded.float().clamp(0.0, 1.0), x)
        counts += torch.bincount(indices.reshape(-1).long(), minlength=model.num_codes)
    usage = softvq.functional.usage_from_counts(counts)
    return {"psnr_hard": float(psnr.compute()), "utilization": float(usage["utilization"]),
            "perplexity_per_code": float(usage["perplexity"]) / model.num_codes, "num_codes": model.num_codes,
            "images": len(test)}


def _run_settings(setting: Setting, steps: int, test_limit: int) -> dict[str, Any]:
    return {**dataclasses.asdict(setting), "steps": steps, "test_limit": test_limit, "alpha": ALPHA}


_IMAGES: dict[str, Tensor] = {}


def _worker_init(data_root: str, cache: str | None, threads: int, val_size: int = VAL_SIZE) -> None:
    torch.set_num_threads(threads)
    _IMAGES.update(load_images(Path(data_root), Path(cache) if cache else None, val_size))


def _task(job: tuple[str, str, int, int, int, str]) -> dict[str, Any]:
    setting_id, config, seed, steps, test_limit, path = job
    run = train_and_score(config, SETTINGS[setting_id][1], seed, steps, _IMAGES, test_limit)
    run.update(setting=setting_id, settings=_run_settings(SETTINGS[setting_id][1], steps, test_limit),
               commit=code_commit())
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    write_atomic(Path(path), json.dumps(run, indent=1))
    return run


def _cost(setting: Setting) -> float:
    """A rough order for the queue (largest first, so that two workers finish together)."""
    return setting.batch_size * (setting.num_codes + 64) * (setting.dim + 16)


# ------------------------------------------------------------------------------------------------- gradient gain
def gradient_gain(quantizer: nn.Module, dim: int, seed: int = 0, tokens: int = 8192, clusters: int = 64,
                  warmup: int = 20) -> dict[str, float]:
    """How much of the decoder's gradient reaches the encoder through ``quantizer`` (channel-last), on clustered
    tokens (``clusters`` unit-normal centres plus noise of std 0.5) after ``warmup`` training steps: the gain
    ``||dL/dz|| / ||dL/dq||`` and the cosine between the two, for a random upstream gradient ``dL/dq``. A
    straight-through quantizer passes the gradient unchanged (gain 1, cosine 1); DDCL passes ``J^T g`` with the soft
    centroid's Jacobian ``J = (2/T) Cov_q(P)``, whose size depends on T and D. Under SGD the gain is a factor on the
    encoder's learning rate; Adam divides most of it out."""
    generator = torch.Generator().manual_seed(seed)
    centres = torch.randn(clusters, dim, generator=generator)

    def batch() -> Tensor:
        pick = torch.randint(clusters, (tokens,), generator=generator)
        return centres[pick] + 0.5 * torch.randn(tokens, dim, generator=generator)

    quantizer.train()
    with torch.no_grad():
        for _ in range(warmup):
            quantizer(batch())
    z = batch()
    return gain_at(quantizer, z, torch.randn(z.shape, generator=generator))


def gain_at(quantizer: nn.Module, z: Tensor, upstream: Tensor) -> dict[str, float]:
    """``||J^T g|| / ||g||`` and ``cos(J^T g, g)`` for the upstream gradient ``g`` at tokens ``z`` (channel-last)."""
    z = z.detach().requires_grad_(True)
    (dz,) = torch.autograd.grad(quantizer(z).quantized, z, upstream)
    return {"gain": float(dz.norm() / upstream.norm()),
            "cosine": float(torch.nn.functional.cosine_similarity(dz.flatten(), upstream.flatten(), dim=0))}


def gradient_gain_table(dims: tuple[int, ...] = (8, 32, 128), num_codes: int = 512) -> list[str]:
    """The Markdown table of :func:`gradient_gain` for DDCL's defaults and HardVQ with EMA + restart at each D."""
    lines = ["| D | DDCL gain | DDCL cosine | DDCL T | HardVQ EMA + restart gain | cosine |",
             "|---|---|---|---|---|---|"]
    for dim in dims:
        torch.manual_seed(0)
        ddcl = softvq.DDCLQuantizer(num_codes, dim)
        d = gradient_gain(ddcl, dim)
        h = gradient_gain(softvq.HardVQ(num_codes, dim, ema_decay=0.99, restart=HARD_RESTART), dim)
        lines.append(f"| {dim} | {d['gain']:.3f} | {d['cosine']:.3f} | {float(ddcl.temperature):.3g} | "
                     f"{h['gain']:.3f} | {h['cosine']:.3f} |")
    return lines


# ------------------------------------------------------------------------------------------------------------- cli
def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m eval.robustness", description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--data-root", type=Path, default=Path("data"), help="CIFAR-10 directory or .tar.gz archive")
    p.add_argument("--settings", nargs="+", choices=list(SETTINGS), default=list(SETTINGS))
    p.add_argument("--configs", nargs="+", choices=list(CONFIGS), default=list(CONFIGS))
    p.add_argument("--seeds", type=int, nargs="+", default=[0, 1])
    p.add_argument("--steps", type=int, default=200, help="optimizer steps per run")
    p.add_argument("--val-size", type=int, default=VAL_SIZE,
                   help="training images held out (unused: nothing is tuned here), as the project's trainer does")
    p.add_argument("--test-limit", type=int, default=0, help="score on this many test images (0: all)")
    p.add_argument("--jobs", type=int, default=1, help="runs trained at a time, in worker processes")
    p.add_argument("--threads", type=int, default=1, help="torch threads per job")
    p.add_argument("--out", type=Path, default=Path("reports/robustness"))
    p.add_argument("--runs", type=Path, default=Path("runs/robustness"),
                   help="one result file per run (and the decoded images, images.pt)")
    p.add_argument("--no-train", action="store_true", help="write the report from the stored runs only")
    p.add_argument("--gradient-gain", action="store_true",
                   help="print how much of the decoder's gradient reaches the encoder through DDCL and HardVQ at "
                        "D = 8, 32, 128 (seconds), and write it to --out/gradient_gain.md; trains nothing else")
    p.add_argument("--quick", action="store_true", help="a smoke run: 5 steps, settings base and k64, 512 test images")
    args = p.parse_args(argv)
    if args.quick:
        args.steps, args.test_limit, args.seeds = 5, 512, args.seeds[:1]
        args.settings = [s for s in args.settings if s in ("base", "k64")] or ["base"]
    if args.steps < 1 or args.jobs < 1 or args.threads < 1 or args.test_limit < 0 or args.val_size < 0:
        p.error("--steps, --jobs and --threads must be positive and --test-limit and --val-size not negative")
    # The command that makes this report: without --no-train (with the runs stored, it reads them just the same).
    args.command = "python -m eval.robustness " + " ".join(a for a in (argv if argv is not None else sys.argv[1:])
                                                         if a != "--no-train")
    return args


def main(argv: list[str] | None = None) -> dict[str, Any]:
    args = parse_args(argv)
    if args.gradient_gain:
        table = gradient_gain_table()
        print("\n".join(table))
        args.out.mkdir(parents=True, exist_ok=True)
        write_atomic(args.out / "gradient_gain.md", "\n".join([
            "# How much of the decoder's gradient reaches the encoder", "", f"Regenerate: `{args.command}`", "",
            f"Code: {code_commit()}. See `eval.robustness.gradient_gain`: clustered synthetic tokens, K = 512, 20 "
            "training steps, then ||dL/dz|| / ||dL/dq|| and their cosine for a random upstream gradient.", "",
            *table, ""]))
        return {"gradient_gain": table}
    runs, jobs = [], []
    for setting_id in sorted(args.settings, key=lambda s: -_cost(SETTINGS[s][1])):
        wanted = _run_settings(SETTINGS[setting_id][1], args.steps, args.test_limit)
        for seed in args.seeds:
            for config in args.configs:
                path = args.runs / setting_id / config / f"seed{seed}.json"
                stored = json.loads(path.read_text()) if path.is_file() else {}
                if stored.get("settings") == wanted:
                    runs.append(stored)
                elif args.no_train:
                    raise SystemExit(f"no stored run with these settings at {path}; run without --no-train")
                else:
                    jobs.append((setting_id, config, seed, args.steps, args.test_limit, str(path)))
    start = time.perf_counter()
    cache = str(args.runs / "images.pt")
    if jobs and args.jobs == 1:
        _worker_init(str(args.data_root), cache, args.threads, args.val_size)
        done = map(_task, jobs)
    elif jobs:
        load_images(args.data_root, Path(cache), args.val_size)  # decoded once here; workers load the tensors
        pool = ProcessPoolExecutor(args.jobs, initializer=_worker_init,
                                   initargs=(str(args.data_root), cache, args.threads, args.val_size),
                                   mp_context=torch.multiprocessing.get_context("spawn"))
        done = pool.map(_task, jobs)
    else:
        done = iter(())
    for run in done:
        t = run.get("test")
        print(f"[robustness] {run['setting']} {run['config']} seed {run['seed']}: "
              + (f"PSNR {t['psnr_hard']:.2f} dB, {100 * t['utilization']:.1f}% used" if t else
                 f"FAILED ({run['failed']})") + f" ({run['train_s']:.0f} s)", flush=True)
        runs.append(run)
    wall = time.perf_counter() - start if jobs else None
    previous = args.out / "results.json"
    if wall is None and previous.is_file():  # a report rewritten from stored runs keeps the grid's wall time
        stored = json.loads(previous.read_text())
        if stored.get("steps") == args.steps and stored.get("seeds") == args.seeds:
            wall = stored.get("wall_s")
    return write_report(runs, args, wall)


def cli(argv: list[str] | None = None) -> int:
    return run_command(main, argv)
