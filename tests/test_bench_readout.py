"""eval.bench_readout: a row per sequence length and its check of linear growth."""

from __future__ import annotations

from eval import bench_readout


def test_readout_benchmark_prints_a_row_per_length_and_checks_linear_growth(tmp_path, capsys):
    out = tmp_path / "bench.md"
    code = bench_readout.main(["--lengths", "16", "32", "--batch-size", "1", "--dim", "8", "--codes", "4",
                               "--heads", "2", "--reps", "1", "--warmup", "0", "--out", str(out)])
    printed = capsys.readouterr().out
    table = [line for line in printed.splitlines() if line.startswith("| ")]
    assert code == 0 and len(table) == 3 and "not measured" in printed
    regenerate, commit, body = out.read_text().split("\n\n", 2)  # the file: its provenance, then what was printed
    assert regenerate == "Regenerate: `python -m eval.bench_readout --lengths 16 32 --batch-size 1 --dim 8 --codes 4 " \
                         f"--heads 2 --reps 1 --warmup 0 --out {out}`"
    assert commit.startswith("Code: ") and body.strip() in printed
    rows = [{"T": 512, "ms": {"ddcl": 1.0, "attn": 1.0}}, {"T": 4096, "ms": {"ddcl": 8.5, "attn": 60.0}}]
    text, passed = bench_readout.growth_check(rows, ["ddcl", "attn"])
    assert passed and "ddcl: 8.50 PASS" in text and "attn: 60.00" in text
    rows[1]["ms"]["ddcl"] = 9.5
    assert not bench_readout.growth_check(rows, ["ddcl", "attn"])[1]
