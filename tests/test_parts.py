"""The parts of softvq.parts on their own, each against an independent reference: brute-force float64 entropies,
the EMA and running-usage formulas written out, bincount, and the layers that compose them."""

from __future__ import annotations

import math

import pytest
import torch

import softvq
from softvq.parts import (
    DeadCodeRestart,
    Ema,
    EmaPrototypes,
    NormalInit,
    Restart,
    Standardize,
    TemperatureControl,
    TokenStandardizer,
    code_counts,
    max_stable_rate,
)


def entropy64(z: torch.Tensor, p: torch.Tensor, t: float) -> float:
    """Mean H(Q) of Boltzmann assignments, by brute force in float64."""
    d = (z.double()[:, None, :] - p.double()[None]).square().sum(-1)
    q = torch.softmax(-d / t, dim=1)
    return float(-(q * q.clamp_min(1e-300).log()).sum(1).mean())


# ---- TemperatureControl ----------------------------------------------------------------------------------------------
def test_calibration_meets_the_entropy_target_by_brute_force():
    torch.manual_seed(0)
    z, p = torch.randn(300, 5), torch.randn(40, 5)
    control = TemperatureControl(40, target_entropy=2.0)
    assert control.temperature is None and not control.ready
    t = control.calibrate(z, p, keep=False)
    assert not control.ready  # used once (evaluation before training): nothing kept
    assert entropy64(z, p, float(t)) == pytest.approx(2.0, abs=1e-6)
    control.calibrate(z, p, keep=True)
    assert control.ready and control.temperature == pytest.approx(float(t), rel=0)
    assert control.temperature_t.dtype == torch.float64


def test_the_control_step_is_the_written_out_formula_and_binds_a_new_tensor():
    control = TemperatureControl(16, temperature=0.5, target_entropy=1.5, rate=0.05)
    before = control.temperature_t
    control.step(torch.tensor(2.0), tokens=10)
    assert control.temperature == pytest.approx(0.5 * math.exp(0.05 * (1.5 - 2.0)), rel=1e-15)
    assert before.item() == 0.5  # the tensor a pending backward holds is unchanged
    control.step(torch.tensor(float("nan")), tokens=10)  # a non-finite entropy leaves T
    assert control.temperature == pytest.approx(0.5 * math.exp(0.05 * (1.5 - 2.0)), rel=1e-15)
    fixed = TemperatureControl(16, temperature=0.5)
    fixed.step(torch.tensor(2.0), tokens=10)
    assert fixed.temperature == 0.5  # no target: T is fixed


def test_setting_t_switches_the_control_off_unless_kept_and_half_keeps_float64():
    control = TemperatureControl(16, temperature=0.5, target_entropy=1.5)
    control.set(0.3, keep_control=True)
    assert control.temperature == 0.3 and control.target_entropy == 1.5
    with pytest.warns(UserWarning, match="switches its entropy control off"):
        control.set(0.2)
    assert control.target_entropy is None and control.temperature == 0.2
    assert control.half().temperature_t.dtype == torch.float64 and control.temperature == 0.2


def test_the_part_resolves_the_layers_target_entropy_option_itself():
    """``"auto"`` is log(K) / 2 for the default recipe and no control for the plain one; an EntropyControl sets
    target and rate; ``None`` before calibration fixes T at 1.0; a bad pair changes nothing."""
    auto = TemperatureControl.from_options(64, None, "auto", dim=8, auto=True)
    assert auto.target_entropy == 0.5 * math.log(64) and auto.rate == softvq.parts.temperature.DEFAULT_RATE
    assert not auto.ready  # calibrated on the first training batch
    plain = TemperatureControl.from_options(64, None, "auto", dim=8, auto=False)
    assert plain.target_entropy is None and plain.temperature == 1.0
    given = TemperatureControl.from_options(64, 0.7, softvq.parts.EntropyControl(2.0, 0.02), dim=8, auto=False)
    assert (given.target_entropy, given.rate, given.temperature) == (2.0, 0.02, 0.7)
    auto.set_target(softvq.parts.EntropyControl(1.5, 0.05))
    assert (auto.target_entropy, auto.rate) == (1.5, 0.05)
    auto.set_target(3.0)  # a number keeps the rate
    assert (auto.target_entropy, auto.rate) == (3.0, 0.05)
    with pytest.raises(ValueError, match=r"below log\(num_codes\)"):
        auto.set_target(softvq.parts.EntropyControl(math.log(64), 0.01))
    assert (auto.target_entropy, auto.rate) == (3.0, 0.05)  # refused whole: neither changed
    auto.set_target("auto")
    assert auto.target_entropy == 0.5 * math.log(64)
    auto.set_target(None)  # not calibrated yet: T held at 1.0
    assert auto.target_entropy is None and auto.temperature == 1.0
    plain.set_target("auto")
    assert plain.target_entropy is None


@pytest.mark.parametrize("kwargs,match", [
    ({"target_entropy": math.log(16)}, r"below log\(num_codes\)"),
    ({"target_entropy": 1.0, "rate": 1.01 * max_stable_rate(16)}, "too large for the entropy control"),
    ({}, "needs a temperature or a target_entropy"),
    ({"temperature": -1.0}, "temperature"),
])
def test_temperature_control_refuses_bad_options(kwargs, match):
    with pytest.raises(ValueError, match=match):
        TemperatureControl(16, **kwargs)


# ---- EmaPrototypes -------------------------------------------------------------------------------------------------
def test_hard_ema_step_matches_the_formula_and_an_unwon_code_stays():
    torch.manual_seed(0)
    codebook = torch.randn(4, 3)
    ema = EmaPrototypes(codebook, decay=0.9)
    z, indices = torch.randn(6, 3), torch.tensor([0, 0, 1, 1, 1, 3])
    counts = code_counts(indices, 4, torch.float32)
    mass = 0.9 * 1.0 + 0.1 * counts.double()
    total = 0.9 * codebook.double() + 0.1 * torch.stack([z.double()[indices == k].sum(0) for k in range(4)])
    start = codebook.clone()
    ema.step_(codebook, z, indices=indices, counts=counts)
    torch.testing.assert_close(ema.mass.double(), mass, rtol=1e-6, atol=1e-7)
    torch.testing.assert_close(codebook.double()[[0, 1, 3]], (total / mass[:, None])[[0, 1, 3]], rtol=1e-5, atol=1e-6)
    assert torch.equal(codebook[2], start[2])  # code 2 won nothing: it stays, bit for bit


def test_soft_ema_step_weights_tokens_by_their_assignments():
    torch.manual_seed(1)
    codebook = torch.randn(3, 2)
    ema = EmaPrototypes(codebook, decay=0.5)
    z, q = torch.randn(5, 2), torch.softmax(torch.randn(5, 3), dim=1)
    mass = 0.5 + 0.5 * q.double().sum(0)
    total = 0.5 * codebook.double() + 0.5 * q.double().t() @ z.double()
    ema.step_(codebook, z, q=q)
    torch.testing.assert_close(codebook.double(), total / mass[:, None], rtol=1e-5, atol=1e-6)


def test_laplace_smoothed_ema_is_vq_vaes_update_and_restart_resets_the_statistics():
    torch.manual_seed(2)
    codebook = torch.randn(4, 2)
    ema = EmaPrototypes(codebook, decay=0.99, epsilon=1e-5)
    z, indices = torch.randn(8, 2), torch.tensor([0, 1, 1, 1, 2, 2, 0, 1])
    counts = code_counts(indices, 4, torch.float32)
    size = 0.99 + 0.01 * counts.double()
    total = 0.99 * codebook.double() + 0.01 * torch.stack([z.double()[indices == k].sum(0) for k in range(4)])
    n = size.sum()
    smoothed = (size + 1e-5) / (n + 4 * 1e-5) * n
    start = codebook.clone()
    ema.step_(codebook, z, indices=indices, counts=counts)
    torch.testing.assert_close(codebook.double()[:3], (total / smoothed[:, None])[:3], rtol=1e-5, atol=1e-6)
    assert torch.equal(codebook[3], start[3])
    dead = torch.tensor([False, False, False, True])
    codebook[3] = torch.tensor([5.0, -5.0])
    ema.restart_(dead, codebook, 2.0)
    assert ema.mass[3].item() == 2.0 and ema.weighted_sum[3].tolist() == [10.0, -10.0]
    assert ema.half().mass.dtype == torch.float32  # EMA steps are below bf16 resolution


# ---- DeadCodeRestart -----------------------------------------------------------------------------------------------
def test_code_counts_is_bincount():
    indices = torch.randint(0, 7, (100,))
    assert torch.equal(code_counts(indices, 7, torch.float32), torch.bincount(indices, minlength=7).float())


def test_usage_starts_from_the_first_batch_then_decays_and_restart_moves_exactly_the_dead_codes():
    restart = DeadCodeRestart(4, Restart(1.0, decay=0.5, cap=None))
    codebook = torch.zeros(4, 2)
    z = torch.arange(10.0).reshape(5, 2) + 1  # no row is zero
    assert not restart.restart_(codebook, z).any()  # no batch seen: nothing restarts
    restart.update(torch.tensor([4.0, 0.0, 2.0, 0.5]))
    assert restart.usage.tolist() == [4.0, 0.0, 2.0, 0.5]
    restart.update(torch.tensor([0.0, 4.0, 2.0, 1.0]))
    assert restart.usage.tolist() == [2.0, 2.0, 2.0, 0.75]
    dead = restart.restart_(codebook, z)
    assert dead.tolist() == [False, False, False, True] and restart.restarts == 1
    assert any(torch.equal(codebook[3], row) for row in z) and not codebook[:3].any()
    assert restart.usage[3].item() == 1.0  # a restarted code starts at the threshold


def test_the_cap_lowers_the_threshold_to_a_fraction_of_the_mean_usage():
    restart = DeadCodeRestart(4, Restart(1.0, decay=0.5, cap=0.25))
    restart.update(torch.tensor([0.5, 0.5, 0.4, 0.2]))  # mean 0.4: the threshold in effect is 0.1
    assert not restart.restart_(torch.zeros(4, 2), torch.ones(3, 2)).any()
    uncapped = DeadCodeRestart(4, Restart(1.0, decay=0.5, cap=None))
    uncapped.update(torch.tensor([0.5, 0.5, 0.4, 0.2]))
    assert uncapped.restart_(torch.zeros(4, 2), torch.ones(3, 2)).all()


@pytest.mark.parametrize("num_codes,tokens,decay", [(512, 8192, 0.9), (4096, 8192, 1 - 8192 / (4096 * 64)),
                                                      (16384, 8192, 0.97)])
def test_auto_decay_remembers_64_tokens_per_code(num_codes, tokens, decay):
    assert DeadCodeRestart(num_codes).usage_decay(tokens) == pytest.approx(decay, abs=1e-15)


# ---- the layers compose the parts ----------------------------------------------------------------------------------
def test_both_layers_hold_the_same_parts_and_their_options_have_one_place():
    ddcl, hard = softvq.DDCLQuantizer(16, 4), softvq.HardVQ(16, 4, ema_decay=0.9, restart=Restart())
    assert isinstance(ddcl.dead_codes, DeadCodeRestart) and isinstance(hard.dead_codes, DeadCodeRestart)
    assert isinstance(ddcl.ema, EmaPrototypes) and isinstance(hard.ema, EmaPrototypes)
    assert isinstance(ddcl.temperature_control, TemperatureControl)
    ddcl.target_entropy = 1.0  # the layer's option is its part's
    assert ddcl.temperature_control.target_entropy == 1.0
    ddcl.dead_codes.settings = Restart(0.5)  # the part holds the layer's restart option whole
    assert ddcl.restart == Restart(0.5) and ddcl.dead_codes.threshold == 0.5
    hard.restart = None  # the layer's restart option is its part's settings, both ways
    assert hard.dead_codes.threshold == 0 and hard.restart is None
    assert not hasattr(softvq.HardVQ(16, 4), "ema")  # a gradient-trained codebook has no EMA part


def test_a_state_dict_of_the_former_layout_loads_under_todays_names():
    torch.manual_seed(0)
    for layer in (softvq.DDCLQuantizer(8, 3), softvq.HardVQ(8, 3, ema_decay=0.9, restart=Restart())):
        layer.train()(torch.randn(64, 3))
        state = layer.state_dict()
        former = {"dead_codes.usage": "usage", "ema.mass": "ema_mass", "ema.weighted_sum": "ema_sum"}
        if isinstance(layer, softvq.HardVQ):
            former.update({"ema.mass": "ema_cluster_size", "ema.weighted_sum": "ema_embed_sum",
                           "prototypes": "embedding"})
        old = {former.get(k, k): v for k, v in state.items()}
        fresh = type(layer)(8, 3, **({"ema_decay": 0.9, "restart": Restart()}
                                     if isinstance(layer, softvq.HardVQ) else {}))
        fresh.load_state_dict(old)  # strict
        for key, value in state.items():
            if isinstance(value, torch.Tensor):
                assert torch.equal(fresh.state_dict()[key], value), key


def test_each_stack_states_its_per_level_settings():
    """The hierarchy's levels are the plain layer (no restarts) unless recipe='auto' gives each the recipe; the
    residual stacks build every level alike: DDCL's defaults, and HardVQ with EMA 0.99 and restarts below 1."""
    plain = softvq.HierarchicalDDCL([16, 8], 4, pool=2)
    assert all(level.recipe == "plain" and level.restart is None and level.target_entropy is None
               for level in plain.levels)
    auto = softvq.HierarchicalDDCL([16, 8], 4, pool=2, recipe="auto")
    assert all(level.restart == Restart() and level.prototype_update == Ema() and level.target_entropy
               for level in auto.levels)
    assert all(level.restart == Restart() and level.prototype_update == Ema()
               for level in softvq.ResidualDDCL(2, 16, 4).levels)
    assert all(level.ema_decay == 0.99 and level.restart == Restart(1.0, decay=0.99, cap=None)
               for level in softvq.ResidualHardVQ(2, 16, 4).levels)


# ---- Restart: dead-code restart's settings, one option of both layers ----------------------------------------------
@pytest.mark.parametrize(("kwargs", "match"), [
    ({"threshold": 0.0}, r"restart\.threshold must be a positive finite number, got 0\.0"),
    ({"threshold": float("nan")}, r"restart\.threshold"),
    ({"decay": 1.0}, r"restart\.decay must be in \(0, 1\), got 1\.0"),
    ({"decay": "fast"}, r"restart\.decay"),
    ({"cap": 0.0}, r"restart\.cap must be a positive"),
])
def test_restart_refuses_bad_settings_naming_the_field(kwargs, match):
    with pytest.raises(ValueError, match=match):
        Restart(**kwargs)


def test_restart_is_taken_as_a_mapping_and_anything_else_is_refused():
    assert Restart.of({"threshold": 2, "cap": None}) == Restart(2.0, "auto", None)
    assert Restart.of(None) is None
    with pytest.raises(ValueError, match=r"unknown field\(s\) \['treshold'\]"):
        Restart.of({"treshold": 2})
    with pytest.raises(ValueError, match=r"restart must be a softvq\.parts\.Restart.*got 1\.0"):
        softvq.DDCLQuantizer(8, 2, restart=1.0)
    with pytest.raises(ValueError, match=r"restart must be a softvq\.parts\.Restart.*got 'auto'"):
        softvq.HardVQ(8, 2, restart="auto")  # HardVQ has no recipe: restarts are off unless given


def test_restart_auto_is_the_recipes_and_none_switches_restarts_off():
    assert softvq.DDCLQuantizer(8, 2).restart == Restart(1.0, "auto", 0.25)
    assert softvq.DDCLQuantizer(8, 2, recipe="plain").restart is None
    assert softvq.DDCLQuantizer(8, 2, restart=None).dead_codes.threshold == 0
    assert softvq.HardVQ(8, 2).restart is None


def test_the_restart_part_holds_its_settings_whole_and_resolves_auto_itself():
    """The part, not the layer, decides what ``"auto"`` means (the ``auto`` it was built with; refused without one) and
    whether restarts are on; a layer's assignment reaches it unchanged, both ways. Without restarts the usage decays at
    ``idle_decay`` (HardVQ's EMA decay, 0.99 without EMA); with them, at the settings' decay."""
    part = DeadCodeRestart(8, "auto", auto=Restart(2.0, decay=0.5))
    assert part.settings == Restart(2.0, decay=0.5) and (part.threshold, part.decay, part.cap) == (2.0, 0.5, 0.25)
    part.settings = None
    assert part.settings is None and (part.threshold, part.decay, part.cap) == (0.0, "auto", None)
    part.settings = {"threshold": 3.0, "cap": None}  # a config file's mapping
    assert part.settings == Restart(3.0, "auto", None)
    with pytest.raises(ValueError, match=r"restart must be a softvq\.parts\.Restart.*got 'auto'"):
        DeadCodeRestart(8, "auto")  # a part of a layer without a recipe
    ddcl = softvq.DDCLQuantizer(8, 2, recipe="plain", restart=Restart(2.0))
    ddcl.restart = "auto"  # the plain recipe's: off
    assert ddcl.dead_codes.settings is None and ddcl.restart is None
    hard = softvq.HardVQ(8, 2, ema_decay=0.9)
    assert hard.dead_codes.decay == 0.9  # the usage tracked without restarts, at the EMA's decay
    hard.restart = Restart(1.0, decay=0.5)
    assert hard.dead_codes.decay == 0.5
    hard.ema_decay = None
    hard.restart = None
    assert hard.dead_codes.decay == 0.99


@pytest.mark.parametrize("layer", ["ddcl", "hard"])
def test_a_restart_given_moves_the_codes_below_its_threshold_and_none_moves_nothing(layer):
    """The codes that won fewer than 4 of a batch's 40 tokens (counted here from the indices) are the ones
    ``Restart(4.0)`` moves (HardVQ after the batch; DDCL before the next one), and ``restart=None`` moves none."""
    torch.manual_seed(3)
    make = (lambda r: softvq.DDCLQuantizer(12, 3, restart=r, init="normal")) if layer == "ddcl" else \
        (lambda r: softvq.HardVQ(12, 3, ema_decay=0.9, restart=r))
    restarting, still = make(Restart(4.0, decay=0.5, cap=None)), make(Restart(4.0, decay=0.5, cap=None))
    still.load_state_dict(restarting.state_dict())  # the same codes (a state loads into a layer of its settings) ...
    still.restart = None  # ... and no restarts
    z = torch.randn(40, 3) * 0.3 + 2.0
    counts = torch.bincount(restarting.train()(z).indices, minlength=12)
    if layer == "ddcl":
        restarting(z)
    assert 0 < restarting.restarts == int((counts < 4).sum()) < 12
    still.train()(z), still(z)
    assert still.restarts == 0


# ---- NormalInit: the init option's alternative to "data" -----------------------------------------------------------
def test_normal_init_draws_the_prototypes_at_its_scale_and_data_init_waits_for_a_batch():
    torch.manual_seed(5)
    reference = torch.randn(6, 3) * 0.25  # the same draw by hand
    torch.manual_seed(5)
    layer = softvq.DDCLQuantizer(6, 3, init=NormalInit(0.25))
    assert torch.equal(layer.prototypes.detach(), reference) and layer.initialized
    assert softvq.DDCLQuantizer(6, 3, init="normal").init == NormalInit(1.0)
    assert softvq.DDCLQuantizer(6, 3, init={"scale": 2.0}).init == NormalInit(2.0)  # a config file's mapping
    assert not softvq.DDCLQuantizer(6, 3).initialized  # "data": the first training batch sets them


@pytest.mark.parametrize(("init", "match"), [
    ({"scale": 0.0}, r"init\.scale must be a positive finite number, got 0\.0"),
    ({"sigma": 1.0}, r"unknown field\(s\) \['sigma'\]"),
    ("kmeans", r"init must be 'data', 'normal', a softvq\.parts\.NormalInit.*got 'kmeans'"),
])
def test_normal_init_refuses_bad_settings(init, match):
    with pytest.raises(ValueError, match=match):
        softvq.DDCLQuantizer(6, 3, init=init)


def test_the_standardiser_holds_the_standardize_option_whole_and_maps_codes_to_its_output_scale():
    """``settings`` reads back what was assigned (on/off, clip, output scale together), ``"auto"`` is the ``auto`` the
    part was built with, and ``output`` / ``evaluation_output`` put codes on the output scale as written out here:
    ``codes * std + mean`` for ``"input"``, ``codes * s`` for a number, the codes themselves otherwise or when off."""
    part = TokenStandardizer.from_setting(3, Standardize((1.5, 0.2), "input"), auto=False)
    assert part.settings == Standardize((1.5, 0.2), "input") and part.on and part.renorm
    codes, mean, std = torch.randn(5, 3), torch.randn(3), torch.rand(3) + 0.5
    torch.testing.assert_close(part.output(codes, mean, std), codes * std + mean, rtol=0, atol=0)
    part.settings = Standardize(None, 2.0)
    assert part.settings == Standardize(None, 2.0) and not part.renorm and part.renorm_clip == (1.5, 0.2)
    torch.testing.assert_close(part.output(codes, mean, std), codes * 2.0, rtol=0, atol=0)
    torch.testing.assert_close(part.evaluation_output(codes), codes * 2.0, rtol=0, atol=0)
    part.settings = "auto"  # the plain recipe's: off
    assert part.settings is None and not part.on and part.output_scale == "standardized"
    assert part.output(codes, None, None) is codes and part.evaluation_output(codes) is codes
    with pytest.raises(ValueError, match=r"output_scale='input' acts on standardised tokens"):
        part.output_scale = "input"
    with pytest.raises(ValueError, match=r"standardize=None: pass 'auto'"):
        part.settings = None
    layer = softvq.DDCLQuantizer(8, 3)
    layer.standardize = Standardize(None, "input")  # the layer's option goes to its part, whole
    assert layer.standardizer.settings == Standardize(None, "input")
    assert layer.standardize and not layer.renorm and layer.output_scale == "input"
    layer.train()(torch.randn(64, 3) * 3.0 + 1.0)  # statistics far from (0, 1)
    mean, std = (s.clone() for s in layer.standardizer.evaluation_statistics())
    expected = layer.prototypes.detach() * std + mean
    torch.testing.assert_close(layer.codebook, expected, rtol=0, atol=0)
