"""eval.robustness: every configuration is built by exactly the call the report prints, the regret arithmetic against
a hand-made table, and a smoke run of the grid (two settings x two methods, a failing run among them) at tiny size."""

from __future__ import annotations

import dataclasses
import json
import math

import pytest
import torch

import softvq
from eval import robustness as R
from softvq.parts import Restart

vqp = pytest.importorskip("vector_quantize_pytorch")


def test_every_configuration_is_built_by_the_call_the_report_prints():
    expected = {  # (class, attributes the documentation's call sets), for K = 64, D = 8
        "ddcl": (softvq.DDCLQuantizer, {"num_codes": 64, "dim": 8, "channel_first": True}),
        "hard": (softvq.HardVQ, {"num_codes": 64, "dim": 8, "ema_decay": None, "restart": None}),
        "hard_recipe": (softvq.HardVQ, {"num_codes": 64, "dim": 8, "ema_decay": 0.99,
                                                      "restart": Restart(1.0, decay=0.99, cap=None)}),
        "vqp_vq": (vqp.VectorQuantize, {"codebook_size": 64, "accept_image_fmap": True}),
        "vqp_vq_recipe": (vqp.VectorQuantize, {"codebook_size": 64, "accept_image_fmap": True, "rotation_trick": True}),
        "vqp_fsq": (vqp.FSQ, {"codebook_size": 64, "channel_first": True}),
        "vqp_simvq": (vqp.SimVQ, {"channel_first": True, "rotation_trick": True}),
    }
    assert set(expected) == set(R.CONFIGS)
    for config, (cls, attributes) in expected.items():
        module, size, call = R.build(config, 64, 8)
        assert call == R.constructor(config, 64, 8) and "{" not in call
        assert type(module) is cls, config
        assert size == 64
        for name, value in attributes.items():
            assert getattr(module, name) == value, (config, name)
    recipe = R.build("vqp_vq_recipe", 64, 8)[0]._codebook  # the README's dead-code recipe reaches the codebook
    assert recipe.kmeans_iters == 10 and recipe.threshold_ema_dead_code == 2 and not bool(recipe.initted)
    defaults = R.build("vqp_vq", 64, 8)[0]._codebook
    assert defaults.threshold_ema_dead_code == 0 and bool(defaults.initted)  # no k-means init by default
    fsq, size, call = R.build("vqp_fsq", 4096, 8)  # the FSQ paper's 2^12 set: 7 * 5^4 = 4375 codes
    assert call == "FSQ(levels=[7, 5, 5, 5, 5], dim=8, channel_first=True)" and size == fsq.codebook_size == 4375
    with pytest.raises(ValueError, match="unknown configuration 'vq'"):
        R.constructor("vq", 64, 8)


def test_regret_against_a_hand_made_table():
    means = {"a": {"x": 20.0, "y": 19.5, "z": None}, "b": {"x": 18.0, "y": 18.4, "z": 17.0},
             "c": {"x": 10.0, "y": float("nan"), "z": 12.5}}
    regret = R.regrets(means)
    assert regret["a"] == {"x": 0.0, "y": 0.5, "z": math.inf}  # a failed run is worse than any finite one
    assert regret["b"]["y"] == 0.0 and regret["b"]["x"] == pytest.approx(0.4) and regret["b"]["z"] == pytest.approx(1.4)
    assert regret["c"] == {"x": 2.5, "y": math.inf, "z": 0.0}
    worst = R.worst_case(regret)
    assert worst["x"] == (2.5, "c") and worst["y"] == (math.inf, "c") and worst["z"] == (math.inf, "a")


def test_settings_are_one_axis_from_base_except_the_named_corners():
    fields = [f.name for f in dataclasses.fields(R.Setting)]
    for setting_id, (_, setting) in R.SETTINGS.items():
        changed = [f for f in fields if getattr(setting, f) != getattr(R.BASE, f)]
        assert len(changed) == (0 if setting_id == "base" else 2 if setting_id in ("batch16_k4096", "sgd_d128")
                                else 1), setting_id
    with pytest.raises(ValueError, match="unknown optimizer 'rmsprop'"):
        R.Setting(optimizer="rmsprop")


def test_grayscale_input_is_luminance_on_three_channels():
    batch = torch.randint(0, 256, (2, 3, 4, 4), dtype=torch.uint8)
    gray = R.to_input(batch, "cifar10-gray")
    x = batch.double() / 255
    luminance = 0.299 * x[:, 0] + 0.587 * x[:, 1] + 0.114 * x[:, 2]
    for channel in range(3):
        torch.testing.assert_close(gray[:, channel].double(), luminance, rtol=1e-6, atol=1e-6)


def test_a_tiny_grid_end_to_end_with_a_failing_run(tiny_cifar, tmp_path, monkeypatch):
    # An encoder whose output is infinite: DDCL's finite check raises, the grid records it and goes on.
    monkeypatch.setitem(R.SETTINGS, "broken", ("encoder output x inf", R.Setting(num_codes=64, encoder_scale=math.inf)))
    argv = ["--data-root", str(tiny_cifar["folder"]), "--settings", "base", "k64", "broken", "--configs", "ddcl",
            "hard_recipe", "--seeds", "0", "--steps", "2", "--val-size", "30", "--out", str(tmp_path / "out"),
            "--runs", str(tmp_path / "runs")]
    summary = R.main(argv)
    runs = {(r["setting"], r["config"]): r for r in summary["runs"]}
    assert len(runs) == 6
    assert runs[("k64", "ddcl")]["constructor"] == "softvq.DDCLQuantizer(64, 32, channel_first=True)"
    assert runs[("base", "hard_recipe")]["optimizer"] == R.OPTIMIZERS["adam"]
    assert "failed" in runs[("broken", "ddcl")] and "test" not in runs[("broken", "ddcl")]
    for key in (("base", "ddcl"), ("k64", "hard_recipe")):
        test = runs[key]["test"]
        assert test["images"] == 50 and 0 < test["utilization"] <= 1 and math.isfinite(test["psnr_hard"])
    means = {s: {c: runs[(s, c)].get("test", {}).get("psnr_hard") for c in ("ddcl", "hard_recipe")}
             for s in ("base", "k64", "broken")}
    assert summary["regret"] == R.regrets(means)
    text = (tmp_path / "out" / "report.md").read_text()
    assert "`softvq.HardVQ(512, 32, ema_decay=0.99, restart=softvq.Restart(1.0, decay=0.99, cap=None))`" in text
    assert "`ddcl` in `broken`, seed 0 failed: ValueError" in text and "| failed |" in text
    stored = tmp_path / "runs" / "base" / "ddcl" / "seed0.json"
    stamp = stored.stat().st_mtime_ns
    again = R.main([*argv, "--no-train"])  # read, not retrained
    assert stored.stat().st_mtime_ns == stamp
    assert json.loads(stored.read_text())["test"] == runs[("base", "ddcl")]["test"]
    assert again["regret"] == summary["regret"]
    with pytest.raises(SystemExit, match="no stored run"):
        R.main([*argv, "--steps", "3", "--no-train"])  # another step count: no stored run has it


def test_the_report_lists_every_collapse_by_configuration(tmp_path):
    def run(setting, config, seed, psnr, utilization):
        return {"setting": setting, "config": config, "seed": seed, "train_s": 1.0,
                "test": {"psnr_hard": psnr, "utilization": utilization, "perplexity_per_code": 0.5}}

    runs = [run("base", "ddcl", 0, 20.0, 1.0), run("base", "ddcl", 1, 19.0, 0.97),
            run("base", "hard", 0, 15.0, 0.10), run("base", "hard", 1, 16.0, 0.60),
            run("k64", "ddcl", 0, 18.0, 0.40), run("k64", "ddcl", 1, 18.0, 0.45),
            run("k64", "hard", 0, 19.0, 0.9), run("k64", "hard", 1, 19.5, 0.9)]
    args = R.parse_args(["--settings", "base", "k64", "--configs", "ddcl", "hard", "--out", str(tmp_path)])
    summary = R.write_report(runs, args, wall_s=None)
    text = (tmp_path / "report.md").read_text()
    assert "- `ddcl`, 1 of 2 settings: `k64` 40.0% (2/2)" in text
    assert "- `hard`, 1 of 2 settings: `base` 10.0% (1/2)" in text
    assert summary["regret"] == {"base": {"ddcl": 0.0, "hard": 4.0}, "k64": {"ddcl": 1.25, "hard": 0.0}}
    assert "Regret ≤ 0.5 dB in every setting: NOT met — over it in `k64` (1.25 dB)" in text
    assert "Test utilization ≥ 95% in every setting (lowest seed): NOT met; lowest 40.0% in `k64`" in text


def test_gradient_gain_is_one_for_straight_through_and_the_jacobian_norm_for_ddcl():
    straight = R.gradient_gain(softvq.HardVQ(16, 4), 4, tokens=64, clusters=4, warmup=2)
    assert straight["gain"] == pytest.approx(1.0, abs=1e-6) and straight["cosine"] == pytest.approx(1.0, abs=1e-6)
    # DDCL, one token, float64: the reference is the full Jacobian of the layer's output, g -> J^T g.
    torch.manual_seed(0)
    layer = softvq.DDCLQuantizer(8, 3).double()
    with torch.no_grad():
        for _ in range(3):
            layer(torch.randn(64, 3, dtype=torch.float64))
    layer.eval()  # no state moves between the calls
    z, g = torch.randn(1, 3, dtype=torch.float64), torch.randn(1, 3, dtype=torch.float64)
    jacobian = torch.autograd.functional.jacobian(lambda x: layer(x).quantized, z).reshape(3, 3)
    reference = g.reshape(3) @ jacobian
    measured = R.gain_at(layer, z, g)
    assert measured["gain"] == pytest.approx(float(reference.norm() / g.norm()), rel=1e-9)
    cosine = float(reference @ g.reshape(3) / (reference.norm() * g.norm()))
    assert measured["cosine"] == pytest.approx(cosine, rel=1e-9, abs=1e-12)
    assert abs(measured["gain"] - 1.0) > 1e-3  # not a straight-through gradient
