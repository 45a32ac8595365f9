"""A state dict records the settings that change a layer's result, and loading it into a layer built with other
settings is refused, naming the setting and both values (softvq._compat: ddcl_settings, hard_settings,
check_state_settings); a state saved before the settings were recorded loads as before."""

from __future__ import annotations

import copy
import io
import math
from pathlib import Path

import pytest
import torch

import softvq
from softvq import DDCLQuantizer, HardVQ
from softvq.parts import Commitment, Ema, EntropyControl, Gradient, Restart, Standardize

FIXTURES = Path(__file__).parent / "fixtures"


def trained(layer: torch.nn.Module, steps: int = 5, dim: int = 16, tokens: int = 512) -> torch.nn.Module:
    g = torch.Generator().manual_seed(0)
    for _ in range(steps):
        layer.train()(torch.randn(tokens, dim, generator=g))
    return layer


def test_the_default_layers_state_into_a_plain_layer_is_refused_naming_each_setting_and_both_values():
    """Before: "All keys matched", and 38.9% of the indices agreed. Refused with strict=False too, and the layer
    refused is left as it was."""
    torch.manual_seed(0)
    state = trained(DDCLQuantizer(64, 16)).state_dict()
    plain = DDCLQuantizer(64, 16, recipe="plain")
    before = copy.deepcopy(plain.state_dict())
    for strict in (True, False):
        with pytest.raises(ValueError) as error:
            plain.load_state_dict(state, strict=strict)
        message = str(error.value)
        assert "DDCLQuantizer state '_extra_state' was saved by a layer with other settings" in message
        for expected in ("recipe: saved 'auto', this layer 'plain'",
                         "hard_output: saved True, this layer False",
                         "standardize: saved softvq.parts.Standardize(renorm_clip=(1.1, 0.1), "
                         "output_scale='standardized'), this layer False",
                         "prototype_update: saved softvq.parts.Ema(decay=0.99, soft=False), this layer "
                         "softvq.parts.Gradient(term='free_energy', weight=1.0)",
                         "restart: saved softvq.parts.Restart(threshold=1.0, decay='auto', cap=0.25), this layer None"):
            assert expected in message
    after = plain.state_dict()
    assert all(torch.equal(after[k], v) if isinstance(v, torch.Tensor) else after[k] == v for k, v in before.items())


SETTINGS = [  # (a layer's options, the setting named, a fragment of the saved value as the error shows it)
    ({"distance": "cosine"}, "distance", "'cosine'"),
    ({"standardize": Standardize(output_scale="input")}, "standardize", "output_scale='input'"),
    ({"standardize": Standardize(renorm_clip=None)}, "standardize", "renorm_clip=None"),
    ({"standardize": False}, "standardize", "False"),
    ({"prototype_update": Ema(decay=0.9)}, "prototype_update", "Ema(decay=0.9, soft=False)"),
    ({"prototype_update": "soft_ema"}, "prototype_update", "Ema(decay=0.99, soft=True)"),
    ({"prototype_update": Gradient(weight=0.5)}, "prototype_update", "Gradient(term='free_energy', weight=0.5)"),
    ({"top_k": 3, "target_entropy": 0.5 * math.log(16)}, "top_k", "3"),  # the target "auto" would follow top_k
    ({"hard_output": False}, "hard_output", "False"),
    ({"commitment_weight": 0.25}, "commitment_weight", "Commitment(weight=0.25, term='hard')"),
    ({"commitment_weight": Commitment(0.25, "l_ols")}, "commitment_weight", "term='l_ols'"),
    ({"target_entropy": 1.5}, "target_entropy", "EntropyControl(target=1.5, rate=0.01)"),
    ({"target_entropy": EntropyControl("auto", rate=0.05)}, "target_entropy", "rate=0.05"),
    ({"target_entropy": None, "temperature": 0.5}, "target_entropy", "None"),
    ({"restart": Restart(2.0)}, "restart", "Restart(threshold=2.0, decay='auto', cap=0.25)"),
    ({"restart": Restart(cap=None)}, "restart", "cap=None"),
    ({"restart": None}, "restart", "None"),
]


@pytest.mark.parametrize("options, setting, shown", SETTINGS, ids=[f"{s}:{i}" for i, (_, s, _) in enumerate(SETTINGS)])
def test_a_state_loads_only_into_a_layer_of_its_settings(options, setting, shown):
    torch.manual_seed(0)
    saved = DDCLQuantizer(16, 4, **options)
    trained(saved, steps=2, dim=4, tokens=128)
    state = saved.state_dict()
    default = DDCLQuantizer(16, 4)
    with pytest.raises(ValueError, match="was saved by a layer with other settings: ") as error:
        default.load_state_dict(state)
    listed = str(error.value).split("other settings: ")[1].split(". Its tensors")[0].split("; ")
    assert [entry.split(": saved ")[0] for entry in listed] == [setting]  # that setting, and only it
    assert shown in listed[0].split(": saved ")[1].split(", this layer ")[0]
    twin = DDCLQuantizer(16, 4, **options)  # built alike: it loads, and computes what the saved layer does
    twin.load_state_dict(state)
    z = torch.randn(40, 4)
    a, b = saved.eval()(z), twin.eval()(z)
    assert torch.equal(a.indices, b.indices) and torch.equal(a.quantized, b.quantized)


def test_assigning_the_saved_settings_before_loading_makes_it_load_and_compute_alike():
    torch.manual_seed(0)
    saved = trained(DDCLQuantizer(64, 16, hard_output=False, distance="cosine"), steps=2, tokens=256)
    layer = DDCLQuantizer(64, 16)
    with pytest.raises(ValueError, match=r"layer\.hard_output = False; layer\.distance = 'cosine'|"
                                         r"layer\.distance = 'cosine'; layer\.hard_output = False"):
        layer.load_state_dict(saved.state_dict())
    layer.hard_output, layer.distance = False, "cosine"
    layer.load_state_dict(saved.state_dict())
    z = torch.randn(30, 16)
    torch.testing.assert_close(layer.eval()(z).quantized, saved.eval()(z).quantized, rtol=0, atol=0)


def test_deleting_the_recorded_settings_loads_the_tensors_under_the_layers_own_as_the_error_says():
    torch.manual_seed(0)
    state = trained(DDCLQuantizer(64, 16), steps=2, tokens=256).state_dict()
    with pytest.raises(ValueError, match=r"delete the 'settings' entry of state_dict\['_extra_state'\]"):
        DDCLQuantizer(64, 16, hard_output=False).load_state_dict(state)
    state["_extra_state"] = {k: v for k, v in state["_extra_state"].items() if k != "settings"}
    layer = DDCLQuantizer(64, 16, hard_output=False)
    layer.load_state_dict(state)
    assert torch.equal(layer.prototypes, torch.as_tensor(state["prototypes"]))


def test_the_settings_are_plain_values_that_load_with_weights_only():
    torch.manual_seed(0)
    layers = [trained(DDCLQuantizer(32, 16, restart=Restart(2.0, cap=None), top_k=4,
                                    standardize=Standardize(output_scale=0.5),
                                    commitment_weight=Commitment(0.1, "l_ols")), steps=2, tokens=256),
              trained(HardVQ(32, 16, ema_decay=0.9, restart=Restart()), steps=2, tokens=256)]
    for layer in layers:
        buffer = io.BytesIO()
        torch.save(layer.state_dict(), buffer)
        buffer.seek(0)
        state = torch.load(buffer, weights_only=True)
        settings = state["_extra_state"]["settings"]

        def plain(value: object) -> bool:
            if isinstance(value, dict):
                return all(isinstance(k, str) and plain(v) for k, v in value.items())
            if isinstance(value, list):
                return all(plain(v) for v in value)
            return value is None or type(value) in (str, float, int, bool)

        assert plain(settings) and settings == layer._settings()
        twin = copy.deepcopy(layer)
        twin.load_state_dict(state)  # strict, and the same settings


def test_a_state_saved_before_the_settings_were_recorded_loads_into_any_layer_as_before():
    """A version-2 DDCL state (no settings) and a HardVQ state without an extra state load as they did, strict; the
    fixtures' Lightning checkpoints are such states."""
    torch.manual_seed(0)
    state = trained(DDCLQuantizer(64, 16), steps=2, tokens=256).state_dict()
    state["_extra_state"] = {k: v for k, v in state["_extra_state"].items() if k != "settings"} | {"version": 2}
    DDCLQuantizer(64, 16, hard_output=False, distance="cosine").load_state_dict(state)
    checkpoint = torch.load(FIXTURES / "vqvae_ddcl.ckpt", weights_only=True)["state_dict"]
    layer_state = {k.removeprefix("quantizer."): v for k, v in checkpoint.items() if k.startswith("quantizer.")}
    assert "settings" not in layer_state["_extra_state"]
    k, d = layer_state["prototypes"].shape
    DDCLQuantizer(k, d, recipe="auto", hard_output=False).load_state_dict(layer_state)
    checkpoint = torch.load(FIXTURES / "vqvae_hard_ema_restart.ckpt", weights_only=True)["state_dict"]
    layer_state = {k.removeprefix("quantizer."): v for k, v in checkpoint.items() if k.startswith("quantizer.")}
    assert "_extra_state" not in layer_state
    k, d = layer_state["prototypes"].shape if "prototypes" in layer_state else layer_state["embedding"].shape
    HardVQ(k, d, ema_decay=0.99).load_state_dict(layer_state)


def test_hard_vq_records_its_settings_and_refuses_another_ema_decay_before_its_keys_differ():
    torch.manual_seed(0)
    ema = trained(HardVQ(32, 16, ema_decay=0.99), steps=2, tokens=256)
    for other, shown in [(HardVQ(32, 16), "ema_decay: saved 0.99, this layer None"),
                         (HardVQ(32, 16, ema_decay=0.9), "ema_decay: saved 0.99, this layer 0.9"),
                         (HardVQ(32, 16, ema_decay=0.99, epsilon=1e-3), "epsilon: saved 1e-05, this layer 0.001"),
                         (HardVQ(32, 16, ema_decay=0.99, commitment_weight=1.0),
                          "commitment_weight: saved 0.25, this layer 1.0"),
                         (HardVQ(32, 16, ema_decay=0.99, restart=Restart()), "restart: saved None, this layer "
                                                                           "softvq.parts.Restart(")]:
        with pytest.raises(ValueError, match="HardVQ state '_extra_state' was saved by a layer with other settings"
                           ) as error:
            other.load_state_dict(ema.state_dict(), strict=False)
        assert shown in str(error.value)
    other = HardVQ(32, 16)
    other.ema_decay = 0.99  # assigned before loading: it loads
    other.load_state_dict(ema.state_dict())
    z = torch.randn(20, 16)
    assert torch.equal(other.eval()(z).quantized, ema.eval()(z).quantized)


def test_a_stack_refuses_a_level_saved_with_other_settings_before_loading_any_level():
    torch.manual_seed(0)
    saved = softvq.ResidualDDCL(2, 16, 8)
    saved.levels[1].hard_output = False
    g = torch.Generator().manual_seed(1)
    for _ in range(3):
        saved.train()(torch.randn(128, 8, generator=g))
    stack = softvq.ResidualDDCL(2, 16, 8)
    before = copy.deepcopy(stack.levels[0].prototypes.detach())
    with pytest.raises(ValueError, match=r"DDCLQuantizer state 'levels\.1\._extra_state' .* hard_output: saved False, "
                                         r"this layer True"):
        stack.load_state_dict(saved.state_dict())
    assert torch.equal(stack.levels[0].prototypes.detach(), before)  # level 0 untouched
    stack.levels[1].hard_output = False
    stack.load_state_dict(saved.state_dict())
    hard = softvq.ResidualHardVQ(2, 16, 8)
    with pytest.raises(ValueError, match=r"HardVQ state 'levels\.0\._extra_state' .* ema_decay: saved 0\.99, this "
                                         r"layer None"):
        softvq.ResidualHardVQ(2, 16, 8, ema_decay=None).load_state_dict(hard.state_dict())
    hier = softvq.HierarchicalDDCL([16, 8], 8, pool=1, distance="cosine")
    with pytest.raises(ValueError, match=r"'levels\.0\._extra_state' .* distance: saved 'cosine'"):
        softvq.HierarchicalDDCL([16, 8], 8, pool=1).load_state_dict(hier.state_dict())


def test_a_readout_from_a_quantizer_still_takes_its_state_and_a_readouts_state_is_checked():
    torch.manual_seed(0)
    quantizer = trained(DDCLQuantizer(32, 16), steps=2, tokens=256)
    readout = softvq.DDCLReadout.from_quantizer(quantizer)  # the readout is the plain layer: other settings
    assert torch.equal(readout.prototypes.detach(), quantizer.prototypes.detach())
    other = softvq.DDCLReadout(32, 16, distance="cosine")
    with pytest.raises(ValueError, match=r"'quantizer\._extra_state' .* distance: saved 'euclidean', this layer "
                                         r"'cosine'"):
        other.load_state_dict(readout.state_dict())
