"""Pure functions for codebook health: usage statistics and the paper's diagnostics S(P) and H(Q).

:class:`softvq.CodebookUsage` is the stateful (epoch-accumulating, DDP-reducing) twin of
:func:`codebook_usage`.
"""

from __future__ import annotations

from typing import Literal

import torch
import torch.nn.functional as F
from torch import Tensor

from softvq._checks import check_choice, check_indices, check_positive_int


def entropy_from_counts(counts: Tensor) -> Tensor:
    """Shannon entropy (nats) of the distribution proportional to non-negative ``counts (K,)``; 0 log 0 = 0."""
    total = counts.sum()
    p = counts / total
    return -(torch.special.xlogy(p, p)).sum()


def usage_from_counts(hard_counts: Tensor, soft_mass: Tensor | None = None) -> dict[str, Tensor]:
    """Utilization, dead codes and perplexities from per-code counts ``(K,)``.

    Returns a dict with ``utilization`` (share of codes chosen at least once), ``dead_codes`` (number never
    chosen), ``perplexity`` (``exp`` of the entropy of the hard usage, between 1 and K) and, when
    ``soft_mass`` (summed assignments per code) is given, ``soft_perplexity``. With no tokens counted the
    perplexities are NaN.
    """
    hard_counts = hard_counts.double()
    used = hard_counts > 0
    nan = torch.tensor(float("nan"), dtype=torch.float64, device=hard_counts.device)
    out = {
        "utilization": used.double().mean(),
        "dead_codes": (~used).sum(),
        "perplexity": entropy_from_counts(hard_counts).exp() if hard_counts.sum() > 0 else nan,
    }
    if soft_mass is not None:
        soft_mass = soft_mass.double()
        out["soft_perplexity"] = entropy_from_counts(soft_mass).exp() if soft_mass.sum() > 0 else nan
    return out


_PROB_MAX = 1 + 1e-5  # the largest assignment probability accepted (float rounding of a one-hot row)


def batch_counts(indices: Tensor, num_codes: int, probs: Tensor | None = None,
                 prob_codes: Tensor | None = None) -> tuple[Tensor, Tensor | None]:
    """Per-code hard counts ``(K,)`` int64 and, when ``probs (..., K)`` is given, summed assignments ``(K,)``.
    With ``prob_codes`` (top-k assignments, :class:`~softvq.QuantizerOutput`), ``probs`` and ``prob_codes`` are
    ``(..., k)`` and each assignment is added to its code's sum: the same sums as the dense ``(..., K)`` array's.

    Raises:
        ValueError: indices outside ``[0, num_codes)`` or not integer, or ``probs`` whose shape does not match or
            that holds NaN, negative or above-1 values, or ``prob_codes`` without ``probs`` or of another shape.
    """
    check_indices(indices, num_codes)
    counts = torch.bincount(indices.reshape(-1).long(), minlength=num_codes)
    if probs is None:
        if prob_codes is not None:
            raise ValueError("prob_codes were given without the probs they index")
        return counts, None
    if prob_codes is None and probs.shape != (*indices.shape, num_codes):
        hint = ("; probs over fewer codes (DDCL's top-k, HardVQ's one-hot as ones) need the codes they refer to: "
                "pass prob_codes (out.prob_codes)") if probs.shape[:-1] == indices.shape else ""
        raise ValueError(f"probs must have shape {(*indices.shape, num_codes)} to match indices, "
                         f"got {tuple(probs.shape)}{hint}")
    if prob_codes is not None:
        if probs.ndim != indices.ndim + 1 or probs.shape[:-1] != indices.shape:
            raise ValueError(f"top-k probs must have shape {(*indices.shape, 'k')} to match indices, "
                             f"got {tuple(probs.shape)}")
        if prob_codes.shape != probs.shape:
            raise ValueError(f"prob_codes must have the shape of probs, {tuple(probs.shape)}, got "
                             f"{tuple(prob_codes.shape)}")
        check_indices(prob_codes, num_codes)
    probs = probs.detach()
    if not probs.is_floating_point():
        raise ValueError(f"probs must be a floating-point tensor of assignment probabilities, got dtype {probs.dtype}")
    # one pass for the range (NaN makes both NaN, which fails both tests); the element-wise masks, four passes over an
    # (N, K) array that cost 8% of a training step at K = 16384, only when a value is out of range
    low, high = probs.aminmax() if probs.numel() else (0.0, 0.0)
    if not (low >= 0 and high <= _PROB_MAX):
        bad = probs[~((probs >= 0) & (probs <= _PROB_MAX))]
        raise ValueError(f"probs must be assignment probabilities in [0, 1]; {bad.numel()} entries are not "
                         f"(e.g. {float(bad[0])!r})")
    if prob_codes is not None:
        soft = torch.zeros(num_codes, dtype=torch.float32, device=probs.device)
        return counts, soft.index_add_(0, prob_codes.reshape(-1).long(), probs.reshape(-1).float())
    return counts, probs.reshape(-1, num_codes).sum(0, dtype=torch.float32)


def codebook_usage(indices: Tensor, num_codes: int, probs: Tensor | None = None,
                   prob_codes: Tensor | None = None) -> dict[str, Tensor]:
    """Codebook health of one batch: see :func:`usage_from_counts`.

    Args:
        indices: integer code indices, any shape, values in ``[0, num_codes)``.
        num_codes: ``K``.
        probs: optional soft assignments ``(..., K)`` whose leading shape matches ``indices``; top-k ones
            ``(..., k)`` with their codes in ``prob_codes`` (``out.probs, out.prob_codes`` of a quantizer's output).
    """
    check_positive_int("num_codes", num_codes)
    return usage_from_counts(*batch_counts(indices, num_codes, probs, prob_codes))


def prototype_separation(prototypes: Tensor,
                         distance: Literal["euclidean", "cosine"] = "euclidean") -> dict[str, Tensor]:
    """S(P): the minimum and mean pairwise Euclidean distance between prototypes ``(K, D)``.

    With ``distance="cosine"`` the prototypes are L2-normalised first (the geometry the layer uses). A
    collapsed codebook has ``min`` near 0. Needs ``K >= 2``.
    """
    check_choice("distance", distance, ("euclidean", "cosine"))
    if prototypes.ndim != 2 or prototypes.shape[0] < 2:
        raise ValueError(f"prototypes must have shape (K, D) with K >= 2, got {tuple(prototypes.shape)}")
    p = prototypes.detach().float() if prototypes.dtype != torch.float64 else prototypes.detach()
    if distance == "cosine":
        p = F.normalize(p, dim=-1)
    pairwise = torch.pdist(p)  # (K (K-1) / 2,)
    return {"min": pairwise.min(), "mean": pairwise.mean()}


def assignment_entropy(probs: Tensor) -> Tensor:
    """H(Q): the mean over tokens of the entropy (nats) of each token's assignment ``probs (..., K)``.

    0 for hard (one-hot) assignments, ``log K`` for uniform ones.
    """
    if probs.ndim == 0:
        raise ValueError("probs must have shape (..., K), got a scalar")
    flat = probs.detach().reshape(-1, probs.shape[-1])
    if flat.shape[0] == 0:
        return torch.zeros((), dtype=probs.dtype, device=probs.device)
    return -(torch.special.xlogy(flat, flat)).sum(-1).mean()
