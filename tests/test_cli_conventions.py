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
from softvq.cli.parsing import FormerFlags, parse

TINY = ["--data.batch_size", "16", "--data.train_subset", "48", "--data.val_size", "32", "--data.num_workers", "0",
        "--model.num_codes", "8", "--model.code_dim", "4", "--model.width", "8", "--model.res_hidden", "4",
        "--model.res_blocks", "1", "--trainer.accelerator", "cpu", "--trainer.progress_bar", "false"]


def test_two_quantizers_name_checkpoints_by_epoch_from_one_and_table_restarts(tiny_cifar, tmp_path, capsys):
    out = tmp_path / "runs"
    argv = ["--data.data_root", str(tiny_cifar["folder"]), "--out", str(out), "--quantizer", "ddcl", "hard",
            "--hard.ema_decay", "0.9", "--hard.restart.threshold", "1", "--hard.restart.decay", "0.9",
            "--hard.restart.cap", "null", "--epochs", "3", *TINY]
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
    assert saved["ddcl"]["standardize"] == {"renorm_clip": [1.1, 0.1], "output_scale": "standardized"}
    assert saved["ddcl"]["hard_output"] is True
    assert saved["ddcl"]["prototype_update"] == {"decay": 0.99, "soft": False}  # the recipe's Ema, field by field
    assert saved["model"]["latent_norm"] == "none"
    assert saved["ddcl"]["target_entropy"] == pytest.approx(0.5 * __import__("math").log(8))
    # "auto" only where it names a rule applied while training (T from the first batch); a part's settings by field
    assert saved["ddcl"]["temperature"] == "auto"
    assert saved["ddcl"]["restart"] == {"threshold": 1.0, "decay": "auto", "cap": 0.25}
    assert None not in (saved["ddcl"]["standardize"], saved["ddcl"]["hard_output"], saved["model"]["latent_norm"])
    # the file is a config: parsed again it describes the same run, key for key
    cfg = train_config.parse(["--config", str(out / "config.json")])
    model = train_vqvae.VQVAE(**train_config.model_kwargs(cfg, "ddcl"))
    again = train_config.resolved_config(cfg, "ddcl", model)
    assert train_config.config_changes(saved, again) == {}


def test_print_config_round_trips_through_a_yaml_file(tmp_path, capsys):
    with pytest.raises(SystemExit) as exit_info:
        train_config.build_parser().parse_args(["--model.num_codes", "64", "--hard.commitment_weight", "0.5",
                                                "--print_config"])
    assert exit_info.value.code == 0
    text = capsys.readouterr().out
    assert yaml.safe_load(text)["model"]["num_codes"] == 64
    path = tmp_path / "run.yaml"
    path.write_text(text)
    cfg = train_config.parse(["--config", str(path), "--epochs", "4"])  # a flag after the file wins
    assert cfg.model.num_codes == 64 and cfg.hard.commitment_weight == 0.5 and cfg.epochs == 4


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


COMMANDS = {"softvq-train": train_config, "softvq-prior": prior, "softvq-evaluate": evaluate,
            "softvq-sample": sample}


@pytest.mark.parametrize("name", COMMANDS)
def test_every_command_reads_and_prints_config_files_alike(name, tmp_path, capsys):
    """One convention: --print_config writes a YAML that --config reads back to the same settings, and the sections
    that several commands have hold the same things under the same names."""
    parser = COMMANDS[name].build_parser()
    assert parser.prog == name
    positional = ["ckpt.ckpt"] if name == "softvq-evaluate" else []
    changed = {"softvq-train": ["--data.batch_size", "7"], "softvq-evaluate": ["--data.batch_size", "7"],
               "softvq-prior": ["--data.batch_size", "7", "--model.dim", "64"], "softvq-sample": ["--n", "7"]}[name]
    with pytest.raises(SystemExit):
        parser.parse_args([*positional, *changed, "--print_config"])
    text = capsys.readouterr().out
    config = yaml.safe_load(text)
    (tmp_path / "c.yaml").write_text(text)
    again = parser.parse_args(["--config", str(tmp_path / "c.yaml")])
    direct = parser.parse_args([*positional, *changed])
    assert {k: v for k, v in again.as_dict().items() if k not in ("config", "__path__")} == \
        {k: v for k, v in direct.as_dict().items() if k not in ("config", "__path__")}
    if "data" in config:  # the same data section: where the images are and how they are loaded
        assert {"data_root", "download", "num_workers", "batch_size", "cache_dir"} <= set(config["data"])
        assert config["data"]["batch_size"] == 7
    if "trainer" in config:
        assert {"accelerator", "precision", "progress_bar"} <= set(config["trainer"])


@pytest.mark.parametrize(("module", "old", "new"), [
    (evaluate, ["c.ckpt", "--data-root", "d", "--batch-size", "9", "--num-workers", "0", "--download",
                "--accelerator", "cpu", "--no-progress-bar"],
     ["c.ckpt", "--data.data_root", "d", "--data.batch_size", "9", "--data.num_workers", "0", "--data.download",
      "true", "--trainer.accelerator", "cpu", "--trainer.progress_bar", "false"]),
    (prior, ["--vqvae", "v.ckpt", "--data-root=d", "--train-subset", "100", "--val-size", "0", "--encode-batch-size",
             "9", "--cache-dir", "c", "--class-conditional", "--label-dropout", "0.2", "--layers", "2", "--heads", "2",
             "--dim", "32", "--mlp-ratio", "2", "--dropout", "0", "--lr", "1e-4", "--weight-decay", "0",
             "--warmup-steps", "5", "--min-lr-ratio", "0.5", "--batch-size", "16", "--devices", "2", "--num-nodes",
             "1", "--strategy", "ddp", "--precision", "bf16-mixed", "--accelerator", "cpu", "--no-progress-bar"],
     ["--vqvae", "v.ckpt", "--data.data_root=d", "--data.train_subset", "100", "--data.val_size", "0",
      "--data.batch_size", "9", "--codes_cache", "c", "--model.class_conditional", "true", "--model.label_dropout",
      "0.2", "--model.layers", "2", "--model.heads", "2", "--model.dim", "32", "--model.mlp_ratio", "2",
      "--model.dropout", "0", "--model.lr", "1e-4", "--model.weight_decay", "0", "--model.warmup_steps", "5",
      "--model.min_lr_ratio", "0.5", "--batch_size", "16", "--trainer.devices", "2", "--trainer.num_nodes", "1",
      "--trainer.strategy", "ddp", "--trainer.precision", "bf16-mixed", "--trainer.accelerator", "cpu",
      "--trainer.progress_bar", "false"]),
    (sample, ["--prior", "p.ckpt", "--top-k", "3", "--class", "cat", "--allow-other-vqvae"],
     ["--prior", "p.ckpt", "--top_k", "3", "--label", "cat", "--allow_other_vqvae"]),
])
def test_old_spellings_are_refused_with_the_flag_that_replaced_each(module, old, new, capsys):
    """The spellings before the shared convention are refused, every one in the command line named with its
    replacement on one line: the k-th flag of ``old`` with the k-th of ``new``, its spelling today; the new spellings
    parse."""
    parser = module.build_parser()
    parser.parse_args(new)  # today's spellings are fine
    with pytest.raises(SystemExit) as stop:
        parse(parser, old)
    message = capsys.readouterr().err
    assert stop.value.code == 2 and message.startswith("error: ") and message.count("\n") == 1, message
    pairs = [(o.partition("=")[0], n.partition("=")[0])
             for o, n in zip([t for t in old if t.startswith("--")], [t for t in new if t.startswith("--")],
                             strict=True) if o != n]
    assert len(pairs) == len([t for t in old if t.startswith("--")]) - (module is not evaluate)  # all but --vqvae
    for flag, today in pairs:
        assert f"{flag} was " in message and f" {today}" in message, (flag, today, message)
    if module is not sample:
        assert "--data-root was renamed --data.data_root" in message


def test_former_flags_name_their_replacement_and_leave_values_alone():
    former = FormerFlags(renames={"--old": "--new"}, switches={"--flag": ("--on", "true"), "--sw": ("--sw2", None)})
    assert former.message("--old") == "--old was renamed --new"
    assert former.message("--flag") == "--flag was replaced by --on true"
    assert former.message("--sw") == "--sw was replaced by --sw2"
    assert former.message("--new") is None and former.replacement("--other") is None
    assert former.message("--old", "run.yaml") == "run.yaml: old was renamed new"  # a config file's key
