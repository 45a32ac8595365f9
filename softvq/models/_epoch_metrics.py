"""What :class:`softvq.models.VQVAE` measures: per training epoch the codebook health, the quantizer's terms and the
reconstruction MSE; per validation / test epoch the reconstruction scores and code usage; and the record each
training epoch writes to ``history.jsonl`` (:func:`epoch_summary`).

Functions of the model, which its Lightning hooks call (``on_train_epoch_start`` is :func:`start_train_epoch`,
``validation_step`` and ``test_step`` are :func:`eval_step`, ...). They rely on the model's ``num_codes``,
``level_num_codes``, ``levels``, ``is_soft``, ``quantizer``, ``quantizer_name``, ``_codebooks()`` and ``_decode()``,
and on the LightningModule's ``log`` / ``log_dict``; :func:`build` sets the model's metric attributes.

All of it is torchmetrics state (reduced across processes, never in a checkpoint's ``state_dict``). These functions
only measure; the training step and the checkpoint hooks are in :mod:`softvq.models.vqvae`, the temperature control in
:mod:`softvq.models._temperature`, the per-level keys of a hierarchy in :mod:`softvq.models._hierarchy`.
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


def build(model: nn.Module) -> None:
    """Sets the model's per-epoch state (torchmetrics: reduced across processes, not saved in checkpoints)."""
    model.train_usage = softvq.CodebookUsage(model.num_codes)
    model.train_mse = MeanMetric()
    model.train_terms = nn.ModuleDict()  # one MeanMetric per quantizer term, created on first sight
    model.train_identity = MaxMetric()
    model.train_entropy = MeanMetric()
    model.val_usage = softvq.CodebookUsage(model.num_codes)
    model.val_metrics = nn.ModuleDict()
    for suffix in ("", "_hard"):
        model.val_metrics["mse" + suffix] = MeanMetric()
        model.val_metrics["psnr" + suffix] = PeakSignalNoiseRatio(data_range=1.0, dim=(1, 2, 3))  # per image
        model.val_metrics["ssim" + suffix] = StructuralSimilarityIndexMeasure(data_range=1.0)
    model._val_summary = {}  # the last validation epoch's keys
    model.test_summary = {}  # filled by Trainer.test (on_test_epoch_end)
    model.test_code_counts = None  # a (K,) tensor after Trainer.test
    model._summary_cache = None  # ((epoch, step), record)
    model._epoch_start = time.perf_counter()
    model._restarts_at_epoch_start = 0
    # levels > 1: every level's health (keys "<key>_l<level>"); level 0 also feeds the plain keys above.
    model.level_metrics = nn.ModuleList([LevelMetrics(k) for k in model.level_num_codes or ()])
    model._level_restarts_at_epoch_start = [0] * max(model.levels, len(model.level_num_codes or ()))


# ---- training epoch ----------------------------------------------------------------------------------------
def start_train_epoch(model: nn.Module) -> None:
    for metric in (model.train_usage, model.train_mse, model.train_identity, model.train_entropy,
                   *model.train_terms.values()):
        metric.reset()
    model._epoch_start = time.perf_counter()
    model._restarts_at_epoch_start = getattr(model._codebooks()[0], "restarts", 0)
    for level, metrics in enumerate(model.level_metrics):
        metrics.reset_train()
        model._level_restarts_at_epoch_start[level] = getattr(model._codebooks()[level], "restarts", 0)


def update_train(model: nn.Module, views: Sequence[QuantizerOutput], mse: Tensor, n: int,
                 levels_run: int | None = None) -> list[Tensor | None]:
    """Add one training batch of ``n`` images (``views``: one quantizer output per level, ``mse``: the batch's
    reconstruction MSE); returns each level's H(Q) of the batch, for the entropy-controlled temperature.
    ``levels_run``: how many levels the step ran (a residual stack's quantize dropout skips the last ones, whose
    indices are -1); the skipped levels count nothing and their H(Q) is ``None``."""
    q = views[0]
    ran = len(views) if levels_run is None else levels_run
    model.train_usage.update(q.indices, q.probs, q.prob_codes)
    model.train_mse.update(mse, weight=n)
    # the layer's own H(Q) where it reports one (DDCL; HardVQ: 0): it is exact, and recomputing it is another pass
    # over the (N, K) assignments with a log per entry (its cost: docs/scaling.md, "Chunk sizes")
    entropy = q.terms["entropy"] if "entropy" in q.terms else softvq.assignment_entropy(q.probs)
    model.train_entropy.update(entropy, weight=n)
    entropies = [entropy] + [metrics.update_train(view, n) if level < ran else None for level, (metrics, view)
                             in enumerate(zip(model.level_metrics[1:], views[1:], strict=True), start=1)]
    if model.level_metrics:
        model.level_metrics[0].update_train(q, n)
    for name, value in q.terms.items():
        if name == "identity_residual":
            model.train_identity.update(value)
            continue
        if name not in model.train_terms:
            model.train_terms[name] = MeanMetric().to(model.device)
        model.train_terms[name].update(value, weight=n)
    return entropies


def epoch_summary(model: nn.Module) -> dict[str, Any]:
    """This training epoch's record (the keys of ``history.jsonl``), computed once per epoch and step.

    Call at the end of a training epoch on every process (the metrics synchronise across processes).
    Validation keys are ``None`` when no validation ran this epoch.
    """
    key = (model.current_epoch, model.global_step)
    if model._summary_cache is not None and model._summary_cache[0] == key:
        return model._summary_cache[1]
    usage = model.train_usage.compute()
    record: dict[str, Any] = {
        "epoch": model.current_epoch + 1,
        "step": model.global_step,
        "quantizer": model.quantizer_name,
        "utilization": float(usage["utilization"]),
        "dead_codes": int(usage["dead_codes"]),
        "perplexity": float(usage["perplexity"]),
        "soft_perplexity": float(usage.get("soft_perplexity", usage["perplexity"])),
        "train_mse": float(model.train_mse.compute()),
        "assignment_entropy": float(model.train_entropy.compute()),
    }
    for name, metric in model.train_terms.items():
        record[name] = float(metric.compute())
    if model.train_identity.update_count > 0:
        record["identity_residual"] = float(model.train_identity.compute())
    codebook = getattr(model._codebooks()[0], "codebook", None)
    if codebook is not None and codebook.shape[0] >= 2:
        distance = getattr(model._codebooks()[0], "distance", "euclidean")
        separation = softvq.prototype_separation(codebook, distance=distance)
        record["separation"] = float(separation["mean"])
        record["separation_min"] = float(separation["min"])
    restarts = getattr(model._codebooks()[0], "restarts", None)
    if restarts is not None:
        record["restarts"] = restarts - model._restarts_at_epoch_start
    temperature = getattr(model._codebooks()[0], "temperature", None)
    if temperature is not None:
        record["temperature"] = float(temperature)
    for name in (*model.val_metrics, "utilization", "dead_codes", "perplexity"):
        record[f"val_{name}"] = model._val_summary.get(f"val_{name}")
    if model.level_metrics:
        record.update(hierarchy_record(model.level_metrics, model._codebooks(), model._level_restarts_at_epoch_start,
                                       model._val_summary))
    record["time_s"] = round(time.perf_counter() - model._epoch_start, 2)
    model._summary_cache = (key, record)
    return record


def log_train_epoch(model: nn.Module) -> None:
    record = epoch_summary(model)
    skip = {"epoch", "step", "quantizer"}
    # "train_epoch/" beside the per-step "train/" curves; validation figures are logged as "val/" already.
    model.log_dict({f"train_epoch/{k.removeprefix('train_')}": float(v) for k, v in record.items()
                   if k not in skip and not k.startswith("val_") and v is not None}, sync_dist=True)


# ---- validation and test -----------------------------------------------------------------------------------
# One shared step: the soft reconstruction and (soft quantizers) the reconstruction decoded from hard indices,
# scored by MSE, per-image PSNR and SSIM, and the code usage. Validation and test never run at the same time, so
# they share the metric objects.
def eval_step(model: nn.Module, batch: tuple[Tensor, Tensor], batch_idx: int) -> dict[str, Tensor] | None:
    x = batch[0]
    out = model(x)
    hard = model._decode(model.quantizer.decode_indices(out.quantizer.indices)) if model.is_soft \
        else out.reconstruction
    views = level_views(out.quantizer, model.quantizer)
    model.val_usage.update(views[0].indices)
    for metrics, view in zip(model.level_metrics, views, strict=False):
        metrics.eval_usage.update(view.indices)
    pairs = (("", out.reconstruction), ("_hard", hard)) if model.is_soft else (("", out.reconstruction),)
    for suffix, rec in pairs:
        model.val_metrics["mse" + suffix].update(F.mse_loss(rec, x), weight=x.shape[0])
        clamped = rec.clamp(0.0, 1.0)
        model.val_metrics["psnr" + suffix].update(clamped, x)
        model.val_metrics["ssim" + suffix].update(clamped, x)
    if batch_idx == 0:  # for the reconstruction grid (models.callbacks.ReconstructionGrid)
        grid = {"images": x[:8], "reconstruction": out.reconstruction[:8], "reconstruction_hard": hard[:8]}
        if model.num_quantizers > 1:  # a residual stack: decoded from its first 1, 2, ... levels too
            grid["reconstruction_levels"] = [model._decode(model.quantizer.decode_indices(
                out.quantizer.indices[:8], q)) for q in range(1, model.num_quantizers)]
        return grid
    return None


def eval_reset(model: nn.Module) -> None:
    model.val_usage.reset()
    for metric in (*model.val_metrics.values(), *(m.eval_usage for m in model.level_metrics)):
        metric.reset()


def eval_summary(model: nn.Module, stage: str) -> dict[str, float | None]:
    """``{stage}_mse``, ``_psnr``, ``_ssim`` (and ``_hard`` twins), ``_utilization``, ``_dead_codes``,
    ``_perplexity`` over the stage's epoch, logged as ``{stage}/...``; {} if it saw no image."""
    summary: dict[str, float | None] = {}
    if int(model.val_usage.hard_counts.sum()) > 0 or model.trainer.world_size > 1:
        for name, metric in model.val_metrics.items():
            if model.is_soft or not name.endswith("_hard"):
                summary[f"{stage}_{name}"] = float(metric.compute())
        if not model.is_soft:  # straight-through: the reconstruction is the hard decode
            summary.update({f"{stage}_{name}_hard": summary[f"{stage}_{name}"] for name in ("mse", "psnr", "ssim")})
        usage = model.val_usage.compute()
        summary.update({f"{stage}_utilization": float(usage["utilization"]),
                        f"{stage}_dead_codes": int(usage["dead_codes"]),
                        f"{stage}_perplexity": float(usage["perplexity"])})
        for level, metrics in enumerate(model.level_metrics):
            summary.update(metrics.eval_summary(stage, f"_l{level}"))
        # sync_dist: the values are equal on every process already (torchmetrics); this only silences the hint.
        model.log_dict({k.replace(f"{stage}_", f"{stage}/", 1): v for k, v in summary.items()}, sync_dist=True)
    return summary


def end_validation_epoch(model: nn.Module) -> None:
    if model.trainer.sanity_checking:
        return
    model._val_summary = eval_summary(model, "val")


def end_test_epoch(model: nn.Module) -> None:
    """Fills :attr:`test_summary` (the ``test_*`` keys) and :attr:`test_code_counts` (tokens per code, ``(K,)``,
    summed over processes)."""
    model.test_summary = eval_summary(model, "test")
    with model.val_usage.sync_context():
        model.test_code_counts = model.val_usage.hard_counts.detach().cpu().clone()
