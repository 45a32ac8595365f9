"""eval.showcase end to end on a tiny data set: the library's commands, resumable steps, the labelled grid."""

from __future__ import annotations

import json

import pytest
from PIL import Image

from eval import showcase

VQVAE = ("--data.train_subset 96 --data.val_size 20 --data.batch_size 32 --model.width 16 --model.res_hidden 8 "
         "--model.res_blocks 1 --model.code_dim 8 --model.num_codes 16 --data.num_workers 0 "
         "--trainer.progress_bar false")
PRIOR = ("--model.layers 1 --model.heads 2 --batch_size 64 --data.val_size 20 --model.warmup_steps 2 "
         "--trainer.progress_bar false --data.train_subset 96")


def test_showcase_trains_both_models_once_and_draws_a_row_per_class(tmp_path, tiny_cifar):
    argv = ["--data-root", str(tiny_cifar["folder"]), "--runs", str(tmp_path / "runs"), "--out", str(tmp_path / "out"),
            "--vqvae-epochs", "1", "--prior-epochs", "1", "--prior-dim", "32", "--vqvae-args", VQVAE,
            "--prior-args", PRIOR, "--per-class", "2", "--guidance", "3"]
    summary = showcase.main(argv)
    assert summary["vqvae_command"].startswith("softvq-train --quantizer ddcl --epochs 1")
    assert "--model.class_conditional true" in summary["prior_command"] and summary["guidance"] == 3.0
    assert len(summary["classes"]) == 10 and summary["prior_test_bits_per_image"] > 0
    with Image.open(tmp_path / "out" / "samples.png") as png:
        assert png.size[1] > png.size[0]  # ten rows of 2 + 1 + 2 tiles
    again = showcase.main(argv)  # both runs are finished: nothing retrains, the same figures
    assert again["vqvae_seconds"] < 1.0 and again["prior_seconds"] < 1.0
    assert again["prior_test_bits_per_image"] == summary["prior_test_bits_per_image"]
    assert json.loads((tmp_path / "out" / "showcase.json").read_text())["per_class"] == 2
    # the grid of given runs: nothing trains, the figure is drawn from them
    grid_argv = ["--data-root", str(tiny_cifar["folder"]), "--out", str(tmp_path / "given"), "--per-class", "1",
                 "--vqvae", str(tmp_path / "runs" / "vqvae" / "checkpoints" / "last.ckpt"),
                 "--prior", str(tmp_path / "runs" / "prior"), "--runs", str(tmp_path / "untouched")]
    given = showcase.main(grid_argv)
    assert given["per_class"] == 1 and len(given["classes"]) == 10 and not (tmp_path / "untouched").exists()
    assert (tmp_path / "given" / "samples.png").is_file() and "vqvae_command" not in given
    with pytest.raises(SystemExit):
        showcase.main(grid_argv[:-4])  # --vqvae without --prior
