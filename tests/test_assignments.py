"""Every public option of the layers is checked on assignment by the constructor's own check and takes effect at the
next call, or is fixed with an error that says how to get another value (softvq._recipe: layer_option, fixed_option;
softvq/hard_vq.py). Each effect is checked against a reference computed here by hand."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

import softvq
from softvq import DDCLQuantizer, HardVQ
from softvq.parts import Commitment, Ema, EntropyControl, Gradient, Restart, Standardize


def trained(layer: torch.nn.Module, steps: int = 3, dim: int = 4, seed: int = 0) -> torch.nn.Module:
    g = torch.Generator().manual_seed(seed)
    layer.train()
    for _ in range(steps):
        layer(torch.randn(256, dim, generator=g, dtype=torch.float64) * 2 + 1)
    return layer


def ddcl(**options) -> DDCLQuantizer:
    torch.manual_seed(0)
    return DDCLQuantizer(16, 4, **options).double()


# ---- refused: the constructor's check, naming the option and the value; the layer keeps its value -------------------
BAD = [  # (option, value, what the error says)
    ("temperature_rate", 100, r"temperature_rate=100 is too large .* below .* = 0\.3824"),  # at K = 64, below
    ("target_entropy", 100, r"target_entropy must be below log\(num_codes\) = 4\.159 nats.*got 100"),
    ("target_entropy", "abc", r"target_entropy .*got 'abc'"),
    ("target_entropy", EntropyControl(2.0, rate=1.0), r"temperature_rate=1\.0 is too large"),
    ("distance", "l2", r"distance must be one of \('euclidean', 'cosine'\), got 'l2'"),
    ("top_k", 0, r"top_k must be a positive integer, got 0"),
    ("top_k", 2.5, r"top_k must be a positive integer, got 2\.5"),
    ("hard_output", "yes", r"hard_output must be True or False, got 'yes'"),
    ("commitment_weight", -1, r"commitment_weight must be a non-negative finite number, got -1"),
    ("commitment_weight", "0.5", r"commitment_weight must be a non-negative finite number, got the str '0\.5'"),
    ("commitment_term", "l2", r"commitment_term must be one of .*got 'l2'"),
    ("check_finite", 1, r"check_finite must be True or False, got 1"),
    ("channel_first", "no", r"channel_first must be True or False, got 'no'"),
    ("standardize", "yes", r"standardize must be True or False, got 'yes'"),
    ("standardize", None, r"standardize=None: pass 'auto'"),
    ("standardize", {"output_scale": -1.0}, r"standardize\.output_scale must be a positive finite number, got -1\.0"),
    ("output_scale", "raw", r"output_scale must be one of \('input', 'standardized'\), got 'raw'"),
    ("renorm", "yes", r"renorm must be True or False, got 'yes'"),
    ("restart", {"cap": 2.0}, r"restart\.cap is a fraction .* in \(0, 1\], got 2\.0"),
    ("restart", "sometimes", r"restart must be a softvq\.parts\.Restart.*got 'sometimes'"),
    ("prototype_update", "sgd", r"prototype_update must be 'auto', 'ema'.*got 'sgd'"),
    ("prototype_update", None, r"prototype_update must be .*got None"),
    ("temperature", -1.0, r"temperature must be a positive finite number, got -1\.0"),
]


@pytest.mark.parametrize("option, value, message", BAD, ids=[f"{o}={v!r}"[:40] for o, v, _ in BAD])
def test_an_assignment_is_checked_as_the_constructor_checks_it(option, value, message):
    layer = DDCLQuantizer(64, 16)
    before = getattr(layer, option)
    with pytest.raises(ValueError, match=message):
        setattr(layer, option, value)
    assert getattr(layer, option) == before  # refused: nothing changed
    if option not in ("output_scale", "renorm", "commitment_term", "temperature_rate"):  # not constructor keywords
        with pytest.raises(ValueError):  # the constructor refuses it alike
            DDCLQuantizer(64, 16, **{option: value})


def test_the_refused_rate_would_have_run_the_temperature_away_and_a_stable_one_is_the_rule():
    """``temperature_rate = 100`` (accepted before) sent T to 5.9e78 in 20 steps; an accepted rate is the control's
    rule ``T <- T exp(rate (target - H))`` at the next step."""
    layer = trained(ddcl(), steps=1)
    with pytest.raises(ValueError, match="temperature_rate"):
        layer.temperature_rate = 100
    layer.temperature_rate = 0.05
    t = layer.temperature
    out = layer(torch.randn(256, 4, dtype=torch.float64))
    assert layer.temperature == pytest.approx(t * math.exp(0.05 * (layer.target_entropy - float(out.terms["entropy"]))),
                                              rel=1e-12)


def test_an_assigned_target_entropy_is_held_with_the_rate_kept_and_an_entropy_control_sets_both():
    layer = trained(ddcl(), steps=1)
    layer.target_entropy = 1.5  # a number: the target, the rate kept (0.01)
    assert (layer.target_entropy, layer.temperature_rate) == (1.5, 0.01)
    t = layer.temperature
    out = layer(torch.randn(256, 4, dtype=torch.float64))
    assert layer.temperature == pytest.approx(t * math.exp(0.01 * (1.5 - float(out.terms["entropy"]))), rel=1e-12)
    layer.target_entropy = EntropyControl(1.0, rate=0.1)
    assert (layer.target_entropy, layer.temperature_rate) == (1.0, 0.1)
    layer.target_entropy = "auto"  # the recipe's: log(K) / 2
    assert layer.target_entropy == 0.5 * math.log(16)
    layer.target_entropy = None  # T held where it is
    t = layer.temperature
    layer(torch.randn(256, 4, dtype=torch.float64))
    assert layer.temperature == t
    fresh = DDCLQuantizer(16, 4)
    fresh.target_entropy = None  # not calibrated yet: the constructor's T without a target, 1.0
    assert fresh.temperature == 1.0


@pytest.mark.parametrize("option, how", [("num_codes", "build a new DDCLQuantizer"),
                                         ("dim", "build a new DDCLQuantizer"),
                                         ("recipe", r"recipe=\.\.\.\), or assign those options themselves"),
                                         ("init", r"init_from_data\(tokens\)")])
def test_the_options_fixed_when_built_say_how_to_get_another_value(option, how):
    layer = DDCLQuantizer(16, 4)
    before = getattr(layer, option)
    with pytest.raises(AttributeError, match=rf"DDCLQuantizer\.{option} cannot be assigned .*fixed when the layer is "
                                             rf"built; .*{how}"):
        setattr(layer, option, "plain" if option == "recipe" else 8)
    assert getattr(layer, option) == before


def test_assigning_gradient_prototypes_trains_them_by_the_gradient_of_the_free_energy():
    """Before, ``prototype_update = Gradient()`` left the prototypes frozen (``requires_grad`` False) while ``out.loss``
    carried the codebook term. Now a training step moves them by ``-lr`` times the free energy's gradient,
    ``dF/dp_k = 2 / (N D) sum_n q_nk (p_k - z_n)`` (its weight 1), and no EMA step moves them in the forward."""
    layer = trained(ddcl(standardize=False, restart=None), steps=1)
    layer.prototype_update = Gradient()
    assert layer.prototypes.requires_grad
    optimizer = torch.optim.SGD([layer.prototypes], lr=0.5)
    z = torch.randn(64, 4, dtype=torch.float64) * 2 + 1
    p = layer.prototypes.detach().clone()
    out = layer(z)
    assert torch.equal(layer.prototypes.detach(), p)  # no EMA step
    out.loss.backward()
    q = out.probs.detach()
    expected = 2.0 / (64 * 4) * (q.sum(0)[:, None] * p - q.t() @ z)
    torch.testing.assert_close(layer.prototypes.grad, expected, rtol=1e-10, atol=1e-12)
    optimizer.step()
    torch.testing.assert_close(layer.prototypes.detach(), p - 0.5 * expected, rtol=1e-10, atol=1e-12)


def test_assigning_ema_after_gradient_stops_the_gradient_and_starts_the_statistics_at_the_codes():
    layer = trained(ddcl(recipe="plain", init="normal"), steps=2)
    assert layer.prototypes.requires_grad
    layer.prototype_update = "ema"
    assert not layer.prototypes.requires_grad
    p = layer.prototypes.detach().clone()
    assert torch.equal(layer.ema.weighted_sum, p) and torch.equal(layer.ema.mass, torch.ones(16, dtype=p.dtype))
    z = torch.randn(128, 4, dtype=torch.float64)
    out = layer(z)
    counts = torch.bincount(out.indices, minlength=16).to(p.dtype)
    sums = torch.zeros_like(p).index_add_(0, out.indices, z)
    expected = (0.99 * p + 0.01 * sums) / (0.99 + 0.01 * counts)[:, None]  # one pseudo-token at each code
    expected = torch.where((counts > 0)[:, None], expected, p)
    torch.testing.assert_close(layer.prototypes.detach(), expected, rtol=1e-12, atol=1e-12)


def test_assigning_output_scale_input_gives_the_codes_on_the_inputs_scale():
    """Before, ``standardize = Standardize(output_scale="input")`` was ignored. Now evaluation outputs the nearest
    code in the standardised space times the evaluation scale plus the mean, computed here from the standardiser's
    statistics."""
    layer = trained(ddcl())
    layer.standardize = Standardize(output_scale="input")
    assert layer.output_scale == "input" and layer.renorm  # Standardize()'s clip: batch renormalisation
    layer.eval()
    z = torch.randn(50, 4, dtype=torch.float64) * 2 + 1
    out = layer(z)
    mean, var = layer.standardizer.applied_mean, layer.standardizer.applied_var
    zs = (z - mean) / var.sqrt()
    p = layer.prototypes.detach()
    nearest = torch.cdist(zs, p).argmin(1)
    assert torch.equal(out.indices, nearest)
    torch.testing.assert_close(out.quantized, p[nearest] * var.sqrt() + mean, rtol=1e-12, atol=1e-12)
    layer.output_scale = 3.0  # the option alone: times a number
    torch.testing.assert_close(layer(z).quantized, 3.0 * p[nearest], rtol=1e-12, atol=1e-12)
    layer.standardize = False
    assert layer.output_scale == "standardized" and not layer.renorm
    with pytest.raises(ValueError, match=r"output_scale='input' acts on standardised tokens.*standardize=False"):
        layer.output_scale = "input"
    with pytest.raises(ValueError, match=r"renorm=True acts on standardised tokens"):
        layer.renorm = True
    torch.testing.assert_close(layer(z).quantized, p[torch.cdist(z, p).argmin(1)], rtol=0, atol=0)


def test_assigned_distance_hard_output_and_top_k_are_what_the_next_call_computes():
    layer = trained(ddcl(standardize=False, restart=None)).eval()
    z = torch.randn(30, 4, dtype=torch.float64)
    p = layer.prototypes.detach()
    layer.distance = "cosine"
    out = layer(z)
    pn, zn = F.normalize(p, dim=-1), F.normalize(z, dim=-1)
    assert torch.equal(out.indices, (zn @ pn.t()).argmax(1))
    torch.testing.assert_close(out.quantized, pn[out.indices], rtol=0, atol=0)
    layer.distance = "euclidean"
    layer.hard_output = False  # the soft centroid, sum_k q_k p_k
    out = layer(z)
    torch.testing.assert_close(out.quantized, out.probs @ p, rtol=1e-12, atol=1e-12)
    layer.hard_output = "auto"  # the recipe's: the argmax code
    assert layer.hard_output is True
    layer.top_k = 3
    out = layer(z)
    assert out.probs.shape == (30, 3) and out.prob_codes.shape == (30, 3)
    assert torch.equal(out.prob_codes.sort(1).values, torch.cdist(z, p).topk(3, largest=False).indices.sort(1).values)


def test_an_assigned_commitment_weight_keeps_its_term_and_a_commitment_sets_both():
    layer = trained(ddcl(standardize=False, restart=None)).eval()  # evaluation: the prototypes stay put
    z = torch.randn(40, 4, dtype=torch.float64)
    layer.commitment_weight = 0.5  # the weight of the "hard" term: 0.5 mse(z, p_argmax) (EMA prototypes: no other)
    out = layer(z)
    p = layer.prototypes.detach()
    torch.testing.assert_close(out.loss, 0.5 * F.mse_loss(z, p[torch.cdist(z, p).argmin(1)]), rtol=1e-12, atol=0)
    layer.commitment_weight = Commitment(0.25, "l_ols")
    assert (layer.commitment_weight, layer.commitment_term) == (0.25, "l_ols")
    layer.commitment_weight = 0.75
    assert (layer.commitment_weight, layer.commitment_term) == (0.75, "l_ols")


def test_assigned_restart_check_finite_and_channel_first_act_at_the_next_call():
    layer = ddcl(init="normal")
    layer.restart = None
    assert layer.dead_codes.threshold == 0
    layer.restart = "auto"
    assert layer.restart == Restart()
    layer.restart = {"threshold": 2.0, "cap": None}
    assert layer.restart == Restart(2.0, cap=None) and layer.dead_codes.threshold == 2.0
    bad = torch.full((4, 4), float("nan"), dtype=torch.float64)
    with pytest.raises(ValueError, match="non-finite"):
        layer.eval()(bad)
    layer.check_finite = False
    layer.eval()(bad)  # not checked
    layer.channel_first = True
    assert layer(torch.randn(2, 4, 3, 3, dtype=torch.float64)).quantized.shape == (2, 4, 3, 3)


# ---- HardVQ ---------------------------------------------------------------------------------------------------------
def test_hard_vq_options_are_checked_on_assignment_and_fixed_ones_say_so():
    layer = HardVQ(8, 4)
    for option, value, message in [("commitment_weight", -0.5, "commitment_weight must be a non-negative"),
                                   ("commitment_weight", 1e300, r"commitment_weight=1e\+300 is too large"),
                                   ("ema_decay", 1.5, r"ema_decay must be None or in \(0, 1\), got 1\.5"),
                                   ("epsilon", 0, "epsilon must be a positive finite number, got 0"),
                                   ("restart", {"cap": 2.0}, r"restart\.cap is a fraction"),
                                   ("check_finite", "yes", "check_finite must be True or False")]:
        before = getattr(layer, option)
        with pytest.raises(ValueError, match=message):
            setattr(layer, option, value)
        assert getattr(layer, option) == before
    for option in ("num_codes", "dim"):
        with pytest.raises(AttributeError, match=rf"HardVQ\.{option} cannot be assigned .*build a new HardVQ"):
            setattr(layer, option, 16)


def test_hard_vq_commitment_weight_assigned_is_the_losss_weight():
    torch.manual_seed(0)
    layer = HardVQ(8, 4).double()
    z = torch.randn(20, 4, dtype=torch.float64)
    layer.commitment_weight = 2.0
    out = layer(z)
    e = layer.prototypes.detach()[torch.cdist(z, layer.prototypes.detach()).argmin(1)]
    torch.testing.assert_close(out.loss, F.mse_loss(e, z) + 2.0 * F.mse_loss(z, e), rtol=1e-12, atol=0)


def test_hard_vq_ema_switched_on_is_vq_vaes_laplace_smoothed_step_from_the_current_codes_and_off_again():
    torch.manual_seed(0)
    layer = HardVQ(8, 4).double().train()
    layer(torch.randn(40, 4, dtype=torch.float64))  # a gradient-trained codebook so far
    layer.ema_decay = 0.9
    assert not layer.prototypes.requires_grad and layer.ema.epsilon == layer.epsilon
    p = layer.prototypes.detach().clone()
    z = torch.randn(60, 4, dtype=torch.float64) * 0.1
    out = layer(z)
    torch.testing.assert_close(out.loss, 0.25 * out.terms["commitment"], rtol=1e-12, atol=0)  # no codebook term
    counts = torch.bincount(out.indices, minlength=8).to(p.dtype)
    mass = 0.9 * 1.0 + 0.1 * counts  # the statistics started at the codes: one pseudo-token each
    total = 0.9 * p + 0.1 * torch.zeros_like(p).index_add_(0, out.indices, z)
    n = mass.sum()
    smoothed = (mass + 1e-5) / (n + 8 * 1e-5) * n
    expected = torch.where((counts > 0)[:, None], total / smoothed[:, None], p)
    torch.testing.assert_close(layer.prototypes.detach(), expected, rtol=1e-12, atol=1e-12)
    layer.epsilon = 1e-3
    assert layer.ema.epsilon == 1e-3
    layer.ema_decay = None  # a gradient-trained codebook again
    assert layer.prototypes.requires_grad and not hasattr(layer, "ema") and layer.dead_codes.decay == 0.99
    out = layer(z)
    e = layer.prototypes.detach()[out.indices]
    torch.testing.assert_close(out.loss, F.mse_loss(e, z) + 0.25 * F.mse_loss(z, e), rtol=1e-12, atol=0)
    assert "ema.mass" not in layer.state_dict()


# ---- the stacks and the readout: their own options ------------------------------------------------------------------
def test_residual_hierarchical_and_readout_options_are_checked_on_assignment():
    stack = softvq.ResidualDDCL(3, 8, 4)
    for option, value, message in [("quantize_dropout", "yes", "quantize_dropout must be True or False"),
                                   ("quantize_dropout_min_levels", 4, "must be at most num_quantizers=3, got 4"),
                                   ("seed", "3", "seed must be an integer, got '3'"),
                                   ("channel_first", 1, "channel_first must be True or False")]:
        with pytest.raises(ValueError, match=message):
            setattr(stack, option, value)
    stack.quantize_dropout, stack.quantize_dropout_min_levels = True, 2
    assert stack.train().active_levels() in (2, 3)
    for option in ("num_codes", "dim", "num_quantizers", "scale"):
        with pytest.raises(AttributeError, match=rf"ResidualDDCL\.{option} cannot be assigned"):
            setattr(stack, option, 2)
    with pytest.raises(ValueError, match="quantize_dropout must be True or False"):
        softvq.ResidualHardVQ(2, 8, 4, quantize_dropout=1)  # the constructor: the same check
    hier = softvq.HierarchicalDDCL([8, 4], 4, pool=2)
    with pytest.raises(ValueError, match=r"pool must be an int or hold one window per level above 0"):
        hier.pool = (2, 2)
    hier.pool = 1  # no pooling: level 1 quantizes level 0's grid
    out = hier(torch.randn(2, 4, 4, 4))
    assert out.quantized[1].shape == (2, 4, 4, 4)
    with pytest.raises(AttributeError, match=r"HierarchicalDDCL\.num_codes cannot be assigned"):
        hier.num_codes = (8, 8)
    readout = softvq.DDCLReadout(8, 4)
    with pytest.raises(ValueError, match="check_finite must be True or False"):
        readout.check_finite = "no"
    with pytest.raises(AttributeError, match=r"DDCLReadout\.num_codes cannot be assigned .*build a new DDCLReadout"):
        readout.num_codes = 4


# ---- former option names as constructor keywords: refused with what replaced them (softvq._compat.FORMER_OPTIONS) ---
FORMER = [  # (build, the error's account of the keyword)
    (lambda: DDCLQuantizer(64, 16, ema_decay=0.9),
     "ema_decay was replaced by prototype_update.decay; pass prototype_update=softvq.parts.Ema(decay=0.9, soft=False)"),
    (lambda: DDCLQuantizer(64, 16, codebook_weight=0.5),
     "codebook_weight was replaced by prototype_update.weight; pass "
     "prototype_update=softvq.parts.Gradient(weight=0.5)"),
    (lambda: DDCLQuantizer(64, 16, codebook_term="l_q"),
     "codebook_term was replaced by prototype_update.term; pass prototype_update=softvq.parts.Gradient(term='l_q')"),
    (lambda: DDCLQuantizer(64, 16, commitment_term="l_ols", commitment_weight=0.25),
     "commitment_term was replaced by commitment_weight.term; pass "
     "commitment_weight=softvq.parts.Commitment(weight=0.25, term='l_ols')"),
    (lambda: DDCLQuantizer(64, 16, temperature_rate=0.05),
     "temperature_rate was replaced by target_entropy.rate; pass "
     "target_entropy=softvq.parts.EntropyControl(target='auto', rate=0.05)"),
    (lambda: DDCLQuantizer(64, 16, init="normal", init_scale=0.1),
     "init_scale was replaced by init.scale; pass init=softvq.parts.NormalInit(scale=0.1)"),
    (lambda: DDCLQuantizer(64, 16, dead_code_threshold=2),
     "dead_code_threshold was replaced by restart.threshold; pass "
     "restart=softvq.parts.Restart(threshold=2.0, decay='auto', cap=0.25)"),
    (lambda: DDCLQuantizer(64, 16, dead_code_cap=0.5),
     "dead_code_cap was replaced by restart.cap; pass restart=softvq.parts.Restart(threshold=1.0, decay='auto', "
     "cap=0.5)"),
    (lambda: DDCLQuantizer(64, 16, output_scale="input"),
     "output_scale was replaced by standardize.output_scale; pass "
     "standardize=softvq.parts.Standardize(renorm_clip=(1.1, 0.1), output_scale='input')"),
    (lambda: DDCLQuantizer(64, 16, renorm=False), "renorm was replaced by standardize.renorm_clip; pass "
                                                  "standardize=softvq.parts.Standardize(renorm_clip=None, "
                                                  "output_scale='standardized')"),
    (lambda: HardVQ(64, 16, beta=0.5), "beta was replaced by commitment_weight; pass commitment_weight=0.5"),
    (lambda: HardVQ(64, 16, ema_decay=0.99, dead_code_threshold=1),
     "dead_code_threshold was replaced by restart.threshold; pass "
     "restart=softvq.parts.Restart(threshold=1.0, decay=0.99, cap=None)"),
    (lambda: softvq.ResidualHardVQ(2, 16, 4, beta=0.5), "beta was replaced by commitment_weight"),
    (lambda: softvq.ResidualDDCL(2, 16, 4, ema_decay=0.9), "ema_decay was replaced by prototype_update.decay"),
    (lambda: softvq.DDCLReadout(16, 4, ema_decay=0.9), "ema_decay was replaced by prototype_update.decay"),
    (lambda: softvq.HierarchicalDDCL([16, 8], 4, init_scale=0.5), "init_scale was replaced by init.scale"),
]


@pytest.mark.parametrize("build, account", FORMER, ids=[str(i) for i in range(len(FORMER))])
def test_a_former_option_name_is_refused_with_the_option_that_replaced_it(build, account):
    """Before: Python's bare "unexpected keyword argument". The error is a TypeError, as Python's, and a ValueError,
    as the library's other option errors; what it says to pass builds the layer the former keyword meant."""
    with pytest.raises(TypeError) as error:
        build()
    assert isinstance(error.value, ValueError)
    assert "an option of earlier versions" in str(error.value) and account in str(error.value)


def test_what_the_former_option_error_says_to_pass_builds_the_layer_the_keyword_meant():
    layer = DDCLQuantizer(64, 16, prototype_update=Ema(decay=0.9, soft=False))
    assert layer.prototype_update == Ema(0.9) and layer.ema.decay == 0.9
    hard = HardVQ(64, 16, commitment_weight=0.5)
    assert hard.commitment_weight == 0.5
    with pytest.raises(ValueError, match="beta"):  # a ValueError too
        HardVQ(64, 16, beta=0.5)
