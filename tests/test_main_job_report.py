"""eval.main_job: the README's main job as a report, and the README block drawn from it (eval.render)."""

from __future__ import annotations

import pytest

from eval import main_job, render

TABLE = """| epoch | ddcl util % | ddcl val PSNR (hard) | hard util % | hard val PSNR (hard) |
|---|---|---|---|---|
| 1 | 100.0 | 19.50 (19.50) | 61.0 | 18.70 (18.70) |
| 2 | 100.0 | 21.40 (21.40) | 75.0 | 20.80 (20.80) |"""


def test_the_report_and_the_readme_block_carry_the_commands_table_plot_and_time(tmp_path):
    run = tmp_path / "runs" / "cifar10"
    run.mkdir(parents=True)
    (run / "comparison.md").write_text("Per-epoch codebook health ...\n\n" + TABLE + "\n")
    (run / "comparison.png").write_bytes(b"\x89PNG\r\n\x1a\nfake")
    out = tmp_path / "reports" / "main_job"
    text = main_job.write_report(run, 262.4, 2, out, commit="abc1234")
    assert "Code: abc1234" in text and "4 min 22 s for the whole command" in text and "2 torch threads" in text
    assert TABLE in text and (out / "comparison.png").read_bytes() == (run / "comparison.png").read_bytes()
    readme = tmp_path / "README.md"
    readme.write_text("<!-- render: main_job reports/main_job -->\n<!-- /render -->\n")
    assert render.main([], root=tmp_path) == 0
    block = readme.read_text()
    assert TABLE in block  # the command's own table, row for row
    assert "![per-epoch curves of both runs](reports/main_job/comparison.png)" in block
    assert "Source: [reports/main_job](reports/main_job/report.md) (code abc1234;" in block
    assert "4 min 22 s for the whole command" in block
    readme.write_text(block.replace("21.40 (21.40)", "21.50 (21.50)"))  # a number typed by hand
    assert render.main(["--check"], root=tmp_path) == 1


def test_a_run_without_its_comparison_or_a_bad_time_is_refused(tmp_path):
    with pytest.raises(FileNotFoundError, match="comparison.md, comparison.png"):
        main_job.write_report(tmp_path, 10.0, 1, tmp_path / "out")
    (tmp_path / "comparison.md").write_text("no table here\n")
    (tmp_path / "comparison.png").write_bytes(b"")
    with pytest.raises(ValueError, match="seconds must be positive.*-1"):
        main_job.write_report(tmp_path, -1.0, 1, tmp_path / "out")
    with pytest.raises(ValueError, match="no table"):
        main_job.write_report(tmp_path, 10.0, 1, tmp_path / "out")
