"""The README's main job (examples/quickstart.py) and the benchmark script keep working."""

from __future__ import annotations

import importlib.util
import json
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def load(path: Path):
    spec = importlib.util.spec_from_file_location(path.stem, path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_quickstart_trains_the_three_quantizers_and_reports_the_identity(capsys):
    quickstart = load(ROOT / "examples" / "quickstart.py")
    quickstart.main(["--steps", "60", "--log-every", "30", "--codes", "32", "--batch-size", "64"])
    lines = capsys.readouterr().out.splitlines()
    ddcl = [line for line in lines if re.match(r"\s+\d+\s+ddcl ", line)]
    hard = [line for line in lines if re.match(r"\s+\d+\s+hard(_ema)? ", line)]
    assert len(ddcl) == 2 and len(hard) == 4
    for line in ddcl:
        residual = float(re.search(r"residual ([0-9.e+-]+)\)", line).group(1))
        assert residual < 1e-5
    plain = [line for line in hard if " hard " in line]
    assert len(plain) == 2
    for line in plain:  # plain hard VQ's decoded output is its training output (an EMA codebook moves after it)
        mse, mse_hard = (float(v) for v in line.split()[2:4])
        assert mse == pytest.approx(mse_hard, rel=1e-4)


def test_quickstart_rejects_bad_flags():
    quickstart = load(ROOT / "examples" / "quickstart.py")
    with pytest.raises(SystemExit):
        quickstart.main(["--steps", "0"])
    with pytest.raises(SystemExit):
        quickstart.main(["--no-such-flag"])


def test_benchmark_prints_a_row_per_codebook_size(tmp_path, capsys):
    bench_codebook = load(ROOT / "eval" / "bench_codebook.py")
    out = tmp_path / "bench.json"
    bench_codebook.main(["--tokens", "256", "--dim", "8", "--codes", "16", "32", "--reps", "2", "--warmup", "1",
                         "--methods", "ddcl", "hard", "--json", str(out)])
    tables = capsys.readouterr().out.split("\n\n")
    times = [line for line in tables[0].splitlines() if line.startswith("| ")]
    assert len(times) == 3 and "1 mm ms" in times[0]  # header + one row per K, with the matmul floor beside
    assert "ddcl / its matmuls" in tables[1] and "ddcl/hard" in tables[2]
    result = json.loads(out.read_text())
    assert [row["K"] for row in result["rows"]] == [16, 32]
    assert all(row["ms"][m] > 0 for row in result["rows"] for m in ("ddcl", "hard", "mm", "pass"))


def test_training_benchmark_times_both_models_side_by_side(tmp_path, capsys):
    bench_train = load(ROOT / "eval" / "bench_train.py")
    out = tmp_path / "train.json"
    bench_train.main(["--steps", "2", "--warmup", "1", "--rounds", "2", "--json", str(out), "--flags",
                      "--model.num_codes", "16", "--model.code_dim", "8", "--model.width", "16",
                      "--model.res_hidden", "8", "--model.res_blocks", "1", "--data.batch_size", "8"])
    rows = [line for line in capsys.readouterr().out.splitlines() if line.startswith("| ")]
    assert [r.split(" | ")[0] for r in rows[1:]] == ["| ddcl", "| hard"] and rows[2].endswith("1.000x |")
    result = json.loads(out.read_text())
    assert result["batch_size"] == 8
    assert all(len(result["step_seconds"][m]) == 4 for m in ("ddcl", "hard"))  # 2 rounds x 2 timed steps


def test_sampling_benchmark_times_cached_and_uncached_decoding(capsys):
    bench_sampling = load(ROOT / "eval" / "bench_sampling.py")
    result = bench_sampling.main(["--num-codes", "16", "--layers", "1", "--dim", "32", "--n", "4", "--reps", "1",
                                  "--guidance", "2"])
    out = capsys.readouterr().out
    assert "| cached |" in out and "| uncached |" in out and "speed-up" in out
    assert result["cached"] > 0 and result["speedup"] == result["uncached"] / result["cached"]


def test_benchmark_times_residual_stacks_beside_single_layers(capsys):
    bench_codebook = load(ROOT / "eval" / "bench_codebook.py")
    bench_codebook.main(["--tokens", "256", "--dim", "8", "--codes", "16", "--reps", "1", "--warmup", "1",
                         "--methods", "ddcl", "rddcl", "rhard", "--no-memory"])
    out = capsys.readouterr().out
    assert "rddcl/rhard" in out and "rddcl/ddcl" in out and "ResidualDDCL(4 levels" in out
