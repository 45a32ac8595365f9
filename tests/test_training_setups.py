"""The layers in the setups real training uses, each against an independent reference: bf16 (a float32 layer),
codes that win nothing (where they started), activation checkpointing and gradient accumulation (the same steps
without them), strict loading (the keys by hand), options that do what they say (the default, the formula by hand),
and the trainer's accumulation and clipping flags (the optimizer's own calls)."""

from __future__ import annotations

import copy
import json
import math
import warnings

import pytest
import torch
from torch.utils.checkpoint import checkpoint

from softvq import DDCLQuantizer, HardVQ
from softvq._compat import upgrade_quantizer_kwargs
from softvq.parts import Ema, Restart


def _clustered(generator: torch.Generator, n: int = 256) -> torch.Tensor:
    centers = torch.randn(16, 8, generator=torch.Generator().manual_seed(0)) * 3
    return centers[torch.randint(16, (n,), generator=generator)] + 0.5 * torch.randn(n, 8, generator=generator)


# ---- numerics and precision ----------------------------------------------------------------------------------------
@pytest.mark.parametrize("make", [lambda: DDCLQuantizer(32, 8), lambda: HardVQ(32, 8, ema_decay=0.99)])
def test_state_never_goes_below_float32_and_double_keeps_float64(make):
    layer = make()
    for cast, dtype in ((lambda m: m.to(torch.bfloat16), torch.float32), (lambda m: m.half(), torch.float32),
                        (lambda m: m.double(), torch.float64)):
        moved = cast(copy.deepcopy(layer))
        state = {k: v for k, v in moved.state_dict().items() if torch.is_tensor(v) and v.is_floating_point()}
        assert state and {v.dtype for v in state.values()} == {dtype}, {k: v.dtype for k, v in state.items()}
        if isinstance(moved, DDCLQuantizer):
            assert moved.temperature_control.temperature_t.dtype == torch.float64
    before = layer.codebook.clone()
    assert torch.equal(layer.to(torch.bfloat16).codebook, before)  # nothing was rounded on the way


def test_bf16_layer_and_bf16_autocast_move_the_prototypes_as_float32_does():
    """300 EMA steps on the same tokens, restarts off: a layer cast to bfloat16 (fed bfloat16 tokens) stays within 1%
    of the float32 layer's prototypes (measured 0.49%; 5.3% when the EMA state was bf16), and a float32 layer under
    bf16 autocast computes exactly as without it (the codebook turns autocast off)."""
    base = DDCLQuantizer(32, 8, restart=None)
    base(_clustered(torch.Generator().manual_seed(1)))
    f32, b16, amp = copy.deepcopy(base), copy.deepcopy(base).to(torch.bfloat16), copy.deepcopy(base)
    start = base.prototypes.detach().clone()
    g = torch.Generator().manual_seed(2)
    for _ in range(300):
        z = _clustered(g)
        f32(z)
        b16(z.to(torch.bfloat16))
        with torch.autocast("cpu", dtype=torch.bfloat16):
            amp(z)
    ref = f32.prototypes.detach()
    assert torch.equal(amp.prototypes.detach(), ref)
    error = (b16.prototypes.detach() - ref).norm()
    assert float(error / ref.norm()) < 0.01
    assert float(error / (ref - start).norm()) < 0.06  # of how far the prototypes moved


@pytest.mark.parametrize("make", [
    lambda: DDCLQuantizer(8, 2, standardize=False, prototype_update=Ema(0.9), restart=None, temperature=0.5,
                          target_entropy=None),
    lambda: HardVQ(8, 2, ema_decay=0.9),
], ids=["ddcl", "hard_ema"])
def test_a_code_that_never_wins_stays_where_it_is(make):
    """With restarts off a code far from every token keeps its place bit for bit over 400 EMA steps at decay 0.9
    (its EMA mass passes 1e-12 after 263 steps: the old floor sent it to the origin; HardVQ's Laplace smoothing did
    the same after ~300)."""
    torch.manual_seed(0)
    layer = make()
    codebook = layer.prototypes
    with torch.no_grad():
        codebook.copy_(torch.randn(8, 2) * 0.5)
        codebook[7] = torch.tensor([40.0, -40.0])
        if isinstance(layer, DDCLQuantizer):
            layer.ema.weighted_sum.copy_(codebook)
            layer._initialized = True
        else:
            layer.ema.weighted_sum.copy_(codebook)
    far = codebook.detach()[7].clone()
    for _ in range(400):
        out = layer(torch.randn(64, 2))
        assert not (out.indices == 7).any()
    assert torch.equal(codebook.detach()[7], far)
    assert (codebook.detach()[:7].abs().max(1).values < 5).all()  # the others moved with their tokens


# ---- steps that are not "one forward, one backward" ----------------------------------------------------------------
def _loss(out) -> torch.Tensor:
    return (out.quantized * torch.linspace(-1, 1, out.quantized.numel()).reshape(out.quantized.shape)).sum() + out.loss


@pytest.mark.parametrize("reentrant", [False, True])
@pytest.mark.parametrize("update", ["ema", "gradient"])
def test_activation_checkpointing_recomputes_bit_for_bit_and_updates_once(reentrant, update):
    """The encoder and the layer checkpointed together, from the first batch (initialisation and calibration inside
    the checkpoint), with restarts on: gradients, prototypes, temperature, usage, restarts and the standardiser equal
    the same steps without checkpointing bit for bit."""
    def make():
        torch.manual_seed(3)
        return (torch.nn.Linear(8, 8), DDCLQuantizer(32, 8, prototype_update=update,
                                                      restart=Restart(3.0, cap=None)))

    (enc_a, plain), (enc_b, ckpt) = make(), make()
    g = torch.Generator().manual_seed(4)
    for step in range(4):
        x = _clustered(g, 96)
        torch.manual_seed(50 + step)
        _loss(plain(enc_a(x))).backward()
        torch.manual_seed(50 + step)  # (a reentrant checkpoint needs an input that requires grad)
        checkpoint(lambda x: _loss(ckpt(enc_b(x))), x.requires_grad_(True), use_reentrant=reentrant).backward()
    assert plain.restarts > 0  # restarts happened inside the checkpoint too
    for (name, a), (_, b) in zip(plain.state_dict().items(), ckpt.state_dict().items(), strict=True):
        assert torch.equal(a, b) if torch.is_tensor(a) else a == b, name
    assert plain.temperature == ckpt.temperature
    for a, b in zip([*enc_a.parameters(), plain.prototypes], [*enc_b.parameters(), ckpt.prototypes], strict=True):
        assert (a.grad is None) == (b.grad is None) and (a.grad is None or torch.equal(a.grad, b.grad))
    assert len(ckpt._records) == 0  # every record was replayed or its backward ran


def test_two_forwards_before_one_backward_give_each_its_own_gradient():
    """Two views of a batch through one float64 layer, then one backward (the first view's updates ran before it),
    against each view's backward run right after its forward: the same input gradients and state, bit for bit.
    (Compiled, against float64: test_compile.)"""
    torch.manual_seed(6)
    layer = DDCLQuantizer(32, 8, restart=Restart(3.0, cap=None)).double()
    layer(torch.randn(96, 8, dtype=torch.float64))
    sequential = copy.deepcopy(layer)
    z = torch.randn(2, 96, 8, dtype=torch.float64) * 2
    torch.manual_seed(7)
    xs = [v.clone().requires_grad_(True) for v in z]
    sum(_loss(layer(x)) for x in xs).backward()
    torch.manual_seed(7)
    for x in z:
        x = x.clone().requires_grad_(True)
        _loss(sequential(x)).backward()
        xs.append(x)
    assert torch.equal(xs[0].grad, xs[2].grad) and torch.equal(xs[1].grad, xs[3].grad)
    assert layer.restarts == sequential.restarts > 0 and layer.temperature == sequential.temperature
    assert torch.equal(layer.prototypes, sequential.prototypes)


# ---- loading is strict where it should be --------------------------------------------------------------------------
def test_a_current_state_dict_with_missing_keys_is_refused_naming_them():
    layer = DDCLQuantizer(8, 3)
    layer(torch.randn(40, 3))
    state = layer.state_dict()
    del state["ema.mass"], state["standardizer.running_var"]
    with pytest.raises(RuntimeError, match=r'Missing key\(s\) in state_dict: .*"ema.mass"'):
        DDCLQuantizer(8, 3).load_state_dict(state)
    fresh = DDCLQuantizer(8, 3)
    missing = fresh.load_state_dict(state, strict=False).missing_keys
    assert sorted(missing) == ["ema.mass", "standardizer.running_var"]


def test_a_version_1_layer_gets_exactly_its_missing_keys_and_trains_on_as_it_was_trained():
    torch.manual_seed(0)
    old = DDCLQuantizer(8, 3, temperature=0.7, recipe="plain")
    old(torch.randn(40, 3))
    state = old.state_dict()
    for key in ("ema.mass", "ema.weighted_sum", "standardizer.running_mean", "standardizer.running_var",
                "standardizer.num_batches_tracked"):
        del state[key]  # what a version-1 layer did not have
    state["usage"] = state.pop("dead_codes.usage")  # its usage, under the name of the time
    state["_extra_state"] = {k: v for k, v in state["_extra_state"].items() if k != "version"}
    new = DDCLQuantizer(8, 3)  # today's defaults, loading the old plain layer
    new.load_state_dict(state)  # strict: exactly the five keys were completed
    assert new.recipe == "plain" and new.restart is None and new.target_entropy is None
    torch.testing.assert_close(new.ema.weighted_sum, state["prototypes"], rtol=0, atol=0)
    with torch.no_grad():  # a code no token reaches: the old layer never restarted it
        old.prototypes[5] = new.prototypes[5] = 30.0
    for _ in range(3):
        z = torch.randn(40, 3)
        for layer in (old, new):
            torch.manual_seed(9)
            _loss(layer(z)).backward()
    assert torch.equal(new.prototypes.grad, old.prototypes.grad) and new.restarts == old.restarts == 0
    assert new.prototypes[5, 0] == 30.0


# ---- options that do what they say ---------------------------------------------------------------------------------
def test_the_documented_default_threshold_written_out_behaves_as_the_default():
    """K = 256 and batches of 64 tokens: Restart(1.0) written out restarts what the default does (the cap of a
    quarter of the mean tokens per code applies to both); Restart(1.0, cap=None) turns the cap off."""
    runs = {}
    for name, kwargs in (("default", {}), ("explicit", {"restart": Restart(1.0)}),
                         ("uncapped", {"restart": Restart(1.0, cap=None)})):
        torch.manual_seed(0)
        layer = DDCLQuantizer(256, 4, **kwargs)
        for step in range(30):
            torch.manual_seed(step)
            layer(torch.randn(64, 4))
        runs[name] = layer
    assert runs["explicit"].restarts == runs["default"].restarts
    assert torch.equal(runs["explicit"].prototypes, runs["default"].prototypes)
    assert runs["uncapped"].restarts > 5 * runs["default"].restarts  # 5,596 against 528 when it was the default


def test_renorm_at_either_value_without_standardisation_builds_the_same_layer_step_for_step():
    """renorm=True became the default and False was the default before: a configuration saved with either and
    standardize=False (upgraded by softvq._compat) builds the same layer, step for step."""
    outs = []
    for renorm in (True, False):
        torch.manual_seed(0)
        kwargs = upgrade_quantizer_kwargs("ddcl", {"standardize": False, "renorm": renorm})
        layer = DDCLQuantizer(8, 4, **kwargs).double()
        z = torch.randn(64, 4, dtype=torch.float64)
        outs.append([layer(z).quantized, layer(z + 0.1).quantized, layer.prototypes.detach().clone()])
    for a, b in zip(*outs, strict=True):
        assert torch.equal(a, b)


def test_the_plain_recipe_and_the_trainer_pass_every_option_at_its_default():
    import inspect

    defaults = {k: p.default for k, p in inspect.signature(DDCLQuantizer).parameters.items()
                if p.default is not inspect.Parameter.empty}
    for recipe in ("auto", "plain"):
        DDCLQuantizer(8, 4, **{**defaults, "recipe": recipe})  # every option passed, as the trainer does


def test_an_assigned_temperature_sticks():
    """With the entropy control on, 100 steps pulled an assigned T back toward the target; assigning switches the
    control off (with a warning), set_temperature(keep_control=True) keeps it."""
    def steps(layer):
        g = torch.Generator().manual_seed(0)
        for _ in range(100):
            layer(_clustered(g, 64))

    torch.manual_seed(0)
    layer = DDCLQuantizer(32, 8)
    layer(torch.randn(64, 8))
    kept = copy.deepcopy(layer)
    with pytest.warns(UserWarning, match="switches its entropy control off"):
        layer.temperature = 0.05
    steps(layer)
    assert layer.temperature == 0.05 and layer.target_entropy is None
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        kept.set_temperature(0.05, keep_control=True)
    steps(kept)
    assert kept.target_entropy is not None and kept.temperature > 0.1  # the control moved it back up


def test_init_from_data_standardises_raw_tokens_first():
    torch.manual_seed(0)
    layer = DDCLQuantizer(8, 3).double()
    z = torch.randn(40, 3, dtype=torch.float64) * torch.tensor([100.0, 0.01, 3.0], dtype=torch.float64) + 7
    layer.init_from_data(z)
    var = z.var(0, unbiased=False)
    standardized = (z - z.mean(0)) / (var + 1e-5 * var.mean()).sqrt()
    for p in layer.prototypes.detach():  # each prototype is one token, standardised as the first batch will be
        assert float((standardized - p).abs().max(1).values.min()) < 1e-12
    assert int(layer.standardizer.num_batches_tracked) == 0  # and no statistic moved
    out = layer(z)  # the first training batch sees the same tokens: every prototype wins its own token at least
    assert out.indices.unique().numel() == 8


def test_hard_vq_returns_the_code_it_assigned_before_the_update_moves_it():
    torch.manual_seed(0)
    for kwargs in ({"ema_decay": 0.5}, {"ema_decay": 0.5, "restart": Restart(2.0, decay=0.5, cap=None)}, {}):
        vq = HardVQ(8, 2, **kwargs)
        for _ in range(3):
            before = vq.codebook.clone()
            out = vq(torch.randn(32, 2) * 0.1)
            # sonnet's and vector-quantize-pytorch's rule (z + sg(e - z) rounds like e to float32's resolution)
            torch.testing.assert_close(out.quantized, before[out.indices], rtol=0, atol=1e-7)
        if kwargs.get("ema_decay"):
            assert not torch.equal(vq.codebook, before)  # the step did move the codebook


# ---- the trainer: gradient accumulation and clipping ---------------------------------------------------------------
def test_trainer_accumulates_and_clips_as_its_flags_say(tmp_path, tiny_cifar, monkeypatch):
    from softvq.cli import train as train_vqvae

    calls = {"forwards": 0, "steps": 0, "norms": []}
    original_step, original_forward = torch.optim.Adam.step, DDCLQuantizer.forward

    def step(self, closure=None):
        with torch.enable_grad():
            loss = closure() if closure is not None else None  # Lightning's closure: forward, backward, clipping
        grads = [p.grad for group in self.param_groups for p in group["params"] if p.grad is not None]
        calls["norms"].append(float(torch.linalg.vector_norm(torch.stack([g.norm() for g in grads]))))
        calls["steps"] += 1
        original_step(self)
        return loss

    def forward(self, z):
        calls["forwards"] += self.training
        return original_forward(self, z)

    monkeypatch.setattr(torch.optim.Adam, "step", step)
    monkeypatch.setattr(DDCLQuantizer, "forward", forward)
    tiny = ["--data.train_subset", "96", "--data.val_size", "16", "--data.batch_size", "16", "--model.width", "8",
            "--model.res_hidden", "4", "--model.res_blocks", "1", "--model.num_codes", "16", "--model.code_dim", "4",
            "--data.num_workers", "0", "--trainer.progress_bar", "false"]
    out = tmp_path / "run"
    train_vqvae.main(["--data.data_root", str(tiny_cifar["folder"]), "--out", str(out), "--epochs", "1",
                      "--trainer.accumulate_grad_batches", "3", "--trainer.gradient_clip_val", "0.001", *tiny])
    assert calls["forwards"] == 6 and calls["steps"] == 2  # 6 batches: the layer steps per batch, Adam per 3
    assert all(norm <= 0.001 * (1 + 1e-5) for norm in calls["norms"])  # clipped to the global norm
    config = json.loads((out / "config.json").read_text())["trainer"]
    assert config["accumulate_grad_batches"] == 3 and config["gradient_clip_val"] == 0.001
    assert math.isfinite(json.loads((out / "history.jsonl").read_text().splitlines()[0])["train_mse"])


def test_a_run_saved_with_the_former_defaults_resumes_and_its_checkpoint_loads(tmp_path, tiny_cifar):
    """A run whose config.json and checkpoint predate the restart cap, renorm and the restart option (flat
    dead_code_threshold / dead_code_decay) and record commitment_term="l_ols" (the former default, inert at weight 0)
    and dead_code_decay=0.9 (the former default): --resume accepts it with its own settings (nothing that acts
    changed), load_vqvae builds it, and real changes are still refused: renorm, absent, was plain batch
    standardisation, so today's default renorm=True is a change the resume names, and so is today's restart decay
    "auto" against the recorded 0.9."""
    from softvq.cli import train as train_vqvae
    from softvq.models import load_vqvae

    tiny = ["--data.train_subset", "64", "--data.val_size", "16", "--data.batch_size", "32", "--model.width", "8",
            "--model.res_hidden", "4", "--model.res_blocks", "1", "--model.num_codes", "16", "--model.code_dim", "4",
            "--data.num_workers", "0", "--trainer.progress_bar", "false", "--data.data_root",
            str(tiny_cifar["folder"])]
    out = tmp_path / "run"
    train_vqvae.main([*tiny, "--out", str(out), "--epochs", "1"])
    config = json.loads((out / "config.json").read_text())
    config["ddcl"]["commitment_term"] = "l_ols"
    del config["ddcl"]["restart"], config["ddcl"]["standardize"]  # the flat options of the time: no cap, no renorm
    config["ddcl"].update(dead_code_threshold="auto", dead_code_decay=0.9,  # 0.9: the former default
                          standardize=True, output_scale="standardized")
    (out / "config.json").write_text(json.dumps(config))
    ckpt_path = out / "checkpoints" / "last.ckpt"
    ckpt = torch.load(ckpt_path, weights_only=True)
    extra = ckpt["state_dict"]["quantizer._extra_state"]  # a layer's state of the time recorded no settings
    del extra["settings"]
    extra["version"] = 2
    kwargs = ckpt["hyper_parameters"]["quantizer_kwargs"]
    kwargs["commitment_term"] = "l_ols"
    del kwargs["restart"]
    kwargs.update(dead_code_threshold="auto", dead_code_decay=0.9, output_scale="standardized")
    torch.save(ckpt, ckpt_path)
    assert load_vqvae(ckpt_path).quantizer.commitment_term == "hard"  # "l_ols" at weight 0 had no term to keep
    with pytest.raises(ValueError, match=r"commitment_weight: (checkpoint|run) 0\.0 vs now 0\.5"):
        train_vqvae.main([*tiny, "--out", str(out), "--epochs", "2", "--resume", "--ddcl.commitment_weight", "0.5"])
    with pytest.raises(ValueError, match=r"restart\.decay: (checkpoint|run) 0\.9 vs now 'auto'"):
        train_vqvae.main([*tiny, "--out", str(out), "--epochs", "2", "--resume"])
    with pytest.raises(ValueError, match=r"--ddcl\.standardize\.renorm_clip: run None vs now \[1\.1, 0\.1\]"):
        train_vqvae.main([*tiny, "--out", str(out), "--epochs", "2", "--resume", "--ddcl.restart.decay", "0.9"])
    rows = train_vqvae.main([*tiny, "--out", str(out), "--epochs", "2", "--resume",
                             "--ddcl.standardize.renorm_clip", "null",
                             "--ddcl.restart.decay", "0.9"])["ddcl"]
    assert [r["epoch"] for r in rows] == [1, 2]
