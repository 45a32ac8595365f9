"""eval.probe chooses settings, so it must judge them on validation and never load the official test split."""

from __future__ import annotations

import json

import pytest
import torch

import softvq
import softvq.data.cifar10 as cifar10
import softvq.parts
from eval import probe


def test_probe_reads_validation_and_never_the_test_split(tiny_cifar, tmp_path, monkeypatch):
    real_load_split = cifar10.load_split

    def no_test_split(source, root, train, transform=None):
        assert train, "a probe loaded the test split"
        return real_load_split(source, root, train, transform)

    monkeypatch.setattr(cifar10, "load_split", no_test_split)
    monkeypatch.setattr(cifar10.CIFAR10DataModule, "test_dataloader",
                        lambda self: pytest.fail("a probe asked for the test loader"))
    results = tmp_path / "probes.jsonl"
    result = probe.main(["--data-root", str(tiny_cifar["folder"]), "--train-subset", "64", "--val-size", "32",
                         "--epochs", "1", "--num-codes", "16", "--code-dim", "8", "--num-workers", "0",
                         "--model-kwargs", '{"width": 16, "res_hidden": 8, "res_blocks": 1}',
                         "--results", str(results)])
    assert result["split"] == "validation" and not any(key.startswith("test") for key in result)
    assert 0 < result["val_util"] <= 1 and 0 < result["val_psnr_hard"] < 60
    assert json.loads(results.read_text()) == result
    with pytest.raises(SystemExit):
        probe.main(["--data-root", str(tiny_cifar["folder"]), "--val-size", "0"])


def test_a_straight_through_level_keeps_the_code_and_passes_the_gradient_unchanged():
    z = torch.randn(64, 4, generator=torch.Generator().manual_seed(0), dtype=torch.float64)
    grads, outs = [], []
    for level_gradient in ("soft_centroid", "straight_through"):
        torch.manual_seed(0)  # the same prototypes (drawn from the first batch) and restarts in both
        layer = probe.build_quantizer("rddcl", 16, 4, {}, num_quantizers=2, level_gradient=level_gradient)
        x = z.clone().requires_grad_(True)
        out = layer.double().train()(x)
        upstream = torch.linspace(-1, 1, out.quantized.numel(), dtype=torch.float64).reshape(out.quantized.shape)
        (out.quantized * upstream).sum().backward()
        grads.append(x.grad)
        outs.append(out)
    torch.testing.assert_close(outs[1].quantized, outs[0].quantized, rtol=0, atol=1e-12)  # the same codes (r + (c - r))
    assert torch.equal(outs[1].indices, outs[0].indices)
    # through the shared standardiser s(z), each of the 2 levels passes the upstream g unchanged: grad = 2 J_s^T g
    x = z.clone().requires_grad_(True)
    standardised, _, _ = softvq.parts.TokenStandardizer(4, renorm=True).double().train()(x)  # ResidualDDCL's default
    (2 * standardised * upstream).sum().backward()
    torch.testing.assert_close(grads[1], x.grad, rtol=1e-10, atol=1e-12)
    assert not torch.allclose(grads[0], grads[1])  # the soft centroid's Jacobian is another gradient
    with pytest.raises(ValueError, match="rddcl only"):
        probe.build_quantizer("rhard", 16, 4, {}, level_gradient="straight_through")


def test_adam_betas_reach_every_parameter_group_of_the_optimizer_that_steps(tiny_cifar, tmp_path, monkeypatch):
    seen = []
    step = torch.optim.Adam.step

    def recording_step(self, *args, **kwargs):
        seen.append({tuple(g["betas"]) for g in self.param_groups})
        return step(self, *args, **kwargs)

    monkeypatch.setattr(torch.optim.Adam, "step", recording_step)
    probe.main(["--data-root", str(tiny_cifar["folder"]), "--train-subset", "32", "--val-size", "16", "--epochs", "1",
                "--num-codes", "8", "--code-dim", "4", "--num-workers", "0", "--quantizer", "hard",
                "--model-kwargs", '{"width": 8, "res_hidden": 4, "res_blocks": 1}', "--adam-betas", "0.5", "0.9",
                "--results", str(tmp_path / "r.jsonl")])
    assert seen and all(groups == {(0.5, 0.9)} for groups in seen)
