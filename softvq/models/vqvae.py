"""VQVAE: encoder -> any softvq quantizer -> decoder, as a LightningModule with per-epoch codebook health.

Its parts live beside it: the encoder and decoder in ``autoencoder.py``; the quantizer names, their defaults and
``LatentNorm`` in ``bottleneck.py``; how the model builds its quantizer and autoencoder in ``_build.py``; what the
model does to its codebooks' temperature (a schedule or an entropy control, for layers that do not hold their own)
in ``_temperature.py``; what the model measures and the per-epoch record in ``_epoch_metrics.py`` (functions of
the model that its Lightning hooks call), with a hierarchy's per-level keys in ``_hierarchy.py``; what it refuses
(bad images, NaN/Inf batches) in ``_batch_checks.py``; checkpoint loading in ``loading.py`` and the RNG states its
checkpoints carry in ``checkpoint_io.py``. The names those modules took from here are still importable from here.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from typing import Any, NamedTuple

import lightning as L
import torch
import torch.nn.functional as F
from einops import rearrange
from torch import Tensor, nn

import softvq
import softvq.models._epoch_metrics as metrics
import softvq.models._hierarchy as hierarchy
import softvq.models._temperature as model_temperature
from softvq._checks import check_float
from softvq._collectives import all_reduce_sum_
from softvq._compat import upgrade_quantizer_kwargs
from softvq.hierarchical import HierarchicalDDCL, HierarchicalOutput, combine_levels
from softvq.models._batch_checks import check_finite_batch, check_images
from softvq.models._build import build_autoencoder_, build_quantizer_
from softvq.models._hierarchy import check_level_indices, level_views
from softvq.models.bottleneck import (
    DDCL_TARGET_ENTROPY,
    HIERARCHY_DEFAULTS,
    LATENT_NORMS,
    QUANTIZERS,
    RESIDUAL_QUANTIZERS,
    LatentNorm,
    build_quantizer,
)
from softvq.models.checkpoint_io import load_rng_state, save_rng_state
from softvq.models.loading import load_module
from softvq.optim import has_trainable_prototypes
from softvq.residual import is_residual
from softvq.types import QuantizerOutput

# Also importable from here: the bottleneck names (softvq.models.bottleneck) and the checkpoint loader
# (softvq.models.loading.load_module).
__all__ = ["DDCL_TARGET_ENTROPY", "HIERARCHY_DEFAULTS", "LATENT_NORMS", "PIXEL_SHIFT", "QUANTIZERS",
           "RESIDUAL_QUANTIZERS", "VQVAE", "LatentNorm", "VQVAEOutput", "build_quantizer", "load_module", "load_vqvae"]

PIXEL_SHIFT = 0.5  # the model sees x - 0.5, so inputs and reconstructions are centred on 0


class VQVAEOutput(NamedTuple):
    """What :meth:`VQVAE.forward` returns.

    Attributes:
        reconstruction: ``(B, C, H, W)`` in image units (``[0, 1]`` for a perfect model; not clamped).
        latents: ``(B, D, h, w)``, the encoder's output before quantization.
        quantizer: the quantizer's :class:`~softvq.QuantizerOutput` (tokens channel-last, ``(B, h, w, ...)``), or
            for ``levels > 1`` the :class:`~softvq.HierarchicalOutput` (one ``(B, h_l, w_l, ...)`` entry per level).
    """

    reconstruction: Tensor
    latents: Tensor
    quantizer: QuantizerOutput | HierarchicalOutput


class VQVAE(L.LightningModule):
    """A VQ-VAE whose bottleneck is any softvq quantizer (DDCL soft codebook or hard straight-through VQ).

    Training loss: ``mse(reconstruction, x) + quantizer.loss`` (pixels in ``[0, 1]``). For a DDCL codebook the
    optimizer gives the prototypes learning rate ``lr / eps`` (:func:`softvq.param_groups`), and the temperature
    follows ``temperature_schedule`` from the quantizer's initial temperature to ``temperature_final`` over the
    run's optimizer steps.

    Per training epoch (counts over the whole epoch, summed across processes) :meth:`epoch_summary` reports
    utilization, dead codes, hard and soft perplexity, the epoch means of the quantizer's terms (``l_q``,
    ``l_ols``, ``v``, ...; ``identity_residual`` is the epoch's maximum), ``assignment_entropy`` H(Q),
    ``separation`` S(P) (mean and ``separation_min``), ``train_mse``, and on the validation set MSE, PSNR and
    SSIM of the soft reconstruction and of the reconstruction decoded from hard indices (``*_hard``).

    Args:
        quantizer: ``"ddcl"``, ``"hard"``, or a quantizer module (then pass it again to ``load_from_checkpoint``).
        num_codes: ``K`` (ignored when ``quantizer`` is a module).
        code_dim: ``D``, the latent channels.
        quantizer_kwargs: options of the quantizer class (e.g. ``temperature``, ``commitment_weight``, ``ema_decay``); a
            checkpoint's former option names are upgraded (:mod:`softvq._compat`).
        in_channels, width, res_hidden, res_blocks, downsamples: see :class:`models.autoencoder.Encoder`.
        lr: encoder/decoder learning rate (Adam).
        eps: ``encoder lr / prototype lr`` for DDCL prototypes (the paper's timescale ratio).
        temperature_schedule: ``"constant"``, ``"linear"``, ``"cosine"`` or ``"exponential"``.
        temperature_final: the temperature at the last step (required unless the schedule is constant).
        target_entropy: model-side entropy-controlled temperature, for DDCL layers that do not control their own (the
            hierarchy, ``recipe="plain"``): after every training step ``T <- T exp(temperature_rate (target_entropy -
            H(Q)))`` (:func:`softvq.adapt_temperature`), so T follows the distance scale and about
            ``exp(target_entropy)`` prototypes share each token. ``"auto"``: ``DDCL_TARGET_ENTROPY`` (2.5 nats) for
            such layers with a constant schedule, else off; ``None``: off. A single DDCL layer with the default recipe
            holds its own target (``quantizer_kwargs={"target_entropy": ...}``).
        temperature_rate: the gain of that control, per step.
        latent_norm: ``"batch"`` standardises each latent channel over the batch (non-affine BatchNorm, running
            statistics at evaluation) before the quantizer, so the encoder cannot shrink what the codebook sees;
            ``"none"``; default ``"batch"`` for the hierarchical DDCL (``levels > 1``) and ``"none"`` otherwise (a
            single DDCL layer standardises its tokens itself).
        levels: ``L``, DDCL levels (hierarchical mode, ``"ddcl"`` only; docs/design.md, "Stacked codebooks"). With
            ``L > 1`` the quantizer is a :class:`softvq.HierarchicalDDCL` whose level 0 (``num_codes`` codes)
            quantizes the latent grid and level ``l`` (``level_codes`` codes) the ``level_pool`` x ``level_pool``
            averages of level ``l - 1``'s soft centroids (8x8 -> 4x4 with the defaults); the decoder sees every level,
            nearest-upsampled to the latent grid and concatenated (``L * code_dim`` input channels). Every level has
            its own entropy-controlled temperature (levels above 0 start at level 0's ``T`` scaled by their tokens'
            variance, measured on the first training batch; with an annealing schedule all levels share ``T``) and
            dead-code restart, and ``history.jsonl`` gains ``<key>_l<level>`` keys for every level (the plain keys
            are level 0's). ``encode`` then returns one index grid per level.
        level_codes: the codebook size of every level above 0 (an int), or one per level above 0.
        level_pool: the pooling window between consecutive levels, on both grid axes.
    """

    def __init__(
        self,
        quantizer: str | nn.Module = "ddcl",
        num_codes: int = 512,
        code_dim: int = 64,
        quantizer_kwargs: dict[str, Any] | None = None,
        in_channels: int = 3,
        width: int = 128,
        res_hidden: int = 32,
        res_blocks: int = 2,
        downsamples: int = 2,
        lr: float = 3e-4,
        eps: float = 0.01,
        temperature_schedule: str = "constant",
        temperature_final: float | None = None,
        latent_norm: str | None = None,
        target_entropy: float | str | None = "auto",
        temperature_rate: float = 0.01,
        levels: int = 1,
        level_codes: int | Sequence[int] = 128,
        level_pool: int = 2,
        num_quantizers: int = 1,
    ) -> None:
        super().__init__()
        # a checkpoint's former option names, today's (softvq._compat), before they are saved again
        quantizer_kwargs = upgrade_quantizer_kwargs(quantizer, quantizer_kwargs)
        self.save_hyperparameters(ignore=["quantizer"] if isinstance(quantizer, nn.Module) else None)
        # Quantizer first, then encoder, decoder and latent norm: this order fixes the random initialisation and the
        # parameter order (saved optimizer states rely on it) and the state-dict keys.
        # (softvq/models/_build.py)
        build_quantizer_(self, quantizer, num_codes, code_dim, quantizer_kwargs, temperature_schedule, levels,
                         level_codes, level_pool, num_quantizers)
        build_autoencoder_(self, quantizer, code_dim, in_channels, width, res_hidden, res_blocks, downsamples,
                           latent_norm)
        self.lr = check_float("lr", lr)
        self.eps = check_float("eps", eps)
        # the model-side temperature (a schedule or an entropy control): softvq/models/_temperature.py
        model_temperature.check_settings(self, temperature_schedule, temperature_final, target_entropy,
                                         temperature_rate)
        metrics.build(self)  # the per-epoch metrics (softvq/models/_epoch_metrics.py)

    @property
    def target_entropy(self) -> float | None:
        """The H(Q) this model holds its codebooks' temperatures at, or ``None`` (fixed, scheduled, or controlled by the
        layer itself). ``"auto"``: ``DDCL_TARGET_ENTROPY`` for plain DDCL layers (the hierarchy, ``recipe="plain"``,
        checkpoints from before the in-layer recipe) with a constant schedule."""
        return model_temperature.target_entropy(self)

    def _codebooks(self) -> list[nn.Module]:
        """The codebook layers, level 0 first (the quantizer itself for a single level)."""
        if isinstance(self.quantizer, HierarchicalDDCL) or is_residual(self.quantizer):
            return list(self.quantizer.levels)
        return [self.quantizer]

    def compile_parts(self, **compile_kwargs: Any) -> None:
        """``torch.compile`` the encoder, the decoder and the quantizer in place (``nn.Module.compile``: state-dict
        names and checkpoints are unchanged). The quantizer compiles with ``fullgraph=True`` (a DDCL or hard codebook
        has no graph break; inside ``torch.compile`` it skips its own finite check, which :meth:`training_step` does on
        the latents anyway); a hierarchy compiles level by level, without it. ``compile_kwargs`` go to every call
        (e.g. ``mode="max-autotune"``)."""
        self.encoder.compile(**compile_kwargs)
        self.decoder.compile(**compile_kwargs)
        if isinstance(self.quantizer, HierarchicalDDCL) or is_residual(self.quantizer):  # level by level
            for level in self.quantizer.levels:
                level.compile(**compile_kwargs)
        else:
            self.quantizer.compile(**{"fullgraph": True, **compile_kwargs})

    # ---- model API -----------------------------------------------------------------------------------------
    def _decode(self, z_q: Tensor | Sequence[Tensor]) -> Tensor:
        """Channel-last quantized tokens ``(B, h, w, D)`` -> images in ``[0, 1]`` units ``(B, C, H, W)``; with
        ``levels > 1`` one ``(B, h_l, w_l, D)`` tensor per level, upsampled to level 0's grid and concatenated."""
        if not isinstance(z_q, Tensor):
            z_q = combine_levels(z_q, self.quantizer.upsample_factors(2))  # (B, h, w, L * D)
        # contiguous: a channels-last view would make the decoder's 1x1-conv weight gradients channels-last too,
        # which DDP's gradient buckets flag as a stride mismatch.
        return self.decoder(rearrange(z_q, "b h w d -> b d h w").contiguous()) + PIXEL_SHIFT

    def latents(self, x: Tensor) -> Tensor:
        """Images ``(B, C, H, W)`` in ``[0, 1]`` -> the latents the quantizer sees, ``(B, D, h, w)`` (after
        ``latent_norm``); what downstream readouts of a trained codebook should consume."""
        check_images(x, self.in_channels, self.downsamples)
        return self.norm(self.encoder(x - PIXEL_SHIFT))

    def forward(self, x: Tensor) -> VQVAEOutput:
        """Encode, quantize and decode images ``x (B, C, H, W)`` in ``[0, 1]``."""
        return self._quantize_decode(self.latents(x))

    def _quantize_decode(self, latents: Tensor) -> VQVAEOutput:
        out = self.quantizer(rearrange(latents, "b d h w -> b h w d"))
        return VQVAEOutput(self._decode(out.quantized), latents, out)

    @torch.no_grad()
    def encode(self, x: Tensor) -> Tensor | tuple[Tensor, ...]:
        """Images ``(B, C, H, W)`` in ``[0, 1]`` -> code indices ``(B, h, w)`` (argmax of the assignments); with
        ``levels > 1`` a tuple of per-level grids ``(B, h_l, w_l)``, level 0 first; for a residual quantizer
        ``(B, h, w, Q)``."""
        return self.quantizer(rearrange(self.latents(x), "b d h w -> b h w d")).indices

    @torch.no_grad()
    def decode_indices(self, indices: Tensor | Sequence[Tensor], num_levels: int | None = None) -> Tensor:
        """Code indices ``(B, h, w)`` (``levels > 1``: one grid per level, as :meth:`encode` returns them; a residual
        quantizer: ``(B, h, w, Q)``, decoded from its first ``num_levels`` levels, all by default) -> images
        ``(B, C, H, W)`` in ``[0, 1]`` units (not clamped)."""
        if is_residual(self.quantizer):
            if not isinstance(indices, Tensor) or indices.ndim != 4:
                raise ValueError(f"expected indices of shape (B, h, w, {self.num_quantizers}), got "
                                 f"{tuple(indices.shape) if isinstance(indices, Tensor) else type(indices).__name__}")
            return self._decode(self.quantizer.decode_indices(indices.to(self.device), num_levels))
        if num_levels is not None:
            raise ValueError("num_levels decodes the first levels of a residual quantizer; this one has one level")
        if self.levels > 1:
            check_level_indices(indices, self.levels)
            return self._decode(self.quantizer.decode_indices([idx.to(self.device) for idx in indices]))
        if not isinstance(indices, Tensor) or indices.ndim != 3:
            raise ValueError(f"expected indices of shape (B, h, w), got {tuple(indices.shape)}")
        return self._decode(self.quantizer.decode_indices(indices.to(self.device)))

    # ---- training --------------------------------------------------------------------------------------------
    def configure_optimizers(self) -> torch.optim.Optimizer:
        if has_trainable_prototypes(self):
            return torch.optim.Adam(softvq.param_groups(self, lr=self.lr, eps=self.eps))
        return torch.optim.Adam([p for p in self.parameters() if p.requires_grad], lr=self.lr)

    def on_train_batch_start(self, batch: Any, batch_idx: int) -> None:
        model_temperature.begin_step_(self)  # the model-side temperature (softvq/models/_temperature.py)

    def training_step(self, batch: tuple[Tensor, Tensor], batch_idx: int) -> Tensor:
        x = batch[0]
        fresh = [not getattr(layer, "initialized", True) for layer in self._codebooks()]
        latents = self.latents(x)
        where = f"training batch {batch_idx} of epoch {self.current_epoch + 1} (global step {self.global_step})"
        check_finite_batch(x, latents, where)
        out = self._quantize_decode(latents)
        rec = F.mse_loss(out.reconstruction, x)
        loss = rec + out.quantizer.loss
        if int(all_reduce_sum_((~torch.isfinite(loss.detach())).long().reshape(1))):
            raise FloatingPointError(f"non-finite training loss ({float(loss.detach())}) in {where} (reconstruction "
                                     f"{float(rec.detach())}, quantizer {float(out.quantizer.loss.detach())})")
        views = level_views(out.quantizer, self.quantizer)  # one QuantizerOutput per level
        if self.levels > 1 and any(fresh[1:]) and self.temperature_schedule == "constant":  # the levels' first batch
            hierarchy.match_temperatures_(self._codebooks(), out.quantizer.inputs, fresh)
        n = x.shape[0]
        # a residual stack says how many levels ran (quantize dropout): a host number, no device sync
        ran = out.quantizer.terms.get("levels") if is_residual(self.quantizer) else None
        entropies = metrics.update_train(self, views, rec.detach(), n, None if ran is None else int(ran))
        model_temperature.end_step_(self, entropies)  # the model-side temperature (softvq/models/_temperature.py)
        self.log("train/loss", loss.detach(), prog_bar=True, batch_size=n)
        self.log("train/mse", rec.detach(), batch_size=n)
        return loss

    # ---- per-epoch metrics: the hooks, each one function of softvq/models/_epoch_metrics.py -------------------
    def on_train_epoch_start(self) -> None:
        metrics.start_train_epoch(self)

    def epoch_summary(self) -> dict[str, Any]:
        """This training epoch's record (the keys of ``history.jsonl``), computed once per epoch and step.

        Call at the end of a training epoch on every process (the metrics synchronise across processes).
        Validation keys are ``None`` when no validation ran this epoch.
        """
        return metrics.epoch_summary(self)

    def on_train_epoch_end(self) -> None:
        metrics.log_train_epoch(self)

    def validation_step(self, batch: tuple[Tensor, Tensor], batch_idx: int) -> dict[str, Tensor] | None:
        return metrics.eval_step(self, batch, batch_idx)

    def on_validation_epoch_start(self) -> None:
        metrics.eval_reset(self)

    def on_validation_epoch_end(self) -> None:
        metrics.end_validation_epoch(self)

    def test_step(self, batch: tuple[Tensor, Tensor], batch_idx: int) -> None:
        metrics.eval_step(self, batch, batch_idx)

    def on_test_epoch_start(self) -> None:
        metrics.eval_reset(self)

    def on_test_epoch_end(self) -> None:
        """Fills :attr:`test_summary` (the ``test_*`` keys) and :attr:`test_code_counts` (tokens per code, ``(K,)``,
        summed over processes)."""
        metrics.end_test_epoch(self)

    # ---- checkpoints -------------------------------------------------------------------------------------------
    def on_save_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        save_rng_state(checkpoint)  # so a resumed run draws as an uninterrupted one (models/checkpoint_io.py)

    def on_load_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        load_rng_state(checkpoint)


def load_vqvae(path: str | os.PathLike, map_location: str | torch.device = "cpu", freeze: bool = True) -> VQVAE:
    """A trained :class:`VQVAE` from a Lightning checkpoint of ``train_vqvae.py``, in eval mode.

    Args:
        path: the ``.ckpt`` file (read with ``weights_only=True``: loading it runs no code).
        map_location: where to load the tensors.
        freeze: also set ``requires_grad=False`` on every parameter.

    Returns:
        The model, with ``class_names`` (the training data's classes, or ``None`` if the checkpoint records none).

    Raises:
        FileNotFoundError: ``path`` is not a file (naming it).
        ValueError: the file is unsafe to load, truncated, corrupt or not a VQVAE checkpoint (naming it and the cause).
    """
    model = load_module(VQVAE, path, "VQ-VAE", map_location)
    return model.requires_grad_(False) if freeze else model
