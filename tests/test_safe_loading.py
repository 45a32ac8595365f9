"""No file this project loads runs code, even with ``TORCH_FORCE_NO_WEIGHTS_ONLY_LOAD=1``.

A pickle payload that creates a marker file when unpickled is fed to every entry point that loads a ``torch.save``
file: resuming training (a ``--resume FILE`` and a planted ``last.ckpt``), the NaN-stop message, the evaluation, the
model and prior loaders, the prior's resume check, Lightning's checkpoint IO, the code and latent caches. The marker
must never appear, and each refusal must name the file.
"""

from __future__ import annotations

import hashlib
import json
import pickle
import shutil
import zipfile
from pathlib import Path

import pytest
import torch

from softvq.cli import evaluate
from softvq.cli import prior as train_prior
from softvq.cli import train as train_vqvae
from softvq.data.cifar10 import CIFAR10DataModule
from softvq.models import PriorConfig, load_prior, load_vqvae
from softvq.models.callbacks import AtomicCheckpointIO
from softvq.models.checkpoint_io import UnsafeCheckpointError
from softvq.models.codes import cache_key, cache_path, code_splits

TINY = ["--epochs", "1", "--data.batch_size", "16", "--data.train_subset", "48", "--data.val_size", "16",
        "--model.num_codes", "16", "--model.code_dim", "4", "--model.width", "8", "--model.res_hidden", "4",
        "--model.res_blocks", "1", "--data.num_workers", "0", "--trainer.accelerator", "cpu", "--trainer.progress_bar",
        "false", "--quantizer", "hard"]


class Payload:
    """Unpickling this calls ``Path(marker).touch()``: what an attacker's code would do, visibly."""

    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self):
        return Path.touch, (self.marker,)


def write_payload(path: Path, marker: Path, like: dict | None = None) -> Path:
    """A file shaped like a checkpoint (or ``like``) that also holds the payload."""
    content = dict(like or {"state_dict": {}, "epoch": 0, "global_step": 0, "hyper_parameters": {}})
    content["payload"] = Payload(marker)
    path.parent.mkdir(parents=True, exist_ok=True)
    torch.save(content, path)
    return path


def snapshot(root: Path) -> dict[str, str]:
    return {str(p.relative_to(root)): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(root.rglob("*")) if p.is_file()}


@pytest.fixture(autouse=True)
def _torch_would_load_pickles(monkeypatch):
    """The setting that turned torch's safe default off: only an explicit weights_only=True keeps the loaders safe."""
    monkeypatch.setenv("TORCH_FORCE_NO_WEIGHTS_ONLY_LOAD", "1")


@pytest.fixture(scope="module")
def finished(tmp_path_factory, tiny_cifar) -> Path:
    out = tmp_path_factory.mktemp("safe") / "run"
    assert train_vqvae.cli(["--data.data_root", str(tiny_cifar["folder"]), "--out", str(out), *TINY]) == 0
    return out


@pytest.fixture()
def marker(tmp_path) -> Path:
    return tmp_path / "PAYLOAD-RAN"


def test_the_payload_is_live(tmp_path, marker):
    """Control: unpickled in full (its data.pkl, with the standard pickle module), the file does run code; so the
    marker's absence below means something."""
    path = write_payload(tmp_path / "evil.ckpt", marker)
    with zipfile.ZipFile(path) as archive:
        (member,) = [name for name in archive.namelist() if name.endswith("/data.pkl")]
        pickle.loads(archive.read(member))  # noqa: S301 - the point of the control
    assert marker.exists()


def test_resume_from_a_payload_file(capsys, tmp_path, tiny_cifar, marker):
    evil = write_payload(tmp_path / "evil.ckpt", marker)
    out = tmp_path / "new"
    assert train_vqvae.cli(["--data.data_root", str(tiny_cifar["folder"]), "--out", str(out), *TINY,
                            "--resume", str(evil)]) == 2
    err = capsys.readouterr().err
    assert not marker.exists()
    assert err.startswith(f"error: checkpoint {evil} is unsafe to load") and err.count("\n") == 1, err
    assert not out.exists()  # refused before anything was written


def test_resume_from_a_planted_last_checkpoint(capsys, tmp_path, tiny_cifar, finished, marker):
    out = tmp_path / "run"
    shutil.copytree(finished, out)
    last = out / "checkpoints" / "last.ckpt"
    write_payload(last, marker, like=torch.load(last, weights_only=True))
    before = snapshot(out)
    assert train_vqvae.cli(["--data.data_root", str(tiny_cifar["folder"]), "--out", str(out), *TINY, "--epochs", "2",
                            "--resume"]) == 2
    assert not marker.exists()
    assert f"checkpoint {last} is unsafe to load" in capsys.readouterr().err
    assert snapshot(out) == before  # config.json, history, checkpoints: byte-identical


def test_nan_stop_message_reads_the_last_checkpoint_safely(tmp_path, marker):
    write_payload(tmp_path / "checkpoints" / "last.ckpt", marker)
    message = train_vqvae.last_good_checkpoint(tmp_path)
    assert not marker.exists()
    assert "cannot be read" in message and "unsafe to load" in message


def test_evaluation_refuses_a_payload(capsys, tmp_path, tiny_cifar, marker):
    evil = write_payload(tmp_path / "evil.ckpt", marker)
    with pytest.raises(UnsafeCheckpointError, match=f"checkpoint {evil} is unsafe to load"):
        evaluate.checkpoint_epochs(evil)
    assert evaluate.run_command(evaluate.main, [str(evil), "--data.data_root", str(tiny_cifar["folder"]),
                                                "--trainer.progress_bar", "false"]) == 2
    assert f"VQ-VAE checkpoint {evil} is unsafe to load" in capsys.readouterr().err
    assert not marker.exists()


@pytest.mark.parametrize("load, what", [(load_vqvae, "VQ-VAE"), (load_prior, "prior")])
def test_model_loaders_refuse_a_payload(tmp_path, finished, marker, load, what):
    evil = write_payload(tmp_path / "evil.ckpt", marker,
                         like=torch.load(finished / "checkpoints" / "last.ckpt", weights_only=True))
    with pytest.raises(UnsafeCheckpointError, match=f"{what} checkpoint {evil} is unsafe to load"):
        load(evil)
    assert not marker.exists()


def test_prior_resume_check_and_lightning_checkpoint_io_refuse_a_payload(tmp_path, marker):
    evil = write_payload(tmp_path / "evil.ckpt", marker)
    with pytest.raises(UnsafeCheckpointError, match=f"checkpoint {evil} is unsafe to load"):
        train_prior.check_prior_checkpoint(evil, PriorConfig(num_codes=16, height=8, width=8), "0" * 64)
    with pytest.raises(UnsafeCheckpointError, match=str(evil)):  # what Trainer.fit(ckpt_path=...) goes through
        AtomicCheckpointIO().load_checkpoint(evil)  # Lightning's default when fit() is given no weights_only
    assert not marker.exists()


def test_code_cache_with_a_payload_is_ignored_and_replaced(tmp_path, tiny_cifar, finished, marker, caplog):
    model = load_vqvae(finished / "checkpoints" / "last.ckpt")
    data = CIFAR10DataModule(tiny_cifar["folder"], val_size=0, train_subset=32, num_workers=0)
    data.setup()
    planted = cache_path(cache_key("a" * 64, data), tmp_path / "codes")
    write_payload(planted, marker, like={"key": cache_key("a" * 64, data)})
    splits = code_splits(model, "a" * 64, data, tmp_path / "codes")
    assert not marker.exists()
    assert f"ignoring the code cache {planted}: code cache {planted} is unsafe to load" in caplog.text
    assert len(splits["train"].labels) == 32
    assert "payload" not in torch.load(planted, weights_only=True)  # replaced by the freshly encoded codes


def test_config_of_a_refused_run_is_valid_json(finished):
    """The run's own files load safely (the fixture's checkpoint holds only tensors and plain containers)."""
    ckpt = torch.load(finished / "checkpoints" / "last.ckpt", weights_only=True)
    assert ckpt["CIFAR10DataModule"]["classes"][0] == "airplane"
    assert json.loads((finished / "config.json").read_text())["quantizer"] == ["hard"]
