"""What a newcomer meets on the commands: config files, one epoch count, quiet output, clean failures, readable help.

Each check compares against something computed independently of the code under test: the history's own epoch of the
lowest validation MSE for the best checkpoint's name, the per-epoch history for the comparison table, a re-parse of
the saved config.json for the configuration round trip.
"""

from __future__ import annotations

import json
import re

import pytest
import yaml

from softvq.cli import config as train_config
from softvq.cli import evaluate, prior, sample
from softvq.cli import train as train_vqvae

TINY = ["--data.batch_size", "16", "--data.train_subset", "48", "--data.val_size", "32", "--data.num_workers", "0",
        "--model.num_codes", "8", "--model.code_dim", "4", "--model.width", "8", "--model.res_hidden", "4",
        "--model.res_blocks", "1", "--trainer.accelerator", "cpu", "--trainer.progress_bar", "false"]


def test_two_quantizers_name_checkpoints_by_epoch_from_one_and_table_restarts(tiny_cifar, tmp_path, capsys):
    out = tmp_path / "runs"
    argv = ["--data.data_root", str(tiny_cifar["folder"]), "--out", str(out), "--quantizer", "ddcl", "hard",
            "--hard.ema_decay", "0.9", "--hard.dead_code_threshold", "1", "--epochs", "3", *TINY]
    assert train_vqvae.cli(argv) == 0
    printed = capsys.readouterr()
    assert "GPU available" not in printed.out + printed.err and "Tip:" not in printed.out + printed.err
    table = (out / "comparison.md").read_text()
    header = [c.strip() for c in table.splitlines()[0].strip("|").split("|")]
    for name in ("ddcl", "hard"):
        history = [json.loads(line) for line in (out / name / "history.jsonl").read_text().splitlines()]
        assert [r["epoch"] for r in history] == [1, 2, 3]
        best = min(history, key=lambda r: r["val_mse"])["epoch"]  # history counts epochs from 1
        assert [p.name for p in (out / name / "checkpoints").glob("best-*.ckpt")] == [f"best-epoch{best:02d}.ckpt"]
        assert sorted(p.name for p in (out / name).glob("recon_epoch*.png")) == [
            f"recon_epoch{e:02d}.png" for e in (1, 2, 3)]
        column = header.index(f"{name} restarts")
        rows = [[c.strip() for c in line.strip("|").split("|")] for line in table.splitlines()[2:]]
        assert [row[column] for row in rows] == [str(r["restarts"]) for r in history]
        # codebook health is the validation split's (training-epoch counts include the codes a restart revived)
        util, dead = header.index(f"{name} util %"), header.index(f"{name} dead")
        assert [(row[util], row[dead]) for row in rows] == [
            (f"{100 * r['val_utilization']:.1f}", str(r["val_dead_codes"])) for r in history]
    assert any(json.loads(line)["restarts"] > 0 for line in (out / "hard" / "history.jsonl").read_text().splitlines())


def test_saved_config_is_resolved_and_reproduces_the_run(tiny_cifar, tmp_path):
    out = tmp_path / "run"
    assert train_vqvae.cli(["--data.data_root", str(tiny_cifar["folder"]), "--out", str(out), "--epochs", "1",
                            *TINY]) == 0
    saved = json.loads((out / "config.json").read_text())
    # nulls that stood for "the recipe's value" are the values the layer chose
    assert saved["ddcl"]["standardize"] is True and saved["ddcl"]["hard_output"] is True
    assert saved["ddcl"]["prototype_update"] == "ema" and saved["model"]["latent_norm"] == "none"
    assert saved["ddcl"]["target_entropy"] == pytest.approx(min(2.5, 0.5 * __import__("math").log(8)))
    # "auto" only where it names a rule applied while training: T from the first batch, the capped restart threshold
    assert saved["ddcl"]["temperature"] == "auto" and saved["ddcl"]["dead_code_threshold"] == "auto"
    assert None not in (saved["ddcl"]["standardize"], saved["ddcl"]["hard_output"], saved["model"]["latent_norm"])
    # the file is a config: parsed again it describes the same run, key for key
    cfg = train_config.parse(["--config", str(out / "config.json")])
    model = train_vqvae.VQVAE(**train_config.model_kwargs(cfg, "ddcl"))
    again = train_config.resolved_config(cfg, "ddcl", model)
    assert train_config.config_changes(saved, again) == {}


def test_print_config_round_trips_through_a_yaml_file(tmp_path, capsys):
    with pytest.raises(SystemExit) as exit_info:
        train_config.build_parser().parse_args(["--model.num_codes", "64", "--hard.beta", "0.5", "--print_config"])
    assert exit_info.value.code == 0
    text = capsys.readouterr().out
    assert yaml.safe_load(text)["model"]["num_codes"] == 64
    path = tmp_path / "run.yaml"
    path.write_text(text)
    cfg = train_config.parse(["--config", str(path), "--epochs", "4"])  # a flag after the file wins
    assert cfg.model.num_codes == 64 and cfg.hard.beta == 0.5 and cfg.epochs == 4


def test_invalid_setting_is_one_error_line_from_its_constructor_and_writes_nothing(tiny_cifar, tmp_path, capsys):
    out = tmp_path / "run"
    code = train_vqvae.cli(["--data.data_root", str(tiny_cifar["folder"]), "--out", str(out), *TINY,
                            "--hard.ema_decay", "1.5", "--quantizer", "hard"])
    err = capsys.readouterr().err
    assert code == 2 and re.search(r"^error: .*ema_decay.*1\.5", err, re.M), err
    assert not out.exists()


def test_run_failing_before_its_first_checkpoint_leaves_no_directory(tiny_cifar, tmp_path, monkeypatch, capsys):
    class Exploding(train_vqvae.VQVAE):
        def training_step(self, batch, batch_idx):
            raise FloatingPointError("non-finite loss at step 0 (test)")

    argv = ["--data.data_root", str(tiny_cifar["folder"]), *TINY, "--epochs", "1"]
    old = tmp_path / "old"  # a finished run, then replaced by one that fails at once
    assert train_vqvae.cli([*argv, "--out", str(old)]) == 0
    monkeypatch.setattr(train_vqvae, "VQVAE", Exploding)
    out = tmp_path / "fresh"
    assert train_vqvae.cli([*argv, "--out", str(out)]) == 2
    assert "non-finite loss at step 0" in capsys.readouterr().err
    assert not out.exists()  # not a directory holding only config.json, which the next attempt would refuse
    assert train_vqvae.cli([*argv, "--out", str(old), "--overwrite"]) == 2
    # --overwrite removed the old run and the failed new one left nothing: the directory, which existed before the
    # command, stays, empty
    assert list(old.iterdir()) == []


@pytest.mark.parametrize("module", [prior, evaluate, sample])
def test_help_shows_no_placeholder_defaults(module, capsys):
    with pytest.raises(SystemExit):
        module.build_parser().parse_args(["--help"])
    text = capsys.readouterr().out
    assert "(default: None)" not in text and "(default: False)" not in text
    assert "(default: " in text  # real defaults are still shown
