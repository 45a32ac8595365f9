"""The seconds of one VQ-VAE training step of every method of :mod:`eval.per_second`, side by side in one process.

    python -m eval.per_second.step_cost --num-codes 512 4096 16384 [--methods ...] [--threads 2] [--json FILE]

The model is the study's (:func:`eval.harness.vqvae_of` in the short setting's sizes: width 128, two residual blocks,
D = 64, batch 128), every method on the same in-memory random batches. ``--interleave steps`` (the default): all the
methods' models live at once and take their training steps in turn, one step each, the order rotated every step
(:func:`time_step_interleaved`: the model's own ``training_step`` with its metrics, backward pass and optimizer step,
outside Lightning's loop), so that a burst of machine noise, which on a shared VM lasts seconds, hits every method
alike; ``--rounds`` x ``--steps`` steps per method after ``--warmup`` untimed ones. ``--interleave fits``: each method
fitted by Lightning for ``--steps`` steps, the methods one after the other in ``--rounds`` rounds
(:func:`eval.bench_train.time_steps`: every step from its start hook to its end hook, warm-up steps dropped); measured
so, one method's per-round step ratio to hard VQ's moved between 0.6x and 1.3x here. Run it on quiet cores: pause
training jobs (SIGSTOP) while it runs. ``ddcl_anneal`` is timed at each of its k
(``ddcl_anneal@128`` ...; a k that ``ddcl_k<k>`` times is that entry): its seconds are each phase's steps times that
phase's cost. Printed: the median step and its
ratio to ``hard_ema``'s; written (``--json``, default ``reports/per_second/step_cost.json``): every step's seconds.
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import time
import warnings
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import lightning as L
import torch

from eval import bench_train, harness
from eval._bench import markdown_table, sync
from eval._provenance import code_commit
from eval.per_second.plan import BASELINES, CANDIDATES, OUT
from softvq.cli.common import quiet_lightning
from softvq.models import VQVAE


def timed_methods(methods: Sequence[str], num_codes: int) -> list[str]:
    """The names timed: ``ddcl_anneal`` as one entry per k of its schedule (``ddcl_anneal@k``), except a k whose
    layer a truncated method already times (``ddcl_k32`` is ``ddcl_anneal``'s last phase: the same layer)."""
    out = []
    for method in methods:
        if method == "ddcl_anneal":
            ks = [min(k, max(1, num_codes // 4)) for k in harness.ANNEAL_K]
            out += [f"ddcl_anneal@{k}" for k in ks if f"ddcl_k{k}" not in methods]
        else:
            out.append(method)
    return list(dict.fromkeys(out))


def build_model(name: str, num_codes: int, args: argparse.Namespace) -> VQVAE:
    """The study's VQ-VAE with method ``name``'s bottleneck (``ddcl_anneal@k``: the annealed layer at that k)."""
    method, _, k = name.partition("@")
    L.seed_everything(args.seed, verbose=False)
    quantizer = (harness.truncated_layer(num_codes, args.code_dim, int(k)) if k
                 else harness.build(method, num_codes, args.code_dim))
    return VQVAE(quantizer=quantizer, code_dim=args.code_dim, width=args.width, res_blocks=args.res_blocks,
                 res_hidden=args.res_hidden, lr=args.lr)


def time_step_interleaved(args: argparse.Namespace, models: dict[str, VQVAE]) -> dict[str, list[float]]:
    """Per-step seconds of every method, the methods taking one training step each in turn (the order rotated every
    step), ``--warmup`` steps each untimed, then ``--rounds x --steps`` timed; each step the model's own batch-start
    hook and ``training_step`` (its metrics included), the backward pass and the optimizer step, on the same batch."""
    device = torch.device("cuda" if args.accelerator == "gpu" else "cpu")
    g = torch.Generator().manual_seed(args.seed)
    batches = torch.rand(4, args.batch_size, 3, 32, 32, generator=g).to(device)
    labels = torch.zeros(args.batch_size, dtype=torch.long, device=device)
    optimizers = {}
    for name, model in models.items():
        model.to(device).train()
        configured = model.configure_optimizers()
        optimizers[name] = configured["optimizer"] if isinstance(configured, dict) else configured
        model.on_train_epoch_start()
    names = list(models)
    times: dict[str, list[float]] = {name: [] for name in names}
    for step in range(args.warmup + args.rounds * args.steps):
        batch = (batches[step % len(batches)], labels)
        for name in names[step % len(names):] + names[:step % len(names)]:
            model, optimizer = models[name], optimizers[name]
            sync(device)
            start = time.perf_counter()
            optimizer.zero_grad(set_to_none=True)
            model.on_train_batch_start(batch, step)
            model.training_step(batch, step).backward()
            optimizer.step()
            sync(device)
            if step >= args.warmup:
                times[name].append(time.perf_counter() - start)
    return times


def measure(args: argparse.Namespace) -> dict[str, Any]:
    """Every step's seconds per K and method name."""
    result: dict[str, Any] = {"steps": {}, "batch_size": args.batch_size}
    for num_codes in args.num_codes:
        models = {name: build_model(name, num_codes, args) for name in timed_methods(args.methods, num_codes)}
        with quiet_lightning(), warnings.catch_warnings():
            # self.log outside a Trainer: the step's logging is skipped, with a warning each time
            warnings.filterwarnings("ignore", message=".*self.trainer. reference is not registered.*")
            times = (time_step_interleaved(args, models) if args.interleave == "steps"
                     else bench_train.time_steps(args, models, args.batch_size))
        result["steps"][str(num_codes)] = times
        print(format_table(num_codes, times))
    return result


def format_table(num_codes: int, times: dict[str, list[float]]) -> str:
    base = "hard_ema" if "hard_ema" in times else next(iter(times))
    median = {m: statistics.median(t) for m, t in times.items()}
    rows = [[str(num_codes), m, f"{median[m] * 1e3:.1f}", f"{median[base] / median[m]:.3f}x"] for m in times]
    return markdown_table(["K", "method", "step ms (median)", f"images/s vs {base}"], rows)


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--num-codes", type=int, nargs="+", default=[512, 4096, 16384])
    p.add_argument("--methods", nargs="+", choices=harness.METHODS, default=[*CANDIDATES, *BASELINES])
    p.add_argument("--steps", type=int, default=8, help="timed steps per fit (default 8)")
    p.add_argument("--warmup", type=int, default=3, help="untimed steps at the start of every fit (default 3)")
    p.add_argument("--rounds", type=int, default=3, help="interleaved rounds (default 3)")
    p.add_argument("--interleave", choices=("steps", "fits"), default="steps",
                   help="take turns every step (default) or every Lightning fit of --steps steps")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", type=Path, default=OUT / "step_cost.json")
    harness.add_vqvae_arguments(p)
    args = p.parse_args(argv)
    args.accelerator = "gpu" if torch.cuda.is_available() else "cpu"
    if min(args.steps, args.rounds) < 1 or args.warmup < 0:
        p.error("--steps and --rounds must be positive and --warmup non-negative")
    return args


def main(argv: Sequence[str] | None = None) -> dict[str, Any]:
    args = parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    warnings.filterwarnings("ignore", message=".*does not have many workers.*")
    warnings.filterwarnings("ignore", message=".*isinstance\\(treespec, LeafSpec\\)` is deprecated")
    print(f"torch {torch.__version__}, {args.accelerator}, threads {torch.get_num_threads()}, batch {args.batch_size}, "
          f"{args.rounds} rounds x {args.steps} steps per method")
    result = measure(args)
    result.update(code=code_commit(), torch=torch.__version__, threads=torch.get_num_threads(),
                  machine=platform.processor() or platform.machine(),
                  cpu_capability=torch.backends.cpu.get_cpu_capability(), accelerator=args.accelerator,
                  rounds=args.rounds, steps_per_fit=args.steps, warmup=args.warmup, interleave=args.interleave)
    result["measured"] = {k: {"code": result["code"], "rounds": args.rounds, "steps_per_fit": args.steps,
                              "interleave": args.interleave} for k in result["steps"]}
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        previous = json.loads(args.json.read_text()) if args.json.exists() else {}
        if previous.get("threads") == result["threads"] and previous.get("machine") == result["machine"]:
            # the other K's measurements stay, each with the commit and rounds it was measured at
            kept = {k: v for k, v in previous.get("steps", {}).items() if k not in result["steps"]}
            old = previous.get("measured", {})
            result["measured"] = {**{k: old.get(k, {"code": previous.get("code"), "rounds": previous.get("rounds"),
                                                    "steps_per_fit": previous.get("steps_per_fit")}) for k in kept},
                                  **result["measured"]}
            result["steps"] = {**kept, **result["steps"]}
        args.json.write_text(json.dumps(result, indent=1) + "\n")
    return result


if __name__ == "__main__":
    main()
