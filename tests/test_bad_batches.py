"""A batch cannot break a layer, and bad input gets an error that names the problem.

Every stateful layer refuses a bad batch before any of its state moves, so the batch after a refused one gives what it
would have given had the refused one never been passed (reference: a copy of the layer that never saw it). Loaders and
command lines print one line that says what is wrong with the file, never torch's advice to load it unsafely.
"""

from __future__ import annotations

import copy
import random

import pytest
import torch

import softvq
from softvq.cli import evaluate
from softvq.models import load_prior, load_vqvae
from softvq.models.callbacks import format_record


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
    "HardVQ EMA + restart": lambda: softvq.HardVQ(16, 8, ema_decay=0.99, dead_code_threshold=1.0),
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
