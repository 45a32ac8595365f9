"""eval.hierarchy end to end on a tiny data set: 2-level runs beside 1-level references, the per-level claim check,
reading the head-to-head's existing runs (also ones trained before --model.levels existed), missing references."""

from __future__ import annotations

import json
import shutil

import matplotlib.image
import pytest
from helpers import train_in_process

from eval import compare, hierarchy
from eval.hierarchy import report

TINY_MODEL = ("--model.width 8 --model.res_hidden 4 --model.res_blocks 1 --model.num_codes 8 --model.code_dim 4 "
              "--data.batch_size 16")


def tiny_args(tiny_cifar, tmp_path, *extra: str) -> list[str]:
    return ["--quick", "--data-root", str(tiny_cifar["folder"]), "--seeds", "0", "--epochs", "2",
            "--train-subset", "64", "--val-size", "32", "--test-limit", "20", "--train-args", TINY_MODEL,
            "--references", "ddcl", "hard", "--runs", str(tmp_path / "runs"), "--out", str(tmp_path / "report"),
            "--num-workers", "0", *extra]


@pytest.fixture(scope="module")
def quick(tmp_path_factory, tiny_cifar):
    tmp = tmp_path_factory.mktemp("hierarchy")
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(compare, "train", train_in_process)
        return tmp, hierarchy.main(tiny_args(tiny_cifar, tmp, "--jobs", "1"))


def test_quick_report_compares_one_and_two_levels_and_checks_every_level(quick):
    tmp, results = quick
    out = tmp / "report"
    for name in report.PLOTS:
        pixels = matplotlib.image.imread(out / name)
        assert pixels.shape[0] > 200 and pixels.std() > 0.05, name  # drawn, not blank
    text = (out / "report.md").read_text()
    assert "**Confirmed.**" in text and "python -m eval.hierarchy --quick" in text
    for heading in ("hierarchical claim", "Test split, last epoch", "Per-level decomposition per epoch",
                    "2-level DDCL, level 1"):
        assert heading in text
    runs = results["runs"]
    assert sorted((r["key"], r["seed"]) for r in runs) == sorted(
        (k, 0) for k in ("ddcl", "hard", "ddcl_2level"))
    two = [r for r in runs if r["key"] == "ddcl_2level"]
    for run in two:
        assert run["test"]["levels"] == 2 and {"utilization_l1", "perplexity_l1", "dead_codes_l0"} <= set(run["test"])
        assert [row["epoch"] for row in run["history"]] == [1, 2]
        assert all(row["v_min_l1"] >= 0 and row["identity_residual_l1"] < 1e-5 for row in run["history"])
    # One check per DDCL run and level: the single level of 1-level DDCL, both levels of the 2-level model.
    checks = results["claim"]
    assert sorted((c["key"], c["seed"], c["level"]) for c in checks) == [
        ("ddcl", 0, 0), ("ddcl_2level", 0, 0), ("ddcl_2level", 0, 1)]
    assert all(c["holds"] and c["epochs"] == 2 for c in checks)
    smallest = min(row["v_min_l0"] for row in two[0]["history"])
    assert next(c for c in checks if c["key"] == "ddcl_2level" and c["seed"] == 0 and c["level"] == 0)["v_min"] \
        == pytest.approx(smallest)


def test_the_claim_check_refutes_a_negative_v_or_a_broken_identity():
    rows = [{"epoch": 1, "v_min_l0": 0.5, "identity_residual_l0": 1e-7, "v_min_l1": -1e-3,
             "identity_residual_l1": 1e-7}, {"epoch": 2, "v_min_l0": 0.4, "identity_residual_l0": 1e-3,
                                             "v_min_l1": 0.2, "identity_residual_l1": 1e-7}]
    run = {"key": "ddcl_2level", "seed": 0, "label": "2", "history": rows, "test": {"levels": 2}}
    checks = hierarchy.claim_check([run], tolerance=1e-5)
    assert [(c["level"], c["holds"], c["v_min"], c["max_residual"]) for c in checks] == [
        (0, False, 0.4, 1e-3), (1, False, -1e-3, 1e-7)]
    assert "**Refuted**" in report.claim_lines(checks, {"ddcl_2level": "2 levels"}, 1e-5)[0]


def test_existing_runs_are_read_and_missing_references_are_left_out(quick, tiny_cifar):
    tmp, results = quick
    runs = tmp / "runs-old"
    shutil.copytree(tmp / "runs", runs)
    for config in (runs / "ddcl").rglob("config.json"):  # trained before --model.levels existed: no such keys
        saved = json.loads(config.read_text())
        saved["model"] = {k: v for k, v in saved["model"].items() if not k.startswith("level")}
        config.write_text(json.dumps(saved))
    shutil.rmtree(runs / "hard" / "seed0")
    stamp = {p: p.stat().st_mtime_ns for p in runs.rglob("last.ckpt")}
    again = hierarchy.main(tiny_args(tiny_cifar, tmp, "--runs", str(runs), "--out", str(tmp / "again"),
                                     "--no-train", "--no-train-references"))
    assert {p: p.stat().st_mtime_ns for p in runs.rglob("last.ckpt")} == stamp
    assert not (runs / "hard" / "seed0").exists()
    assert {r["key"] for r in again["runs"]} == {"ddcl", "ddcl_2level"}
    assert "hard/seed0`" in (tmp / "again" / "report.md").read_text()
    assert not list((runs / "ddcl").rglob("test_metrics.json"))  # nothing written into reference runs


def test_plan_trains_two_level_runs_beside_the_reference_seeds():
    new, refs = hierarchy.plan([0], ["ddcl", "hard"], reference_seeds=[0, 1, 2])
    assert [(s.key, s.seed) for s in new] == [("ddcl_2level", 0)] and "--model.levels" in new[0].flags
    assert [(s.key, s.seed) for s in refs] == [(k, s) for k in ("ddcl", "hard") for s in (0, 1, 2)]


@pytest.mark.parametrize("argv, match", [
    (["--epochs", "0"], "--epochs: must be >= 1"),
    (["--seeds", "1", "1"], "repeated seeds"),
    (["--reference-seeds", "0", "0"], "--reference-seeds: repeated seeds"),
    (["--references", "ddcl_eps0.1"], "invalid choice"),
    (["--identity-tolerance", "0"], "--identity-tolerance: must be > 0"),
])
def test_bad_arguments_are_refused(argv, match, capsys):
    with pytest.raises(SystemExit):
        hierarchy.parse_args(argv)
    assert match in capsys.readouterr().err
