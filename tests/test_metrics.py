"""Codebook-health metrics against hand-computed values."""

from __future__ import annotations

import math
import os

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from helpers import free_port

from softvq import CodebookUsage, assignment_entropy, codebook_usage, prototype_separation


def test_hand_made_counts():
    usage = CodebookUsage(num_codes=5)
    usage.update(torch.tensor([0, 0, 1]))
    usage.update(torch.tensor([[3]]))  # any shape; accumulates across updates
    out = usage.compute()
    # usage shares (1/2, 1/4, 0, 1/4, 0): H = 1.5 ln 2, perplexity 2^1.5
    assert out["utilization"].item() == pytest.approx(3 / 5)
    assert out["dead_codes"].item() == 2
    assert out["perplexity"].item() == pytest.approx(2**1.5, rel=1e-12)
    assert "soft_perplexity" not in out


def test_uniform_usage_has_perplexity_k_and_soft_perplexity():
    k = 8
    usage = CodebookUsage(num_codes=k)
    probs = torch.full((2, 8, k), 1.0 / k)
    usage.update(torch.arange(16).reshape(2, 8) % k, probs)
    out = usage.compute()
    assert out["utilization"].item() == 1.0 and out["dead_codes"].item() == 0
    assert out["perplexity"].item() == pytest.approx(k)
    assert out["soft_perplexity"].item() == pytest.approx(k, rel=1e-6)


def test_soft_perplexity_hand_computed():
    probs = torch.tensor([[0.5, 0.5, 0.0], [0.5, 0.0, 0.5]])  # mass (1, 0.5, 0.5) -> shares (1/2, 1/4, 1/4)
    out = codebook_usage(torch.tensor([0, 0]), 3, probs)
    assert out["soft_perplexity"].item() == pytest.approx(2**1.5, rel=1e-6)
    assert out["perplexity"].item() == pytest.approx(1.0)
    assert out["dead_codes"].item() == 2


def test_functional_matches_metric_and_reset():
    torch.manual_seed(0)
    idx = torch.randint(0, 16, (4, 50))
    metric = CodebookUsage(16)
    for row in idx:
        metric.update(row)
    for key, value in codebook_usage(idx, 16).items():
        torch.testing.assert_close(metric.compute()[key], value)
    metric.reset()
    metric.update(torch.tensor([1]))
    assert metric.compute()["dead_codes"].item() == 15


def test_no_tokens_gives_nan_perplexity():
    out = codebook_usage(torch.empty(0, dtype=torch.long), 4)
    assert out["utilization"].item() == 0 and out["dead_codes"].item() == 4
    assert math.isnan(out["perplexity"].item())


def test_bad_indices_and_probs_raise():
    usage = CodebookUsage(4)
    with pytest.raises(ValueError, match=r"\[0, 4\).*\[0, 4\]"):
        usage.update(torch.tensor([0, 4]))
    with pytest.raises(ValueError, match="-1"):
        usage.update(torch.tensor([-1]))
    with pytest.raises(ValueError, match="integer"):
        usage.update(torch.tensor([0.0]))
    with pytest.raises(ValueError, match="probs"):
        usage.update(torch.tensor([0, 1]), torch.ones(2, 3))
    with pytest.raises(ValueError, match="num_codes"):
        CodebookUsage(0)


def test_prototype_separation_unit_square():
    corners = torch.tensor([[0.0, 0.0], [1.0, 0.0], [0.0, 1.0], [1.0, 1.0]])
    sep = prototype_separation(corners)
    assert sep["min"].item() == pytest.approx(1.0)
    assert sep["mean"].item() == pytest.approx((4 + 2 * math.sqrt(2)) / 6)
    # cosine: normalised first, so scaling a prototype changes nothing
    scaled = corners[1:] * torch.tensor([[3.0], [0.5], [2.0]])
    cos = prototype_separation(scaled, distance="cosine")
    assert cos["min"].item() == pytest.approx(math.sqrt(2 - math.sqrt(2)))  # 45 degrees apart
    with pytest.raises(ValueError, match="K >= 2"):
        prototype_separation(torch.zeros(1, 3))


def test_assignment_entropy_known_cases():
    k = 6
    assert assignment_entropy(torch.full((3, 4, k), 1 / k)).item() == pytest.approx(math.log(k))
    assert assignment_entropy(torch.eye(k)).item() == 0.0
    two = torch.tensor([[0.5, 0.5, 0.0], [1.0, 0.0, 0.0]])
    assert assignment_entropy(two).item() == pytest.approx(math.log(2) / 2)


def _ddp_worker(rank: int, world: int, port: int, results) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    try:
        metric = CodebookUsage(6)
        shard = [torch.tensor([0, 0, 1]), torch.tensor([1, 3])][rank]  # together: codes 0, 1, 3 used
        metric.update(shard)
        results[rank] = {k: float(v) for k, v in metric.compute().items()}
    finally:
        dist.destroy_process_group()


def test_counts_sum_across_processes():
    results = mp.Manager().dict()
    mp.spawn(_ddp_worker, args=(2, free_port(), results), nprocs=2, join=True)
    expected = {k: float(v) for k, v in codebook_usage(torch.tensor([0, 0, 1, 1, 3]), 6).items()}
    assert results[0] == pytest.approx(expected) and results[1] == pytest.approx(expected)
    assert expected["dead_codes"] == 3
