"""DDCL's top-k truncations (``ddcl_top128``, ``ddcl_top256``) against the exact layer (``ddcl``)
at K = 16384, in the peers' short setting (``eval/peers``: width 128, 2 residual blocks, D = 64, Adam 3e-4, batch 128,
10,000 training images, 5 epochs), judged on the **validation** split only.

    python -m eval.topk_default.train --data-root ../shared/data/cifar10-jpeg.tar.gz --threads 1 \
        --num-codes 16384 --seeds 0 --methods ddcl_top256 ddcl ddcl_top128 --runs ../runs/topk_default

It trains through :func:`eval.peers.fit_run` with two differences, both needed by this question:

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
import time
from pathlib import Path
from typing import Any

import lightning as L
import torch

from eval import peers
from eval._provenance import git
from softvq.models.files import write_atomic


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


def commit() -> dict[str, Any]:
    """The commit the runs are trained at, and the files that differ from it."""
    dirty = git("status", "--porcelain")
    return {"commit": git("rev-parse", "--short", "HEAD"), "dirty": bool(dirty), "dirty_files": dirty.splitlines()}


def fit_without_test(method: str, seed: int, args: argparse.Namespace, out: Path) -> dict[str, Any]:
    """:func:`eval.peers.fit_run` without its test-split scoring, keeping the trained state dict."""
    out.mkdir(parents=True, exist_ok=True)  # StepLog starts its file before fit_run runs
    model, _, result = peers.fit_run(method, seed, args, out, test=False, echo=True,
                                     callbacks=[StepLog(out / "steps.jsonl")])
    torch.save(model.state_dict(), out / "vqvae.pt")
    quantizer = model.quantizer
    return {**result, "top_k": getattr(quantizer, "top_k", None),
            "target_entropy": getattr(quantizer, "target_entropy", None), "code": args.code}


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
