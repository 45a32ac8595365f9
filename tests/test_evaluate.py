"""eval.evaluate against a by-hand evaluation of the same checkpoint on the same test images."""

from __future__ import annotations

import json
import math
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from PIL import Image
from torchmetrics.functional.image import structural_similarity_index_measure
from torchvision.transforms.functional import to_tensor

from softvq.cli import evaluate
from softvq.cli import train as train_vqvae
from softvq.models import load_vqvae

ROOT = Path(__file__).resolve().parents[1]
TINY = ["--data.train_subset", "96", "--data.val_size", "32", "--data.batch_size", "32", "--model.width", "16",
        "--model.res_hidden", "8", "--model.res_blocks", "1", "--model.num_codes", "16", "--model.code_dim", "8",
        "--data.num_workers", "0", "--trainer.progress_bar", "false", "--epochs", "2"]


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory, tiny_cifar):
    out = tmp_path_factory.mktemp("vqvae")
    train_vqvae.main([*TINY, "--data.data_root", str(tiny_cifar["folder"]), "--out", str(out), "--quantizer", "ddcl",
                      "hard", "--ddcl.temperature", "0.5"])
    return {name: out / name / "checkpoints" / "last.ckpt" for name in ("ddcl", "hard")}


def split_images(folder: Path) -> torch.Tensor:
    """The test split in ImageFolder order (classes alphabetical, files sorted), as the data module reads it."""
    files = sorted((folder / "test").glob("*/*.jpg"), key=lambda p: (p.parent.name, p.name))
    return torch.stack([to_tensor(Image.open(f).convert("RGB")) for f in files])


@pytest.mark.parametrize("name", ["ddcl", "hard"])
def test_every_key_and_the_values_of_a_by_hand_evaluation(checkpoints, tiny_cifar, name):
    result = evaluate.evaluate(checkpoints[name], tiny_cifar["folder"], batch_size=16, num_workers=0,
                               accelerator="cpu", progress=False)
    assert set(evaluate.METRICS) <= set(result)
    assert result["images"] == 50 and result["epochs"] == 2 and result["global_step"] == 6  # 96 images / 32
    assert result["quantizer"] == name and result["num_codes"] == 16 and result["split"] == "test"

    # the reference runs the model as the tool does (float32, batches of 16: a token within float32 rounding of a tie
    # between two codes takes the same one) and computes every metric from its outputs by hand, in float64
    model = load_vqvae(checkpoints[name])
    x = split_images(tiny_cifar["folder"])
    with torch.no_grad():
        outs = [model(batch) for batch in x.split(16)]
        indices = torch.cat([o.quantizer.indices for o in outs])
        soft = torch.cat([o.reconstruction for o in outs]).double()
        hard = model.decode_indices(indices).double()
    x = x.double()
    for suffix, rec in (("", soft), ("_hard", hard)):
        mse = ((rec - x) ** 2).mean().item()
        clamped = rec.clamp(0, 1)
        psnr = (10 * torch.log10(1 / ((clamped - x) ** 2).mean(dim=(1, 2, 3)))).mean().item()
        ssim = structural_similarity_index_measure(clamped, x, data_range=1.0).item()
        assert result["mse" + suffix] == pytest.approx(mse, rel=1e-4)
        assert result["psnr" + suffix] == pytest.approx(psnr, rel=1e-4)
        assert result["ssim" + suffix] == pytest.approx(ssim, abs=1e-4)
    if name == "hard":  # straight-through: the reconstruction is the hard decode
        assert result["psnr"] == result["psnr_hard"]
    counts = torch.bincount(indices.flatten(), minlength=16)
    assert result["code_counts"] == counts.tolist() and sum(result["code_counts"]) == 50 * 8 * 8
    p = counts.double() / counts.sum()
    assert result["utilization"] == pytest.approx((counts > 0).double().mean().item())
    assert result["dead_codes"] == int((counts == 0).sum())
    assert result["perplexity"] == pytest.approx(math.exp(-(p[p > 0] * p[p > 0].log()).sum().item()), rel=1e-5)


def test_limit_and_the_command_line(checkpoints, tiny_cifar, tmp_path, capsys):
    out = tmp_path / "metrics.json"
    printed = evaluate.main([str(checkpoints["ddcl"]), "--data.data_root", str(tiny_cifar["archive"]), "--limit",
                             "20", "--data.num_workers", "0", "--trainer.progress_bar", "false", "--out", str(out),
                             "--trainer.accelerator", "cpu"])
    assert printed["images"] == 20 and sum(printed["code_counts"]) == 20 * 64
    saved = json.loads(out.read_text())
    config = saved.pop("config")  # the resolved settings, beside the metrics
    assert saved == printed and config["limit"] == 20 and config["data"]["num_workers"] == 0
    assert config["checkpoint"] == str(checkpoints["ddcl"]) and config["trainer"]["accelerator"] == "cpu"
    shown = json.loads(capsys.readouterr().out)
    assert "code_counts" not in shown and shown["psnr_hard"] == printed["psnr_hard"]


def test_missing_or_truncated_checkpoint_is_a_clear_error_naming_the_file(checkpoints, tiny_cifar, tmp_path):
    with pytest.raises(FileNotFoundError, match="nope.ckpt"):
        evaluate.evaluate(tmp_path / "nope.ckpt", tiny_cifar["folder"])
    truncated = tmp_path / "truncated.ckpt"
    truncated.write_bytes(checkpoints["ddcl"].read_bytes()[:2000])
    with pytest.raises(ValueError, match="truncated.ckpt is truncated"):
        evaluate.evaluate(truncated, tiny_cifar["folder"])
    with pytest.raises(ValueError, match="limit"):
        evaluate.evaluate(checkpoints["ddcl"], tiny_cifar["folder"], limit=0)
    copy = tmp_path / "copy.ckpt"
    shutil.copy(checkpoints["ddcl"], copy)
    with pytest.raises(FileNotFoundError, match="no-such-data"):
        evaluate.evaluate(copy, tmp_path / "no-such-data", num_workers=0)
    # As a script: a one-line error and exit status 2, no traceback.
    proc = subprocess.run([sys.executable, "-m", "eval.evaluate", str(truncated), "--data.data_root",
                           str(tiny_cifar["folder"])], cwd=ROOT, capture_output=True, text=True)
    assert proc.returncode == 2 and proc.stderr.startswith("error: VQ-VAE checkpoint")
    assert "truncated.ckpt" in proc.stderr
    assert "Traceback" not in proc.stderr


def renamed_class(tiny: Path, root: Path) -> Path:
    """The tiny tree with class 'truck' renamed 'lorry' in both splits: 10 classes, one of them not CIFAR-10's."""
    shutil.copytree(tiny, root)
    for split in ("train", "test"):
        (root / split / "truck").rename(root / split / "lorry")
    return root


def test_data_with_other_classes_than_the_checkpoint_is_refused(checkpoints, tiny_cifar, tmp_path):
    other = renamed_class(tiny_cifar["folder"], tmp_path / "other")
    assert load_vqvae(checkpoints["hard"]).class_names == tuple(sorted(p.name for p in
                                                                       (tiny_cifar["folder"] / "test").iterdir()))
    with pytest.raises(ValueError, match=r"only in checkpoint .*: \['truck'\]; only in the data at .*: \['lorry'\]"):
        evaluate.evaluate(checkpoints["hard"], other, num_workers=0, accelerator="cpu", progress=False)


def test_out_that_cannot_be_a_file_is_refused_before_evaluating(checkpoints, tiny_cifar, tmp_path, monkeypatch):
    def never(*args, **kwargs):
        raise AssertionError("the evaluation ran before --out was checked")

    monkeypatch.setattr(evaluate, "evaluate", never)
    base = [str(checkpoints["hard"]), "--data.data_root", str(tiny_cifar["folder"]), "--trainer.progress_bar", "false"]
    with pytest.raises(IsADirectoryError, match=f"--out {tmp_path} is a directory; give a file name"):
        evaluate.main([*base, "--out", str(tmp_path)])
    (tmp_path / "a_file").write_text("keep")
    with pytest.raises(NotADirectoryError, match=f"{tmp_path / 'a_file'} is a file, not a directory"):
        evaluate.main([*base, "--out", str(tmp_path / "a_file" / "metrics.json")])
    assert (tmp_path / "a_file").read_text() == "keep"
