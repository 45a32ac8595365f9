"""How many prototypes a top-k DDCL step must keep: the Boltzmann mass it leaves out and the error of the encoder
gradient it gives, against the exact layer in float64, on a trained VQ-VAE's own tokens.

    python -m eval.topk_bound --rd-runs runs/rate_distortion --out reports/topk

For each DDCL VQ-VAE of the rate-distortion study (``eval/rate_distortion/``: K = 512 and 4096, the layer's
defaults), the **validation** images' latents are standardised as the layer sees them, and at the layer's trained
temperature T (and at T / 2 and 2 T) this computes, per token, in float64:

- the assignments ``q = softmax(-|z - p_k|^2 / T)`` and the mass outside the ``k`` largest, ``1 - sum_topk q``;
- the encoder gradient of the soft centroid for a random upstream gradient ``g``:
  ``dz = (2 / T) sum_j q_j ((p_j - mu) . g) p_j``, exactly and from the ``k`` largest (renormalised), and its
  relative error ``|dz_k - dz| / |dz|``.

The accuracy bound a default ``k`` must meet (the large-codebook study's): mean mass left out <= 1e-4 and mean
gradient error <= 1e-3 at the default entropy target, across K and T. No default changes here; this is the
measurement that fixes one.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from pathlib import Path
from typing import Any

import torch
from torch import Tensor

from eval._provenance import code_commit
from eval.sample_quality import load_point
from softvq.cli.common import run_command
from softvq.data.cifar10 import CIFAR10DataModule
from softvq.models.files import write_atomic

KS = (4, 8, 16, 32, 64, 128, 256, 512, 1024)
MASS_BOUND, GRADIENT_BOUND = 1e-4, 1e-3


def truncation_errors(z: Tensor, p: Tensor, t: float, ks: tuple[int, ...], seed: int = 0) -> dict[str, Any]:
    """Mean (and 99th percentile) mass outside the top ``k`` and relative encoder-gradient error of the top-``k``
    soft centroid, per ``k``, for tokens ``z (N, D)`` and prototypes ``p (K, D)`` at temperature ``t`` (float64)."""
    z, p = z.double(), p.double()
    d = torch.cdist(z, p).square()  # (N, K)
    q = torch.softmax(-d / t, dim=1)
    g = torch.randn(z.shape, generator=torch.Generator().manual_seed(seed), dtype=torch.float64)
    exact = _encoder_gradient(q, p, g, t)
    order = q.argsort(dim=1, descending=True)
    out = {}
    for k in ks:
        if k > p.shape[0]:
            continue
        keep = order[:, :k]
        qk = torch.zeros_like(q).scatter_(1, keep, q.gather(1, keep))
        mass = 1.0 - qk.sum(1)
        qk = qk / qk.sum(1, keepdim=True)  # the truncated distribution: softmax over the k largest scores
        err = (_encoder_gradient(qk, p, g, t) - exact).norm(dim=1) / exact.norm(dim=1).clamp_min(1e-300)
        out[k] = {"mass_mean": float(mass.mean()), "mass_p99": float(mass.quantile(0.99)),
                  "gradient_error_mean": float(err.mean()), "gradient_error_p99": float(err.quantile(0.99))}
    out_entropy = float(-(q * q.clamp_min(1e-300).log()).sum(1).mean())
    return {"entropy": out_entropy, "by_k": out}


def _encoder_gradient(q: Tensor, p: Tensor, g: Tensor, t: float) -> Tensor:
    """``(2 / T) sum_j q_j ((p_j - mu) . g) p_j`` for every token: the soft centroid's Jacobian applied to ``g``."""
    mu = q @ p
    a = q * ((p @ g.T).T - (mu * g).sum(1, keepdim=True))  # (N, K): q_j (p_j . g - mu . g)
    return (2.0 / t) * (a @ p)


@torch.no_grad()
def layer_tokens(directory: Path, data_root: Path, limit: int) -> tuple[Tensor, Tensor, float, int]:
    """A DDCL point's validation tokens in the layer's standardised space, its prototypes there, its temperature
    and K."""
    result, vqvae, _, _ = load_point(directory)
    s = result["settings"]
    data = CIFAR10DataModule(data_root, val_size=s["val_size"], train_subset=s["train_subset"], num_workers=0)
    data.setup("fit")
    images = torch.stack([data.val_set[i][0] for i in range(min(limit, len(data.val_set)))])
    layer = vqvae.quantizer
    latents = vqvae.latents(images).movedim(1, -1).reshape(-1, layer.dim)
    z = layer.standardizer.standardize(latents)
    return z, layer.codebook, float(layer.temperature), layer.num_codes


def main(argv: list[str] | None = None) -> dict[str, Any]:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--rd-runs", type=Path, default=Path("runs/rate_distortion"))
    p.add_argument("--data-root", type=Path, default=Path("data"))
    p.add_argument("--images", type=int, default=64, help="validation images per point (64 tokens each)")
    p.add_argument("--out", type=Path, default=Path("reports/topk"))
    args = p.parse_args(argv)
    points = sorted(d.parent for d in args.rd_runs.glob("ddcl/K*/seed0/vqvae.pt"))
    if not points:
        raise FileNotFoundError(f"no DDCL point of the rate-distortion study under {args.rd_runs}")
    rows = []
    for directory in points:
        z, protos, t, k = layer_tokens(directory, args.data_root, args.images)
        for factor in (0.5, 1.0, 2.0):
            rows.append({"num_codes": k, "temperature": t * factor, "factor": factor,
                         **truncation_errors(z, protos, t * factor, KS)})
    lines = ["# Top-k DDCL: the mass left out and the encoder-gradient error against the exact layer", "",
             f"Regenerate: `python -m eval.topk_bound {' '.join(argv if argv is not None else sys.argv[1:])}`", "",
             f"Code: {code_commit()}. Validation tokens ({args.images} images x 64 positions per point) of the "
             f"rate-distortion study's DDCL VQ-VAEs, float64, one random upstream gradient per token.", "",
             f"Bound a default k must meet at the trained T (x1): mean mass <= {MASS_BOUND:g}, mean gradient error "
             f"<= {GRADIENT_BOUND:g}.", "",
             "| K | T (x trained) | H(Q) nats | k | mass left out: mean / p99 | gradient error: mean / p99 |",
             "|---|---|---|---|---|---|"]
    for row in rows:
        for k, e in row["by_k"].items():
            lines.append(f"| {row['num_codes']} | {row['temperature']:.3g} (x{row['factor']:g}) | {row['entropy']:.2f} "
                         f"| {k} | {e['mass_mean']:.1e} / {e['mass_p99']:.1e} | {e['gradient_error_mean']:.1e} / "
                         f"{e['gradient_error_p99']:.1e} |")
    smallest = {}
    for row in rows:
        if row["factor"] == 1.0:
            ok = [k for k, e in row["by_k"].items() if e["mass_mean"] <= MASS_BOUND
                  and e["gradient_error_mean"] <= GRADIENT_BOUND]
            smallest[row["num_codes"]] = min(ok) if ok else None
    lines += ["", "Smallest k within the bound at the trained temperature: " + ", ".join(
        f"K = {k}: {'none of ' + str(KS) if v is None else v}" for k, v in smallest.items()) + ".", ""]
    args.out.mkdir(parents=True, exist_ok=True)
    write_atomic(args.out / "bound.md", "\n".join(lines))
    summary = {"rows": rows, "smallest_k": smallest, "log2": {k: math.log2(k) for k in smallest}}
    write_atomic(args.out / "bound.json", json.dumps(summary, indent=1))
    return summary


def cli(argv: list[str] | None = None) -> int:
    return run_command(main, argv)


if __name__ == "__main__":
    raise SystemExit(cli())
