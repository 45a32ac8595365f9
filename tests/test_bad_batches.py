"""A batch cannot break a layer, and bad input gets an error that names the problem.

Every stateful layer refuses a bad batch before any of its state moves, so the batch after a refused one gives what it
would have given had the refused one never been passed (reference: a copy of the layer that never saw it). Loaders and
command lines print one line that says what is wrong with the file, never torch's advice to load it unsafely.
"""

from __future__ import annotations

import copy
import random
import warnings

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import softvq
from softvq.cli import evaluate
from softvq.models import load_prior, load_vqvae
from softvq.models.callbacks import format_record
from softvq.parts import Restart


def _state_equal(a: torch.nn.Module, b: torch.nn.Module) -> bool:
    sa, sb = a.state_dict(), b.state_dict()
    return sa.keys() == sb.keys() and all(
        torch.equal(x, sb[k]) if isinstance(x, torch.Tensor) else x == sb[k] for k, x in sa.items())


STATEFUL = {
    "DDCLQuantizer": lambda: softvq.DDCLQuantizer(16, 8),
    "ResidualDDCL shared": lambda: softvq.ResidualDDCL(2, 16, 8),
    "ResidualDDCL per_level": lambda: softvq.ResidualDDCL(2, 16, 8, scale="per_level"),
    "HierarchicalDDCL auto": lambda: softvq.HierarchicalDDCL([16, 8], 8, pool=2, recipe="auto"),
    "DDCLReadout standardised": lambda: softvq.DDCLReadout(16, 8, standardize=True, target_entropy=1.0),
    "HardVQ EMA + restart": lambda: softvq.HardVQ(16, 8, ema_decay=0.99, restart=Restart(1.0, decay=0.99, cap=None)),
    "ResidualHardVQ": lambda: softvq.ResidualHardVQ(2, 16, 8),
}


@pytest.mark.parametrize("name", list(STATEFUL))
@pytest.mark.parametrize("bad_value", [float("nan"), float("inf")])
def test_a_refused_batch_moves_no_state(name, bad_value):
    torch.manual_seed(0)
    layer = STATEFUL[name]().train()
    good = [torch.randn(4, 16, 8) for _ in range(3)]  # (B, T, D): every layer's input
    layer(good[0])
    never_saw_it = copy.deepcopy(layer)
    bad = good[1].clone()
    bad[1, 5, 4] = bad_value  # one bad value among 512
    with pytest.raises(ValueError, match=r"\b1 (non-finite value|real token)"):  # counts the input's one value
        layer(bad)
    assert _state_equal(layer, never_saw_it)
    for batch in good[1:]:  # the run goes on as if the bad batch had never come
        torch.manual_seed(1)
        out = layer(batch)
        torch.manual_seed(1)
        ref = never_saw_it(batch)
        assert torch.equal(_first(out), _first(ref))
        assert _state_equal(layer, never_saw_it)
    assert torch.isfinite(_first(layer.eval()(good[2]))).all()


def _first(out: tuple) -> torch.Tensor:
    """The codes of a layer's output (level 0's for the hierarchy, the slots for the readout)."""
    return out[0] if isinstance(out[0], torch.Tensor) else out[0][0]


@pytest.mark.parametrize("layer", [softvq.DDCLQuantizer(4, 8), softvq.ResidualDDCL(2, 4, 8),
                                   softvq.ResidualHardVQ(2, 4, 8), softvq.HardVQ(4, 8)])
def test_integer_tokens_are_refused_by_every_layer(layer):
    with pytest.raises(ValueError, match="expected a floating-point tensor, got dtype torch.int64"):
        layer(torch.ones(3, 8, dtype=torch.long))


def test_a_readout_of_an_untrained_quantizer_says_so():
    with pytest.raises(ValueError, match="has seen no training batch: its temperature is not calibrated"):
        softvq.DDCLReadout.from_quantizer(softvq.DDCLQuantizer(8, 4))
    trained = softvq.DDCLQuantizer(8, 4)
    trained(torch.randn(64, 4))
    readout = softvq.DDCLReadout.from_quantizer(trained)
    assert readout.quantizer.temperature == trained.temperature
    assert torch.equal(readout.prototypes, trained.prototypes)


@pytest.mark.parametrize("build, message", [
    (lambda: softvq.HardVQ(8, 4, ema_decay="x"), r"ema_decay must be None or in \(0, 1\), got 'x'"),
    (lambda: softvq.HardVQ(8, 4, ema_decay=1.0), r"ema_decay must be None or in \(0, 1\), got 1.0"),
    (lambda: softvq.HardVQ(8, 4, check_finite="no"), "check_finite must be True or False, got 'no'"),
    (lambda: softvq.DDCLQuantizer(8, 4, check_finite="no"), "check_finite must be True or False, got 'no'"),
    (lambda: softvq.DDCLReadout(8, 4, check_finite=1), "check_finite must be True or False, got 1"),
])
def test_options_are_checked_strictly_and_named(build, message):
    with pytest.raises(ValueError, match=message):
        build()


def test_a_file_of_random_bytes_gets_one_line_without_unsafe_advice(tmp_path, capsys):
    path = tmp_path / "random.ckpt"
    path.write_bytes(random.Random(0).randbytes(4096))
    for load, what in ((load_vqvae, "VQ-VAE"), (load_prior, "prior")):
        with pytest.raises(ValueError) as caught:
            load(path)
        text = str(caught.value)
        assert text.startswith(f"{what} checkpoint {path} is truncated, corrupt") and "\n" not in text
        assert "weights_only" not in text and "arbitrary code" not in text
    assert evaluate.run_command(evaluate.main, [str(path), "--trainer.progress_bar", "false"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0 and "weights_only" not in err and str(path) in err


def test_the_epoch_line_leads_with_held_out_codebook_figures():
    record = {"epoch": 3, "quantizer": "DDCL", "utilization": 1.0, "dead_codes": 0, "perplexity": 410.2,
              "train_mse": 0.004, "val_utilization": 0.385, "val_dead_codes": 315, "val_perplexity": 150.0,
              "time_s": 12.0}
    line = format_record(record)
    assert "val util  38.5% dead  315 ppl   150.0" in line and "train util 100.0% dead    0 ppl   410.2" in line
    assert line.index("val util") < line.index("train util")
    del record["val_utilization"]  # an epoch without validation: the training figures alone, labelled
    assert "val util" not in format_record(record) and "train util 100.0%" in format_record(record)


# ---- training state a batch cannot break ---------------------------------------------------------------------------
def _after_twenty_normal_batches(first: torch.Tensor | None, num_codes: int, dim: int) -> tuple[float, float, float]:
    """T, H(Q) and the encoder's gradient norm after ``first`` (if any) and 20 normal batches of 256 tokens."""
    torch.manual_seed(0)
    layer = softvq.DDCLQuantizer(num_codes, dim).train()
    if first is not None:
        with pytest.warns(UserWarning, match="cannot start the codebook"):
            layer(first)
    g = torch.Generator().manual_seed(1)
    for _ in range(20):
        z = torch.randn(256, dim, generator=g).requires_grad_(True)
        out = layer(z)
    out.quantized.sum().backward()
    return layer.temperature, float(out.terms["entropy"]), float(z.grad.norm())


@pytest.mark.parametrize("num_codes, dim, first", [
    (512, 8, torch.randn(16, 8)),  # too few tokens for K at the target entropy (N e^H <= K): T went to about 1e-5
    (512, 8, torch.randn(1, 8)),  # a one-token "shape check" in training mode
    (16, 4, torch.zeros(64, 4)),  # all equal: T was 1e-18 and the gradient 1e12
])
def test_a_first_batch_that_cannot_start_the_codebook_does_not_fool_it(num_codes, dim, first):
    t, h, grad = _after_twenty_normal_batches(first, num_codes, dim)
    t_ref, h_ref, grad_ref = _after_twenty_normal_batches(None, num_codes, dim)
    assert t_ref / 1.5 < t < t_ref * 1.5  # within a factor 1.5 of a layer whose first batch was normal
    assert abs(h - h_ref) < 0.25
    assert grad_ref / 1.5 < grad < grad_ref * 1.5


def test_at_the_default_target_a_first_batch_of_at_most_sqrt_k_tokens_cannot_start_the_codebook():
    """docs/design.md, "Bad batches": N e^H <= K with H = log K / 2 is N <= sqrt(K), 22.6 at K = 512, so 22 tokens
    leave the codebook unstarted (prototypes untouched, a warning) and 23 start it."""
    for n, starts in ((22, False), (23, True)):
        torch.manual_seed(0)
        layer = softvq.DDCLQuantizer(512, 8).train()
        before = layer.prototypes.detach().clone()
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            layer(torch.randn(n, 8))
        refused = [w for w in caught if "cannot start the codebook" in str(w.message)]
        assert (not refused) == starts, n
        assert torch.equal(layer.prototypes, before) != starts, n


def test_a_zero_initialised_encoder_output_trains():
    """An encoder whose output layer starts at zero gives all-equal tokens at first: the codebook waits for tokens
    with a spread, while the layer's output still passes a gradient to the encoder, which then spreads them."""
    torch.manual_seed(0)
    encoder, decoder = torch.nn.Linear(16, 8), torch.nn.Linear(8, 16)
    torch.nn.init.zeros_(encoder.weight)
    torch.nn.init.zeros_(encoder.bias)
    layer = softvq.DDCLQuantizer(32, 8).train()
    optimizer = torch.optim.Adam([*encoder.parameters(), *decoder.parameters()], lr=1e-2)
    x = torch.randn(512, 16)
    with pytest.warns(UserWarning, match="all equal"):
        for _ in range(30):
            loss = (decoder(layer(encoder(x)).quantized) - x).square().mean()
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
    assert float(encoder.weight.detach().abs().sum()) > 0 and layer.initialized and layer.temperature > 1e-3
    used = layer.eval()(encoder(x)).indices.unique().numel()
    assert used >= 16  # half the codebook or more (HardVQ: every code but restarts alike); it was 1


def test_the_temperature_rate_is_bounded_where_the_control_is_stable():
    from softvq.parts.temperature import EntropyControl, max_stable_rate, max_varentropy
    # the bound's varentropy against a brute-force search over two-level and random distributions on 4 codes
    qs = torch.distributions.Dirichlet(torch.full((4,), 0.3)).sample((20000,)).double()
    varentropy = (qs * (-qs.clamp_min(1e-300).log()).square()).sum(1) - (qs * -qs.clamp_min(1e-300).log()).sum(1) ** 2
    assert float(varentropy.max()) <= max_varentropy(4) + 1e-9 and float(varentropy.max()) > 0.9 * max_varentropy(4)
    with pytest.raises(ValueError, match=r"temperature_rate=100(\.0)? is too large .* below .* = 0.187"):
        softvq.DDCLQuantizer(512, 8, target_entropy=EntropyControl(rate=100))
    torch.manual_seed(0)
    layer = softvq.DDCLQuantizer(64, 4, target_entropy=EntropyControl(rate=0.99 * max_stable_rate(64)),
                                 restart=None).train()
    z = torch.randn(1024, 4)
    layer(z)
    layer.set_temperature(layer.temperature * 30, keep_control=True)  # far from the target: H near log K
    entropies = [float(layer(z).terms["entropy"]) for _ in range(120)]
    assert abs(entropies[-1] - layer.target_entropy) < 1e-3  # at the bound's edge the control still converges


@pytest.mark.parametrize("build, key", [
    (lambda: softvq.DDCLQuantizer(8, 4), "prototypes"),
    (lambda: softvq.DDCLQuantizer(8, 4), "standardizer.running_var"),
    (lambda: softvq.HardVQ(8, 4, ema_decay=0.9), "prototypes"),
    (lambda: softvq.ResidualDDCL(2, 8, 4), "levels.1.ema.weighted_sum"),
])
def test_a_state_dict_with_a_non_finite_value_is_refused(build, key):
    layer = build().train()
    layer(torch.randn(64, 4))
    state = layer.state_dict()
    state[key].view(-1)[0] = float("nan")
    fresh = build()
    before = copy.deepcopy(fresh.state_dict())
    with pytest.raises(ValueError, match=rf"state '{key}' holds 1 non-finite value"):
        fresh.load_state_dict(state)
    assert all(torch.equal(v, before[k]) for k, v in fresh.state_dict().items() if isinstance(v, torch.Tensor))


def test_one_code_works_as_hard_vq_does():
    layer = softvq.DDCLQuantizer(1, 4).train()
    z = torch.randn(64, 4)
    out = layer(z)
    assert layer.target_entropy is None and layer.temperature == 1.0  # nothing to control
    assert torch.equal(out.indices, torch.zeros(64, dtype=torch.long))
    assert torch.equal(layer.eval()(z).indices, softvq.HardVQ(1, 4)(z).indices)
    with pytest.raises(ValueError, match="target_entropy=0.5 cannot be held with num_codes=1"):
        softvq.DDCLQuantizer(1, 4, target_entropy=0.5)


# ---- a property over random batch sequences (Hypothesis) -----------------------------------------------------------
_KINDS = ("normal", "equal", "spike", "nan")


@st.composite
def batch_sequences(draw):
    """Up to 8 batches: a size (0-40 tokens), a kind (normal, all equal, one large token among small ones, or with
    a NaN), a scale 1e-3..1e3, and the mode it is passed in."""
    return [(draw(st.integers(0, 40)), draw(st.sampled_from(_KINDS)), 10.0 ** draw(st.integers(-3, 3)),
             draw(st.booleans())) for _ in range(draw(st.integers(1, 8)))]


def _tokens(size: int, kind: str, scale: float, g: torch.Generator) -> torch.Tensor:
    z = torch.randn(size, 4, generator=g, dtype=torch.float64) * scale
    if kind == "equal" and size:
        z = z[:1].expand(size, 4).clone()
    elif kind == "spike" and size:
        z[0] *= 1e3
    elif kind == "nan" and size:
        z[size // 2, 1] = float("nan")
    return z


PROPERTY_LAYERS = {
    "DDCLQuantizer": lambda: softvq.DDCLQuantizer(16, 4),
    "ResidualDDCL": lambda: softvq.ResidualDDCL(2, 16, 4),
    "HardVQ": lambda: softvq.HardVQ(16, 4, ema_decay=0.99, restart=Restart(1.0, decay=0.99, cap=None)),
}


@pytest.mark.parametrize("name", list(PROPERTY_LAYERS))
@settings(max_examples=10, deadline=None, derandomize=True, suppress_health_check=[HealthCheck.too_slow])
@given(sequence=batch_sequences())
def test_no_sequence_of_batches_breaks_a_layer(name, sequence):
    """Whatever the batches: finite batches give finite outputs, ``L_q = L_OLS + V`` holds, a refused batch changes
    no state, and evaluation afterwards is finite."""
    torch.manual_seed(0)
    layer = PROPERTY_LAYERS[name]().double()  # float64: the identity then holds to rounding even at 1e6 spikes
    g = torch.Generator().manual_seed(len(sequence))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # "cannot start the codebook", "eval before training"
        for size, kind, scale, training in sequence:
            z = _tokens(size, kind, scale, g)
            layer.train(training)
            if kind == "nan" and size:
                before = copy.deepcopy(layer.state_dict())
                with pytest.raises(ValueError, match="non-finite"):
                    layer(z)
                assert all(torch.equal(v, before[k]) for k, v in layer.state_dict().items() if torch.is_tensor(v))
                continue
            out = layer(z)
            assert torch.isfinite(out.quantized).all() and torch.isfinite(out.loss)
            for key, l_q in out.terms.items():
                if key.startswith("l_q") and size:  # L_q = L_OLS + V to float64 rounding (l_q may be ~0: absolute)
                    level = key[len("l_q"):]
                    gap = float(l_q - out.terms["l_ols" + level] - out.terms["v" + level])
                    assert abs(gap) <= 1e-9 * max(1.0, float(l_q)), key
            assert all(torch.isfinite(v).all() for v in layer.state_dict().values()
                       if torch.is_tensor(v) and v.is_floating_point())
        layer.eval()
        out = layer(torch.randn(32, 4, generator=g, dtype=torch.float64))
        assert torch.isfinite(out.quantized).all() and all(torch.isfinite(v).all() for v in out.terms.values())


def test_a_batch_that_cannot_estimate_a_variance_moves_no_statistic():
    from softvq.parts import TokenStandardizer
    s = TokenStandardizer(4).train()
    for degenerate in (torch.randn(1, 4), torch.ones(16, 4) * 3.0):  # one token; all equal
        s(degenerate)
        assert int(s.num_batches_tracked) == 0 and torch.equal(s.running_var, torch.ones(4))
    z = torch.randn(64, 4) * 2 + 1
    s(z)  # still the first batch: it sets the statistics whole
    torch.testing.assert_close(s.running_mean, z.mean(0))
    torch.testing.assert_close(s.running_var, z.var(0))
    before = s.running_mean.clone(), s.running_var.clone()
    for degenerate in (torch.randn(1, 4), torch.ones(16, 4) * 3.0):
        s(degenerate)
    assert torch.equal(s.running_mean, before[0]) and torch.equal(s.running_var, before[1])
    assert int(s.num_batches_tracked) == 1
