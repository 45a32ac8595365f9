"""DDCL's top-k truncations (``ddcl_top128``, ``ddcl_top256``) against the exact layer (``ddcl``)
at K = 16384, in the peers' short setting (``eval/peers``: width 128, 2 residual blocks, D = 64, Adam 3e-4, batch 128,
10,000 training images, 5 epochs), judged on the **validation** split only.

    python -m eval.topk_default.train --data-root ../shared/data/cifar10-jpeg.tar.gz --threads 1 \
        --num-codes 16384 --seeds 0 --methods ddcl_top256 ddcl ddcl_top128 --runs ../runs/topk_default

It trains exactly as :func:`eval.peers.fit_run` does (same seeding order, same bottleneck builder, same callbacks and
throughput record, same ``settings_of``) with two differences, both needed by this question:

- no ``trainer.test``: the official test split is never read (this is a choice of default, tuned on validation);
- the trained VQ-VAE's state dict is kept (``vqvae.pt``), so that ``eval/topk_default/evaluate.py`` can measure
  the Boltzmann mass a truncation leaves out at the trained temperature (``eval/topk_bound.py``'s functions).

It also writes ``steps.jsonl`` (every 10 training steps: wall clock, CPU seconds, loss, temperature, finiteness),
to see a temperature control that runs away inside an epoch, and records per epoch ``train_cpu_s``, the training
loop's CPU seconds (this machine is shared and its processes paused at times: wall-clock images/s count the
pauses). Runs: ``--runs/K<K>/<method>/seed<S>/`` (history.jsonl, steps.jsonl, result.json, vqvae.pt); a run whose
``result.json`` has the same settings is skipped.
"""

from __future__ import annotations

import argparse
import json
import math
import subprocess
import time
from pathlib import Path
from typing import Any

import lightning as L
import torch

ROOT = Path(__file__).resolve().parents[2]

from eval import peers  # noqa: E402
from softvq.data.cifar10 import CIFAR10DataModule  # noqa: E402
from softvq.models import VQVAE  # noqa: E402
from softvq.models.callbacks import HistoryWriter  # noqa: E402
from softvq.models.files import write_atomic  # noqa: E402


class StepLog(L.Callback):
    """Every ``every`` training steps: the loss, the layer's temperature and whether both are finite."""

    def __init__(self, path: Path, every: int = 10) -> None:
        self.path, self.every = path, every
        path.write_text("")

    def on_train_batch_end(self, trainer: L.Trainer, pl_module: L.LightningModule, outputs: Any, batch: Any,
                           batch_idx: int) -> None:
        step = trainer.global_step
        if step % self.every:
            return
        loss = outputs["loss"] if isinstance(outputs, dict) else outputs
        loss = float(loss.detach()) if isinstance(loss, torch.Tensor) else float("nan")
        t = getattr(pl_module.quantizer, "temperature", None)
        row = {"step": step, "epoch": trainer.current_epoch + 1, "wall": time.time(), "cpu_s": time.process_time(),
               "loss": loss,
               "temperature": None if t is None else float(t), "finite": math.isfinite(loss)}
        with self.path.open("a") as f:
            f.write(json.dumps(row) + "\n")


class CpuClock(L.Callback):
    """CPU seconds of this process in each epoch's training loop (the span :class:`eval.peers.Throughput` times,
    validation excluded): unlike wall time, a process paused (SIGSTOP) or sharing its core does not count them."""

    def __init__(self) -> None:
        self.per_epoch: list[float] = []
        self._start, self._open = 0.0, False

    def on_train_epoch_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self._start, self._open = time.process_time(), True

    def _close(self) -> None:
        if self._open:
            self.per_epoch.append(time.process_time() - self._start)
            self._open = False

    def on_validation_epoch_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        if not trainer.sanity_checking:
            self._close()

    def on_train_epoch_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self._close()


def commit() -> dict[str, Any]:
    head = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True, text=True).stdout
    dirty = subprocess.run(["git", "status", "--porcelain"], cwd=ROOT, capture_output=True, text=True).stdout
    return {"commit": head.strip(), "dirty": bool(dirty.strip()), "dirty_files": dirty.strip().splitlines()}


def fit_without_test(method: str, seed: int, args: argparse.Namespace, out: Path) -> dict[str, Any]:
    """:func:`eval.peers.fit_run` without its test-split scoring, keeping the trained state dict."""
    out.mkdir(parents=True, exist_ok=True)
    (out / "history.jsonl").unlink(missing_ok=True)
    L.seed_everything(seed, workers=True, verbose=False)
    data = CIFAR10DataModule(args.data_root, batch_size=args.batch_size, val_size=args.val_size,
                             train_subset=args.train_subset, num_workers=args.num_workers, seed=seed)
    quantizer = peers.build(method, args.num_codes, args.code_dim)
    L.seed_everything(seed, workers=True, verbose=False)
    model = VQVAE(quantizer=quantizer, code_dim=args.code_dim, width=args.width, res_blocks=args.res_blocks,
                  res_hidden=args.res_hidden, lr=args.lr)
    L.seed_everything(seed, workers=True, verbose=False)
    speed, clock = peers.Throughput(), CpuClock()
    trainer = L.Trainer(max_epochs=args.epochs, accelerator="cpu", logger=False, enable_checkpointing=False,
                        enable_progress_bar=not args.no_progress_bar, enable_model_summary=False,
                        num_sanity_val_steps=0,
                        callbacks=[HistoryWriter(out / "history.jsonl", echo=True), speed,
                                   clock, StepLog(out / "steps.jsonl")])
    start = time.perf_counter()
    trainer.fit(model, datamodule=data)
    wall = time.perf_counter() - start
    history = [json.loads(line) for line in (out / "history.jsonl").read_text().splitlines() if line.strip()]
    for row, speed_row in zip(history, speed.per_epoch, strict=False):
        row["train_images_per_s"] = speed_row
    for row, cpu in zip(history, clock.per_epoch, strict=False):
        row["train_cpu_s"] = cpu  # the training loop's CPU seconds in this process (data-loader worker excluded)
    torch.save(model.state_dict(), out / "vqvae.pt")
    return {"method": method, "seed": seed, "settings": peers.settings_of(args), "history": history,
            "top_k": getattr(quantizer, "top_k", None), "target_entropy": getattr(quantizer, "target_entropy", None),
            "wall_s": wall, "code": args.code, "test": None}


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--data-root", type=Path, required=True)
    p.add_argument("--methods", nargs="+", choices=peers.METHODS, default=["ddcl_top256", "ddcl", "ddcl_top128"])
    p.add_argument("--num-codes", type=int, default=16384)
    p.add_argument("--seeds", type=int, nargs="+", default=[0])
    peers.add_vqvae_arguments(p)
    p.add_argument("--runs", type=Path, default=Path("../runs/topk_default"))
    p.add_argument("--no-progress-bar", action="store_true")
    args = p.parse_args(argv)
    args.code = commit()
    print(f"[topk_default] code {args.code}", flush=True)
    with peers.study_run(args.threads):
        for seed in args.seeds:
            for method in args.methods:
                out = args.runs / f"K{args.num_codes}" / method / f"seed{seed}"
                path = out / "result.json"
                if path.is_file() and json.loads(path.read_text()).get("settings") == peers.settings_of(args):
                    print(f"[topk_default] {method} seed {seed}: finished, read {path}", flush=True)
                    continue
                print(f"[topk_default] training {method} seed {seed} -> {out} at {time.strftime('%H:%M:%S')}",
                      flush=True)
                result = fit_without_test(method, seed, args, out)
                write_atomic(path, json.dumps(result, indent=1))
                print(f"[topk_default] {method} seed {seed} done in {result['wall_s']:.0f} s", flush=True)


if __name__ == "__main__":
    main()
