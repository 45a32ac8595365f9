"""eval.sample_quality.why: the band energies against Parseval and against sinusoids whose frequency is known, the
per-class accuracy against a hand-made prediction table, the mutual information against small cases worked out by
hand, the two nearest codes against brute force and against the layers' own choice, and a run on tiny long runs that
writes the JSON and the figure without reading the test split."""

from __future__ import annotations

import json
import math
import re

import pytest
import torch
from test_sample_quality_long import PEERS, VQVAE

import softvq
from eval import long_run, peers
from eval.sample_quality import classifier as clf
from eval.sample_quality import why
from eval.sample_quality.sampling import reconstruct
from softvq.data import cifar10
from softvq.data.cifar10 import CIFAR10DataModule, sha256_file
from softvq.models.checkpoint_io import load_torch_file

WIDTH = math.sqrt(0.5) / 8  # the width of each of 8 bands in |f|, cycles per pixel


def _wave(h: int, w: int, ky: int, kx: int) -> torch.Tensor:
    """``cos(2 pi (ky i / h + kx j / w))`` on an ``(h, w)`` grid: frequency ``(ky / h, kx / w)`` cycles per pixel."""
    i, j = torch.meshgrid(torch.arange(h, dtype=torch.float64), torch.arange(w, dtype=torch.float64), indexing="ij")
    return torch.cos(2 * math.pi * (ky * i / h + kx * j / w))


@pytest.mark.parametrize("shape", [(4, 3, 32, 32), (2, 1, 15, 20)])
def test_band_energies_sum_to_the_squared_error(shape):
    e = torch.randn(shape, generator=torch.Generator().manual_seed(0), dtype=torch.float64)
    bands = why.band_energies(e, 8)
    assert bands.shape == (8,) and (bands >= 0).all()
    assert float(bands.sum()) == pytest.approx(float(e.square().sum()), rel=1e-12)


@pytest.mark.parametrize("ky, kx, band", [
    (0, 8, 2),   # |f| = 8/32 = 0.25; 0.25 / 0.0884 = 2.83
    (6, 10, 4),  # |f| = sqrt(36 + 100) / 32 = 0.3644; / 0.0884 = 4.12
    (1, 0, 0),   # |f| = 1/32 = 0.031, the lowest band beside DC
    (16, 16, 7),  # (-1)^(i + j): the Nyquist corner, |f| = sqrt(2) / 2, in the last band
])
def test_a_sinusoid_lands_in_its_band(ky, kx, band):
    assert min(math.floor(math.hypot(ky, kx) / 32 / WIDTH), 7) == band  # the table's arithmetic, the corner in 7
    e = 0.1 * _wave(32, 32, ky, kx).expand(2, 3, 32, 32)
    energies = why.band_energies(e, 8)
    total = float(e.square().sum())
    assert float(energies[band]) == pytest.approx(total, rel=1e-10)
    assert float(energies.sum() - energies[band]) < 1e-10 * total


def test_a_constant_offset_is_all_in_band_zero():
    e = torch.full((3, 3, 32, 32), 0.02, dtype=torch.float64)
    energies = why.band_energies(e, 8)
    assert float(energies[0]) == pytest.approx(0.02 ** 2 * 3 * 3 * 32 * 32, rel=1e-12)
    assert float(energies[1:].abs().max()) < 1e-15


def test_correcting_one_band_removes_exactly_that_bands_error():
    g = torch.Generator().manual_seed(0)
    x, recon = torch.rand(3, 3, 32, 32, generator=g), torch.rand(3, 3, 32, 32, generator=g)
    fixed = [why.band_corrected(x, recon, b, 8) for b in range(8)]
    # the bands partition the frequencies: the corrections add up to the whole error
    assert torch.allclose(recon + sum(f - recon for f in fixed), x, atol=1e-5)
    for b, f in enumerate(fixed):  # what is left of the error has nothing in band b and all else unchanged
        left, before = why.band_energies((x - f).double(), 8), why.band_energies((x - recon).double(), 8)
        assert float(left[b]) < 1e-8 * float(before.sum())
        others = [c for c in range(8) if c != b]
        assert torch.allclose(left[others], before[others], rtol=1e-4)
    wave = 0.1 * _wave(32, 32, 0, 8).float().expand(1, 3, 32, 32)  # an error all in band 2
    assert torch.allclose(why.band_corrected(recon[:1] + wave, recon[:1], 2, 8), recon[:1] + wave, atol=1e-6)
    assert torch.allclose(why.band_corrected(recon[:1] + wave, recon[:1], 3, 8), recon[:1], atol=1e-6)


def test_per_class_accuracy_against_a_prediction_table():
    labels = torch.tensor([0, 0, 1, 1, 1, 2])
    real = torch.tensor([0, 1, 1, 1, 0, 2])
    recon = torch.tensor([0, 0, 1, 2, 0, 1])
    got = why.class_accuracy(labels, real, recon, num_classes=4)
    assert got["real"] == {"overall": pytest.approx(4 / 6), "per_class": [0.5, pytest.approx(2 / 3), 1.0, None]}
    assert got["reconstruction"] == {"overall": 0.5, "per_class": [1.0, pytest.approx(1 / 3), 0.0, None]}
    assert got["changed"] == {"overall": 0.5, "per_class": [0.5, pytest.approx(1 / 3), 1.0, None]}


def test_mutual_information_of_small_cases():
    independent = why.mutual_information(torch.tensor([0, 0, 1, 1]), torch.tensor([0, 1, 0, 1]), 2, 2)
    assert independent == {"bits": pytest.approx(0.0, abs=1e-15), "h_code_bits": 1.0, "h_class_bits": 1.0}
    # the class determines the code: I = H(class) = -(2 * 1/4 log2 1/4 + 1/2 log2 1/2) = 1.5
    determined = why.mutual_information(torch.tensor([0, 1, 2, 2]), torch.tensor([5, 3, 7, 7]), 3, 8)
    assert determined == {"bits": pytest.approx(1.5), "h_code_bits": pytest.approx(1.5), "h_class_bits": 1.5}
    # partly: p(0,0) = 1/2, p(1,0) = p(1,1) = 1/4; I = H(class) - H(class | code) = 1 - 3/4 H(2/3, 1/3)
    part = why.mutual_information(torch.tensor([0, 0, 1, 1]), torch.tensor([0, 0, 0, 1]), 2, 2)
    h = -(2 / 3 * math.log2(2 / 3) + 1 / 3 * math.log2(1 / 3))
    assert part["bits"] == pytest.approx(1 - 0.75 * h)
    assert part["bits"] == pytest.approx(0.5 * math.log2(4 / 3) + 0.25 * math.log2(2 / 3) + 0.25)  # the sum itself


def test_two_nearest_against_brute_force():
    g = torch.Generator().manual_seed(0)
    tokens, codebook = torch.randn(50, 3, generator=g), torch.randn(7, 3, generator=g)
    idx, dist = why.two_nearest(tokens, codebook, block=8)
    brute = ((tokens[:, None].double() - codebook[None].double()) ** 2).sum(-1)  # (50, 7)
    order = brute.argsort(1)[:, :2]
    assert torch.equal(idx, order)
    assert torch.allclose(dist, brute.gather(1, order), rtol=1e-12, atol=1e-12)
    # by hand: (0.25, 0) to codes (0, 0), (1, 0), (0, 3): 0.0625, 0.5625, 9.0625, a ratio of 1/9
    idx, dist = why.two_nearest(torch.tensor([[0.25, 0.0]]), torch.tensor([[0.0, 0.0], [1.0, 0.0], [0.0, 3.0]]))
    assert idx.tolist() == [[0, 1]] and float(dist[0, 0] / dist[0, 1]) == pytest.approx(1 / 9)


@pytest.mark.parametrize("method, distance", [("ddcl", "euclidean"), ("ddcl", "cosine"), ("hard_ema", None),
                                              *([("vqp_fsq", None)] if "vqp_fsq" in PEERS else [])])
def test_the_nearest_code_in_code_space_is_the_layers_choice(method, distance):
    torch.manual_seed(0)
    layer = peers.build(method, 64, 8)
    if method == "ddcl":
        layer.distance = distance
    for _ in range(3):  # a few training steps: statistics, prototypes from data, EMA
        layer(torch.randn(256, 8) * 3 + 1)
    layer.eval()
    z = torch.randn(500, 8) * 3 + 1
    with torch.no_grad():
        tokens, codebook = why.code_space(layer, z)
        idx, _ = why.two_nearest(tokens, codebook)
        assert torch.equal(idx[:, 0], layer(z).indices)
    if isinstance(layer, softvq.DDCLQuantizer):  # the prototypes themselves, in the standardised space
        assert torch.equal(codebook, layer.prototypes.detach() if distance == "euclidean"
                           else torch.nn.functional.normalize(layer.prototypes.detach(), dim=-1))


@pytest.fixture(scope="module")
def tiny_runs(tmp_path_factory, tiny_cifar):
    """Tiny finished long runs (DDCL and the study's peers) and the cached classifier of the study's settings."""
    threads = torch.get_num_threads()
    base, tiny = tmp_path_factory.mktemp("why"), tiny_cifar["folder"]
    long_run.main(["--data-root", str(tiny), "--runs", str(base / "runs"), "--out", str(base / "lr_report"),
                   "--methods", "ddcl", *PEERS, "--seeds", "0", *VQVAE])
    data = CIFAR10DataModule(tiny, val_size=32, num_workers=0)
    data.setup()
    settings = {"width": 4, "epochs": 1, "batch_size": 128, "lr": 0.1, "seed": 0, "data": str(tiny), "val_size": 32}
    clf.load_or_train(data.train_set, data.val_set, data.test_set, settings, base / "classifier", progress=False)
    yield base, tiny
    torch.set_num_threads(threads)


def _argv(base, tiny, *extra):
    return ["--data-root", str(tiny), "--long-runs", str(base / "runs"), "--classifier-width", "4",
            "--classifier-epochs", "1", "--classifier-cache", str(base / "classifier"), "--images", "24",
            "--out", str(base / "out" / "why.json"), "--threads", "1", *extra]


def test_a_study_of_tiny_runs_writes_its_figures_without_the_test_split(tiny_runs, monkeypatch):
    base, tiny = tiny_runs
    load_split = cifar10.load_split

    def train_only(source, root, train, **kw):
        if not train:
            raise AssertionError("the test split was read")
        return load_split(source, root, train=train, **kw)

    monkeypatch.setattr(cifar10, "load_split", train_only)
    summary = why.main(_argv(base, tiny))
    saved = json.loads((base / "out" / "why.json").read_text())
    assert saved == json.loads(json.dumps(summary)) and saved["split"] == "validation"
    assert (base / "out" / "why.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert [r["point"] for r in saved["runs"]] == sorted(f"K64/{m}/seed0" for m in ["ddcl", *PEERS])
    assert saved["band_edges"][-1] == pytest.approx(math.sqrt(0.5)) and len(saved["band_edges"]) == 9
    classifier, _ = clf.load_classifier(base / "classifier" / saved["classifier"]["file"])
    data = CIFAR10DataModule(tiny, val_size=32, train_subset=128, num_workers=0)
    data.setup("fit")
    x, y = clf.images_of(data.val_set, 24)
    for r in saved["runs"]:
        run = base / "runs" / r["point"]
        assert r["checkpoint_sha256"] == sha256_file(run / "checkpoints" / "last.ckpt") and r["images"] == 24
        vqvae = peers.vqvae_of(r["method"], r["settings"])
        vqvae.load_state_dict(load_torch_file(run / "checkpoints" / "last.ckpt")["state_dict"])
        recon = reconstruct(vqvae.eval(), x)
        per_image = (recon - x).double().square().flatten(1)
        s = r["spectrum"]
        assert s["total_error"] == pytest.approx(float(per_image.sum(1).mean()), rel=1e-9)
        assert sum(s["error_energy"]) == pytest.approx(s["total_error"], rel=1e-12)
        assert sum(s["image_energy"]) == pytest.approx(float(x.double().square().flatten(1).sum(1).mean()), rel=1e-9)
        assert r["psnr_hard"] == pytest.approx(float((-10 * per_image.mean(1).log10()).mean()), rel=1e-6)
        real, rec = clf.predict(classifier, x), clf.predict(classifier, recon)
        assert r["accuracy"]["reconstruction"]["overall"] == pytest.approx(float((rec == y).double().mean()))
        assert r["accuracy"]["changed"]["overall"] == pytest.approx(float((rec != real).double().mean()))
        fixed = clf.predict(classifier, why.band_corrected(x, recon, 3, 8))  # band 3's error removed
        assert r["accuracy"]["band_corrected"][3] == pytest.approx(float((fixed == y).double().mean()))
        assert len(r["accuracy"]["band_corrected"]) == 8
        c = r["codes"]
        mi = c["mutual_information"]
        assert 0 <= mi["bits"] <= min(mi["h_code_bits"], mi["h_class_bits"]) + 1e-12
        assert c["nearest_is_assigned"] == 1.0  # the geometry picks what the layer picked, token for token
        q = c["margin"]["quartiles"]
        assert 0 <= q[0] <= q[1] <= q[2] <= 1 and 0 <= c["margin"]["mean"] <= 1
        assert c["swap"]["psnr_drop"] == pytest.approx(r["psnr_hard"] - c["swap"]["psnr"])
    assert saved["commit"] and saved["command"].startswith("python -m eval.sample_quality.why --data-root")
    text = (base / "out" / "why.md").read_text()  # its tables are why.json's numbers
    rows = {r["point"]: r for r in saved["runs"]}

    def table(heading: str, skip: int = 0) -> list[list[str]]:
        section = text.split(heading, 1)[1].split("\n## ", 1)[0]
        return [[c.strip() for c in line.strip("|").split("|")] for line in section.splitlines()
                if line.startswith("| K")][skip:]

    spectrum = table("## The error spectrum")
    assert [c[0] for c in spectrum[:len(rows)]] == list(rows)
    for cells in spectrum[:len(rows)]:
        r = rows[cells[0]]
        assert cells[1:] == [f"{r['psnr_hard']:.2f}", *(f"{v:.3f}" for v in r["spectrum"]["error_share"]),
                             f"{r['spectrum']['total_error']:.2f}"]
    for cells in table("## The classifier")[:len(rows)]:
        a = rows[cells[0]]["accuracy"]
        assert cells[1:] == [f"{a['real']['overall']:.3f}", f"{a['reconstruction']['overall']:.3f}",
                             f"{a['changed']['overall']:.3f}"]
    for cells in table("## The codes"):
        c = rows[cells[0]]["codes"]
        assert cells[1] == f"{c['mutual_information']['bits']:.3f}" and cells[-1] == f"{c['swap']['psnr_drop']:.2f} dB"
    assert "validation split" in text and saved["commit"] in text


@pytest.mark.parametrize("extra, message", [
    (["--images", "0"], "--images must be positive, got 0"),
    (["--bands", "-1"], "--bands must be positive, got -1"),
    (["--out", "x.png"], "--out must name a .json file"),
    (["--methods", "nope"], "invalid choice: 'nope'"),
])
def test_bad_flags_are_errors_that_name_them(extra, message, capsys, tmp_path):
    with pytest.raises(SystemExit):
        why.parse_args(["--long-runs", str(tmp_path), *extra])
    assert re.search(message, capsys.readouterr().err)


def test_no_runs_or_no_classifier_is_named(tiny_runs, tmp_path, capsys):
    base, tiny = tiny_runs
    assert why.cli(_argv(base, tiny, "--num-codes", "512")) == 2
    assert "no finished long run" in capsys.readouterr().err
    assert why.cli(_argv(base, tiny, "--classifier-cache", str(tmp_path))) == 2
    assert "no cached classifier" in capsys.readouterr().err
