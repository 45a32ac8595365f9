"""eval.compare end to end on a tiny data set (report, plots, reuse of finished runs, errors) and its statistics."""

from __future__ import annotations

import json
import shutil

import matplotlib.image
import numpy as np
import pytest
from helpers import train_in_process

from eval import compare
from eval.compare import report

TINY_MODEL = ("--model.width 8 --model.res_hidden 4 --model.res_blocks 1 --model.num_codes 8 --model.code_dim 4 "
              "--data.batch_size 16")


def tiny_args(tiny_cifar, tmp_path, *extra: str) -> list[str]:
    return ["--quick", "--data-root", str(tiny_cifar["folder"]), "--seeds", "0", "1", "--epochs", "2",
            "--train-subset", "64", "--val-size", "32", "--test-limit", "20", "--train-args", TINY_MODEL,
            "--runs", str(tmp_path / "runs"), "--out", str(tmp_path / "report"), "--num-workers", "0", *extra]


@pytest.fixture(scope="module", autouse=True)
def one_row_per_study():
    """In this module each study has one row beside its reference (eps 1.0, fixed T): every run costs a process."""
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(compare, "EPS", tuple(r for r in compare.EPS if r[0] != "ddcl_eps0.1"))
        mp.setattr(compare, "TEMPERATURE", compare.TEMPERATURE[:1])
        yield


@pytest.fixture(scope="module")
def quick(tmp_path_factory, tiny_cifar):
    tmp = tmp_path_factory.mktemp("compare")
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(compare, "train", train_in_process)
        results = compare.main(tiny_args(tiny_cifar, tmp, "--jobs", "1"))
    return tmp, results


def test_quick_comparison_writes_the_report_and_every_plot(quick):
    tmp, results = quick
    out = tmp / "report"
    for name in report.PLOTS:
        png = out / name
        assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and png.stat().st_size > 5000, name
        pixels = matplotlib.image.imread(png)
        assert pixels.ndim == 3 and pixels.shape[0] > 200 and pixels.std() > 0.05, name  # drawn, not blank
    text = (out / "report.md").read_text()
    for name in report.PLOTS:
        assert f"]({name})" in text
    for heading in ("Against the paper's claims", "Test split, last epoch", "eps ablation", "Temperature"):
        assert heading in text
    assert "python -m eval.compare --quick" in text
    # 3 methods x 2 seeds + the plain layer, eps 1.0 and fixed T on seed 0.
    runs = results["runs"]
    assert sorted((r["key"], r["seed"]) for r in runs) == sorted(
        [(k, s) for k in ("ddcl", "hard", "hard_ema") for s in (0, 1)]
        + [(k, 0) for k in ("ddcl_plain", "ddcl_eps1.0", "ddcl_fixedT")])
    for run in runs:
        assert [row["epoch"] for row in run["history"]] == [1, 2] and run["num_codes"] == 8
        if run["group"] in compare.ABLATIONS:  # an ablation never reads the test split
            assert run["test"] is None and not (tmp / "runs" / run["key"] / "seed0" / "test_metrics.json").exists()
            continue
        assert run["test"]["images"] == 20 and run["test"]["epochs"] == 2 and run["test"]["num_codes"] == 8
        assert set(compare.evaluate.METRICS) <= set(run["test"])
    # the ablations' tables are the last epoch's validation figures
    text = (out / "report.md").read_text()
    row = next(line for line in text.splitlines() if line.startswith(f"| {eps1_label(runs)} | 1 |"))
    last = next(r for r in runs if r["key"] == "ddcl_eps1.0")["history"][-1]
    assert [c.strip() for c in row.strip("|").split("|")][5] == f"{last['val_psnr_hard']:.2f}"
    eps1 = next(r for r in runs if r["key"] == "ddcl_eps1.0")
    config = json.loads((tmp / "runs" / "ddcl_eps1.0" / "seed0" / "config.json").read_text())
    assert config["model"]["eps"] == 1.0 and config["seed"] == 0 and config["model"]["width"] == 8
    assert eps1["flags"][-2:] == ["--model.eps", "1.0"]
    assert json.loads((out / "results.json").read_text())["settings"]["seeds"] == [0, 1]


def eps1_label(runs: list[dict]) -> str:
    return next(r["label"] for r in runs if r["key"] == "ddcl_eps1.0")


def test_the_report_table_is_the_mean_and_std_of_the_runs(quick):
    tmp, results = quick
    ddcl = [r for r in results["runs"] if r["key"] == "ddcl"]
    psnr = np.array([r["test"]["psnr_hard"] for r in ddcl])
    row = next(line for line in (tmp / "report" / "report.md").read_text().splitlines()
               if line.startswith("| DDCL | 2 |"))
    cells = [c.strip() for c in row.strip("|").split("|")]
    assert cells[5] == f"{psnr.mean():.2f} ± {psnr.std(ddof=1):.2f}"  # PSNR hard


def test_finished_runs_are_read_not_retrained_and_other_settings_are_refused(quick, tiny_cifar):
    tmp, results = quick
    stamp = {p: p.stat().st_mtime_ns for p in (tmp / "runs").rglob("last.ckpt")}
    again = compare.main(tiny_args(tiny_cifar, tmp, "--no-train", "--out", str(tmp / "report2")))
    assert {p: p.stat().st_mtime_ns for p in (tmp / "runs").rglob("last.ckpt")} == stamp
    assert [(r["test"] or {}).get("psnr") for r in again["runs"]] == \
        [(r["test"] or {}).get("psnr") for r in results["runs"]]
    other = r"seed0 holds a run with other settings \(.*model\.num_codes: 8 there, 16 here"
    with pytest.raises(ValueError, match=other):
        compare.main(tiny_args(tiny_cifar, tmp, "--train-args", TINY_MODEL.replace("codes 8", "codes 16"),
                               "--no-train"))
    config = tmp / "runs" / "hard" / "seed0" / "config.json"  # a run from before a flag existed still matches
    saved = json.loads(config.read_text())
    older = {**saved, "model": {k: v for k, v in saved["model"].items() if k != "target_entropy"}}
    config.write_text(json.dumps(older))
    assert compare.run_state(compare.plan([0], [0])[1], compare.parse_args(tiny_args(tiny_cifar, tmp))) == "done"
    config.write_text(json.dumps(saved))
    with pytest.raises(ValueError, match="more than --epochs 1"):
        compare.main(tiny_args(tiny_cifar, tmp, "--epochs", "1", "--no-train"))
    missing = tmp / "runs-partial"
    shutil.copytree(tmp / "runs", missing)
    shutil.rmtree(missing / "hard" / "seed1")
    with pytest.raises(FileNotFoundError, match=r"--no-train.*hard/seed1"):
        compare.main(tiny_args(tiny_cifar, tmp, "--no-train", "--runs", str(missing)))


def test_the_head_to_head_alone_without_studies(quick, tiny_cifar):
    tmp, _ = quick
    alone = compare.main(tiny_args(tiny_cifar, tmp, "--no-train", "--studies", "--out", str(tmp / "alone")))
    assert {r["key"] for r in alone["runs"]} == {"ddcl", "hard", "hard_ema"}
    assert sorted(p.name for p in (tmp / "alone").glob("*.png")) == sorted(report.PLOTS[:3])
    assert "eps ablation" not in (tmp / "alone" / "report.md").read_text()


def test_a_failing_run_names_its_log(tiny_cifar, tmp_path, monkeypatch):
    monkeypatch.setattr(compare, "METHODS", compare.METHODS[:1])  # one run shows it; each costs an interpreter start
    with pytest.raises(RuntimeError, match=r"training .*seed0 failed.*train\.log"):
        compare.main(tiny_args(tiny_cifar, tmp_path, "--seeds", "0", "--studies", "--train-args",
                               TINY_MODEL + " --data.data_root " + str(tmp_path / "no-data")))


@pytest.mark.parametrize("argv, match", [
    (["--epochs", "0"], "--epochs: must be >= 1"),
    (["--jobs", "0"], "--jobs: must be >= 1"),
    (["--val-size", "0"], "needs a validation set"),
    (["--seeds", "1", "1"], "repeated seeds"),
    (["--test-limit", "0"], "--test-limit"),
    (["--train-args", "--model.num_codes -3"], "train_vqvae.py rejects '--model.num_codes -3': num_codes must be a "
                                               "positive integer, got -3"),
    (["--train-args", "--model.num_codes x"], "train_vqvae.py rejects '--model.num_codes x'"),
    (["--train-args", "--hard.commitment_weight -1"], "commitment_weight must be a non-negative finite number, got -1"),
])
def test_bad_arguments_are_refused(argv, match, capsys):
    with pytest.raises(SystemExit):
        compare.parse_args(argv)
    assert match in capsys.readouterr().err


def test_mean_std_series_and_collapse_rule_by_hand():
    values = np.array([[1.0, 2.0, np.nan], [3.0, 6.0, 4.0]])
    mean, std = report.mean_std(values)
    np.testing.assert_allclose(mean, [2.0, 4.0, 4.0])
    np.testing.assert_allclose(std, [np.sqrt(2.0), np.sqrt(8.0), 0.0])  # a single value has no spread
    run = {"history": [{"epoch": 1, "psnr": 10.0}, {"epoch": 3, "psnr": 12.0}], "num_codes": 100}
    np.testing.assert_array_equal(report.series([run], "psnr", 3), [[10.0, np.nan, 12.0]])
    healthy = {**run, "history": [{"epoch": 1, "utilization": 0.9, "perplexity": 40.0}]}
    few_codes = {**run, "history": [{"epoch": 1, "utilization": 0.4, "perplexity": 40.0}]}
    peaked = {**run, "history": [{"epoch": 1, "utilization": 1.0, "perplexity": 9.0}]}
    assert not report.collapsed(healthy) and report.collapsed(few_codes) and report.collapsed(peaked)
