"""eval.neighbour's NeighbourDDCL (the per-second candidates ddcl_n16 / ddcl_n32): each token's distribution truncated
to the codes listed for its nearest code, against a brute-force float64 reference with the same set (outputs, loss
terms, both gradients); the lists against brute-force distances, their round-robin refresh, and a duplicate prototype
that cannot push a code out of its own list."""

from __future__ import annotations

import pytest
import torch

from eval import harness
from eval.neighbour import NeighbourDDCL
from softvq.parts import Commitment, Gradient


def brute_force_lists(p, r):
    """Row c: c, then its r - 1 nearest other codes (squared distances written out; no tie in random data)."""
    d = (p[:, None, :] - p[None, :, :]).square().sum(-1)
    d.fill_diagonal_(-1.0)
    return d.topk(r, dim=1, largest=False).indices


def neighbour_brute_force(z, p, temperature, lists, r):
    """docs/design.md's layer written out on the distribution truncated to the r nearest of the list of each token's
    nearest code."""
    d = (z[:, None, :] - p[None, :, :]).square().sum(-1)  # (N, K)
    rows = lists[d.detach().argmin(1)]  # (N, R): the set is piecewise constant and has no gradient
    rows = rows.gather(1, d.detach().gather(1, rows).topk(r, dim=1, largest=False).indices)
    keep = torch.zeros_like(d, dtype=torch.bool).scatter_(1, rows, True)
    q = torch.softmax((-d / temperature).masked_fill(~keep, float("-inf")), dim=1)
    mu = q @ p
    l_q = (q * d).sum(1).mean()
    l_ols = (z - mu).square().sum(1).mean()
    v = (q * (p[None, :, :] - mu[:, None, :]).square().sum(-1)).sum(1).mean()
    return q, mu, {"l_q": l_q, "l_ols": l_ols, "v": v}


@pytest.mark.parametrize("cb_term,cm_term,width", [("l_q", "l_ols", 5), ("l_ols", "l_q", 5), ("l_q", "l_ols", 9)])
def test_the_neighbour_truncation_is_the_stated_distribution_exactly_in_float64(cb_term, cm_term, width):
    torch.manual_seed(0)
    r, temperature = 5, 0.7
    layer = NeighbourDDCL(16, 4, neighbours=r, candidates=width, temperature=temperature, target_entropy=None,
                          recipe="plain", init="normal", prototype_update=Gradient(cb_term),
                          commitment_weight=Commitment(0.3, cm_term)).double()
    z = torch.randn(40, 4, dtype=torch.float64, requires_grad=True)
    g_mu, g_q = torch.randn(40, 4, dtype=torch.float64), torch.randn(40, 16, dtype=torch.float64)
    out = layer(z)
    dense = out.dense_probs(16)
    ((out.quantized * g_mu).sum() + (dense * g_q).sum() + 2.0 * out.loss).backward()

    lists = brute_force_lists(layer.prototypes.detach(), width)
    assert torch.equal(layer.neighbour_index[:, 0], torch.arange(16))  # each code first in its own list
    assert torch.equal(layer.neighbour_index.sort(1).values, lists.sort(1).values)
    z_ref = z.detach().clone().requires_grad_(True)
    p_ref = layer.prototypes.detach().clone().requires_grad_(True)
    q, mu, terms = neighbour_brute_force(z_ref, p_ref, temperature, lists, r)
    cb = neighbour_brute_force(z_ref.detach(), p_ref, temperature, lists, r)[2][cb_term]  # reaches P only
    cm = neighbour_brute_force(z_ref, p_ref.detach(), temperature, lists, r)[2][cm_term]  # reaches z only
    ((mu * g_mu).sum() + (q * g_q).sum() + 2.0 * (cb + 0.3 * cm) / 4).backward()

    nearest = (z.detach()[:, None] - layer.prototypes.detach()[None]).square().sum(-1).argmin(1)
    assert torch.equal(out.indices, nearest)
    torch.testing.assert_close(dense, q.detach(), rtol=1e-12, atol=1e-15)
    torch.testing.assert_close(out.quantized, mu.detach(), rtol=1e-12, atol=1e-13)
    for name in ("l_q", "l_ols", "v"):  # L_q = L_OLS + V holds for the stated distribution
        torch.testing.assert_close(out.terms[name], terms[name].detach(), rtol=1e-11, atol=1e-14)
    assert out.terms["identity_residual"] < 1e-12
    torch.testing.assert_close(z.grad, z_ref.grad, rtol=1e-9, atol=1e-12)
    torch.testing.assert_close(layer.prototypes.grad, p_ref.grad, rtol=1e-9, atol=1e-12)


def test_lists_refresh_round_robin_and_always_hold_their_own_code():
    torch.manual_seed(0)
    layer = NeighbourDDCL(64, 4, neighbours=4, refresh_every=8, init="normal")
    p = torch.randn(64, 4)
    p[7] = p[3]  # a duplicate: code 3 and code 7 tie at distance 0
    p[11] = p[3]
    layer.refresh(p)  # every list, the first time
    assert torch.equal(layer.neighbour_index[:, 0], torch.arange(64))
    for code in (3, 7, 11):
        assert set(layer.neighbour_index[code, :3].tolist()) == {3, 7, 11}
    stale = layer.neighbour_index.clone()
    moved = p.flip(0)  # every code moves: the next step refreshes codes 0-7 only, the one after 8-15
    layer.refresh(moved)
    fresh = brute_force_lists(moved, 4)
    assert torch.equal(layer.neighbour_index[:8].sort(1).values, fresh[:8].sort(1).values)
    assert torch.equal(layer.neighbour_index[8:], stale[8:])
    layer.refresh(moved)
    assert torch.equal(layer.neighbour_index[8:16].sort(1).values, fresh[8:16].sort(1).values)
    capped = NeighbourDDCL(64, 4, neighbours=4, refresh_every=8, max_refresh=3, init="normal")
    capped.refresh(p)
    capped.refresh(moved)  # 3 codes a step, not 64 / 8
    assert torch.equal(capped.neighbour_index[:3].sort(1).values, fresh[:3].sort(1).values)
    assert not torch.equal(capped.neighbour_index[3:8].sort(1).values, fresh[3:8].sort(1).values)
    with pytest.raises(ValueError, match="refresh_every.*0"):
        NeighbourDDCL(64, 4, refresh_every=0)
    with pytest.raises(ValueError, match="max_refresh.*0"):
        NeighbourDDCL(64, 4, max_refresh=0)


def test_harness_builds_the_candidates_with_the_truncated_layers_targets():
    for method, r, width in (("ddcl_n16", 16, 16), ("ddcl_n32", 32, 32), ("ddcl_c16", 16, 64)):
        layer = harness.build(method, 512, 8)
        assert layer.neighbours == layer.top_k == r and layer.neighbour_index.shape == (512, width)
        assert layer.target_entropy == pytest.approx(harness.truncated_target(r, 512))
    assert harness.build("ddcl_n32", 64, 8).neighbours == 16  # at most K / 4
    layer = harness.build("ddcl_c16", 256, 8)
    out = layer(torch.randn(2, 300, 8))
    assert out.probs.shape == (2, 300, 16) and out.terms["identity_residual"] < 1e-4
    layer.eval()
    evaluated = layer(torch.randn(2, 30, 8))  # evaluation: the parent's top_k = r over each token's own nearest
    assert evaluated.probs.shape == (2, 30, 16)
