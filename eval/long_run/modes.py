"""Training mode against evaluation mode on a long run's checkpoint: the same validation images through DDCL's layer
as evaluation scores them (the default ``"applied"`` statistics), through a fresh training-mode copy of the layer per
batch (its state as saved, one forward each, so what a training step would have output), and with other
standardisation statistics (the running moments, each batch's exact moments, all scored tokens' exact moments, and the
shift and scale training applies averaged over training batches at the checkpoint's weights).
The issue this measures: docs/design.md, "Which evaluation statistics".

    python -m eval.long_run.modes --data-root ../shared/data/cifar10-jpeg.tar.gz \\
        --run runs/long_run/K4096/ddcl_wide/seed0 --out reports/long_run/probes/modes_k4096_wide_s0.json

Mean per-image PSNR of the hard codes' reconstructions (dB) and the fraction of tokens whose code differs from
evaluation's. The validation split only; the run's state is not changed.
"""

from __future__ import annotations

import copy
from typing import Any

import torch
from einops import rearrange
from torch import Tensor

from eval.long_run.checkpoint import load_run, run_data, tool_parser, training_batches, validation_images, write_record
from eval.long_run.probe import mean_psnr
from softvq.models import VQVAE


@torch.no_grad()
def applied_statistics(model: VQVAE, batches: list[Tensor]) -> tuple[Tensor, Tensor]:
    """The shift and squared scale a training step would apply (batch renormalisation against the saved running
    moments; nothing moves) on each image batch of ``batches`` at ``model``'s weights, averaged: the evaluation
    statistics without the noise and the lag of a running average."""
    st = model.quantizer.standardizer
    was_training = st.training
    st.train()
    try:
        applied = [st(rearrange(model.latents(x), "b d h w -> (b h w) d"), update=False)[1:] for x in batches]
    finally:
        st.train(was_training)
    return torch.stack([a[0] for a in applied]).mean(0), torch.stack([a[1] for a in applied]).square().mean(0)


@torch.no_grad()
def compare_modes(model: VQVAE, images: Tensor, batch: int = 128,
                  train_batches: list[Tensor] | None = None) -> dict[str, Any]:
    """PSNR of ``images`` through the DDCL layer of ``model`` in evaluation, in a training-mode copy (per ``batch``
    images) and with other standardisation statistics (with ``train_batches``: also :func:`applied_statistics` over
    them), and the fraction of codes that differ from evaluation's."""
    model.eval()
    layer, st = model.quantizer, model.quantizer.standardizer
    tokens = rearrange(model.latents(images), "b d h w -> b h w d")
    out = layer(tokens)
    result: dict[str, Any] = {"eval": {"psnr": mean_psnr(model._decode(out.quantized), images), "codes_changed": 0.0}}

    def scored(indices: Tensor, reconstruction: Tensor) -> dict[str, float]:
        return {"psnr": mean_psnr(reconstruction, images),
                "codes_changed": float((indices != out.indices).float().mean())}

    rng = torch.get_rng_state()  # a copy's restart draws; the caller's random state must not see them
    pieces = []
    for i in range(0, len(tokens), batch):
        train_copy = copy.deepcopy(layer).train()
        o = train_copy(tokens[i:i + batch])
        pieces.append((o.indices, model._decode(o.quantized)))
    torch.set_rng_state(rng)
    result["train_mode_copy"] = scored(torch.cat([p[0] for p in pieces]), torch.cat([p[1] for p in pieces]))

    flat = tokens.reshape(-1, layer.dim)
    mean, var = flat.mean(0), flat.var(0)
    kind, saved = st.eval_statistics, (st.running_mean.clone(), st.running_var.clone())
    st.eval_statistics = "running"  # each variant below is scored as running moments set by hand
    try:
        def with_moments(m: Tensor, v: Tensor, x: Tensor) -> Any:
            st.running_mean.copy_(m)
            st.running_var.copy_(v)
            return layer(x)

        variants = {"running": saved, "applied": (st.applied_mean.clone(), st.applied_var.clone()),
                    "all_exact": (mean, var)}
        if train_batches:
            variants["applied_over_train_batches"] = applied_statistics(model, train_batches)
        for name, (m, v) in variants.items():
            o = with_moments(m, v, tokens)
            result[name] = scored(o.indices, model._decode(o.quantized))
        per_batch = []
        for i in range(0, len(tokens), batch):
            part = tokens[i:i + batch]
            f = part.reshape(-1, layer.dim)
            o = with_moments(f.mean(0), f.var(0), part)
            per_batch.append((o.indices, model._decode(o.quantized)))
        result["batch_exact"] = scored(torch.cat([p[0] for p in per_batch]), torch.cat([p[1] for p in per_batch]))
    finally:
        st.running_mean.copy_(saved[0])
        st.running_var.copy_(saved[1])
        st.eval_statistics = kind
    std = var.sqrt()
    result["offsets"] = {  # the largest per-dimension distance of each statistic from the scored tokens' own
        "running_mean_std": float(((saved[0] - mean).abs() / std).max()),
        "applied_mean_std": float(((st.applied_mean - mean).abs() / std).max()),
        "applied_scale_rel": float((st.applied_var.sqrt() / std - 1).abs().max()),
    }
    return result


def main(argv: list[str] | None = None) -> dict[str, Any]:
    p = tool_parser("python -m eval.long_run.modes", __doc__, images=1024)
    p.add_argument("--train-batches", type=int, default=40,
                   help="training batches the applied statistics are averaged over at the checkpoint's weights")
    args = p.parse_args(argv)
    torch.set_num_threads(1)
    model, settings = load_run(args.run)
    data = run_data(args.data_root, settings)  # set up once for both splits
    images = validation_images(data, args.images)
    train_batches = training_batches(data, args.train_batches)
    scores = {"train_batches": len(train_batches), **compare_modes(model, images, train_batches=train_batches)}
    return write_record(args.run, settings, images, scores, args.out)


if __name__ == "__main__":
    main()
