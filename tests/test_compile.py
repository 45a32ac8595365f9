"""The codebooks' training step on an accelerator's terms: no host-device synchronisation (counted by a recorder of
the ATen calls that copy a value to the host or size an output by the data), and torch.compile(fullgraph=True) with
outputs, gradients and state equal to eager execution."""

from __future__ import annotations

import json

import pytest
import torch
from helpers import SyncRecorder, running_moments

from softvq import DDCLQuantizer, HardVQ
from softvq.parts import Commitment, Restart


def _step(layer: torch.nn.Module, z: torch.Tensor) -> None:
    x = z.clone().requires_grad_(True)
    out = layer(x)
    (out.quantized.square().mean() + out.loss).backward()


# Restart below 3.5 tokens a batch (cap=None: 3 tokens a batch per code would cap it at 0.75). Not 4: the running usage
# starts from a batch's integer counts, and 0.99 * 4 + 0.01 * 4 is 4 or 4 - 1 ulp as the arithmetic is fused or not, so
# a threshold of 4 put codes exactly on it, and eager and compiled code restarted different codes under
# ATEN_CPU_CAPABILITY=avx2 (inductor fuses the multiply-add): a tie, not a difference of numerics.
LAYERS = {
    "ddcl": lambda: DDCLQuantizer(32, 8, check_finite=False, restart=Restart(3.5, cap=None)),
    "ddcl_top_k": lambda: DDCLQuantizer(32, 8, check_finite=False, top_k=6, restart=Restart(3.5, cap=None)),
    "ddcl_soft_ema": lambda: DDCLQuantizer(32, 8, check_finite=False, prototype_update="soft_ema"),
    "ddcl_plain": lambda: DDCLQuantizer(32, 8, recipe="plain", check_finite=False,
                                        restart=Restart(3.5, cap=None)),
    "ddcl_cosine_l_q": lambda: DDCLQuantizer(32, 8, check_finite=False, distance="cosine",
                                             commitment_weight=Commitment(0.25, "l_q")),
    "hard_ema": lambda: HardVQ(32, 8, ema_decay=0.99, restart=Restart(3.5, decay=0.99, cap=None), check_finite=False),
    "hard": lambda: HardVQ(32, 8, restart=Restart(3.5, decay=0.99, cap=None), check_finite=False),
}


# a threshold of 3.5 tokens per batch: some codes restart
RESTARTING = {"ddcl", "ddcl_top_k", "ddcl_plain", "hard_ema", "hard"}


@pytest.mark.parametrize("name", sorted(LAYERS))
def test_training_steps_never_synchronise_with_the_host(name):
    torch.manual_seed(0)
    layer = LAYERS[name]().train()
    z = torch.randn(6, 16, 8) * 3 + 1  # 96 tokens for 32 codes: a threshold of 3.5 per batch restarts codes
    recorder = SyncRecorder()
    with recorder:
        for _ in range(4):  # the first batch too: data initialisation and the temperature calibration
            _step(layer, z)
        layer.eval()(z)  # and evaluation
    assert recorder.calls == []
    if name in RESTARTING:
        assert layer.restarts > 0  # the restart path ran inside the recorder


def test_the_recorder_sees_a_synchronisation():
    """The control: the finite check reads the largest |z| on the host, and the recorder says so."""
    recorder = SyncRecorder()
    with recorder:
        _step(DDCLQuantizer(8, 4).train(), torch.randn(20, 4))
    assert "aten._local_scalar_dense.default" in recorder.calls


@pytest.mark.parametrize("name, backend", [("ddcl", "inductor"), ("hard_ema", "inductor"),
                                           ("ddcl_top_k", "aot_eager"), ("ddcl_plain", "aot_eager")])
def test_compiled_training_equals_eager_with_no_graph_break(name, backend):
    """fullgraph=True fails on any graph break; the compiled layer then trains exactly as the eager one (its random
    draws taken from the same generator: inductor's fallback_random). The default recipe and hard VQ go through
    inductor's code generation; top-k and the plain recipe, whose graphs differ but whose kernels are the same ops,
    through AOT autograd only (dynamo's tracing and the functionalised backward, without inductor's C++ build)."""
    import torch._inductor.config as inductor_config

    torch._dynamo.reset()
    with inductor_config.patch(fallback_random=True):
        _compare_compiled_and_eager(name, backend)


def _compare_compiled_and_eager(name: str, backend: str = "inductor") -> None:
    """Four training steps of the eager layer, the compiled one and a float64 copy (the reference that says what float
    tolerance is): the compiled layer's outputs and gradients must be as close to float64 as the eager layer's are.
    The last two batches are two forward passes before one backward (two views of a batch): each pass's gradient is
    that of the state it read, although the first pass's updates (temperature, EMA, restarts) ran before the
    backward."""
    torch.manual_seed(1)
    eager = LAYERS[name]().train()
    compiled = LAYERS[name]().train()
    compiled.load_state_dict(eager.state_dict())
    reference = LAYERS[name]().train()
    reference.load_state_dict(eager.state_dict())
    reference.double()
    compiled.compile(fullgraph=True, backend=backend)
    zs = torch.randn(4, 96, 8) * 2
    for step, group in enumerate([zs[:1], zs[1:2], zs[2:]]):
        results = []
        for layer, dtype in ((eager, torch.float32), (compiled, torch.float32), (reference, torch.float64)):
            torch.manual_seed(100 + step)  # all three draw the same restarts and initialisation
            xs = [z.to(dtype).clone().requires_grad_(True) for z in group]
            outs = [layer(x) for x in xs]
            sum(out.quantized.square().mean() + out.loss for out in outs).backward()
            results.append([(out, x.grad) for out, x in zip(outs, xs, strict=True)])
        for (a, ga), (b, gb), (r, gr) in zip(*results, strict=True):
            assert torch.equal(b.indices, a.indices)
            for name_, ea, eb in (("quantized", a.quantized, b.quantized), ("probs", a.probs, b.probs),
                                  ("loss", a.loss, b.loss), ("z.grad", ga, gb)):
                ref = {"quantized": r.quantized, "probs": r.probs, "loss": r.loss, "z.grad": gr}[name_].float()
                scale = ref.abs().max().clamp_min(1e-30)
                err_eager, err_compiled = (ea - ref).abs().max() / scale, (eb - ref).abs().max() / scale
                # compiled and eager float32 differ in summation order only: within a few times eager's own error
                assert err_compiled <= 4 * err_eager + 1e-6, (step, name_, float(err_eager), float(err_compiled))
    for (key, x), (_, y) in zip(eager.state_dict().items(), compiled.state_dict().items(), strict=True):
        if isinstance(x, torch.Tensor) and x.is_floating_point():
            torch.testing.assert_close(y, x, rtol=1e-4, atol=1e-5, msg=lambda m, k=key: f"{k}: {m}")
    assert compiled.restarts == eager.restarts
    if isinstance(eager, DDCLQuantizer):
        assert compiled.temperature == pytest.approx(eager.temperature, rel=1e-5)


def test_max_rows_equals_torch_max_with_ties_and_any_width():
    from softvq._kernels import max_rows

    torch.manual_seed(3)
    for k in (31, 64, 96, 512):
        x = torch.randn(50, k)
        x[:, k // 3] = x[:, k - 1] = 9.0  # a tie across blocks: the first index wins, as torch's does
        x[7, :] = 0.0  # a row that is all ties
        for largest in (True, False):
            v, i = max_rows(x if largest else -x, largest=largest)
            rv, ri = (x if largest else -x).max(1) if largest else (-x).min(1)
            assert torch.equal(v, rv) and torch.equal(i, ri)


def test_floored_softmax_is_the_softmax_to_float32_resolution_and_never_subnormal():
    from softvq._soft_centroid import _softmax_floored

    torch.manual_seed(4)
    s = torch.randn(64, 256) * 60  # most entries far below each row's largest
    exact = torch.softmax(s.double(), 1)
    q = _softmax_floored(s.clone(), s.max(1).values)
    tiny = torch.finfo(torch.float32).tiny
    assert bool(((q == 0) | (q >= tiny)).all())  # no subnormal assignment
    assert float((q.double() - exact).abs().max()) < 1e-6 and float(q.min()) > 0
    torch.testing.assert_close(q.sum(1), torch.ones(64))


def test_the_trainer_compiles_the_model_with_trainer_compile(tmp_path, tiny_cifar, monkeypatch):
    from softvq.cli import train as train_vqvae
    from softvq.models import VQVAE

    compiled = []
    original = VQVAE.compile_parts

    def compile_parts(self, **kwargs):
        # the trainer's wiring is what this test checks: AOT autograd without inductor's C++ code generation (a
        # minute on 2 cores), which test_compiled_training_equals_eager_with_no_graph_break exercises on the layers
        original(self, **{**kwargs, "backend": "aot_eager"})
        compiled.append(self.quantizer._compiled_call_impl is not None)  # nn.Module.compile sets it

    monkeypatch.setattr(VQVAE, "compile_parts", compile_parts)

    tiny = ["--data.train_subset", "64", "--data.val_size", "32", "--data.batch_size", "32", "--model.width", "16",
            "--model.res_hidden", "8", "--model.res_blocks", "1", "--model.num_codes", "32", "--model.code_dim", "8",
            "--data.num_workers", "0", "--trainer.progress_bar", "false"]
    histories = train_vqvae.main(["--data.data_root", str(tiny_cifar["folder"]), "--out", str(tmp_path / "run"),
                                  "--epochs", "1", "--trainer.compile", "true", *tiny])
    rows = histories["ddcl"]
    assert len(rows) == 1 and rows[0]["train_mse"] > 0 and rows[0]["utilization"] > 0
    config = json.loads((tmp_path / "run" / "config.json").read_text())
    assert config["trainer"]["compile"] is True
    assert compiled == [True]  # the model that trained was compiled, codebook included


def test_compiled_batch_renormalisation_has_eager_gradients_while_it_updates_its_statistics():
    """Batch renormalisation reads the running statistics its own forward just moved in place. The compiled gradient
    once came out up to 2% off (the backward recomputed the factors from buffers updated a second time); against
    the same formula by hand in float64, for three steps of a drifting input."""
    from softvq.parts.standardize import TokenStandardizer, renorm_factors

    torch._dynamo.reset()
    torch.manual_seed(0)
    zs = (torch.randn(3, 96, 8) * 2 + torch.arange(3.0)[:, None, None]).double()
    w = torch.randn(96, 8, dtype=torch.float64)
    layer = TokenStandardizer(8, renorm=True).double().train()
    compiled = torch.compile(layer, fullgraph=True)
    for z, (run_mean, run_var) in zip(zs, running_moments(zs), strict=True):
        x, xr = z.clone().requires_grad_(True), z.clone().requires_grad_(True)
        (compiled(x)[0] * w).sum().backward()
        mean, var = xr.mean(0), xr.var(0, unbiased=False)
        std = (var + 1e-5 * var.detach().mean()).sqrt()
        run_std = (run_var + 1e-5 * run_var.mean()).sqrt()
        r, d = std.detach() / run_std, (mean.detach() - run_mean) / run_std
        (((xr - mean) / std * r + d) * w).sum().backward()
        torch.testing.assert_close(x.grad, xr.grad, rtol=1e-10, atol=1e-12)
    torch.library.opcheck(renorm_factors, (zs[0].mean(0), zs[0].std(0), run_mean, run_var.sqrt(), 3.0, 5.0))
