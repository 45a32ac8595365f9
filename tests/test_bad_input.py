"""Bad input, one case per line: a clear error that names the bad thing, and nothing already on disk is lost.

Command-line cases run ``train_vqvae.cli`` (exit status 2 and one ``error:`` line, or jsonargparse's usage error)
against
an output directory that already holds a finished run: after the failure every file of that run is byte-identical.
"""

from __future__ import annotations

import hashlib
import math
import re
import shutil
from pathlib import Path

import lightning as L
import numpy as np
import pytest
import torch
from conftest import write_image_folder
from PIL import Image
from torch.utils.data import Dataset

import softvq
from softvq import DDCLQuantizer
from softvq.cli import train as train_vqvae
from softvq.models import VQVAE, load_vqvae
from softvq.readout import DDCLReadout

TINY = ["--epochs", "1", "--data.batch_size", "16", "--data.train_subset", "96", "--data.val_size", "20",
        "--model.num_codes", "16", "--model.code_dim", "4", "--model.width", "8", "--model.res_hidden", "4",
        "--model.res_blocks", "1", "--data.num_workers", "0", "--trainer.accelerator", "cpu",
        "--trainer.progress_bar", "false"]


def snapshot(root: Path) -> dict[str, str]:
    return {str(p.relative_to(root)): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(root.rglob("*")) if p.is_file()}


@pytest.fixture(scope="module")
def finished(tmp_path_factory, tiny_cifar) -> Path:
    """A finished 1-epoch run (K = 16, D = 4)."""
    out = tmp_path_factory.mktemp("finished") / "run"
    assert train_vqvae.cli(["--data.data_root", str(tiny_cifar["folder"]), "--out", str(out), *TINY]) == 0
    return out


@pytest.fixture()
def previous(finished, tmp_path) -> Path:
    out = tmp_path / "previous"
    shutil.copytree(finished, out)
    return out


def fails(capsys, argv: list[str], data: Path, out: Path) -> str:
    """Run the command; it must fail with status 2 and leave ``out`` as it was. Returns stderr."""
    before = snapshot(out) if out.exists() else None  # a new --out may get config.json: nothing to lose there
    try:
        code = train_vqvae.cli(["--data.data_root", str(data), "--out", str(out), *TINY, *argv])
    except SystemExit as exit_:  # jsonargparse: a flag of the wrong type or choice
        code = exit_.code
    assert code == 2
    if before is not None:
        assert snapshot(out) == before  # nothing lost, nothing half-written
    assert not (out / "checkpoints").exists() or before is not None
    return capsys.readouterr().err


# ---- flags: a wrong type or choice is one ``error:`` line naming the flag, what it takes and the value; a value out of
# range is the constructor's one ``error:`` line naming the setting and the value; both before anything is written --
@pytest.mark.parametrize("argv, message", [
    (["--epochs", "-1"], "error: epochs must be a positive integer, got -1"),
    (["--epochs", "0"], "error: epochs must be a positive integer, got 0"),
    (["--model.eps", "0"], "error: eps must be a positive finite number, got 0.0"),
    (["--model.eps", "-0.1"], "error: eps must be a positive finite number, got -0.1"),
    (["--ddcl.temperature", "0"], "error: temperature must be a positive finite number, got 0.0"),
    (["--ddcl.temperature", "-2"], "error: temperature must be a positive finite number, got -2.0"),
    (["--ddcl.temperature", "nan"], ("error: --ddcl.temperature: expected a number or 'auto'", "got 'nan'")),
    (["--quantizer", "soft"], "argument --quantizer: invalid choice: 'soft'"),
    (["--model.num_codes", "0"], "error: num_codes must be a positive integer, got 0"),
    (["--data.batch_size", "x"], "error: --data.batch_size: expected an integer, got 'x'"),
])
def test_bad_flag(capsys, tiny_cifar, previous, argv, message):
    err = fails(capsys, argv, tiny_cifar["folder"], previous)
    assert all(part in err for part in ((message,) if isinstance(message, str) else message)), err


# ---- the run: data, checkpoints, output directory ------------------------------------------------------------------
def small_images(root: Path) -> Path:
    write_image_folder(root, per_class_train=12, per_class_test=1)
    Image.fromarray(np.zeros((28, 28, 3), np.uint8)).save(root / "train" / "cat" / "0001.jpg")
    return root / "train" / "cat" / "0001.jpg"


def corrupt_image(root: Path) -> Path:
    write_image_folder(root, per_class_train=12, per_class_test=1)
    (root / "train" / "dog" / "0002.jpg").write_bytes(b"\xff\xd8 not a jpeg")
    return root / "train" / "dog" / "0002.jpg"


def empty_folder(root: Path) -> Path:
    for split in ("train", "test"):
        (root / split / "cat").mkdir(parents=True)
    return root / "train"


def truncated_archive(root: Path, tiny: dict[str, Path]) -> Path:
    root.mkdir()
    data = tiny["archive"].read_bytes()
    (root / "cifar.tar.gz").write_bytes(data[: len(data) // 2])
    return root / "cifar.tar.gz"


def test_wrong_image_size(capsys, tmp_path):
    bad = small_images(tmp_path / "data")
    err = fails(capsys, [], tmp_path / "data", tmp_path / "new")
    assert f"image {bad} is 28x28 pixels; CIFAR-10 images are 32x32" in err


def test_corrupt_image_file(capsys, tmp_path):
    bad = corrupt_image(tmp_path / "data")
    assert f"cannot decode image {bad}" in fails(capsys, [], tmp_path / "data", tmp_path / "new")


def test_corrupt_image_file_read_by_a_loader_worker_is_one_line(capsys, tmp_path):
    bad = corrupt_image(tmp_path / "data")
    err = fails(capsys, ["--data.num_workers", "1"], tmp_path / "data", tmp_path / "new")
    assert err.startswith(f"error: cannot decode image {bad}") and err.count("\n") == 1, err  # not the traceback


def test_empty_dataset(capsys, tmp_path):
    folder = empty_folder(tmp_path / "data")
    assert f"{folder} holds no images" in fails(capsys, [], tmp_path / "data", tmp_path / "new")


def test_corrupt_archive(capsys, tmp_path, tiny_cifar, monkeypatch):
    archive = truncated_archive(tmp_path / "data", tiny_cifar)
    monkeypatch.setenv("SOFTVQ_CACHE", str(tmp_path / "cache"))
    assert str(archive) in fails(capsys, [], archive, tmp_path / "new")
    assert not any((tmp_path / "cache").rglob("train"))  # no half-extracted tree left to be mistaken for data


def test_truncated_checkpoint(capsys, tiny_cifar, previous):
    last = previous / "checkpoints" / "last.ckpt"
    last.write_bytes(last.read_bytes()[:5000])
    assert f"checkpoint {last} is truncated or corrupt" in fails(capsys, ["--resume", "--epochs", "2"],
                                                                 tiny_cifar["folder"], previous)


def test_checkpoint_with_another_codebook_size(capsys, tiny_cifar, previous):
    err = fails(capsys, ["--resume", "--epochs", "2", "--model.num_codes", "32"], tiny_cifar["folder"], previous)
    assert "another model configuration" in err and "num_codes: checkpoint 16 vs now 32" in err


def test_checkpoint_with_another_code_dim(capsys, tiny_cifar, previous):
    err = fails(capsys, ["--resume", "--epochs", "2", "--model.code_dim", "8"], tiny_cifar["folder"], previous)
    assert "code_dim: checkpoint 4 vs now 8" in err


def test_start_over_an_existing_run_without_resume_or_overwrite(capsys, tiny_cifar, previous):
    assert f"{previous} already holds a run" in fails(capsys, [], tiny_cifar["folder"], previous)


def test_unwritable_out(capsys, tmp_path, tiny_cifar):
    (tmp_path / "a_file").write_text("keep me")
    out = tmp_path / "a_file" / "run"
    assert f"cannot write to the output directory {out}" in fails(capsys, [], tiny_cifar["folder"], out)
    assert (tmp_path / "a_file").read_text() == "keep me"


# ---- NaN / Inf during training: stop at the step, keep the last good checkpoint, resume after the fix -------------
class PoisonAfter(Dataset):
    """``base`` whose items, after the first ``after`` reads, are filled with ``value``."""

    def __init__(self, base: Dataset, after: int, value: float) -> None:
        self.base, self.after, self.value, self.reads = base, after, value, 0

    def __len__(self) -> int:
        return len(self.base)

    def __getitem__(self, index: int):
        self.reads += 1
        image, label = self.base[index]
        if self.reads > self.after:
            image = torch.full_like(image, self.value)
        return image, label


def poison(monkeypatch, after: int, value: float) -> None:
    class Poisoned(train_vqvae.CIFAR10DataModule):
        def setup(self, stage=None):
            super().setup(stage)
            if not isinstance(self.train_set, PoisonAfter):
                self.train_set = PoisonAfter(self.train_set, after, value)

    monkeypatch.setattr(train_vqvae, "CIFAR10DataModule", Poisoned)


@pytest.mark.parametrize("value, message", [
    (float("nan"), "training batch 0 of epoch 2 (global step 6) holds 3072 NaN/Inf pixel value(s) out of 49152"),
    (float("-inf"), "training batch 0 of epoch 2 (global step 6) holds 3072 NaN/Inf pixel value(s) out of 49152"),
    (1e20, "non-finite training loss (inf) in training batch 0 of epoch 2 (global step 6)"),  # finite tokens
])
def test_non_finite_values_in_training(capsys, monkeypatch, tmp_path, tiny_cifar, value, message):
    out = tmp_path / "run"
    poison(monkeypatch, after=96 + 15, value=value)  # epoch 1 reads 96 images; the 16th read of epoch 2 is bad
    argv = ["--data.data_root", str(tiny_cifar["folder"]), "--out", str(out), *TINY, "--epochs", "3"]
    assert train_vqvae.cli(argv) == 2
    err = capsys.readouterr().err
    assert message in err and "global step 6" in err
    last = out / "checkpoints" / "last.ckpt"
    assert f"the last good checkpoint, {last} (end of epoch 1), is kept" in err
    assert torch.load(last, map_location="cpu", weights_only=True)["epoch"] == 0
    assert [r["epoch"] for r in train_vqvae.read_history(out / "history.jsonl")] == [1]
    monkeypatch.undo()  # the data is fixed: the run continues from the kept checkpoint
    assert train_vqvae.cli([*argv, "--resume"]) == 0
    assert [r["epoch"] for r in train_vqvae.read_history(out / "history.jsonl")] == [1, 2, 3]


class BlowUpEncoder(L.Callback):
    """Training diverges: at ``step`` the encoder's last weights become infinite, so the tokens are not finite."""

    def __init__(self, step: int) -> None:
        self.step = step

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        if trainer.global_step == self.step:
            with torch.no_grad():
                list(pl_module.encoder.parameters())[-2].fill_(float("inf"))


def test_non_finite_tokens_in_training(capsys, monkeypatch, tmp_path, tiny_cifar):
    build = train_vqvae.build_trainer

    def with_blow_up(*args, **kwargs):
        trainer = build(*args, **kwargs)
        trainer.callbacks.insert(0, BlowUpEncoder(step=8))
        return trainer

    monkeypatch.setattr(train_vqvae, "build_trainer", with_blow_up)
    out = tmp_path / "run"
    argv = ["--data.data_root", str(tiny_cifar["folder"]), "--out", str(out), *TINY, "--epochs", "3"]
    assert train_vqvae.cli(argv) == 2
    err = capsys.readouterr().err
    assert "the encoder produced" in err and "NaN/Inf latent value(s)" in err
    assert "in training batch 2 of epoch 2 (global step 8): training diverged" in err
    assert f"the last good checkpoint, {out / 'checkpoints' / 'last.ckpt'} (end of epoch 1), is kept" in err
    assert torch.load(out / "checkpoints" / "last.ckpt", map_location="cpu", weights_only=True)["epoch"] == 0


# ---- the library API --------------------------------------------------------------------------------------------
def test_unknown_quantizer_name():
    with pytest.raises(ValueError, match=r"quantizer must be one of \('ddcl', 'hard', 'rddcl', 'rhard'\), got 'soft'"):
        VQVAE(quantizer="soft")


@pytest.mark.parametrize("make, message", [
    (lambda: DDCLQuantizer(8, 4, temperature=0.0), "temperature must be a positive finite number, got 0.0"),
    (lambda: DDCLQuantizer(8, 4, temperature=-1.0), "temperature must be a positive finite number, got -1.0"),
    (lambda: VQVAE(num_codes=8, code_dim=4, width=8, eps=0.0), "eps must be a positive finite number, got 0.0"),
    (lambda: softvq.param_groups(VQVAE(num_codes=8, code_dim=4, width=8), lr=1e-3, eps=-0.1), "eps"),
    (lambda: DDCLQuantizer(0, 4), "num_codes must be a positive integer, got 0"),
])
def test_invalid_hyperparameter(make, message):
    with pytest.raises(ValueError, match=message.replace("(", r"\(").replace(")", r"\)")):
        make()


def test_wrong_image_size_in_the_model():
    with pytest.raises(ValueError, match=r"multiples of 4 \(2\^downsamples\), got \(30, 30\)"):
        VQVAE(num_codes=8, code_dim=4, width=8)(torch.rand(2, 3, 30, 30))


def test_non_finite_tokens_in_the_layers():
    tokens = torch.randn(2, 5, 4)
    tokens[1, 2, 3] = float("nan")
    with pytest.raises(ValueError, match=r"non-finite value\(s\) \(NaN or Inf\)"):
        DDCLQuantizer(8, 4)(tokens)
    with pytest.raises(ValueError, match=r"tokens hold 1 real token\(s\) with NaN or Inf, the first in row 1"):
        DDCLReadout(8, 4)(tokens)


def test_truncated_checkpoint_in_the_loader(tmp_path, finished):
    broken = tmp_path / "last.ckpt"
    broken.write_bytes((finished / "checkpoints" / "last.ckpt").read_bytes()[:3000])
    with pytest.raises(ValueError, match=f"VQ-VAE checkpoint {broken} is truncated, corrupt"):
        load_vqvae(broken)
    with pytest.raises(FileNotFoundError, match="VQ-VAE checkpoint not found"):
        load_vqvae(tmp_path / "missing.ckpt")


def test_truncated_archive_in_the_data_module(tmp_path, tiny_cifar, monkeypatch):
    archive = truncated_archive(tmp_path / "data", tiny_cifar)
    monkeypatch.setenv("SOFTVQ_CACHE", str(tmp_path / "cache"))
    with pytest.raises(softvq.data.CorruptArchiveError, match=str(archive)):
        softvq.data.CIFAR10DataModule(archive).setup()


# ---- integer types, bools, windows, probabilities, tokens too large for their squared distances --
@pytest.mark.parametrize("make, message", [
    (lambda: DDCLQuantizer(16, 8, temperature=True), "temperature must be a positive finite number, got True"),
    (lambda: DDCLQuantizer(16, 8, temperature=np.bool_(True)), "temperature must be a positive finite number"),
    (lambda: softvq.HardVQ(16, 8, commitment_weight=False),
     "commitment_weight must be a non-negative finite number, got False"),
    (lambda: DDCLQuantizer(True, 8), "num_codes must be a positive integer, got True"),
    (lambda: softvq.HierarchicalDDCL((8, 4), 4, pool=2.0), "pool must be an int >= 1 or a sequence of windows"),
    (lambda: softvq.HierarchicalDDCL((8, 4), 4, pool="2"), "pool must be an int >= 1 or a sequence of windows"),
    (lambda: softvq.CodebookUsage(4).update(torch.tensor([0, 1]), torch.tensor([[0.5, 0.5, 0, 0],
                                                                                [float("nan"), 1, 0, 0]])),
     "probs must be assignment probabilities in [0, 1]; 1 entries are not (e.g. nan)"),
    (lambda: softvq.CodebookUsage(4).update(torch.tensor([1]), torch.tensor([[-0.5, 1.5, 0, 0]])),
     "probs must be assignment probabilities in [0, 1]; 2 entries are not (e.g. -0.5)"),
    (lambda: softvq.CodebookUsage(4).update(torch.tensor([0, 1]), torch.tensor([[1.0, 0, 0, 0], [0, 1.5, 0, 0]])),
     "probs must be assignment probabilities in [0, 1]; 1 entries are not (e.g. 1.5)"),
    (lambda: softvq.CodebookUsage(4).update(torch.tensor([0]), torch.tensor([[float("inf"), 0, 0, 0]])),
     "probs must be assignment probabilities in [0, 1]; 1 entries are not (e.g. inf)"),
])
def test_bad_api_input_by_message(make, message):
    with pytest.raises(ValueError, match=re.escape(message)):
        make()


def test_probabilities_at_the_ends_of_the_range_are_accepted():
    probs = torch.tensor([[1.0 + 5e-6, 0, 0, 0], [0, 0.25, 0.75, 0]], dtype=torch.float64)
    usage = softvq.CodebookUsage(4)
    usage.update(torch.tensor([0, 2]), probs)
    assert usage.compute()["utilization"] == pytest.approx(0.5)


def test_numpy_integers_are_accepted_as_plain_ints():
    layer = DDCLQuantizer(np.int64(16), np.int32(8))
    assert type(layer.num_codes) is int and type(layer.dim) is int and layer.codebook.shape == (16, 8)
    hard = softvq.HardVQ(np.int64(16), np.int64(8))
    assert type(hard.num_codes) is int and hard.codebook.shape == (16, 8)
    assert softvq.HierarchicalDDCL((np.int64(8), 4), 4, pool=np.int64(2)).pool == (2,)
    assert layer(torch.randn(5, 8)).indices.shape == (5,)


@pytest.mark.parametrize("make", [lambda: DDCLQuantizer(16, 8), lambda: softvq.HardVQ(16, 8)],
                         ids=["ddcl", "hard"])
def test_tokens_too_large_for_squared_distances(make):
    """|z| >= 1e19 in float32 overflowed the squared distances (NaN from DDCL, inf from HardVQ): now an error naming
    the magnitude and the limit; just below the limit both compute, HardVQ's codes checked against float64."""
    limit = math.sqrt(torch.finfo(torch.float32).max / (16 * 8))  # the bound derived in max_token_magnitude
    layer = make()
    z = torch.randn(32, 8)
    z[3, 5] = 1e19
    with pytest.raises(ValueError, match=r"z has a value of magnitude 1e\+19, above 1\.63e\+18"):
        layer(z)
    torch.manual_seed(0)
    z = (torch.rand(64, 8) * 2 - 1) * 0.99 * limit
    with torch.no_grad():  # codes inside the bound too: 16 of the tokens (an untrained standardiser is the identity)
        layer.prototypes.copy_(z[:16])
    codes = layer.codebook.clone()
    out = layer.eval()(z)  # the distance computation alone (no codebook or temperature update)
    assert torch.isfinite(out.quantized).all() and torch.isfinite(out.probs).all() and torch.isfinite(out.loss)
    assert all(torch.isfinite(v) for v in out.terms.values())
    reference = torch.cdist(z.double(), codes.double()).argmin(1)  # exact nearest codes in float64
    assert torch.equal(out.indices, reference)


# ---- classes -----------------------------------------------------------------------------------
def test_a_class_missing_from_test_is_refused_before_training(capsys, tmp_path):
    write_image_folder(tmp_path / "data", per_class_train=12, per_class_test=1)
    shutil.rmtree(tmp_path / "data" / "test" / "ship")
    err = fails(capsys, [], tmp_path / "data", tmp_path / "new")
    assert err.count("\n") == 1 and "only in" in err and "train: ['ship']; only in" in err and "test: none" in err
    assert not (tmp_path / "new").exists()  # checked before anything was written


def test_resume_on_data_with_other_classes_is_refused(capsys, tmp_path, tiny_cifar, previous):
    other = tmp_path / "other"
    shutil.copytree(tiny_cifar["folder"], other)
    for split in ("train", "test"):
        (other / split / "frog").rename(other / split / "toad")
    err = fails(capsys, ["--resume", "--epochs", "2"], other, previous)
    assert "only in checkpoint" in err and "['frog']; only in the data at" in err and "['toad']" in err
