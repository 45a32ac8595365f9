"""Settings that would overflow float32 in the first steps are refused when built and when assigned, naming the option
and the bound derived from float32's range (softvq._checks: check_weight, check_code_scale; softvq.parts.standardize:
check_output_scale; softvq.parts.init: check_init; softvq.parts.temperature: check_temperature); a setting at the
bound trains finite. Numbers are numbers: a string or bytes that spells one is refused, naming the value."""

from __future__ import annotations

import math
import re
import warnings

import pytest
import torch

import softvq
from softvq import DDCLQuantizer, HardVQ
from softvq._checks import check_float
from softvq.parts import Commitment, Ema, EntropyControl, Gradient, NormalInit, Restart, Standardize

FMAX = torch.finfo(torch.float32).max
D = 16
# the largest coordinate whose squared distances over D dimensions fit in float32 (softvq._checks.max_token_magnitude)
MAGNITUDE = math.sqrt(FMAX / (16 * D))


def steps(layer: torch.nn.Module, n: int = 3) -> list:
    g = torch.Generator().manual_seed(0)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return [layer.train()(torch.randn(128, D, generator=g)) for _ in range(n)]


def finite(layer: DDCLQuantizer, outs: list) -> bool:
    return all(bool(torch.isfinite(o.quantized).all()) and math.isfinite(float(o.loss)) for o in outs) and \
        (layer.temperature is None or math.isfinite(layer.temperature))


def test_a_normal_init_whose_distances_overflow_is_refused_with_its_bound_and_one_at_the_bound_trains_finite():
    """Before: NormalInit(1e20) gave NaN outputs and T after 3 steps. The bound: coordinates of a normal draw stay
    within 8 standard deviations, and 8 s must stay within sqrt(finfo(float32).max / (16 D))."""
    bound = MAGNITUDE / 8
    with pytest.raises(ValueError, match=r"init\.scale=1e\+20 is too large for dim=16: .* at most "
                                         + re.escape(f"{MAGNITUDE:.3g} / 8 = {bound:.3g}")):
        DDCLQuantizer(64, D, init=NormalInit(1e20))
    torch.manual_seed(0)
    layer = DDCLQuantizer(64, D, init=NormalInit(0.99 * bound))
    assert finite(layer, steps(layer))


def test_an_output_scale_that_overflows_is_refused_when_built_and_assigned_and_one_at_the_bound_is_finite():
    """Before: Standardize(output_scale=1e40) gave inf. A standardised coordinate is at most sqrt(N - 1) (below 2^16
    for fewer than 2^32 tokens): 2^16 times the scale must stay within sqrt(finfo(float32).max / (16 D))."""
    bound = MAGNITUDE / 2**16
    message = r"output_scale=1e\+40 is too large for dim=16: .* at most " + \
        re.escape(f"{MAGNITUDE:.3g} / 65536 = {bound:.3g}")
    with pytest.raises(ValueError, match=rf"standardize\.{message}"):
        DDCLQuantizer(64, D, standardize=Standardize(output_scale=1e40))
    layer = DDCLQuantizer(64, D)
    with pytest.raises(ValueError, match=rf"standardize\.{message}"):
        layer.standardize = Standardize(output_scale=1e40)
    with pytest.raises(ValueError, match=message):
        layer.output_scale = 1e40
    assert layer.output_scale == "standardized"
    torch.manual_seed(0)
    layer = DDCLQuantizer(64, D, standardize=Standardize(output_scale=0.99 * bound))
    outs = steps(layer)
    assert finite(layer, outs) and bool(torch.isfinite(outs[-1].quantized.double().square().sum()))


@pytest.mark.parametrize("option, bound", [
    ({"init": NormalInit}, MAGNITUDE / 8),
    ({"standardize": lambda scale: Standardize(output_scale=scale)}, MAGNITUDE / 2**16),
], ids=["init-scale", "output-scale"])
def test_a_code_scale_just_above_its_bound_is_refused_and_one_just_below_is_built(option, bound):
    """The refusals above are probed far beyond each bound; these 1% either side of it, so a bound enforced at
    another value (too lax or too strict) fails here."""
    (name, make), = option.items()
    DDCLQuantizer(64, D, **{name: make(0.99 * bound)})
    with pytest.raises(ValueError, match=r"is too large for dim=16"):
        DDCLQuantizer(64, D, **{name: make(1.01 * bound)})


@pytest.mark.parametrize("build", [
    lambda: DDCLQuantizer(64, D, commitment_weight=1e300),
    lambda: DDCLQuantizer(64, D, commitment_weight=Commitment(1e20, "l_ols")),
    lambda: DDCLQuantizer(64, D, prototype_update=Gradient(weight=1e20)),
    lambda: HardVQ(64, D, commitment_weight=1e300),
], ids=["ddcl", "commitment", "gradient", "hard"])
def test_a_loss_weight_beyond_the_square_root_of_float32s_range_is_refused(build):
    """Before: commitment_weight=1e300 gave an inf loss. A weight and a loss both at most sqrt(finfo(float32).max)
    multiply to a finite float32."""
    with pytest.raises(ValueError, match=r"weight=1e\+(300|20) is too large: a loss term's weight must be at most "
                                         + re.escape(f"sqrt(finfo(float32).max) = {math.sqrt(FMAX):.3g}")):
        build()


def test_a_loss_weight_assigned_is_bounded_alike_and_one_at_the_bound_gives_a_finite_loss():
    layer = DDCLQuantizer(64, D)
    for option, value in [("commitment_weight", 1e300), ("prototype_update", {"weight": 1e300})]:
        with pytest.raises(ValueError, match=r"weight=1e\+300 is too large"):
            setattr(layer, option, value)
    hard = HardVQ(64, D)
    with pytest.raises(ValueError, match=r"commitment_weight=1e\+300 is too large"):
        hard.commitment_weight = 1e300
    layer.commitment_weight = 0.99 * math.sqrt(FMAX)
    assert finite(layer, steps(layer))


def test_a_temperature_whose_logits_overflow_is_refused():
    """Before: temperature=1e-300 gave NaN. Logits of standardised codes (coordinates within 2^16) divided by T must
    stay finite: T >= 16 D 2^32 / finfo(float32).max."""
    bound = 16 * D * 2**32 / FMAX
    with pytest.raises(ValueError, match=r"temperature=1e-300 is too small: .* = " + re.escape(f"{bound:.3g}")):
        DDCLQuantizer(64, D, temperature=1e-300, target_entropy=None)
    layer = DDCLQuantizer(64, D, temperature=1.0, target_entropy=None)
    with pytest.raises(ValueError, match=r"temperature=1e-30 is too small"):
        layer.temperature = 1e-30
    assert layer.temperature == 1.0
    layer = DDCLQuantizer(64, D, temperature=2 * bound, target_entropy=None)
    assert finite(layer, steps(layer))


def test_restart_cap_is_a_fraction_and_hard_vqs_smoothing_is_bounded():
    for build in (lambda: Restart(cap=2), lambda: DDCLQuantizer(8, 2, restart={"cap": 1.5}),
                  lambda: HardVQ(8, 2, restart=Restart(cap=2.0))):
        with pytest.raises(ValueError, match=r"restart\.cap is a fraction of the mean tokens per code per batch, in "
                                             r"\(0, 1\], got (2|1\.5|2\.0)"):
            build()
    assert Restart(cap=1).cap == 1.0
    with pytest.raises(ValueError, match=r"epsilon=1e\+38 is too large for num_codes=64"):
        HardVQ(64, D, ema_decay=0.99, epsilon=1e38)


NUMERIC_TEXT = [  # a number spelled as text, where a number belongs: refused, naming the option and the value
    (lambda: Restart(threshold="1"), r"restart\.threshold .*got the str '1'"),
    (lambda: Restart(decay="0.9"), r"restart\.decay .*got the str '0\.9'"),
    (lambda: Restart(cap=b"0.5"), r"restart\.cap .*got the bytes b'0\.5'"),
    (lambda: Ema(decay="0.9"), r"prototype_update\.decay .*got the str '0\.9'"),
    (lambda: Gradient(weight="1"), r"prototype_update\.weight .*got the str '1'"),
    (lambda: Commitment("0.25"), r"commitment_weight\.weight .*got the str '0\.25'"),
    (lambda: NormalInit("1"), r"init\.scale .*got the str '1'"),
    (lambda: EntropyControl("2.0"), r"target_entropy\.target .*got the str '2\.0'"),
    (lambda: Standardize(renorm_clip=("3", 5.0)), r"standardize\.renorm_clip .*got the str '3'"),
    (lambda: Standardize(output_scale=bytearray(b"2")), r"standardize\.output_scale .*got the bytearray"),
    (lambda: DDCLQuantizer(8, 2, temperature="1.0"), r"temperature .*got the str '1\.0'"),
    (lambda: DDCLQuantizer(8, 2, commitment_weight="0.5"), r"commitment_weight .*got the str '0\.5'"),
    (lambda: DDCLQuantizer(8, 2, target_entropy="1.0"), r"target_entropy .*got '1\.0'"),
    (lambda: HardVQ(8, 2, ema_decay="0.99"), r"ema_decay must be None or in \(0, 1\), got '0\.99'"),
    (lambda: HardVQ(8, 2, epsilon=b"1e-5"), r"epsilon .*got the bytes b'1e-5'"),
    (lambda: setattr(DDCLQuantizer(8, 2), "temperature_rate", "0.05"), r"temperature_rate .*got the str '0\.05'"),
    (lambda: setattr(DDCLQuantizer(8, 2), "temperature", "0.5"), r"temperature .*got the str '0\.5'"),
    (lambda: check_float("x", "1e3"), r"x must be a positive finite number, got the str '1e3'"),
]


@pytest.mark.parametrize("build, message", NUMERIC_TEXT, ids=[str(i) for i in range(len(NUMERIC_TEXT))])
def test_a_number_spelled_as_text_is_refused_naming_the_option_and_the_value(build, message):
    with pytest.raises(ValueError, match=message):
        build()


def test_numbers_of_other_numeric_types_are_still_numbers():
    import numpy as np

    assert check_float("x", np.float32(0.5)) == 0.5 and check_float("x", torch.tensor(2.0)) == 2.0
    assert Restart(threshold=np.int64(2)).threshold == 2.0
    assert softvq.DDCLQuantizer(8, 2, commitment_weight=np.float64(0.25)).commitment_weight == 0.25
