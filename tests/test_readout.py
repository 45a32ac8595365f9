"""DDCLReadout against a token-by-token float64 loop, plus the invariances the readout promises."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from softvq import DDCLQuantizer, DDCLReadout, ReadoutOutput
from softvq.parts import Commitment, Gradient, Restart, Standardize

K, D = 5, 4


def loop_reference(z: torch.Tensor, mask: torch.Tensor, p: torch.Tensor, temperature: float,
                   distance: str = "euclidean") -> dict:
    """docs/design.md, "The layer: L_q = L_OLS + V", and the readout's definitions, one real token and one prototype at
    a time (differentiable)."""
    batch, length, _ = z.shape
    codes = F.normalize(p, dim=-1) if distance == "cosine" else p
    slots, pooled, mass = [], [], []
    assignments = [[torch.zeros(K, dtype=z.dtype) for _ in range(length)] for _ in range(batch)]
    l_q = l_ols = v = free_energy = 0.0
    n = 0
    for b in range(batch):
        weighted, row_mass, centroid_sum, count = [0.0] * K, [0.0] * K, 0.0, 0
        for t in range(length):
            if not mask[b, t]:
                continue
            zt = z[b, t]
            zd = F.normalize(zt, dim=0) if distance == "cosine" else zt
            d = torch.stack([(zd - codes[k]).square().sum() for k in range(K)])
            q = torch.softmax(-d / temperature, dim=0)
            mu = sum(q[k] * codes[k] for k in range(K))
            l_q = l_q + (q * d).sum()
            free_energy = free_energy - temperature * torch.logsumexp(-d / temperature, dim=0)
            l_ols = l_ols + (zd - mu).square().sum()
            v = v + sum(q[k] * (codes[k] - mu).square().sum() for k in range(K))
            for k in range(K):
                weighted[k] = weighted[k] + q[k] * zt  # slots pool the tokens as given
                row_mass[k] = row_mass[k] + q[k]
            centroid_sum = centroid_sum + mu
            assignments[b][t] = q
            count += 1
        n += count
        slots.append(torch.stack([weighted[k] / row_mass[k] for k in range(K)]))
        mass.append(torch.stack(row_mass))
        pooled.append(centroid_sum / count)
    return {"slots": torch.stack(slots), "pooled": torch.stack(pooled), "mass": torch.stack(mass),
            "assignments": torch.stack([torch.stack(row) for row in assignments]),
            "l_q": l_q / n, "l_ols": l_ols / n, "v": v / n, "free_energy": free_energy / n}


def make(dtype=torch.float64, **kw) -> DDCLReadout:
    torch.manual_seed(0)
    return DDCLReadout(K, D, init="normal", **kw).to(dtype)


def ragged(batch=3, length=7, dtype=torch.float64, seed=1) -> tuple[torch.Tensor, torch.Tensor]:
    """Tokens ``(B, T, D)`` and a mask with rows of different lengths; padded positions hold garbage."""
    g = torch.Generator().manual_seed(seed)
    z = torch.randn(batch, length, D, generator=g, dtype=dtype) * 1.3 + 0.2
    lengths = torch.tensor([length, 1, length - 2, 3][:batch])
    mask = torch.arange(length)[None, :] < lengths[:, None]
    mask = mask[:, torch.randperm(length, generator=g)]  # padding scattered, not only at the end
    return z.masked_fill(~mask[..., None], float("nan")), mask


@pytest.mark.parametrize("distance,temperature,codebook_term", [("euclidean", 0.9, "free_energy"),
                                                                 ("cosine", 0.3, "l_q")])
def test_outputs_and_terms_match_a_token_by_token_loop_float64(distance, temperature, codebook_term):
    readout = make(distance=distance, temperature=temperature, prototype_update=Gradient(codebook_term, 0.7),
                   commitment_weight=Commitment(0.3, "l_ols"))
    z, mask = ragged()
    out = readout(z, mask)
    assert isinstance(out, ReadoutOutput)
    ref = loop_reference(z, mask, readout.prototypes.detach(), temperature, distance)
    for name in ("slots", "pooled", "mass", "assignments"):
        torch.testing.assert_close(getattr(out, name), ref[name], rtol=1e-12, atol=1e-14, msg=name)
    for name in ("l_q", "l_ols", "v"):
        torch.testing.assert_close(out.terms[name], ref[name], rtol=1e-12, atol=0, msg=name)
    torch.testing.assert_close(out.loss, (0.7 * ref[codebook_term] + 0.3 * ref["l_ols"]) / D, rtol=1e-12, atol=0)
    l_q, l_ols, v = (out.terms[k].item() for k in ("l_q", "l_ols", "v"))
    assert abs(l_q - l_ols - v) / l_q < 1e-12 and out.terms["identity_residual"].item() < 1e-12 and v > 0
    assert out.slots.shape == (3, K, D) and out.pooled.shape == (3, D) and out.assignments.shape == (3, 7, K)
    assert out.mass.shape == (3, K) and out.loss.shape == ()
    assert torch.equal(out.assignments[~mask], torch.zeros(int((~mask).sum()), K, dtype=torch.float64))
    torch.testing.assert_close(out.mass.sum(1), mask.sum(1).double())


def test_identity_holds_on_every_batch_and_every_row():
    readout = make(temperature=0.5)
    z, mask = ragged(batch=3, length=9, seed=5)
    for rows in ([0], [1], [2], [0, 1, 2]):
        terms = readout(z[rows], mask[rows]).terms
        ref = loop_reference(z[rows], mask[rows], readout.prototypes.detach(), 0.5)
        torch.testing.assert_close(terms["v"], ref["v"], rtol=1e-12, atol=0)
        assert abs(terms["l_q"] - terms["l_ols"] - terms["v"]).item() / terms["l_q"].item() < 1e-12
    far = DDCLReadout(64, 16, temperature=2.0, init="normal")  # float32, far from the origin
    with torch.no_grad():
        far.prototypes.add_(100.0)
    assert far(torch.randn(4, 128, 16) + 100.0).terms["identity_residual"].item() < 1e-5


@pytest.mark.parametrize("codebook_term", ["free_energy", "l_q"])
def test_gradients_match_the_loop_reference_with_stop_gradients(codebook_term):
    readout = make(temperature=0.8, prototype_update=Gradient(codebook_term, 1.0),
                   commitment_weight=Commitment(0.25, "l_ols"))
    z, mask = ragged(batch=2, length=5, seed=3)
    z = z.nan_to_num(0.0).requires_grad_(True)
    g = torch.Generator().manual_seed(4)
    g_slots, g_pooled = torch.randn(2, K, D, generator=g, dtype=torch.float64), torch.randn(2, D, generator=g,
                                                                                            dtype=torch.float64)
    g_assign = torch.randn(2, 5, K, generator=g, dtype=torch.float64)
    out = readout(z, mask)
    ((out.slots * g_slots).sum() + (out.pooled * g_pooled).sum() + (out.assignments * g_assign).sum()
     + 3.0 * out.loss).backward()

    z_ref = z.detach().clone().requires_grad_(True)
    p_ref = readout.prototypes.detach().clone().requires_grad_(True)
    ref = loop_reference(z_ref, mask, p_ref, 0.8)
    codebook = loop_reference(z_ref.detach(), mask, p_ref, 0.8)[codebook_term]  # reaches the prototypes only
    commitment_l_ols = loop_reference(z_ref, mask, p_ref.detach(), 0.8)["l_ols"]  # reaches the tokens only
    ((ref["slots"] * g_slots).sum() + (ref["pooled"] * g_pooled).sum() + (ref["assignments"] * g_assign).sum()
     + 3.0 * (codebook + 0.25 * commitment_l_ols) / D).backward()
    torch.testing.assert_close(z.grad, z_ref.grad, rtol=1e-9, atol=1e-12)
    torch.testing.assert_close(readout.prototypes.grad, p_ref.grad, rtol=1e-9, atol=1e-12)
    assert torch.equal(z.grad[~mask], torch.zeros(int((~mask).sum()), D, dtype=torch.float64))
    assert z.grad[mask].abs().sum(1).min() > 0 and readout.prototypes.grad.abs().sum(1).min() > 0


def test_padding_changes_nothing_whatever_it_holds():
    readout = DDCLReadout(16, D, temperature=0.7, init="normal")
    torch.manual_seed(7)
    z = torch.randn(4, 10, D, requires_grad=True)
    mask = torch.arange(10)[None, :] < torch.tensor([10, 3, 7, 1])[:, None]
    garbage = torch.tensor([float("nan"), float("inf"), -float("inf"), 1e30])
    filler = garbage[torch.randint(4, (4, 10, D))]
    padded = torch.cat([torch.where(mask[..., None], z, filler), torch.randn(4, 6, D) * 1e6], 1)
    wide_mask = torch.cat([mask, torch.zeros(4, 6, dtype=torch.bool)], 1)
    a, b = readout(z.masked_fill(~mask[..., None], 0.0), mask), readout(padded, wide_mask)
    for name in ("slots", "pooled", "mass"):
        torch.testing.assert_close(getattr(b, name), getattr(a, name), rtol=1e-6, atol=1e-6, msg=name)
    torch.testing.assert_close(b.assignments[:, :10], a.assignments, rtol=1e-6, atol=1e-7)
    assert torch.equal(b.assignments[:, 10:], torch.zeros(4, 6, 16))
    for name in ("l_q", "l_ols", "v"):
        torch.testing.assert_close(b.terms[name], a.terms[name], rtol=1e-6, atol=0)
    # The gradient of the tokens is the same, and exactly 0 at padding (the garbage never enters the graph).
    (grad_a,) = torch.autograd.grad(sum_outputs(a), z)
    z2 = padded.detach().requires_grad_(True)
    (grad_b,) = torch.autograd.grad(sum_outputs(readout(z2, wide_mask)), z2)
    torch.testing.assert_close(grad_b[:, :10][mask], grad_a[mask], rtol=1e-5, atol=1e-6)
    assert torch.equal(grad_b[~wide_mask], torch.zeros(int((~wide_mask).sum()), D))
    # A full row with no mask is the same as an all-True mask.
    full = torch.randn(2, 6, D)
    torch.testing.assert_close(readout(full).slots, readout(full, torch.ones(2, 6, dtype=torch.bool)).slots)


def sum_outputs(out: ReadoutOutput) -> torch.Tensor:
    return out.slots.sum() + out.pooled.square().sum() + out.loss


def test_outputs_are_invariant_to_permuting_the_real_tokens():
    readout = DDCLReadout(8, D, temperature=0.6, init="normal")
    z, mask = ragged(batch=3, length=8, dtype=torch.float32, seed=9)
    a = readout(z, mask)
    perm = torch.stack([torch.randperm(8, generator=torch.Generator().manual_seed(s)) for s in range(3)])
    zp, mp = z.gather(1, perm[..., None].expand(-1, -1, D)), mask.gather(1, perm)
    b = readout(zp, mp)
    for name in ("slots", "pooled", "mass"):
        torch.testing.assert_close(getattr(b, name), getattr(a, name), rtol=1e-6, atol=1e-6, msg=name)
    torch.testing.assert_close(b.assignments, a.assignments.gather(1, perm[..., None].expand(-1, -1, 8)))
    torch.testing.assert_close(b.loss, a.loss, rtol=1e-6, atol=0)


def test_a_prototype_without_mass_gives_a_zero_slot_and_finite_gradients():
    readout = DDCLReadout(3, 2, temperature=0.1, init="normal").double()
    with torch.no_grad():
        readout.prototypes.copy_(torch.tensor([[0.0, 0.0], [1.0, 0.0], [1e3, 1e3]]))  # the last is never reached
    z = torch.tensor([[[0.1, 0.0], [0.9, 0.1], [0.2, -0.1]]], dtype=torch.float64, requires_grad=True)
    out = readout(z)
    # (its assignments are floored at tiny^0.75 of the largest, softvq._soft_centroid: far below an empty slot's mass)
    assert out.mass[0, 2].item() < torch.finfo(torch.float64).tiny ** 0.5
    assert torch.equal(out.slots[0, 2], torch.zeros(2, dtype=torch.float64))
    assert out.mass[0, :2].min() > 0
    (out.slots.sum() + out.pooled.sum()).backward()
    assert torch.isfinite(z.grad).all() and torch.isfinite(readout.prototypes.grad).all()


@pytest.mark.parametrize("far, empty", [(70.0, True), (35.0, False)])
def test_a_vanishing_mass_never_gives_an_infinite_gradient_in_float32(far, empty):
    """q ~ e^-70 ~ 4e-31 is a positive float32, but 1 / mass^2 overflows: such a slot counts as empty."""
    readout = DDCLReadout(3, 2, temperature=1.0, init="normal")
    with torch.no_grad():
        readout.prototypes.copy_(torch.tensor([[0.0, 0.0], [1.0, 0.0], [far**0.5, 0.0]]))
    z = torch.tensor([[[0.0, 0.1], [0.9, 0.0], [0.1, -0.1]]], requires_grad=True)
    out = readout(z)
    assert 0 < out.mass[0, 2].item() < 1e-10
    assert bool((out.slots[0, 2] == 0).all()) == empty
    if not empty:  # the weighted mean of the tokens, led by the one nearest to the far prototype
        q = out.assignments[0, :, 2].double()
        torch.testing.assert_close(out.slots[0, 2].double(), (q[:, None] * z[0].detach().double()).sum(0) / q.sum())
    (out.slots.square().sum() + out.pooled.sum()).backward()
    assert torch.isfinite(z.grad).all() and torch.isfinite(readout.prototypes.grad).all()


def test_data_init_uses_real_tokens_only():
    readout = DDCLReadout(4, D).train()
    z = torch.full((2, 6, D), 1e6)
    mask = torch.zeros(2, 6, dtype=torch.bool)
    mask[:, :2] = True
    z[mask] = torch.randn(4, D)
    readout(z, mask)
    assert readout.quantizer.initialized
    matches = torch.cdist(readout.prototypes.detach(), z[mask]).min(1).values
    assert matches.max() < 1e-2  # every prototype is one of the 4 real tokens (with tiny jitter at most)


def test_from_quantizer_copies_the_codebook_and_can_freeze_it():
    torch.manual_seed(11)
    quantizer = DDCLQuantizer(6, D, temperature=0.4, distance="cosine", commitment_weight=0.5, init="normal",
                              recipe="plain")
    before = quantizer.prototypes.detach().clone()
    tokens = torch.randn(2, 5, D)
    readout = DDCLReadout.from_quantizer(quantizer, freeze=False)
    assert readout.quantizer.temperature == 0.4 and readout.quantizer.distance == "cosine"
    torch.testing.assert_close(readout(tokens).assignments, quantizer(tokens).probs)  # the same code assignment
    readout(tokens).loss.backward()
    assert readout.prototypes.grad is not None and quantizer.prototypes.grad is None
    with torch.no_grad():
        readout.prototypes.add_(1.0)
    assert torch.equal(quantizer.prototypes.detach(), before)  # an independent copy
    # every code "dead": a trainable copy restarts them, a frozen one never (uncapped: 10 tokens a batch for 6 codes
    # would cap the threshold at 0.42)
    quantizer.restart = Restart(100.0, cap=None)
    restarting = DDCLReadout.from_quantizer(quantizer).train()
    assert restarting.quantizer.restart == Restart(100.0, "auto", None)
    frozen = DDCLReadout.from_quantizer(quantizer, freeze=True).train()
    x = tokens.clone().requires_grad_(True)
    for _ in range(2):  # the first training call only records usage; restarts start with the second
        out = frozen(x)
        restarting(tokens)
    (out.pooled.sum() + out.slots.sum() + out.loss).backward()
    assert frozen.prototypes.grad is None and x.grad.abs().sum() > 0
    assert torch.equal(frozen.prototypes.detach(), before) and frozen.quantizer.restarts == 0
    assert restarting.quantizer.restarts > 0
    with pytest.raises(TypeError, match="DDCLQuantizer"):
        DDCLReadout.from_quantizer(torch.nn.Linear(2, 2))


def test_empty_batch_and_other_dtypes():
    readout = DDCLReadout(K, D, init="normal")
    out = readout(torch.randn(0, 7, D), torch.zeros(0, 7, dtype=torch.bool))
    assert out.slots.shape == (0, K, D) and out.pooled.shape == (0, D) and out.assignments.shape == (0, 7, K)
    out.loss.backward()  # still connected to the prototypes
    with torch.autocast("cpu", dtype=torch.bfloat16):
        half = readout(torch.randn(2, 5, D, dtype=torch.bfloat16))
    assert half.assignments.dtype == torch.float32 and half.slots.dtype == torch.bfloat16
    torch.testing.assert_close(half.assignments.sum(-1), torch.ones(2, 5))


@pytest.mark.parametrize("tokens, mask, match", [
    (torch.randn(5, D), None, r"tokens must have shape \(B, T, 4\), got \(5, 4\)"),
    (torch.randn(2, 5, D + 1), None, r"tokens must have shape \(B, T, 4\), got \(2, 5, 5\)"),
    (torch.ones(2, 5, D, dtype=torch.long), None, "floating point"),
    (torch.randn(2, 5, D), torch.ones(2, 5), "mask must be a bool tensor.*float32"),
    (torch.randn(2, 5, D), torch.ones(2, 4, dtype=torch.bool), r"mask must have shape \(B, T\) = \(2, 5\)"),
    (torch.randn(3, 5, D), torch.tensor([[True] * 5, [False] * 5, [True] * 5]), r"row\(s\) \[1\] .* no real token"),
    (torch.randn(2, 0, D), None, r"row\(s\) \[0, 1\] .* no real token"),
    (torch.randn(3, 5, D).index_put_((torch.tensor(2), torch.tensor(1)), torch.tensor(float("inf"))), None,
     "1 real token.* NaN or Inf, the first in row 2"),
])
def test_bad_inputs_raise_clear_errors(tokens, mask, match):
    with pytest.raises(ValueError, match=match):
        DDCLReadout(K, D, init="normal")(tokens, mask)


@pytest.mark.parametrize("kwargs, match", [
    ({"num_codes": 0}, "num_codes must be a positive integer, got 0"),
    ({"dim": 2.5}, "dim must be a positive integer, got 2.5"),
    ({"temperature": -1.0}, "temperature must be a positive finite number, got -1.0"),
    ({"distance": "manhattan"}, "distance must be one of .* got 'manhattan'"),
    ({"prototype_update": {"term": "v"}}, r"prototype_update\.term must be one of"),
    ({"commitment_weight": float("nan")}, "commitment_weight must be a non-negative finite number"),
    ({"restart": {"decay": 1.0}}, r"restart\.decay must be in \(0, 1\), got 1.0"),
])
def test_bad_hyperparameters_raise(kwargs, match):
    with pytest.raises(ValueError, match=match):
        DDCLReadout(**{"num_codes": K, "dim": D, **kwargs})


def test_from_a_standardising_quantizer_assigns_as_the_trained_quantizer_evaluates():
    torch.manual_seed(12)
    quantizer = DDCLQuantizer(6, D, init="normal")  # the default recipe: in-layer standardisation, EMA, hard output
    for _ in range(3):
        quantizer(torch.randn(4, 7, D) * 0.01 + 2.0)  # a few training steps set the running statistics
    quantizer.eval()
    tokens = torch.randn(2, 5, D) * 0.01 + 2.0
    readout = DDCLReadout.from_quantizer(quantizer, freeze=True)  # in training mode, as a downstream task trains it
    torch.testing.assert_close(readout(tokens).assignments, quantizer(tokens).probs)
    readout(torch.randn(2, 5, D))  # another distribution: the frozen statistics stay the trained ones
    assert torch.equal(readout.quantizer.standardizer.running_mean, quantizer.standardizer.running_mean)


def train_steps(readout: DDCLReadout, steps: int = 3, seed: int = 30) -> list:
    """A few training calls on ragged batches (the gradient of a stand-in loss included), with the RNG reseeded
    before each so that data init and restarts draw the same tokens for any two readouts."""
    results = []
    for step in range(steps):
        z, mask = ragged(batch=3, length=7, seed=seed + step)
        z = z.nan_to_num(0.0).requires_grad_(True)
        torch.manual_seed(seed + 100 + step)
        out = readout(z, mask)
        (out.slots.square().sum() + out.pooled.sum() + out.assignments[..., 0].sum() + out.loss).backward()
        results.append((out, z.grad))
    return results


@pytest.mark.parametrize("kwargs", [
    {},
    {"temperature": 0.4, "distance": "cosine", "commitment_weight": Commitment(0.5, "hard")},
    {"init": "normal", "prototype_update": Gradient("l_q", 0.3),
     "commitment_weight": Commitment(0.2, "free_energy"), "restart": Restart(1.5, decay=0.5, cap=None)},
    {"standardize": True, "temperature": 2.0, "prototype_update": Gradient("l_ols")},
])
def test_keywords_build_the_readout_from_quantizer_builds_from_an_explicit_quantizer(kwargs):
    """DDCLReadout(K, D, **kw) against DDCLReadout.from_quantizer(DDCLQuantizer(K, D, recipe="plain", **kw)), output
    for output and gradient for gradient, through data init, dead-code restarts and standardisation."""
    torch.manual_seed(21)
    readout = DDCLReadout(K, D, **kwargs).double()
    torch.manual_seed(21)
    reference = DDCLReadout.from_quantizer(DDCLQuantizer(K, D, recipe="plain", **kwargs).double())
    assert repr(readout) == repr(reference)
    for (out, grad), (ref, ref_grad) in zip(train_steps(readout), train_steps(reference), strict=True):
        for name in ("slots", "pooled", "assignments", "mass", "loss"):
            assert torch.equal(getattr(out, name), getattr(ref, name)), name
        assert out.terms.keys() == ref.terms.keys() and all(torch.equal(out.terms[k], ref.terms[k]) for k in out.terms)
        assert torch.equal(grad, ref_grad)
        assert torch.equal(readout.prototypes.grad, reference.prototypes.grad)
    state, ref_state = readout.state_dict(), reference.state_dict()
    assert state.keys() == ref_state.keys()
    for key, value in state.items():
        assert torch.equal(value, ref_state[key]) if torch.is_tensor(value) else value == ref_state[key], key
    if kwargs.get("restart"):
        assert readout.quantizer.restarts > 0  # the forwarded threshold acted


def test_the_readout_defaults_are_the_plain_layer_at_temperature_1():
    torch.manual_seed(22)
    readout = DDCLReadout(K, D)
    torch.manual_seed(22)
    explicit = DDCLQuantizer(K, D, recipe="plain", temperature=1.0, standardize=False, hard_output=False,
                             restart=None, check_finite=False)
    assert readout.quantizer.extra_repr() == explicit.extra_repr()
    assert readout.quantizer.temperature == 1.0 and readout.quantizer.restart is None
    assert not readout.quantizer.standardize and not readout.quantizer.hard_output
    assert readout.quantizer.prototype_update == Gradient() and readout.prototypes.requires_grad
    assert readout.check_finite and not readout.quantizer.check_finite  # the readout checks the real tokens itself
    assert torch.equal(readout.prototypes, explicit.prototypes)


def test_recipe_keywords_act_in_the_inner_quantizer_on_the_real_tokens_only():
    """EMA prototypes, the entropy-controlled temperature, standardisation and restarts, forwarded: the readout's
    quantizer ends each step in the state of a DDCLQuantizer fed only the real tokens."""
    kwargs = {"prototype_update": "ema", "target_entropy": 0.9, "temperature": "auto",
              "standardize": Standardize(output_scale="input"), "restart": Restart(0.5)}
    torch.manual_seed(23)
    readout = DDCLReadout(K, D, **kwargs).double()
    torch.manual_seed(23)
    reference = DDCLQuantizer(K, D, recipe="plain", **kwargs).double()
    assert not readout.prototypes.requires_grad  # EMA: the prototypes are not trained by the gradient
    for step in range(4):
        z, mask = ragged(batch=3, length=7, seed=40 + step)
        torch.manual_seed(step)
        out = readout(z, mask)
        torch.manual_seed(step)
        ref = reference(z[mask])
        assert torch.equal(out.assignments[mask], ref.probs)
        rows = mask.nonzero()[:, 0]
        pooled = torch.stack([ref.quantized[rows == b].mean(0) for b in range(3)])
        torch.testing.assert_close(out.pooled, pooled, rtol=1e-12, atol=1e-12)  # on the input's scale
        state, ref_state = readout.quantizer.state_dict(), reference.state_dict()
        for key, value in state.items():
            assert torch.equal(value, ref_state[key]) if torch.is_tensor(value) else value == ref_state[key], key
    assert readout.quantizer.temperature != 1.0  # calibrated, then controlled
    assert abs(out.terms["l_q"].item()) > 0 and readout.quantizer.standardizer.running_var.ne(1.0).all()


@pytest.mark.parametrize("kwargs, match", [
    ({"recipe": "auto"}, r"DDCLReadout cannot honour recipe='auto' \(only recipe='plain'\)"),
    ({"hard_output": True}, r"DDCLReadout cannot honour hard_output=True \(only hard_output=False\)"),
    ({"channel_first": True}, r"DDCLReadout cannot honour channel_first=True .* tokens \(B, T, D\)"),
    ({"temprature": 0.5}, "DDCLReadout got temprature=0.5, which is not a DDCLQuantizer keyword"),
    ({"target_entropy": 10.0}, "target_entropy must be below log"),  # the quantizer's own checks still apply
])
def test_keywords_the_readout_cannot_honour_are_named(kwargs, match):
    with pytest.raises(ValueError, match=match):
        DDCLReadout(K, D, **kwargs)


def test_the_values_the_readout_fixes_may_still_be_passed():
    readout = DDCLReadout(K, D, recipe="plain", hard_output=False, channel_first=False)
    assert readout.quantizer.recipe == "plain" and not readout.quantizer.hard_output
    assert not readout.quantizer.channel_first
