"""eval.long_run: a run stopped after an epoch and resumed ends as the uninterrupted one (histories, test figures and
weights bit for bit), the 8-bit PSNR and the steps-to-reach rule against hand-computed values, records without absolute
paths, a run directory with other settings refused, and the equal-compute view (seconds to reach a PSNR, interpolated
between epochs; the report's section from fake records and step times; the step timer's results file)."""

from __future__ import annotations

import importlib.util
import json
import math
import os
import re

import lightning as L
import pytest
import torch
from helpers import json_strings

from eval import long_run, reports
from eval.long_run.equal_compute import reach_interpolated, value_at
from eval.long_run.metrics import perfect_psnr_8bit, psnr_8bit
from eval.long_run.report import (
    epoch_margins,
    falls,
    falls_table,
    steps_to_reach,
    write_report,
)
from softvq.models.callbacks import read_history
from softvq.models.checkpoint_io import load_torch_file

# vector-quantize-pytorch's VectorQuantize too where the bench extra is installed: a third-party layer's state resumes
METHODS = ["ddcl", "hard_ema"] + (["vqp_vq"] if importlib.util.find_spec("vector_quantize_pytorch") else [])
TINY = ["--num-codes", "16", "--methods", *METHODS, "--seeds", "0", "--off-plan", "--epochs", "2",
        "--train-subset", "64", "--val-size", "32", "--batch-size", "16", "--code-dim", "8", "--width", "32",
        "--res-blocks", "1", "--res-hidden", "8", "--test-limit", "32", "--num-workers", "0", "--threads", "1",
        "--no-progress-bar"]
WALL_CLOCK = {"time_s"}  # the only history field that may differ between two runs of the same numbers


class StopAfterFirstEpoch(L.Callback):
    """Ends training after epoch 1, as a stopped process would (its checkpoint written, epoch 2 never started)."""

    def on_train_epoch_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        if trainer.current_epoch == 0:
            trainer.should_stop = True


def _argv(tiny_cifar, base, *extra):
    return ["--data-root", str(tiny_cifar["folder"]), "--runs", str(base / "runs"), "--out", str(base / "out"),
            *TINY, *extra]


@pytest.fixture(scope="module")
def one_thread():
    """--threads 1 (the runner sets torch's threads for the process): on two busy cores, 7x faster than two; restored
    after this module's tests."""
    threads = torch.get_num_threads()
    yield
    torch.set_num_threads(threads)


@pytest.fixture(scope="module")
def studies(tmp_path_factory, tiny_cifar, one_thread):
    """The tiny study trained uninterrupted, and the same study stopped after epoch 1 and resumed."""
    straight, resumed = tmp_path_factory.mktemp("straight"), tmp_path_factory.mktemp("resumed")
    uninterrupted = long_run.main(_argv(tiny_cifar, straight))
    stopped = long_run.main(_argv(tiny_cifar, resumed), callbacks=[StopAfterFirstEpoch()])
    report_while_stopped = (resumed / "out" / "report.md").read_text()
    first_epoch = {m: read_history(resumed / "runs" / "K16" / m / "seed0" / "history.jsonl") for m in METHODS}
    finished = long_run.main(_argv(tiny_cifar, resumed))
    return {"straight": straight, "resumed": resumed, "uninterrupted": uninterrupted, "stopped": stopped,
            "report_while_stopped": report_while_stopped, "first_epoch": first_epoch, "finished": finished}


def test_a_run_resumed_after_an_epoch_ends_bit_for_bit_as_the_uninterrupted_run(studies):
    assert studies["stopped"]["finished"] == [] and len(studies["stopped"]["in_progress"]) == len(METHODS)
    assert "in progress" in studies["report_while_stopped"] and "epoch 1/2" in studies["report_while_stopped"]
    straight = {r["method"]: r for r in studies["uninterrupted"]["finished"]}
    resumed = {r["method"]: r for r in studies["finished"]["finished"]}
    assert sorted(straight) == sorted(resumed) == sorted(METHODS)
    for method in straight:
        a, b = straight[method], resumed[method]
        # resumed, not retrained: the second start began at epoch 1, and epoch 1's record is the one written before
        assert [i["from_epoch"] for i in b["invocations"]] == [0, 1]
        assert b["history"][0] == studies["first_epoch"][method][0]
        assert [row["step"] for row in a["history"]] == [4, 8]  # 64 images / batch 16 per epoch
        assert [{k: v for k, v in row.items() if k not in WALL_CLOCK} for row in a["history"]] == \
               [{k: v for k, v in row.items() if k not in WALL_CLOCK} for row in b["history"]]
        assert a["test"] == b["test"] and a["test"]["images"] == 32
        for key in ("val_psnr_hard", "val_ssim_hard", "val_utilization", "val_perplexity", "restarts", "train_mse"):
            assert a["history"][-1][key] is not None
        weights = [load_torch_file(s / "runs" / "K16" / method / "seed0" / "checkpoints" / "last.ckpt",
                                   "checkpoint")["state_dict"] for s in (studies["straight"], studies["resumed"])]
        _assert_identical(weights[0], weights[1], method)


def _assert_identical(a, b, where):
    """Tensors equal bit for bit, recursively through dicts and lists (a layer's extra state is a dict)."""
    if isinstance(a, torch.Tensor):
        assert isinstance(b, torch.Tensor) and a.dtype == b.dtype and torch.equal(a, b), where
    elif isinstance(a, dict):
        assert a.keys() == b.keys(), where
        for key in a:
            _assert_identical(a[key], b[key], f"{where}.{key}")
    elif isinstance(a, list | tuple):
        assert len(a) == len(b), where
        for i, (x, y) in enumerate(zip(a, b, strict=True)):
            _assert_identical(x, y, f"{where}[{i}]")
    else:
        assert a == b, where


def test_the_record_holds_the_test_figures_and_the_report_tables_them(studies):
    out = studies["resumed"] / "out"
    record = json.loads((out / "runs" / "K16_ddcl_seed0.json").read_text())
    test = record["test"]
    assert test["ppl_per_k"] == test["perplexity"] / 16
    # decoded hard codes scored in 8 bits: within rounding of the float per-image PSNR of the same decode
    assert abs(test["psnr_8bit"] - test["psnr_hard"]) < 0.2
    assert record["settings"]["epochs"] == 2 and record["settings"]["num_codes"] == 16
    text = (out / "report.md").read_text()
    for part in ("## K = 16", "8-bit per-image PSNR", "24.72", "23.32", "Steps to reach", "once, at the end",
                 "python -m eval.long_run", f"{test['psnr_hard']:.2f}"):
        assert part in text, part
    assert (out / "val_psnr_K16.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    header = reports.read_header(out / "report.md")  # the header every committed report has (eval.reports)
    assert header.command.startswith("python -m eval.long_run --no-train") and header.commits


def test_a_record_holds_no_absolute_path(studies):
    base = studies["resumed"]
    text = (base / "out" / "runs" / "K16_hard_ema_seed0.json").read_text()

    for value in json_strings(json.loads(text)):
        for token in value.split():
            assert not os.path.isabs(token.partition("=")[2] or token), value
    # the tmp directory appears only inside repository-relative paths ("../../tmp/..."), never as an absolute one
    assert re.search(rf"(?<!\.){re.escape(str(base))}", text) is None
    assert f"--runs {long_run.repo_relative(base / 'runs')} " in json.loads(text)["command"]


def test_a_finished_run_is_read_and_a_run_with_other_settings_is_refused(studies, tiny_cifar):
    base = studies["resumed"]
    result = base / "runs" / "K16" / "ddcl" / "seed0" / "result.json"
    stamp = result.stat().st_mtime_ns
    again = long_run.main(_argv(tiny_cifar, base))
    assert result.stat().st_mtime_ns == stamp and len(again["finished"]) == len(METHODS)
    with pytest.raises(ValueError, match=r"other settings[\s\S]*lr: run 0.0003 vs now 0.001"):
        long_run.main(_argv(tiny_cifar, base, "--lr", "1e-3"))
    assert result.stat().st_mtime_ns == stamp  # neither retrained nor mixed


def test_a_failing_git_commit_is_logged_and_the_record_still_written(studies, tmp_path, caplog):
    record = json.loads((studies["resumed"] / "out" / "runs" / "K16_ddcl_seed0.json").read_text())
    long_run.publish(long_run.Run(16, "ddcl", 0), record, tmp_path, commit=True)  # outside the repository: git fails
    assert json.loads((tmp_path / "runs" / "K16_ddcl_seed0.json").read_text()) == record
    assert "git commit of" in caplog.text and "failed" in caplog.text


def test_the_plan_is_filtered_and_an_off_plan_combination_needs_the_flag():
    runs = long_run.select_runs(num_codes=[4096])
    assert [r.name for r in runs] == ["K4096_ddcl_seed0", "K4096_ddcl_exact_seed0", "K4096_hard_ema_seed0",
                                      "K4096_vqp_vq_seed0", "K4096_ddcl_seed1", "K4096_ddcl_exact_seed1",
                                      "K4096_hard_ema_seed1"]
    assert [r.name for r in long_run.select_runs(methods=["vqp_fsq"])] == ["K512_vqp_fsq_seed0"]
    assert len(long_run.select_runs()) == sum(len(s) for per_k in long_run.PLAN.values() for s in per_k.values())
    with pytest.raises(ValueError, match="--off-plan"):
        long_run.select_runs(num_codes=[512], methods=["vqp_fsq"], seeds=[1])
    assert [r.name for r in long_run.select_runs([512], ["vqp_fsq"], [1], off_plan=True)] == ["K512_vqp_fsq_seed1"]


def test_steps_to_reach_is_the_first_epoch_end_at_or_above_the_threshold():
    steps = [352, 704, 1056, 1408, 1760]
    psnrs = [22.5, 24.0, 23.8, 24.6, None]  # not monotone; no validation in the last epoch
    assert steps_to_reach(steps, psnrs, 24.0) == 704  # reached exactly
    assert steps_to_reach(steps, psnrs, 23.9) == 704  # between two epochs' values
    assert steps_to_reach(steps, psnrs, 24.5) == 1408  # after a dip
    assert steps_to_reach(steps, psnrs, 22.0) == 352
    assert steps_to_reach(steps, psnrs, 25.0) is None  # never
    assert steps_to_reach([], [], 20.0) is None
    with pytest.raises(ValueError, match="same length"):
        steps_to_reach([1, 2], [20.0], 20.0)


def test_falls_are_the_drops_between_consecutive_epochs_and_the_table_sums_them_over_seeds():
    def run(seed, curve):
        return {"method": "m", "seed": seed, "label": "M",
                "history": [{"epoch": e + 1, "step": e + 1, "val_psnr_hard": v} for e, v in enumerate(curve)]}

    a = run(0, [23.0, 24.0, 23.7, 23.75, None, 23.0, 23.95, 23.9])  # falls 0.3, then none across the gap, then 0.05
    assert falls(a) == pytest.approx([0.3, 0.05])
    b = run(1, [22.0, 22.5, 23.0])  # rises at every epoch
    assert falls(b) == []
    # largest 0.30; each seed's largest 0.30 and 0 -> 0.15; one fall above 0.1 dB
    assert falls_table({"m": [a, b]})[2] == "| M | 2 | 0.30 | 0.15 | 1 |"


def test_a_candidate_setting_of_ddcl_is_margined_against_the_peers_and_is_never_the_best_peer():
    def run(method, seed, curve):
        return {"method": method, "seed": seed, "label": method,
                "history": [{"epoch": e + 1, "step": 352 * (e + 1), "val_psnr_hard": v} for e, v in enumerate(curve)]}

    methods = {"ddcl": [run("ddcl", 0, [24.0, 25.0])], "ddcl_wide": [run("ddcl_wide", 0, [24.2, 25.6])],
               "hard_ema": [run("hard_ema", 0, [23.5, 25.3])]}
    defaults, wide = epoch_margins(methods, "ddcl"), epoch_margins(methods, "ddcl_wide")
    # the candidate leads every method at epoch 2, yet the defaults' best peer is HardVQ: 25.0 - 25.3
    assert "| 2 | 25.00 (n=1) | hard_ema | 25.30 (n=1) | -0.30 |" in defaults[3]
    assert "| 1 | 24.20 (n=1) | hard_ema | 23.50 (n=1) | +0.70 |" in wide[2]
    assert "| 2 | 25.60 (n=1) | hard_ema | 25.30 (n=1) | +0.30 |" in wide[3]
    assert epoch_margins({k: methods[k] for k in ("ddcl", "ddcl_wide")}, "ddcl") == []  # no peer to margin against


def test_psnr_8bit_against_hand_computed_values():
    target = torch.full((2, 3, 32, 32), 100 / 255)
    reconstruction = target.clone()
    reconstruction[0, 1, 5, 7] = 110 / 255  # one value ten levels off in image 0; image 1 perfect
    values = psnr_8bit(reconstruction, target)
    n = 3 * 32 * 32
    assert values.shape == (2,)
    assert values[0].item() == pytest.approx(10 * math.log10(255**2 / (100 / n)), abs=1e-9)
    # a perfect image scores as one value one level off: finite, and above every imperfect image
    assert values[1].item() == pytest.approx(10 * math.log10(255**2 * n), abs=1e-9) == perfect_psnr_8bit(n)
    assert math.isfinite(values.mean().item()) and values[1] > values[0]
    # clamped to [0, 1], then rounded to levels: 1.3 is 255, and 100.4 / 255 is level 100
    above = torch.full((1, 1, 2, 2), 1.3)
    assert psnr_8bit(above, torch.ones(1, 1, 2, 2)).item() == pytest.approx(perfect_psnr_8bit(4))
    near = torch.full((1, 1, 2, 2), 100.4 / 255)
    assert psnr_8bit(near, torch.full((1, 1, 2, 2), 100 / 255)).item() == pytest.approx(perfect_psnr_8bit(4))
    # per image, then the mean: not the PSNR of the pooled MSE
    pooled = 10 * math.log10(255**2 / (100 / n / 2))
    assert values.mean().item() == pytest.approx((values[0].item() + perfect_psnr_8bit(n)) / 2)
    assert values.mean().item() != pytest.approx(pooled)
    with pytest.raises(ValueError, match="same shape"):
        psnr_8bit(torch.zeros(1, 3, 4, 4), torch.zeros(1, 3, 4, 5))


def test_a_run_killed_between_its_last_epoch_and_its_record_is_scored_from_its_last_checkpoint(studies, tiny_cifar):
    base = studies["straight"]
    before = json.loads((base / "out" / "runs" / "K16_hard_ema_seed0.json").read_text())
    (base / "runs" / "K16" / "hard_ema" / "seed0" / "result.json").unlink()
    (base / "out" / "runs" / "K16_hard_ema_seed0.json").unlink()
    again = {r["method"]: r for r in long_run.main(_argv(tiny_cifar, base))["finished"]}["hard_ema"]
    assert [i["from_epoch"] for i in again["invocations"]] == [0, 2]  # no epoch trained again
    assert again["test"] == before["test"] and again["history"] == before["history"]


def test_a_reports_fingerprints_are_rebuilt_from_its_records(tmp_path):
    """Each record carries the prints its run was trained with; a run trained again replaces its record and so its
    print, and a method whose record predates prints keeps the stored ones."""
    runs = tmp_path / "runs"
    runs.mkdir()
    for name, method, prints in (("K16_ddcl_seed0", "ddcl", ["aaa"]), ("K16_ddcl_seed1", "ddcl", ["bbb", "aaa"]),
                                 ("K16_hard_ema_seed0", "hard_ema", None), ("K16_vqp_vq_seed0", "vqp_vq", ["zzz"])):
        rec = {"method": method, **({"fingerprints": prints} if prints else {})}
        (runs / f"{name}.json").write_text(json.dumps(rec))
    stored = {"ddcl": ["old"], "hard_ema": ["h1"]}
    assert reports.report_fingerprints(runs, stored) == {"ddcl": ["aaa", "bbb"], "hard_ema": ["h1"]}
    (runs / "K16_ddcl_seed1.json").write_text(json.dumps({"method": "ddcl", "fingerprints": ["aaa"]}))  # retrained
    assert reports.report_fingerprints(runs, stored)["ddcl"] == ["aaa"]


def test_seconds_to_reach_interpolates_linearly_between_epochs():
    seconds = [100.0, 200.0, 300.0, 400.0]
    psnrs = [23.0, 24.0, 23.5, 25.5]  # falls back after epoch 2
    assert reach_interpolated(seconds, psnrs, 24.0) == 200.0  # exactly at an epoch
    assert reach_interpolated(seconds, psnrs, 23.5) == pytest.approx(150.0)  # between epochs 1 and 2
    assert reach_interpolated(seconds, psnrs, 25.0) == pytest.approx(375.0)  # from the dip: 23.5 -> 25.5
    assert reach_interpolated(seconds, psnrs, 26.0) is None  # never reached
    assert reach_interpolated(seconds, psnrs, 22.0) == 100.0  # reached at epoch 1: no extrapolation towards 0
    assert reach_interpolated([1, 2, 3], [23.0, None, float("nan")], 23.0) == 1.0
    assert reach_interpolated([1, 2, 3], [23.0, None, 25.0], 24.0) == pytest.approx(2.0)  # across the gap
    assert reach_interpolated([], [], 20.0) is None
    with pytest.raises(ValueError, match="same length"):
        reach_interpolated([1, 2], [20.0], 20.0)
    assert value_at(seconds, psnrs, 250.0) == pytest.approx(23.75)
    assert value_at(seconds, psnrs, 300.0) == pytest.approx(23.5)
    assert value_at(seconds, psnrs, 50.0) is None and value_at(seconds, psnrs, 401.0) is None


def _fake_record(method, seed, curve, steps_per_epoch=100):
    settings = {"epochs": len(curve), "train_subset": None, "val_size": 5000, "threads": 1, "batch_size": 128,
                "num_codes": 16, "code_dim": 8, "width": 32, "res_blocks": 1, "res_hidden": 8, "lr": 3e-4,
                "test_limit": 0, "data": "data"}
    test = {"psnr_hard": curve[-1], "ssim_hard": 0.8, "psnr_8bit": curve[-1], "utilization": 1.0, "ppl_per_k": 0.9}
    return {"method": method, "num_codes": 16, "seed": seed, "label": method, "settings": settings, "test": test,
            "history": [{"epoch": e + 1, "step": steps_per_epoch * (e + 1), "val_psnr_hard": v}
                        for e, v in enumerate(curve)],
            "code": "c0ffee0", "command": "python -m eval.long_run --fake", "invocations": []}


def test_the_report_renders_the_equal_compute_view_from_records_and_step_times(tmp_path):
    out = tmp_path / "out"
    (out / "runs").mkdir(parents=True)
    for rec in (_fake_record("ddcl", 0, [23.5, 24.5, 25.5]), _fake_record("ddcl", 1, [23.7, 24.7, 25.7]),
                _fake_record("hard_ema", 0, [23.0, 24.0, 26.0]), _fake_record("vqp_vq", 0, [22.0, 23.0, 23.5])):
        (out / "runs" / f"K16_{rec['method']}_seed{rec['seed']}.json").write_text(json.dumps(rec))
    write_report(out, tmp_path / "runs")
    assert "Equal compute" not in (out / "report.md").read_text()  # no step times, no view
    step_times = {"code": "abc1234+", "dirty": ["softvq/x.py"], "date": "2026-01-02T03:04:05+00:00", "cpu": "CPU X",
                  "cores": 2, "threads": 1, "torch": "2.x", "command": "python -m eval.long_run.step_times",
                  "note": "the other job paused", "load_before": [1.0, 1.0, 1.0], "batch_size": 128, "rounds": 3,
                  "steps": 5, "warmup": 2,
                  "times": {"16": {"ddcl": {"median_ms": 2000.0, "images_per_s": 64.0},
                                   "hard_ema": {"median_ms": 1000.0, "images_per_s": 128.0}}},
                  "not_timed": {"16": {"vqp_vq": "vector-quantize-pytorch is not installed here"}}}
    (out / "step_times.json").write_text(json.dumps(step_times))
    write_report(out, tmp_path / "runs")
    text = (out / "report.md").read_text()
    assert "step times measured at abc1234+ on 2026-01-02" in text.split("## K = 16")[0]  # the header names it
    view = text.split("## Equal compute")[1]
    assert "abc1234+ (uncommitted changes in softvq/x.py)" in view and "CPU X" in view and "paused" in view
    # DDCL: the mean of its seeds, 23.6 / 24.6 / 25.6 dB at 200 / 400 / 600 s; HardVQ 23 / 24 / 26 dB at 100 / 200 / 300
    assert "| ddcl | 2 | 2000.0 | 64 | 0.50x | 280 s (1.40) | 480 s (2.40) | not reached |" in view
    assert "| hard_ema | 1 | 1000.0 | 128 | 1.00x | 200 s (2.00) | 250 s (2.50) | 300 s (3.00) |" in view
    assert "| vqp_vq | 1 | not timed (vector-quantize-pytorch is not installed here) |" in view
    assert "24 dB: hard_ema (200 s; next ddcl, 1.40x its seconds)" in view
    assert "26 dB: hard_ema (300 s; no other)" in view
    # at HardVQ's whole budget (300 s) DDCL's mean curve is halfway from 23.6 to 24.6 dB
    assert ("DDCL's mean curve is at 24.10 dB, the hard VQ's at 26.00 dB: **the hard VQ ahead at equal compute by "
            "1.90 dB** (within the seed spread (fewer than 3 seeds (1 and 1)))") in view
    assert "K = 16: against hard_ema the hard VQ ahead by 1.90 dB at 300 s, within the seed spread" in view
    assert (out / "val_psnr_seconds_K16.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_the_step_timer_times_the_records_models_with_the_training_benchmarks_harness(tmp_path, one_thread):
    from eval.long_run import step_times

    out = tmp_path / "out"
    (out / "runs").mkdir(parents=True)
    for rec in (_fake_record("ddcl", 0, [23.0]), _fake_record("ddcl", 1, [23.0]), _fake_record("hard_ema", 0, [23.0])):
        rec["settings"]["batch_size"] = 16
        (out / "runs" / f"K16_{rec['method']}_seed{rec['seed']}.json").write_text(json.dumps(rec))
    assert step_times.selection(step_times.load_records(out), methods=["ddcl"]) == {16: {"ddcl": rec["settings"]}}
    result = step_times.main(["--out", str(out), "--steps", "2", "--warmup", "0", "--rounds", "1"])
    assert json.loads((out / "step_times.json").read_text()) == result
    assert sorted(result["times"]["16"]) == ["ddcl", "hard_ema"] and result["batch_size"] == 16
    for entry in result["times"]["16"].values():
        assert len(entry["steps_ms"]) == 2 and entry["median_ms"] > 0
        assert entry["images_per_s"] == pytest.approx(16 / entry["median_ms"] * 1e3, rel=1e-2)
    assert result["threads"] == 1 and result["code"] and result["torch"] == torch.__version__
