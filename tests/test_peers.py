"""eval.harness, eval.peers and eval.dropin: the adapter against the wrapped library, the runs end to end on a tiny
data set, the report's statistics by hand, and reuse of finished runs."""

from __future__ import annotations

import dataclasses
import json
import math

import numpy as np
import pytest
import torch

from eval import dropin, harness, peers
from eval._spread import mean_std

vqp = pytest.importorskip("vector_quantize_pytorch")

TINY = ["--train-subset", "64", "--val-size", "32", "--batch-size", "16", "--num-codes", "64",
        "--code-dim", "8", "--width", "8", "--res-blocks", "1", "--res-hidden", "4", "--test-limit", "32",
        "--num-workers", "0", "--no-progress-bar"]


@pytest.mark.parametrize("method", ["vqp_vq", "vqp_fsq", "vqp_simvq"])
def test_adapter_passes_the_library_output_through_and_decodes_its_indices(method):
    torch.manual_seed(0)
    adapter = harness.build(method, 64, 8)
    z = torch.randn(3, 4, 4, 8)
    adapter.train()
    out = adapter(z)
    assert out.quantized.shape == z.shape and out.indices.shape == (3, 4, 4)
    assert torch.equal(out.probs.argmax(-1), out.indices) and torch.equal(out.probs.sum(-1), torch.ones(3, 4, 4))
    adapter.eval()
    out = adapter(z)
    # in evaluation every peer outputs its code: the decode of the indices, through the library's own function
    torch.testing.assert_close(out.quantized, adapter.decode_indices(out.indices), rtol=1e-5, atol=1e-5)
    assert adapter.codebook.shape == (64, 8)


def test_adapter_counts_the_library_dead_code_replacements():
    # VectorQuantize (>= 1.34) updates its EMA cluster sizes (from zero, decay 0.8) and then replaces the codes below
    # a tenth of the mean: after one batch exactly the codes that won no token, counted here from the indices it
    # returned, not from the library
    torch.manual_seed(0)
    module = vqp.VectorQuantize(dim=4, codebook_size=16, dead_code_threshold_ratio=0.1)
    adapter = harness.PeerAdapter(module, "vq", 16, 4)
    out = adapter(0.1 * torch.randn(2, 32, 4) + 3.0)  # one tight cluster far from the random codes: few codes win
    unused = 16 - out.indices.unique().numel()
    assert unused > 0 and adapter.restarts == unused


def test_peers_end_to_end_reuses_finished_runs(tmp_path, tiny_cifar):
    argv = ["--data-root", str(tiny_cifar["folder"]), "--methods", "ddcl", "hard_ema", "vqp_vq", "--seeds", "0", "1",
            "--runs", str(tmp_path / "runs"), "--out", str(tmp_path / "report"), *TINY]
    argv_epochs = [*argv, "--epochs", "1"]
    summary = peers.main(argv_epochs)
    assert len(summary["runs"]) == 6
    text = (tmp_path / "report" / "report.md").read_text()
    for part in ("## Test split", "## Margins", "## Targets", "PSNR from hard indices", "python -m eval.peers"):
        assert part in text
    for png in ("health.png", "test.png"):
        assert (tmp_path / "report" / png).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    ddcl = [r for r in summary["runs"] if r["method"] == "ddcl"]
    mean, std = mean_std(np.array([r["test"]["psnr_hard"] for r in ddcl]))
    assert f"{float(mean):.2f} ± {float(std):.2f}" in text  # the table is the mean and sample std of the seeds
    for run in summary["runs"]:
        assert run["test"]["psnr_hard"] == run["test"]["psnr"] or run["method"] != "ddcl"  # hard output: one decode
        assert len(run["history"]) == 1 and run["history"][0]["train_images_per_s"] > 0
    result = tmp_path / "runs" / "ddcl" / "seed0" / "result.json"
    stamp = result.stat().st_mtime_ns
    again = peers.main([*argv_epochs, "--no-train"])  # read, not retrained
    assert result.stat().st_mtime_ns == stamp
    assert json.loads(result.read_text())["test"] == again["runs"][0]["test"]
    with pytest.raises(ValueError, match="other settings"):
        peers.main([*argv, "--epochs", "2", "--no-train"])  # 2 epochs: another run


def test_dropin_models_decode_their_indices_to_what_they_output(tiny_cifar, tmp_path):
    for method in dropin.METHODS:
        torch.manual_seed(0)
        model = dropin.SmallAutoencoder(method, 64).eval()
        x = torch.rand(2, 3, 32, 32)
        with torch.no_grad():
            reconstruction, indices, _ = model(x)
            torch.testing.assert_close(model.decode_indices(indices), reconstruction, rtol=1e-5, atol=1e-5)
        assert indices.shape == ((2, 8, 8, dropin.NUM_QUANTIZERS) if method in dropin.RESIDUAL else (2, 8, 8))
    summary = dropin.main(["--data-root", str(tiny_cifar["folder"]), "--steps", "3", "--seeds", "0", "--batch-size",
                           "16", "--num-codes", "64", "--test-limit", "16", "--num-workers", "0",
                           "--methods", "ddcl", "hard", "rddcl", "vqp_rvq", "--num-quantizers", "2",
                           "--out", str(tmp_path / "dropin"), "--runs", str(tmp_path / "dropin-runs")])
    assert [r["method"] for r in summary["runs"]] == ["ddcl", "hard", "rddcl", "vqp_rvq"]
    text = (tmp_path / "dropin" / "report.md").read_text()
    assert "DDCL" in text and "PSNR from hard indices" in text and "residual stacks: 2 levels" in text
    for run in summary["runs"]:
        assert 0 < run["test"]["utilization"] <= 1 and run["test"]["images"] == 16
        if run["method"] in dropin.RESIDUAL:  # the table shows the worst level
            levels = run["test"]["levels"]
            assert len(levels) == 2 and run["settings"]["num_quantizers"] == 2
            assert run["test"]["utilization"] == min(level["utilization"] for level in levels)
        else:
            assert "num_quantizers" not in run["settings"]  # single-codebook runs stored earlier stay valid


def test_dropin_probe_on_validation_scores_held_out_training_images_with_the_options_given(tiny_cifar, tmp_path):
    """--split validation trains on the training images less --val-size and scores those held out (never the test
    split); --ddcl-kwargs reaches the layer and is recorded, so such a run is never read back as the report's."""
    argv = ["--data-root", str(tiny_cifar["folder"]), "--steps", "2", "--seeds", "0", "--batch-size", "16",
            "--num-codes", "16", "--num-workers", "0", "--methods", "ddcl", "--runs", str(tmp_path / "runs")]
    built = []
    original = dropin.softvq.DDCLQuantizer

    def spy(*args, **kwargs):
        built.append(kwargs)
        return original(*args, **kwargs)

    dropin.softvq.DDCLQuantizer = spy
    try:
        probe = dropin.main([*argv, "--split", "validation", "--val-size", "24", "--ddcl-kwargs",
                             '{"standardize": {"renorm_clip": null}}',
                             "--out", str(tmp_path / "val")])
        report = dropin.main([*argv, "--out", str(tmp_path / "test")])
    finally:
        dropin.softvq.DDCLQuantizer = original
    (run,), (test_run,) = probe["runs"], report["runs"]
    assert run["test"]["images"] == 24 and test_run["test"]["images"] == 50  # the held-out images, then the test split
    assert run["settings"]["ddcl_kwargs"] == {"standardize": {"renorm_clip": None}}
    assert run["settings"]["split"] == "validation"
    assert "split" not in test_run["settings"] and "ddcl_kwargs" not in test_run["settings"]
    assert built[0]["standardize"] == {"renorm_clip": None} and "standardize" not in built[-1]
    val_text, test_text = ((tmp_path / split / "report.md").read_text() for split in ("val", "test"))
    assert "validation split (24 held-out training images" in val_text
    assert "val util %" in val_text and "test util %" not in val_text and "test util %" in test_text
    # the layer's evaluation with the running moments is scored beside its default, the applied statistics
    assert math.isfinite(run["test"]["psnr_hard_running_stats"])
    assert run["test"]["psnr_hard_running_stats"] != run["test"]["psnr_hard"]
    # options are passed on as given: a former name is the layer's to refuse, naming what replaced it
    with pytest.raises(TypeError, match=r"renorm.*standardize"):
        dropin.main([*argv, "--ddcl-kwargs", '{"renorm": false}', "--out", str(tmp_path / "former")])


def test_fsq_levels_of_the_sweep_sizes_name_their_true_code_count():
    assert [int(np.prod(harness.fsq_levels(k))) for k in (512, 1024, 4096, 16384)] == [512, 1000, 4375, 15360]


def test_a_probe_of_a_peer_overrides_one_option_of_its_recommended_configuration():
    def restarts(kwargs):
        torch.manual_seed(0)
        adapter = harness.build("vqp_vq", 16, 4, kwargs)
        adapter(torch.randn(2, 32, 4))  # k-means starts the codes on this batch
        for _ in range(5):
            adapter(0.01 * torch.randn(2, 32, 4) + 10.0)  # then the data moves away: most codes win nothing
        return adapter.restarts

    assert restarts({}) > 0  # the recipe's dead-code replacement (a tenth of the mean) moves codes that win nothing
    assert restarts({"dead_code_threshold_ratio": 0.0}) == 0  # the probe switches it off, and only that
    assert harness.build("vqp_vq", 16, 4, {"dead_code_threshold_ratio": 0.0}).module.rotation_trick  # the rest kept


def _numbers(history: list[dict]) -> list[dict]:
    return [{k: v for k, v in row.items() if k not in ("time_s", "train_images_per_s", "train_cpu_s")}
            for row in history]


def test_same_seed_same_numbers_for_every_method(tmp_path, tiny_cifar):
    """eval.peers is deterministic at a fixed seed, commit and thread count, for every method; and the bottleneck is
    built after seeding whoever calls fit_run (the rate-distortion and residual studies pass a builder): HardVQ draws
    its codebook at construction, so a module built beforehand started from the caller's random state."""
    args = peers.parse_args(["--data-root", str(tiny_cifar["folder"]), *TINY, "--train-subset", "32",
                             "--test-limit", "16", "--epochs", "1"])
    for method in harness.LABELS:
        first = harness.fit_run(method, 3, args, tmp_path / method / "a")[2]
        torch.rand(7)  # another random state at the call: it must not matter
        builder = None if method != "hard_ema" else (lambda: harness.build("hard_ema", args.num_codes, args.code_dim))
        second = harness.fit_run(method, 3, args, tmp_path / method / "b", quantizer=builder)[2]
        assert first["test"] == second["test"], method
        assert _numbers(first["history"]) == _numbers(second["history"]), method
    with pytest.raises(TypeError, match="a function that builds the bottleneck"):
        harness.fit_run("hard_ema", 3, args, tmp_path / "module", quantizer=harness.build("hard_ema", 8, 8))
    # test=False (a study tuned on validation) trains the same run and never calls the test loop
    model, _, untested = harness.fit_run("ddcl", 3, args, tmp_path / "untested", test=False)
    assert untested["test"] is None and model.test_summary == {}
    tested = harness.fit_run("ddcl", 3, args, tmp_path / "tested")[2]
    assert _numbers(untested["history"]) == _numbers(tested["history"])
    assert all(row["train_cpu_s"] > 0 for row in untested["history"])


def test_the_wide_candidate_holds_h_at_half_log_k_below_log_d_plus_one():
    # sqrt(K) prototypes share a token up to K = (D + 1)^2, then D + 1 of them (enough to span D directions)
    assert harness.wide_entropy_target(512, 64) == pytest.approx(math.log(512) / 2)  # 3.12 nats
    assert harness.wide_entropy_target(4096, 64) == pytest.approx(math.log(64))  # 4.16: 64 prototypes
    assert harness.wide_entropy_target(16384, 64) == pytest.approx(math.log(65))  # capped: 65 prototypes
    layer = harness.build("ddcl_wide", 4096, 64)
    assert layer.target_entropy == pytest.approx(math.log(64))
    assert harness.build("ddcl_wide", 4096, 64, {"target_entropy": 3.0}).target_entropy == 3.0  # an override wins
    with pytest.raises(ValueError, match="num_codes >= 2"):
        harness.wide_entropy_target(1, 64)


def test_below_d_plus_one_squared_the_wide_candidate_is_the_defaults_layer_and_h25_the_former_defaults():
    # the long-run records of ddcl_wide at K = 512 and 4096 stand as the exact layer's (the default then; at K = 512
    # today's): the same options, and the same training, bit for bit (docs/design.md, "Training to the end")
    torch.manual_seed(0)
    batches = [torch.randn(300, 8) for _ in range(3)]
    layers = []
    for method in ("ddcl", "ddcl_wide"):
        torch.manual_seed(1)
        layer = harness.build(method, 64, 8)  # 64 < (8 + 1)^2 = 81
        layers.append((layer, [layer(x) for x in batches]))
    (a, outs_a), (b, outs_b) = layers
    assert a.target_entropy == b.target_entropy == 0.5 * math.log(64)
    for x, y in zip(outs_a, outs_b, strict=True):
        assert torch.equal(x.quantized, y.quantized) and torch.equal(x.indices, y.indices)
    for (name, u), (_, v) in zip(a.state_dict().items(), b.state_dict().items(), strict=True):
        assert torch.equal(u, v) if isinstance(u, torch.Tensor) else u == v, name
    assert harness.build("ddcl_wide", 128, 8).target_entropy == pytest.approx(math.log(9))  # above it, capped
    for k in (512, 4096):  # the records' sizes (D = 64): the exact layer's target to the bit, log K / 2
        assert harness.build("ddcl_wide", k, 64).target_entropy == harness.build("ddcl_exact", k, 64).target_entropy \
            == 0.5 * math.log(k)
        assert harness.build("ddcl_wide", k, 64).top_k is None  # the exact layer, as measured
    # the former defaults: 2.5 nats from K = 149 on, log K / 2 below
    assert harness.build("ddcl_h25", 512, 64).target_entropy == 2.5
    assert harness.build("ddcl_h25", 64, 8).target_entropy == pytest.approx(0.5 * math.log(64))
    assert harness.build("ddcl_h25", 1, 8).target_entropy is None


def test_the_capped_hard_peer_restarts_only_codes_below_a_quarter_of_the_mean_usage():
    # at K = 16384 and 8,192 tokens a batch the mean code wins 0.5 tokens: the uncapped threshold of one token
    # restarts most codes every step, the capped one only those below N / (4K) (docs/studies.md, "Long training")
    usage = torch.tensor([0.3] * 8 + [0.05] * 4 + [0.5] * 4)  # mean 0.2875: capped threshold 0.071875
    z = torch.randn(64, 4)
    moved = {}
    for method in ("hard_ema", "hard_ema_cap"):
        layer = harness.build(method, 16, 4)
        layer.dead_codes.usage.copy_(usage)
        moved[method] = layer.dead_codes.restart_(layer.codebook.clone(), z)
    assert moved["hard_ema"].all()  # every code is below one token a batch
    assert torch.equal(moved["hard_ema_cap"], usage < 0.25 * usage.mean())
    assert int(moved["hard_ema_cap"].sum()) == 4
    capped = harness.build("hard_ema_cap", 16, 4).dead_codes.settings
    assert capped == dataclasses.replace(harness.HARD_RESTART, cap=0.25)


@pytest.mark.parametrize(("method", "k"), [("ddcl_top128", 128), ("ddcl_top256", 256)])
def test_the_top_k_candidates_are_the_defaults_layer_truncated_to_k_prototypes(method, k):
    layer = harness.build(method, 512, 8)
    assert isinstance(layer, harness.softvq.DDCLQuantizer) and layer.top_k == k
    default = harness.build("ddcl", 512, 8)
    assert default.top_k is None and layer.target_entropy == default.target_entropy  # only the truncation differs
    assert harness.build(method, 512, 8, {"top_k": 64}).top_k == 64  # an override wins
    assert method in harness.METHODS and method in harness.LABELS
