"""DDCLQuantizer(top_k=k): the Boltzmann distribution truncated to each token's k nearest prototypes, against a
brute-force truncated reference in float64 (outputs, every routed loss term, both gradients), the exact layer for
k >= K bit for bit, the bound the mass left out puts on the soft centroid, what the forward pass saves for the
backward pass (measured with saved-tensor hooks), and the (N, k) probs the metrics read without a dense (N, K)."""

from __future__ import annotations

import warnings

import pytest
import torch
import torch.nn.functional as F

from softvq import CodebookUsage, DDCLQuantizer, DDCLReadout, HierarchicalDDCL, ResidualDDCL, codebook_usage
from softvq.models import VQVAE
from softvq.parts import Commitment, Gradient


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
    check_against_brute_force(distance, cb_term, cm_term, k=5)


def test_top_k_of_all_codes_but_one_is_the_truncated_distribution_not_the_exact_layer():
    """k = K - 1, the largest k that truncates: each token's farthest prototype gets no mass (an off-by-one in the
    choice between the truncated and the exact path would give it some)."""
    check_against_brute_force("euclidean", "free_energy", "l_q", k=15)


def check_against_brute_force(distance: str, cb_term: str, cm_term: str, k: int) -> None:
    """``DDCLQuantizer(16, 4, top_k=k)``'s outputs, loss terms and gradients against :func:`truncated_brute_force`."""
    torch.manual_seed(0)
    temperature = 0.7 if distance == "euclidean" else 0.2
    layer = DDCLQuantizer(16, 4, temperature, recipe="plain", top_k=k, distance=distance, init="normal",
                          prototype_update=Gradient(cb_term), commitment_weight=Commitment(0.3, cm_term)).double()
    z = torch.randn(40, 4, dtype=torch.float64, requires_grad=True)
    g_mu, g_q = torch.randn(40, 4, dtype=torch.float64), torch.randn(40, 16, dtype=torch.float64)
    out = layer(z)
    dense = out.dense_probs(16)  # probs are (40, k), of the codes prob_codes
    ((out.quantized * g_mu).sum() + (dense * g_q).sum() + 2.0 * out.loss).backward()

    z_ref = z.detach().clone().requires_grad_(True)
    p_ref = layer.prototypes.detach().clone().requires_grad_(True)
    q, mu, terms = truncated_brute_force(z_ref, p_ref, temperature, k, distance)
    cb = truncated_brute_force(z_ref.detach(), p_ref, temperature, k, distance)[2][cb_term]  # reaches P only
    cm = truncated_brute_force(z_ref, p_ref.detach(), temperature, k, distance)[2][cm_term]  # reaches z only
    loss = (cb + 0.3 * cm) / 4
    ((mu * g_mu).sum() + (q * g_q).sum() + 2.0 * loss).backward()

    assert out.probs.shape == out.prob_codes.shape == (40, k)
    assert torch.equal(dense.count_nonzero(1), torch.full((40,), k))  # exactly k prototypes per token
    torch.testing.assert_close(dense, q.detach(), rtol=1e-12, atol=1e-15)  # the k nearest, with their mass
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
        if name == "_extra_state":  # the recorded settings name top_k itself; everything else is equal
            assert a["settings"]["top_k"] is None and b["settings"]["top_k"] == top_k
            a, b = ({k: v for k, v in s.items() if k != "settings"} for s in (a, b))
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
    # the (N, K) assignments replaced by two (N, k) arrays: the values and the prototypes they refer to (the probs
    # stay (N, k): no scatter into a dense array saves the index a third time)
    assert sum(truncated) <= sum(exact) - n * num_codes + 2 * n * k


def test_top_k_probs_feed_the_usage_metrics_as_the_dense_ones_do_and_vqvae_logs_them():
    """The soft usage of top-k assignments, summed by code, equals the dense (N, K) array's; the VQ-VAE's training
    metrics read them without building it; and dense_probs refuses to guess K."""
    torch.manual_seed(0)
    layer = DDCLQuantizer(64, 8, top_k=6)
    out = layer(torch.randn(3, 50, 8))
    assert out.probs.shape == (3, 50, 6) and out.prob_codes.shape == (3, 50, 6)
    dense = out.dense_probs(64)
    assert dense.shape == (3, 50, 64)
    torch.testing.assert_close(dense.sum(-1), torch.ones(3, 50))
    assert torch.equal(dense.argmax(-1), out.indices)
    sparse_usage, dense_usage = CodebookUsage(64), CodebookUsage(64)
    sparse_usage.update(out.indices, out.probs, out.prob_codes)
    dense_usage.update(out.indices, dense)
    torch.testing.assert_close(sparse_usage.soft_mass, dense_usage.soft_mass, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(sparse_usage.compute()["soft_perplexity"], dense_usage.compute()["soft_perplexity"])
    with pytest.raises(ValueError, match="num_codes"):
        out.dense_probs()
    with pytest.raises(ValueError, match="prob_codes must have the shape"):
        sparse_usage.update(out.indices, out.probs, out.prob_codes[..., :5])
    with pytest.raises(ValueError, match=r"\[0, 64\)"):
        sparse_usage.update(out.indices, out.probs, out.prob_codes + 60)
    with pytest.raises(ValueError, match="without the probs"):
        sparse_usage.update(out.indices, None, out.prob_codes)
    exact = DDCLQuantizer(64, 8, top_k=64)(torch.randn(5, 8))
    assert exact.prob_codes is None and exact.dense_probs() is exact.probs  # k >= K: the exact layer, dense

    torch.manual_seed(1)
    model = VQVAE("ddcl", num_codes=32, code_dim=8, width=16, res_blocks=1, res_hidden=8,
                  quantizer_kwargs={"top_k": 4})
    seen = []
    model.quantizer.register_forward_hook(lambda module, args, output: seen.append(output))
    with warnings.catch_warnings():  # self.log without a trainer
        warnings.simplefilter("ignore")
        model.training_step((torch.rand(2, 3, 32, 32), torch.zeros(2)), 0)
    reference = codebook_usage(seen[0].indices, 32, seen[0].dense_probs(32))
    logged = model.train_usage.compute()
    for key in ("soft_perplexity", "perplexity", "utilization"):
        torch.testing.assert_close(logged[key], reference[key])


def test_the_stacks_and_the_readout_give_dense_probs_of_top_k_levels():
    """Residual and hierarchical stacks and the readout keep their documented dense (..., K) assignments when their
    DDCL layers use top-k: each the scatter of that layer's (..., k) ones."""
    torch.manual_seed(0)
    residual = ResidualDDCL(2, 32, 8, top_k=5)
    out = residual(torch.randn(40, 8))
    assert out.probs.shape == (40, 2, 32) and out.prob_codes is None
    assert torch.equal(out.probs.count_nonzero(-1), torch.full((40, 2), 5))
    torch.testing.assert_close(out.probs.sum(-1), torch.ones(40, 2))
    hierarchy = HierarchicalDDCL([32, 16], 8, pool=2, top_k=5)
    grids = hierarchy(torch.randn(2, 4, 4, 8))
    assert [tuple(p.shape) for p in grids.probs] == [(2, 4, 4, 32), (2, 2, 2, 16)]
    assert all(torch.equal(p.count_nonzero(-1), torch.full(p.shape[:-1], 5)) for p in grids.probs)
    readout = DDCLReadout(32, 8, top_k=5)
    pooled = readout(torch.randn(3, 7, 8))
    assert pooled.assignments.shape == (3, 7, 32)
    assert torch.equal(pooled.assignments.count_nonzero(-1), torch.full((3, 7), 5))


@pytest.mark.parametrize("bad", [0, -3, 2.5, True])
def test_top_k_must_be_a_positive_integer(bad):
    with pytest.raises((ValueError, TypeError), match="top_k"):
        DDCLQuantizer(16, 4, top_k=bad)


def test_soft_ema_prototypes_under_top_k_weigh_each_code_by_its_top_k_mass():
    """The soft-EMA M-step reads every code's column of the assignments: under top-k, the (N, k) ones scattered to
    their codes, so each code's EMA mass moves by the sum of the probs the layer returned for it."""
    torch.manual_seed(0)
    layer = DDCLQuantizer(16, 4, prototype_update="soft_ema", top_k=5, restart=None, init="normal")
    layer(torch.randn(30, 4))  # the first batch initialises what it needs
    before = layer.ema.mass.clone()
    out = layer(torch.randn(30, 4))
    mass = torch.zeros(16, dtype=torch.float64).index_put_((out.prob_codes.reshape(-1),),
                                                           out.probs.detach().reshape(-1).double(), accumulate=True)
    expected = before.double() * layer.ema.decay + mass * (1 - layer.ema.decay)
    torch.testing.assert_close(layer.ema.mass.double(), expected, rtol=1e-5, atol=1e-6)
    assert (mass > 0).sum() > 5  # more codes than one token's top 5 got mass
