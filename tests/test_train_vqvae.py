"""train_vqvae.py end to end on a tiny data set: history.jsonl, checkpoints, resume, CLI errors."""

from __future__ import annotations

import inspect
import json
import math
import subprocess
import sys
from pathlib import Path

import lightning as L
import pytest
import torch
from helpers import worse_every_epoch_module

from softvq import DDCLQuantizer
from softvq.cli import config
from softvq.cli import train as train_vqvae
from softvq.models import VQVAE
from softvq.parts import Ema, Restart

ROOT = Path(__file__).resolve().parents[1]
TINY = ["--data.train_subset", "96", "--data.val_size", "48", "--data.batch_size", "32", "--model.width", "16",
        "--model.res_hidden", "8", "--model.res_blocks", "1", "--model.num_codes", "32", "--model.code_dim", "8",
        "--data.num_workers", "0", "--trainer.progress_bar", "false"]
COMMON_KEYS = {"epoch", "step", "quantizer", "utilization", "dead_codes", "perplexity", "soft_perplexity",
               "train_mse", "val_mse", "val_psnr", "val_ssim", "val_psnr_hard", "val_mse_hard", "val_ssim_hard",
               "l_q", "l_ols", "v", "assignment_entropy", "separation", "separation_min", "time_s"}
DDCL_KEYS = COMMON_KEYS | {"identity_residual", "temperature", "restarts"}


def run(tmp_path: Path, data: Path, *extra: str) -> dict:
    return train_vqvae.main([*TINY, "--data.data_root", str(data), *extra])


def weights(path: Path) -> dict[str, torch.Tensor]:
    state = torch.load(path, map_location="cpu", weights_only=True)["state_dict"]
    return {k: v for k, v in state.items() if isinstance(v, torch.Tensor)}


def test_both_quantizers_write_history_checkpoints_and_grids(tmp_path, tiny_cifar, capsys):
    """The history rows against references computed outside the metrics that wrote them: each epoch's utilization
    and dead codes from the distinct indices the quantizer emitted in that epoch's training steps (recorded by a
    forward hook, counted with a Python set); the last epoch's validation utilization and dead codes, and hard VQ's
    val_psnr and val_psnr_hard, from last.ckpt by brute-force nearest neighbour on the validation images and a
    float64 10 log10(1 / MSE) per image (data range 1, clamped to [0, 1]), averaged over the images."""
    from helpers import exact_cdist

    from softvq import DDCLQuantizer, HardVQ
    from softvq.data.cifar10 import CIFAR10DataModule

    steps: dict[str, list[torch.Tensor]] = {"ddcl": [], "hard": []}

    def record(module, args, output):  # the indices of every training step, as the quantizer emitted them
        if isinstance(module, (DDCLQuantizer, HardVQ)) and module.training:
            steps["ddcl" if isinstance(module, DDCLQuantizer) else "hard"].append(output.indices.detach().clone())

    out = tmp_path / "cmp"
    handle = torch.nn.modules.module.register_module_forward_hook(record)
    try:
        histories = run(tmp_path, tiny_cifar["archive"], "--quantizer", "ddcl", "hard", "--epochs", "2",
                        "--out", str(out), "--ddcl.temperature", "0.05", "--model.temperature_schedule",
                        "exponential", "--model.temperature_final", "0.005", "--data.train_subset", "240",
                        "--data.val_size", "60")
    finally:
        handle.remove()
    data = CIFAR10DataModule(tiny_cifar["archive"], val_size=60, train_subset=240, num_workers=0)
    data.prepare_data()
    data.setup("fit")
    val_images = torch.stack([data.val_set[i][0] for i in range(len(data.val_set))])
    assert val_images.shape == (60, 3, 32, 32)
    for name, keys in (("ddcl", DDCL_KEYS), ("hard", COMMON_KEYS)):
        rows = [json.loads(line) for line in (out / name / "history.jsonl").read_text().splitlines()]
        assert rows == histories[name] and [r["epoch"] for r in rows] == [1, 2]
        assert len(steps[name]) == 16  # one quantizer call per training step
        for row in rows:
            assert keys <= set(row), keys - set(row)
            assert row["quantizer"] == name and row["step"] == 8 * row["epoch"]  # 240 images in batches of 32
            used = set(torch.cat([i.flatten() for i in steps[name][8 * row["epoch"] - 8:8 * row["epoch"]]]).tolist())
            assert row["utilization"] == pytest.approx(len(used) / 32, rel=1e-12) and 0 < row["utilization"] <= 1
            assert row["dead_codes"] == 32 - len(used) and 0 <= row["dead_codes"] < 32
            assert 1 <= row["perplexity"] <= 32 and row["val_psnr"] > 0 and -1 <= row["val_ssim"] <= 1
        model = VQVAE.load_from_checkpoint(out / name / "checkpoints" / "last.ckpt", map_location="cpu").eval()
        state = weights(out / name / "checkpoints" / "last.ckpt")
        with torch.no_grad():  # brute force in the space the layer measures distances in
            tokens = model.latents(val_images).permute(0, 2, 3, 1).reshape(-1, 8).double()
            if name == "ddcl":
                tokens = model.quantizer.standardizer(tokens)[0]
            codes = state["quantizer.prototypes"].double()
            nearest = exact_cdist(tokens, codes).argmin(1)
            used = set(nearest.tolist())
            assert rows[-1]["val_utilization"] == pytest.approx(len(used) / 32, rel=1e-12), name
            assert rows[-1]["val_dead_codes"] == 32 - len(used), name
            if name == "hard":  # straight-through: the reconstruction is the hard decode, so both PSNRs are its PSNR
                hard = model.decode_indices(nearest.reshape(60, 8, 8)).clamp(0, 1).double()
                mse = (hard - val_images.double()).square().mean(dim=(1, 2, 3))
                psnr = float((10 * torch.log10(1.0 / mse)).mean())
                assert rows[-1]["val_psnr_hard"] == pytest.approx(psnr, rel=1e-5)
                assert rows[-1]["val_psnr"] == pytest.approx(psnr, rel=1e-5)
        ckpts = sorted(p.name for p in (out / name / "checkpoints").iterdir())
        assert "last.ckpt" in ckpts and any(c.startswith("best-epoch") for c in ckpts)
        for epoch in (1, 2):
            png = out / name / f"recon_epoch{epoch:02d}.png"
            assert png.stat().st_size > 1000 and png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
        assert list((out / name / "tb").glob("events.out.tfevents.*"))
        assert json.loads((out / name / "config.json").read_text())["quantizer"] == [name]  # as --quantizer takes it
    ddcl = histories["ddcl"]
    assert all(r["identity_residual"] < 1e-5 for r in ddcl)
    # T is set before each of the 16 steps: steps 0..15 run from 0.05 to 0.005 geometrically; the record holds the
    # temperature of the epoch's last step (7 and 15).
    assert ddcl[0]["temperature"] == pytest.approx(0.05 * 0.1 ** (7 / 15))
    assert ddcl[1]["temperature"] == pytest.approx(0.005)
    hard = histories["hard"]
    assert all(r["val_psnr"] == r["val_psnr_hard"] and r["v"] == 0 for r in hard)  # the last one by hand above
    table = (out / "comparison.md").read_text()
    assert table.count("\n") == 4 and "ddcl util %" in table and "hard val PSNR" in table
    printed = capsys.readouterr().out
    assert table in printed
    assert (out / "comparison.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    # the closing block names every file the command wrote, and the TensorBoard command
    block = printed[printed.index(f"Outputs in {out}/:"):].splitlines()
    assert block[1:] == [
        "  comparison.md, comparison.png: the per-epoch table and curves of ddcl, hard",
        *(f"  {q}: {q}/checkpoints/ (best-epoch02.ckpt, last.ckpt), {q}/history.jsonl, {q}/config.json, "
          f"reconstructions {q}/recon_epoch01.png ... recon_epoch02.png" for q in ("ddcl", "hard")),
        f"  TensorBoard: tensorboard --logdir {out}"]


def test_resume_continues_from_the_last_checkpoint_exactly(tmp_path, tiny_cifar):
    straight = tmp_path / "straight"
    run(tmp_path, tiny_cifar["folder"], "--quantizer", "ddcl", "--epochs", "2", "--out", str(straight),
        "--ddcl.temperature", "0.05", "--seed", "3")
    parts = tmp_path / "parts"
    run(tmp_path, tiny_cifar["folder"], "--quantizer", "ddcl", "--epochs", "1", "--out", str(parts),
        "--ddcl.temperature", "0.05", "--seed", "3")
    after_one = weights(parts / "checkpoints" / "last.ckpt")
    history = run(tmp_path, tiny_cifar["folder"], "--quantizer", "ddcl", "--epochs", "2", "--out", str(parts),
                  "--ddcl.temperature", "0.05", "--seed", "3", "--resume")["ddcl"]
    assert [r["epoch"] for r in history] == [1, 2] and history[1]["step"] == 6
    ckpt = torch.load(parts / "checkpoints" / "last.ckpt", map_location="cpu", weights_only=True)
    assert ckpt["epoch"] == 1 and ckpt["global_step"] == 6  # Lightning counts epochs from 0
    resumed, reference = weights(parts / "checkpoints" / "last.ckpt"), weights(straight / "checkpoints" / "last.ckpt")
    assert any(not torch.equal(resumed[k], after_one[k]) for k in resumed)  # it trained on
    for key in reference:  # and it trained on exactly as an uninterrupted run (CPU, num_workers=0)
        assert torch.equal(resumed[key], reference[key]), key
    straight_rows = [json.loads(x) for x in (straight / "history.jsonl").read_text().splitlines()]
    for a, b in zip(history, straight_rows, strict=True):
        assert {k: v for k, v in a.items() if k != "time_s"} == {k: v for k, v in b.items() if k != "time_s"}


def test_resume_drops_history_rows_written_after_the_checkpoint(tmp_path, tiny_cifar):
    out = tmp_path / "run"
    run(tmp_path, tiny_cifar["folder"], "--quantizer", "hard", "--epochs", "1", "--out", str(out))
    with open(out / "history.jsonl", "a") as f:  # as if killed after writing epoch 2 but before its checkpoint
        f.write(json.dumps({"epoch": 2, "quantizer": "hard", "stale": True}) + "\n")
    history = run(tmp_path, tiny_cifar["folder"], "--quantizer", "hard", "--epochs", "2", "--out", str(out),
                  "--resume")["hard"]
    assert [r["epoch"] for r in history] == [1, 2] and "stale" not in history[1]


def test_resume_refuses_a_checkpoint_of_another_configuration(tmp_path, tiny_cifar):
    out = tmp_path / "run"
    run(tmp_path, tiny_cifar["folder"], "--quantizer", "hard", "--epochs", "1", "--out", str(out))
    with pytest.raises(ValueError, match="num_codes: checkpoint 32 vs now 64"):
        run(tmp_path, tiny_cifar["folder"], "--quantizer", "hard", "--epochs", "2", "--out", str(out),
            "--resume", "--model.num_codes", "64")
    truncated = tmp_path / "truncated.ckpt"
    raw = (out / "checkpoints" / "last.ckpt").read_bytes()
    truncated.write_bytes(raw[: len(raw) // 2])
    with pytest.raises(ValueError, match="truncated.ckpt is truncated or corrupt"):
        run(tmp_path, tiny_cifar["folder"], "--quantizer", "hard", "--epochs", "2", "--out", str(out),
            "--resume", str(truncated))
    with pytest.raises(FileNotFoundError, match="missing.ckpt"):
        run(tmp_path, tiny_cifar["folder"], "--quantizer", "hard", "--epochs", "2", "--out", str(out),
            "--resume", str(tmp_path / "missing.ckpt"))
    # A fresh run into a used directory neither overwrites it silently nor loses the old history.
    before = (out / "history.jsonl").read_text()
    with pytest.raises(FileExistsError, match="--resume .* --overwrite"):
        run(tmp_path, tiny_cifar["folder"], "--quantizer", "hard", "--epochs", "1", "--out", str(out))
    assert (out / "history.jsonl").read_text() == before


def test_overwrite_starts_afresh_without_stale_artefacts(tmp_path, tiny_cifar):
    out = tmp_path / "run"
    run(tmp_path, tiny_cifar["folder"], "--quantizer", "hard", "--epochs", "2", "--out", str(out))
    stale = out / "checkpoints" / "best-epoch99.ckpt"
    stale.write_bytes(b"old")
    history = run(tmp_path, tiny_cifar["folder"], "--quantizer", "hard", "--epochs", "1", "--out", str(out),
                  "--overwrite")["hard"]
    assert [r["epoch"] for r in history] == [1]
    assert not stale.exists() and not (out / "recon_epoch02.png").exists()


def test_checkpoint_loads_back_into_a_model(tmp_path, tiny_cifar):
    """By value, not by shape: the reloaded model's state dict equals the checkpoint's and the trained model's
    (captured by a forward hook during the run) tensor for tensor, the layer's extra state included, and on a fixed
    batch its codes and reconstructions equal the trained model's bit for bit."""
    trained: list[VQVAE] = []

    def capture(module, args, output):  # the model train_vqvae.main builds and trains
        if isinstance(module, VQVAE) and not trained:
            trained.append(module)

    out = tmp_path / "run"
    handle = torch.nn.modules.module.register_module_forward_hook(capture)
    try:
        run(tmp_path, tiny_cifar["folder"], "--quantizer", "ddcl", "--epochs", "1", "--out", str(out),
            "--ddcl.temperature", "0.02", "--ddcl.target_entropy", "null")
    finally:
        handle.remove()
    original = trained[0].eval()
    model = VQVAE.load_from_checkpoint(out / "checkpoints" / "last.ckpt", map_location="cpu").eval()
    assert model is not original
    assert model.quantizer.temperature == 0.02 and model.quantizer.initialized
    saved = torch.load(out / "checkpoints" / "last.ckpt", map_location="cpu", weights_only=True)["state_dict"]
    loaded, reference = model.state_dict(), original.state_dict()
    assert set(loaded) == set(saved) == set(reference)
    for key, value in saved.items():
        if isinstance(value, torch.Tensor):
            assert torch.equal(loaded[key], value) and torch.equal(reference[key], value), key
        else:  # the quantizer's extra state: temperature, initialized, restarts, ...
            assert loaded[key] == value == reference[key], key
    x = torch.rand(4, 3, 32, 32, generator=torch.Generator().manual_seed(7))
    with torch.no_grad():
        codes = model.encode(x)
        assert torch.equal(codes, original.encode(x)) and codes.unique().numel() > 1
        torch.testing.assert_close(model.decode_indices(codes), original.decode_indices(codes), rtol=0, atol=0)
        torch.testing.assert_close(model(x).reconstruction, original(x).reconstruction, rtol=0, atol=0)


def test_missing_data_is_a_clear_error(tmp_path):
    with pytest.raises(FileNotFoundError, match="no CIFAR-10 data found"):
        run(tmp_path, tmp_path / "no-data", "--quantizer", "hard", "--epochs", "1", "--out", str(tmp_path / "o"))


def test_help_documents_every_flag(capsys):
    with pytest.raises(SystemExit) as info:
        train_vqvae.main(["--help"])
    assert info.value.code == 0
    text = capsys.readouterr().out
    for flag in ("--quantizer", "--epochs", "--data.batch_size", "--data.train_subset", "--data.data_root", "--out",
                 "--seed", "--model.num_codes", "--model.code_dim", "--model.width", "--model.lr", "--model.eps",
                 "--ddcl.temperature", "--model.temperature_schedule", "--model.temperature_final",
                 "--hard.commitment_weight", "--hard.ema_decay", "--ddcl.prototype_update.help", "--hard.restart",
                 "--ddcl.restart", "--ddcl.restart.help",
                 "--resume", "--overwrite", "--data.download", "--model.latent_norm", "--ddcl.prototype_update",
                 "--ddcl.commitment_weight", "--ddcl.target_entropy", "--model.target_entropy", "--trainer.devices",
                 "--check_replicas", "--config", "--print_config"):
        assert flag in text, flag


def test_defaults_are_the_collapse_free_recipe_for_ddcl_and_the_plain_baseline_for_hard():
    cfg = config.parse([])
    ddcl, hard = config.model_kwargs(cfg, "ddcl"), config.model_kwargs(cfg, "hard")
    assert ddcl["latent_norm"] is None and ddcl["target_entropy"] == "auto"  # the model's defaults decide
    layer_defaults = {k: p.default for k, p in inspect.signature(DDCLQuantizer).parameters.items()
                      if k not in config.LAYER_SKIP}
    assert ddcl["quantizer_kwargs"] == layer_defaults  # the flags' defaults are the layer's own: its recipe
    assert ddcl["quantizer_kwargs"]["recipe"] == "auto" and ddcl["quantizer_kwargs"]["temperature"] == "auto"
    assert hard["latent_norm"] is None
    assert {k: hard["quantizer_kwargs"][k] for k in ("commitment_weight", "ema_decay", "restart")} == {
        "commitment_weight": 0.25, "ema_decay": None, "restart": None}  # straight-through, gradient codebook
    model = VQVAE(**ddcl)  # what the library's own defaults build: the layer's recipe
    layer = model.quantizer
    assert model.latent_norm == "none" and VQVAE(**hard).latent_norm == "none"
    assert layer.recipe == "auto" and layer.standardize and layer.hard_output and layer.prototype_update == Ema()
    assert layer.restart == Restart(1.0, "auto", 0.25) and layer.temperature is None
    assert layer.target_entropy == pytest.approx(0.5 * math.log(layer.num_codes))  # sqrt(K) prototypes' worth
    assert model.target_entropy is None and VQVAE(**hard).target_entropy is None  # no model-side control

    def build(*argv: str) -> VQVAE:
        return VQVAE(**config.model_kwargs(config.parse(list(argv)), "ddcl"))

    off = build("--ddcl.target_entropy", "null")
    assert off.target_entropy is None and off.quantizer.target_entropy is None
    assert build("--ddcl.target_entropy", "1.5").quantizer.target_entropy == 1.5
    model = build("--ddcl.temperature", "4", "--model.temperature_schedule", "cosine", "--model.temperature_final", "1")
    assert model.target_entropy is None and model.quantizer.target_entropy is None  # the schedule sets T
    # the paper's layer: the model, not the layer, holds T at an entropy of 2.5 nats
    plain = build("--ddcl.recipe", "plain", "--ddcl.temperature", "4")
    assert plain.target_entropy == 2.5 and plain.quantizer.target_entropy is None
    assert plain.quantizer.prototypes.requires_grad and not plain.quantizer.hard_output


@pytest.mark.parametrize("argv, match", [
    # a wrong flag, type or choice: one line naming the flag and what it accepts (softvq.cli.parsing)
    (["--no-such-flag"], "error: --no-such-flag: no such flag"),
    (["--quantizer", "fsq"], "invalid choice"),
    (["--model.width", "wide"], "error: --model.width: expected an integer, got 'wide'"),
    # a value out of range: the constructor's error line, before anything is written
    (["--epochs", "-1"], "error: epochs must be a positive integer, got -1"),
    (["--model.eps", "0"], "error: eps must be a positive finite number, got 0.0"),
    (["--ddcl.temperature", "-0.5"], "error: temperature must be a positive finite number, got -0.5"),
    (["--ddcl.prototype_update.decay", "1.5"], "error: prototype_update.decay must be in (0, 1), got 1.5"),
    (["--quantizer", "hard", "--hard.ema_decay", "1.5"], "error: ema_decay must be None or in (0, 1), got 1.5"),
    (["--model.temperature_schedule", "cosine"], "error: temperature_schedule='cosine' needs temperature_final"),
    (["--ddcl.recipe", "plain", "--model.target_entropy", "2", "--model.temperature_schedule", "linear",
      "--model.temperature_final", "1"], "choose one"),
    (["--ddcl.target_entropy", "-1"], "error: target_entropy must be a positive finite number, got -1.0"),
    (["--model.width", "15"], "error: width must be even"),
])
def test_bad_flags_exit_with_a_message(argv, match, capsys, tmp_path):
    out = tmp_path / "run"
    try:
        code = train_vqvae.cli(["--data.data_root", str(tmp_path / "no-data"), "--out", str(out), *argv])
    except SystemExit as exit_:  # jsonargparse
        code = exit_.code
    assert code == 2
    assert match in capsys.readouterr().err
    assert not out.exists()


def test_script_runs_as_a_command(tmp_path):
    result = subprocess.run([sys.executable, str(ROOT / "train_vqvae.py"), "--data.data_root", str(tmp_path / "none"),
                             "--out", str(tmp_path / "o"), "--epochs", "1"],
                            capture_output=True, text=True, cwd=tmp_path, timeout=120)
    assert result.returncode == 2
    assert "error: no CIFAR-10 data found" in result.stderr and "Traceback" not in result.stderr


def test_last_checkpoint_holds_the_final_epoch_even_when_validation_got_worse(tmp_path):
    # Lightning's save_last=True skipped last.ckpt after an epoch that did not improve the monitored metric.
    data = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(torch.zeros(4, 1)), batch_size=2)
    trainer = L.Trainer(max_epochs=3, logger=False, enable_progress_bar=False, enable_model_summary=False,
                        num_sanity_val_steps=0, callbacks=train_vqvae.checkpoint_callbacks(tmp_path, validation=True))
    trainer.fit(worse_every_epoch_module(), data, data)
    last = torch.load(tmp_path / "last.ckpt", map_location="cpu", weights_only=True)
    assert (last["epoch"], last["global_step"]) == (2, 6)  # 0-based epoch 2 = the third
    assert sorted(p.name for p in tmp_path.iterdir()) == ["best-epoch01.ckpt", "last.ckpt"]  # epochs from 1
    best = torch.load(tmp_path / "best-epoch01.ckpt", map_location="cpu", weights_only=True)
    assert best["global_step"] == 2
    without_val = tmp_path / "no-val"
    trainer = L.Trainer(max_epochs=2, logger=False, enable_progress_bar=False, enable_model_summary=False,
                        limit_val_batches=0, callbacks=train_vqvae.checkpoint_callbacks(without_val, validation=False))
    trainer.fit(worse_every_epoch_module(), data)
    assert sorted(p.name for p in without_val.iterdir()) == ["last.ckpt"]
    assert torch.load(without_val / "last.ckpt", map_location="cpu", weights_only=True)["global_step"] == 4
