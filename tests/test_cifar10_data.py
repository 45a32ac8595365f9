"""CIFAR10DataModule: every on-disk layout gives the same tensors; missing and corrupt data fail clearly."""

from __future__ import annotations

import hashlib
import io
import pickle
import shutil
import tarfile
import urllib.error
from pathlib import Path

import numpy as np
import pytest
import torch
from conftest import CLASSES, synthetic_images, write_image_folder
from PIL import Image
from torchvision import datasets
from torchvision.datasets import cifar as cifar_module

from softvq.data import archive as archive_io
from softvq.data import cifar10 as svdata
from softvq.data.cifar10 import (
    CIFAR10DataModule,
    ClassMismatchError,
    CorruptArchiveError,
    DataNotFoundError,
    UnsafeArchiveError,
    extract_archive,
    split_indices,
)


def all_tensors(dm: CIFAR10DataModule, split: str) -> tuple[torch.Tensor, torch.Tensor]:
    dataset = {"train": dm.train_set, "val": dm.val_set, "test": dm.test_set}[split]
    xs, ys = zip(*torch.utils.data.DataLoader(dataset, batch_size=64, shuffle=False), strict=True)
    return torch.cat(xs), torch.cat(ys)


def make_dm(root, **kw) -> CIFAR10DataModule:
    dm = CIFAR10DataModule(root, batch_size=32, val_size=kw.pop("val_size", 40), num_workers=0, **kw)
    dm.prepare_data()
    dm.setup()
    return dm


def test_image_folder_and_archive_give_identical_tensors(tiny_cifar):
    a = make_dm(tiny_cifar["folder"], train_subset=100)
    b = make_dm(tiny_cifar["archive"], train_subset=100)
    assert a.source[0] == b.source[0] == "imagefolder"
    assert b.source[1] != tiny_cifar["folder"]  # really read from the extracted copy
    for split, n in (("train", 100), ("val", 40), ("test", 50)):
        xa, ya = all_tensors(a, split)
        xb, yb = all_tensors(b, split)
        assert xa.shape == (n, 3, 32, 32) and xa.dtype == torch.float32
        assert torch.equal(xa, xb) and torch.equal(ya, yb)
        assert 0.0 <= float(xa.min()) and float(xa.max()) <= 1.0
    # Same pixels as decoding the JPEG files directly, and the official label order.
    xt, yt = all_tensors(a, "test")
    first = np.array(Image.open(tiny_cifar["folder"] / "test" / "airplane" / "0000.jpg").convert("RGB"))
    assert torch.equal(xt[0], torch.from_numpy(first).permute(2, 0, 1).float() / 255)
    assert yt.tolist() == [c for c in range(10) for _ in range(5)]


def test_directory_holding_one_archive_is_used(tiny_cifar, tmp_path):
    root = tmp_path / "data"
    root.mkdir()
    (root / "cifar10-jpeg.tar.gz").write_bytes(tiny_cifar["archive"].read_bytes())
    dm = make_dm(root)
    assert len(dm.test_set) == 50


def test_archive_is_extracted_once_and_reused(tiny_cifar, tmp_path, monkeypatch, caplog):
    caplog.set_level("INFO", logger="softvq.data")
    first = extract_archive(tiny_cifar["archive"], tmp_path / "cache")
    marker = next((tmp_path / "cache").glob("*/.softvq-complete"))
    # the first extraction says where the tree went and how to move the cache; a reuse says nothing
    assert [r.getMessage().split(" (")[0] for r in caplog.records] == \
        [f"unpacked {tiny_cifar['archive']} into {marker.parent}"]
    assert "SOFTVQ_CACHE" in caplog.records[0].getMessage() and "--data.cache_dir" in caplog.records[0].getMessage()
    caplog.clear()
    stamp = marker.stat().st_mtime_ns

    def no_second_extraction(*args, **kwargs):
        raise AssertionError("the archive was extracted again")

    monkeypatch.setattr(tarfile, "open", no_second_extraction)
    assert extract_archive(tiny_cifar["archive"], tmp_path / "cache") == first
    assert marker.stat().st_mtime_ns == stamp
    assert sorted(p.name for p in first.iterdir() if p.is_dir()) == ["test", "train"]
    assert caplog.records == []


@pytest.mark.parametrize("cut", [0.5, 0.97])
def test_truncated_archive_errors_and_leaves_nothing_behind(tiny_cifar, tmp_path, cut):
    raw = tiny_cifar["archive"].read_bytes()
    broken = tmp_path / "broken.tar.gz"
    broken.write_bytes(raw[: int(len(raw) * cut)])
    cache = tmp_path / "cache"
    with pytest.raises(CorruptArchiveError, match="corrupt or truncated"):
        extract_archive(broken, cache)
    assert not cache.exists() or list(cache.iterdir()) == []
    # The data module reports the same error, naming the file.
    with pytest.raises(CorruptArchiveError, match="broken.tar.gz"):
        make_dm(broken)


def test_checksum_sidecar_mismatch_is_reported(tiny_cifar, tmp_path):
    archive = tmp_path / "data.tar.gz"
    archive.write_bytes(tiny_cifar["archive"].read_bytes())
    (tmp_path / "data.tar.gz.sha256").write_text("0" * 64 + "  data.tar.gz\n")
    with pytest.raises(CorruptArchiveError, match="sha256"):
        extract_archive(archive, tmp_path / "cache")
    good = hashlib.sha256(archive.read_bytes()).hexdigest()
    (tmp_path / "data.tar.gz.sha256").write_text(f"{good}  data.tar.gz\n")
    assert (extract_archive(archive, tmp_path / "cache") / "train").is_dir()


def test_archive_with_unsafe_member_is_refused(tmp_path):
    archive = tmp_path / "evil.tar.gz"
    with tarfile.open(archive, "w:gz") as tar:
        payload = b"x"
        info = tarfile.TarInfo("../escaped.txt")
        info.size = len(payload)
        tar.addfile(info, io.BytesIO(payload))
    with pytest.raises(UnsafeArchiveError, match=f"{archive} is unsafe to extract: .*escaped.txt") as caught:
        extract_archive(archive, tmp_path / "cache")
    assert isinstance(caught.value, CorruptArchiveError)  # scripts report it as an expected error
    assert "truncated" not in str(caught.value) and "download it again" not in str(caught.value)
    assert not (tmp_path / "escaped.txt").exists()
    assert not list((tmp_path / "cache").iterdir())  # nothing extracted into the cache


def test_archive_with_a_symlink_out_is_unsafe(tmp_path):
    archive = tmp_path / "link.tar.gz"
    with tarfile.open(archive, "w:gz") as tar:
        info = tarfile.TarInfo("train/cat/0000.jpg")
        info.type, info.linkname = tarfile.SYMTYPE, "/etc/passwd"
        tar.addfile(info)
    with pytest.raises(UnsafeArchiveError, match="unsafe to extract"):
        extract_archive(archive, tmp_path / "cache")


@pytest.mark.parametrize("member", ["relative_link", "absolute_name", "hard_link"])
def test_archive_members_that_data_filter_would_let_through_are_refused(tmp_path, member):
    """``filter="data"`` alone re-roots an absolute name and keeps links that stay inside the cache: an image archive
    holds neither, so both are refused before anything is extracted, as the docstring says."""
    archive = tmp_path / f"{member}.tar.gz"
    with tarfile.open(archive, "w:gz") as tar:
        payload = b"x"
        info = tarfile.TarInfo("train/cat/0000.jpg")
        info.size = len(payload)
        tar.addfile(info, io.BytesIO(payload))
        if member == "absolute_name":
            info = tarfile.TarInfo("/train/cat/0001.jpg")
            info.size = len(payload)
            tar.addfile(info, io.BytesIO(payload))
        else:
            info = tarfile.TarInfo("train/cat/0001.jpg")
            info.type = tarfile.SYMTYPE if member == "relative_link" else tarfile.LNKTYPE
            info.linkname = "0000.jpg" if member == "relative_link" else "train/cat/0000.jpg"
            tar.addfile(info)
    expected = "outside the archive's folder" if member == "absolute_name" else "is a link"
    with pytest.raises(UnsafeArchiveError, match=f"unsafe to extract: member .*0001.jpg.* {expected}"):
        extract_archive(archive, tmp_path / "cache")
    assert not list((tmp_path / "cache").iterdir())


def test_an_archive_whose_splits_have_other_classes_leaves_the_cache(tmp_path):
    root = write_image_folder(tmp_path / "data", per_class_train=1, per_class_test=1)
    shutil.rmtree(root / "test" / "truck")
    archive = tmp_path / "uneven.tar.gz"
    with tarfile.open(archive, "w:gz") as tar:
        tar.add(root, arcname="cifar10")
    cache = tmp_path / "cache"
    expected = rf"{archive}: test/ has other classes .*only in .*train/: \['truck'\]"
    with pytest.raises(ClassMismatchError, match=expected):
        svdata.resolve_cifar10(archive, cache_dir=cache)
    assert not list(cache.iterdir())  # neither the entry nor a temporary folder stays behind
    # an entry cached before the check existed goes as soon as it is reused
    entry = extract_archive(archive, cache)  # no validate: cached as before
    assert entry.parent.parent == cache
    with pytest.raises(ClassMismatchError):
        svdata.resolve_cifar10(archive, cache_dir=cache)
    assert not list(cache.iterdir())


# ---- classes: hidden entries are ignored, train/ and test/ must agree, checkpoints record them ---------
def test_hidden_folders_and_files_are_neither_classes_nor_images(tmp_path):
    root = write_image_folder(tmp_path / "data", per_class_train=2, per_class_test=1)
    for split in ("train", "test"):
        (root / split / ".ipynb_checkpoints").mkdir()
    Image.new("RGB", (32, 32)).save(root / "train" / ".ipynb_checkpoints" / "a.jpg")
    Image.new("RGB", (32, 32)).save(root / "test" / ".ipynb_checkpoints" / "b.jpg")
    (root / "train" / "cat" / ".thumbs").mkdir()
    Image.new("RGB", (32, 32)).save(root / "train" / "cat" / ".thumbs" / "c.jpg")
    Image.new("RGB", (32, 32)).save(root / "train" / "cat" / "._0000.jpg")
    dm = CIFAR10DataModule(root, batch_size=4, val_size=0, num_workers=0)
    dm.setup()
    assert dm.classes == CLASSES  # 10 classes, not 11 with ".ipynb_checkpoints" as class 0
    full = dm.train_set.dataset
    reference = sorted((str(p), CLASSES.index(p.parent.name)) for p in (root / "train").glob("[!.]*/[!.]*.jpg"))
    assert sorted(full.samples) == reference  # every label the index of its folder in CIFAR-10's class list
    assert len(dm.test_set) == 10


def test_a_class_missing_from_test_is_refused(tmp_path):
    root = write_image_folder(tmp_path / "data", per_class_train=2, per_class_test=1)
    shutil.rmtree(root / "test" / "truck")
    with pytest.raises(ClassMismatchError, match=r"only in .*train: \['truck'\]; only in .*test: none"):
        CIFAR10DataModule(root, val_size=0, num_workers=0).setup("test")


def test_classes_are_saved_in_the_data_state_and_checked_on_load(tmp_path):
    root = write_image_folder(tmp_path / "data", per_class_train=2, per_class_test=1)
    dm = CIFAR10DataModule(root, val_size=0, num_workers=0)
    dm.setup("fit")
    assert dm.state_dict() == {"classes": list(CLASSES)}
    dm.load_state_dict({"classes": list(CLASSES)})  # the same: accepted
    with pytest.raises(ClassMismatchError, match=r"only in the checkpoint: \['lion'\]; only in the data .*"
                                                   r"\['truck'\]"):
        dm.load_state_dict({"classes": [*CLASSES[:9], "lion"]})


def test_archive_without_train_and_test_is_refused(tmp_path):
    archive = tmp_path / "other.tar.gz"
    with tarfile.open(archive, "w:gz") as tar:
        info = tarfile.TarInfo("readme.txt")
        tar.addfile(info, io.BytesIO(b""))
    with pytest.raises(CorruptArchiveError, match="train/ and test/"):
        extract_archive(archive, tmp_path / "cache")


def test_missing_data_says_where_to_put_it(tmp_path):
    with pytest.raises(DataNotFoundError, match="cifar-10-batches-py") as info:
        make_dm(tmp_path / "nowhere")
    message = str(info.value)
    assert "nowhere" in message and "train/<class>" in message and ".tar.gz" in message


def test_failed_download_offline_gives_the_same_instructions(tmp_path, monkeypatch):
    def offline(*args, **kwargs):
        raise urllib.error.URLError("no network")

    monkeypatch.setattr(datasets, "CIFAR10", offline)
    with pytest.raises(DataNotFoundError, match="downloading CIFAR-10 .* failed") as info:
        make_dm(tmp_path / "data", download=True)
    assert "train/<class>" in str(info.value)


def test_empty_image_folder_is_reported(tmp_path):
    for split in ("train", "test"):
        (tmp_path / split).mkdir()
    with pytest.raises(DataNotFoundError, match="holds no images"):
        make_dm(tmp_path)


def test_official_python_release_is_read_through_torchvision(tmp_path, monkeypatch):
    base = tmp_path / "cifar-10-batches-py"
    base.mkdir()
    images = synthetic_images(60, seed=3)
    labels = [i % 10 for i in range(60)]
    rows = images.transpose(0, 3, 1, 2).reshape(60, -1)  # the official layout: (N, 3*32*32), channel planes

    def dump(name, lo, hi):
        with open(base / name, "wb") as f:
            pickle.dump({"data": rows[lo:hi], "labels": labels[lo:hi]}, f)

    for i in range(5):
        dump(f"data_batch_{i + 1}", 10 * i, 10 * i + 10)
    dump("test_batch", 50, 60)
    with open(base / "batches.meta", "wb") as f:
        pickle.dump({"label_names": list(CLASSES)}, f)
    # Our files have other md5s than the official ones.
    monkeypatch.setattr(datasets.CIFAR10, "_check_integrity", lambda self: True)
    monkeypatch.setattr(cifar_module, "check_integrity", lambda *args, **kwargs: True)
    dm = make_dm(tmp_path, val_size=10)
    assert dm.source == ("torchvision", tmp_path)
    x, y = all_tensors(dm, "test")
    assert torch.equal(x, torch.from_numpy(images[50:]).permute(0, 3, 1, 2).float() / 255)
    assert y.tolist() == labels[50:]


def test_corrupt_official_release_is_reported(tmp_path):
    (tmp_path / "cifar-10-batches-py").mkdir()
    (tmp_path / "cifar-10-batches-py" / "data_batch_1").write_bytes(b"garbage")
    with pytest.raises(DataNotFoundError, match="corrupt or incomplete"):
        make_dm(tmp_path)


def test_split_is_fixed_disjoint_and_subset_is_a_prefix():
    train, val = split_indices(100, 20, None)
    assert len(val) == 20 and len(train) == 80 and not set(train) & set(val)
    assert sorted(train + val) == list(range(100))
    again_train, again_val = split_indices(100, 20, 30)
    assert again_val == val and again_train == train[:30]
    torch.manual_seed(123)  # the global RNG (the run's seed) does not move the split
    assert split_indices(100, 20, None) == (train, val)


@pytest.mark.parametrize("kwargs, match", [
    ({"val_size": 100}, "val_size must be in"),
    ({"val_size": 10, "train_subset": 91}, "train_subset=91 exceeds"),
])
def test_split_errors(kwargs, match):
    with pytest.raises(ValueError, match=match):
        split_indices(100, kwargs["val_size"], kwargs.get("train_subset"))


@pytest.mark.parametrize("kwargs, match", [
    ({"batch_size": 0}, "batch_size"),
    ({"val_size": -1}, "val_size"),
    ({"train_subset": 0}, "train_subset"),
    ({"num_workers": -2}, "num_workers"),
])
def test_invalid_arguments(kwargs, match):
    with pytest.raises(ValueError, match=match):
        CIFAR10DataModule("data", **kwargs)


def test_default_cache_dir_follows_the_environment(monkeypatch, tmp_path):
    monkeypatch.setenv("SOFTVQ_CACHE", str(tmp_path / "a"))
    assert svdata.default_cache_dir() == tmp_path / "a"
    monkeypatch.delenv("SOFTVQ_CACHE")
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert svdata.default_cache_dir() == tmp_path / "xdg" / "softvq"


@pytest.mark.skipif(not (Path(__file__).resolve().parents[2] / "shared/data/cifar10-jpeg.tar.gz").exists(),
                    reason="the shared CIFAR-10 archive is not on this machine")
def test_shared_archive_checksum_matches():
    archive = Path(__file__).resolve().parents[2] / "shared/data/cifar10-jpeg.tar.gz"
    assert archive_io.expected_sha256(archive) == svdata.sha256_file(archive)
