"""train_vqvae.py on Lightning DDP: 2 CPU processes (gloo) with batch B train exactly as 1 process with batch 2B.

Both runs are the real command line. In float64 (``--trainer.precision 64-true``) the only differences between them
are the rounding of one all-reduce of two half-batch sums against one full-batch sum (~1e-16), too small to move an
argmax within a few steps: code counts, utilization, dead codes and perplexity must be equal, everything else equal
to rounding. ``--check_replicas 1`` makes every DDP step verify that both processes hold the same codebook; the high
``--hard.restart.threshold`` and ``--ddcl.restart.threshold`` make codes restart, drawing tokens from both
processes' batches.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]
SMALL = ["--epochs", "2", "--data.train_subset", "64", "--data.val_size", "20", "--model.num_codes", "16",
         "--model.code_dim", "4", "--model.width", "8", "--model.res_hidden", "4", "--model.res_blocks", "1",
         "--data.num_workers", "0", "--trainer.accelerator", "cpu", "--trainer.precision", "64-true",
         "--trainer.progress_bar", "false", "--quantizer", "ddcl", "hard", "--hard.ema_decay", "0.9",
         "--ddcl.prototype_update.decay", "0.9", "--hard.restart.threshold", "30", "--hard.restart.decay", "0.9",
         "--hard.restart.cap", "null", "--ddcl.restart.threshold", "30",
         "--check_replicas", "1", "--seed", "4"]
EXACT = ("epoch", "step", "utilization", "dead_codes", "perplexity", "val_utilization", "val_dead_codes",
         "val_perplexity", "restarts")


def train(tmp_path: Path, data: Path, name: str, *extra: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)}
    result = subprocess.run([sys.executable, str(ROOT / "train_vqvae.py"), "--data.data_root", str(data),
                             "--out", str(tmp_path / name), *SMALL, *extra],
                            cwd=tmp_path, env=env, capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    return result


def rows(run: Path) -> list[dict]:
    return [json.loads(line) for line in (run / "history.jsonl").read_text().splitlines()]


def tensors(path: Path) -> dict[str, torch.Tensor]:
    state = torch.load(path, map_location="cpu", weights_only=True)["state_dict"]
    return {k: v for k, v in state.items() if isinstance(v, torch.Tensor)}


@pytest.fixture(scope="module")
def runs(tmp_path_factory, tiny_cifar):
    tmp = tmp_path_factory.mktemp("ddp")
    ddp = train(tmp, tiny_cifar["folder"], "ddp", "--trainer.devices", "2", "--data.batch_size", "8")
    single = train(tmp, tiny_cifar["folder"], "single", "--trainer.devices", "1", "--data.batch_size", "16")
    return tmp, ddp, single


@pytest.mark.parametrize("quantizer", ["ddcl", "hard"])
def test_two_processes_report_the_codebook_health_of_one_process_on_the_same_batches(runs, quantizer):
    tmp, _, _ = runs
    ddp, single = rows(tmp / "ddp" / quantizer), rows(tmp / "single" / quantizer)
    assert [r["step"] for r in ddp] == [4, 8]  # 64 images, 2 x 8 per step
    for a, b in zip(ddp, single, strict=True):
        for key in EXACT:
            assert a.get(key) == b.get(key), (quantizer, a["epoch"], key)
        for key, value in b.items():
            if isinstance(value, float) and key not in ("time_s",) + EXACT:
                assert a[key] == pytest.approx(value, rel=1e-6, abs=1e-9), (quantizer, a["epoch"], key)
    assert 0 < single[-1]["perplexity"] < 16 and single[-1]["utilization"] > 0.5  # not a degenerate case
    if quantizer == "ddcl":  # dead-code restarts drew tokens from both processes' batches, as one process would
        assert sum(r["restarts"] for r in single) > 0


@pytest.mark.parametrize("quantizer", ["ddcl", "hard"])
def test_two_processes_end_with_the_weights_of_one_process(runs, quantizer):
    tmp, _, _ = runs
    ddp = tensors(tmp / "ddp" / quantizer / "checkpoints" / "last.ckpt")
    single = tensors(tmp / "single" / quantizer / "checkpoints" / "last.ckpt")
    assert ddp.keys() == single.keys()
    for key in single:  # rounding, amplified by 8 steps of training: 1e-9 of each tensor's scale (measured: 2e-11
        # with batch renormalisation, 1e-13 without; a process-local quantity would differ by ~1e-2)
        scale = float(single[key].abs().max()) if single[key].is_floating_point() else 0.0
        torch.testing.assert_close(ddp[key], single[key], rtol=1e-9, atol=1e-12 + 1e-9 * scale, msg=key)


def test_two_level_hierarchy_on_two_processes_equals_one_process(tmp_path, tiny_cifar):
    """Level 1 starts on level 0's temperature scale, from the token variance of both processes' batches."""
    hierarchy = ["--quantizer", "ddcl", "--model.levels", "2", "--model.level_codes", "8"]
    ddp = train(tmp_path, tiny_cifar["folder"], "ddp", "--trainer.devices", "2", "--data.batch_size", "8", *hierarchy)
    train(tmp_path, tiny_cifar["folder"], "single", "--trainer.devices", "1", "--data.batch_size", "16", *hierarchy)
    assert "after each of 8 checked steps" in ddp.stdout
    for a, b in zip(rows(tmp_path / "ddp"), rows(tmp_path / "single"), strict=True):
        for key in ("utilization_l1", "dead_codes_l1", "perplexity_l1", "utilization", "perplexity"):
            assert a[key] == b[key], key
        assert a["temperature_l1"] == pytest.approx(b["temperature_l1"], rel=1e-12)


def test_every_step_checked_the_codebook_identical_on_both_processes(runs):
    _, ddp, single = runs
    checked = [line for line in ddp.stdout.splitlines() if line.startswith("replica check:")]
    assert checked == ["replica check: the codebook was identical on all 2 processes after each of 8 checked "
                       "steps (every 1)"] * 2  # one line per quantizer: 2 epochs x 4 steps
    assert "replica check" not in single.stdout  # one process: nothing to compare
