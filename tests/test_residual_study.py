"""eval.residual end to end on a tiny data set: the peers behind softvq's residual interface, per-level figures, the
PSNR by levels decoded, the report and the scale probe."""

from __future__ import annotations

import argparse
import json

import pytest
import torch

from eval import peers, residual


def test_peer_residual_decodes_like_the_library_and_masks_levels():
    torch.manual_seed(0)
    for method in ("vqp_rvq", "vqp_rfsq"):
        adapter = residual.build(method, 3, 16, 8).eval()
        out = adapter(torch.randn(2, 4, 4, 8))
        assert out.indices.shape == (2, 4, 4, 3) and out.probs.shape[-2] == 3
        torch.testing.assert_close(adapter.decode_indices(out.indices), out.quantized, rtol=0, atol=1e-5)
        first = adapter.decode_indices(out.indices, 1)  # the first level alone: the library's own level-0 codes
        codes = adapter.module.get_codes_from_indices(out.indices.reshape(2, 16, 3))
        expected = codes[0] if method == "vqp_rvq" else adapter.module.project_out(codes[0])
        torch.testing.assert_close(first, expected.reshape(2, 4, 4, 8), rtol=0, atol=1e-5)


@pytest.mark.filterwarnings("ignore::UserWarning")
def test_residual_study_end_to_end(tmp_path, tiny_cifar):
    argv = ["--data-root", str(tiny_cifar["folder"]), "--num-quantizers", "2", "--num-codes", "16", "--epochs", "1",
            "--train-subset", "96", "--val-size", "32", "--test-limit", "32", "--width", "16", "--res-blocks", "1",
            "--res-hidden", "8", "--code-dim", "8", "--seeds", "0", "--runs", str(tmp_path / "runs"), "--out",
            str(tmp_path / "out"), "--no-progress-bar", "--threads", "1"]
    summary = residual.main([*argv, "--methods", "rddcl", "vqp_rvq", "ddcl512"])
    runs = {r["method"]: r for r in summary["runs"]}
    assert runs["rddcl"]["bits_per_position"] == 8.0 and runs["ddcl512"]["bits_per_position"] == 9.0
    assert len(runs["rddcl"]["psnr_by_levels"]) == 2 and len(runs["ddcl512"]["psnr_by_levels"]) == 1
    for method in ("rddcl", "vqp_rvq"):
        assert {"utilization_l1", "perplexity_l1"} <= set(runs[method]["test"])
        assert "val_utilization_l1" in runs[method]["history"][-1]
    assert runs["rddcl"]["psnr_by_levels"][-1] == pytest.approx(runs["rddcl"]["test"]["psnr_hard"], abs=1e-4)
    text = (tmp_path / "out" / "report.md").read_text()
    for part in ("## Test split", "## Targets", "dB per added bit", "level 1 val util %", "python -m eval.residual"):
        assert part in text, part
    assert (tmp_path / "out" / "psnr_by_levels.png").stat().st_size > 0
    residual.main([*argv, "--probe-scale"])  # reads the rddcl run, trains the per-level one
    assert "Better on validation" in (tmp_path / "out" / "scale_probe.md").read_text()


def test_the_single_codebook_rows_are_read_from_matching_rate_distortion_points(tmp_path):
    argv = ["--data-root", "data", "--epochs", "1", "--train-subset", "96", "--seeds", "0", "1", "--methods",
            "ddcl512", "--runs", str(tmp_path / "runs"), "--out", str(tmp_path / "out"), "--no-train"]
    args = residual.parse_args([*argv, "--single-runs", str(tmp_path / "rd")])
    point = {"method": "ddcl", "seed": 0, "test": {"psnr_hard": 21.5, "ssim_hard": 0.7, "num_codes": 512},
             "history": [{"epoch": 1}], "prior": {"test": {}}, "neighbours": {},
             "settings": {**peers.settings_of(argparse.Namespace(**{**vars(args), "num_codes": 512})), "prior": {}}}
    for seed, epochs in ((0, 1), (1, 2)):  # seed 1's point was trained for 2 epochs: another VQ-VAE
        directory = tmp_path / "rd" / "ddcl" / "K512" / f"seed{seed}"
        directory.mkdir(parents=True)
        stored = {**point, "seed": seed, "settings": {**point["settings"], "epochs": epochs}}
        (directory / "result.json").write_text(json.dumps(stored))
    row = residual.run("ddcl512", 0, args)
    assert row["method"] == "ddcl512" and row["levels"] == 1 and row["bits_per_position"] == 9.0
    assert row["psnr_by_levels"] == [21.5] and row["test"] == point["test"] and "prior" not in row
    assert row["source"].endswith("seed0/result.json")
    assert residual.run("ddcl512", 1, args) is None  # other settings: not read (and --no-train: not trained)
    assert residual.run("ddcl512", 0, residual.parse_args(argv)) is None  # without --single-runs nothing is shared
