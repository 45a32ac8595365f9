"""DDCLQuantizer(top_k=k): the Boltzmann distribution truncated to each token's k nearest prototypes, against a
brute-force truncated reference in float64 (outputs, every routed loss term, both gradients), the exact layer for
k >= K bit for bit, the bound the mass left out puts on the soft centroid, and what the forward pass saves for the
backward pass (measured with saved-tensor hooks)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from softvq import DDCLQuantizer


def truncated_brute_force(z, p, temperature, k, distance="euclidean"):
    """docs/design.md's layer written out literally on the distribution truncated to each row's k nearest prototypes
    (chosen on the detached distances: the choice is piecewise constant and has no gradient)."""
    if distance == "cosine":
        z, p = F.normalize(z, dim=-1), F.normalize(p, dim=-1)
    d = (z[:, None, :] - p[None, :, :]).square().sum(-1)  # (N, K)
    keep = torch.zeros_like(d, dtype=torch.bool).scatter_(1, d.detach().topk(k, dim=1, largest=False).indices, True)
    q = torch.softmax((-d / temperature).masked_fill(~keep, float("-inf")), dim=1)  # 0 off the top k
    mu = q @ p
    l_q = (q * d).sum(1).mean()
    l_ols = (z - mu).square().sum(1).mean()
    v = (q * (p[None, :, :] - mu[:, None, :]).square().sum(-1)).sum(1).mean()
    free_energy = (-temperature * torch.logsumexp((-d / temperature).masked_fill(~keep, float("-inf")), 1)).mean()
    return q, mu, {"l_q": l_q, "l_ols": l_ols, "v": v, "free_energy": free_energy}


@pytest.mark.parametrize("distance", ["euclidean", "cosine"])
@pytest.mark.parametrize("cb_term,cm_term", [("free_energy", "l_q"), ("l_q", "l_ols"), ("l_ols", "free_energy")])
def test_top_k_is_the_truncated_distribution_exactly_in_float64(distance, cb_term, cm_term):
    torch.manual_seed(0)
    k, temperature = 5, 0.7 if distance == "euclidean" else 0.2
    layer = DDCLQuantizer(16, 4, temperature, recipe="plain", top_k=k, distance=distance, init="normal",
                          codebook_term=cb_term, commitment_term=cm_term, commitment_weight=0.3).double()
    z = torch.randn(40, 4, dtype=torch.float64, requires_grad=True)
    g_mu, g_q = torch.randn(40, 4, dtype=torch.float64), torch.randn(40, 16, dtype=torch.float64)
    out = layer(z)
    ((out.quantized * g_mu).sum() + (out.probs * g_q).sum() + 2.0 * out.loss).backward()

    z_ref = z.detach().clone().requires_grad_(True)
    p_ref = layer.prototypes.detach().clone().requires_grad_(True)
    q, mu, terms = truncated_brute_force(z_ref, p_ref, temperature, k, distance)
    cb = truncated_brute_force(z_ref.detach(), p_ref, temperature, k, distance)[2][cb_term]  # reaches P only
    cm = truncated_brute_force(z_ref, p_ref.detach(), temperature, k, distance)[2][cm_term]  # reaches z only
    loss = (cb + 0.3 * cm) / 4
    ((mu * g_mu).sum() + (q * g_q).sum() + 2.0 * loss).backward()

    assert torch.equal(out.probs.count_nonzero(1), torch.full((40,), k))  # exactly k prototypes per token
    torch.testing.assert_close(out.probs, q.detach(), rtol=1e-12, atol=1e-15)
    torch.testing.assert_close(out.quantized, mu.detach(), rtol=1e-12, atol=1e-13)
    torch.testing.assert_close(out.loss, loss.detach(), rtol=1e-12, atol=1e-15)
    for name in ("l_q", "l_ols", "v"):  # L_q = L_OLS + V holds for the truncated distribution
        torch.testing.assert_close(out.terms[name], terms[name].detach(), rtol=1e-11, atol=1e-14)
    assert out.terms["identity_residual"] < 1e-12
    torch.testing.assert_close(z.grad, z_ref.grad, rtol=1e-9, atol=1e-12)
    torch.testing.assert_close(layer.prototypes.grad, p_ref.grad, rtol=1e-9, atol=1e-12)


@pytest.mark.parametrize("top_k", [24, 100])
def test_top_k_of_at_least_k_codes_is_the_exact_layer_bit_for_bit(top_k):
    """The defaults' layer (hard output, EMA prototypes, restarts, the entropy control) over 4 training steps and an
    evaluation: outputs, gradients and state equal to top_k=None's, bit for bit."""
    layers = []
    for k in (None, top_k):
        torch.manual_seed(0)
        layers.append(DDCLQuantizer(24, 6, top_k=k))
    exact, truncated = layers
    for step in range(5):
        grads, outs = [], []
        for layer in (exact, truncated):
            torch.manual_seed(step)
            z = (torch.randn(60, 6) * (1 + step)).requires_grad_(True)
            layer.train(step < 4)
            out = layer(z)
            (out.quantized.square().mean() + out.loss).backward()
            grads.append(z.grad)
            outs.append(out)
        for a, b in ((outs[0].quantized, outs[1].quantized), (outs[0].probs, outs[1].probs), (*grads,)):
            assert torch.equal(a, b)
    for (name, a), (_, b) in zip(exact.state_dict().items(), truncated.state_dict().items(), strict=True):
        assert torch.equal(a, b) if isinstance(a, torch.Tensor) else a == b, name


def test_the_soft_centroid_moves_at_most_the_mass_left_out_times_the_codebooks_diameter():
    """mu = (1 - m) mu_top + m mu_rest for the mass m left out, so |mu_top - mu| <= m diam(P): the bound that ties
    the mass measured in docs/scaling.md to the output's error."""
    torch.manual_seed(1)
    p = torch.randn(64, 8, dtype=torch.float64)
    z = torch.randn(500, 8, dtype=torch.float64)
    diameter = torch.cdist(p, p).max()
    q_exact = torch.softmax(-torch.cdist(z, p).square() / 3.0, dim=1)
    mu_exact = q_exact @ p
    for k in (1, 4, 16, 48):
        layer = DDCLQuantizer(64, 8, 3.0, recipe="plain", init="normal", top_k=k).double()
        with torch.no_grad():
            layer.prototypes.copy_(p)
            mu = layer(z).quantized
        mass_out = 1 - q_exact.topk(k, dim=1).values.sum(1)
        error = (mu - mu_exact).norm(dim=1)
        assert (error <= mass_out * diameter + 1e-12).all()
        assert error.max() > 0.01 * (mass_out * diameter).max()  # the bound is not vacuous here


def _saved_bytes(layer: DDCLQuantizer, z: torch.Tensor) -> list[int]:
    """Element counts of every tensor autograd saves in one training step's forward pass."""
    sizes: list[int] = []

    def pack(t: torch.Tensor) -> torch.Tensor:
        sizes.append(t.numel())
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = layer(z.clone().requires_grad_(True))
    del out
    return sizes


def test_the_backward_pass_keeps_n_by_k_assignments_not_n_by_k_codes():
    n, num_codes, dim, k = 2048, 1024, 8, 32
    z = torch.randn(n, dim)
    torch.manual_seed(0)
    exact = _saved_bytes(DDCLQuantizer(num_codes, dim), z)
    torch.manual_seed(0)
    truncated = _saved_bytes(DDCLQuantizer(num_codes, dim, top_k=k), z)
    assert max(exact) >= n * num_codes  # the exact layer keeps its (N, K) assignments
    assert max(truncated) == max(n * k, n * dim)  # top-k keeps nothing larger than (N, k) or the (N, D) tokens
    # the (N, K) assignments replaced by at most three (N, k) arrays: the values, the prototypes they refer to, and
    # that index again where the dense probs are scattered from it
    assert sum(truncated) <= sum(exact) - n * num_codes + 3 * n * k


@pytest.mark.parametrize("bad", [0, -3, 2.5, True])
def test_top_k_must_be_a_positive_integer(bad):
    with pytest.raises((ValueError, TypeError), match="top_k"):
        DDCLQuantizer(16, 4, top_k=bad)
