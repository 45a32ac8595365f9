"""train_prior.py and sample.py end to end on tiny VQ-VAEs: cached codes, history, checkpoints, pairing, CLI errors."""

from __future__ import annotations

import json
import math
import re
import shutil

import pytest
import torch
from conftest import CLASSES
from PIL import Image
from torchvision.transforms.functional import to_tensor

from softvq.cli import prior as train_prior
from softvq.cli import sample
from softvq.cli import train as train_vqvae
from softvq.models import load_prior, load_vqvae
from softvq.models.codes import extract_codes
from softvq.models.transformer import PriorConfig

VQVAE_TINY = ["--data.train_subset", "96", "--data.val_size", "0", "--data.batch_size", "32", "--model.width", "16",
              "--model.res_hidden", "8", "--model.res_blocks", "1", "--model.code_dim", "8", "--data.num_workers", "0",
              "--trainer.progress_bar", "false", "--epochs", "1"]
PRIOR_TINY = ["--model.layers", "1", "--model.heads", "2", "--model.dim", "32", "--batch_size", "64",
              "--data.val_size", "50", "--model.warmup_steps", "2", "--trainer.progress_bar", "false"]


@pytest.fixture(scope="module")
def vqvaes(tmp_path_factory, tiny_cifar):
    """Tiny VQ-VAE checkpoints: DDCL with K = 16, hard VQ with K = 16 and hard VQ with K = 32."""
    paths = {}
    for name, quantizer, codes in (("ddcl", "ddcl", "16"), ("hard", "hard", "16"), ("hard32", "hard", "32")):
        out = tmp_path_factory.mktemp(name)
        train_vqvae.main([*VQVAE_TINY, "--quantizer", quantizer, "--model.num_codes", codes, "--data.data_root",
                          str(tiny_cifar["folder"]), "--out", str(out)])
        paths[name] = out / "checkpoints" / "last.ckpt"
    return paths


@pytest.fixture(scope="module")
def trained(vqvaes, tiny_cifar, tmp_path_factory):
    """A class-conditional prior over the DDCL VQ-VAE's codes, 2 epochs (codes cached in the run's cache)."""
    out = tmp_path_factory.mktemp("prior")
    cache = out / "cache"
    results = train_prior.main([*PRIOR_TINY, "--vqvae", str(vqvaes["ddcl"]), "--data.data_root",
                                str(tiny_cifar["folder"]), "--out", str(out / "run"), "--epochs", "2",
                                "--model.class_conditional", "true", "--codes_cache", str(cache)])
    return {"out": out / "run", "cache": cache, "results": results}


def test_train_prior_writes_history_checkpoints_and_test_nll(trained, vqvaes):
    out, results = trained["out"], trained["results"]
    rows = [json.loads(line) for line in (out / "history.jsonl").read_text().splitlines()]
    assert [r["epoch"] for r in rows] == [1, 2] and [r["step"] for r in rows] == [4, 8]  # 250 grids in batches of 64
    for row in rows:
        assert {"train_bits", "val_bits", "lr", "time_s"} <= set(row)
        assert 0 < row["val_bits"] < 2 * math.log2(16) and 0 < row["train_bits"]
    best = min(rows, key=lambda r: r["val_bits"])["epoch"]  # checkpoint names count epochs from 1, as the history
    assert sorted(p.name for p in (out / "checkpoints").iterdir()) == [f"best-epoch{best:02d}.ckpt", "last.ckpt"]
    assert list((out / "tb").glob("events.out.tfevents.*"))
    saved = json.loads((out / "test.json").read_text())
    assert saved["test_sequences"] == 50 and saved["train_sequences"] == 250 and saved["val_sequences"] == 50
    assert saved["test_bits_per_position"] == pytest.approx(results["test_bits_per_position"])
    assert saved["test_bits_per_image"] == pytest.approx(64 * saved["test_bits_per_position"])
    assert len(saved["test_position_bits"]) == 8 and len(saved["test_position_bits"][0]) == 8
    assert saved["test_code_perplexity"] == pytest.approx(2 ** saved["test_unigram_entropy_bits"])
    assert 1 <= saved["test_codes_used"] <= 16 and saved["log2_num_codes"] == 4.0
    assert saved["vqvae"]["num_codes"] == 16 and saved["vqvae"]["quantizer"] == "ddcl"
    prior = load_prior(out / "checkpoints" / "last.ckpt")  # the checkpoint knows its VQ-VAE and its classes
    assert prior.vqvae.path == str(vqvaes["ddcl"]) and prior.config.num_classes == 10
    assert not prior.training and not any(p.requires_grad for p in prior.parameters())


@pytest.mark.parametrize("name", ["ddcl", "hard"])
def test_cached_codes_equal_the_vqvae_encoding_of_the_same_images(trained, vqvaes, tiny_cifar, tmp_path, name,
                                                                  monkeypatch):
    cache = trained["cache"] if name == "ddcl" else tmp_path / "cache"
    if name == "hard":  # extraction from a hard-VQ checkpoint, into its own cache
        train_prior.main([*PRIOR_TINY, "--vqvae", str(vqvaes[name]), "--data.data_root", str(tiny_cifar["folder"]),
                          "--out", str(tmp_path / "run"), "--epochs", "1", "--codes_cache", str(cache)])
    files = list(cache.glob("codes-*.pt"))
    assert len(files) == 1
    saved = torch.load(files[0], weights_only=True)
    model = load_vqvae(vqvaes[name])
    # The official test split in ImageFolder order (class folders, then file names), encoded here image by image.
    images = [to_tensor(Image.open(tiny_cifar["folder"] / "test" / c / f"{j:04d}.jpg").convert("RGB"))
              for c in CLASSES for j in range(5)]
    expected = torch.cat([model.encode(x[None]) for x in images])
    codes = saved["test"]["codes"].long()
    # Batched and one-image convolutions differ in the last float bits, which can flip a near-tie between two codes:
    # a differing code must be one the image's own assignments rate as highly as the expected one (to 1e-4).
    differ = (codes != expected).nonzero().tolist()
    assert len(differ) <= 2, f"{len(differ)} cached codes differ from the image-by-image encoding"
    for b, i, j in differ:
        with torch.no_grad():
            probs = model.quantizer(model.latents(images[b][None]).movedim(1, -1)).probs[0, i, j]
        assert probs[codes[b, i, j]] >= probs[expected[b, i, j]] - 1e-4
    assert saved["test"]["labels"].long().tolist() == [c for c in range(10) for _ in range(5)]
    assert saved["train"]["codes"].shape == (250, 8, 8) and saved["val"]["codes"].shape == (50, 8, 8)
    # A second run over the same checkpoint and selection reads the cache instead of encoding.
    monkeypatch.setattr("softvq.models.codes.extract_codes", None)  # would raise if called
    train_prior.main([*PRIOR_TINY, "--vqvae", str(vqvaes[name]), "--data.data_root", str(tiny_cifar["folder"]),
                      "--out", str(tmp_path / "again"), "--epochs", "1", "--codes_cache", str(cache)])


def test_extract_codes_refuses_a_model_in_training_mode(vqvaes):
    model = load_vqvae(vqvaes["ddcl"]).train()
    with pytest.raises(ValueError, match="eval mode"):
        extract_codes(model, [(torch.zeros(3, 32, 32), 0)])


def test_resume_continues_the_history_and_refuses_another_configuration(trained, vqvaes, tiny_cifar, tmp_path):
    out = tmp_path / "run"
    base = [*PRIOR_TINY, "--vqvae", str(vqvaes["ddcl"]), "--data.data_root", str(tiny_cifar["folder"]),
            "--out", str(out), "--codes_cache", str(trained["cache"])]
    train_prior.main([*base, "--epochs", "1"])
    train_prior.main([*base, "--epochs", "2", "--resume"])
    rows = [json.loads(line) for line in (out / "history.jsonl").read_text().splitlines()]
    assert [r["epoch"] for r in rows] == [1, 2] and rows[1]["step"] == 8
    with pytest.raises(ValueError, match="dim: checkpoint 32 vs now 64"):
        train_prior.main([*base, "--epochs", "3", "--resume", "--model.dim", "64"])
    with pytest.raises(ValueError, match="models the codes of another VQ-VAE"):
        train_prior.main([*base, "--epochs", "3", "--resume", "--vqvae", str(vqvaes["hard"])])
    with pytest.raises(FileExistsError, match="--resume .* --overwrite"):
        train_prior.main([*base, "--epochs", "1"])


def test_a_class_conditional_prior_on_soft_targets_caches_them_beside_the_codes_and_resumes_only_alike(
        trained, vqvaes, tiny_cifar, tmp_path):
    out, cache = tmp_path / "soft", tmp_path / "cache"
    base = [*PRIOR_TINY, "--vqvae", str(vqvaes["ddcl"]), "--data.data_root", str(tiny_cifar["folder"]),
            "--out", str(out), "--codes_cache", str(cache), "--model.class_conditional", "true",
            "--model.soft_top_k", "4"]
    results = train_prior.main([*base, "--epochs", "1", "--model.soft_targets", "0.5"])
    assert results["soft_targets"] == 0.5 and results["soft_top_k"] == 4 and 0 < results["soft_mass_kept"] <= 1
    (file,) = cache.glob("codes-*.pt")
    saved = torch.load(file, weights_only=True)
    assert saved["key"]["soft_top_k"] == 4 and saved["train"]["soft_probs"].shape == (250, 8, 8, 4)
    # the hard codes beside them are the ones a hard-codes-only extraction caches
    hard = [torch.load(f, weights_only=True) for f in trained["cache"].glob("codes-*.pt")]
    (hard,) = [h for h in hard if h["key"] == {k: v for k, v in saved["key"].items() if k != "soft_top_k"}]
    assert torch.equal(saved["test"]["codes"], hard["test"]["codes"])
    assert torch.equal(saved["train"]["soft_codes"][..., 0], saved["train"]["codes"])
    with pytest.raises(ValueError, match="trained with --model.soft_targets 0.5, not 0.0"):
        train_prior.main([*base, "--epochs", "2", "--resume"])
    with pytest.raises(ValueError, match="model.soft_targets must be a number in"):
        train_prior.main([*base, "--epochs", "1", "--model.soft_targets", "2", "--overwrite"])


def test_train_prior_errors_are_clear(vqvaes, tiny_cifar, tmp_path, capsys):
    base = ["--data.data_root", str(tiny_cifar["folder"]), "--out", str(tmp_path / "run")]
    with pytest.raises(FileNotFoundError, match="checkpoint not found: .*missing.ckpt"):
        train_prior.main(["--vqvae", str(tmp_path / "missing.ckpt"), *base])
    broken = tmp_path / "broken.ckpt"
    broken.write_bytes(vqvaes["ddcl"].read_bytes()[:2000])
    with pytest.raises(ValueError, match="broken.ckpt is truncated, corrupt"):
        train_prior.main(["--vqvae", str(broken), *base])
    for flags, message in ((["--epochs", "-1"], "epochs must be a positive integer, got -1"),
                           (["--epochs", "0"], "epochs must be a positive integer, got 0"),
                           (["--model.dropout", "1"], r"model.dropout must be a number in \[0, 1\), got 1"),
                           (["--model.heads", "3"], "model.heads must divide model.dim 256, got 3"),
                           ([], "--vqvae is required")):
        vqvae = [] if not flags else ["--vqvae", str(vqvaes["ddcl"])]
        assert train_prior.cli([*vqvae, *base, *flags]) == 2
        assert re.search(message, capsys.readouterr().err), message
    with pytest.raises(SystemExit):  # a value of the wrong type is the parser's: a usage message, exit 2
        train_prior.main(["--vqvae", str(vqvaes["ddcl"]), *base, "--model.layers", "two"])
    assert "--model.layers" in capsys.readouterr().err
    assert not (tmp_path / "run").exists()


def test_sample_writes_a_png_grid_of_decoded_samples(trained, tmp_path):
    ckpt = trained["out"] / "checkpoints" / "last.ckpt"
    out = tmp_path / "grid.png"
    result = sample.main(["--prior", str(ckpt), "--n", "6", "--label", "horse", "--top_k", "4", "--temperature",
                          "0.8", "--out", str(out), "--nrow", "3"])
    assert result["codes"].shape == (6, 8, 8) and 0 <= int(result["codes"].min()) and int(result["codes"].max()) < 16
    assert result["images"].shape == (6, 3, 32, 32) and result["labels"].tolist() == [7] * 6
    with Image.open(out) as png:  # 3 x 2 tiles of 32 px with 2 px padding
        assert png.size == (3 * 34 + 2, 2 * 34 + 2)
    saved = json.loads(out.with_suffix(".json").read_text())  # the resolved settings, beside the grid
    assert saved["label"] == "horse" and saved["top_k"] == 4 and saved["n"] == 6 and "config" not in saved
    replay = sample.main(["--config", str(out.with_suffix(".json")), "--out", str(tmp_path / "replay.png")])
    assert torch.equal(replay["codes"], result["codes"])
    every = sample.main(["--prior", str(ckpt), "--n", "20", "--out", str(tmp_path / "all.png"), "--seed", "1"])
    assert every["labels"].tolist() == [c for c in range(10) for _ in range(2)]  # every class, in blocks
    again = sample.main(["--prior", str(ckpt), "--n", "20", "--out", str(tmp_path / "all.png"), "--seed", "1"])
    assert torch.equal(again["codes"], every["codes"])
    # the conditional prior trained with label dropout (train_prior's default 0.1) samples with guidance
    assert json.loads((trained["out"] / "test.json").read_text())["label_dropout"] == 0.1
    guided = sample.main(["--prior", str(ckpt), "--n", "20", "--out", str(tmp_path / "all.png"), "--seed", "1",
                          "--guidance", "3"])
    prior = load_prior(ckpt)
    expected = prior.sample(20, every["labels"], guidance=3.0, generator=torch.Generator().manual_seed(1))
    assert torch.equal(guided["codes"], expected) and not torch.equal(guided["codes"], every["codes"])


def test_sample_refuses_a_vqvae_of_another_k_and_bad_options(trained, vqvaes, tmp_path, capsys):
    ckpt = str(trained["out"] / "checkpoints" / "last.ckpt")
    out = ["--out", str(tmp_path / "g.png")]
    with pytest.raises(ValueError, match=r"K=16 codes, but .*hard32.*last.ckpt has K=32"):
        sample.main(["--prior", ckpt, "--vqvae", str(vqvaes["hard32"]), *out])
    with pytest.raises(ValueError, match="is not the VQ-VAE it was trained on"):
        sample.main(["--prior", ckpt, "--vqvae", str(vqvaes["hard"]), *out])
    assert sample.main(["--prior", ckpt, "--vqvae", str(vqvaes["hard"]), "--allow_other_vqvae", "--n", "1",
                        "--label", "0", *out])["images"].shape == (1, 3, 32, 32)
    with pytest.raises(ValueError, match="class must be one of .*got 'zebra'"):
        sample.main(["--prior", ckpt, "--label", "zebra", *out])
    with pytest.raises(ValueError, match="--top_k must be at most K = 16"):
        sample.main(["--prior", ckpt, "--top_k", "17", *out])
    with pytest.raises(SystemExit):
        sample.main(["--prior", ckpt, "--temperature", "0", *out])
    assert "--temperature" in (err := capsys.readouterr().err) and "0" in err
    with pytest.raises(SystemExit):
        sample.main(["--prior", ckpt, "--top_k", "0", *out])
    assert "--top_k" in capsys.readouterr().err
    with pytest.raises(ValueError, match="--prior is required"):
        sample.main(out)
    with pytest.raises(FileNotFoundError, match="prior checkpoint not found"):
        sample.main(["--prior", str(tmp_path / "none.ckpt"), *out])


def test_sample_refuses_a_class_for_an_unconditional_prior(vqvaes, tiny_cifar, trained, tmp_path):
    out = tmp_path / "uncond"
    train_prior.main([*PRIOR_TINY, "--vqvae", str(vqvaes["ddcl"]), "--data.data_root", str(tiny_cifar["folder"]),
                      "--out", str(out), "--epochs", "1", "--data.val_size", "0", "--codes_cache",
                      str(trained["cache"])])
    assert [p.name for p in (out / "checkpoints").iterdir()] == ["last.ckpt"]  # no validation: no best checkpoint
    ckpt = str(out / "checkpoints" / "last.ckpt")
    with pytest.raises(ValueError, match="--label 'cat' given, but this prior is unconditional"):
        sample.main(["--prior", ckpt, "--label", "cat", "--out", str(tmp_path / "g.png")])
    result = sample.main(["--prior", ckpt, "--n", "2", "--out", str(tmp_path / "g.png")])
    assert result["labels"] is None and result["images"].shape == (2, 3, 32, 32)
    with pytest.raises(ValueError, match="--guidance 2.0 needs a class-conditional prior trained with label dropout"):
        sample.main(["--prior", ckpt, "--guidance", "2", "--out", str(tmp_path / "g.png")])


def test_prior_refuses_data_with_other_classes_than_its_vqvae_and_records_them(trained, vqvaes, tiny_cifar,
                                                                               tmp_path):
    assert load_prior(trained["out"] / "checkpoints" / "last.ckpt").vqvae.classes == list(CLASSES)
    other = tmp_path / "other"
    shutil.copytree(tiny_cifar["folder"], other)
    for split in ("train", "test"):
        (other / split / "dog").rename(other / split / "wolf")
    with pytest.raises(ValueError, match=r"only in --vqvae .*: \['dog'\]; only in the data at .*: \['wolf'\]"):
        train_prior.main([*PRIOR_TINY, "--vqvae", str(vqvaes["ddcl"]), "--data.data_root", str(other),
                          "--out", str(tmp_path / "run"), "--epochs", "1", "--codes_cache", str(tmp_path / "cache")])
    assert not (tmp_path / "run").exists()


def test_train_prior_refuses_an_out_in_use(vqvaes, tiny_cifar, tmp_path):
    from softvq.models.files import RunLock, RunLockedError

    with RunLock(tmp_path / "run"), pytest.raises(RunLockedError, match=r"is in use by another run \(pid \d+"):
        train_prior.main([*PRIOR_TINY, "--vqvae", str(vqvaes["ddcl"]), "--data.data_root", str(tiny_cifar["folder"]),
                          "--out", str(tmp_path / "run"), "--epochs", "1"])


def test_a_prior_checkpoint_saved_before_the_null_class_and_soft_targets_resumes_as_it_was_trained(tmp_path):
    """A checkpoint whose config has no ``null_class`` and whose hyperparameters have no ``soft_targets`` is a
    conditional prior without the null class trained on the hard codes: it matches exactly that config and loss, and
    another is refused naming the setting."""
    today = PriorConfig(16, 4, 4, num_classes=10, null_class=False, layers=1, heads=2, dim=32)
    old_config = {k: v for k, v in today.to_dict().items() if k != "null_class"}
    path = tmp_path / "old.ckpt"
    torch.save({"state_dict": {}, "hyper_parameters": {"config": old_config, "vqvae": {"sha256": "ab" * 32}}}, path)
    assert train_prior.saved_null_class(path) is False
    train_prior.check_prior_checkpoint(path, today, "ab" * 32)  # the same prior: accepted
    with pytest.raises(ValueError, match="null_class: checkpoint False vs now True"):
        train_prior.check_prior_checkpoint(path, PriorConfig(**{**today.to_dict(), "null_class": True}), "ab" * 32)
    with pytest.raises(ValueError, match="soft_targets 0.0, not 0.5"):
        train_prior.check_prior_checkpoint(path, today, "ab" * 32, soft_targets=0.5)
