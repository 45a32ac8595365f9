"""The nearest code of every token in row blocks (softvq._kernels.nearest_codes): the brute-force argmin of the
squared distances, whatever the block size, with memory bounded by one block, and HardVQ built on it."""

from __future__ import annotations

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

import softvq
from softvq import _kernels
from softvq._kernels import max_rows, nearest_codes, squared_distances


def brute_force(z: torch.Tensor, codebook: torch.Tensor) -> torch.Tensor:
    """argmin_k ||z_n - e_k||^2 from the differences themselves, in float64 (no expansion, no blocks)."""
    return (z.double()[:, None, :] - codebook.double()[None]).square().sum(-1).argmin(1)


@pytest.mark.parametrize("rows", [1, 7, 16, 100, 1000])  # 7 and 100 do not divide N = 96 + 4; 1000 > N
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
def test_blocks_of_any_size_give_the_brute_force_nearest_code(rows, dtype):
    g = torch.Generator().manual_seed(0)
    z = torch.randn(100, 5, generator=g, dtype=torch.float64).to(dtype)
    codebook = torch.randn(37, 5, generator=g, dtype=torch.float64).to(dtype)
    got = nearest_codes(z, codebook, rows=rows)
    assert got.dtype == torch.int64 and got.shape == (100,)
    assert torch.equal(got, brute_force(z, codebook))
    assert torch.equal(got, max_rows(squared_distances(z, codebook), largest=False)[1])  # the unblocked computation


def test_a_tie_goes_to_the_first_code_in_every_block():
    codebook = torch.tensor([[1.0, 0.0], [0.0, 1.0], [1.0, 0.0]])  # codes 0 and 2 coincide
    z = torch.tensor([[2.0, 0.0], [0.0, 3.0], [0.9, 0.1]]).repeat(5, 1)
    assert nearest_codes(z, codebook, rows=2).tolist() == [0, 1, 0] * 5


class LargestTensor(TorchDispatchMode):
    """The largest number of elements of any tensor an operation creates while the mode is on."""

    def __init__(self) -> None:
        super().__init__()
        self.numel = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in out if isinstance(out, (tuple, list)) else (out,):
            if isinstance(t, torch.Tensor):
                self.numel = max(self.numel, t.numel())
        return out


def test_no_tensor_holds_more_than_one_block_of_scores():
    n, k, rows = 4096, 512, 64
    z, codebook = torch.randn(n, 8), torch.randn(k, 8)
    with LargestTensor() as blocked:
        nearest_codes(z, codebook, rows=rows)
    assert blocked.numel == rows * k  # the block buffer; the (N, K) scores would be 64 times that
    with LargestTensor() as whole:
        max_rows(squared_distances(z, codebook), largest=False)
    assert whole.numel == n * k  # the control: the unblocked computation does build them


def test_the_block_budget_sets_the_rows():
    cpu = torch.device("cpu")
    assert _kernels.block_rows(512, torch.float32, cpu) == _kernels.CPU_BLOCK_BYTES // (512 * 4)
    assert _kernels.block_rows(16384, torch.float64, cpu) == _kernels.CPU_BLOCK_BYTES // (16384 * 8)
    assert _kernels.block_rows(2**40, torch.float32, cpu) == 1


def test_hard_vq_in_small_blocks_trains_as_in_one(monkeypatch):
    """HardVQ with an EMA codebook, three training steps in float64, blocks of 7 rows against one block: the same
    indices, outputs, loss and state. (No restarts: they draw tokens with replacement, and two codes on one token tie
    to the last bit, which the blocks' matmuls may round otherwise: test_a_tie_goes_to_the_first_code_in_every_block
    covers exact ties.)"""
    runs = []
    for budget in (7 * 16 * 8, 2**30):  # 7 rows of K = 16 float64 scores; everything in one block
        monkeypatch.setattr(_kernels, "CPU_BLOCK_BYTES", budget)
        torch.manual_seed(0)
        layer = softvq.HardVQ(16, 4, ema_decay=0.99).double()
        outs = []
        for step in range(3):
            torch.manual_seed(10 + step)
            outs.append(layer(torch.randn(50, 4, dtype=torch.float64) * 2))
        runs.append((outs, layer.state_dict()))
    (a, state_a), (b, state_b) = runs
    for x, y in zip(a, b, strict=True):
        assert torch.equal(x.indices, y.indices)
        torch.testing.assert_close(x.quantized, y.quantized, rtol=0, atol=0)
        torch.testing.assert_close(x.loss, y.loss)
    for key, value in state_a.items():
        if isinstance(value, torch.Tensor):
            torch.testing.assert_close(value, state_b[key], msg=key)
