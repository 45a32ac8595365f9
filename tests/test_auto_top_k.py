"""DDCLQuantizer's ``top_k="auto"``, the recipe's, chosen per second
(docs/scaling.md, "The default per codebook size"): the rule per K, its entropy target (one the k codes can hold)
following top_k, the default at K = 4096 as the per-second study's ``ddcl_k16`` bit for bit, the exact layer one
option away, and states saved before the option (versions 2 and 3, when "auto" meant the exact layer) loading into
today's default as the exact layer they were."""

from __future__ import annotations

import math

import pytest
import torch

from softvq import DDCLQuantizer
from softvq._recipe import auto_top_k
from softvq.parts import EntropyControl


def trained(layer: DDCLQuantizer, steps: int = 3, tokens: int = 512, dim: int = 8, seed: int = 0) -> DDCLQuantizer:
    g = torch.Generator().manual_seed(seed)
    for _ in range(steps):
        layer.train()(torch.randn(tokens, dim, generator=g))
    return layer


@pytest.mark.parametrize("num_codes, k", [(2, None), (512, None), (2048, None), (2049, 16), (4096, 16), (8192, 16),
                                          (8193, 32), (16384, 32), (65536, 32)])
def test_the_recipes_top_k_per_codebook_size_and_the_target_those_codes_can_hold(num_codes, k):
    layer = DDCLQuantizer(num_codes, 4)
    assert auto_top_k(num_codes) == k and layer.top_k == k
    expected = 0.5 * math.log(num_codes) if k is None else math.log(k) - 0.5
    assert layer.target_entropy == pytest.approx(expected, rel=1e-15)
    assert layer.target_entropy < math.log(k or num_codes)  # reachable: below the entropy of k even codes
    plain = DDCLQuantizer(num_codes, 4, recipe="plain")  # the paper's layer: exact, T fixed
    assert plain.top_k is None and plain.target_entropy is None


def test_the_default_at_4096_is_the_truncation_to_16_with_its_target_bit_for_bit():
    """The per-second study's ddcl_k16 (eval.harness.truncated_layer) is the default's computation at this K: the
    same outputs, gradients and state after three training steps."""
    layers = []
    for options in ({}, {"top_k": 16, "target_entropy": math.log(16) - 0.5}):
        torch.manual_seed(0)
        layer = trained(DDCLQuantizer(4096, 8, **options))
        z = torch.randn(300, 8, generator=torch.Generator().manual_seed(1), requires_grad=True)
        out = layer.train()(z)
        (out.quantized.square().sum() + out.loss).backward()
        layers.append((layer, out, z.grad))
    (a, out_a, grad_a), (b, out_b, grad_b) = layers
    assert torch.equal(out_a.quantized, out_b.quantized) and torch.equal(out_a.probs, out_b.probs)
    assert torch.equal(grad_a, grad_b) and out_a.probs.shape[-1] == 16
    assert a.temperature == b.temperature
    state_a, state_b = a.state_dict(), b.state_dict()
    assert all(torch.equal(state_a[key], state_b[key]) for key in state_a if key != "_extra_state")
    assert state_a["_extra_state"] == state_b["_extra_state"]


def test_the_exact_layer_is_one_option_away_and_an_auto_target_follows_top_k_both_ways():
    exact = DDCLQuantizer(4096, 8, top_k=None)
    assert exact.top_k is None and exact.target_entropy == pytest.approx(0.5 * math.log(4096))
    layer = DDCLQuantizer(4096, 8)
    layer.top_k = None
    assert layer.target_entropy == pytest.approx(0.5 * math.log(4096))
    layer.top_k = 64
    assert layer.target_entropy == pytest.approx(math.log(64) - 0.5)
    layer.top_k = "auto"
    assert layer.top_k == 16 and layer.target_entropy == pytest.approx(math.log(16) - 0.5)
    layer.target_entropy = 1.5  # a number stays where it is set
    layer.top_k = None
    assert layer.target_entropy == 1.5
    layer.target_entropy = EntropyControl("auto", rate=0.02)  # "auto" again: follows, with the rate given
    assert layer.target_entropy == pytest.approx(0.5 * math.log(4096)) and layer.temperature_rate == 0.02
    layer.top_k = 16
    assert layer.target_entropy == pytest.approx(math.log(16) - 0.5) and layer.temperature_rate == 0.02


def test_a_truncation_to_one_code_holds_no_entropy():
    layer = DDCLQuantizer(64, 4, top_k=1)
    assert layer.target_entropy is None and layer.temperature == 1.0  # T fixed: the nearest code whatever T
    out = trained(layer, dim=4).eval()(torch.randn(10, 4))
    assert out.probs.shape == (10, 1)
    with pytest.raises(ValueError, match="no entropy to hold"):
        DDCLQuantizer(64, 4, top_k=1, target_entropy=EntropyControl("auto"))


@pytest.mark.parametrize("version", [2, 3])
def test_a_state_saved_before_auto_truncated_loads_into_todays_default_as_the_exact_layer(version):
    """Versions 2 and 3 meant the exact layer (and log K / 2) by "auto": such a state of a default layer at K = 4096
    loads into today's default layer (top_k 16), which takes top_k=None and evaluates as the saved layer did; a state of
    today's version is compared as it is, and refused naming top_k."""
    torch.manual_seed(0)
    saved = trained(DDCLQuantizer(4096, 8, top_k=None))
    state = saved.state_dict()
    state["_extra_state"] = {**state["_extra_state"], "version": version}
    layer = DDCLQuantizer(4096, 8)
    layer.load_state_dict(state)
    assert layer.top_k is None and layer.target_entropy == pytest.approx(0.5 * math.log(4096))
    z = torch.randn(200, 8, generator=torch.Generator().manual_seed(2))
    a, b = saved.eval()(z), layer.eval()(z)
    assert torch.equal(a.indices, b.indices) and torch.equal(a.probs, b.probs)
    # a layer that set top_k itself keeps it; its "auto" target takes the one of then (log K / 2)
    truncated = trained(DDCLQuantizer(4096, 8, top_k=16, target_entropy=0.5 * math.log(4096)))
    old = truncated.state_dict()
    old["_extra_state"] = {**old["_extra_state"], "version": version}
    again = DDCLQuantizer(4096, 8, top_k=16)
    again.load_state_dict(old)
    assert again.top_k == 16 and again.target_entropy == pytest.approx(0.5 * math.log(4096))
    with pytest.raises(ValueError, match=r"top_k: saved None, this layer 16"):
        DDCLQuantizer(4096, 8).load_state_dict(saved.state_dict())  # today's version: no reinterpretation
