"""The seconds of one VQ-VAE training step of every method of :mod:`eval.per_second`, side by side in one process.

    python -m eval.per_second.step_cost --num-codes 512 4096 16384 [--methods ...] [--threads 2] [--json FILE]

The model is the study's (:func:`eval.harness.vqvae_of` in the short setting's sizes: width 128, two residual blocks,
D = 64, batch 128); each method is fitted by Lightning for ``--steps`` steps on the same in-memory random batches, the
methods one after the other in ``--rounds`` interleaved rounds so that machine noise hits them alike
(:func:`eval.bench_train.time_steps`: every step from its start hook to its end hook, warm-up steps dropped). Run it on
quiet cores: pause training jobs (SIGSTOP) while it runs. ``ddcl_anneal`` is timed at each of its k
(``ddcl_anneal@128`` ...; a k that ``ddcl_k<k>`` times is that entry): its seconds are each phase's steps times that
phase's cost. Printed: the median step and its
ratio to ``hard_ema``'s; written (``--json``, default ``reports/per_second/step_cost.json``): every step's seconds.
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import warnings
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import lightning as L
import torch

from eval import bench_train, harness
from eval._bench import markdown_table
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


def measure(args: argparse.Namespace) -> dict[str, Any]:
    """Every step's seconds per K and method name."""
    result: dict[str, Any] = {"steps": {}, "batch_size": args.batch_size}
    for num_codes in args.num_codes:
        models = {name: build_model(name, num_codes, args) for name in timed_methods(args.methods, num_codes)}
        with quiet_lightning():
            times = bench_train.time_steps(args, models, args.batch_size)
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
                  rounds=args.rounds, steps_per_fit=args.steps, warmup=args.warmup)
    result["measured"] = {k: {"code": result["code"], "rounds": args.rounds, "steps_per_fit": args.steps}
                          for k in result["steps"]}
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
