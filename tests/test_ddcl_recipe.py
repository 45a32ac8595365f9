"""DDCLQuantizer's in-layer recipe against by-hand references (float64): hard output with the soft-centroid gradient,
in-layer standardisation, the EMA prototype update, entropy-controlled temperature, channel-first input, restarts
and loading state dicts from before the recipe existed."""

from __future__ import annotations

import math

import pytest
import torch
from helpers import running_moments

from softvq import DDCLQuantizer
from softvq.parts import Ema, Gradient, Restart, Standardize


def reference(z: torch.Tensor, p: torch.Tensor, temperature: float, standardize: bool, hard: bool,
              back: bool = True, running: tuple[torch.Tensor, torch.Tensor] | None = None,
              clip: tuple[float, float] = (1.1, 0.1)):
    """docs/design.md, "The layer: L_q = L_OLS + V", written out with an explicit (N, K, D) difference tensor, plus
    the recipe's two maps: batch standardisation (biased variance, eps 1e-5 of the mean variance) before, and
    ``code * std + mean`` after; hard output as ``mu + sg(code - mu)``. With ``running`` (mean, variance after this
    batch: the layer's default ``renorm=True``), batch renormalisation: ``(z - mean_B) / std_B * r + d`` with
    ``r = sg(std_B / std)``, ``d = sg((mean_B - mean) / std)`` clipped by ``clip`` (the layer's default
    ``renorm_clip``), i.e. the running statistics in value unless clipped."""
    mean = std = None
    if standardize:
        mean = z.mean(0)
        var = ((z - mean) ** 2).mean(0)
        std = (var + 1e-5 * var.detach().mean()).sqrt()
        if running is not None:
            run_mean, run_var = running
            run_std = (run_var + 1e-5 * run_var.mean()).sqrt()
            r_max, d_max = clip
            r = (std.detach() / run_std).clamp(1 / r_max, r_max)
            d = ((mean.detach() - run_mean) / run_std).clamp(-d_max, d_max)
            std = std / r
            mean = mean - d * std
        z = (z - mean) / std
    d = ((z[:, None, :] - p[None, :, :]) ** 2).sum(-1)
    q = torch.softmax(-d / temperature, dim=1)
    mu = q @ p
    idx = d.argmin(1)
    out = mu + (p[idx] - mu).detach() if hard else mu
    if standardize and back:
        out = out * std + mean
    entropy = -(q * q.log()).sum(1).mean()
    return out, idx, q, entropy


def layer(k=6, dim=3, **kw) -> DDCLQuantizer:
    torch.manual_seed(0)
    kw = {"init": "normal", "temperature": 0.8, "target_entropy": None, "restart": None,
          "prototype_update": "gradient", **kw}
    return DDCLQuantizer(k, dim, **kw).double()


@pytest.mark.parametrize("standardize,scale,renorm", [(False, "standardized", True), (True, "standardized", True),
                                                      (True, "input", True), (True, "standardized", False)])
def test_hard_output_is_the_code_and_its_gradient_the_soft_centroid_jacobian(standardize, scale, renorm):
    quantizer = layer(standardize=standardize and Standardize((1.1, 0.1) if renorm else None, scale))  # hard output on
    assert quantizer.hard_output
    z = (torch.randn(20, 3, dtype=torch.float64) * 2 + 0.5).requires_grad_(True)
    weights = torch.randn(20, 3, dtype=torch.float64)
    out = quantizer(z)
    (out.quantized * weights).sum().backward()
    zr = z.detach().clone().requires_grad_(True)
    running = running_moments([z])[0] if standardize and renorm else None
    ref, idx, _, _ = reference(zr, quantizer.prototypes.detach(), 0.8, standardize, hard=True,
                               back=scale == "input", running=running)
    (ref * weights).sum().backward()
    assert torch.equal(out.indices, idx)
    torch.testing.assert_close(out.quantized, ref, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(z.grad, zr.grad, rtol=1e-10, atol=1e-12)
    if scale == "standardized":  # the value is exactly the prototype: the decoder sees the code it is tested on
        assert torch.equal(out.quantized, quantizer.decode_indices(out.indices))
    quantizer.eval()  # evaluation: the output is the decode of the indices, bit for bit
    out = quantizer(z.detach())
    assert torch.equal(out.quantized, quantizer.decode_indices(out.indices))


def test_hard_output_jacobian_per_token_is_two_over_t_times_the_assignment_covariance():
    quantizer = layer(standardize=False)
    p = quantizer.prototypes.detach()
    z = torch.randn(1, 3, dtype=torch.float64)
    jac = torch.autograd.functional.jacobian(lambda x: quantizer(x).quantized, z).reshape(3, 3)
    q = torch.softmax(-((z - p) ** 2).sum(1) / 0.8, dim=0)
    mu = q @ p
    cov = ((p - mu).T * q) @ (p - mu)  # C_n = sum_k q_k (p_k - mu)(p_k - mu)^T
    torch.testing.assert_close(jac, 2.0 / 0.8 * cov, rtol=1e-10, atol=1e-12)


@pytest.mark.parametrize("renorm", [True, False])
def test_in_layer_standardisation_matches_float64_by_hand(renorm):
    quantizer = layer(standardize=Standardize((1.1, 0.1) if renorm else None, "input"))
    sd = quantizer.standardizer
    batches = [torch.randn(30, 3, dtype=torch.float64) * torch.tensor([0.01, 2.0, 5.0], dtype=torch.float64) + 3 * k
               for k in range(4)]  # a drifting encoder: the renormalisation clips bind from the second batch on
    mean, var = torch.zeros(3, dtype=torch.float64), torch.ones(3, dtype=torch.float64)
    applied_mean, applied_var = mean.clone(), var.clone()
    r_max, d_max = sd.renorm_clip
    for step, x in enumerate(batches):
        quantizer(x)
        m = 1.0 if step == 0 else 0.1  # the first batch sets the running statistics whole
        mean = (1 - m) * mean + m * x.mean(0)
        var = (1 - m) * var + m * x.var(0, unbiased=True)
        torch.testing.assert_close(sd.running_mean, mean, rtol=1e-12, atol=1e-14)
        torch.testing.assert_close(sd.running_var, var, rtol=1e-12, atol=1e-14)
        # what the step applied: the batch's own moments, or renormalisation's clipped ones toward the running
        b_var = x.var(0, unbiased=False)
        b_std, run_std = (b_var + 1e-5 * b_var.mean()).sqrt(), (var + 1e-5 * var.mean()).sqrt()
        shift, scale = x.mean(0), b_std
        if renorm:
            r = (b_std / run_std).clamp(1 / r_max, r_max)
            scale = b_std / r
            shift = x.mean(0) - ((x.mean(0) - mean) / run_std).clamp(-d_max, d_max) * scale
        a = 1.0 if step == 0 else 0.85  # the default eval_momentum (docs/design.md, "Which evaluation statistics")
        applied_mean = (1 - a) * applied_mean + a * shift
        applied_var = (1 - a) * applied_var + a * scale**2
        torch.testing.assert_close(sd.applied_mean, applied_mean, rtol=1e-12, atol=1e-14)
        torch.testing.assert_close(sd.applied_var, applied_var, rtol=1e-12, atol=1e-14)
    assert renorm is False or not torch.allclose(applied_mean, mean)  # the clip bound: the two kinds differ
    quantizer.eval()
    x = torch.randn(7, 3, dtype=torch.float64) + 6
    for kind, (m, std) in {"applied": (applied_mean, applied_var.sqrt()),
                           "running": (mean, (var + 1e-5 * var.mean()).sqrt())}.items():
        sd.eval_statistics = kind
        out = quantizer(x)
        zs = (x - m) / std
        d = ((zs[:, None] - quantizer.prototypes.detach()[None]) ** 2).sum(-1)
        assert torch.equal(out.indices, d.argmin(1))
        codes = quantizer.prototypes.detach()[out.indices] * std + m
        torch.testing.assert_close(out.quantized, codes, rtol=1e-12, atol=1e-12)
        torch.testing.assert_close(quantizer.codebook, quantizer.prototypes.detach() * std + m, rtol=1e-12, atol=0)
    # scale-free: the codebook sees the same tokens whatever scale the encoder gives them
    quantizer.train()
    a, b = layer(standardize=True), layer(standardize=True)
    x = torch.randn(40, 3, dtype=torch.float64)
    assert torch.equal(a(x).indices, b(1e-3 * x).indices)


@pytest.mark.parametrize("update", ["ema", "soft_ema"])
def test_ema_prototype_update_by_hand(update):
    quantizer = layer(k=3, dim=2, standardize=False, prototype_update=Ema(0.75, soft=update == "soft_ema"),
                      temperature=0.5)
    assert not quantizer.prototypes.requires_grad  # not the optimizer's: the layer moves them
    p0 = quantizer.prototypes.detach().clone()
    z = torch.tensor([[0.0, 0.1], [1.0, 1.0], [1.2, 0.8], [-2.0, 0.5], [-1.8, 0.4]], dtype=torch.float64)
    out = quantizer(z)
    d = ((z[:, None] - p0[None]) ** 2).sum(-1)
    if update == "ema":
        w = torch.nn.functional.one_hot(d.argmin(1), 3).double()  # k-means: the tokens each prototype wins
    else:
        w = torch.softmax(-d / 0.5, dim=1)  # the free-energy M-step: tokens weighted by q
    mass = 0.75 * 1.0 + 0.25 * w.sum(0)  # one pseudo-token at the initial prototype
    total = 0.75 * p0 + 0.25 * (w.T @ z)
    torch.testing.assert_close(quantizer.prototypes.detach(), total / mass[:, None], rtol=1e-12, atol=1e-14)
    torch.testing.assert_close(out.quantized, p0[d.argmin(1)], rtol=0, atol=0)  # this step used the old ones
    quantizer.eval()
    before = quantizer.prototypes.detach().clone()
    quantizer(z)
    assert torch.equal(before, quantizer.prototypes.detach())  # evaluation never moves them


def test_temperature_is_calibrated_then_follows_the_entropy_step_by_step():
    torch.manual_seed(3)
    quantizer = DDCLQuantizer(160, 4, restart=None, prototype_update="gradient").double()
    target = 0.5 * math.log(160)  # "auto": sqrt(K) prototypes' worth of entropy
    assert quantizer.temperature is None and quantizer.target_entropy == target
    batches = [torch.randn(400, 4, dtype=torch.float64) * (1 + 0.1 * i) for i in range(6)]  # a drifting scale
    running = running_moments(batches)
    out = quantizer(batches[0])
    first = quantizer.temperature  # already one control step after the calibrated value
    t0 = first / math.exp(0.01 * (target - float(out.terms["entropy"])))
    _, _, _, h0 = reference(batches[0], quantizer.prototypes.detach(), t0, standardize=True, hard=True,
                            running=running[0])
    assert abs(float(h0) - target) < 1e-6  # the calibrated T gives the target entropy on the first batch
    for x, stats in zip(batches[1:], running[1:], strict=True):
        t = quantizer.temperature
        out = quantizer(x)
        _, _, _, h = reference(x, quantizer.prototypes.detach(), t, standardize=True, hard=True, running=stats)
        torch.testing.assert_close(out.terms["entropy"], h, rtol=1e-10, atol=1e-12)
        assert quantizer.temperature == pytest.approx(t * math.exp(0.01 * (target - float(h))), rel=1e-12)
    state = quantizer.state_dict()
    clone = DDCLQuantizer(160, 4, restart=None, prototype_update="gradient").double()  # its settings (recorded)
    clone.load_state_dict(state)
    assert clone.temperature == quantizer.temperature  # checkpointed


def test_channel_first_equals_permuted_channel_last():
    first = layer(k=8, dim=4, standardize=Standardize(output_scale="input"), channel_first=True)
    last = layer(k=8, dim=4, standardize=Standardize(output_scale="input"))
    x = torch.randn(2, 4, 3, 5, dtype=torch.float64, requires_grad=True)
    y = x.detach().permute(0, 2, 3, 1).clone().requires_grad_(True)
    a, b = first(x), last(y)
    torch.testing.assert_close(a.quantized, b.quantized.permute(0, 3, 1, 2), rtol=0, atol=0)
    assert torch.equal(a.indices, b.indices) and a.indices.shape == (2, 3, 5)
    torch.testing.assert_close(a.probs, b.probs, rtol=0, atol=0)
    (a.quantized.square().sum() + a.loss).backward()
    (b.quantized.square().sum() + b.loss).backward()
    torch.testing.assert_close(x.grad, y.grad.permute(0, 3, 1, 2), rtol=1e-12, atol=1e-12)
    first.eval()
    assert first.decode_indices(a.indices).shape == (2, 4, 3, 5)
    with pytest.raises(ValueError, match=r"\(B, 4, \.\.\.\), got \(2, 3, 4\)"):
        first(torch.randn(2, 3, 4, dtype=torch.float64))


def test_restart_never_moves_a_live_code_in_a_small_batch():
    torch.manual_seed(0)  # 16 tokens a batch for 64 codes: the threshold of 1 token per batch is capped at 1/16
    quantizer = DDCLQuantizer(64, 2, standardize=False, init="normal", prototype_update="gradient")
    z = quantizer.prototypes.detach()[:16].clone()  # every batch: one token on each of the first 16 codes
    for _ in range(30):
        quantizer(z)
    assert torch.equal(quantizer.prototypes.detach()[:16], z)  # the codes in use were never moved
    assert quantizer.restarts >= 48  # the 48 that win nothing were


@pytest.mark.parametrize(("num_codes", "tokens", "decay"), [
    (512, 8192, 0.9),  # 16 tokens per code a batch: the floor's memory already holds 160
    (1024, 8192, 0.9),  # 8 a batch: 80 tokens
    (4096, 8192, 1 - 2 / 64),  # 2 a batch: 32 batches hold 64 tokens
    (16384, 8192, 0.97),  # 0.5 a batch: the ceiling (33 batches, 16 tokens), not 1 - 0.5 / 64
])
def test_auto_usage_decay_remembers_64_tokens_per_code_and_drives_the_running_count(num_codes, tokens, decay):
    quantizer = DDCLQuantizer(num_codes, 2)
    assert quantizer.restart.decay == "auto"
    assert quantizer.dead_codes.usage_decay(tokens) == pytest.approx(decay, abs=1e-15)
    torch.testing.assert_close(quantizer.dead_codes.usage_decay(torch.tensor(float(tokens), dtype=torch.float64)),
                               torch.tensor(decay, dtype=torch.float64), rtol=0, atol=1e-15)
    assert (1 / (1 - decay)) * tokens / num_codes >= 64 - 1e-9 or decay == 0.97  # the memory in tokens per code
    usage = torch.rand(num_codes, dtype=torch.float64)
    counts = torch.bincount(torch.randint(num_codes, (tokens,), generator=torch.Generator().manual_seed(0)),
                            minlength=num_codes).double()  # a batch's argmax counts: they sum to ``tokens``
    quantizer.dead_codes.usage.copy_(usage)
    quantizer.dead_codes.update(counts.to(quantizer.dead_codes.usage.dtype))
    torch.testing.assert_close(quantizer.dead_codes.usage.double(), usage * decay + counts * (1 - decay),
                               rtol=1e-6, atol=1e-6)
    fixed = DDCLQuantizer(num_codes, 2, restart=Restart(decay=0.5))
    assert fixed.dead_codes.usage_decay(tokens) == 0.5  # a decay given is used as given


def test_the_flat_restart_options_are_a_records_only():
    """``restart`` took the place of dead_code_threshold / _decay / _cap: the layer refuses the former names (a record
    that has them is upgraded on load, tests/test_compat.py), and a decay it cannot use is refused by name."""
    for name in ("dead_code_threshold", "dead_code_decay", "dead_code_cap"):
        with pytest.raises(TypeError, match=name):
            DDCLQuantizer(8, 2, **{name: 0.9})
    with pytest.raises(ValueError, match=r"restart\.decay"):
        DDCLQuantizer(8, 2, restart={"decay": "fast"})


def test_state_dict_from_before_the_recipe_loads_as_the_plain_layer():
    torch.manual_seed(0)
    old = DDCLQuantizer(8, 3, temperature=0.7, recipe="plain")
    old(torch.randn(40, 3))  # data initialisation
    state = old.state_dict()
    for key in ("ema.mass", "ema.weighted_sum", "standardizer.running_mean", "standardizer.running_var",
                "standardizer.num_batches_tracked"):
        del state[key]  # a version-1 layer had none of these
    state["usage"] = state.pop("dead_codes.usage")  # and kept its usage at the top level
    state["_extra_state"] = {k: v for k, v in state["_extra_state"].items() if k != "version"}
    new = DDCLQuantizer(8, 3, temperature=0.7)  # today's defaults
    new.load_state_dict(state)
    assert new.recipe == "plain" and not new.standardize and not new.hard_output
    assert new.prototype_update == Gradient() and new.prototypes.requires_grad
    z = torch.randn(10, 3)
    new.eval(), old.eval()
    a, b = new(z), old(z)
    assert torch.equal(a.quantized, b.quantized) and torch.equal(a.indices, b.indices)
    state["_extra_state"] = {"temperature": "hot", "initialized": True}
    with pytest.raises(ValueError, match="temperature"):
        DDCLQuantizer(8, 3).load_state_dict(state)


@pytest.mark.parametrize("kwargs,match", [
    ({"recipe": "fast"}, "recipe"),
    ({"prototype_update": "adam"}, "prototype_update"),
    ({"prototype_update": {"decay": 1.0}}, r"prototype_update\.decay"),
    ({"prototype_update": {"decay": 0.9, "term": "l_q"}}, "neither Ema.s"),
    ({"hard_output": 1}, "hard_output"),
    ({"standardize": "yes"}, "standardize"),
    ({"channel_first": None}, "channel_first"),
    ({"target_entropy": 2.1}, r"log\(num_codes\)"),  # K = 8: log 8 = 2.08 nats is uniform
    ({"target_entropy": -1.0}, "target_entropy"),
    ({"commitment_weight": {"weight": 0.5, "term": "soft"}}, r"commitment_weight\.term"),
    ({"commitment_weight": {"weight": 0.0, "term": "l_ols"}}, r"commitment_weight\.weight"),
    ({"standardize": {"renorm_clip": (1.1,)}}, r"standardize\.renorm_clip must be a pair"),
    ({"standardize": {"renorm_clip": (0.9, 0.1)}}, "r_max"),
    ({"standardize": {"renorm_clip": (1.1, float("nan"))}}, "renorm_clip"),
    ({"standardize": {"output_scale": "raw"}}, r"standardize\.output_scale"),
    ({"standardize": {"renorm": False}}, r"unknown field\(s\) \['renorm'\]"),
])
def test_invalid_recipe_options_raise(kwargs, match):
    with pytest.raises(ValueError, match=match):
        DDCLQuantizer(8, 4, **kwargs)


def test_batch_renormalisation_is_the_running_statistics_in_value_and_the_batchs_gradient_by_hand():
    from softvq.parts import TokenStandardizer

    torch.manual_seed(0)
    sd = TokenStandardizer(3, renorm=True, renorm_clip=(1.5, 0.5)).double().train()
    mean, var = None, None
    for step in range(4):
        scale = torch.tensor([0.01, 2.0, 5.0], dtype=torch.float64) * (1 + step)  # a drifting encoder
        z = (torch.randn(50, 3, dtype=torch.float64) * scale + step).requires_grad_(True)
        upstream = torch.randn(50, 3, dtype=torch.float64)
        y, shift, s = sd(z)
        (y * upstream).sum().backward()
        # by hand: the running statistics after this batch (the first sets them whole), then r and d clipped
        m = 1.0 if step == 0 else 0.1
        bm, bv = z.detach().mean(0), z.detach().var(0, unbiased=False)
        mean = bm if mean is None else (1 - m) * mean + m * bm
        var = z.detach().var(0, unbiased=True) if var is None else (1 - m) * var + m * z.detach().var(0, unbiased=True)
        run_std = (var + 1e-5 * var.mean()).sqrt()
        zz = z.detach().clone().requires_grad_(True)
        mu, v = zz.mean(0), zz.var(0, unbiased=False)
        std = (v + 1e-5 * v.detach().mean()).sqrt()
        r = (std.detach() / run_std).clamp(1 / 1.5, 1.5)
        d = ((bm - mean) / run_std).clamp(-0.5, 0.5)
        expected = (zz - mu) / std * r + d
        (expected * upstream).sum().backward()
        torch.testing.assert_close(y, expected, rtol=1e-12, atol=1e-12)
        torch.testing.assert_close(z.grad, zz.grad, rtol=1e-10, atol=1e-12)
        torch.testing.assert_close(y * s + shift, z, rtol=1e-12, atol=1e-12)  # the map back inverts it
        if step == 0:  # the first batch set the running statistics: its own moments (the unbiased variance), d = 0
            uv = bv * 50 / 49
            torch.testing.assert_close(y, ((z - bm) / (uv + 1e-5 * uv.mean()).sqrt()).detach(), rtol=1e-12,
                                       atol=1e-12)
    unclipped = TokenStandardizer(3, renorm=True).double().train()
    for step in range(3):
        z = torch.randn(50, 3, dtype=torch.float64) * (1 + 0.1 * step) + 0.1 * step
        y, _, _ = unclipped(z)
        run = (unclipped.running_var + 1e-5 * unclipped.running_var.mean()).sqrt()
        torch.testing.assert_close(y, (z - unclipped.running_mean) / run, rtol=1e-12, atol=1e-12)  # = evaluation
    with pytest.raises(ValueError, match="r_max"):
        TokenStandardizer(3, renorm=True, renorm_clip=(0.5, 1.0))


def test_the_layers_renorm_option_assigns_training_tokens_as_evaluation_standardises_them():
    """DDCLQuantizer(renorm=True): a training batch of a drifting encoder is assigned after standardising with the
    running statistics (just moved by that batch), the ones evaluation uses, checked against brute-force distances
    to the prototypes the step read."""
    torch.manual_seed(0)
    layer = DDCLQuantizer(16, 3, standardize=Standardize((3.0, 5.0)), restart=None).double()  # no clip binds
    assert layer.standardizer.renorm
    layer(torch.randn(200, 3, dtype=torch.float64))  # the first batch draws the prototypes from its tokens
    for step in range(1, 6):
        z = torch.randn(200, 3, dtype=torch.float64) * (1 + 0.05 * step) + 0.05 * step
        before = layer.prototypes.detach().clone()
        out = layer(z)
        sd = layer.standardizer
        standardised = (z - sd.running_mean) / (sd.running_var + 1e-5 * sd.running_var.mean()).sqrt()
        expected = torch.cdist(standardised, before).argmin(1)
        assert torch.equal(out.indices, expected)


def test_auto_usage_decay_at_its_floor_trains_bit_for_bit_as_a_decay_of_0_9():
    torch.manual_seed(0)  # 512 tokens a batch for 16 codes: "auto" is its floor, 0.9
    z = torch.randn(6, 512, 4)
    runs = []
    for decay in ("auto", 0.9):
        torch.manual_seed(1)
        quantizer = DDCLQuantizer(16, 4, restart=Restart(decay=decay))
        outs = [quantizer(batch).quantized for batch in z]
        runs.append((outs, quantizer.state_dict(), quantizer.restarts))
    (a, sa, ra), (b, sb, rb) = runs
    assert all(torch.equal(x, y) for x, y in zip(a, b, strict=True)) and ra == rb
    assert all(torch.equal(sa[k], sb[k]) for k in sa if isinstance(sa[k], torch.Tensor))


def test_a_numeric_output_scale_multiplies_the_standardised_code_and_its_gradient():
    """``output_scale=s``: the standardised layer's output and input gradient times ``s``, bit for bit in value; in
    evaluation the output is still the decode of the indices (``codebook`` scaled alike)."""
    base, scaled = layer(standardize=True), layer(standardize=True)
    scaled.load_state_dict(base.state_dict())  # the same state (a state loads into a layer of its settings only) ...
    scaled.standardize = Standardize(output_scale=0.2)  # ... then its codes times 0.2
    z = torch.randn(20, 3, dtype=torch.float64) * 3 + 1
    w = torch.randn(20, 3, dtype=torch.float64)
    za, zb = z.clone().requires_grad_(True), z.clone().requires_grad_(True)
    a, b = base(za), scaled(zb)
    (a.quantized * w).sum().backward()
    (b.quantized * w).sum().backward()
    assert torch.equal(b.indices, a.indices)
    torch.testing.assert_close(b.quantized, 0.2 * a.quantized, rtol=1e-15, atol=0)
    torch.testing.assert_close(zb.grad, 0.2 * za.grad, rtol=1e-12, atol=1e-15)
    scaled.eval()
    out = scaled(z)
    assert torch.equal(out.quantized, scaled.decode_indices(out.indices))
    torch.testing.assert_close(scaled.codebook, 0.2 * scaled.prototypes.detach(), rtol=0, atol=0)
    with pytest.raises(ValueError, match="output_scale"):
        layer(standardize={"output_scale": -1.0})
