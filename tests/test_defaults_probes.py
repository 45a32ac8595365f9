"""eval.defaults_probes: validation lines only, one change per row against the defaults, and the verdict from them."""

from __future__ import annotations

import json

from eval import defaults_probes as dp


def _line(name: str, psnr: float, split: str = "validation") -> str:
    return json.dumps({"name": name, "epochs": dp.EPOCHS, "seed": 0, "split": split, "val_psnr_hard": psnr,
                       "val_util": 1.0, "val_ppl": 400.0})


def test_render_reads_validation_lines_and_judges_against_the_defaults(tmp_path):
    path = tmp_path / "probes.jsonl"
    path.write_text("\n".join([
        json.dumps({"name": "default", "epochs": 2, "test_psnr_hard": 99.0}),  # an old test-split line: ignored
        _line("default", 21.0), _line("soft_ema", 20.5), _line("entropy_1", 21.3), _line("hard_ema", 20.9)]) + "\n")
    results = dp.read_results(path)
    assert set(results) == {"default", "soft_ema", "entropy_1", "hard_ema"}
    assert results["default"]["val_psnr_hard"] == 21
    text = dp.render(results, ["--out", "x"], "DATA", tmp_path / "missing.json")
    assert "| … prototypes by the soft (free-energy) EMA | `--name soft_ema --quantizer ddcl --epochs 2 --seed 0 " \
           "--kwargs '{\"prototype_update\": \"soft_ema\"}'` | 20.50 | -0.50 | 100.0 | 400 |" in text
    assert "`entropy_1` beats the defaults by +0.30 dB on validation" in text and "not yet a default" in text
    assert "| … target entropy 4.0 nats |" in text and "not run" in text  # a probe without a line
    assert "99.00" not in text  # the old test-split line is not in the table
    results["entropy_1"]["val_psnr_hard"] = 20.0
    assert "No one-option change of the defaults beats them on validation" in dp.render(results, [], "D", tmp_path)


def test_every_ddcl_probe_differs_from_the_defaults_in_one_option():
    defaults = [spec for spec in dp.PROBES if spec[0] == "default"]
    assert defaults and defaults[0][3] == {} and defaults[0][4] == {}
    for name, _, quantizer, kwargs, model_kwargs in dp.PROBES:
        if quantizer == "ddcl" and name not in ("default", "plain"):
            options = {k for k in kwargs if k != "commitment_term"}  # the term only matters with its weight
            assert len(options) == 1 and not model_kwargs, name
