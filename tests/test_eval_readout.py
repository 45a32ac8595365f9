"""eval/readout/ end to end on a tiny VQ-VAE, its readouts against references, and its readout benchmark twin."""

from __future__ import annotations

import json
import math
import shutil

import pytest
import torch
from conftest import CLASSES
from PIL import Image
from torchvision.transforms.functional import to_tensor

from eval import bench_readout, readout
from eval.readout.heads import HistogramProbe, fit
from softvq import DDCLQuantizer, assignment_entropy
from softvq.cli import train as train_vqvae
from softvq.models import VQVAE

TINY = ["--data.train_subset", "96", "--data.val_size", "0", "--data.batch_size", "32", "--model.width", "16",
        "--model.res_hidden", "8", "--model.res_blocks", "1", "--model.num_codes", "16", "--model.code_dim", "8",
        "--data.num_workers", "0", "--trainer.progress_bar", "false", "--epochs", "1"]


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory, tiny_cifar):
    out = tmp_path_factory.mktemp("vqvae")
    train_vqvae.main([*TINY, "--data.data_root", str(tiny_cifar["folder"]), "--out", str(out),
                      "--ddcl.temperature", "0.5"])
    return out / "checkpoints" / "last.ckpt"


def test_quick_run_writes_a_report_with_every_readout_and_seed(checkpoint, tiny_cifar, tmp_path, monkeypatch):
    out = tmp_path / "report"
    argv = ["--checkpoint", str(checkpoint), "--data-root", str(tiny_cifar["folder"]), "--quick",
            "--train-subset", "200", "--out", str(out), "--num-workers", "0", "--batch-size", "64"]
    results = readout.main(argv)
    saved = json.loads((out / "results.json").read_text())
    assert saved["readouts"].keys() == set(readout.READOUTS) and saved["config"]["tokens"] == 64
    assert saved["config"]["train_images"] == 200 and saved["config"]["test_images"] == 50  # all 50 test images
    for name, r in saved["readouts"].items():
        assert [run["seed"] for run in r["runs"]] == [0, 1, 2]
        for run in r["runs"]:
            assert 0.0 <= run["test_acc"] <= 1.0 and 0.0 <= run["train_acc"] <= 1.0
            # accuracies are counts over 50 test / 200 training images
            assert math.isclose(run["test_acc"] * 50, round(run["test_acc"] * 50), abs_tol=1e-9)
        shifts = [run.get("codebook_shift") for run in r["runs"]]
        if name == "ddcl_frozen":
            assert shifts == [0.0, 0.0, 0.0]
        elif name == "ddcl_finetuned":
            assert all(s > 0 for s in shifts)
        else:
            assert shifts == [None, None, None]
    assert saved["readouts"]["mean"]["summary"] == results["readouts"]["mean"]["summary"]
    text = (out / "report.md").read_text()
    assert text.count("\n| (") == 6 and " ± " in text and "official test split" in text

    # The cached tokens are the frozen encoder's output on the test images, row-major over the 8x8 grid.
    cache = next((tmp_path / "softvq-cache" / "readout").glob("latents-*.pt"))
    tokens, indices, labels = torch.load(cache, weights_only=True)["test"]
    test_root = tiny_cifar["folder"] / "test"
    image = to_tensor(Image.open(test_root / CLASSES[0] / "0000.jpg").convert("RGB"))
    model = VQVAE.load_from_checkpoint(checkpoint, map_location="cpu").eval()
    with torch.no_grad():
        latents = model(image[None]).latents[0]  # (D, 8, 8): what the VQ-VAE's quantizer sees
        first = torch.nonzero(labels == 0)[0, 0]  # the test subset keeps the whole (tiny) test split, in order
        # Batch of 1 vs the cache's batches: float32 convolution rounding, divided by the latents' small running
        # standard deviation (unit-scale tokens after the norm), differs by up to ~1e-5.
        torch.testing.assert_close(tokens[first], latents.permute(1, 2, 0).reshape(64, 8), atol=1e-4, rtol=1e-4)
        assert torch.equal(indices[first], model.encode(image[None]).reshape(64))

    # A second run reuses the cache instead of encoding again.
    monkeypatch.setattr(readout, "encode", None)  # would raise if called
    again = readout.main([*argv, "--readouts", "mean", "--seeds", "0"])
    assert again["readouts"]["mean"]["runs"][0]["test_acc"] == saved["readouts"]["mean"]["runs"][0]["test_acc"]


def test_missing_or_corrupt_checkpoint_and_missing_data_are_clear_errors(checkpoint, tiny_cifar, tmp_path):
    base = ["--data-root", str(tiny_cifar["folder"]), "--quick", "--out", str(tmp_path), "--num-workers", "0"]
    with pytest.raises(FileNotFoundError, match="checkpoint not found: .*missing.ckpt"):
        readout.main(["--checkpoint", str(tmp_path / "missing.ckpt"), *base])
    broken = tmp_path / "broken.ckpt"
    broken.write_bytes(checkpoint.read_bytes()[:1000])
    with pytest.raises(ValueError, match="broken.ckpt is truncated, corrupt"):
        readout.main(["--checkpoint", str(broken), *base])
    with pytest.raises(FileNotFoundError, match="no CIFAR-10 data found"):
        readout.main(["--checkpoint", str(checkpoint), "--data-root", str(tmp_path / "nodata"), "--quick"])
    with pytest.raises(SystemExit):
        readout.main(["--checkpoint", str(checkpoint), "--epochs", "0"])


def test_histogram_probe_counts_codes_and_fit_learns_a_separable_task():
    indices = torch.tensor([[0, 2, 2, 3], [1, 1, 1, 1]])
    probe = HistogramProbe(4, 2)
    probe.head = torch.nn.Identity()
    logits, _ = probe(torch.zeros(2, 4, 3), indices)
    torch.testing.assert_close(logits, torch.tensor([[0.25, 0, 0.5, 0.25], [0, 1.0, 0, 0]]))
    # Codes 0-1 mean class 0, codes 2-3 class 1: a linear probe on the histogram must learn it.
    g = torch.Generator().manual_seed(0)
    labels = torch.randint(2, (256,), generator=g)
    idx = torch.randint(2, (256, 8), generator=g) + 2 * labels[:, None]
    split = (torch.zeros(256, 8, 3), idx, labels)
    result = fit(HistogramProbe(4, 2), split, split, epochs=20, batch_size=64, lr=1e-2, eps=0.1, seed=0,
                 device=torch.device("cpu"))
    assert result["test_acc"] == 1.0 and result["params"] == 10


def test_readout_benchmark_prints_a_row_per_length_and_checks_linear_growth(tmp_path, capsys):
    out = tmp_path / "bench.md"
    code = bench_readout.main(["--lengths", "16", "32", "--batch-size", "1", "--dim", "8", "--codes", "4",
                               "--heads", "2", "--reps", "1", "--warmup", "0", "--out", str(out)])
    printed = capsys.readouterr().out
    table = [line for line in printed.splitlines() if line.startswith("| ")]
    assert code == 0 and len(table) == 3 and "not measured" in printed
    regenerate, commit, body = out.read_text().split("\n\n", 2)  # the file: its provenance, then what was printed
    assert regenerate == "Regenerate: `python -m eval.bench_readout --lengths 16 32 --batch-size 1 --dim 8 --codes 4 " \
                         f"--heads 2 --reps 1 --warmup 0 --out {out}`"
    assert commit.startswith("Code: ") and body.strip() in printed
    rows = [{"T": 512, "ms": {"ddcl": 1.0, "attn": 1.0}}, {"T": 4096, "ms": {"ddcl": 8.5, "attn": 60.0}}]
    text, passed = bench_readout.growth_check(rows, ["ddcl", "attn"])
    assert passed and "ddcl: 8.50 PASS" in text and "attn: 60.00" in text
    rows[1]["ms"]["ddcl"] = 9.5
    assert not bench_readout.growth_check(rows, ["ddcl", "attn"])[1]


@pytest.mark.parametrize("distance", ["euclidean", "cosine"])
def test_standardize_gives_unit_scale_tokens_and_keeps_the_codebook_assignments(distance):
    torch.manual_seed(0)
    quantizer = DDCLQuantizer(8, 3, temperature=0.05, distance=distance, init="normal", recipe="plain")
    with torch.no_grad():
        quantizer.prototypes.mul_(0.2).add_(3.0)
    tokens = torch.randn(40, 6, 3) * 0.2 + 3.0
    split = (tokens, torch.zeros(40, 6, dtype=torch.long), torch.zeros(40, dtype=torch.long))
    before = quantizer.prototypes.detach().clone()
    train, test, mapped, scaling = readout.standardize(split, split, quantizer)
    assert torch.equal(quantizer.prototypes.detach(), before)  # a copy is mapped
    flat = train[0].reshape(-1, 3).double()
    if distance == "euclidean":
        torch.testing.assert_close(flat.mean(0), torch.zeros(3, dtype=torch.float64), atol=1e-6, rtol=0)
        assert flat.square().sum(1).mean().item() == pytest.approx(3.0, rel=1e-5)  # unit RMS per coordinate
    else:  # angles are kept: only a scale, the RMS of the raw tokens
        assert scaling["center_norm"] == 0 and scaling["scale"] == pytest.approx(tokens.square().mean().sqrt().item())
    torch.testing.assert_close(mapped(test[0]).probs, quantizer(tokens).probs, atol=1e-5, rtol=1e-4)
    assert scaling["layer_standardizes"] is False
    assert readout.codebook_entropy(mapped, test[0]) == pytest.approx(
        float(assignment_entropy(quantizer(tokens).probs)) / math.log(8), rel=1e-4)


def test_standardize_maps_a_self_standardising_layer_by_its_running_statistics():
    torch.manual_seed(0)
    quantizer = DDCLQuantizer(8, 3)  # the defaults: the layer standardises its tokens itself
    tokens = torch.randn(40, 6, 3) * 0.2 + 3.0
    quantizer(tokens)  # one training batch: data init and running statistics
    quantizer.eval()
    split = (tokens, torch.zeros(40, 6, dtype=torch.long), torch.zeros(40, dtype=torch.long))
    before = quantizer.prototypes.detach().clone()
    train, test, mapped, scaling = readout.standardize(split, split, quantizer)
    assert scaling["layer_standardizes"] is True
    assert torch.equal(mapped.prototypes.detach(), before)  # the prototypes live in the standardised space
    torch.testing.assert_close(mapped(test[0]).probs, quantizer(tokens).probs, atol=1e-4, rtol=1e-3)


def test_readout_refuses_data_with_other_classes_than_the_checkpoint(checkpoint, tiny_cifar, tmp_path):
    other = tmp_path / "other"
    shutil.copytree(tiny_cifar["folder"], other)
    for split in ("train", "test"):
        (other / split / "cat").rename(other / split / "lion")
    with pytest.raises(ValueError, match=r"only in checkpoint .*: \['cat'\]; only in the data at .*: \['lion'\]"):
        readout.main(["--checkpoint", str(checkpoint), "--data-root", str(other), "--quick", "--train-subset", "200",
                      "--out", str(tmp_path / "report"), "--num-workers", "0"])
