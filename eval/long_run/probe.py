"""A probe of one bottleneck setting on the full training split, scored every few hundred images: the research loop
behind the long-training study (which setting keeps DDCL learning after the first epoch).

    python -m eval.long_run.probe --data-root ../shared/data/cifar10-jpeg.tar.gz --method ddcl --seed 11 \
        --epochs 3 --out runs/long_probe/ddcl_s11.jsonl
    python -m eval.long_run.probe ... --method hard_ema            # the strongest hard VQ, as eval.peers builds it
    python -m eval.long_run.probe ... --kwargs '{"commitment_weight": 0.01}'   # any option of the layer
    python -m eval.long_run.probe ... --gradient straight_through_plus   # the encoder gets (I + J) g, not J g
    python -m eval.long_run.probe ... --gradient straight_through   # I g alone (with a commitment_weight: VQ-VAE's)
    python -m eval.long_run.probe ... --as-long-run --num-codes 4096 --seed 0   # the long run's run, and its seeding
    python -m eval.long_run.probe ... --anneal-entropy 2.5 1.0    # the entropy target falls linearly over the run
    python -m eval.long_run.probe ... --output-scale 0.1          # the decoder sees DDCL's codes at a tenth
    python -m eval.long_run.probe ... --detach-statistics         # no gradient through the standardiser's moments
    python -m eval.long_run.probe ... --anchor 0.01               # a restoring force on the tokens' per-dimension mean
    python -m eval.long_run.probe ... --freeze-standardizer 352   # from step 352 on, train with fixed statistics
    python -m eval.long_run.probe ... --standardizer-momentum 0.3 # the running moments follow the tokens faster

Trains the VQ-VAE of :func:`eval.peers.fit_run` (one torch thread) and every ``--every`` optimizer steps scores the
first ``--val-images`` validation images (the validation split only: a probe chooses settings) in evaluation mode,
appending one JSON line to ``--out``: ``psnr`` (mean per-image PSNR of the hard-code reconstruction, clamped to
``[0, 1]``, the layer's evaluation statistics as they are) and, for DDCL, what its evaluation mode would give with
other standardisation statistics — ``psnr_running_stats`` (the running moments), ``psnr_exact_stats`` (the exact
moments of those images' latents), ``psnr_used_stats`` (the shift and scale the last training step used),
``psnr_applied_m<m>_stats`` (running averages of the applied ones at momenta :data:`APPLIED_MOMENTA`) — and
``psnr_train_mode`` (a copy of the layer in training mode, batches of 128, as a training step would output them),
with the largest offset of the running mean from the exact one (in standard deviations),
the share of tokens whose code changes with exact statistics, the temperature and the restarts so far. The scoring
changes nothing of the run (the copy's random draws are undone: a test checks the run bit for bit). One line per
epoch end adds the epoch's validation summary.
"""

from __future__ import annotations

import argparse
import copy
import json
import time
from pathlib import Path
from typing import Any

import lightning as L
import torch
from einops import rearrange
from torch import Tensor, nn

from eval import peers
from softvq import DDCLQuantizer, QuantizerOutput
from softvq.data.cifar10 import CIFAR10DataModule
from softvq.models import VQVAE
from softvq.parts import TokenStandardizer

GRADIENTS = ("soft_centroid", "straight_through_plus", "straight_through")


class GradientProbe(nn.Module):
    """A :class:`softvq.DDCLQuantizer` whose training output carries another gradient to its input, the value unchanged
    (the argmax code): ``"straight_through_plus"`` adds ``zs - sg(zs)`` (``zs`` the standardised tokens, read by a hook
    on the layer's standardiser), so the encoder gets ``(I + J) g`` instead of the soft centroid's ``J g``;
    ``"straight_through"`` gives it ``I g`` alone (VQ-VAE's estimator, through the standardisation). With
    ``scale`` every output (and every decoded code) is multiplied by it: the decoder sees codes of that scale. With
    ``anchor > 0`` a training step adds ``anchor * mean_d(m_d^2 / sg(v_d))`` to the loss (``m_d``, ``v_d``: the mean
    and variance of the batch's tokens in dimension ``d``, as the layer takes them): batch standardisation hides a
    per-dimension shift of the tokens from the reconstruction loss, so nothing holds the tokens' mean and the running
    moments lag behind its drift; the anchor makes the shift cost something and pulls it to 0."""

    def __init__(self, layer: DDCLQuantizer, gradient: str, scale: float = 1.0, anchor: float = 0.0) -> None:
        super().__init__()
        if gradient not in GRADIENTS:
            raise ValueError(f"gradient must be one of {GRADIENTS}, got {gradient!r}")
        if not layer.hard_output or not layer.standardize:
            raise ValueError("GradientProbe needs a layer with hard_output and standardize (the defaults)")
        if not anchor >= 0:
            raise ValueError(f"anchor must be >= 0, got {anchor!r}")
        self.layer, self.gradient, self.scale, self.anchor = layer, gradient, scale, anchor
        self.num_codes, self.dim = layer.num_codes, layer.dim
        self._standardised: Tensor | None = None
        layer.standardizer.register_forward_hook(self._keep)

    def _keep(self, module: nn.Module, inputs: Any, outputs: tuple[Tensor, Tensor, Tensor]) -> None:
        self._standardised = outputs[0]

    @property
    def codebook(self) -> Tensor:
        return self.layer.codebook * self.scale

    @property
    def restarts(self) -> int:
        return self.layer.restarts

    def decode_indices(self, indices: Tensor) -> Tensor:
        return self.layer.decode_indices(indices) * self.scale

    def forward(self, z: Tensor) -> QuantizerOutput:
        out = self.layer(z)
        quantized = out.quantized
        if self.training and self.gradient != "soft_centroid":
            zs = self._standardised.reshape(quantized.shape)
            if self.gradient == "straight_through":  # the code's value, the identity's gradient alone
                quantized = quantized.detach()
            quantized = quantized + (zs - zs.detach())
        loss = out.loss
        if self.training and self.anchor > 0:
            flat = z.reshape(-1, z.shape[-1])
            loss = loss + self.anchor * (flat.mean(0).square() / flat.detach().var(0).clamp_min(1e-12)).mean()
        return out._replace(quantized=quantized * self.scale if self.scale != 1.0 else quantized, loss=loss)


APPLIED_MOMENTA = (0.1, 0.3, 0.5, 0.7, 0.85)  # the running averages of the applied statistics that are scored


def mean_psnr(reconstruction: Tensor, x: Tensor) -> float:
    """Mean over images of the per-image PSNR (images in ``[0, 1]``, the reconstruction clamped)."""
    mse = (reconstruction.clamp(0, 1) - x).square().flatten(1).mean(1)
    return float((10 * torch.log10(1 / mse)).mean())


def ddcl_layer(model: VQVAE) -> DDCLQuantizer | None:
    layer = getattr(model.quantizer, "layer", model.quantizer)
    return layer if isinstance(layer, DDCLQuantizer) else None


class Snapshots(L.Callback):
    """Scores ``images`` every ``every`` optimizer steps (see the module docstring) into the JSONL file ``out``;
    with ``anneal = (start, end)`` moves a DDCL layer's ``target_entropy`` from ``start`` to ``end`` over the run;
    with ``freeze_at`` sets its standardiser ``frozen`` after that many optimizer steps: from then on training
    standardises with the evaluation statistics of that moment, fixed (no batch moments, no projection of the
    tokens' per-dimension shift and scale out of the gradient), so training and evaluation standardise alike."""

    def __init__(self, images: Tensor, every: int, out: Path, anneal: tuple[float, float] | None = None,
                 freeze_at: int | None = None) -> None:
        self.images, self.every, self.out, self.anneal, self.freeze_at = images, every, out, anneal, freeze_at
        self._used: tuple[Tensor, Tensor] | None = None
        # running averages of the shift and scale (squared) training applied, one per momentum: evaluation statistics
        # that follow what training saw, scored beside the running moments
        self._applied: dict[float, tuple[Tensor, Tensor]] = {}
        self._start = time.perf_counter()

    def setup(self, trainer: L.Trainer, pl_module: VQVAE, stage: str) -> None:
        layer = ddcl_layer(pl_module)
        if layer is not None:
            layer.standardizer.register_forward_hook(self._keep_used)

    def _keep_used(self, module: nn.Module, inputs: Any, outputs: tuple[Tensor, Tensor, Tensor]) -> None:
        if module.training:
            self._used = (outputs[1].detach().clone(), outputs[2].detach().clone())
            shift, var = self._used[0], self._used[1] ** 2
            for m in APPLIED_MOMENTA:
                old = self._applied.get(m)
                self._applied[m] = (shift, var) if old is None else (old[0].lerp(shift, m), old[1].lerp(var, m))

    def _write(self, record: dict[str, Any]) -> None:
        with open(self.out, "a") as f:
            f.write(json.dumps(record) + "\n")

    def on_train_batch_end(self, trainer: L.Trainer, pl_module: VQVAE, outputs: Any, batch: Any,
                           batch_idx: int) -> None:
        layer = ddcl_layer(pl_module)
        if self.anneal is not None and layer is not None:
            start, end = self.anneal
            layer.target_entropy = start + (end - start) * trainer.global_step / trainer.estimated_stepping_batches
        if self.freeze_at is not None and layer is not None and trainer.global_step == self.freeze_at:
            layer.standardizer.frozen = True
            self._write({"frozen_at": trainer.global_step})
        if trainer.global_step % self.every:
            return
        pl_module.eval()
        record = {"step": trainer.global_step, "epoch": trainer.current_epoch + 1, **self.score(pl_module)}
        pl_module.train()
        record["time_s"] = round(time.perf_counter() - self._start, 1)
        self._write(record)

    def on_train_epoch_end(self, trainer: L.Trainer, pl_module: VQVAE) -> None:
        s = pl_module.epoch_summary()
        self._write({"epoch_end": trainer.current_epoch + 1, "step": trainer.global_step,
                     **{k: s.get(k) for k in ("val_psnr_hard", "val_perplexity", "val_utilization", "train_mse",
                                              "restarts")}})

    @torch.no_grad()
    def score(self, model: VQVAE) -> dict[str, Any]:
        x = self.images.to(model.device)
        tokens = rearrange(model.latents(x), "b d h w -> b h w d")
        out = model.quantizer(tokens)
        record: dict[str, Any] = {"psnr": mean_psnr(model._decode(out.quantized), x)}
        layer = ddcl_layer(model)
        if layer is None:
            return record
        scale = getattr(model.quantizer, "scale", 1.0)  # a GradientProbe's output scale: the layer's codes times it
        st = layer.standardizer
        running = st.running_mean.clone(), st.running_var.clone()
        flat = tokens.reshape(-1, tokens.shape[-1])
        mean, var = flat.mean(0), flat.var(0)
        record["run_mean_offset"] = float(((running[0] - mean).abs() / var.sqrt()).max())
        record["run_std_offset"] = float((running[1].sqrt() / var.sqrt() - 1).abs().max())
        kind = st.eval_statistics
        st.eval_statistics = "running"  # the variants below are scored as running moments set by hand
        try:
            variants = [("running", running), ("exact", (mean, var))]
            if self._used is not None:  # the shift and scale of the last training step (a variance: scale squared)
                variants.append(("used", (self._used[0], self._used[1] ** 2)))
            variants += [(f"applied_m{m:g}", stats) for m, stats in sorted(self._applied.items())]
            for key, (m, v) in variants:
                st.running_mean.copy_(m)
                st.running_var.copy_(v)
                other = layer(tokens)
                record[f"psnr_{key}_stats"] = mean_psnr(model._decode(other.quantized * scale), x)
                record[f"codes_changed_{key}"] = float((other.indices != out.indices).float().mean())
        finally:
            st.running_mean.copy_(running[0])
            st.running_var.copy_(running[1])
            st.eval_statistics = kind
        train_copy = copy.deepcopy(layer).train()
        train_copy.standardizer._forward_hooks.clear()
        state = torch.get_rng_state()  # the copy's restarts draw; the run must not see it
        recon = [model._decode(train_copy(tokens[i:i + 128]).quantized * scale) for i in range(0, len(tokens), 128)]
        torch.set_rng_state(state)
        record["psnr_train_mode"] = mean_psnr(torch.cat(recon), x)
        record["temperature"] = layer.temperature
        record["restarts"] = layer.restarts
        return record


def detach_statistics(layer: nn.Module) -> None:
    """Make the shift and scale of every batch-renormalising :class:`~softvq.parts.TokenStandardizer` in ``layer``
    constants of the backward pass (their values unchanged): the loss then sees a per-dimension shift or rescaling of
    the encoder's tokens, which batch statistics' gradient makes a direction it cannot see (and Adam drifts along)."""
    found = [m for m in layer.modules() if isinstance(m, TokenStandardizer)]
    if not found or not all(m.renorm for m in found):
        raise ValueError("--detach-statistics needs a layer that standardises with batch renormalisation (DDCL's "
                         "default)")
    for m in found:
        renormalise = m._renormalise
        m._renormalise = lambda mean, var, f=renormalise: tuple(t.detach() for t in f(mean, var))


def build_quantizer(method: str, num_codes: int, kwargs: dict[str, Any], gradient: str, scale: float = 1.0,
                    detach: bool = False, dim: int = 64, anchor: float = 0.0) -> nn.Module:
    quantizer = peers.build(method, num_codes, dim, kwargs)
    if detach:
        detach_statistics(quantizer)
    if gradient != "soft_centroid" or scale != 1.0 or anchor:
        if not isinstance(quantizer, DDCLQuantizer):
            raise ValueError(f"--gradient, --output-scale and --anchor probe DDCL; --method is {method!r}")
        quantizer = GradientProbe(quantizer, gradient, scale, anchor)
    return quantizer


def build_model(method: str, num_codes: int, kwargs: dict[str, Any], gradient: str, scale: float = 1.0,
                detach: bool = False, anchor: float = 0.0) -> VQVAE:
    return VQVAE(quantizer=build_quantizer(method, num_codes, kwargs, gradient, scale, detach, anchor=anchor),
                 code_dim=64)


class ScoringImages(L.Callback):
    """Hands ``snapshots`` the first ``count`` validation images once the trainer has set the data up (so that reading
    them draws nothing before training starts: the run stays the long run's)."""

    def __init__(self, snapshots: Snapshots, count: int) -> None:
        self.snapshots, self.count = snapshots, count

    def on_fit_start(self, trainer: L.Trainer, pl_module: VQVAE) -> None:
        val = trainer.datamodule.val_set
        state = torch.get_rng_state()
        self.snapshots.images = torch.stack([val[i][0] for i in range(min(self.count, len(val)))])
        torch.set_rng_state(state)


def main(argv: list[str] | None = None) -> VQVAE:
    """Run the probe; returns the trained model."""
    p = argparse.ArgumentParser(prog="python -m eval.long_run.probe", description=__doc__.split("\n\n")[0])
    p.add_argument("--data-root", type=Path, default=Path("data"))
    p.add_argument("--method", choices=peers.METHODS, default="ddcl")
    p.add_argument("--kwargs", type=json.loads, default={}, help="JSON options of the bottleneck")
    p.add_argument("--gradient", choices=GRADIENTS, default="soft_centroid", help="DDCL's encoder gradient")
    p.add_argument("--output-scale", type=float, default=1.0, help="multiply DDCL's codes (the decoder input)")
    p.add_argument("--anneal-entropy", type=float, nargs=2, default=None, metavar=("START", "END"))
    p.add_argument("--detach-statistics", action="store_true",
                   help="the standardiser's shift and scale carry no gradient (their values unchanged)")
    p.add_argument("--anchor", type=float, default=0.0,
                   help="weight of a loss pulling the tokens' per-dimension batch mean to 0 (in their std)")
    p.add_argument("--freeze-standardizer", type=int, default=None, metavar="STEP",
                   help="from this optimizer step on, DDCL's standardiser trains with its evaluation statistics of "
                        "that step, fixed")
    p.add_argument("--standardizer-momentum", type=float, default=None, metavar="M",
                   help="weight of each batch in DDCL's running moments (the layer's: 0.1)")
    p.add_argument("--seed", type=int, default=11)
    p.add_argument("--every", type=int, default=22, help="optimizer steps between two scorings")
    p.add_argument("--val-images", type=int, default=1024)
    p.add_argument("--num-codes", type=int, default=512)
    p.add_argument("--as-long-run", action="store_true",
                   help="seed and build as eval.long_run does: with no other option the run is the long run's run of "
                        "that seed and K, epoch for epoch (its history is the baseline)")
    p.add_argument("--out", type=Path, required=True, help="JSONL file the scorings are appended to")
    peers.add_vqvae_arguments(p)  # the VQ-VAE's flags, as the long run's
    p.set_defaults(epochs=3, train_subset=None)
    args = p.parse_args(argv)
    if args.every < 1 or args.val_images < 1:
        p.error("--every and --val-images must be positive")
    if args.standardizer_momentum is not None and not 0 < args.standardizer_momentum <= 1:
        p.error(f"--standardizer-momentum must be in (0, 1], got {args.standardizer_momentum}")
    args.out.parent.mkdir(parents=True, exist_ok=True)
    torch.set_num_threads(args.threads or 1)
    L.seed_everything(args.seed, workers=True, verbose=False)
    data = CIFAR10DataModule(args.data_root, batch_size=args.batch_size, val_size=args.val_size,
                             train_subset=args.train_subset, num_workers=args.num_workers, seed=args.seed)
    options = (args.method, args.num_codes, args.kwargs, args.gradient, args.output_scale, args.detach_statistics)
    anchor = {"anchor": args.anchor} if args.anchor else {}
    images: Tensor | None = None
    if args.as_long_run:  # eval.long_run.train_run's seeding between data, bottleneck and autoencoder
        quantizer = build_quantizer(*options, dim=args.code_dim, **anchor)
        L.seed_everything(args.seed, workers=True, verbose=False)
        model = VQVAE(quantizer=quantizer, code_dim=args.code_dim, width=args.width, res_blocks=args.res_blocks,
                      res_hidden=args.res_hidden, lr=args.lr)
    else:  # the probe's own seeding (the committed probe lines before --as-long-run)
        data.setup("fit")
        images = torch.stack([data.val_set[i][0] for i in range(min(args.val_images, len(data.val_set)))])
        model = build_model(*options, **anchor)
    if args.standardizer_momentum is not None:
        layer = ddcl_layer(model)
        if layer is None:
            p.error(f"--standardizer-momentum needs a DDCL layer; --method is {args.method!r}")
        layer.standardizer.momentum = args.standardizer_momentum
    L.seed_everything(args.seed, workers=True, verbose=False)
    with open(args.out, "a") as f:
        f.write(json.dumps({"probe": vars(args) | {"data_root": str(args.data_root), "out": str(args.out)}}) + "\n")
    snapshots = Snapshots(images, args.every, args.out, tuple(args.anneal_entropy) if args.anneal_entropy else None,
                          args.freeze_standardizer)
    callbacks: list[L.Callback] = [snapshots] + ([ScoringImages(snapshots, args.val_images)] if images is None else [])
    trainer = L.Trainer(max_epochs=args.epochs, accelerator="cpu", logger=False, enable_checkpointing=False,
                        enable_progress_bar=False, enable_model_summary=False, num_sanity_val_steps=0,
                        callbacks=callbacks)
    trainer.fit(model, datamodule=data)
    return model


if __name__ == "__main__":
    main()
