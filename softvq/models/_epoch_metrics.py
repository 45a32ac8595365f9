"""What :class:`softvq.models.VQVAE` measures, as a mixin of its LightningModule: per training epoch the codebook
health, the quantizer's terms and the reconstruction MSE; per validation / test epoch the reconstruction scores and
code usage; and the record each training epoch writes to ``history.jsonl`` (:meth:`EpochMetrics.epoch_summary`).

All of it is torchmetrics state (reduced across processes, never in a checkpoint's ``state_dict``). The hooks here
only measure; the training step, the temperature control and the checkpoint hooks are in :mod:`softvq.models.vqvae`,
the per-level keys of a hierarchy in :mod:`softvq.models._hierarchy`.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from typing import Any

import torch.nn.functional as F
from torch import Tensor, nn
from torchmetrics import MaxMetric, MeanMetric
from torchmetrics.image import PeakSignalNoiseRatio, StructuralSimilarityIndexMeasure

import softvq
from softvq.models._hierarchy import LevelMetrics, hierarchy_record, level_views
from softvq.types import QuantizerOutput


class EpochMetrics:
    """The metric half of :class:`~softvq.models.VQVAE` (listed before ``LightningModule`` in its bases).

    It relies on the model's ``num_codes``, ``level_num_codes``, ``levels``, ``is_soft``, ``quantizer``,
    ``quantizer_name``, ``_codebooks()`` and ``_decode()``, and on the LightningModule's ``log`` / ``log_dict``.
    """

    def _build_metrics(self) -> None:
        """The per-epoch state (torchmetrics: reduced across processes, not saved in checkpoints)."""
        self.train_usage = softvq.CodebookUsage(self.num_codes)
        self.train_mse = MeanMetric()
        self.train_terms = nn.ModuleDict()  # one MeanMetric per quantizer term, created on first sight
        self.train_identity = MaxMetric()
        self.train_entropy = MeanMetric()
        self.val_usage = softvq.CodebookUsage(self.num_codes)
        self.val_metrics = nn.ModuleDict()
        for suffix in ("", "_hard"):
            self.val_metrics["mse" + suffix] = MeanMetric()
            self.val_metrics["psnr" + suffix] = PeakSignalNoiseRatio(data_range=1.0, dim=(1, 2, 3))  # per image
            self.val_metrics["ssim" + suffix] = StructuralSimilarityIndexMeasure(data_range=1.0)
        self._val_summary: dict[str, float | None] = {}
        self.test_summary: dict[str, float | None] = {}  # filled by Trainer.test (on_test_epoch_end)
        self.test_code_counts: Tensor | None = None
        self._summary_cache: tuple[tuple[int, int], dict[str, Any]] | None = None
        self._epoch_start = time.perf_counter()
        self._restarts_at_epoch_start = 0
        # levels > 1: every level's health (keys "<key>_l<level>"); level 0 also feeds the plain keys above.
        self.level_metrics = nn.ModuleList([LevelMetrics(k) for k in self.level_num_codes or ()])
        self._level_restarts_at_epoch_start = [0] * max(self.levels, len(self.level_num_codes or ()))

    # ---- training epoch ----------------------------------------------------------------------------------------
    def on_train_epoch_start(self) -> None:
        for metric in (self.train_usage, self.train_mse, self.train_identity, self.train_entropy,
                       *self.train_terms.values()):
            metric.reset()
        self._epoch_start = time.perf_counter()
        self._restarts_at_epoch_start = getattr(self._codebooks()[0], "restarts", 0)
        for level, metrics in enumerate(self.level_metrics):
            metrics.reset_train()
            self._level_restarts_at_epoch_start[level] = getattr(self._codebooks()[level], "restarts", 0)

    def _update_train_metrics(self, views: Sequence[QuantizerOutput], mse: Tensor, n: int,
                              levels_run: int | None = None) -> list[Tensor | None]:
        """Add one training batch of ``n`` images (``views``: one quantizer output per level, ``mse``: the batch's
        reconstruction MSE); returns each level's H(Q) of the batch, for the entropy-controlled temperature.
        ``levels_run``: how many levels the step ran (a residual stack's quantize dropout skips the last ones, whose
        indices are -1); the skipped levels count nothing and their H(Q) is ``None``."""
        q = views[0]
        ran = len(views) if levels_run is None else levels_run
        self.train_usage.update(q.indices, q.probs, q.prob_codes)
        self.train_mse.update(mse, weight=n)
        # the layer's own H(Q) where it reports one (DDCL; HardVQ: 0): another pass over the (N, K) assignments with a
        # log per entry cost DDCL's training step 7 ms of 250 here
        entropy = q.terms["entropy"] if "entropy" in q.terms else softvq.assignment_entropy(q.probs)
        self.train_entropy.update(entropy, weight=n)
        entropies = [entropy] + [metrics.update_train(view, n) if level < ran else None for level, (metrics, view)
                                 in enumerate(zip(self.level_metrics[1:], views[1:], strict=True), start=1)]
        if self.level_metrics:
            self.level_metrics[0].update_train(q, n)
        for name, value in q.terms.items():
            if name == "identity_residual":
                self.train_identity.update(value)
                continue
            if name not in self.train_terms:
                self.train_terms[name] = MeanMetric().to(self.device)
            self.train_terms[name].update(value, weight=n)
        return entropies

    def epoch_summary(self) -> dict[str, Any]:
        """This training epoch's record (the keys of ``history.jsonl``), computed once per epoch and step.

        Call at the end of a training epoch on every process (the metrics synchronise across processes).
        Validation keys are ``None`` when no validation ran this epoch.
        """
        key = (self.current_epoch, self.global_step)
        if self._summary_cache is not None and self._summary_cache[0] == key:
            return self._summary_cache[1]
        usage = self.train_usage.compute()
        record: dict[str, Any] = {
            "epoch": self.current_epoch + 1,
            "step": self.global_step,
            "quantizer": self.quantizer_name,
            "utilization": float(usage["utilization"]),
            "dead_codes": int(usage["dead_codes"]),
            "perplexity": float(usage["perplexity"]),
            "soft_perplexity": float(usage.get("soft_perplexity", usage["perplexity"])),
            "train_mse": float(self.train_mse.compute()),
            "assignment_entropy": float(self.train_entropy.compute()),
        }
        for name, metric in self.train_terms.items():
            record[name] = float(metric.compute())
        if self.train_identity.update_count > 0:
            record["identity_residual"] = float(self.train_identity.compute())
        codebook = getattr(self._codebooks()[0], "codebook", None)
        if codebook is not None and codebook.shape[0] >= 2:
            distance = getattr(self._codebooks()[0], "distance", "euclidean")
            separation = softvq.prototype_separation(codebook, distance=distance)
            record["separation"] = float(separation["mean"])
            record["separation_min"] = float(separation["min"])
        restarts = getattr(self._codebooks()[0], "restarts", None)
        if restarts is not None:
            record["restarts"] = restarts - self._restarts_at_epoch_start
        temperature = getattr(self._codebooks()[0], "temperature", None)
        if temperature is not None:
            record["temperature"] = float(temperature)
        for name in (*self.val_metrics, "utilization", "dead_codes", "perplexity"):
            record[f"val_{name}"] = self._val_summary.get(f"val_{name}")
        if self.level_metrics:
            record.update(hierarchy_record(self.level_metrics, self._codebooks(), self._level_restarts_at_epoch_start,
                                           self._val_summary))
        record["time_s"] = round(time.perf_counter() - self._epoch_start, 2)
        self._summary_cache = (key, record)
        return record

    def on_train_epoch_end(self) -> None:
        record = self.epoch_summary()
        skip = {"epoch", "step", "quantizer"}
        # "train_epoch/" beside the per-step "train/" curves; validation figures are logged as "val/" already.
        self.log_dict({f"train_epoch/{k.removeprefix('train_')}": float(v) for k, v in record.items()
                       if k not in skip and not k.startswith("val_") and v is not None}, sync_dist=True)

    # ---- validation and test -----------------------------------------------------------------------------------
    # One shared step: the soft reconstruction and (soft quantizers) the reconstruction decoded from hard indices,
    # scored by MSE, per-image PSNR and SSIM, and the code usage. Validation and test never run at the same time, so
    # they share the metric objects.
    def _eval_step(self, batch: tuple[Tensor, Tensor], batch_idx: int) -> dict[str, Tensor] | None:
        x = batch[0]
        out = self(x)
        hard = self._decode(self.quantizer.decode_indices(out.quantizer.indices)) if self.is_soft \
            else out.reconstruction
        views = level_views(out.quantizer, self.quantizer)
        self.val_usage.update(views[0].indices)
        for metrics, view in zip(self.level_metrics, views, strict=False):
            metrics.eval_usage.update(view.indices)
        pairs = (("", out.reconstruction), ("_hard", hard)) if self.is_soft else (("", out.reconstruction),)
        for suffix, rec in pairs:
            self.val_metrics["mse" + suffix].update(F.mse_loss(rec, x), weight=x.shape[0])
            clamped = rec.clamp(0.0, 1.0)
            self.val_metrics["psnr" + suffix].update(clamped, x)
            self.val_metrics["ssim" + suffix].update(clamped, x)
        if batch_idx == 0:  # for the reconstruction grid (models.callbacks.ReconstructionGrid)
            grid = {"images": x[:8], "reconstruction": out.reconstruction[:8], "reconstruction_hard": hard[:8]}
            if self.num_quantizers > 1:  # a residual stack: decoded from its first 1, 2, ... levels too
                grid["reconstruction_levels"] = [self._decode(self.quantizer.decode_indices(
                    out.quantizer.indices[:8], q)) for q in range(1, self.num_quantizers)]
            return grid
        return None

    def _eval_reset(self) -> None:
        self.val_usage.reset()
        for metric in (*self.val_metrics.values(), *(m.eval_usage for m in self.level_metrics)):
            metric.reset()

    def _eval_summary(self, stage: str) -> dict[str, float | None]:
        """``{stage}_mse``, ``_psnr``, ``_ssim`` (and ``_hard`` twins), ``_utilization``, ``_dead_codes``,
        ``_perplexity`` over the stage's epoch, logged as ``{stage}/...``; {} if it saw no image."""
        summary: dict[str, float | None] = {}
        if int(self.val_usage.hard_counts.sum()) > 0 or self.trainer.world_size > 1:
            for name, metric in self.val_metrics.items():
                if self.is_soft or not name.endswith("_hard"):
                    summary[f"{stage}_{name}"] = float(metric.compute())
            if not self.is_soft:  # straight-through: the reconstruction is the hard decode
                summary.update({f"{stage}_{name}_hard": summary[f"{stage}_{name}"] for name in ("mse", "psnr", "ssim")})
            usage = self.val_usage.compute()
            summary.update({f"{stage}_utilization": float(usage["utilization"]),
                            f"{stage}_dead_codes": int(usage["dead_codes"]),
                            f"{stage}_perplexity": float(usage["perplexity"])})
            for level, metrics in enumerate(self.level_metrics):
                summary.update(metrics.eval_summary(stage, f"_l{level}"))
            # sync_dist: the values are equal on every process already (torchmetrics); this only silences the hint.
            self.log_dict({k.replace(f"{stage}_", f"{stage}/", 1): v for k, v in summary.items()}, sync_dist=True)
        return summary

    def validation_step(self, batch: tuple[Tensor, Tensor], batch_idx: int) -> dict[str, Tensor] | None:
        return self._eval_step(batch, batch_idx)

    def on_validation_epoch_start(self) -> None:
        self._eval_reset()

    def on_validation_epoch_end(self) -> None:
        if self.trainer.sanity_checking:
            return
        self._val_summary = self._eval_summary("val")

    def test_step(self, batch: tuple[Tensor, Tensor], batch_idx: int) -> None:
        self._eval_step(batch, batch_idx)

    def on_test_epoch_start(self) -> None:
        self._eval_reset()

    def on_test_epoch_end(self) -> None:
        """Fills :attr:`test_summary` (the ``test_*`` keys) and :attr:`test_code_counts` (tokens per code, ``(K,)``,
        summed over processes)."""
        self.test_summary = self._eval_summary("test")
        with self.val_usage.sync_context():
            self.test_code_counts = self.val_usage.hard_counts.detach().cpu().clone()
