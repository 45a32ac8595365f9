"""Training throughput of the project's default VQ-VAE with a DDCL codebook against hard VQ, side by side.

    python -m eval.bench_train                                   # training steps on in-memory batches
    python -m eval.bench_train --data-root ../shared/data/cifar10-jpeg.tar.gz --epochs 3   # + full epochs
    python -m eval.bench_train --compile                         # + the torch.compile'd models (--trainer.compile)

Both models are what ``softvq-train`` builds with its defaults (``--quantizer ddcl`` and ``--quantizer hard
--hard.ema_decay 0.99 --hard.restart.threshold 1 --hard.restart.decay 0.99 --hard.restart.cap null``, the strongest
hard VQ here, configured as the DDCL layer's recipe); ``--flags`` passes further ``softvq-train`` flags to both
(e.g. ``--flags --model.num_codes 1024``).

*Training step*: Lightning fits each model for ``--steps`` steps on the same in-memory random batches (no data
loading), one model after the other, for ``--rounds`` interleaved rounds (so machine noise hits all of them alike);
a callback times every step from ``on_train_batch_start`` to ``on_train_batch_end``: forward, backward, the optimizer
step and the metric updates, everything the trainer does per batch. The first ``--warmup`` steps of every fit are
dropped (and, compiled, the whole first round: it compiles). Reported: the median step and images per second.

*Full epoch* (with ``--data-root``): one training epoch on ``--train-subset`` images of the CIFAR-10 data module and
its validation pass on ``--val-size`` images, the whole ``trainer.fit`` timed, ``--epochs`` interleaved rounds.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
import warnings
from typing import Any

import lightning as L
import torch
from torch.utils.data import DataLoader, TensorDataset

from eval._bench import markdown_table
from eval._hard import HARD_RESTART_FLAGS
from softvq.cli import config
from softvq.cli.common import quiet_lightning
from softvq.models import VQVAE

HARD_FLAGS = ["--hard.ema_decay", "0.99", *HARD_RESTART_FLAGS]


class StepTimer(L.Callback):
    """Wall time of every training step, from the batch's start hook to its end hook."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.times: list[float] = []
        self._start = 0.0

    def _sync(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

    def on_train_batch_start(self, trainer: L.Trainer, pl_module: L.LightningModule, batch: Any,
                             batch_idx: int) -> None:
        self._sync()
        self._start = time.perf_counter()

    def on_train_batch_end(self, trainer: L.Trainer, pl_module: L.LightningModule, outputs: Any, batch: Any,
                           batch_idx: int) -> None:
        self._sync()
        self.times.append(time.perf_counter() - self._start)


def build_models(args: argparse.Namespace) -> tuple[dict[str, VQVAE], int]:
    """The VQ-VAE of every method, as ``softvq-train`` builds it, and the training batch size."""
    models, batch_size = {}, 0
    for method in args.methods:
        quantizer = method.removesuffix("_compiled")
        cfg = config.parse(["--quantizer", quantizer, *HARD_FLAGS, *args.flags])
        L.seed_everything(args.seed, verbose=False)
        model = VQVAE(**config.model_kwargs(cfg, quantizer))
        if method.endswith("_compiled"):
            model.compile_parts()
        models[method] = model
        batch_size = cfg.data.batch_size
    return models, batch_size


def trainer(args: argparse.Namespace, callbacks: list[L.Callback], **kwargs: Any) -> L.Trainer:
    return L.Trainer(accelerator=args.accelerator, devices=1, logger=False, enable_checkpointing=False,
                     enable_progress_bar=False, enable_model_summary=False, num_sanity_val_steps=0,
                     callbacks=callbacks, **kwargs)


def time_steps(args: argparse.Namespace, models: dict[str, VQVAE], batch_size: int) -> dict[str, list[float]]:
    """Per-step seconds of every method over the interleaved rounds (warm-up steps dropped)."""
    g = torch.Generator().manual_seed(args.seed)
    images = torch.rand(batch_size * (args.steps + args.warmup), 3, 32, 32, generator=g)
    loader = DataLoader(TensorDataset(images, torch.zeros(len(images), dtype=torch.long)), batch_size=batch_size)
    times: dict[str, list[float]] = {m: [] for m in models}
    for round_ in range(args.rounds):
        for method, model in models.items():
            timer = StepTimer(torch.device("cuda" if args.accelerator == "gpu" else "cpu"))
            trainer(args, [timer], max_steps=args.steps + args.warmup, limit_val_batches=0).fit(model, loader)
            if not (round_ == 0 and method.endswith("_compiled") and args.rounds > 1):
                times[method] += timer.times[args.warmup:]
            print(f"  round {round_ + 1}: {method} median step {statistics.median(timer.times[args.warmup:]) * 1e3:.1f}"
                  f" ms", file=sys.stderr)
    return times


def time_epochs(args: argparse.Namespace, models: dict[str, VQVAE]) -> dict[str, list[float]]:
    """Seconds of one training epoch plus its validation, per method and round, on the CIFAR-10 data module."""
    from softvq.data import CIFAR10DataModule

    cfg = config.parse(["--data.data_root", str(args.data_root), "--data.train_subset", str(args.train_subset),
                        "--data.val_size", str(args.val_size), *args.flags])
    data = CIFAR10DataModule(**config.data_kwargs(cfg))
    data.prepare_data()
    data.setup("fit")
    seconds: dict[str, list[float]] = {m: [] for m in models}
    for round_ in range(args.epochs):
        for method, model in models.items():
            start = time.perf_counter()
            trainer(args, [], max_epochs=1).fit(model, datamodule=data)
            seconds[method].append(time.perf_counter() - start)
            print(f"  epoch round {round_ + 1}: {method} {seconds[method][-1]:.1f} s", file=sys.stderr)
    return seconds


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--methods", nargs="+", choices=("ddcl", "hard", "ddcl_compiled", "hard_compiled"),
                        default=["ddcl", "hard"], help="models to compare (default: ddcl hard)")
    parser.add_argument("--compile", action="store_true", help="add ddcl_compiled and hard_compiled")
    parser.add_argument("--steps", type=int, default=20, help="timed training steps per fit (default 20)")
    parser.add_argument("--warmup", type=int, default=3, help="untimed steps at the start of every fit (default 3)")
    parser.add_argument("--rounds", type=int, default=3, help="interleaved rounds of training steps (default 3)")
    parser.add_argument("--data-root", help="CIFAR-10 (as softvq-train's --data.data_root): also time full epochs")
    parser.add_argument("--epochs", type=int, default=2, help="interleaved full-epoch rounds (default 2)")
    parser.add_argument("--train-subset", type=int, default=5000, help="training images per epoch (default 5000)")
    parser.add_argument("--val-size", type=int, default=1000, help="validation images per epoch (default 1000)")
    parser.add_argument("--accelerator", default="gpu" if torch.cuda.is_available() else "cpu",
                        help="Lightning accelerator (default: gpu if available, else cpu)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--json", metavar="FILE", help="also write the measurements as JSON to FILE")
    parser.add_argument("--flags", nargs=argparse.REMAINDER, default=[],
                        help="further softvq-train flags for every model (last on the command line)")
    args = parser.parse_args(argv)
    if args.compile:
        args.methods += [m for m in ("ddcl_compiled", "hard_compiled") if m not in args.methods]
    for name in ("steps", "rounds", "epochs", "train_subset", "val_size"):
        if getattr(args, name) < 1:
            parser.error(f"--{name.replace('_', '-')} must be positive, got {getattr(args, name)}")
    if args.warmup < 0:
        parser.error(f"--warmup must be non-negative, got {args.warmup}")
    return args


def format_table(steps: dict[str, list[float]], epochs: dict[str, list[float]] | None, batch_size: int,
                 train_images: int) -> str:
    base = "hard" if "hard" in steps else next(iter(steps))
    step_ms = {m: statistics.median(t) * 1e3 for m, t in steps.items()}
    head = ["model", "step ms (median)", "images/s", f"images/s vs {base}"]
    epoch_s = {}
    if epochs:
        epoch_s = {m: statistics.median(t) for m, t in epochs.items()}
        head += ["epoch + val s (median)", "epoch images/s", f"epoch vs {base}"]
    rows = []
    for m in steps:
        row = [m, f"{step_ms[m]:.1f}", f"{batch_size / step_ms[m] * 1e3:.0f}", f"{step_ms[base] / step_ms[m]:.3f}x"]
        if epochs:
            row += [f"{epoch_s[m]:.1f}", f"{train_images / epoch_s[m]:.0f}", f"{epoch_s[base] / epoch_s[m]:.3f}x"]
        rows.append(row)
    return markdown_table(head, rows)


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    warnings.filterwarnings("ignore", message=".*does not have many workers.*")
    warnings.filterwarnings("ignore", message=".*isinstance\\(treespec, LeafSpec\\)` is deprecated")
    models, batch_size = build_models(args)
    print(f"torch {torch.__version__}, {args.accelerator}, threads {torch.get_num_threads()}, batch {batch_size}, "
          f"{args.rounds} rounds x {args.steps} steps per model")
    with quiet_lightning():
        steps = time_steps(args, models, batch_size)
        epochs = time_epochs(args, models) if args.data_root else None
    print(format_table(steps, epochs, batch_size, args.train_subset))
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"batch_size": batch_size, "step_seconds": steps, "epoch_seconds": epochs,
                       "train_images": args.train_subset, "val_images": args.val_size}, f, indent=2)


if __name__ == "__main__":
    main()
