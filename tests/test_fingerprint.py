"""A fingerprint (eval.fingerprint) means the same on every machine: the same numerics give a print that matches under
another of PyTorch's kernel sets and another thread count, values on a rounding jump included, while a change of a
value by a rounding step or more gives another print. CI runs this file under a second ATEN_CPU_CAPABILITY too."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import numpy as np
import pytest
import torch

from eval import fingerprint
from eval._provenance import ROOT


@pytest.fixture(scope="module")
def runs():
    return fingerprint.runs()


def test_the_prints_match_under_another_kernel_set_and_thread_count(runs):
    """The prints of a process with PyTorch's scalar kernels (no vector instructions) and 2 threads match this
    process's runs, whatever kernels and threads this one has; this process's own prints match too."""
    other = "default" if torch.backends.cpu.get_cpu_capability() != "DEFAULT" else "avx2"
    env = {**os.environ, "ATEN_CPU_CAPABILITY": other, "OMP_NUM_THREADS": "2"}
    code = ("import torch, json; torch.set_num_threads(2); from eval import fingerprint as f; "
            "print(json.dumps(f.today()))")
    done = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=env, capture_output=True, text=True, check=True)
    prints = json.loads(done.stdout.strip().splitlines()[-1])
    assert prints.keys() == runs.keys()
    for method, run in runs.items():
        assert run.matches(prints[method]), (method, other)
        assert run.matches(run.print()), method


def test_a_run_ends_before_its_codebook_holds_coincident_codes():
    """Coincident codes make a token's nearest code a tie that the last bits of a matmul decide: the run refuses to
    go on with them rather than give a print that depends on the machine."""
    import softvq

    def build():
        layer = softvq.HardVQ(16, 8)
        with torch.no_grad():
            layer.prototypes[3] = layer.prototypes[5]
        return layer

    with pytest.raises(RuntimeError, match="1 coincident code"):
        fingerprint.fingerprint("hard", build)


def _run(*values: float) -> fingerprint.Run:
    return fingerprint.Run([([np.array(values, dtype=np.float64)], [])])


def test_a_value_on_a_rounding_jump_rounds_alike_on_either_side_of_it():
    g, near = fingerprint.GRID, fingerprint.NEAR
    below = _run(1.0, (7 + 0.5 - near / 10) * g)  # the value within NEAR steps of cell 7's jump
    stored = below.print()
    assert stored.endswith("@7+")  # the jump moved to 7 + 3/4, and the move recorded
    above = _run(1.0, (7 + 0.5 + near / 10) * g)  # the same value another machine computed, across the jump
    assert above.matches(stored) and below.matches(stored)
    assert not _run(1.0, (7 + 0.5 + near / 10) * g + 2 * g).matches(stored)  # two steps away: another value
    # another value of the cell on the moved jump: the jump moves the other way
    crowded = _run((7 + 0.5) * g, (7 + 0.75) * g)
    assert crowded.print().endswith("@7-")
    assert _run((7 + 0.5 - 1e-9) * g, (7 + 0.75) * g).matches(crowded.print())


def test_a_change_of_a_value_by_a_step_changes_the_print():
    base = np.linspace(-3, 3, 50)
    stored = _run(*base).print()
    for i in (0, 17, 49):
        moved = base.copy()
        moved[i] += fingerprint.GRID
        assert not _run(*moved).matches(stored), i
