"""How many directions the encoder's gradient can take through a trained DDCL layer: per validation token, the
participation ratio of the covariance of the prototypes under its assignment, ``C_n = sum_k q_nk (p_k - mu_n)(p_k -
mu_n)^T``, which the soft centroid's Jacobian ``(2/T) C_n`` applies to the decoder's gradient
(docs/design.md, "What reaches the encoder and what reaches the prototypes"; the findings: "Training to the end").
The participation ratio ``tr(C)^2 / tr(C^2)`` counts the directions that carry the trace (D when C is isotropic, 1
when it is a line).

Scored on a long run's last checkpoint (:mod:`eval.long_run`), at the layer's own temperature and at the temperatures
that put the mean assignment entropy at other targets on the same tokens and prototypes:

    python -m eval.long_run.jacobian_span --data-root ../shared/data/cifar10-jpeg.tar.gz \\
        --run runs/long_run/K4096/ddcl_wide/seed0 --entropies 2.5 4.159 --out reports/long_run/probes/span.json

The validation split only (the run's own held-out images, as its settings record them).
"""

from __future__ import annotations

import math
from typing import Any

import torch
from einops import rearrange
from torch import Tensor

from eval.long_run.checkpoint import load_run, run_data, tool_parser, validation_images, write_record
from softvq.models import VQVAE


def participation_ratio(q: Tensor, prototypes: Tensor) -> Tensor:
    """Per token ``n``, ``tr(C_n)^2 / tr(C_n^2)`` of ``C_n = sum_k q_nk (p_k - mu_n)(p_k - mu_n)^T`` with ``mu_n = q_n
    P``: ``q (N, K)`` rows summing to 1, ``prototypes (K, D)``. Float64, ``(N,)``; 0 where ``C_n`` is 0 (one-hot)."""
    q, p = q.to(torch.float64), prototypes.to(torch.float64)
    mu = q @ p  # (N, D)
    outer = (p[:, :, None] * p[:, None, :]).reshape(p.shape[0], -1)  # p_k p_k^T flattened, (K, D * D)
    second = (q @ outer).reshape(-1, p.shape[1], p.shape[1])  # sum_k q_nk p_k p_k^T, (N, D, D): one matmul
    cov = second - mu[:, :, None] * mu[:, None, :]
    trace = torch.diagonal(cov, dim1=1, dim2=2).sum(-1)
    frob = cov.square().sum((1, 2))
    return torch.where(frob > 0, trace.square() / frob.clamp_min(1e-300), torch.zeros_like(trace))


def assignment_radius(q: Tensor, prototypes: Tensor) -> Tensor:
    """Per token, ``sqrt(tr C_n)``: the root-mean-square distance of the prototypes its assignment ``q (N, K)`` spreads
    over from their mean ``mu_n`` (the width of the neighbourhood the soft centroid averages; float64, ``(N,)``)."""
    q, p = q.to(torch.float64), prototypes.to(torch.float64)
    mu = q @ p
    return (q @ p.square().sum(-1) - mu.square().sum(-1)).clamp_min(0).sqrt()


def entropy_of(distances: Tensor, temperature: float) -> Tensor:
    """Per row, the entropy in nats of ``softmax(-distances / temperature)`` (float64)."""
    logq = torch.log_softmax(-distances.to(torch.float64) / temperature, dim=-1)
    return -(logq.exp() * logq).sum(-1)


def temperature_for_entropy(distances: Tensor, target: float, iterations: int = 60) -> float:
    """The temperature at which the mean entropy of ``softmax(-distances / T)`` over the rows is ``target`` nats
    (bisection in log T; the mean entropy rises with T from 0 to log K).

    Raises:
        ValueError: ``target`` is not in ``(0, log K)``.
    """
    k = distances.shape[-1]
    if not 0 < target < math.log(k):
        raise ValueError(f"target entropy must be in (0, log K = {math.log(k):.4g}), got {target}")
    lo, hi = -30.0, 30.0  # log T: a one-hot and a uniform assignment at any float64 distance scale
    for _ in range(iterations):
        mid = 0.5 * (lo + hi)
        if float(entropy_of(distances, math.exp(mid)).mean()) < target:
            lo = mid
        else:
            hi = mid
    return math.exp(0.5 * (lo + hi))


def _summary(values: Tensor) -> dict[str, float]:
    v = values.to(torch.float64)
    return {"mean": float(v.mean()), "p10": float(v.quantile(0.1)), "median": float(v.median()),
            "p90": float(v.quantile(0.9))}


def span(model: VQVAE, images: Tensor, entropies: tuple[float, ...] = (), batch: int = 128) -> dict[str, Any]:
    """The layer of ``model`` (a DDCL VQ-VAE, evaluation mode) on ``images``: at its own temperature and at each
    of ``entropies``, the mean entropy, ``exp`` of it, the participation ratio's and the assignment radius's mean and
    quantiles (:func:`assignment_radius`); beside them the
    participation ratios of the whole codebook's covariance and of the scored tokens' own."""
    layer = model.quantizer
    model.eval()
    standardised: list[Tensor] = []
    hook = layer.standardizer.register_forward_hook(lambda m, i, o: standardised.append(o[0].detach()))
    try:
        with torch.no_grad():
            for start in range(0, len(images), batch):
                layer(rearrange(model.latents(images[start:start + batch]), "b d h w -> b h w d"))
    finally:
        hook.remove()
    z = torch.cat([s.reshape(-1, layer.dim) for s in standardised]).to(torch.float64)
    p = layer.prototypes.detach().to(torch.float64)
    distances = torch.cdist(z, p).square()  # the layer's euclidean distance in the standardised space
    settings = [("layer", float(layer.temperature))]
    settings += [(f"H={h:g}", temperature_for_entropy(distances, h)) for h in entropies]
    uniform = torch.full((1, p.shape[0]), 1 / p.shape[0], dtype=torch.float64)
    tokens = torch.full((1, z.shape[0]), 1 / z.shape[0], dtype=torch.float64)
    out: dict[str, Any] = {"tokens": int(z.shape[0]), "num_codes": layer.num_codes, "dim": layer.dim,
                           # references: the whole codebook's and the scored tokens' own covariance
                           "codebook_participation_ratio": float(participation_ratio(uniform, p)),
                           "tokens_participation_ratio": float(participation_ratio(tokens, z)),
                           # the scale beside the radius: each token's distance to its nearest prototype
                           "nearest_code_distance": _summary(distances.amin(-1).clamp_min(0).sqrt())}
    for name, temperature in settings:
        entropy, prs, radii = [], [], []
        for d in distances.split(1024):
            logq = torch.log_softmax(-d / temperature, dim=-1)
            q = logq.exp()
            entropy.append(-(q * logq).sum(-1))
            prs.append(participation_ratio(q, p))
            radii.append(assignment_radius(q, p))
        entropy, prs, radii = torch.cat(entropy), torch.cat(prs), torch.cat(radii)
        out[name] = {"temperature": temperature, "entropy": float(entropy.mean()),
                     "exp_entropy": float(entropy.exp().mean()), "participation_ratio": _summary(prs),
                     "radius": _summary(radii)}
    return out


def main(argv: list[str] | None = None) -> dict[str, Any]:
    p = tool_parser("python -m eval.long_run.jacobian_span", __doc__, images=64)
    p.add_argument("--entropies", type=float, nargs="*", default=[], help="mean entropies (nats) also scored")
    args = p.parse_args(argv)
    torch.set_num_threads(1)
    model, settings = load_run(args.run)
    images = validation_images(run_data(args.data_root, settings), args.images)
    return write_record(args.run, settings, images, span(model, images, tuple(args.entropies)), args.out)

if __name__ == "__main__":
    main()
