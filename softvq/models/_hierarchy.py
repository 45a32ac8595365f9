"""Per-level bookkeeping of a hierarchical (``levels > 1``) :class:`models.VQVAE`: codebook health and DDCL terms of
every level, written to ``history.jsonl`` as ``<key>_l<level>``.

Level 0 also keeps the plain keys (``utilization``, ``v``, ...) that a single-level model writes, so reports that read
plain keys compare the bottom level of a hierarchy with a single-level codebook of the same size.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
from torch import Tensor, nn
from torchmetrics import MaxMetric, MeanMetric, MinMetric

import softvq
from softvq._checks import check_positive_int
from softvq._collectives import all_reduce_sum_, is_distributed
from softvq.hierarchical import HierarchicalDDCL, HierarchicalOutput
from softvq.residual import is_residual
from softvq.types import QuantizerOutput

# Per-level training keys (train epoch) and evaluation keys (validation / test epoch), each written as f"{key}_l{l}".
TRAIN_KEYS = ("utilization", "dead_codes", "perplexity", "soft_perplexity", "assignment_entropy", "l_q", "l_ols", "v",
              "v_min", "identity_residual", "separation", "separation_min", "restarts", "temperature")
EVAL_KEYS = ("utilization", "dead_codes", "perplexity")


def level_views(out: QuantizerOutput | HierarchicalOutput, quantizer: nn.Module | None = None
                ) -> tuple[QuantizerOutput, ...]:
    """One :class:`~softvq.QuantizerOutput` per level (just ``(out,)`` for a single-level quantizer; ``quantizer``,
    the module that made ``out``, tells a residual stack's output apart)."""
    if isinstance(out, HierarchicalOutput):
        return tuple(out.level(i) for i in range(len(out.indices)))
    if is_residual(quantizer):
        return tuple(quantizer.level_output(out, q) for q in range(quantizer.num_quantizers))
    return (out,)


def codes_per_level(num_codes: int, level_codes: int | Sequence[int], levels: int) -> tuple[int, ...]:
    """``(K_0, ..., K_{L-1})``: ``num_codes`` at level 0, ``level_codes`` (one int for every level, or one per level)
    above it.

    Raises:
        ValueError: ``level_codes`` of the wrong length (naming it and ``levels``).
    """
    above = [level_codes] * (levels - 1) if isinstance(level_codes, int) else list(level_codes)
    if len(above) != levels - 1:
        raise ValueError(f"level_codes must be an int or hold one codebook size per level above 0 ({levels - 1} for "
                         f"levels={levels}), got {level_codes!r}")
    return (num_codes, *above)


def build_hierarchy(num_codes: int, code_dim: int, levels: int, level_codes: int | Sequence[int], level_pool: int,
                    ddcl_kwargs: dict[str, Any]) -> HierarchicalDDCL:
    """The :class:`~softvq.HierarchicalDDCL` of a ``levels``-level VQ-VAE: ``num_codes`` codes at level 0,
    ``level_codes`` above, ``level_pool`` x ``level_pool`` windows between levels, ``ddcl_kwargs`` at every level.

    Raises:
        ValueError: an invalid ``level_codes`` or ``level_pool`` (naming it).
    """
    codes = codes_per_level(num_codes, level_codes, levels)
    return HierarchicalDDCL(codes, code_dim, pool=check_positive_int("level_pool", level_pool), **ddcl_kwargs)


def hierarchy_record(metrics: Sequence[LevelMetrics], layers: Sequence[nn.Module],
                     restarts_at_epoch_start: Sequence[int], val_summary: dict[str, Any]) -> dict[str, Any]:
    """Every level's ``<key>_l<level>`` entries of one epoch's ``history.jsonl`` record (:data:`TRAIN_KEYS` and
    ``val_`` + :data:`EVAL_KEYS`; the validation ones ``None`` when no validation ran)."""
    record: dict[str, Any] = {}
    for level, (level_metrics, layer) in enumerate(zip(metrics, layers, strict=True)):
        suffix = f"_l{level}"
        record.update(level_metrics.train_record(suffix))
        record.update(codebook_record(layer, suffix, restarts_at_epoch_start[level]))
        for name in EVAL_KEYS:
            record[f"val_{name}{suffix}"] = val_summary.get(f"val_{name}{suffix}")
    return record


class LevelMetrics(nn.Module):
    """One level's per-epoch state: hard/soft usage, the means of its DDCL terms, the largest identity residual, the
    smallest batch ``V``, H(Q); and the level's code usage on the validation / test split.

    Metric states are not persistent: they never enter the checkpoint's ``state_dict``.
    """

    def __init__(self, num_codes: int) -> None:
        super().__init__()
        self.train_usage = softvq.CodebookUsage(num_codes)
        self.train_terms = nn.ModuleDict({name: MeanMetric() for name in ("l_q", "l_ols", "v")})
        self.train_identity = MaxMetric()
        self.train_v_min = MinMetric()  # V >= 0 must hold on every batch, not only on the epoch mean
        self.train_entropy = MeanMetric()
        self.eval_usage = softvq.CodebookUsage(num_codes)

    def reset_train(self) -> None:
        for metric in (self.train_usage, self.train_identity, self.train_v_min, self.train_entropy,
                       *self.train_terms.values()):
            metric.reset()

    def update_train(self, out: QuantizerOutput, images: int) -> Tensor:
        """Add one training batch of this level; returns its H(Q) (for the level's entropy-controlled T)."""
        self.train_usage.update(out.indices, out.probs, out.prob_codes)
        entropy = softvq.assignment_entropy(out.probs)
        self.train_entropy.update(entropy, weight=images)
        for name, metric in self.train_terms.items():
            if name in out.terms:  # a DDCL or HardVQ level (another library's levels report none)
                metric.update(out.terms[name], weight=images)
        if "v" in out.terms:
            self.train_v_min.update(out.terms["v"])
        if "identity_residual" in out.terms:  # a DDCL level
            self.train_identity.update(out.terms["identity_residual"])
        return entropy

    def train_record(self, suffix: str) -> dict[str, Any]:
        usage = self.train_usage.compute()
        record: dict[str, Any] = {
            f"utilization{suffix}": float(usage["utilization"]),
            f"dead_codes{suffix}": int(usage["dead_codes"]),
            f"perplexity{suffix}": float(usage["perplexity"]),
            f"soft_perplexity{suffix}": float(usage.get("soft_perplexity", usage["perplexity"])),
            f"assignment_entropy{suffix}": float(self.train_entropy.compute()),
        }
        for name, metric in self.train_terms.items():
            if metric.update_count > 0:
                record[f"{name}{suffix}"] = float(metric.compute())
        if self.train_v_min.update_count > 0:
            record[f"v_min{suffix}"] = float(self.train_v_min.compute())
        if self.train_identity.update_count > 0:
            record[f"identity_residual{suffix}"] = float(self.train_identity.compute())
        return record

    def eval_summary(self, stage: str, suffix: str) -> dict[str, float | int]:
        usage = self.eval_usage.compute()
        return {f"{stage}_utilization{suffix}": float(usage["utilization"]),
                f"{stage}_dead_codes{suffix}": int(usage["dead_codes"]),
                f"{stage}_perplexity{suffix}": float(usage["perplexity"])}


def codebook_record(layer: nn.Module, suffix: str, restarts_at_epoch_start: int) -> dict[str, Any]:
    """A DDCL layer's prototype separation S(P), restarts this epoch and temperature, keyed with ``suffix``."""
    record: dict[str, Any] = {}
    codebook = layer.codebook
    if codebook.shape[0] >= 2:
        separation = softvq.prototype_separation(codebook, distance=getattr(layer, "distance", "euclidean"))
        record[f"separation{suffix}"] = float(separation["mean"])
        record[f"separation_min{suffix}"] = float(separation["min"])
    if getattr(layer, "restarts", None) is not None:
        record[f"restarts{suffix}"] = layer.restarts - restarts_at_epoch_start
    if getattr(layer, "temperature", None) is not None:  # a DDCL level
        record[f"temperature{suffix}"] = float(layer.temperature)
    return record


@torch.no_grad()
def match_temperatures_(layers: Sequence[nn.Module], inputs: Sequence[Tensor], fresh: Sequence[bool]) -> None:
    """Put every level above 0 that was just initialised from data on level 0's temperature *scale*:
    ``T_l = T_0 * s_l / s_0`` with ``s_l`` the total variance of the tokens level ``l`` quantized in this batch.

    Pooled soft centroids spread far less than the standardised latents of level 0 (a window average of soft
    averages), so one ``T`` for all levels leaves the upper levels' assignments near uniform; entropy control would
    need hundreds of steps (``rate`` 0.01) to close a gap of that size. Squared distances scale with the variance, so
    this gives every level about the same ``d / T`` at the start; entropy control (or a constant ``T``) goes on from
    there per level.
    """
    scale0 = total_variance(inputs[0])
    for layer, z, new in zip(layers[1:], inputs[1:], fresh[1:], strict=True):
        scale = total_variance(z)
        if new and float(scale0) > 0 and float(scale) > 0:
            # a new starting point: a level's own entropy control (if it has one) goes on from there
            layer.set_temperature(float(layers[0].temperature * scale / scale0), keep_control=True)


def total_variance(z: Tensor) -> Tensor:
    """The summed per-channel (biased) variance of channel-last tokens ``z (..., D)`` in float64; under
    ``torch.distributed`` over every process's tokens together (two all-reduces), so all processes agree."""
    flat = z.detach().reshape(-1, z.shape[-1]).double()
    if not is_distributed():
        return flat.var(0, unbiased=False).sum()
    stats = all_reduce_sum_(torch.cat([flat.sum(0), flat.new_tensor([flat.shape[0]])]))
    count = stats[-1].clamp_min(1)
    mean = stats[:-1] / count
    return all_reduce_sum_((flat - mean).square().sum(0)).sum() / count


def check_level_indices(indices: Sequence[Tensor], levels: int) -> None:
    """Per-level index grids ``(B, h_l, w_l)`` for :meth:`models.VQVAE.decode_indices`.

    Raises:
        ValueError: not a sequence of ``levels`` tensors of 3 dimensions (naming what it got).
    """
    if isinstance(indices, Tensor) or not isinstance(indices, Sequence) or len(indices) != levels:
        got = f"a tensor of shape {tuple(indices.shape)}" if isinstance(indices, Tensor) else repr(type(indices))
        raise ValueError(f"a {levels}-level model decodes one index grid (B, h_l, w_l) per level, got {got}")
    for level, idx in enumerate(indices):
        if not isinstance(idx, Tensor) or idx.ndim != 3:
            shape = tuple(idx.shape) if isinstance(idx, Tensor) else type(idx).__name__
            raise ValueError(f"expected indices of level {level} of shape (B, h, w), got {shape}")

