"""Every public layer and recipe trains bit for bit as recorded in tests/golden/layers.json (50 steps of outputs,
gradients and state), and every saved state in tests/golden/states/ loads into a freshly built layer and evaluates
to the tensors saved with it. A rewrite of the layers' internals keeps both; a change of numerics re-records them
(``python tests/golden/make_golden.py``) and says why in its commit."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).parent / "golden"))
import make_golden as record  # noqa: E402

GOLDEN = json.loads(record.GOLDEN.read_text())
# bits depend on torch's build and on the CPU kernels it dispatches to (AVX2 and AVX512 sum in other orders)
SAME_TORCH = pytest.mark.skipif(
    (torch.__version__, torch.backends.cpu.get_cpu_capability()) != (GOLDEN["torch"], GOLDEN["cpu"]),
    reason=f"recorded with torch {GOLDEN['torch']} on {GOLDEN['cpu']}: bits may differ under {torch.__version__} on "
           f"{torch.backends.cpu.get_cpu_capability()}")


@pytest.fixture(autouse=True)
def one_thread():
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # as recorded: a reduction's order may depend on the thread count
    yield
    torch.set_num_threads(threads)


@SAME_TORCH
@pytest.mark.parametrize("name", sorted(record.CASES))
def test_training_reproduces_the_golden_file(name):
    assert record.compare(name, GOLDEN["cases"][name]) is None


def test_the_check_sees_one_changed_option(monkeypatch):
    """The control: EMA decay 0.98 instead of 0.99 changes the state after the first step, and the check says so."""
    _, shape, dtype = record.CASES["hard_ema_restart"]
    monkeypatch.setitem(record.CASES, "hard_ema_restart",
                        (lambda: record.softvq.HardVQ(record.K, record.D, ema_decay=0.98,
                                                             restart=record.HARD_RESTART),
                         shape, dtype))
    assert record.compare("hard_ema_restart", GOLDEN["cases"]["hard_ema_restart"]) == \
        "hard_ema_restart: step 0, state differs"


@pytest.mark.parametrize("name", sorted(record.CASES))
def test_a_saved_state_loads_and_evaluates_as_saved(name):
    saved = torch.load(record.STATES / f"{name}.pt", weights_only=True)
    build, _, dtype = record.CASES[name]
    layer = build().to(dtype)
    layer.load_state_dict(saved["state_dict"])
    with torch.no_grad():
        out = layer.eval()(saved["batch"])
    got = dict(record.tensors_of(out, "out"))
    assert got.keys() == saved["eval_output"].keys()
    exact = (torch.__version__, torch.backends.cpu.get_cpu_capability()) == (GOLDEN["torch"], GOLDEN["cpu"])
    for key, want in saved["eval_output"].items():
        if exact or not want.is_floating_point():
            assert torch.equal(got[key], want), key
        else:  # another build or CPU: the same numbers up to summation order
            torch.testing.assert_close(got[key], want, rtol=1e-5, atol=1e-6, msg=key)
