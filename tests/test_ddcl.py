"""DDCLQuantizer against an independent brute-force reference (explicit (N, K, D) tensors, float64)."""

from __future__ import annotations

import itertools

import pytest
import torch
import torch.nn.functional as F
from helpers import exact_cdist

from softvq import DDCLQuantizer
from softvq.ddcl import _TERMS, Objective, _SoftCentroid
from softvq.parts import Commitment, Gradient, NormalInit, Restart


def plain(*args, **kw) -> DDCLQuantizer:
    """The paper's layer as written (no in-layer recipe): what the brute-force references describe."""
    return DDCLQuantizer(*args, recipe="plain", **kw)


def brute_force(z: torch.Tensor, p: torch.Tensor, temperature: float, distance: str = "euclidean"):
    """docs/design.md, "The layer: L_q = L_OLS + V", written out literally, with the (N, K, D) difference tensor the
    library must avoid."""
    if distance == "cosine":
        z, p = F.normalize(z, dim=-1), F.normalize(p, dim=-1)
    diff = z[:, None, :] - p[None, :, :]  # (N, K, D)
    d = diff.square().sum(-1)
    q = torch.softmax(-d / temperature, dim=1)
    mu = q @ p
    l_q = (q * d).sum(1).mean()
    l_ols = (z - mu).square().sum(1).mean()
    v = (q * (p[None, :, :] - mu[:, None, :]).square().sum(-1)).sum(1).mean()
    free_energy = (-temperature * torch.log(torch.exp(-d / temperature).sum(1))).mean()  # no log-sum-exp shift
    return d, q, mu, {"l_q": l_q, "l_ols": l_ols, "v": v, "free_energy": free_energy}


def make(num_codes=12, dim=5, dtype=torch.float64, **kw) -> DDCLQuantizer:
    torch.manual_seed(0)
    return plain(num_codes, dim, init="normal", **kw).to(dtype)


SHAPES = [(7, 5), (3, 4, 5), (2, 3, 4, 5)]


@pytest.mark.parametrize("distance", ["euclidean", "cosine"])
@pytest.mark.parametrize("shape", SHAPES)
def test_terms_match_brute_force_and_identity_float64(shape, distance):
    quantizer = make(distance=distance, temperature=0.7 if distance == "euclidean" else 0.2)
    z = torch.randn(shape, dtype=torch.float64) * 1.5 + 0.3
    out = quantizer(z)
    flat = z.reshape(-1, 5)
    d, q, mu, ref = brute_force(flat, quantizer.prototypes.detach(), quantizer.temperature, distance)
    for name in ("l_q", "l_ols", "v"):
        torch.testing.assert_close(out.terms[name], ref[name], rtol=1e-12, atol=0)
    l_q, l_ols, v = (out.terms[k].item() for k in ("l_q", "l_ols", "v"))
    assert abs(l_q - l_ols - v) / l_q < 1e-12
    assert out.terms["identity_residual"].item() < 1e-12
    assert v >= 0
    torch.testing.assert_close(out.probs.reshape(-1, 12), q, rtol=1e-10, atol=1e-14)
    torch.testing.assert_close(out.probs.sum(-1), torch.ones(shape[:-1], dtype=torch.float64))
    torch.testing.assert_close(out.quantized, out.probs @ quantizer.codebook)
    torch.testing.assert_close(out.quantized.reshape(-1, 5), mu)
    assert out.indices.shape == shape[:-1] and out.indices.dtype == torch.int64
    ref_codes = quantizer.codebook if distance == "cosine" else quantizer.prototypes.detach()
    ref_z = F.normalize(flat, dim=-1) if distance == "cosine" else flat
    assert torch.equal(out.indices.reshape(-1), exact_cdist(ref_z, ref_codes).argmin(1))
    assert out.quantized.shape == shape


def test_identity_float32_at_rounding_far_from_origin():
    """Centring keeps the float32 identity at rounding when tokens and prototypes sit far from the origin."""
    torch.manual_seed(1)
    quantizer = plain(64, 16, temperature=2.0, init="normal")
    with torch.no_grad():
        quantizer.prototypes.add_(100.0)
    z = torch.randn(512, 16) + 100.0
    out = quantizer(z)
    assert out.terms["identity_residual"].item() < 1e-5
    _, _, _, ref = brute_force(z.double(), quantizer.prototypes.detach().double(), 2.0)
    torch.testing.assert_close(out.terms["l_q"].double(), ref["l_q"], rtol=1e-4, atol=0)


def reference_objective(z, p, temperature, distance, cb_term, cb_w, cm_term, cm_w):
    """Routed loss built with explicit stop-gradients on the brute-force reference."""
    _, q, mu, _ = brute_force(z, p, temperature, distance)
    *_, cb_terms = brute_force(z.detach(), p, temperature, distance)
    *_, cm_terms = brute_force(z, p.detach(), temperature, distance)
    loss = (cb_w * cb_terms[cb_term] + (cm_w * cm_terms[cm_term] if cm_w else 0.0)) / z.shape[-1]
    return mu, q, loss


# every routing of the two terms; a commitment weight of 0 has no term (Commitment(weight, term) needs a weight)
ROUTINGS = [(cb_term, cm_term, cb_w, cm_w)
            for cb_term, cm_term in itertools.product(_TERMS, repeat=2) for cb_w, cm_w in [(1.0, 0.25), (0.0, 0.5)]]
ROUTINGS += [(cb_term, "hard", 0.7, 0.0) for cb_term in _TERMS]


@pytest.mark.parametrize("distance", ["euclidean", "cosine"])
@pytest.mark.parametrize("cb_term,cm_term,cb_w,cm_w", ROUTINGS)
def test_gradients_match_reference_with_stop_gradients(distance, cb_term, cm_term, cb_w, cm_w):
    torch.manual_seed(2)
    quantizer = plain(9, 5, temperature=0.9 if distance == "euclidean" else 0.3, distance=distance,
                              prototype_update=Gradient(cb_term, cb_w),
                              commitment_weight=Commitment(cm_w, cm_term) if cm_w else 0.0, init="normal").double()
    z = torch.randn(4, 6, 5, dtype=torch.float64, requires_grad=True)
    g_mu = torch.randn(4, 6, 5, dtype=torch.float64)
    g_q = torch.randn(4, 6, 9, dtype=torch.float64)
    out = quantizer(z)
    ((out.quantized * g_mu).sum() + (out.probs * g_q).sum() + 3.0 * out.loss).backward()

    z_ref = z.detach().reshape(-1, 5).clone().requires_grad_(True)
    p_ref = quantizer.prototypes.detach().clone().requires_grad_(True)
    mu, q, loss = reference_objective(z_ref, p_ref, quantizer.temperature, distance, cb_term, cb_w, cm_term, cm_w)
    ((mu * g_mu.reshape(-1, 5)).sum() + (q * g_q.reshape(-1, 9)).sum() + 3.0 * loss).backward()

    torch.testing.assert_close(out.loss, loss.detach(), rtol=1e-12, atol=1e-15)
    torch.testing.assert_close(z.grad.reshape(-1, 5), z_ref.grad, rtol=1e-9, atol=1e-12)
    torch.testing.assert_close(quantizer.prototypes.grad, p_ref.grad, rtol=1e-9, atol=1e-12)


def test_gradcheck_soft_centroid_and_assignments():
    """Finite differences (torch.autograd.gradcheck) on the outputs mu and q of the fused function."""
    torch.manual_seed(3)
    z = torch.randn(6, 3, dtype=torch.float64, requires_grad=True)
    p = torch.randn(4, 3, dtype=torch.float64, requires_grad=True)

    def fn(z_, p_):
        mu, q, *_ = _SoftCentroid.apply(z_, p_, 0.8, Objective("l_q", 1.0, "l_ols", 0.25))
        return mu, q

    assert torch.autograd.gradcheck(fn, (z, p))


def test_only_routed_terms_reach_each_side():
    """loss alone: the commitment term's gradient reaches z, the codebook term's reaches the prototypes."""
    torch.manual_seed(4)
    q_only_codebook = plain(8, 4, init="normal", prototype_update=Gradient(weight=1.0), commitment_weight=0.0).double()
    z = torch.randn(10, 4, dtype=torch.float64, requires_grad=True)
    q_only_codebook(z).loss.backward()
    assert torch.count_nonzero(z.grad) == 0
    assert torch.count_nonzero(q_only_codebook.prototypes.grad) > 0

    q_only_commit = plain(8, 4, init="normal", prototype_update=Gradient(weight=0.0), commitment_weight=1.0).double()
    z.grad = None
    q_only_commit(z).loss.backward()
    assert torch.count_nonzero(z.grad) > 0
    assert q_only_commit.prototypes.grad is None or torch.count_nonzero(q_only_commit.prototypes.grad) == 0


def test_gradients_finite_at_tiny_temperature_and_huge_inputs():
    torch.manual_seed(5)
    quantizer = plain(32, 8, temperature=1e-4, init=NormalInit(1e4))
    z = (torch.randn(64, 8) * 1e4).requires_grad_(True)
    out = quantizer(z)
    (out.quantized.square().mean() + out.loss).backward()
    for t in (out.quantized, out.probs, out.loss, z.grad, quantizer.prototypes.grad, *out.terms.values()):
        assert torch.isfinite(t).all()
    # At such a temperature the assignment is hard: the output is the nearest prototype.
    nearest = quantizer.prototypes.detach()[exact_cdist(z.detach(), quantizer.prototypes.detach()).argmin(1)]
    torch.testing.assert_close(out.quantized.detach(), nearest, rtol=1e-5, atol=1e-3)  # float32 at |z| ~ 1e4


def test_output_approaches_nearest_prototype_as_temperature_falls():
    torch.manual_seed(6)
    quantizer = make(num_codes=16, dim=4)
    z = torch.randn(200, 4, dtype=torch.float64)
    dist = exact_cdist(z, quantizer.prototypes.detach()).square()
    nearest = quantizer.prototypes.detach()[dist.argmin(1)]
    two = dist.topk(2, dim=1, largest=False).values
    clear = (two[:, 1] - two[:, 0]) > 0.01  # tokens without a near-tie between their two nearest prototypes
    errors = []
    for t in (10.0, 1.0, 0.1, 0.01, 0.001, 1e-4):
        quantizer.temperature = t  # annealing: the temperature can change between steps
        errors.append((quantizer(z).quantized - nearest)[clear].abs().max().item())
    assert all(a > b for a, b in zip(errors, errors[1:], strict=False)), errors
    assert errors[-1] < 1e-12, errors


def test_data_initialisation_copies_first_training_batch():
    torch.manual_seed(7)
    quantizer = plain(16, 3)  # init="data"
    assert not quantizer.initialized
    z = torch.randn(4, 10, 3)
    quantizer.eval()
    with pytest.warns(UserWarning, match="placeholder"):
        quantizer(z)
    assert not quantizer.initialized  # evaluation never initialises
    quantizer.train()
    quantizer(z)
    assert quantizer.initialized
    dist_to_tokens = exact_cdist(quantizer.prototypes.detach(), z.reshape(-1, 3)).min(1).values
    assert dist_to_tokens.max().item() == 0.0  # every prototype is one of the tokens
    assert torch.unique(quantizer.prototypes.detach(), dim=0).shape[0] == 16  # distinct tokens
    before = quantizer.prototypes.detach().clone()
    quantizer(torch.randn(40, 3))
    assert torch.equal(before, quantizer.prototypes.detach())  # only the first batch


def test_data_initialisation_with_fewer_tokens_than_codes_gives_distinct_prototypes():
    torch.manual_seed(8)
    quantizer = plain(32, 3)
    z = torch.randn(5, 3)
    quantizer.init_from_data(z)
    assert torch.unique(quantizer.prototypes.detach(), dim=0).shape[0] == 32
    assert exact_cdist(quantizer.prototypes.detach(), z).min(1).values.max().item() < 0.05


def test_state_dict_keeps_temperature_and_initialisation():
    quantizer = plain(8, 2, temperature=0.5)
    quantizer(torch.randn(20, 2))
    quantizer.temperature = 0.125
    restored = plain(8, 2, temperature=3.0)
    restored.load_state_dict(quantizer.state_dict())
    assert restored.temperature == 0.125 and restored.initialized
    assert torch.equal(restored.prototypes, quantizer.prototypes)
    z = torch.randn(20, 2)
    torch.testing.assert_close(restored(z).quantized, quantizer(z).quantized)


def test_state_dict_with_bad_extra_state_raises():
    quantizer = plain(8, 2)
    state = quantizer.state_dict()
    state["_extra_state"] = {"temperature": 0.5}  # e.g. a hand-edited or foreign checkpoint
    with pytest.raises(ValueError, match="initialized"):
        quantizer.load_state_dict(state)
    state["_extra_state"] = {"temperature": -1.0, "initialized": True}
    with pytest.raises(ValueError, match="temperature"):
        quantizer.load_state_dict(state)
    del state["_extra_state"]
    with pytest.raises(RuntimeError, match="_extra_state"):  # strict loading names the missing entry
        quantizer.load_state_dict(state)


def test_cosine_distance_is_scale_invariant():
    quantizer = plain(10, 6, distance="cosine", temperature=0.1, init="normal")
    z = torch.randn(30, 6)
    torch.testing.assert_close(quantizer(z).probs, quantizer(7.5 * z).probs)
    assert torch.allclose(quantizer.codebook.norm(dim=-1), torch.ones(10))


def test_decode_indices_returns_codebook_rows():
    quantizer = make()
    out = quantizer(torch.randn(3, 4, 5, dtype=torch.float64))
    hard = quantizer.decode_indices(out.indices)
    assert hard.shape == (3, 4, 5)
    torch.testing.assert_close(hard, quantizer.prototypes.detach()[out.indices])
    with pytest.raises(ValueError, match="12"):
        quantizer.decode_indices(torch.tensor([12]))


def test_autocast_bf16_computes_in_float32():
    torch.manual_seed(9)
    encoder = torch.nn.Linear(8, 8)
    quantizer = plain(32, 8, temperature=0.5)
    x = torch.randn(64, 8)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        z = encoder(x)
        assert z.dtype == torch.bfloat16
        out = quantizer(z)
    assert out.quantized.dtype == torch.bfloat16
    assert out.probs.dtype == torch.float32 and out.loss.dtype == torch.float32
    assert out.terms["identity_residual"].item() < 1e-5
    (out.quantized.float().square().mean() + out.loss).backward()
    assert torch.isfinite(encoder.weight.grad).all() and torch.isfinite(quantizer.prototypes.grad).all()


def test_empty_batch_returns_empty_outputs():
    quantizer = make()
    for shape in [(0, 5), (2, 0, 5)]:
        out = quantizer(torch.empty(shape, dtype=torch.float64))
        assert out.quantized.shape == shape
        assert out.indices.shape == shape[:-1]
        assert out.probs.shape == (*shape[:-1], 12)
        assert out.loss.item() == 0.0
        out.loss.backward()  # still part of the graph


@pytest.mark.parametrize(
    "kwargs,match",
    [
        ({"num_codes": 0}, "num_codes"),
        ({"num_codes": 2.5}, "num_codes"),
        ({"dim": 0}, "dim"),
        ({"temperature": 0.0}, "temperature"),
        ({"temperature": -1.0}, "temperature"),
        ({"temperature": float("nan")}, "temperature"),
        ({"distance": "manhattan"}, "manhattan"),
        ({"prototype_update": {"term": "v"}}, r"prototype_update\.term"),
        ({"commitment_weight": -0.1}, "commitment_weight"),
        ({"init": "kmeans"}, "init"),
        ({"restart": {"threshold": -1.0}}, r"restart\.threshold"),
        ({"restart": {"decay": 1.0}}, r"restart\.decay"),
        ({"restart": {"decay": 0.0}}, r"restart\.decay"),
        ({"restart": 0.0}, "restart must be"),
    ],
)
def test_invalid_hyperparameters_raise(kwargs, match):
    args = {"num_codes": 8, "dim": 4, **kwargs}
    with pytest.raises(ValueError, match=match):
        DDCLQuantizer(**args)


def test_invalid_temperature_assignment_raises():
    quantizer = make()
    with pytest.raises(ValueError, match="temperature"):
        quantizer.temperature = 0
    assert quantizer.temperature == 1.0


@pytest.mark.parametrize(
    "z,match",
    [
        (torch.randn(3, 4), r"\(\.\.\., 5\).*\(3, 4\)"),
        (torch.tensor([[1.0, float("nan"), 0, 0, 0]]), "non-finite"),
        (torch.tensor([[1.0, float("inf"), 0, 0, 0]]), "non-finite"),
        (torch.ones(3, 5, dtype=torch.long), "floating"),
    ],
)
def test_bad_input_raises(z, match):
    with pytest.raises(ValueError, match=match):
        make(dtype=torch.float32)(z)


class _RecordShapes(torch.utils._python_dispatch.TorchDispatchMode):
    """Records the shape of every tensor any aten op produces (forward and backward)."""

    def __init__(self) -> None:
        super().__init__()
        self.shapes: list[tuple[int, ...]] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in out if isinstance(out, (tuple, list)) else (out,):
            if isinstance(t, torch.Tensor):
                self.shapes.append(tuple(t.shape))
        return out


@pytest.mark.parametrize("distance", ["euclidean", "cosine"])
def test_never_builds_an_n_by_k_by_d_tensor(distance):
    """Memory is O(N K): no op of the forward or backward pass produces N*K*D elements."""
    n, k, dim = 96, 40, 24
    quantizer = plain(k, dim, distance=distance, init="normal")
    z = torch.randn(n, dim, requires_grad=True)
    with _RecordShapes() as rec:
        out = quantizer(z)
        (out.quantized.square().mean() + out.probs.square().mean() + out.loss).backward()
    assert (n, k) in rec.shapes  # the recorder sees the distance matrix...
    largest = max(torch.Size(s).numel() for s in rec.shapes)
    assert largest == n * k, f"largest intermediate has {largest} elements (N*K = {n * k})"  # ...and nothing larger


def test_jacobian_of_soft_centroid_is_assignment_covariance():
    """docs/design.md, "What reaches the encoder": d mu_n / d z_n = (2/T) C_n with
    C_n = sum_k q_nk (p_k - mu_n)(p_k - mu_n)^T, trace C_n = V_n."""
    torch.manual_seed(10)
    quantizer = make(num_codes=7, dim=3, temperature=0.6)
    z = torch.randn(1, 3, dtype=torch.float64)
    jac = torch.autograd.functional.jacobian(lambda x: quantizer(x).quantized[0], z)[:, 0, :]  # (D, D)
    out = quantizer(z)
    p, q, mu = quantizer.prototypes.detach(), out.probs[0], out.quantized[0]
    cov = ((p - mu).T * q) @ (p - mu)
    torch.testing.assert_close(jac, (2 / 0.6) * cov, rtol=1e-10, atol=1e-12)
    torch.testing.assert_close(torch.trace(cov), out.terms["v"], rtol=1e-10, atol=0)


def test_free_energy_attracts_a_far_prototype_where_l_q_repels_it():
    """Why the default codebook term is the free energy: L_q pushes prototypes that are farther than average by more
    than T even farther away (dL_q/dd < 0 there), which Adam turns into a full-size step, so they die; the free energy
    F = -T log sum_k exp(-d_k / T) = L_q - T H(q) only attracts (dF/dd_k = q_k), so a far prototype drifts back."""
    torch.manual_seed(5)
    z = torch.randn(200, 4, dtype=torch.float64)
    directions = {}
    for term in ("l_q", "free_energy"):
        quantizer = plain(3, 4, temperature=1.0, prototype_update=Gradient(term), commitment_weight=0.0,
                                  init="normal").double()
        with torch.no_grad():
            quantizer.prototypes.copy_(torch.tensor([[0.0, 0, 0, 0], [0.5, 0, 0, 0], [6.0, 0, 0, 0]]))
        quantizer(z).loss.backward()
        step = -quantizer.prototypes.grad[2]  # gradient-descent direction of the far prototype
        to_data = z.mean(0) - quantizer.prototypes.detach()[2]
        directions[term] = float(step @ to_data)
    assert directions["l_q"] < 0 < directions["free_energy"]


def test_free_energy_is_l_q_minus_temperature_times_entropy():
    torch.manual_seed(6)
    quantizer = plain(7, 3, temperature=0.6, prototype_update=Gradient("free_energy", 1.0),
                              commitment_weight=0.0, init="normal").double()
    z = torch.randn(50, 3, dtype=torch.float64)
    out = quantizer(z)
    entropy = -(torch.special.xlogy(out.probs, out.probs)).sum(1).mean()
    torch.testing.assert_close(out.loss * 3, out.terms["l_q"] - 0.6 * entropy, rtol=1e-12, atol=1e-12)


def test_dead_code_restart_moves_an_unused_prototype_onto_a_batch_token():
    torch.manual_seed(7)
    quantizer = plain(4, 2, temperature=0.5, init="normal", restart=Restart(1.0)).double()
    with torch.no_grad():
        quantizer.prototypes.copy_(torch.tensor([[0.0, 0.0], [1.0, 0.0], [0.0, 1.0], [50.0, 50.0]]))
    z1 = torch.randn(64, 2, dtype=torch.float64)
    quantizer(z1)  # first batch: the usage starts at its counts, prototype 3 (far away) has none
    assert quantizer.dead_codes.usage[3].item() == 0 and quantizer.restarts == 0
    torch.testing.assert_close(quantizer.dead_codes.usage.sum(), torch.tensor(64.0, dtype=torch.float64))
    z2 = torch.randn(64, 2, dtype=torch.float64)
    quantizer(z2)
    assert quantizer.restarts == 1
    moved = quantizer.prototypes.detach()[3]
    assert torch.cdist(moved[None], z2).min().item() == 0.0  # exactly one of this batch's tokens
    torch.testing.assert_close(quantizer.prototypes.detach()[:3], torch.tensor([[0.0, 0.0], [1.0, 0.0], [0.0, 1.0]],
                                                                               dtype=torch.float64))
    state = quantizer.state_dict()
    clone = plain(4, 2, init="normal", restart=Restart(1.0)).double()
    clone.load_state_dict(state)
    assert clone.restarts == 1 and torch.equal(clone.dead_codes.usage, quantizer.dead_codes.usage)

    quantizer.eval()
    with torch.no_grad():
        quantizer.prototypes[3] = 100.0
        quantizer.dead_codes.usage[3] = 0.0
    quantizer(z2)  # evaluation never changes the codebook
    assert quantizer.restarts == 1 and quantizer.prototypes[3, 0].item() == 100.0


def test_no_restart_without_threshold_and_legacy_state_dict_loads():
    quantizer = plain(4, 2, init="normal")
    with torch.no_grad():
        quantizer.prototypes[3] = 50.0
    for _ in range(3):
        quantizer(torch.randn(32, 2))
    assert quantizer.restarts == 0 and quantizer.prototypes[3, 0].item() == 50.0
    legacy = {k: v for k, v in quantizer.state_dict().items() if not k.endswith("usage")}
    legacy["_extra_state"] = {k: v for k, v in legacy["_extra_state"].items() if k != "version"}  # version 1
    fresh = plain(4, 2, init="normal")
    fresh.load_state_dict(legacy)
    assert (fresh.dead_codes.usage == -1).all()
    # a default layer that loads version 1 becomes the plain layer: "auto" assigned to an option is the plain recipe's
    default = DDCLQuantizer(4, 2, init="normal")
    default.load_state_dict(legacy)
    assert default.recipe == "plain" and default.restart is None and not default.standardize
    default.restart, default.standardize, default.target_entropy = "auto", "auto", "auto"
    assert default.restart is None and not default.standardize and default.target_entropy is None
