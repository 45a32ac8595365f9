"""eval.probe chooses settings, so it must judge them on validation and never load the official test split."""

from __future__ import annotations

import json

import pytest

import softvq.data.cifar10 as cifar10
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
