"""Checkpoints and records of earlier versions load as they were trained (softvq._compat): tiny VQ-VAE checkpoints of
every quantizer kind written before the layers were composed of softvq.parts (tests/fixtures/make_checkpoints.py)
reconstruct their saved batch as they did, and a run recorded with a former option name resumes."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

import softvq
from softvq.cli import config
from softvq.models import load_vqvae

FIXTURES = Path(__file__).parent / "fixtures"
KINDS = ("hard", "hard_ema_restart", "ddcl", "ddcl_2level", "rddcl", "rhard")


def rounding_tolerance(model: torch.nn.Module) -> float:
    """How far, relative to its largest magnitude, a float32 forward of ``model`` may land from the same forward on
    another CPU: ``8 u`` times the length of its sums along the way (each convolution's or linear layer's fan-in,
    plus the quantizer's codes and dimensions): a sum of ``n`` terms in any order is within ``n u`` of the exact one,
    relative to its terms' magnitudes (Higham 2002, section 4.2); the factor 8 covers the elementwise functions and the
    terms' magnitudes above the result's. The fixtures were written with one CPU's kernels (at a967bc2); another CPU
    sums in other orders, and the same CPU under another thread count may too."""
    depth = 0
    for module in model.modules():
        if isinstance(module, torch.nn.modules.conv._ConvNd):
            depth += module.in_channels // module.groups * int(torch.tensor(module.kernel_size).prod())
        elif isinstance(module, torch.nn.Linear):
            depth += module.in_features
        elif isinstance(module, softvq.DDCLQuantizer | softvq.HardVQ):
            depth += module.num_codes + module.dim
    return 8 * 2.0 ** -24 * depth


@pytest.mark.parametrize("kind", KINDS)
def test_an_old_checkpoint_loads_and_reconstructs_as_saved(kind):
    path = FIXTURES / f"vqvae_{kind}.ckpt"
    saved = torch.load(path, weights_only=True)["softvq_fixture"]
    model = load_vqvae(path)
    with torch.no_grad():
        recon = model(saved["batch"]).reconstruction
    want = saved["reconstruction"]
    assert recon.shape == want.shape and recon.dtype == want.dtype
    assert float((recon - want).abs().max() / want.abs().max()) <= rounding_tolerance(model)  # no CPU's bits assumed
    layers = [model.quantizer] if not hasattr(model.quantizer, "levels") else list(model.quantizer.levels)
    assert all(isinstance(layer.dead_codes, softvq.parts.DeadCodeRestart) for layer in layers)
    if kind.startswith("hard") or kind == "rhard":
        assert "beta" not in model.hparams["quantizer_kwargs"]  # saved again under today's name
        assert all(layer.commitment_weight == (0.5 if kind == "hard" else 0.25) for layer in layers)


def test_a_run_recorded_with_a_former_option_name_resumes_and_a_changed_value_is_named():
    recorded = {"quantizer": ["hard"], "hard": {"beta": 0.25, "ema_decay": 0.99}}
    assert config.config_changes(recorded, {"quantizer": ["hard"], "hard": {"commitment_weight": 0.25,
                                                                             "ema_decay": 0.99}}) == {}
    assert config.config_changes(recorded, {"quantizer": ["hard"], "hard": {"commitment_weight": 0.5,
                                                                             "ema_decay": 0.99}}) == {
        "hard.commitment_weight": [0.25, 0.5]}
    hparams = {"quantizer": "ddcl", "quantizer_kwargs": {"beta": 1.0}}  # not a hard quantizer's: left as it is
    assert softvq._compat.upgrade_settings(config.flat(hparams)) == {"quantizer": "ddcl",
                                                                     "quantizer_kwargs.beta": 1.0}


def test_the_layers_take_only_todays_option_names():
    with pytest.raises(TypeError, match="beta"):
        softvq.HardVQ(8, 4, beta=0.25)


@pytest.mark.parametrize("name", ["temperature", "standardize", "prototype_update", "hard_output"])
def test_none_is_off_so_an_option_with_nothing_to_switch_off_refuses_it_and_a_record_reads_it_as_auto(name):
    with pytest.raises(ValueError, match=rf"{name}=None: pass 'auto'"):
        softvq.DDCLQuantizer(8, 2, **{name: None})
    assert softvq._compat.upgrade_quantizer_kwargs("ddcl", {name: None}) == {name: "auto"}
    assert softvq._compat.upgrade_quantizer_kwargs("hard", {"epsilon": None}) == {"epsilon": None}
    saved = config.flat({"quantizer": "ddcl", "quantizer_kwargs": {name: None}})
    assert softvq._compat.upgrade_settings(saved)[f"quantizer_kwargs.{name}"] == "auto"
    # "auto" resolves as the former None did: the recipe's value
    assert getattr(softvq.DDCLQuantizer(8, 2, **{name: "auto"}), name, None) == getattr(softvq.DDCLQuantizer(8, 2),
                                                                                        name, None)


FLAT_RESTARTS = [  # (quantizer, a record's flat restart options, the restart setting they meant)
    ("ddcl", {"dead_code_threshold": "auto"}, {"threshold": 1.0, "decay": "auto", "cap": 0.25}),
    ("ddcl", {"dead_code_threshold": None, "dead_code_cap": None}, {"threshold": 1.0, "decay": "auto", "cap": None}),
    ("ddcl", {"recipe": "plain", "dead_code_threshold": "auto"}, None),
    ("ddcl", {"dead_code_threshold": 0.0, "dead_code_decay": 0.9}, None),
    ("ddcl", {"dead_code_threshold": 4.0, "dead_code_decay": 0.5, "dead_code_cap": None},
     {"threshold": 4.0, "decay": 0.5, "cap": None}),
    ("hard", {"ema_decay": 0.95, "dead_code_threshold": 1.0}, {"threshold": 1.0, "decay": 0.95, "cap": None}),
    ("hard", {"ema_decay": None, "dead_code_threshold": 2}, {"threshold": 2.0, "decay": 0.99, "cap": None}),
    ("hard", {"dead_code_threshold": 0.0}, None),
    ("rhard", {"dead_code_threshold": 1.0}, {"threshold": 1.0, "decay": 0.99, "cap": None}),
]


@pytest.mark.parametrize(("quantizer", "flat", "restart"), FLAT_RESTARTS)
def test_a_records_flat_restart_options_become_the_restart_it_meant(quantizer, flat, restart):
    """Checkpoints' hyperparameters and runs' config.json before ``restart`` took a Restart: the threshold, decay and
    cap (DDCL's "auto" threshold the recipe's; HardVQ's usage at its EMA decay, uncapped) become one setting."""
    upgraded = softvq._compat.upgrade_quantizer_kwargs(quantizer, flat)
    assert upgraded["restart"] == restart and not any(k.startswith("dead_code") for k in upgraded)
    dotted = softvq._compat.upgrade_settings(config.flat({"quantizer": [quantizer], quantizer: flat,
                                                          "quantizer_kwargs": flat}))
    for section in (quantizer, "quantizer_kwargs"):
        assert ({k.split(".", 2)[2]: v for k, v in dotted.items() if k.startswith(f"{section}.restart.")} or
                dotted[f"{section}.restart"]) == restart


def test_a_layer_from_upgraded_flat_options_is_the_layer_they_built():
    """The golden file's HardVQ "EMA 0.99 + restart 1" was recorded with ``dead_code_threshold=1.0``: the upgraded
    options build a layer whose restart part has the settings the old one had (and the golden test then pins its
    numbers bit for bit)."""
    old = softvq._compat.upgrade_quantizer_kwargs("hard", {"ema_decay": 0.99, "dead_code_threshold": 1.0})
    layer = softvq.HardVQ(16, 8, **old)
    assert (layer.dead_codes.threshold, layer.dead_codes.decay, layer.dead_codes.cap) == (1.0, 0.99, None)
    assert layer.restart == softvq.Restart(1.0, decay=0.99, cap=None)
    saved = softvq._compat.upgrade_quantizer_kwargs("hard", {"restart": softvq.Restart(1.0, decay=0.99, cap=None)})
    assert saved["restart"] == {"threshold": 1.0, "decay": 0.99, "cap": None}  # plain types: weights_only loads it


@pytest.mark.parametrize(("flat", "init"), [
    ({"init": "normal", "init_scale": 0.1}, {"scale": 0.1}),
    ({"init": "data", "init_scale": 1.0}, "data"),
    ({"init_scale": 1.0}, "data"),
])
def test_a_records_init_scale_becomes_the_normal_init_it_meant(flat, init):
    assert softvq._compat.upgrade_quantizer_kwargs("ddcl", flat) == {"init": init}
    dotted = softvq._compat.upgrade_settings(config.flat({"quantizer": ["ddcl"], "ddcl": flat}))
    assert "ddcl.init_scale" not in dotted
    assert (dotted["ddcl.init"] if init == "data" else {"scale": dotted["ddcl.init.scale"]}) == init
    layer = softvq.DDCLQuantizer(4, 2, **softvq._compat.upgrade_quantizer_kwargs("ddcl", flat))
    assert layer.init == (init if init == "data" else softvq.parts.NormalInit(**init))


@pytest.mark.parametrize(("flat", "update"), [
    ({"ema_decay": 0.9}, {"decay": 0.9, "soft": False}),
    ({"prototype_update": "soft_ema", "ema_decay": 0.5, "codebook_term": "free_energy"}, {"decay": 0.5, "soft": True}),
    ({"recipe": "plain", "codebook_term": "l_q", "codebook_weight": 2.0, "ema_decay": 0.99},
     {"term": "l_q", "weight": 2.0}),
    ({"prototype_update": "gradient", "codebook_weight": 0.0}, {"term": "free_energy", "weight": 0.0}),
])
def test_a_records_flat_update_options_become_the_prototype_update_they_meant(flat, update):
    """ema_decay (the EMA's) and codebook_term / codebook_weight (the gradient's), before prototype_update took an Ema
    or a Gradient: the kind recorded (the recipe's for "auto") decides which of them meant something."""
    upgraded = softvq._compat.upgrade_quantizer_kwargs("ddcl", flat)
    assert upgraded["prototype_update"] == update
    assert not {"ema_decay", "codebook_term", "codebook_weight"} & set(upgraded)
    dotted = softvq._compat.upgrade_settings(config.flat({"quantizer": ["ddcl"], "ddcl": flat}))
    assert {k.rsplit(".", 1)[1]: v for k, v in dotted.items() if k.startswith("ddcl.prototype_update.")} == update
    assert softvq._compat.upgrade_quantizer_kwargs("hard", {"ema_decay": 0.9}) == {"ema_decay": 0.9}  # HardVQ's own
    layer = softvq.DDCLQuantizer(4, 2, **upgraded)
    assert layer.prototype_update == (softvq.parts.Ema(**update) if "decay" in update else
                                      softvq.parts.Gradient(**update))


@pytest.mark.parametrize(("flat", "target_entropy"), [
    ({"target_entropy": 2.0, "temperature_rate": 0.05}, {"target": 2.0, "rate": 0.05}),
    ({"target_entropy": 2.0, "temperature_rate": 0.01}, 2.0),  # the default gain: the target alone
    ({"target_entropy": None, "temperature_rate": 0.05}, None),  # no control: the gain did nothing
    ({"recipe": "plain", "temperature_rate": 0.05}, "auto"),  # the plain recipe's "auto" is no control either
    ({"temperature_rate": 0.05}, {"target": "auto", "rate": 0.05}),
])
def test_a_records_temperature_rate_becomes_the_entropy_control_it_meant(flat, target_entropy):
    upgraded = softvq._compat.upgrade_quantizer_kwargs("ddcl", flat)
    assert upgraded.get("target_entropy", "auto") == target_entropy and "temperature_rate" not in upgraded
    dotted = softvq._compat.upgrade_settings(config.flat({"quantizer": ["ddcl"], "ddcl": flat}))
    fields = {k.rsplit(".", 1)[1]: v for k, v in dotted.items() if k.startswith("ddcl.target_entropy.")}
    assert (fields or dotted.get("ddcl.target_entropy", "auto")) == target_entropy
    layer = softvq.DDCLQuantizer(64, 2, temperature="auto" if target_entropy else 1.0, **upgraded)
    rate_acted = isinstance(target_entropy, dict)
    assert layer.temperature_rate == (0.05 if rate_acted else 0.01)


@pytest.mark.parametrize(("flat", "commitment"), [
    ({"commitment_term": "l_ols", "commitment_weight": 0.0}, 0.0),  # the former default term, inert at weight 0
    ({"commitment_term": "hard", "commitment_weight": 0.25}, 0.25),
    ({"commitment_term": "l_ols", "commitment_weight": 0.5}, {"weight": 0.5, "term": "l_ols"}),
    ({"commitment_term": "free_energy"}, 0.0),
])
def test_a_records_commitment_term_becomes_the_commitment_it_meant(flat, commitment):
    upgraded = softvq._compat.upgrade_quantizer_kwargs("ddcl", flat)
    assert upgraded == {"commitment_weight": commitment}
    dotted = softvq._compat.upgrade_settings(config.flat({"quantizer": ["ddcl"], "ddcl": flat}))
    fields = {k.rsplit(".", 1)[1]: v for k, v in dotted.items() if k.startswith("ddcl.commitment_weight.")}
    assert (fields or dotted["ddcl.commitment_weight"]) == commitment and "ddcl.commitment_term" not in dotted
    layer = softvq.DDCLQuantizer(8, 2, **upgraded)
    term = flat.get("commitment_term") if isinstance(commitment, dict) else "hard"
    assert (layer.commitment_weight, layer.commitment_term) == (flat.get("commitment_weight", 0.0), term)


@pytest.mark.parametrize(("flat", "standardize"), [
    ({"standardize": True, "renorm": True, "renorm_clip": [1.1, 0.1], "output_scale": "standardized"},
     {"renorm_clip": [1.1, 0.1], "output_scale": "standardized"}),
    ({"standardize": True, "renorm": False, "renorm_clip": [1.1, 0.1], "output_scale": "input"},
     {"renorm_clip": None, "output_scale": "input"}),
    ({"standardize": False, "renorm": True, "output_scale": "standardized"}, False),
    ({"recipe": "plain", "standardize": "auto", "output_scale": 0.2}, False),
])
def test_a_records_flat_standardiser_options_become_the_standardize_they_meant(flat, standardize):
    upgraded = softvq._compat.upgrade_quantizer_kwargs("ddcl", flat)
    assert upgraded["standardize"] == standardize
    assert not {"renorm", "renorm_clip", "output_scale"} & set(upgraded)
    dotted = softvq._compat.upgrade_settings(config.flat({"quantizer": ["ddcl"], "ddcl": flat}))
    fields = {k.rsplit(".", 1)[1]: v for k, v in dotted.items() if k.startswith("ddcl.standardize.")}
    assert (fields or dotted["ddcl.standardize"]) == standardize
    layer = softvq.DDCLQuantizer(8, 2, **upgraded)
    assert layer.standardize == bool(standardize)


def test_a_run_record_that_predates_renorm_trained_with_plain_batch_standardisation():
    """config.json began recording ddcl.renorm / ddcl.renorm_clip after runs without them: those trained with plain
    batch standardisation (and Ioffe's clip), the defaults then, so they read as Standardize(renorm_clip=None)."""
    dotted = softvq._compat.upgrade_settings({"quantizer": ["ddcl"], "ddcl.standardize": True})
    assert dotted["ddcl.standardize.renorm_clip"] is None and dotted["ddcl.standardize.output_scale"] == "standardized"
