"""eval.rate_distortion, its report and eval.sample_quality: the matched-PSNR arithmetic and the spread rule on
hand-made points, neighbour statistics and the Fréchet distance against closed forms, the classifier cache's hash
check, and both studies end to end on a tiny data set."""

from __future__ import annotations

import json
import math

import pytest
import torch
import torch.nn.functional as F

from eval import rate_distortion as rd
from eval import sample_quality
from eval.rate_distortion import report
from eval.sample_quality import classifier as clf


def point(method: str, k: int, seed: int, psnr: float, bits: float) -> dict:
    return {"method": method, "seed": seed, "target_entropy": None, "settings": {"num_codes": k},
            "test": {"psnr_hard": psnr}, "prior": {"test": {"bits_per_image": bits}}}


def test_matched_psnr_reads_the_peers_bits_off_its_log_linear_line():
    # the peer: log(bits) = log(400) + 0.2 (psnr - 23), measured at 23 and 24 dB
    peer = [point("hard_ema", 512, s, 23.0, 400.0) for s in range(3)] + [point("hard_ema", 4096, 0, 24.0,
                                                                               400.0 * math.exp(0.2))]
    ours = [point("ddcl", 512, s, 23.5 + d, 380.0 * math.exp(0.3 * d)) for s, d in enumerate((-0.1, 0.0, 0.1))]
    ours.append(point("ddcl", 4096, 0, 25.1, 500.0))
    rows = report.matched(report.group(peer + ours))
    small = next(r for r in rows if r["num_codes"] == 512)
    expected_peer = 400.0 * math.exp(0.2 * 0.5)  # at DDCL's mean PSNR, 23.5 dB
    assert small["peer_bits"] == pytest.approx(expected_peer)
    ddcl_mean = sum(380.0 * math.exp(0.3 * d) for d in (-0.1, 0.0, 0.1)) / 3
    assert small["saving"] == pytest.approx(1 - ddcl_mean / expected_peer)
    assert small["inside"]
    # seed by seed: the peer's seeds all sit on its line at 23 dB; DDCL's seeds moved along its own line
    assert small["spread"]["peer_bits"] == pytest.approx([expected_peer] * 3)
    large = next(r for r in rows if r["num_codes"] == 4096)
    assert not large["inside"] and "outside" in large["reason"]  # 25.1 dB: 1.1 dB beyond the peer's 24
    # the peer's K = 4096 point (24 dB, 488.6 bits) has more PSNR but more bits than DDCL's K = 512 point: no beat
    beaten = report.dominated_by(report.group(peer + ours + [point("vqp_vq", 512, 0, 23.6, 300.0)]))
    assert "beaten on both axes by vqp_vq K = 512 (23.60 dB, 300.0 bits)" in beaten[0]
    assert "hard_ema" not in beaten[0] and "no peer point beats it" in beaten[1]
    lines = report.target_lines(rows, 512)
    assert "K = 512" in lines[0] and "**met**" in lines[0]
    assert "K = 4096: no peer's line reaches DDCL's PSNR" in lines[1]


def test_the_sweeps_default_row_names_the_entropy_its_layer_held():
    def point(target, **extra):
        return {"method": "ddcl", "seed": 0, "target_entropy": target, "settings": {"num_codes": 512},
                "history": [{"val_psnr_hard": 23.0, "val_perplexity": 450.0}],
                "prior": {"val": {"bits_per_image": 448.0, "bits_per_position": 7.0}},
                "neighbours": {"val": {"k": 8, "within_8_nearest": 0.16}}, **extra}

    # a result from before results recorded it: the default then, min(2.5, log K / 2) = 2.5 at K = 512
    assert report.held_entropy(point(None), 512) == 2.5
    assert report.held_entropy(point(None, held_entropy=0.5 * math.log(512)), 512) == pytest.approx(3.119, abs=1e-3)
    assert report.held_entropy(point(1.5, held_entropy=1.5), 512) == 1.5
    lines = report.sweep_lines([point(None, held_entropy=3.119), point(1.5), point(3.5)], 512)
    assert [line.split(" |")[0] for line in lines[2:]] == ["| 1.5", "| default (3.12)", "| 3.5"]  # sorted by entropy


def test_neighbour_similarity_against_a_hand_count():
    codebook = torch.tensor([[0.0], [1.0], [10.0], [11.0]])  # 0 and 1 are near, 2 and 3 are near
    codes = torch.tensor([[[0, 1], [2, 2]]])  # right pairs (0,1) (2,2); down pairs (0,2) (1,2)
    stats = rd.neighbour_similarity(codes, codebook, k=2)
    assert stats["same_code"] == pytest.approx(1 / 4)
    assert stats["within_2_nearest"] == pytest.approx(2 / 4)  # (0,1) and (2,2); not (0,2) or (1,2)


def test_frechet_distance_against_closed_forms():
    g = torch.Generator().manual_seed(0)
    x = torch.randn(3000, 8, generator=g, dtype=torch.float64) @ torch.randn(8, 8, generator=g, dtype=torch.float64)
    assert clf.frechet_distance(x, x) == pytest.approx(0.0, abs=1e-6)
    shift = torch.linspace(-1, 1, 8, dtype=torch.float64)
    assert clf.frechet_distance(x, x + shift) == pytest.approx(float(shift.square().sum()), rel=1e-6)
    # a scaled centred copy: same mean, covariance a^2 S, so the distance is (1 - a)^2 tr(S)
    centred = x - x.mean(0)
    cov = centred.T @ centred / (len(x) - 1)
    assert clf.frechet_distance(centred, 3.0 * centred) == pytest.approx(4.0 * float(cov.trace()), rel=1e-6)
    interval = clf.bootstrap_frechet(x, x + shift, replicates=8)
    assert interval["low"] <= interval["high"] and interval["value"] == pytest.approx(float(shift.square().sum()))
    with pytest.raises(ValueError, match="NaN or Inf"):
        clf.frechet_distance(x, torch.full_like(x, float("nan")))
    with pytest.raises(ValueError, match="feature widths differ"):
        clf.frechet_distance(x, x[:, :4])


def test_augment_returns_crops_or_mirrored_crops_of_the_padded_images():
    x = torch.rand(6, 3, 32, 32, generator=torch.Generator().manual_seed(1))
    torch.manual_seed(2)
    out = clf.augment(x)
    padded = F.pad(x, (4, 4, 4, 4), mode="reflect")
    for k in range(6):
        crops = [padded[k, :, i:i + 32, j:j + 32] for i in range(9) for j in range(9)]
        assert any(torch.equal(out[k], c) or torch.equal(out[k], c.flip(-1)) for c in crops)


@pytest.fixture(scope="module")
def studies(tmp_path_factory, tiny_cifar):
    """Both studies on the tiny data set: DDCL and HardVQ EMA, K = 64 / 256, one seed each, one sweep point."""
    base = tmp_path_factory.mktemp("rd")
    small = ["--epochs", "1", "--num-codes", "64", "256", "--code-dim", "16", "--width", "32", "--res-blocks", "1",
             "--res-hidden", "8", "--prior-layers", "1", "--prior-dim", "32", "--prior-epochs", "1"]
    argv = [*small, "--data-root", str(tiny_cifar["folder"]), "--methods", "ddcl", "hard_ema", "--seeds", "0",
            "--sweep", "1.5", "--train-subset", "100", "--val-size", "50", "--test-limit", "50", "--threads", "1",
            "--runs", str(base / "runs"), "--out", str(base / "report"), "--no-progress-bar"]
    summary = rd.main(argv)
    quality = sample_quality.main(["--data-root", str(tiny_cifar["folder"]), "--rd-runs", str(base / "runs"),
                                   "--samples", "20", "--val-size", "50", "--train-subset", "100",
                                   "--classifier-width", "4", "--classifier-epochs", "1", "--conditional",
                                   "--guidance", "1", "2", "--classifier-cache", str(base / "classifier"),
                                   "--out", str(base / "quality"), "--threads", "1"])
    return {"base": base, "argv": argv, "summary": summary, "quality": quality, "tiny": tiny_cifar["folder"]}


def test_rate_distortion_end_to_end_and_bits_are_the_summed_position_nlls(studies):
    base, summary = studies["base"], studies["summary"]
    text = (base / "report" / "report.md").read_text()
    for part in ("## Test split", "## Matched PSNR", "## Target", "validation split", "python -m eval.rate_distortion",
                 "256 (256)"):
        assert part in text, part
    assert (base / "report" / "rate_distortion.png").stat().st_size > 0
    assert len(summary["results"]) == 5 and not summary["missing"]  # 2 methods x 2 sizes + 1 sweep point
    # the reported bits per image are the sum over positions of the prior's NLL of the test codes
    directory = base / "runs" / "ddcl" / "K64" / "seed0"
    result, vqvae, prior, codes = sample_quality.load_point(directory)
    with torch.no_grad():
        nll = prior.nll(codes["test"]).double()  # (N, 64) nats
    assert codes["test"].shape == (50, 8, 8)
    assert result["held_entropy"] == pytest.approx(0.5 * math.log(64))  # the default's target, log K / 2, recorded
    # the kept VQ-VAE weights reload into the same model: it encodes the test images into the kept codes
    from softvq.data.cifar10 import CIFAR10DataModule

    data = CIFAR10DataModule(studies["tiny"], val_size=50, num_workers=0)
    data.setup("test")
    images, _ = clf.images_of(data.test_set, 50)
    assert torch.equal(vqvae.encode(images), codes["test"])
    assert result["prior"]["test"]["bits_per_image"] == pytest.approx(float(nll.sum(1).mean() / math.log(2)),
                                                                      rel=1e-5)
    again = rd.main([*studies["argv"], "--no-train"])  # read, not retrained
    assert [r["prior"]["test"]["bits_per_image"] for r in again["results"]] == \
        [r["prior"]["test"]["bits_per_image"] for r in summary["results"]]
    with pytest.raises(ValueError, match="does not have"):
        rd.main([*studies["argv"], "--only", "ddcl:999:0"])


def test_sample_quality_end_to_end(studies):
    q = studies["quality"]
    assert q["protocol"]["temperature"] in (0.9, 1.0) and len(q["rows"]) == 4  # the sweep point is not scored
    for row in q["rows"]:
        assert row["samples_fd"]["value"] >= 0 and row["samples_fd"]["low"] <= row["samples_fd"]["high"]
        assert 0 <= row["reconstruction_accuracy"] <= 1
    assert q["conditional"]["guidance"] in (1.0, 2.0) and len(q["conditional"]["rows"]) == 4
    text = (studies["base"] / "quality" / "report.md").read_text()
    for part in ("classifier Fréchet distance", "## Unconditional samples", "## Guided class-conditional samples"):
        assert part in text, part
    saved = json.loads((studies["base"] / "quality" / "results.json").read_text())
    assert saved["classifier"]["sha256"] == q["classifier"]["sha256"]


def test_sample_quality_scores_only_the_codebook_sizes_asked_for(studies):
    runs = studies["base"] / "runs"
    every = sample_quality.find_points(runs)
    assert [p.relative_to(runs).as_posix() for p in every] == [
        "ddcl/K256/seed0", "ddcl/K64/seed0", "hard_ema/K256/seed0", "hard_ema/K64/seed0"]  # not the sweep's point
    assert [p.relative_to(runs).as_posix() for p in sample_quality.find_points(runs, [64])] == [
        "ddcl/K64/seed0", "hard_ema/K64/seed0"]
    with pytest.raises(FileNotFoundError, match=r"at K in \[4096\]"):
        sample_quality.find_points(runs, [4096])


def test_the_classifier_cache_refuses_a_file_with_another_hash(studies):
    path = next((studies["base"] / "classifier").glob("classifier-*.pt"))
    model, record = clf.load_classifier(path)
    assert record["sha256"] == clf.sha256_file(path)
    state = model.state_dict()
    state["head.bias"] = state["head.bias"] + 1.0  # another classifier in the same place
    torch.save(state, path)
    with pytest.raises(ValueError, match="the file was changed or replaced"):
        clf.load_classifier(path)
