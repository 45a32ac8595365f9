"""CodePrior: an autoregressive prior over a VQ-VAE's code grids (a LightningModule), sampling and evaluation.

A VQ-VAE becomes a generative model once a prior over its discrete codes can be sampled: draw a code grid from
the prior, decode it with the VQ-VAE's decoder. The prior records which VQ-VAE its codes came from (path, SHA-256,
``K``, latent grid), and :func:`check_pairing` refuses a VQ-VAE of another ``K`` or grid (both in ``_pairing.py``);
its scores in bits (:func:`evaluate_prior` and the unigram baselines) are ``_prior_scores.py``.
"""

from __future__ import annotations

import math
import os
import time
from dataclasses import asdict
from typing import Any

import lightning as L
import torch
import torch.nn.functional as F
from einops import rearrange
from torch import Tensor
from torchmetrics import MeanMetric

from softvq._checks import check_choice, check_float, check_non_negative_int, check_positive_int
from softvq._compat import upgrade_prior_config
from softvq.models._pairing import VQVAERecord, check_pairing, latent_grid, vqvae_record
from softvq.models._prior_scores import LN2, PriorEvaluation, evaluate_prior, unigram_bits, unigram_cross_entropy_bits
from softvq.models.loading import load_module
from softvq.models.transformer import CodeTransformer, PriorConfig

# Also importable from here: the VQ-VAE record and pairing check (softvq.models._pairing) and the prior's scores
# (softvq.models._prior_scores).
__all__ = ["LN2", "CodePrior", "PriorEvaluation", "VQVAERecord", "check_pairing", "check_temperature_top_k",
           "class_index", "evaluate_prior", "format_prior_record", "guide", "latent_grid", "load_prior",
           "unigram_bits", "unigram_cross_entropy_bits", "vqvae_record"]


class CodePrior(L.LightningModule):
    """A GPT-style autoregressive prior over code grids ``(B, h, w)``, raster order, optionally class-conditional.

    Batches are ``(codes (B, h, w) int64, labels (B,) int64)``, or with soft targets ``(codes, labels, probs
    (B, h, w, k), prob_codes (B, h, w, k))`` (:class:`~softvq.models.codes.SoftCodes`: each token's top-k
    assignments under the VQ-VAE's quantizer). The loss is the mean cross-entropy (nats) of every code given the
    codes before it: to the hard code, or with ``soft_targets = a > 0`` ``(1 - a)`` times that plus ``a`` times the
    cross-entropy to the token's soft assignments (the inputs stay the hard codes). Validation and every reported
    score are the hard codes' cross-entropy whatever ``a`` is, in bits per code position (nats / ln 2). AdamW
    (weight decay on matrices only), linear warmup over ``warmup_steps``, then cosine decay to ``min_lr_ratio * lr``
    at the last step of the run.

    Args:
        config: the network's :class:`~models.transformer.PriorConfig` (or its ``dict``).
        vqvae: the :class:`VQVAERecord` (or its ``dict``) of the VQ-VAE whose codes it models; ``None`` for tests.
        lr: peak learning rate.
        weight_decay: AdamW weight decay of the weight matrices and embeddings.
        warmup_steps: optimizer steps of linear warmup.
        min_lr_ratio: the learning rate at the last step, as a share of ``lr``.
        label_dropout: a class-conditional prior with the null class (``config.has_null_class``) trains each sequence
            with its label replaced by the null class at this rate, so one network also learns the unconditional
            model that classifier-free guidance (``sample(guidance=w)``) mixes in. ``None``: 0.1 with the null class,
            0 without.
        soft_targets: the weight ``a`` in ``[0, 1]`` of the cross-entropy to the soft assignments in the training loss
            (0: the hard codes alone, today's prior; 1: the soft assignments alone). Training batches must carry them
            when ``a > 0``.

    A conditional prior saved before the null class existed (its ``config`` has no ``null_class``) loads as it was
    saved: no null class, no label dropout, and sampling without guidance draws what it drew then.
    """

    def __init__(
        self,
        config: PriorConfig | dict[str, Any],
        vqvae: VQVAERecord | dict[str, Any] | None = None,
        lr: float = 1e-3,
        weight_decay: float = 0.01,
        warmup_steps: int = 100,
        min_lr_ratio: float = 0.1,
        label_dropout: float | None = None,
        soft_targets: float = 0.0,
    ) -> None:
        super().__init__()
        if isinstance(config, dict):  # a checkpoint's, in today's fields (softvq._compat)
            config = PriorConfig(**upgrade_prior_config(config))
        self.config = config
        self.vqvae = VQVAERecord(**vqvae) if isinstance(vqvae, dict) else vqvae
        if self.vqvae is not None and self.vqvae.num_codes != self.config.num_codes:
            raise ValueError(f"config.num_codes ({self.config.num_codes}) differs from the VQ-VAE's K "
                             f"({self.vqvae.num_codes})")
        self.lr = check_float("lr", lr)
        self.weight_decay = check_float("weight_decay", weight_decay, allow_zero=True)
        self.warmup_steps = check_non_negative_int("warmup_steps", warmup_steps)
        self.min_lr_ratio = check_float("min_lr_ratio", min_lr_ratio, allow_zero=True)
        if label_dropout is None:
            label_dropout = 0.1 if self.config.has_null_class else 0.0
        if not (isinstance(label_dropout, (int, float)) and 0.0 <= label_dropout < 1.0):
            raise ValueError(f"label_dropout must be a number in [0, 1), got {label_dropout!r}")
        if label_dropout > 0 and not self.config.has_null_class:
            raise ValueError(f"label_dropout={label_dropout} needs a class-conditional config with null_class=True "
                             f"(the token the dropped labels become); this config has num_classes="
                             f"{self.config.num_classes}, null_class={self.config.null_class}")
        self.label_dropout = float(label_dropout)
        if not (isinstance(soft_targets, (int, float)) and 0.0 <= soft_targets <= 1.0):
            raise ValueError(f"soft_targets must be a number in [0, 1], got {soft_targets!r}")
        self.soft_targets = float(soft_targets)
        # Plain types only: Lightning's weights_only checkpoint loading accepts them.
        self.save_hyperparameters({"config": self.config.to_dict(),
                                   "vqvae": None if self.vqvae is None else asdict(self.vqvae),
                                   "lr": lr, "weight_decay": weight_decay, "warmup_steps": warmup_steps,
                                   "min_lr_ratio": min_lr_ratio, "label_dropout": self.label_dropout,
                                   "soft_targets": self.soft_targets})
        self.net = CodeTransformer(self.config)
        self.train_nll = MeanMetric()
        self.val_nll = MeanMetric()
        self._val_bits: float | None = None
        self._epoch_start = time.perf_counter()

    @property
    def num_codes(self) -> int:
        return self.config.num_codes

    @property
    def conditional(self) -> bool:
        return self.config.num_classes > 0

    # ---- model API -----------------------------------------------------------------------------------------
    def forward(self, codes: Tensor, labels: Tensor | None = None, null: bool = False) -> Tensor:
        """Next-code logits; see :meth:`models.transformer.CodeTransformer.forward`."""
        return self.net(codes, labels, null)

    def guided_logits(self, codes: Tensor, labels: Tensor, guidance: float) -> Tensor:
        """Classifier-free guided next-code logits ``l_null + w * (l_label - l_null)``: ``w = 1`` is the conditional
        model, ``w = 0`` the unconditional one (the null class), ``w > 1`` pushes samples toward their class."""
        return guide(self(codes, labels), self(codes, null=True), guidance)

    def _grid_logits(self, codes: Tensor, labels: Tensor | None, null: bool) -> Tensor:
        """Next-code logits ``(B, L, K)`` of whole code grids ``codes (B, h, w)``; a grid of another shape is an
        error naming it."""
        c = self.config
        if codes.shape[1:] != (c.height, c.width):
            raise ValueError(f"expected code grids of shape (B, {c.height}, {c.width}), got {tuple(codes.shape)}")
        return self(codes, labels, null)

    @staticmethod
    def _hard_cross_entropy(logits: Tensor, codes: Tensor) -> Tensor:
        targets = rearrange(codes, "b h w -> b (h w)").to(logits.device, torch.long)
        return F.cross_entropy(rearrange(logits, "b l k -> b k l").float(), targets, reduction="none")

    @staticmethod
    def _soft_cross_entropy(logits: Tensor, probs: Tensor, prob_codes: Tensor) -> Tensor:
        # half precision (autocast) upcast as the hard cross-entropy does
        log_p = (logits.float() if logits.dtype in (torch.float16, torch.bfloat16) else logits).log_softmax(-1)
        where = rearrange(prob_codes, "b h w k -> b (h w) k").to(log_p.device, torch.long)
        weights = rearrange(probs, "b h w k -> b (h w) k").to(log_p)
        # entries of weight 0 (padding past a layer's support) add exactly 0, even where a log-probability is -inf
        terms = torch.where(weights > 0, weights * log_p.gather(-1, where), weights.new_zeros(()))
        return -terms.sum(-1)

    def nll(self, codes: Tensor, labels: Tensor | None = None, null: bool = False) -> Tensor:
        """Per-position negative log-likelihood in nats of whole code grids ``(B, h, w)``: ``(B, h * w)``
        (``null``: under the null class, the unconditional model of a guided conditional prior)."""
        return self._hard_cross_entropy(self._grid_logits(codes, labels, null), codes)

    def _check_soft(self, codes: Tensor, probs: Tensor, prob_codes: Tensor) -> None:
        c = self.config
        if probs.shape != prob_codes.shape or probs.shape[:-1] != codes.shape:
            raise ValueError(f"soft targets must be (B, {c.height}, {c.width}, k) probabilities and codes beside the "
                             f"codes {tuple(codes.shape)}, got {tuple(probs.shape)} and {tuple(prob_codes.shape)}")

    def soft_nll(self, codes: Tensor, probs: Tensor, prob_codes: Tensor, labels: Tensor | None = None,
                 null: bool = False) -> Tensor:
        """Per-position cross-entropy in nats, ``(B, h * w)``, of the next-code distribution given the hard codes
        ``codes (B, h, w)`` to the soft targets ``probs (B, h, w, k)`` on the codes ``prob_codes (B, h, w, k)``
        (rows summing to 1): ``-sum_j probs_j log p(prob_codes_j | codes before)``. One-hot targets on the hard
        codes give :meth:`nll` (up to float rounding: another reduction order)."""
        self._check_soft(codes, probs, prob_codes)
        return self._soft_cross_entropy(self._grid_logits(codes, labels, null), probs, prob_codes)

    def _loss(self, codes: Tensor, labels: Tensor | None, null: bool, soft: tuple[Tensor, Tensor] | None) -> Tensor:
        """The training loss of the sequences ``codes`` per position: the hard codes' cross-entropy, mixed with the
        soft targets' at ``soft_targets``; one forward pass of the network either way."""
        if self.soft_targets == 0.0:
            return self.nll(codes, labels, null)
        if soft is None:
            raise ValueError(f"soft_targets={self.soft_targets} needs batches with soft targets (codes, labels, "
                             f"probs, prob_codes); this batch has codes and labels only")
        self._check_soft(codes, *soft)
        logits = self._grid_logits(codes, labels, null)
        soft_loss = self._soft_cross_entropy(logits, *soft)
        if self.soft_targets == 1.0:
            return soft_loss
        return (1.0 - self.soft_targets) * self._hard_cross_entropy(logits, codes) + self.soft_targets * soft_loss

    @torch.no_grad()
    def sample(self, n: int, labels: Tensor | None = None, temperature: float = 1.0, top_k: int | None = None,
               generator: torch.Generator | None = None, guidance: float = 1.0, cache: bool = True) -> Tensor:
        """Draw ``n`` code grids, one code at a time in raster order.

        Each step decodes one position with a key/value cache (:meth:`CodeTransformer.step`); ``cache=False`` re-runs
        the transformer over the whole prefix at every step instead (the same draws, ``L`` times the work).

        Args:
            n: number of grids.
            labels: ``(n,)`` class labels for a class-conditional prior; ``None`` for an unconditional one.
            temperature: the logits are divided by it (``< 1`` sharper, ``> 1`` flatter); ``> 0``.
            top_k: sample among the ``top_k`` most likely codes only; ``None`` = all ``K``. ``top_k=1`` is greedy
                (argmax) decoding.
            generator: a ``torch.Generator`` on the model's device, for reproducible draws.
            guidance: classifier-free guidance weight ``w`` of a conditional prior with the null class: the logits
                are ``l_null + w * (l_label - l_null)`` (before ``temperature`` and ``top_k``). ``1`` (default) is
                plain conditional sampling and needs no null class; ``0`` samples the unconditional model.
            cache: decode with the key/value cache.

        Returns:
            ``(n, h, w)`` int64 codes in ``[0, K)``.
        """
        check_positive_int("n", n)
        temperature, top_k = check_temperature_top_k(temperature, top_k, self.num_codes)
        guidance = check_float("guidance", guidance, allow_zero=True)
        guided = guidance != 1.0
        if guided and not self.config.has_null_class:
            raise ValueError(f"guidance={guidance} needs a class-conditional prior trained with the null class "
                             f"(label dropout); this one has num_classes={self.config.num_classes}, "
                             f"null_class={self.config.null_class}: sample it with guidance=1")
        c, net = self.config, self.net
        was_training = self.training
        self.eval()
        codes = torch.zeros(n, 0, dtype=torch.long, device=self.device)
        try:
            if cache:
                start = net.start_tokens(labels, n)
                if guided:
                    start = torch.cat([start, net.start_tokens(None, n, null=True)])
                caches, inputs = net.new_cache(start.shape[0]), start
            for _ in range(c.length):
                if cache:
                    logits = net.step(inputs, caches)
                    logits = guide(logits[:n], logits[n:], guidance) if guided else logits
                else:
                    logits = (self.guided_logits(codes, labels, guidance) if guided else self(codes, labels))[:, -1]
                logits = logits.float() / temperature  # (n, K): the next code
                if top_k is not None and top_k < c.num_codes:
                    kth = torch.topk(logits, top_k, dim=-1).values[:, -1:]
                    logits = logits.masked_fill(logits < kth, float("-inf"))
                drawn = torch.multinomial(logits.softmax(-1), 1, generator=generator)  # (n, 1)
                codes = torch.cat([codes, drawn], dim=1)
                inputs = torch.cat([drawn[:, 0]] * (2 if guided else 1))
        finally:
            self.train(was_training)
        return rearrange(codes, "b (h w) -> b h w", h=c.height)

    # ---- training --------------------------------------------------------------------------------------------
    def _common_step(self, batch: tuple[Tensor, ...], stage: str) -> Tensor:
        codes, labels = batch[0], batch[1]
        # soft targets shape the training loss only: validation scores the hard codes, for every soft_targets
        soft = (batch[2], batch[3]) if stage == "train" and len(batch) == 4 else None
        labels = labels if self.conditional else None
        if stage != "train":
            loss = self.nll(codes, labels).mean()
        elif self.conditional and self.label_dropout > 0:
            # classifier-free guidance: a share of the sequences learn the unconditional model (the null class)
            dropped = torch.rand(codes.shape[0], device=codes.device) < self.label_dropout

            def part(mask: Tensor, null: bool) -> Tensor:
                kept = None if soft is None else (soft[0][mask], soft[1][mask])
                return self._loss(codes[mask], None if null else labels[mask], null, kept)

            parts = [part(~dropped, False)] if not dropped.all() else []
            parts += [part(dropped, True)] if dropped.any() else []
            loss = torch.cat(parts).mean()
        else:
            loss = self._loss(codes, labels, False, soft).mean()
        if not torch.isfinite(loss):
            raise FloatingPointError(f"non-finite {stage} loss ({float(loss)}) at global step {self.global_step}")
        metric = self.train_nll if stage == "train" else self.val_nll
        metric.update(loss.detach(), weight=codes.shape[0])
        self.log(f"{stage}/bits_per_position", loss.detach() / LN2, prog_bar=True, batch_size=codes.shape[0],
                 on_step=stage == "train", on_epoch=stage != "train")
        return loss

    def training_step(self, batch: tuple[Tensor, Tensor], batch_idx: int) -> Tensor:
        return self._common_step(batch, "train")

    def validation_step(self, batch: tuple[Tensor, Tensor], batch_idx: int) -> None:
        self._common_step(batch, "val")

    def configure_optimizers(self) -> dict[str, Any]:
        decay = [p for p in self.parameters() if p.requires_grad and p.ndim >= 2]
        no_decay = [p for p in self.parameters() if p.requires_grad and p.ndim < 2]
        optimizer = torch.optim.AdamW([{"params": decay, "weight_decay": self.weight_decay},
                                       {"params": no_decay, "weight_decay": 0.0}], lr=self.lr, betas=(0.9, 0.95))
        total = max(int(self.trainer.estimated_stepping_batches), 1)
        warmup, floor = self.warmup_steps, self.min_lr_ratio

        def factor(step: int) -> float:
            if step < warmup:
                return (step + 1) / warmup
            progress = min((step - warmup) / max(total - warmup, 1), 1.0)
            return floor + (1.0 - floor) * 0.5 * (1.0 + math.cos(math.pi * progress))

        scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, factor)
        return {"optimizer": optimizer, "lr_scheduler": {"scheduler": scheduler, "interval": "step"}}

    def on_train_epoch_start(self) -> None:
        self.train_nll.reset()
        self._epoch_start = time.perf_counter()

    def on_validation_epoch_start(self) -> None:
        self.val_nll.reset()

    def on_validation_epoch_end(self) -> None:
        if not self.trainer.sanity_checking and self.val_nll.update_count > 0:
            self._val_bits = float(self.val_nll.compute()) / LN2

    def epoch_summary(self) -> dict[str, Any]:
        """This training epoch's ``history.jsonl`` record: ``train_bits`` (with dropout on, the epoch's running
        mean) and ``val_bits`` (eval mode; ``None`` without validation) in bits per code position."""
        return {"epoch": self.current_epoch + 1, "step": self.global_step,
                "train_bits": float(self.train_nll.compute()) / LN2, "val_bits": self._val_bits,
                "lr": float(self.trainer.optimizers[0].param_groups[0]["lr"]) if self._trainer else self.lr,
                "time_s": round(time.perf_counter() - self._epoch_start, 2)}


def format_prior_record(record: dict[str, Any]) -> str:
    """One human-readable line for a prior's epoch record."""
    val = "n/a" if record.get("val_bits") is None else f"{record['val_bits']:.4f}"
    return (f"epoch {record['epoch']:>3} | train {record['train_bits']:.4f} bits/position | val {val} | "
            f"lr {record['lr']:.2e} | {record['time_s']:.0f}s")


def guide(conditional: Tensor, unconditional: Tensor, guidance: float) -> Tensor:
    """Classifier-free guidance: ``unconditional + guidance * (conditional - unconditional)`` of two logit tensors."""
    return unconditional + guidance * (conditional - unconditional)


def check_temperature_top_k(temperature: float, top_k: int | None, num_codes: int) -> tuple[float, int | None]:
    """Validated sampling options: ``temperature > 0`` and ``top_k`` ``None`` or an integer in ``[1, num_codes]``."""
    temperature = check_float("temperature", temperature)
    if top_k is not None and (isinstance(top_k, bool) or not isinstance(top_k, int) or not 1 <= top_k <= num_codes):
        raise ValueError(f"top_k must be an integer in [1, {num_codes}] (K of this prior), got {top_k!r}")
    return temperature, top_k


def class_index(value: str | int, classes: tuple[str, ...]) -> int:
    """A class given by name (one of ``classes``) or by index (an ``int`` or its text) -> its index."""
    if isinstance(value, str) and value in classes:
        return classes.index(value)
    try:
        index = int(value)
    except (TypeError, ValueError):
        check_choice("class", value, classes)  # raises, listing the names
        raise
    if not 0 <= index < len(classes):
        raise ValueError(f"class must be one of {classes} or an index in [0, {len(classes)}), got {value!r}")
    return index


def load_prior(path: str | os.PathLike, map_location: str | torch.device = "cpu") -> CodePrior:
    """A trained :class:`CodePrior` from a checkpoint of ``train_prior.py``, in eval mode with frozen weights.

    Raises:
        FileNotFoundError: ``path`` is not a file (naming it).
        ValueError: the file is truncated, corrupt or not a CodePrior checkpoint (naming it and the cause).
    """
    return load_module(CodePrior, path, "prior", map_location).requires_grad_(False)


