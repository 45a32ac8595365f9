"""The cost of one VQ-VAE training step (the peers' short setting, K = 16384, one torch thread) with the exact DDCL
layer and its top-k truncations, timed in one process, interleaved, so that whatever else the shared machine runs
weighs on every method alike (the runs' own images/s were recorded hours apart, some through SIGSTOP pauses).

    OMP_NUM_THREADS=1 python -m eval.topk_default.step_cost --out reports/topk_default/step_cost.json

A step: encoder, layer, decoder, MSE + the layer's loss, backward, Adam (``VQVAE.configure_optimizers``), on a batch of
128 uniform random 32 x 32 images (the work does not depend on the pixels). Each method is built from the same seed,
takes ``--warmup`` steps, then ``--rounds`` rounds of ``--steps`` steps each, the methods' order rotating per round.
Reported per method: the median over rounds of CPU seconds per step (``time.process_time``) and of wall seconds.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import torch
import torch.nn.functional as F

ROOT = Path(__file__).resolve().parents[2]

from eval import peers  # noqa: E402
from softvq.models import VQVAE  # noqa: E402
from softvq.models.files import write_atomic  # noqa: E402


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--methods", nargs="+", default=["ddcl", "ddcl_top256", "ddcl_top128"])
    p.add_argument("--num-codes", type=int, default=16384)
    p.add_argument("--batch-size", type=int, default=128)
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--rounds", type=int, default=4)
    p.add_argument("--steps", type=int, default=5)
    p.add_argument("--out", type=Path, default=Path("reports/topk_default/step_cost.json"))
    args = p.parse_args(argv)
    torch.set_num_threads(1)
    models, optims = {}, {}
    for method in args.methods:
        torch.manual_seed(0)
        models[method] = VQVAE(quantizer=peers.build(method, args.num_codes, 64), code_dim=64, width=128,
                               res_blocks=2, res_hidden=32, lr=3e-4).train()
        optims[method] = models[method].configure_optimizers()
    g = torch.Generator().manual_seed(0)
    x = torch.rand(args.batch_size, 3, 32, 32, generator=g)

    def step(method: str) -> None:
        out = models[method](x)
        loss = F.mse_loss(out.reconstruction, x) + out.quantizer.loss
        optims[method].zero_grad(set_to_none=True)
        loss.backward()
        optims[method].step()

    for method in args.methods:
        for _ in range(args.warmup):
            step(method)
    cpu: dict[str, list[float]] = {m: [] for m in args.methods}
    wall: dict[str, list[float]] = {m: [] for m in args.methods}
    for r in range(args.rounds):
        order = args.methods[r % len(args.methods):] + args.methods[:r % len(args.methods)]
        for method in order:
            c, w = time.process_time(), time.perf_counter()
            for _ in range(args.steps):
                step(method)
            cpu[method].append((time.process_time() - c) / args.steps)
            wall[method].append((time.perf_counter() - w) / args.steps)
            print(f"round {r} {method}: {cpu[method][-1]:.3f} CPU s/step, {wall[method][-1]:.3f} wall s/step",
                  flush=True)
    result = {"settings": vars(args) | {"out": str(args.out)},
              "cpu_s_per_step": {m: statistics.median(v) for m, v in cpu.items()},
              "wall_s_per_step": {m: statistics.median(v) for m, v in wall.items()},
              "cpu_rounds": cpu, "wall_rounds": wall,
              "temperature": {m: float(models[m].quantizer.temperature) for m in args.methods}}
    write_atomic(args.out, json.dumps(result, indent=1))
    print(json.dumps({k: result[k] for k in ("cpu_s_per_step", "wall_s_per_step")}, indent=1))


if __name__ == "__main__":
    main()
