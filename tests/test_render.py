"""README.md and docs/ numbers rendered from results files (eval.render): the committed blocks equal what their
sources give, and a block that drifts from its source is found."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from eval import harness, render


def test_every_committed_block_is_what_its_source_gives():
    assert render.differing() == []
    assert any(render.BLOCK.search(p.read_text()) for p in render.markdown_files())  # the README has blocks


def _toy(root: Path, psnr: tuple[float, float]) -> Path:
    study = root / "reports" / "toy"
    study.mkdir(parents=True)
    (study / "report.md").write_text("# toy\n\nRegenerate: `python -m eval.peers --toy`\n\nCode: abc1234\n")
    settings = {"num_codes": 8, "epochs": 2, "train_subset": 100, "seeds": [0, 1]}
    runs = [{"method": "ddcl", "seed": s, "test": {"psnr_hard": p, "ssim_hard": 0.5, "utilization": 1.0,
                                                   "dead_codes": 0, "perplexity": 7.0}} for s, p in enumerate(psnr)]
    (study / "results.json").write_text(json.dumps({"settings": settings, "runs": runs}))
    readme = root / "README.md"
    readme.write_text("intro\n<!-- render: peers_test reports/toy/results.json -->\nold\n<!-- /render -->\nend\n")
    return readme


def test_a_block_is_filled_from_its_source_and_a_drifted_one_is_named(tmp_path):
    readme = _toy(tmp_path, (20.0, 21.0))
    assert render.differing(tmp_path) == ["README.md: peers_test reports/toy/results.json"]
    assert render.main([], root=tmp_path) == 0
    text = readme.read_text()
    assert "| softvq DDCL, defaults | 2 | 20.50 ± 0.71 |" in text  # mean and sample std of 20 and 21, by hand
    assert "(code abc1234; K = 8, 2 epochs on 100 training images, seeds 0, 1; test split)" in text
    assert text.startswith("intro\n") and text.endswith("<!-- /render -->\nend\n")
    assert render.main(["--check"], root=tmp_path) == 0
    readme.write_text(text.replace("20.50", "20.60"))  # a number typed by hand
    assert render.main(["--check"], root=tmp_path) == 1


def test_former_defaults_marks_the_ddcl_rows_and_nothing_else(tmp_path):
    readme = _toy(tmp_path, (20.0, 21.0))
    readme.write_text(readme.read_text().replace("results.json -->", "results.json former-defaults -->"))
    assert render.main([], root=tmp_path) == 0
    text = readme.read_text()
    assert "| softvq DDCL, defaults at the time (target entropy 2.5 nats) | 2 | 20.50 ± 0.71 |" in text
    assert "Source: [reports/toy/results.json]" in text  # the flag is no source
    assert render.labels_of({"hard_ema": "HardVQ"}, ["former-defaults"]) == {"hard_ema": "HardVQ"}


@pytest.mark.parametrize("spec,match", [("nope reports/toy/results.json", "needs one of"),
                                        ("peers_test", "needs one of"),
                                        ("peers_test reports/missing.json", "not an existing path"),
                                        ("peers_test ../outside.json", "not an existing path inside")])
def test_bad_blocks_name_the_problem(tmp_path, spec, match):
    _toy(tmp_path, (20.0, 21.0))
    (tmp_path.parent / "outside.json").write_text("{}")
    with pytest.raises(ValueError, match=match):
        render.render_block(spec, tmp_path)


def test_unedited_leaves_a_page_with_uncommitted_changes_alone(tmp_path):
    """``--unedited`` (what a study that commits its records runs) re-renders committed pages only."""
    import subprocess

    readme = _toy(tmp_path, (20.0, 21.0))
    other = tmp_path / "docs" / "page.md"
    other.parent.mkdir()
    other.write_text(readme.read_text())
    git = ["git", "-c", "user.name=t", "-c", "user.email=t@t", "-C", str(tmp_path)]
    subprocess.run([*git, "init", "-q"], check=True)
    subprocess.run([*git, "add", "-A"], check=True)
    subprocess.run([*git, "commit", "-qm", "toy"], check=True)
    other.write_text(other.read_text() + "being edited\n")
    assert render.main(["--unedited"], root=tmp_path) == 0
    assert "20.50 ± 0.71" in readme.read_text()
    assert "20.50" not in other.read_text() and "\nold\n" in other.read_text()


def test_vqp_threshold_2_names_vector_quantize_pytorchs_former_recipe_and_nothing_else():
    labels = {"vqp_vq": harness.LABELS["vqp_vq"], "hard_ema": "HardVQ", "ddcl": "DDCL"}
    assert "ratio 0.1" in labels["vqp_vq"]  # today's recipe (eval._hard.VQP_RECIPE)
    former = render.labels_of(labels, ["vqp-threshold-2"])
    assert former == {**labels, "vqp_vq": "vqp VectorQuantize (kmeans init, dead < 2, rotation trick)"}
    both = render.labels_of(labels, ["former-defaults", "vqp-threshold-2"])
    assert both["ddcl"] == "DDCL" + render.FORMER_DEFAULTS and both["vqp_vq"] == former["vqp_vq"]
    assert render.labels_of({"ddcl": "DDCL"}, ["vqp-threshold-2"]) == {"ddcl": "DDCL"}  # no vqp row: none added
