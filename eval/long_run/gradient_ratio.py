"""The balance a commitment term gives the encoder: ``||d commitment / d tokens|| / ||d reconstruction / d output||``
at the quantizer, for HardVQ (commitment weight 0.25 on its raw tokens) and for DDCL (weight 1 on its standardised
tokens), every 40 steps of a short run; with the raw tokens' standard deviation (the scale the decoder sees from
HardVQ).

    python -m eval.long_run.gradient_ratio --data-root ../shared/data/cifar10-jpeg.tar.gz --method hard_ema
    python -m eval.long_run.gradient_ratio --data-root ../shared/data/cifar10-jpeg.tar.gz --method ddcl

The DDCL weight that gives the encoder HardVQ's balance is HardVQ's ratio over DDCL's
(docs/design.md, "Training to the end"). One JSON line per scoring on standard output.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import lightning as L
import torch
import torch.nn.functional as F
from einops import rearrange

from eval import peers
from softvq.data.cifar10 import CIFAR10DataModule
from softvq.models import VQVAE


def main(argv: list[str] | None = None) -> list[dict[str, float]]:
    p = argparse.ArgumentParser(prog="python -m eval.long_run.gradient_ratio", description=__doc__.split("\n\n")[0])
    p.add_argument("--data-root", type=Path, default=Path("data"))
    p.add_argument("--method", choices=("hard_ema", "ddcl"), default="hard_ema")
    p.add_argument("--steps", type=int, default=241)
    p.add_argument("--every", type=int, default=40)
    p.add_argument("--train-subset", type=int, default=10_000)
    p.add_argument("--batch-size", type=int, default=128)
    p.add_argument("--val-size", type=int, default=5000, help="images held out (the training set is the rest)")
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args(argv)
    torch.set_num_threads(1)
    L.seed_everything(args.seed, verbose=False)
    data = CIFAR10DataModule(args.data_root, batch_size=args.batch_size, val_size=args.val_size,
                             train_subset=args.train_subset, num_workers=0, seed=args.seed)
    data.setup("fit")
    quantizer = peers.build(args.method, 512, 64)
    model = VQVAE(quantizer=quantizer, code_dim=64).train()
    optimizer = torch.optim.Adam([w for w in model.parameters() if w.requires_grad], lr=3e-4)
    standardised: dict[str, torch.Tensor] = {}
    if args.method == "ddcl":
        quantizer.standardizer.register_forward_hook(lambda m, i, o: standardised.__setitem__("z", o[0]))
    records, step = [], 0
    while step < args.steps:
        for x, _ in data.train_dataloader():
            tokens = rearrange(model.latents(x), "b d h w -> b h w d")
            out = quantizer(tokens)
            rec = F.mse_loss(model._decode(out.quantized), x)
            if step % args.every == 0:
                z = tokens if args.method == "hard_ema" else standardised["z"].reshape(tokens.shape)
                code = quantizer.decode_indices(out.indices).reshape(z.shape)
                weight = 0.25 if args.method == "hard_ema" else 1.0
                commit = weight * F.mse_loss(z, code.detach())
                g_rec = torch.autograd.grad(rec, out.quantized, retain_graph=True)[0]
                g_commit = torch.autograd.grad(commit, z, retain_graph=True)[0]
                record = {"method": args.method, "step": step, "commitment_weight": weight,
                          "ratio": float(g_commit.norm() / g_rec.norm()), "token_std": float(tokens.detach().std()),
                          "reconstruction_mse": float(rec)}
                print(json.dumps(record), flush=True)
                records.append(record)
            optimizer.zero_grad()
            (rec + out.loss).backward()
            optimizer.step()
            step += 1
            if step >= args.steps:
                break
    return records


if __name__ == "__main__":
    main()
