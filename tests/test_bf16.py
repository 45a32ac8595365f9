"""bf16 autocast on CPU (``--trainer.precision bf16-mixed``): the encoder and decoder run in bfloat16, the codebook
in float32.

A real training run through the command line, with spies on what the quantizers compute: the latents reach them in
bfloat16, yet every squared-distance matrix (and hence the Boltzmann softmax and the assignments) is float32, the
loss is finite and L_q = L_OLS + V holds to float32 rounding.
"""

from __future__ import annotations

import math

import pytest
import torch

import softvq._kernels
import softvq._soft_centroid
import softvq.parts.calibration
from softvq import DDCLQuantizer, HardVQ
from softvq.cli import train as train_vqvae

SMALL = ["--epochs", "2", "--data.batch_size", "16", "--data.train_subset", "96", "--data.val_size", "20",
         "--model.num_codes", "16", "--model.code_dim", "8", "--model.width", "16", "--model.res_hidden", "8",
         "--model.res_blocks", "1", "--data.num_workers", "0", "--trainer.accelerator", "cpu",
         "--trainer.progress_bar", "false", "--trainer.precision", "bf16-mixed"]


@pytest.fixture()
def spies(monkeypatch):
    seen: dict[str, list] = {"distances": [], "inputs": [], "probs": [], "loss": []}

    def spy(module, name="squared_distances"):
        original = getattr(module, name)

        def distances(z, codebook, *args):
            d = original(z, codebook, *args)
            seen["distances"].append((z.dtype, codebook.dtype, d.dtype, torch.is_autocast_enabled("cpu")))
            return d
        monkeypatch.setattr(module, name, distances)

    spy(softvq._soft_centroid, "logit_scores")  # DDCLQuantizer's forward pass: the scores (|z|^2 - d) / T
    spy(softvq.parts.calibration)  # its temperature calibration
    spy(softvq._kernels)  # HardVQ's nearest_codes (its batches here fit one block: squared_distances itself)
    for cls in (DDCLQuantizer, HardVQ):
        original_forward = cls.forward

        def forward(self, z, _original=original_forward):
            out = _original(self, z)
            if self.training:
                seen["inputs"].append(z.dtype)
                seen["probs"].append(out.probs.dtype)
                seen["loss"].append(float(out.loss.detach()))
            return out
        monkeypatch.setattr(cls, "forward", forward)
    return seen


def test_bf16_training_step_is_finite_and_the_codebook_computes_in_float32(tmp_path, tiny_cifar, spies):
    histories = train_vqvae.main(["--data.data_root", str(tiny_cifar["folder"]), "--out", str(tmp_path / "bf16"),
                                  "--quantizer", "ddcl", "hard", *SMALL])
    steps = 2 * 6 * 2  # 2 quantizers x 2 epochs x 6 steps
    assert len(spies["inputs"]) == steps
    assert set(spies["inputs"]) == {torch.bfloat16}  # autocast was on: the encoder emitted bfloat16
    assert set(spies["probs"]) == {torch.float32}
    assert len(spies["distances"]) >= steps  # evaluation calls count too
    assert {d[2] for d in spies["distances"]} == {torch.float32}
    assert {(d[0], d[1]) for d in spies["distances"]} == {(torch.float32, torch.float32)}
    assert {d[3] for d in spies["distances"]} == {False}  # autocast is off inside the codebook
    assert all(math.isfinite(v) for v in spies["loss"])
    for name, rows in histories.items():
        for row in rows:
            for key in ("train_mse", "perplexity", "val_psnr", "val_psnr_hard", "assignment_entropy"):
                assert row[key] is not None and math.isfinite(row[key]), (name, key)
    ddcl = histories["ddcl"]
    assert max(r["identity_residual"] for r in ddcl) < 1e-5  # float32 rounding
    assert all(r["v"] > 0 for r in ddcl)
    assert ddcl[-1]["train_mse"] < ddcl[0]["train_mse"]  # and it learns
