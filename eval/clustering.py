"""Scoring a clustering against reference classes: contingency table, Hungarian accuracy, cluster owners.

Clustering accuracy (ACC) is the share of points whose cluster maps to their class under the best one-to-one
map from clusters to classes (Hungarian algorithm on the contingency table; Kuhn 1955). With more clusters
than classes only as many clusters as classes are matched and the rest count as errors; :func:`cluster_owners`
gives the many-to-one (majority) map instead. The assignment step uses SciPy, imported only when called.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import Tensor


def _as_labels(name: str, labels: Tensor | Sequence[int]) -> Tensor:
    """``labels`` as a 1-D int64 CPU tensor of non-negative integers (numpy arrays and lists accepted)."""
    t = torch.as_tensor(labels).detach().cpu()
    if t.ndim != 1:
        raise ValueError(f"{name} must be 1-D, got shape {tuple(t.shape)}")
    if t.numel() == 0:
        return t.long()
    if t.is_floating_point() or t.is_complex() or t.dtype == torch.bool:
        raise ValueError(f"{name} must hold integers, got dtype {t.dtype}")
    if int(t.min()) < 0:
        raise ValueError(f"{name} must be non-negative, got minimum {int(t.min())}")
    return t.long()


def contingency_matrix(labels_true: Tensor | Sequence[int], labels_pred: Tensor | Sequence[int]) -> Tensor:
    """Counts ``C[k, c]`` of points in cluster ``k`` and class ``c``.

    Args:
        labels_true: ``(N,)`` reference classes, integers ``>= 0``.
        labels_pred: ``(N,)`` cluster indices, integers ``>= 0``.

    Returns:
        ``(max(labels_pred) + 1, max(labels_true) + 1)`` int64 tensor; rows are clusters, columns classes.

    Raises:
        ValueError: on non-1-D, non-integer or negative labels, different lengths, or no points.
    """
    y = _as_labels("labels_true", labels_true)
    p = _as_labels("labels_pred", labels_pred)
    if y.numel() != p.numel():
        raise ValueError(f"labels_true and labels_pred must have the same length, got {y.numel()} and {p.numel()}")
    if y.numel() == 0:
        raise ValueError("labels_true and labels_pred are empty: a clustering of no points has no accuracy")
    n_classes, n_clusters = int(y.max()) + 1, int(p.max()) + 1
    return torch.bincount(p * n_classes + y, minlength=n_clusters * n_classes).reshape(n_clusters, n_classes)


def clustering_accuracy(labels_true: Tensor | Sequence[int], labels_pred: Tensor | Sequence[int]) -> float:
    """ACC: the share of points on the diagonal of the contingency table under the best one-to-one matching.

    Invariant to renaming the clusters: a permutation of the true labels scores 1.0.

    Args:
        labels_true: ``(N,)`` reference classes, integers ``>= 0``.
        labels_pred: ``(N,)`` cluster indices, integers ``>= 0`` (any number of clusters).

    Returns:
        ACC in ``[0, 1]``.

    Raises:
        ImportError: when SciPy is missing.
        ValueError: as :func:`contingency_matrix`.
    """
    table = contingency_matrix(labels_true, labels_pred)
    try:
        from scipy.optimize import linear_sum_assignment
    except ImportError as err:  # pragma: no cover - depends on the environment
        raise ImportError("clustering_accuracy needs SciPy for the Hungarian matching: pip install scipy") from err
    rows, cols = linear_sum_assignment(table.numpy(), maximize=True)
    return float(table[torch.as_tensor(rows), torch.as_tensor(cols)].sum()) / float(table.sum())


def cluster_owners(labels_true: Tensor | Sequence[int], labels_pred: Tensor | Sequence[int],
                   num_clusters: int | None = None) -> Tensor:
    """The class that holds most of each cluster's points (the many-to-one map), ``-1`` for an empty cluster.

    Args:
        labels_true: ``(N,)`` reference classes.
        labels_pred: ``(N,)`` cluster indices.
        num_clusters: ``K``; clusters beyond ``max(labels_pred)`` (won by no point) are reported as empty.

    Returns:
        ``(K,)`` int64; ties go to the lower class index.
    """
    table = contingency_matrix(labels_true, labels_pred)
    k = table.shape[0] if num_clusters is None else num_clusters
    if k < table.shape[0]:
        raise ValueError(f"num_clusters={num_clusters} is smaller than the largest cluster index + 1 "
                         f"({table.shape[0]})")
    owners = torch.full((k,), -1, dtype=torch.long)
    won = table.sum(1) > 0
    owners[: table.shape[0]][won] = table[won].argmax(1)
    return owners
