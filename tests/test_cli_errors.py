"""What a ``softvq-*`` command says about input it refuses: a bad or misspelt flag or config key, a value of the wrong
type, contradictory fields of one part, a former option name. Each is refused before anything is read or written, in
at most three lines on stderr whose first names the flag (or key) and what is accepted there, or the name that
replaced it (softvq/cli/parsing.py). The commands run in-process through their ``cli`` functions; nothing trains.
"""

from __future__ import annotations

import json

import pytest
import yaml

import softvq
from softvq.cli import config, evaluate, prior, sample
from softvq.cli import train as train_vqvae

CLI = {"softvq-train": train_vqvae.cli, "softvq-evaluate": evaluate.cli, "softvq-prior": prior.cli,
       "softvq-sample": sample.cli}
# What each command needs besides the flag under test, so that nothing else is missing.
REQUIRED = {"softvq-train": [], "softvq-evaluate": ["c.ckpt"], "softvq-prior": ["--vqvae", "v.ckpt"],
            "softvq-sample": ["--prior", "p.ckpt"]}


def refused(capsys, tmp_path, command: str, argv: list[str]) -> list[str]:
    """Run ``command`` with ``argv``; it must end with status 2 (returned, or SystemExit as argparse exits on a bad
    flag) with at most three lines on stderr, and write nothing. Returns those lines."""
    out = tmp_path / "out"
    extra = ["--out", str(out)] if command != "softvq-sample" else ["--out", str(out / "s.png")]
    try:
        code = CLI[command]([*REQUIRED[command], *extra, *argv])
    except SystemExit as stop:
        code = stop.code
    err = capsys.readouterr().err
    lines = err.strip().splitlines()
    assert code == 2, err
    assert 1 <= len(lines) <= 3 and lines[0].startswith("error: "), err
    assert not out.exists()
    return lines


# ---- 1. a bad or misspelt flag, a bad value: short, naming the flag and what it accepts ---------------------------
@pytest.mark.parametrize(("command", "argv", "first"), [
    ("softvq-train", ["--ddcl.restart.treshold", "1"],
     ["--ddcl.restart.treshold", "did you mean --ddcl.restart.threshold?", "threshold, decay, cap"]),
    ("softvq-train", ["--ddcl.prototype_update.dekay", "0.9"],
     ["--ddcl.prototype_update.dekay", "--ddcl.prototype_update.decay", "Ema's (decay, soft) or Gradient's"]),
    ("softvq-train", ["--ddcl.foo", "1"], ["--ddcl.foo", "no such flag", "--ddcl.* takes temperature, recipe,"]),
    ("softvq-train", ["--batch_size", "8"], ["--batch_size", "did you mean --data.batch_size?"]),
    ("softvq-train", ["--trainer.batch_size", "8"], ["--trainer.batch_size", "--data.batch_size", "accelerator"]),
    ("softvq-train", ["--no-such-flag"], ["--no-such-flag", "no such flag"]),
    ("softvq-evaluate", ["--data.data_rot", "d"], ["--data.data_rot", "did you mean --data.data_root?"]),
    ("softvq-prior", ["--model.layer", "2"], ["--model.layer", "did you mean --model.layers?"]),  # no abbreviation
    ("softvq-train", ["--epoch", "2"], ["--epoch", "did you mean --epochs?"]),
    ("softvq-sample", ["--temprature", "0.9"], ["--temprature", "did you mean --temperature?"]),
])
def test_a_misspelt_flag_is_named_with_the_accepted_names(capsys, tmp_path, command, argv, first):
    lines = refused(capsys, tmp_path, command, argv)
    assert all(part in lines[0] for part in first), lines


@pytest.mark.parametrize(("command", "argv", "first"), [
    ("softvq-train", ["--ddcl.restart.threshold", "abc"], ["--ddcl.restart.threshold", "a number", "'abc'"]),
    ("softvq-train", ["--hard.restart.cap", "lots"], ["--hard.restart.cap", "a number or null", "'lots'"]),
    ("softvq-train", ["--epochs", "abc"], ["--epochs", "an integer", "'abc'"]),
    ("softvq-train", ["--epochs", "-1"], ["epochs", "a positive integer", "-1"]),  # the constructor's check
    ("softvq-train", ["--model.width", "wide"], ["--model.width", "an integer", "'wide'"]),
    ("softvq-train", ["--ddcl.temperature", "hot"], ["--ddcl.temperature", "a number or 'auto'", "'hot'"]),
    ("softvq-train", ["--ddcl.prototype_update", "adam"],
     ["--ddcl.prototype_update", "'ema', 'soft_ema', 'gradient'", "Ema", "Gradient", "'adam'"]),
    ("softvq-train", ["--quantizer", "fsq"], ["--quantizer", "'fsq'", "'ddcl', 'hard'"]),
    ("softvq-train", ["--quantizer", "ddcl", "ddcl"], ["--quantizer", "each name once"]),
    ("softvq-evaluate", ["--limit", "0"], ["--limit", "a positive integer or null", "'0'"]),
    ("softvq-prior", ["--model.lr", "fast"], ["--model.lr", "a number", "'fast'"]),
    ("softvq-sample", ["--n", "many"], ["--n", "a positive integer", "'many'"]),
])
def test_a_bad_value_names_the_flag_and_what_it_accepts(capsys, tmp_path, command, argv, first):
    lines = refused(capsys, tmp_path, command, argv)
    assert all(part in lines[0] for part in first), lines


@pytest.mark.parametrize("command", CLI)
def test_help_still_prints_the_usage_and_exits_0(capsys, command):
    with pytest.raises(SystemExit) as stop:
        CLI[command](["--help"])
    assert stop.value.code == 0
    printed = capsys.readouterr()
    assert printed.out.startswith(f"usage: {command}") and "--config CONFIG" in printed.out and not printed.err


def test_a_bad_key_in_a_config_file_is_named_with_the_file(capsys, tmp_path):
    path = tmp_path / "run.yaml"
    path.write_text(yaml.safe_dump({"epoch": 3, "ddcl": {"temperature": 1.0}}))
    lines = refused(capsys, tmp_path, "softvq-train", ["--config", str(path)])
    assert f"{path}: epoch: no such setting; did you mean epochs?" in lines[0]
    path.write_text(yaml.safe_dump({"ddcl": {"restart": {"treshold": 2}}}))
    lines = refused(capsys, tmp_path, "softvq-train", ["--config", str(path)])
    assert "ddcl.restart.treshold" in lines[0] and "ddcl.restart.threshold" in lines[0] and str(path) in lines[0]


@pytest.mark.parametrize("command", CLI)
def test_a_config_file_that_is_missing_or_not_yaml_is_one_line(capsys, tmp_path, command):
    assert "--config: File does not exist" in refused(capsys, tmp_path, command, ["--config", "none.yaml"])[0]
    (tmp_path / "bad.yaml").write_text("n: [1\n")
    assert "Problems parsing config" in refused(capsys, tmp_path, command, ["--config", str(tmp_path / "bad.yaml")])[0]


def test_a_field_flag_without_a_value_says_what_it_takes(capsys, tmp_path):
    lines = refused(capsys, tmp_path, "softvq-train", ["--ddcl.restart.threshold"])
    assert lines == ["error: --ddcl.restart.threshold needs a value: a number"]


# ---- 2. contradictory fields of one part are refused, not dropped -------------------------------------------------
@pytest.mark.parametrize("argv", [
    ["--ddcl.prototype_update.decay", "0.9", "--ddcl.prototype_update.term", "l_q"],
    ["--ddcl.prototype_update.term", "l_q", "--ddcl.prototype_update.decay", "0.9"],
    ["--ddcl.prototype_update.soft", "true", "--ddcl.prototype_update.weight", "2"],
    ["--rddcl.prototype_update.decay", "0.9", "--rddcl.prototype_update.term", "l_q"],
    ["--ddcl.prototype_update", "{decay: 0.9, term: l_q}"],
])
def test_fields_of_ema_and_of_gradient_in_one_setting_are_refused(capsys, tmp_path, argv):
    first = refused(capsys, tmp_path, "softvq-train", argv)[0]
    fields = [token.rpartition(".")[2] for token in argv if token.startswith("--") and token.count(".") == 2]
    fields = fields or ["decay", "term"]
    assert all(name in first for name in fields) and "Ema" in first and "Gradient" in first, first
    assert "not of both" in first


def test_fields_of_two_classes_are_refused_in_a_config_file_and_across_a_file_and_a_flag(capsys, tmp_path):
    path = tmp_path / "run.yaml"
    path.write_text(yaml.safe_dump({"ddcl": {"prototype_update": {"decay": 0.9, "term": "l_q"}}}))
    first = refused(capsys, tmp_path, "softvq-train", ["--config", str(path)])[0]
    assert all(s in first for s in ("ddcl.prototype_update.decay", "ddcl.prototype_update.term", "Ema", "Gradient"))
    path.write_text(json.dumps({"ddcl": {"prototype_update": {"term": "l_q"}}}))  # a Gradient, then Ema's field
    argv = ["--config", str(path), "--ddcl.prototype_update.decay", "0.9"]
    first = refused(capsys, tmp_path, "softvq-train", argv)[0]
    assert all(s in first for s in ("--ddcl.prototype_update.decay", "ddcl.prototype_update.term", "Ema", "Gradient"))
    assert str(path) in first
    section = tmp_path / "ddcl.yaml"  # a section's own file (--ddcl FILE)
    section.write_text(yaml.safe_dump({"prototype_update": {"decay": 0.9, "weight": 2.0}}))
    first = refused(capsys, tmp_path, "softvq-train", ["--ddcl", str(section)])[0]
    assert "decay" in first and "weight" in first and "Ema" in first and "Gradient" in first


@pytest.mark.parametrize(("argv", "named"), [
    (["--ddcl.prototype_update", "gradient", "--ddcl.prototype_update.decay", "0.9"],
     "--ddcl.prototype_update gradient"),
    (["--ddcl.target_entropy", "1.0", "--ddcl.target_entropy.rate", "0.1"], "--ddcl.target_entropy 1.0"),
    (["--ddcl.restart.threshold", "2", "--ddcl.restart", "null"], "--ddcl.restart null"),
    (["--hard.restart", "null", "--hard.restart.threshold", "2"], "--hard.restart null"),
    (["--ddcl.standardize", "false", "--ddcl.standardize.output_scale", "2"], "--ddcl.standardize false"),
    (["--ddcl.commitment_weight", "0.3", "--ddcl.commitment_weight.term", "l_ols"], "--ddcl.commitment_weight 0.3"),
    (["--ddcl.init", "data", "--ddcl.init.scale", "0.5"], "--ddcl.init data"),
])
def test_a_whole_value_and_fields_of_the_same_part_are_refused(capsys, tmp_path, argv, named):
    """jsonargparse keeps the later of the two and drops the other (``--ddcl.target_entropy 1.0`` became ``auto``)."""
    first = refused(capsys, tmp_path, "softvq-train", argv)[0]
    field = next(t for t in argv if t.count(".") == 2)
    assert named in first and field in first and "fields" in first, first


def test_fields_after_a_config_files_whole_value_are_refused_and_its_defaults_are_no_value(capsys, tmp_path):
    path = tmp_path / "run.yaml"
    path.write_text(yaml.safe_dump({"ddcl": {"target_entropy": 1.0}}))
    first = refused(capsys, tmp_path, "softvq-train", ["--config", str(path), "--ddcl.target_entropy.rate", "0.1"])[0]
    assert "--ddcl.target_entropy.rate" in first and "ddcl.target_entropy: 1.0" in first and str(path) in first
    # a file of every setting (--print_config) holds the defaults ("auto", null, ...): its fields can still be set
    with pytest.raises(SystemExit):
        config.build_parser().parse_args(["--print_config"])
    path.write_text(capsys.readouterr().out)
    cfg = config.parse(["--config", str(path), "--ddcl.restart.threshold", "2", "--ddcl.prototype_update.term", "l_q",
                        "--hard.restart.threshold", "1", "--ddcl.target_entropy.rate", "0.1"])
    assert cfg.ddcl.restart.threshold == 2.0 and cfg.ddcl.prototype_update.term == "l_q"
    assert cfg.hard.restart.threshold == 1.0 and cfg.ddcl.target_entropy.rate == 0.1


def test_fields_of_one_class_from_a_file_and_flags_are_merged(tmp_path):
    path = tmp_path / "run.yaml"
    path.write_text(yaml.safe_dump({"ddcl": {"restart": {"threshold": 2.0}, "prototype_update": {"term": "l_q"}}}))
    cfg = config.parse(["--config", str(path), "--ddcl.restart.cap", "0.5", "--ddcl.prototype_update.weight", "2"])
    assert (cfg.ddcl.restart.threshold, cfg.ddcl.restart.cap) == (2.0, 0.5)
    assert (cfg.ddcl.prototype_update.term, cfg.ddcl.prototype_update.weight) == ("l_q", 2.0)
    # a flag after the file replaces its whole value, as for any setting
    assert config.parse(["--config", str(path), "--ddcl.restart", "null"]).ddcl.restart is None


def test_every_field_given_by_flags_is_kept():
    """Read as nested keys, jsonargparse kept only the last field of a union's second class: ``term`` was dropped
    here, leaving ``Gradient("free_energy", 2.0)``."""
    cfg = config.parse(["--ddcl.prototype_update.term", "l_q", "--ddcl.prototype_update.weight=2e-1",
                        "--ddcl.restart.threshold", "2", "--ddcl.restart.cap", "null"])
    assert (cfg.ddcl.prototype_update.term, cfg.ddcl.prototype_update.weight) == ("l_q", 0.2)
    assert (cfg.ddcl.restart.threshold, cfg.ddcl.restart.decay, cfg.ddcl.restart.cap) == (2.0, "auto", None)
    model = config.check_all(cfg)["ddcl"]
    assert model._codebooks()[0].prototype_update == softvq.parts.Gradient("l_q", 0.2)


# ---- 3. a former name is refused with the name that replaced it ---------------------------------------------------
@pytest.mark.parametrize(("argv", "message"), [
    (["--ddcl.dead_code_threshold", "2"], "--ddcl.dead_code_threshold was renamed --ddcl.restart.threshold"),
    (["--ddcl.dead_code_decay=0.9"], "--ddcl.dead_code_decay was renamed --ddcl.restart.decay"),
    (["--ddcl.ema_decay", "0.9"], "--ddcl.ema_decay was renamed --ddcl.prototype_update.decay"),
    (["--ddcl.codebook_term", "l_q"], "--ddcl.codebook_term was renamed --ddcl.prototype_update.term"),
    (["--ddcl.renorm_clip", "[1, 2]"], "--ddcl.renorm_clip was renamed --ddcl.standardize.renorm_clip"),
    (["--ddcl.commitment_term", "l_ols"], "--ddcl.commitment_term was renamed --ddcl.commitment_weight.term"),
    (["--ddcl.init_scale", "0.5"], "--ddcl.init_scale was renamed --ddcl.init.scale"),
    (["--hard.beta", "0.5"], "--hard.beta was renamed --hard.commitment_weight"),
    (["--rhard.dead_code_threshold", "1"], "--rhard.dead_code_threshold was renamed --rhard.restart.threshold"),
])
def test_a_former_quantizer_flag_is_refused_with_its_replacement(capsys, tmp_path, argv, message):
    assert refused(capsys, tmp_path, "softvq-train", argv) == [f"error: {message}"]


def test_options_that_are_still_current_are_not_former_names():
    cfg = config.parse(["--hard.ema_decay", "0.9", "--rddcl.renorm", "false", "--rddcl.renorm_clip", "[2, 4]"])
    assert cfg.hard.ema_decay == 0.9 and cfg.rddcl.renorm is False


@pytest.mark.parametrize("suffix", [".yaml", ".json"])
def test_a_former_key_in_a_config_file_is_refused_with_its_replacement(capsys, tmp_path, suffix):
    path = tmp_path / f"run{suffix}"
    path.write_text(json.dumps({"ddcl": {"dead_code_threshold": 2, "temperature_rate": 0.1},
                                "hard": {"beta": 0.5}}))
    first = refused(capsys, tmp_path, "softvq-train", ["--config", str(path)])[0]
    for old, new in (("ddcl.dead_code_threshold", "ddcl.restart.threshold"),
                     ("ddcl.temperature_rate", "ddcl.target_entropy.rate"), ("hard.beta", "hard.commitment_weight")):
        assert f"{path}: {old} was renamed {new}" in first, first


@pytest.mark.parametrize(("command", "argv", "message"), [
    ("softvq-evaluate", ["--data-root", "d"], "--data-root was renamed --data.data_root"),
    ("softvq-evaluate", ["--no-progress-bar"], "--no-progress-bar was replaced by --trainer.progress_bar false"),
    ("softvq-prior", ["--lr", "1e-3"], "--lr was renamed --model.lr"),
    ("softvq-prior", ["--class-conditional"], "--class-conditional was replaced by --model.class_conditional true"),
    ("softvq-sample", ["--top-k", "5"], "--top-k was renamed --top_k"),
])
def test_a_former_flag_of_a_command_is_refused_with_its_replacement_not_translated(capsys, tmp_path, command, argv,
                                                                                   message):
    assert refused(capsys, tmp_path, command, argv) == [f"error: {message}"]


def test_every_former_flag_given_is_named_on_one_line(capsys):
    with pytest.raises(SystemExit) as stop:
        config.parse(["--ddcl.dead_code_threshold", "2", "--hard.beta", "0.5", "--epochs", "2"])
    assert stop.value.code == 2
    assert capsys.readouterr().err == ("error: --ddcl.dead_code_threshold was renamed --ddcl.restart.threshold; "
                                       "--hard.beta was renamed --hard.commitment_weight\n")


def test_a_run_recorded_with_former_names_is_upgraded_not_refused(tmp_path):
    """Only input is refused: a run's own config.json with the former names is compared in today's names when the
    run resumes (softvq._compat.upgrade_settings), as before."""
    cfg = config.parse(["--quantizer", "ddcl", "--ddcl.restart.threshold", "2"])
    model = config.check_all(cfg)["ddcl"]
    now = config.resolved_config(cfg, "ddcl", model)
    recorded = json.loads(json.dumps(now))
    restart = recorded["ddcl"].pop("restart")
    recorded["ddcl"].update(dead_code_threshold=restart["threshold"], dead_code_decay=restart["decay"],
                            dead_code_cap=restart["cap"])
    (tmp_path / "config.json").write_text(json.dumps(recorded))
    assert train_vqvae.resume_changes(now, tmp_path) == {}
