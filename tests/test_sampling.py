"""GlobalBatchSampler against hand-built references: slices of one permutation per (seed, epoch)."""

from __future__ import annotations

import pytest
import torch
from torch.utils.data import DataLoader

from softvq.data import GlobalBatchSampler


def batches(n, batch_size, world, rank, **kw) -> list[list[int]]:
    sampler = GlobalBatchSampler(n, batch_size, num_replicas=world, rank=rank, **kw)
    loader = DataLoader(list(range(n)), batch_size=batch_size, sampler=sampler)
    out = [b.tolist() for b in loader]
    assert sum(map(len, out)) == len(sampler)
    return out


def test_known_small_case_without_shuffle():
    assert batches(10, 2, 2, 0) == [[0, 1], [4, 5], [8]]
    assert batches(10, 2, 2, 1) == [[2, 3], [6, 7], [9]]
    assert batches(10, 2, 2, 1, drop_last=True) == [[2, 3], [6, 7]]
    assert batches(9, 2, 4, 3) == [[6, 7]]  # the last global batch (one index) goes to rank 0 alone
    assert batches(9, 2, 4, 0) == [[0, 1], [8]]


@pytest.mark.parametrize("n, batch_size, world", [(64, 8, 2), (70, 4, 3), (5, 4, 2)])
def test_processes_together_read_the_one_process_batches(n, batch_size, world):
    single = batches(n, batch_size * world, 1, 0, shuffle=True, seed=3)
    ranks = [batches(n, batch_size, world, r, shuffle=True, seed=3) for r in range(world)]
    for step, expected in enumerate(single):
        together = [i for r in range(world) if step < len(ranks[r]) for i in ranks[r][step]]
        assert together == expected  # rank order = the one-process batch's order
    assert sorted(i for r in ranks for b in r for i in b) == list(range(n))  # every index exactly once


def test_order_depends_on_seed_and_epoch_only():
    sampler = GlobalBatchSampler(50, 5, shuffle=True, seed=7)
    first = list(sampler)
    torch.manual_seed(123)  # the global random state plays no part
    assert list(sampler) == first
    assert first == torch.randperm(50, generator=torch.Generator().manual_seed(7)).tolist()
    sampler.set_epoch(1)
    assert list(sampler) == torch.randperm(50, generator=torch.Generator().manual_seed(8)).tolist() != first


@pytest.mark.parametrize("kwargs, match", [
    ({"n": 10, "batch_size": 0}, "batch_size must be a positive integer, got 0"),
    ({"n": -1, "batch_size": 2}, "n must be a non-negative integer, got -1"),
    ({"n": 10, "batch_size": 2, "num_replicas": 2, "rank": 2}, r"rank must be in \[0, 2\), got 2"),
])
def test_invalid_arguments(kwargs, match):
    with pytest.raises(ValueError, match=match):
        GlobalBatchSampler(**kwargs)
