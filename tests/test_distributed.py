"""Two CPU processes (gloo): codebook state stays identical across ranks and equals a one-process run."""

from __future__ import annotations

import os

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from helpers import exact_cdist, free_port

from softvq import DDCLQuantizer, HardVQ


def _data() -> torch.Tensor:
    return torch.randn(2, 3, 64, 4, generator=torch.Generator().manual_seed(0))  # (rank, step, token, D)


def _make_ema(dead_code_threshold: float = 0.3) -> HardVQ:
    torch.manual_seed(1)
    vq = HardVQ(16, 4, ema_decay=0.9, dead_code_threshold=dead_code_threshold)
    with torch.no_grad():
        vq.embedding.normal_()
        vq.ema_embed_sum.copy_(vq.embedding)
    return vq


def _worker(rank: int, world: int, port: int, results) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    try:
        data = _data()
        vq, plain = _make_ema(), _make_ema(dead_code_threshold=0.0)
        for step in range(3):
            torch.manual_seed(100 + rank)  # ranks draw different restart candidates: rank 0's must win
            vq(data[rank, step])
            plain(data[rank, step])
        ddcl = DDCLQuantizer(8, 4)
        torch.manual_seed(200 + rank)
        ddcl(data[rank, 0])  # data initialisation from each rank's own batch
        results[rank] = {"ema": vq.codebook.clone(), "size": vq.ema_cluster_size.clone(),
                         "plain": plain.codebook.clone(), "plain_size": plain.ema_cluster_size.clone(),
                         "ddcl": ddcl.prototypes.detach().clone()}
    finally:
        dist.destroy_process_group()


@pytest.fixture(scope="module")
def two_ranks():
    results = mp.Manager().dict()
    mp.spawn(_worker, args=(2, free_port(), results), nprocs=2, join=True)
    return dict(results)


def test_ema_codebook_identical_on_both_ranks(two_ranks):
    for key in ("ema", "size", "plain", "plain_size", "ddcl"):
        assert torch.equal(two_ranks[0][key], two_ranks[1][key]), key


def test_ema_over_two_ranks_equals_one_process_on_the_whole_batch(two_ranks):
    data = _data()
    single = _make_ema(dead_code_threshold=0.0)
    for step in range(3):
        single(torch.cat([data[0, step], data[1, step]]))  # what the two ranks saw together
    torch.testing.assert_close(two_ranks[0]["plain_size"], single.ema_cluster_size)
    torch.testing.assert_close(two_ranks[0]["plain"], single.codebook)
    assert not torch.equal(single.codebook, _make_ema().codebook)  # the EMA did move the codebook


def test_ddcl_data_init_comes_from_rank_zero(two_ranks):
    data = _data()
    rank0_tokens = data[0, 0]
    dist_to_rank0 = exact_cdist(two_ranks[1]["ddcl"], rank0_tokens)
    assert dist_to_rank0.min(1).values.max().item() == 0.0
