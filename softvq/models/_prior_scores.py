"""A prior's scores in bits per code position: its NLL on code grids (:func:`evaluate_prior`) and the context-free
baselines a prior must beat (:func:`unigram_bits`, :func:`unigram_cross_entropy_bits`). Also importable from
:mod:`softvq.models.prior`.
"""

from __future__ import annotations

import math
from typing import NamedTuple

import torch
from torch import Tensor, nn

from softvq._checks import check_float, check_positive_int

LN2 = math.log(2.0)


class PriorEvaluation(NamedTuple):
    """What :func:`evaluate_prior` returns.

    Attributes:
        bits_per_position: mean NLL over every code position of every sequence, in bits.
        position_bits: ``(h, w)`` mean NLL in bits at each grid position.
        sequences: number of code grids evaluated.
    """

    bits_per_position: float
    position_bits: Tensor
    sequences: int


@torch.no_grad()
def evaluate_prior(prior: nn.Module, codes: Tensor, labels: Tensor | None = None,
                   batch_size: int = 500) -> PriorEvaluation:
    """The NLL of ``prior`` (a :class:`~softvq.models.CodePrior`) on code grids ``codes (N, h, w)`` (with
    ``labels (N,)`` if it is class-conditional), in eval mode, in bits per code position."""
    check_positive_int("batch_size", batch_size)
    if codes.shape[0] == 0:
        raise ValueError("no code grids to evaluate")
    was_training = prior.training
    prior.eval()
    total = torch.zeros(prior.config.length, dtype=torch.float64)
    try:
        for start in range(0, codes.shape[0], batch_size):
            chunk = codes[start:start + batch_size].to(prior.device)
            y = None if not prior.conditional else labels[start:start + batch_size].to(prior.device)
            total += prior.nll(chunk, y).double().sum(0).cpu()
    finally:
        prior.train(was_training)
    per_position = total / codes.shape[0] / LN2
    grid = per_position.reshape(prior.config.height, prior.config.width).float()
    return PriorEvaluation(float(per_position.mean()), grid, int(codes.shape[0]))


def unigram_bits(codes: Tensor, num_codes: int) -> float:
    """Entropy in bits of the empirical code distribution of ``codes`` (any shape): ``log2(perplexity)``. The NLL of
    a prior that knew these very frequencies and ignored context; what a context model must beat."""
    counts = torch.bincount(codes.reshape(-1).long(), minlength=num_codes).double()
    p = counts[counts > 0] / counts.sum()
    return float(-(p * p.log2()).sum())


def unigram_cross_entropy_bits(train: Tensor, test: Tensor, num_codes: int, pseudo_count: float = 0.5) -> float:
    """Bits per code of ``test`` under the code frequencies of ``train`` (add-``pseudo_count`` smoothing): the NLL of
    a context-free prior fitted on the training codes, a fair baseline for a prior's test NLL."""
    check_float("pseudo_count", pseudo_count)
    counts = torch.bincount(train.reshape(-1).long(), minlength=num_codes).double() + pseudo_count
    log_p = (counts / counts.sum()).log2()
    return float(-log_p[test.reshape(-1).long()].mean())
