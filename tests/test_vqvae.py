"""models/: encoder/decoder shapes, VQVAE encode/decode against the parts, per-epoch summary by hand."""

from __future__ import annotations

import copy
import math

import pytest
import torch
from einops import rearrange
from helpers import exact_cdist

import softvq
from softvq.models import VQVAE, Decoder, Encoder, build_quantizer
from softvq.models._temperature import ModelEntropyControl, ScheduledTemperature
from softvq.models.vqvae import LatentNorm
from softvq.parts import NormalInit, TemperatureControl
from softvq.schedule import anneal_temperature

SMALL = {"num_codes": 16, "code_dim": 8, "width": 16, "res_hidden": 8, "res_blocks": 1}


@pytest.mark.parametrize("downsamples, size", [(1, 16), (2, 8), (3, 4)])
def test_encoder_decoder_shapes(downsamples, size):
    enc = Encoder(width=16, res_hidden=8, res_blocks=2, downsamples=downsamples, code_dim=5)
    dec = Decoder(width=16, res_hidden=8, res_blocks=2, upsamples=downsamples, code_dim=5)
    z = enc(torch.rand(2, 3, 32, 32))
    assert z.shape == (2, 5, size, size)
    assert dec(z).shape == (2, 3, 32, 32)


@pytest.mark.parametrize("kwargs, match", [
    ({"width": 15}, "width must be even"),
    ({"width": 0}, "width"),
    ({"res_blocks": -1}, "res_blocks"),
    ({"downsamples": 0}, "downsamples"),
    ({"code_dim": 0}, "code_dim"),
])
def test_encoder_rejects_bad_configs(kwargs, match):
    with pytest.raises(ValueError, match=match):
        Encoder(**kwargs)


@pytest.mark.parametrize("name", ["ddcl", "hard"])
def test_encode_and_decode_match_the_parts(name):
    """encode/decode against the parts, and the layouts checked by value: code_dim 6 on an 8x8 grid (with D equal to
    the grid size a (B, h, w, D) tensor has the shape of a (B, D, h, w) one), ``out.latents[:, :, i, j]`` is the
    encoder's conv output at (i, j) and ``quantized[:, i, j]`` the codebook row of ``indices[:, i, j]``. The codes
    are 16 of the batch's own tokens: a fresh encoder's latents barely vary, and a random codebook sends them all to
    one code, which no layout bug can change."""
    torch.manual_seed(0)
    options = {"init": NormalInit(0.1)} if name == "ddcl" else {}
    model = VQVAE(name, quantizer_kwargs=options, **{**SMALL, "code_dim": 6}).eval()
    x = torch.rand(3, 3, 32, 32)
    with torch.no_grad():
        conv = model.norm(model.encoder(x - 0.5))  # a conv stack's output: (B, D, h, w) by construction
        assert conv.shape == (3, 6, 8, 8)
        tokens = rearrange(conv, "b d h w -> (b h w) d")
        rows = tokens[torch.randperm(len(tokens))[:16]]
        model.quantizer.prototypes.copy_(rows)
        assert torch.equal(rearrange(model.latents(x), "b d h w -> (b h w) d"), tokens)
        codebook = model.quantizer.codebook
        expected = exact_cdist(tokens.double(), codebook.double()).argmin(dim=1).reshape(3, 8, 8)
        indices = model.encode(x)
        assert indices.shape == (3, 8, 8) and torch.equal(indices, expected)
        assert indices.unique().numel() > 8 and not torch.equal(indices, indices.transpose(1, 2))
        images = model.decode_indices(indices)
        by_hand = model.decoder(rearrange(codebook[indices], "b h w d -> b d h w")) + 0.5
        assert images.shape == x.shape and torch.allclose(images, by_hand, atol=1e-6)
        out = model(x)
    assert out.reconstruction.shape == x.shape and out.latents.shape == (3, 6, 8, 8)
    quantized = out.quantizer.quantized
    assert quantized.shape == (3, 8, 8, 6) and torch.equal(out.quantizer.indices, indices)
    for i, j in ((0, 0), (2, 5), (7, 3)):  # off-diagonal cells too: a transposed grid fails there
        assert torch.equal(out.latents[:, :, i, j], conv[:, :, i, j]), (i, j)
        torch.testing.assert_close(quantized[:, i, j], codebook[indices[:, i, j]], rtol=0, atol=1e-6)
    if name == "hard":  # straight-through: the forward value is the hard decode
        assert torch.allclose(out.reconstruction, images, atol=1e-6)


def test_batch_latent_norm_standardises_channels_and_undoes_any_encoder_scale():
    """The DDCL default: the quantizer sees per-channel standardised latents, so the encoder cannot shrink them."""
    torch.manual_seed(1)
    model = VQVAE("ddcl", quantizer_kwargs={"init": "normal", "recipe": "plain"}, latent_norm="batch", **SMALL)
    # a single DDCL layer standardises its tokens itself; the hierarchy (plain levels) keeps the model's LatentNorm
    assert VQVAE("ddcl", **SMALL).latent_norm == "none" and VQVAE("hard", **SMALL).latent_norm == "none"
    assert VQVAE("ddcl", levels=2, level_codes=8, **SMALL).latent_norm == "batch"
    x = torch.rand(6, 3, 32, 32)
    last = model.encoder.net[-1]  # the 1x1 convolution that produces the latents
    with torch.no_grad():
        last.weight.mul_(100.0)  # raw latent variance ~1 (far above BatchNorm's eps of 1e-5)
        last.bias.mul_(100.0)
        out = model(x)
        flat = rearrange(out.latents, "b d h w -> d (b h w)").double()
        torch.testing.assert_close(flat.mean(1), torch.zeros(8, dtype=torch.float64), atol=1e-5, rtol=0)
        torch.testing.assert_close(flat.var(1, unbiased=False), torch.ones(8, dtype=torch.float64), atol=1e-3, rtol=0)
        last.weight.mul_(0.1)  # the encoder shrinks its outputs tenfold: the quantizer sees the same tokens
        last.bias.mul_(0.1)
        shrunk = model(x)
    torch.testing.assert_close(shrunk.latents, out.latents, atol=1e-3, rtol=1e-3)
    torch.testing.assert_close(shrunk.reconstruction, out.reconstruction, atol=1e-3, rtol=1e-3)


def test_latent_norm_running_statistics_start_from_the_first_batch():
    """Evaluation right after a short run must standardise like training did, not divide by BatchNorm's initial 1."""
    torch.manual_seed(0)
    norm = LatentNorm(4).double()
    batches = [1e-2 * torch.randn(8, 4, 3, 3, dtype=torch.float64) + 0.5 for _ in range(3)]

    def stats(x):  # the running statistics BatchNorm keeps: mean and unbiased variance per channel
        flat = rearrange(x, "b d h w -> d (b h w)")
        return flat.mean(1), flat.var(1, unbiased=True)

    norm(batches[0])
    mean, var = stats(batches[0])
    torch.testing.assert_close(norm.running_mean, mean, rtol=1e-12, atol=0)
    torch.testing.assert_close(norm.running_var, var, rtol=1e-12, atol=0)
    for x in batches[1:]:  # afterwards the usual 10% exponential average
        norm(x)
        new_mean, new_var = stats(x)
        mean, var = 0.9 * mean + 0.1 * new_mean, 0.9 * var + 0.1 * new_var
    torch.testing.assert_close(norm.running_mean, mean, rtol=1e-12, atol=0)
    torch.testing.assert_close(norm.running_var, var, rtol=1e-12, atol=0)
    assert norm.momentum == 0.1 and int(norm.num_batches_tracked) == 3
    norm.eval()
    x = batches[0]
    expected = (x - mean[None, :, None, None]) / torch.sqrt(var[None, :, None, None] + norm.eps)
    torch.testing.assert_close(norm(x), expected, rtol=1e-12, atol=1e-12)
    state = norm.state_dict()  # the same buffers as nn.BatchNorm2d: old checkpoints load
    assert set(state) == set(torch.nn.BatchNorm2d(4, affine=False).state_dict())


@pytest.mark.parametrize("x, match", [
    (torch.rand(2, 1, 32, 32), r"shape \(B, 3, H, W\)"),
    (torch.rand(3, 32, 32), r"shape \(B, 3, H, W\)"),
    (torch.rand(2, 3, 30, 32), "multiples of 4"),
    (torch.zeros(2, 3, 32, 32, dtype=torch.uint8), "float images"),
])
def test_bad_images_are_rejected(x, match):
    with pytest.raises(ValueError, match=match):
        VQVAE("hard", **SMALL)(x)


def test_bad_model_options_are_rejected():
    with pytest.raises(ValueError, match="quantizer must be one of"):
        VQVAE("fsq", **SMALL)
    with pytest.raises(ValueError, match="invalid option for quantizer 'hard'"):
        VQVAE("hard", quantizer_kwargs={"temperature": 0.5}, **SMALL)
    with pytest.raises(ValueError, match="temperature"):
        VQVAE("ddcl", quantizer_kwargs={"temperature": -1.0}, **SMALL)
    with pytest.raises(ValueError, match="needs temperature_final"):
        VQVAE("ddcl", temperature_schedule="cosine", **SMALL)
    with pytest.raises(ValueError, match="needs a quantizer with a temperature"):
        VQVAE("hard", temperature_schedule="linear", temperature_final=0.1, **SMALL)
    with pytest.raises(ValueError, match="eps"):
        VQVAE("ddcl", eps=0.0, **SMALL)


def test_any_quantizer_module_can_be_plugged_in():
    quantizer = softvq.DDCLQuantizer(16, 8, temperature=0.1, distance="cosine")
    model = VQVAE(quantizer, **SMALL)
    assert model.quantizer is quantizer and "quantizer" not in model.hparams
    with pytest.raises(ValueError, match="differs from code_dim"):
        VQVAE(softvq.HardVQ(16, 4), **SMALL)


def test_optimizer_gives_prototypes_lr_over_eps():
    ddcl = VQVAE("ddcl", lr=2e-4, eps=0.05, quantizer_kwargs={"prototype_update": "gradient"},
                 **SMALL).configure_optimizers()
    lrs = {g["name"]: g["lr"] for g in ddcl.param_groups}
    assert lrs == pytest.approx({"model": 2e-4, "prototypes": 4e-3})
    model = VQVAE("ddcl", **SMALL)  # the default: the layer moves its prototypes, the optimizer never sees them
    optimized = {id(p) for g in model.configure_optimizers().param_groups for p in g["params"]}
    assert id(model.quantizer.prototypes) not in optimized and id(model.encoder.net[0].weight) in optimized
    hard = VQVAE("hard", lr=2e-4, **SMALL).configure_optimizers()
    assert len(hard.param_groups) == 1 and hard.param_groups[0]["lr"] == 2e-4


def test_epoch_summary_counts_the_whole_epoch(recwarn):
    torch.manual_seed(0)
    # a layer without in-forward updates (EMA, restarts, T control, batch renormalisation's running statistics), so
    # that the recomputation below repeats the step
    model = VQVAE("ddcl", quantizer_kwargs={"temperature": 0.05, "target_entropy": None, "restart": None,
                                            "prototype_update": "gradient", "renorm": False}, **SMALL)
    model.on_train_epoch_start()
    batches = [torch.rand(5, 3, 32, 32), torch.rand(3, 3, 32, 32), torch.rand(4, 3, 32, 32)]
    indices, sq_errors, terms = [], [], []
    for x in batches:
        loss = model.training_step((x, torch.zeros(len(x))), 0)
        loss.backward()  # no optimizer step: the recomputation below sees the same weights
        with torch.no_grad():
            out = model(x)
        indices.append(out.quantizer.indices.flatten())
        sq_errors.append(((out.reconstruction - x) ** 2).mean(dim=(1, 2, 3)))
        terms.append(out.quantizer.terms)
    record = model.epoch_summary()
    everything = torch.cat(indices)
    counts = torch.bincount(everything, minlength=16).double()
    p = counts[counts > 0] / counts.sum()
    assert record["utilization"] == pytest.approx(float((counts > 0).sum()) / 16)
    assert record["dead_codes"] == int((counts == 0).sum())
    assert record["perplexity"] == pytest.approx(math.exp(float(-(p * p.log()).sum())), rel=1e-6)
    assert record["train_mse"] == pytest.approx(float(torch.cat(sq_errors).mean()), rel=1e-5)
    weights = torch.tensor([5.0, 3.0, 4.0])
    for name in ("l_q", "l_ols", "v"):
        mean = float((torch.stack([t[name] for t in terms]) * weights).sum() / weights.sum())
        assert record[name] == pytest.approx(mean, rel=1e-5)
    assert record["identity_residual"] == pytest.approx(max(float(t["identity_residual"]) for t in terms))
    assert record["identity_residual"] < 1e-5
    separation = softvq.prototype_separation(model.quantizer.codebook)
    assert record["separation_min"] == pytest.approx(float(separation["min"]))
    assert record["temperature"] == 0.05 and record["epoch"] == 1 and record["quantizer"] == "ddcl"
    assert record["val_psnr"] is None  # no validation ran
    assert model.epoch_summary() is record  # computed once per epoch


def test_validation_psnr_is_per_image_and_hard_decode_is_reported():
    torch.manual_seed(1)
    model = VQVAE("ddcl", quantizer_kwargs={"temperature": 0.5, "init": NormalInit(0.1),
                                            "hard_output": False}, **SMALL).eval()
    x = torch.rand(6, 3, 32, 32)
    model.on_validation_epoch_start()
    with torch.no_grad():
        model.validation_step((x, torch.zeros(6)), 0)
        soft = model(x).reconstruction.clamp(0, 1)
        hard = model.decode_indices(model.encode(x)).clamp(0, 1)
    for metric, rec in (("psnr", soft), ("psnr_hard", hard)):
        per_image = 10 * torch.log10(1.0 / ((rec - x) ** 2).mean(dim=(1, 2, 3)))
        assert float(model.val_metrics[metric].compute()) == pytest.approx(float(per_image.mean()), rel=1e-5)
    assert float(model.val_metrics["mse"].compute()) != pytest.approx(float(model.val_metrics["mse_hard"].compute()))


def test_temperature_follows_the_schedule():
    model = VQVAE("ddcl", quantizer_kwargs={"temperature": 1.0}, temperature_schedule="exponential",
                  temperature_final=0.01, **SMALL)

    class FakeTrainer:
        estimated_stepping_batches = 11
        global_step = 0

    model.trainer = FakeTrainer()
    for step in (0, 5, 10):
        FakeTrainer.global_step = step
        model.on_train_batch_start(None, 0)
        assert model.quantizer.temperature == pytest.approx(10 ** (-2 * step / 10))


def test_entropy_controlled_temperature_follows_the_measured_entropy(recwarn):
    torch.manual_seed(2)
    model = VQVAE("ddcl", quantizer_kwargs={"temperature": 0.3, "init": "normal", "restart": None,
                                            "recipe": "plain"}, target_entropy=0.5, temperature_rate=0.2, **SMALL)
    for _ in range(3):
        x = torch.rand(4, 3, 32, 32)
        before = model.quantizer.temperature
        with torch.no_grad():
            entropy = float(softvq.assignment_entropy(model(x).quantizer.probs))  # same weights, same batch
        model.training_step((x, torch.zeros(4)), 0)
        assert model.quantizer.temperature == pytest.approx(before * math.exp(0.2 * (0.5 - entropy)), rel=1e-5)
    with pytest.raises(ValueError, match="choose one"):
        VQVAE("ddcl", target_entropy=1.0, temperature_schedule="linear", temperature_final=0.1,
              quantizer_kwargs={"recipe": "plain"}, **SMALL)
    with pytest.raises(ValueError, match="controls its own temperature"):  # the default layer holds its own target
        VQVAE("ddcl", target_entropy=1.0, **SMALL)
    with pytest.raises(ValueError, match="target_entropy"):
        VQVAE("hard", target_entropy=1.0, **SMALL)


def test_the_model_side_temperature_is_the_layers_own_part_with_the_models_rule(recwarn):
    """The model's mechanism takes the codebook's TemperatureControl's place, carrying its T: the layer reads, saves
    and restores that T as any part's, its own control stays off, and the part is kept from step to step."""
    torch.manual_seed(4)
    model = VQVAE("ddcl", quantizer_kwargs={"temperature": 0.3, "recipe": "plain"}, target_entropy=0.5,
                  temperature_rate=0.2, **SMALL)
    assert type(model.quantizer.temperature_control) is TemperatureControl  # nothing taken over before training
    x = torch.rand(4, 3, 32, 32)
    model.training_step((x, torch.zeros(4)), 0)
    part = model.quantizer.temperature_control
    assert isinstance(part, ModelEntropyControl) and isinstance(part, TemperatureControl)
    assert part.settings == (0.5, 0.2) and model.quantizer.target_entropy is None
    assert model.quantizer.temperature != 0.3 and part.temperature == model.quantizer.temperature
    model.training_step((x, torch.zeros(4)), 1)
    assert model.quantizer.temperature_control is part
    fresh = VQVAE("ddcl", quantizer_kwargs={"temperature": 0.3, "recipe": "plain"}, target_entropy=0.5,
                  temperature_rate=0.2, **SMALL)
    fresh.load_state_dict(model.state_dict())  # T travels in the layer's extra state, as the plain part's
    assert fresh.quantizer.temperature == part.temperature

    scheduled = VQVAE("ddcl", levels=2, level_codes=8, temperature_schedule="linear", temperature_final=0.5, **SMALL)

    class FakeTrainer:
        estimated_stepping_batches = 5
        global_step = 4

    scheduled.trainer = FakeTrainer()
    scheduled.on_train_batch_start(None, 0)
    for level in scheduled.quantizer.levels:  # each level's own part, at the schedule's end
        assert isinstance(level.temperature_control, ScheduledTemperature)
        assert level.temperature == pytest.approx(0.5)


def test_plain_layer_with_its_own_target_keeps_its_temperature_to_itself():
    # recipe="plain" with a target of its own: the model-side "auto" target (2.5 nats) must not also set T
    torch.manual_seed(3)
    model = VQVAE("ddcl", quantizer_kwargs={"recipe": "plain", "target_entropy": 2.0, "temperature": 0.5}, **SMALL)
    assert model.target_entropy is None and model.quantizer.target_entropy == 2.0
    assert VQVAE("ddcl", quantizer_kwargs={"recipe": "plain"}, **SMALL).target_entropy == 2.5  # no target: the model's
    x = torch.rand(4, 3, 32, 32)
    alone = copy.deepcopy(model)
    alone.train()
    alone(x)  # the layer's own control, once
    model.training_step((x, torch.zeros(4)), 0)
    assert model.quantizer.temperature != 0.5
    assert model.quantizer.temperature == pytest.approx(alone.quantizer.temperature, rel=1e-6)


def test_adapt_temperature_known_values_and_errors():
    assert softvq.adapt_temperature(4.0, 3.0, 2.5, rate=0.1) == pytest.approx(4.0 * math.exp(-0.05))
    assert softvq.adapt_temperature(4.0, 2.0, 2.5, rate=0.1) == pytest.approx(4.0 * math.exp(0.05))
    assert softvq.adapt_temperature(4.0, 2.5, 2.5) == 4.0
    for kwargs, match in (({"temperature": 0.0}, "temperature"), ({"entropy": float("nan")}, "entropy"),
                          ({"rate": -1.0}, "rate"), ({"target_entropy": -0.1}, "target_entropy")):
        args = {"temperature": 1.0, "entropy": 1.0, "target_entropy": 1.0, **kwargs}
        with pytest.raises(ValueError, match=match):
            softvq.adapt_temperature(**args)


@pytest.mark.parametrize("schedule, expected", [
    ("constant", [2.0, 2.0, 2.0]),
    ("linear", [2.0, 1.25, 0.5]),
    ("cosine", [2.0, 1.25, 0.5]),
    ("exponential", [2.0, 1.0, 0.5]),
])
def test_anneal_temperature_known_values(schedule, expected):
    got = [anneal_temperature(2.0, 0.5, t, schedule) for t in (0.0, 0.5, 1.0)]
    assert got == pytest.approx(expected)
    assert anneal_temperature(2.0, 0.5, 1.7, schedule) == pytest.approx(expected[-1])  # clamped


def test_cosine_schedule_shape():
    # cosine: slow start, slow end; at 1/4 it has covered (1 - cos(pi/4)) / 2 of the way
    assert anneal_temperature(1.0, 0.0 + 1e-9, 0.25, "cosine") == pytest.approx(1 - (1 - math.cos(math.pi / 4)) / 2)


@pytest.mark.parametrize("args, match", [
    ((0.0, 0.1, 0.5, "linear"), "start"),
    ((1.0, -0.1, 0.5, "linear"), "end"),
    ((1.0, 0.1, float("nan"), "linear"), "progress"),
    ((1.0, 0.1, 0.5, "step"), "schedule"),
])
def test_anneal_temperature_errors(args, match):
    with pytest.raises(ValueError, match=match):
        anneal_temperature(*args)


def test_build_quantizer_passes_options():
    """Options reach the layer; and each built layer's codes are the rows of its state dict (``prototypes``, read by
    key, not through ``codebook``): ``decode_indices`` of given indices returns those rows,
    and in evaluation it picks and outputs the row that brute-force nearest neighbour picks for tokens placed next
    to known rows (an independent reference, where ``codebook == prototypes`` held by construction)."""
    q = build_quantizer("hard", 8, 4, commitment_weight=0.5, ema_decay=0.9)
    assert isinstance(q, softvq.HardVQ) and q.commitment_weight == 0.5 and q.ema_decay == 0.9
    q = build_quantizer("ddcl", 8, 4, temperature=0.3, prototype_update="soft_ema")
    assert isinstance(q, softvq.DDCLQuantizer) and q.temperature == 0.3
    assert q.prototype_update == softvq.parts.Ema(soft=True)
    with pytest.raises(ValueError, match="invalid option for quantizer 'ddcl'"):
        build_quantizer("ddcl", 8, 4, epsilon=0.5)
    torch.manual_seed(0)
    for name, options in (("hard", {}), ("ddcl", {"init": "normal"})):
        layer = build_quantizer(name, 8, 4, **options).eval()
        rows = layer.state_dict()["prototypes"].clone()  # (K, D)
        given = torch.tensor([[5, 0, 7], [2, 5, 1]])
        assert torch.equal(layer.decode_indices(given), rows[given]), name
        chosen = torch.tensor([3, 6, 0, 6, 1, 4])
        tokens = rows[chosen] + 1e-3 * torch.randn(len(chosen), 4)  # far closer to their row than to any other
        nearest = (tokens[:, None, :] - rows[None, :, :]).square().sum(-1).argmin(1)  # brute force, (N, K)
        assert torch.equal(nearest, chosen), name
        with torch.no_grad():
            out = layer(tokens)
        assert torch.equal(out.indices, nearest), name
        torch.testing.assert_close(out.quantized, rows[nearest], rtol=0, atol=1e-6, msg=name)


def test_a_checkpoint_from_before_the_in_layer_recipe_loads_and_evaluates_as_trained(tmp_path):
    """A VQ-VAE checkpoint written before the layer carried its recipe (main 39fa6bd: hyperparameters without
    ``recipe``, LatentNorm on, a layer state without the standardiser, EMA buffers or a version key) loads with
    ``load_vqvae`` as the plain layer it was, and the model-side temperature control comes back on for resuming."""
    import lightning as L

    from softvq.models import load_vqvae

    torch.manual_seed(0)
    old_kwargs = {"temperature": 4.0, "distance": "euclidean", "codebook_term": "free_energy", "codebook_weight": 1.0,
                  "commitment_term": "l_ols", "commitment_weight": 0.0, "init": "data", "dead_code_threshold": 1.0}
    trained = VQVAE("ddcl", quantizer_kwargs={**old_kwargs, "recipe": "plain"}, latent_norm="batch", **SMALL)
    trained.training_step((torch.rand(4, 3, 32, 32), torch.zeros(4)), 0)  # data init, LatentNorm statistics
    state = trained.state_dict()
    for key in [k for k in state if k.startswith(("quantizer.ema.", "quantizer.standardizer."))]:
        del state[key]
    state["quantizer.usage"] = state.pop("quantizer.dead_codes.usage")  # the name of the time
    state["quantizer._extra_state"] = {k: v for k, v in state["quantizer._extra_state"].items() if k != "version"}
    hparams = {**dict(trained.hparams), "quantizer_kwargs": old_kwargs}  # no "recipe": today's default is "auto"
    path = tmp_path / "old.ckpt"
    torch.save({"state_dict": state, "hyper_parameters": hparams, "epoch": 0, "global_step": 1,
                "pytorch-lightning_version": L.__version__}, path)
    model = load_vqvae(path)
    layer = model.quantizer
    assert layer.recipe == "plain" and not layer.standardize and not layer.hard_output
    assert model.target_entropy == 2.5  # the model-side control of T the run was trained with
    x = torch.rand(3, 3, 32, 32)
    trained.eval()
    with torch.no_grad():
        assert torch.equal(model.encode(x), trained.encode(x))
        torch.testing.assert_close(model(x).reconstruction, trained(x).reconstruction, rtol=0, atol=0)
