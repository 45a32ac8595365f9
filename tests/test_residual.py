"""ResidualDDCL / ResidualHardVQ against references: the output is the sum of the decoded levels, each level sees the
residual computed by hand, every level's identity L_q = L_OLS + V against float64 sums, quantize dropout, layouts,
state dicts. Two gloo processes against one: tests/test_distributed.py (one spawn for every distributed check)."""

from __future__ import annotations

import pytest
import torch

from softvq import DDCLQuantizer
from softvq.residual import ResidualDDCL, ResidualHardVQ, ResidualQuantizer


def trained(model: ResidualQuantizer, steps: int = 5, seed: int = 0) -> ResidualQuantizer:
    g = torch.Generator().manual_seed(seed)
    model.train()
    for _ in range(steps):
        model(torch.randn(256, 8, generator=g, dtype=torch.float64) * 3 + 1)
    return model.eval()


def tokens(n: int = 128, seed: int = 1) -> torch.Tensor:
    return torch.randn(n, 8, generator=torch.Generator().manual_seed(seed), dtype=torch.float64) * 3 + 1


@pytest.mark.parametrize("make", [lambda: ResidualDDCL(3, 16, 8).double(),
                                  lambda: ResidualDDCL(3, 16, 8, scale="per_level").double(),
                                  lambda: ResidualHardVQ(3, 16, 8).double()])
def test_output_is_the_sum_of_the_decoded_levels_and_each_level_sees_the_residual(make):
    model = trained(make())
    z = tokens()
    seen = []
    hooks = [level.register_forward_hook(lambda m, args, out: seen.append(args[0].detach())) for level in model.levels]
    out = model(z)
    for h in hooks:
        h.remove()
    torch.testing.assert_close(out.quantized, model.decode_indices(out.indices), rtol=0, atol=1e-12)
    x = model.standardizer.standardize(z) if model.standardizer is not None else z
    for q, level in enumerate(model.levels):  # level q's input: x minus the codes of the levels before it, by hand
        before = sum((level_j.decode_indices(out.indices[:, j]) for j, level_j in enumerate(model.levels[:q])),
                     torch.zeros_like(x))
        torch.testing.assert_close(seen[q], x - before, rtol=0, atol=1e-12)
        partial = model.decode_indices(out.indices, levels=q + 1)
        torch.testing.assert_close(partial, before + level.decode_indices(out.indices[:, q]), rtol=0, atol=1e-12)
    errors = [float((x - model.decode_indices(out.indices, levels=q)).square().mean()) for q in (1, 2, 3)]
    assert errors[0] > errors[1] > errors[2]  # each level removes part of what is left
    assert out.indices.shape == (128, 3) and out.probs.shape == (128, 3, 16)
    torch.testing.assert_close(out.probs.sum(-1), torch.ones(128, 3, dtype=out.probs.dtype))


def test_every_level_satisfies_the_identity_against_float64_sums():
    model = trained(ResidualDDCL(3, 16, 8).double())
    z = tokens()
    seen = []
    hooks = [level.register_forward_hook(lambda m, args, out: seen.append(args[0].detach())) for level in model.levels]
    out = model(z)  # evaluation: the prototypes the terms used are the ones read below
    for h in hooks:
        h.remove()
    for q, level in enumerate(model.levels):
        r, probs = seen[q], out.probs[:, q].double()
        # the level's codebook space is its input itself (scale "shared": no per-level standardisation)
        p = level.codebook.double()
        mu = probs @ p
        d = torch.cdist(r, p).square()  # (N, K)
        l_q = (probs * d).sum(-1).mean()
        l_ols = (r - mu).square().sum(-1).mean()
        v = (probs * torch.cdist(mu, p).square()).sum(-1).mean()
        torch.testing.assert_close(l_q, l_ols + v, rtol=1e-10, atol=1e-12)  # the identity, by hand
        terms = {k: float(out.terms[f"{k}/level{q}"]) for k in ("l_q", "l_ols", "v")}
        ratio = terms["l_q"] / float(l_q)  # the layer may average over D too: one factor for all three terms
        for name, ours in (("l_q", l_q), ("l_ols", l_ols), ("v", v)):
            assert terms[name] == pytest.approx(float(ours) * ratio, rel=1e-6), (q, name)
        assert float(out.terms[f"identity_residual/level{q}"]) < 1e-9


def test_quantize_dropout_runs_the_first_levels_and_draws_alike_everywhere():
    a = ResidualDDCL(4, 8, 8, quantize_dropout=True, quantize_dropout_min_levels=2, seed=3).double().train()
    b = ResidualDDCL(4, 8, 8, quantize_dropout=True, quantize_dropout_min_levels=2, seed=3).double().train()
    counts = []
    for step in range(12):  # two instances (two DDP processes) draw the same level counts from seed and step alone
        x = tokens(64, seed=step)
        torch.manual_seed(step)  # the global random state plays no part in the draw
        expected = a.active_levels()
        out = a(x)
        torch.manual_seed(100 + step)
        assert b.active_levels() == expected
        b(x)
        counts.append(expected)
        assert (out.indices[:, expected:] == -1).all() and (out.indices[:, :expected] >= 0).all()
        assert float(out.terms["levels"]) == expected
        assert bool(torch.isnan(out.terms[f"l_q/level{expected - 1}"]).logical_not())
        if expected < 4:
            assert torch.isnan(out.terms["l_q/level3"]) and (out.probs[:, 3] == 0).all()
    assert set(counts) <= {2, 3, 4} and len(set(counts)) > 1
    a.eval()
    out = a(tokens(32, seed=50))
    assert (out.indices >= 0).all()  # evaluation runs every level
    cut = out.indices.clone()
    cut[:, 2:] = -1  # a code grid of the first 2 levels decodes as the first 2 levels
    torch.testing.assert_close(a.decode_indices(cut), a.decode_indices(out.indices, levels=2), rtol=0, atol=0)


def test_channel_first_matches_channel_last_and_the_state_dict_round_trips():
    last = trained(ResidualDDCL(2, 16, 8).double())
    first = ResidualDDCL(2, 16, 8, channel_first=True).double()
    first.load_state_dict(last.state_dict())
    first.eval()
    maps = tokens(2 * 5 * 6).reshape(2, 5, 6, 8)
    a, b = last(maps), first(maps.movedim(-1, 1))
    assert torch.equal(a.indices, b.indices) and b.indices.shape == (2, 5, 6, 2)
    torch.testing.assert_close(b.quantized, a.quantized.movedim(-1, 1), rtol=0, atol=0)
    torch.testing.assert_close(first.decode_indices(b.indices), b.quantized, rtol=0, atol=1e-12)


def test_bad_input_and_options_are_clear_errors():
    model = ResidualDDCL(2, 16, 8)
    with pytest.raises(ValueError, match=r"expected tokens of shape \(\.\.\., 8\), got \(4, 7\)"):
        model(torch.randn(4, 7))
    with pytest.raises(ValueError, match=r"expected indices of shape \(\.\.\., 2\)"):
        model.decode_indices(torch.zeros(4, 3, dtype=torch.long))
    with pytest.raises(ValueError, match="levels must be at most num_quantizers=2, got 3"):
        model.decode_indices(torch.zeros(4, 2, dtype=torch.long), levels=3)
    with pytest.raises(ValueError, match="or be -1"):
        model.decode_indices(torch.full((4, 2), -2))
    with pytest.raises(ValueError, match="standardize is set by ResidualDDCL"):
        ResidualDDCL(2, 16, 8, standardize=True)
    with pytest.raises(ValueError, match="scale must be one of"):
        ResidualDDCL(2, 16, 8, scale="global")
    with pytest.raises(ValueError, match="quantize_dropout_min_levels must be at most num_quantizers=2, got 3"):
        ResidualDDCL(2, 16, 8, quantize_dropout=True, quantize_dropout_min_levels=3)
    with pytest.raises(ValueError, match="num_quantizers must be a positive integer, got 0"):
        ResidualHardVQ(0, 16, 8)
    with pytest.raises(ValueError, match="same num_codes and dim"):
        ResidualQuantizer([ResidualHardVQ(1, 16, 8).levels[0], ResidualHardVQ(1, 8, 8).levels[0]])


@pytest.mark.filterwarnings("ignore::UserWarning")
@pytest.mark.parametrize("name", ["rddcl", "rhard"])
def test_vqvae_trains_a_residual_stack_with_per_level_health_and_codes(name, tmp_path):
    import json

    import lightning as L
    from torch.utils.data import DataLoader, TensorDataset

    from softvq.models import VQVAE, load_vqvae
    from softvq.models.callbacks import HistoryWriter
    from softvq.models.codes import extract_codes

    torch.manual_seed(0)
    images = torch.rand(48, 3, 16, 16)
    loader = DataLoader(TensorDataset(images, torch.zeros(48, dtype=torch.long)), batch_size=16)
    model = VQVAE(name, num_codes=16, code_dim=8, width=16, res_hidden=8, res_blocks=1, num_quantizers=3)
    trainer = L.Trainer(max_epochs=1, logger=False, enable_progress_bar=False, enable_model_summary=False,
                        default_root_dir=tmp_path, callbacks=[HistoryWriter(tmp_path / "h.jsonl", echo=False)])
    trainer.fit(model, loader, loader)
    record = json.loads((tmp_path / "h.jsonl").read_text().splitlines()[-1])
    for q in range(3):  # every level's health, in training and on held-out images
        assert {f"utilization_l{q}", f"perplexity_l{q}", f"restarts_l{q}", f"val_utilization_l{q}"} <= set(record)
    assert ("temperature_l2" in record) == (name == "rddcl")
    model.eval()
    codes = model.encode(images[:4])
    assert codes.shape == (4, 4, 4, 3)
    with torch.no_grad():
        out = model(images[:4])
    torch.testing.assert_close(model.decode_indices(codes), out.reconstruction)  # hard output: the codes decode alike
    first = model.decode_indices(codes, num_levels=1)
    torch.testing.assert_close(first, model._decode(model.quantizer.levels[0].decode_indices(codes[..., 0])))
    path = tmp_path / "m.ckpt"
    trainer.save_checkpoint(path)
    loaded = load_vqvae(path)
    assert loaded.num_quantizers == 3 and torch.equal(loaded.encode(images[:4]), codes)
    with pytest.raises(ValueError, match=f"{name} has 3 residual levels"):
        extract_codes(model, TensorDataset(images[:4], torch.zeros(4, dtype=torch.long)))
    with pytest.raises(ValueError, match=r"expected indices of shape \(B, h, w, 3\)"):
        model.decode_indices(codes[..., 0])
    with pytest.raises(ValueError, match="num_quantizers=2 stacks residual codebooks"):
        VQVAE("ddcl", num_codes=16, code_dim=8, num_quantizers=2)
    with pytest.raises(ValueError, match="takes neither levels > 1"):
        VQVAE(name, num_codes=16, code_dim=8, num_quantizers=2, levels=2)


def test_softvq_train_runs_residual_stacks_side_by_side(tmp_path, tiny_cifar):
    import json

    from PIL import Image

    from softvq.cli import train

    train.main(["--quantizer", "rddcl", "rhard", "--model.num_quantizers", "3", "--data.data_root",
                str(tiny_cifar["folder"]), "--data.train_subset", "96", "--data.val_size", "32", "--data.batch_size",
                "32", "--model.width", "16", "--model.res_hidden", "8", "--model.res_blocks", "1", "--model.code_dim",
                "8", "--model.num_codes", "16", "--data.num_workers", "0", "--trainer.progress_bar", "false",
                "--epochs", "1", "--rddcl.scale", "per_level", "--out", str(tmp_path)])
    for name in ("rddcl", "rhard"):
        record = json.loads((tmp_path / name / "history.jsonl").read_text().splitlines()[-1])
        assert {"val_utilization_l2", "perplexity_l2", "restarts_l2"} <= set(record)
        config = json.loads((tmp_path / name / "config.json").read_text())
        assert config["model"]["num_quantizers"] == 3 and name in config
        with Image.open(tmp_path / name / "recon_epoch01.png") as png:  # 3 rows + decodes of the first 1 and 2 levels
            width, height = png.size
        assert height / width > 0.5  # five rows of 8 images (three rows would be about 0.35-0.45)
    assert json.loads((tmp_path / "rddcl" / "config.json").read_text())["rddcl"]["scale"] == "per_level"


def test_vqvae_trains_with_quantize_dropout_and_counts_only_the_levels_that_ran():
    from softvq.models import VQVAE

    torch.manual_seed(0)
    images = torch.rand(16, 3, 16, 16)  # 16 images x 16 positions = 256 tokens a step
    quantizer = ResidualDDCL(3, 16, 8, quantize_dropout=True, seed=5)
    reference = ResidualDDCL(3, 16, 8, quantize_dropout=True, seed=5).train()
    model = VQVAE(quantizer=quantizer, code_dim=8, width=16, res_hidden=8, res_blocks=1)
    model.train()
    ran = []
    for step in range(8):
        reference.steps.fill_(step)
        ran.append(reference.active_levels())  # the draw of this step, replayed from the seed and the step count
        loss = model.training_step((images, torch.zeros(16, dtype=torch.long)), step)
        assert torch.isfinite(loss)
    assert len(set(ran)) > 1  # the draws skipped levels on some steps
    for q, metrics in enumerate(model.level_metrics):
        steps = sum(n > q for n in ran)
        assert int(metrics.train_usage.hard_counts.sum()) == 256 * steps  # a skipped level counts nothing
    model.eval()
    with torch.no_grad():  # evaluation runs every level
        assert bool((model(images).quantizer.indices >= 0).all())


def test_each_stack_states_its_standardisers_clip():
    """The shared standardiser keeps Ioffe's clip, where the stack was measured; per-level levels take the layer's."""
    assert ResidualDDCL(2, 8, 4).standardizer.renorm_clip == (3.0, 5.0)
    assert ResidualDDCL(2, 8, 4, renorm_clip=(1.1, 0.1)).standardizer.renorm_clip == (1.1, 0.1)
    per_level = ResidualDDCL(2, 8, 4, scale="per_level")
    assert per_level.standardizer is None
    assert {level.standardizer.renorm_clip for level in per_level.levels} == {(1.1, 0.1)}  # the layer's default
    assert DDCLQuantizer(8, 4).standardizer.renorm_clip == (1.1, 0.1)
