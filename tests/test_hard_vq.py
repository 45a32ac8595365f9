"""HardVQ against brute-force nearest codes and hand-computed EMA updates."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from helpers import exact_cdist

from softvq import HardVQ
from softvq.parts import Restart


@pytest.mark.parametrize("shape", [(13, 6), (2, 5, 6), (2, 3, 4, 6)])
@pytest.mark.parametrize("ema_decay", [None, 0.9])
def test_forward_is_nearest_code(shape, ema_decay):
    torch.manual_seed(0)
    vq = HardVQ(20, 6, ema_decay=ema_decay).eval()
    with torch.no_grad():
        vq.prototypes.normal_()
    z = torch.randn(shape)
    out = vq(z)
    flat = z.reshape(-1, 6)
    expected = exact_cdist(flat, vq.codebook).argmin(1)
    assert torch.equal(out.indices.reshape(-1), expected)
    assert out.indices.shape == shape[:-1] and out.indices.dtype == torch.int64
    torch.testing.assert_close(out.quantized.reshape(-1, 6), vq.codebook[expected])
    # one-hot without the (N, K) array: ones on the codes prob_codes, the dense one-hot where asked for
    assert out.probs.shape == out.prob_codes.shape == (*shape[:-1], 1)
    assert torch.equal(out.probs, torch.ones_like(out.probs))
    assert torch.equal(out.prob_codes[..., 0], out.indices)
    assert torch.equal(out.dense_probs(20), F.one_hot(out.indices, 20).float())
    torch.testing.assert_close(vq.decode_indices(out.indices), out.quantized)
    per_token = (flat - vq.codebook[expected]).square().sum(1).mean()
    torch.testing.assert_close(out.terms["l_q"], per_token)
    torch.testing.assert_close(out.terms["commitment"], per_token / 6)
    assert out.terms["v"].item() == 0.0


def test_straight_through_passes_output_gradient_to_z():
    torch.manual_seed(1)
    vq = HardVQ(8, 4)
    z = torch.randn(10, 4, requires_grad=True)
    g = torch.randn(10, 4)
    (vq(z).quantized * g).sum().backward()
    torch.testing.assert_close(z.grad, g, rtol=0, atol=0)


def test_loss_is_codebook_plus_weighted_commitment():
    torch.manual_seed(2)
    vq = HardVQ(8, 4, commitment_weight=0.25)
    z = torch.randn(10, 4, requires_grad=True)
    out = vq(z)
    codes = vq.codebook[out.indices]
    mse = (z.detach() - codes).square().mean()
    torch.testing.assert_close(out.loss, 1.25 * mse)
    out.loss.backward()
    # d/dz of commitment_weight * mse(z, sg e) and d/de of mse(e, sg z), element means
    torch.testing.assert_close(z.grad, 0.25 * 2 * (z.detach() - codes) / z.numel())
    expected_codebook_grad = torch.zeros(8, 4).index_add_(0, out.indices, 2 * (codes - z.detach()) / z.numel())
    torch.testing.assert_close(vq.prototypes.grad, expected_codebook_grad)


def test_ema_update_matches_hand_computation_and_only_in_training():
    vq = HardVQ(2, 1, ema_decay=0.5, epsilon=1e-5)
    with torch.no_grad():
        vq.prototypes.copy_(torch.tensor([[0.0], [10.0]]))
        vq.ema.weighted_sum.copy_(vq.prototypes)
    z = torch.tensor([[1.0], [2.0], [3.0]])  # all nearest to code 0

    vq.eval()
    vq(z)
    assert torch.equal(vq.codebook, torch.tensor([[0.0], [10.0]]))  # evaluation leaves the codebook alone

    vq.train()
    vq(z)
    # cluster sizes: 0.5 * [1, 1] + 0.5 * [3, 0] = [2, 0.5]; sums: 0.5 * [0, 10] + 0.5 * [6, 0] = [3, 5]
    size = torch.tensor([2.0, 0.5])
    n = size.sum()
    smoothed = (size + 1e-5) / (n + 2e-5) * n
    torch.testing.assert_close(vq.codebook[0, 0], 3.0 / smoothed[0])
    assert vq.codebook[1, 0] == 10.0  # code 1 won no token: it stays where it was (not 5 / 0.5)
    assert vq.prototypes.grad is None and not vq.prototypes.requires_grad


def test_dead_code_is_restarted_from_batch_vectors():
    torch.manual_seed(3)
    vq = HardVQ(4, 2, ema_decay=0.9, restart=Restart(0.5, decay=0.9, cap=None))
    with torch.no_grad():
        vq.prototypes.copy_(torch.tensor([[0.0, 0.0], [1.0, 0.0], [0.0, 1.0], [1e3, 1e3]]))  # code 3 far away
        vq.ema.weighted_sum.copy_(vq.prototypes)
        vq.ema.mass.fill_(10.0)
        vq.dead_codes.usage.fill_(10.0)
        vq.dead_codes.usage[3] = 0.0  # code 3 has not been used for a while
    z = torch.rand(32, 2)
    vq.train()
    vq(z)
    restarted = vq.codebook[3]
    assert exact_cdist(restarted[None], z).min().item() == 0.0  # it is now one of the batch's vectors
    assert vq.dead_codes.usage[3].item() == 0.5
    torch.testing.assert_close(vq.ema.weighted_sum[3], restarted * 0.5)


def test_dead_code_restart_without_ema():
    torch.manual_seed(4)
    vq = HardVQ(3, 2, restart=Restart(1.0, decay=0.99, cap=None))
    with torch.no_grad():
        vq.prototypes.copy_(torch.tensor([[0.0, 0.0], [5.0, 5.0], [-5.0, -5.0]]))
    z = torch.rand(16, 2) * 0.1
    vq(z)  # all tokens go to code 0: codes 1, 2 fall under the threshold
    assert exact_cdist(vq.codebook[1:], z).min(1).values.max().item() == 0.0


def test_empty_batch_and_bad_input():
    vq = HardVQ(5, 3)
    out = vq(torch.empty(0, 3))
    assert out.quantized.shape == (0, 3) and out.indices.shape == (0,) and out.probs.shape == (0, 5)
    out.loss.backward()
    with pytest.raises(ValueError, match=r"\(\.\.\., 3\)"):
        vq(torch.randn(4, 2))
    with pytest.raises(ValueError, match="non-finite"):
        vq(torch.tensor([[float("nan"), 0.0, 0.0]]))


@pytest.mark.parametrize(
    "kwargs,match",
    [({"num_codes": 0}, "num_codes"), ({"dim": -1}, "dim"), ({"commitment_weight": -1.0}, "commitment_weight"),
     ({"ema_decay": 1.0}, "ema_decay"), ({"ema_decay": 0.0}, "ema_decay"),
     ({"restart": {"threshold": -2.0}}, r"restart\.threshold"), ({"epsilon": 0.0}, "epsilon")],
)
def test_invalid_hyperparameters_raise(kwargs, match):
    with pytest.raises(ValueError, match=match):
        HardVQ(**{"num_codes": 8, "dim": 4, **kwargs})


def test_live_codes_are_never_restarted():
    """Every code gets 8 of the 32 tokens of every batch, twice the threshold: none may be restarted, from the first
    step on (a usage average starting at 0 read 0.08 after step 1 and restarted all four)."""
    torch.manual_seed(0)
    centres = torch.tensor([[0.0, 0.0], [4.0, 0.0], [0.0, 4.0], [4.0, 4.0]])
    vq = HardVQ(4, 2, restart=Restart(4.0, decay=0.99, cap=None)).train()
    with torch.no_grad():
        vq.prototypes.copy_(centres)
    for _ in range(5):
        z = (centres.repeat_interleave(8, 0) + 0.1 * torch.randn(32, 2))[torch.randperm(32)]
        assert torch.equal(vq(z).indices.bincount(minlength=4), torch.full((4,), 8))
        assert torch.equal(vq.codebook, centres)  # no gradient step here: only a restart could move a code
    assert vq.dead_codes.usage.tolist() == [8.0] * 4  # started from the first batch's counts, not from 0


def test_restarts_count_the_codes_moved():
    torch.manual_seed(0)
    vq = HardVQ(8, 2, ema_decay=0.9, restart=Restart(0.5, decay=0.9, cap=None))
    with torch.no_grad():
        vq.prototypes.copy_(torch.arange(16.0).reshape(8, 2))  # codes 0..7 along a line
    z = torch.tensor([[0.0, 1.0], [2.0, 3.0]]).repeat(8, 1)  # every token on code 0 or 1
    vq(z)  # the first batch sets the usage: codes 2..7 won nothing
    assert vq.restarts == 6
    before = vq.restarts
    vq.eval()(z)
    assert vq.restarts == before  # evaluation restarts nothing
