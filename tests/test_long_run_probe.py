"""eval.long_run.probe: its scorings change nothing of the run they watch (bit for bit), its PSNR is the hard codes'
decode scored by hand, and the straight-through-plus gradient is (I + J) g against autograd on the plain layer."""

from __future__ import annotations

import json

import pytest
import torch

from eval.long_run import probe
from softvq import DDCLQuantizer
from softvq.parts import Standardize

TINY = ["--epochs", "1", "--train-subset", "64", "--val-size", "32", "--batch-size", "16", "--num-codes", "16",
        "--val-images", "16", "--num-workers", "0"]


def _run(tiny_cifar, out, *extra):
    threads = torch.get_num_threads()
    try:
        return probe.main(["--data-root", str(tiny_cifar["folder"]), "--out", str(out), *TINY, *extra])
    finally:
        torch.set_num_threads(threads)


def test_scoring_every_step_leaves_the_run_bit_for_bit_and_scores_the_hard_codes(tiny_cifar, tmp_path):
    # codes times 0.05: every score must decode the codes the decoder trains on (the scaled ones), not the layer's
    watched = _run(tiny_cifar, tmp_path / "watched.jsonl", "--every", "1", "--output-scale", "0.05")
    alone = _run(tiny_cifar, tmp_path / "alone.jsonl", "--every", "1000", "--output-scale", "0.05")
    for (key, a), (_, b) in zip(watched.state_dict().items(), alone.state_dict().items(), strict=True):
        assert torch.equal(a, b) if isinstance(a, torch.Tensor) else a == b, key
    lines = [json.loads(line) for line in (tmp_path / "watched.jsonl").read_text().splitlines()]
    scored = [line for line in lines if "psnr" in line]
    assert [line["step"] for line in scored] == [1, 2, 3, 4]  # 64 images in batches of 16
    assert all(line["psnr_exact_stats"] > 0 and 0 <= line["codes_changed_exact"] <= 1 for line in scored)
    # the layer's default evaluation statistics are the applied ones at its default momentum, which the probe also keeps
    default = f"psnr_applied_m{probe.TokenStandardizer(1).eval_momentum:g}_stats"
    assert all(abs(line["psnr"] - line[default]) < 1e-3 for line in scored)
    # 2.6 dB apart when the scale was left out
    for key in ("psnr_running_stats", "psnr_exact_stats", "psnr_used_stats", "psnr_train_mode"):
        assert abs(scored[-1][key] - scored[-1]["psnr"]) < 0.5, (key, scored[-1])
    # the running averages of the applied statistics start from the first step's: then they are the last-used ones
    for m in probe.APPLIED_MOMENTA:
        assert scored[0][f"psnr_applied_m{m:g}_stats"] == scored[0]["psnr_used_stats"]
    assert len({scored[-1][f"psnr_applied_m{m:g}_stats"] for m in probe.APPLIED_MOMENTA}) > 1  # and then differ
    # the last scoring is of the final model: its PSNR is the decode of its hard codes, scored by hand
    data = probe.CIFAR10DataModule(tiny_cifar["folder"], batch_size=16, val_size=32, train_subset=64, seed=11)
    data.setup("fit")
    x = torch.stack([data.val_set[i][0] for i in range(16)])
    watched.eval()
    with torch.no_grad():
        rec = watched.decode_indices(watched.encode(x)).clamp(0, 1)
    by_hand = (10 * torch.log10(1 / (rec - x).square().mean((1, 2, 3)))).mean()
    assert abs(scored[-1]["psnr"] - float(by_hand)) < 1e-4


@pytest.mark.parametrize("gradient", ["straight_through_plus", "straight_through"])
def test_straight_through_gives_the_identity_plus_or_without_the_soft_centroid_jacobian(gradient):
    torch.manual_seed(0)
    layer = DDCLQuantizer(6, 3, temperature=0.8, target_entropy=None, restart=None, init="normal",
                          standardize=Standardize(renorm_clip=None)).double()
    plain = DDCLQuantizer(6, 3, temperature=0.8, target_entropy=None, restart=None, init="normal",
                          standardize=Standardize(renorm_clip=None)).double()
    plain.load_state_dict(layer.state_dict())
    wrapped = probe.GradientProbe(layer, gradient)
    z = torch.randn(20, 3, dtype=torch.float64)
    w = torch.randn(20, 3, dtype=torch.float64)
    z1, z2, z3 = (z.clone().requires_grad_(True) for _ in range(3))
    out = wrapped(z1)
    (out.quantized * w).sum().backward()
    ref = plain(z2)
    (ref.quantized * w).sum().backward()  # J g through the batch standardisation
    assert torch.equal(out.quantized, ref.quantized) and torch.equal(out.indices, ref.indices)
    mean, var = z3.mean(0), z3.var(0, unbiased=False)
    zs = (z3 - mean) / (var + 1e-5 * var.detach().mean()).sqrt()  # the layer's eps, detached as there
    (zs * w).sum().backward()  # the identity part, through the same standardisation
    expected = z2.grad + z3.grad if gradient == "straight_through_plus" else z3.grad
    assert not torch.allclose(z2.grad, torch.zeros_like(z2.grad))  # J g is not nothing: the two cases differ
    torch.testing.assert_close(z1.grad, expected, rtol=1e-10, atol=1e-12)


def test_gradient_ratio_scores_every_few_steps_on_both_methods(tiny_cifar):
    from eval.long_run import gradient_ratio

    threads = torch.get_num_threads()
    try:
        for method in ("hard_ema", "ddcl"):
            records = gradient_ratio.main(["--data-root", str(tiny_cifar["folder"]), "--method", method, "--steps",
                                           "3", "--every", "2", "--train-subset", "64", "--batch-size", "16",
                                           "--val-size", "32"])
            assert [r["step"] for r in records] == [0, 2]
            assert all(0 < r["ratio"] < float("inf") and r["token_std"] > 0 for r in records)
    finally:
        torch.set_num_threads(threads)



def test_detached_statistics_change_no_value_and_give_the_gradient_of_constant_shift_and_scale():
    """With the standardiser's shift and scale detached the output is the same tensor and the input's gradient is
    ``g_s / scale`` (``g_s`` the gradient at the standardised tokens, read by a hook); batch statistics' gradient
    instead sums to zero over the batch in every dimension (a shift of every token is invisible to the loss)."""
    torch.manual_seed(0)
    default = DDCLQuantizer(16, 4).train()
    detached = DDCLQuantizer(16, 4).train()
    detached.load_state_dict(default.state_dict())
    probe.detach_statistics(detached)
    z = (torch.randn(200, 4) * 3 + 1).double()
    w = torch.randn(200, 4, dtype=torch.float64)
    results = []
    for layer in (default.double(), detached.double()):
        seen = {}
        layer.standardizer.register_forward_hook(lambda m, i, o, seen=seen: seen.update(zs=o[0], scale=o[2]) or
                                                 o[0].retain_grad())
        x = z.clone().requires_grad_(True)
        torch.manual_seed(1)  # the same initialisation draws
        out = layer(x)
        (out.quantized * w).sum().backward()
        results.append((out.quantized.detach(), x.grad, seen["zs"].grad, seen["scale"].detach()))
    (q0, g0, _, _), (q1, g1, gs, scale) = results
    assert torch.equal(q0, q1)
    torch.testing.assert_close(g1, gs / scale, rtol=1e-12, atol=1e-12)
    assert g0.sum(0).abs().max() < 1e-9 * g0.abs().max() and g1.sum(0).abs().max() > 1e-3 * g1.abs().max()


def test_the_anchor_adds_the_tokens_squared_mean_in_their_variance_and_only_a_common_shift_to_the_gradient():
    """``--anchor w`` adds ``w * mean_d(m_d^2 / v_d)`` (``v`` detached) to the loss and nothing to the output; its
    gradient at every token is the same vector, ``2 w m_d / (D N v_d)``: a shift of all tokens, the direction batch
    standardisation's gradient leaves out."""
    torch.manual_seed(0)
    layer = DDCLQuantizer(16, 4).double()
    plain = DDCLQuantizer(16, 4).double()
    plain.load_state_dict(layer.state_dict())
    wrapped = probe.GradientProbe(layer, "soft_centroid", anchor=0.3)
    z = (torch.randn(200, 4) * 3 + 1).double()
    x1, x2 = z.clone().requires_grad_(True), z.clone().requires_grad_(True)
    torch.manual_seed(1)
    out = wrapped(x1)
    torch.manual_seed(1)
    ref = plain(x2)
    assert torch.equal(out.quantized, ref.quantized)
    m, v = z.mean(0), z.var(0)
    torch.testing.assert_close(out.loss - ref.loss, 0.3 * (m.square() / v).mean(), rtol=1e-12, atol=0)
    (out.loss - ref.loss).backward()
    torch.testing.assert_close(x1.grad, (2 * 0.3 * m / (4 * 200 * v)).expand(200, 4), rtol=1e-10, atol=1e-14)
    with pytest.raises(ValueError, match="anchor must be >= 0"):
        probe.GradientProbe(DDCLQuantizer(16, 4), "soft_centroid", anchor=-1.0)


def test_freezing_the_standardiser_fixes_its_statistics_from_that_step_and_changes_nothing_before(tiny_cifar,
                                                                                                   tmp_path):
    """``--freeze-standardizer 2``: the first two steps are the plain run's bit for bit (scored at step 2 alike), then
    the statistics stop moving (training standardises with the frozen evaluation statistics), so the later steps
    differ from the plain run's."""
    frozen = _run(tiny_cifar, tmp_path / "frozen.jsonl", "--every", "1", "--freeze-standardizer", "2")
    plain = _run(tiny_cifar, tmp_path / "plain.jsonl", "--every", "1")

    def scored(name):
        return [json.loads(line) for line in (tmp_path / name).read_text().splitlines()]

    a, b = scored("frozen.jsonl"), scored("plain.jsonl")
    assert {"frozen_at": 2} in a
    a = [r for r in a if "psnr" in r]
    b = [r for r in b if "psnr" in r]
    assert [r["psnr"] for r in a[:2]] == [r["psnr"] for r in b[:2]] and a[-1]["psnr"] != b[-1]["psnr"]
    st = probe.ddcl_layer(frozen).standardizer
    assert st.frozen and int(st.num_batches_tracked) == 2  # steps 3 and 4 (64 images, batches of 16) moved nothing
    assert int(probe.ddcl_layer(plain).standardizer.num_batches_tracked) == 4


def test_the_standardiser_momentum_option_sets_the_running_moments_weight(tiny_cifar, tmp_path):
    """``--standardizer-momentum 1.0`` reaches the layer's standardiser and changes its running moments against the
    layer's 0.1; a value outside (0, 1] is refused."""
    fast = probe.ddcl_layer(_run(tiny_cifar, tmp_path / "m1.jsonl", "--standardizer-momentum", "1.0")).standardizer
    slow = probe.ddcl_layer(_run(tiny_cifar, tmp_path / "m01.jsonl")).standardizer
    assert fast.momentum == 1.0 and slow.momentum == 0.1
    assert not torch.allclose(fast.running_mean, slow.running_mean)
    with pytest.raises(SystemExit):
        _run(tiny_cifar, tmp_path / "bad.jsonl", "--standardizer-momentum", "1.5")
