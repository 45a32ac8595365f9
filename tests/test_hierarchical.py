"""HierarchicalDDCL against an independent float64 reference: per-level identity and V >= 0, gradients into every
level, shapes for 1-3 levels on image grids and sequences, invalid configurations by message; and the 2-level VQ-VAE
(``train_vqvae.py --model.levels 2``) end to end."""

from __future__ import annotations

import json

import pytest
import torch
import torch.nn.functional as F
from helpers import exact_cdist

from softvq import DDCLQuantizer, HierarchicalDDCL, HierarchicalOutput
from softvq.cli import train as train_vqvae
from softvq.models import VQVAE
from softvq.models.codes import extract_codes
from softvq.parts import Gradient, Restart


def reference_pool(x: torch.Tensor, window: tuple[int, ...]) -> torch.Tensor:
    """Window means with torch's own average pooling (channel-first), an independent twin of ``pool_tokens``."""
    if x.ndim == 3:  # (B, T, D)
        return F.avg_pool1d(x.transpose(1, 2), window).transpose(1, 2)
    return F.avg_pool2d(x.permute(0, 3, 1, 2), window).permute(0, 2, 3, 1)  # (B, h, w, D)


def reference(hier: HierarchicalDDCL, z: torch.Tensor, windows: list[tuple[int, ...]]) -> list[dict]:
    """docs/design.md, "The layer: L_q = L_OLS + V", at every level, written out with explicit (N, K, D) differences,
    in float64."""
    levels, x = [], z
    for level, layer in enumerate(hier.levels):
        if level > 0:
            x = reference_pool(levels[-1]["mu"].reshape(x.shape[0], *levels[-1]["grid"], -1), windows[level - 1])
        flat = x.reshape(-1, x.shape[-1])
        p = layer.prototypes.detach()
        diff = flat[:, None, :] - p[None, :, :]  # (N, K, D)
        d = diff.square().sum(-1)
        q = torch.softmax(-d / layer.temperature, dim=1)
        mu = q @ p
        levels.append({
            "input": x, "grid": x.shape[1:-1], "mu": mu, "q": q, "d": d,
            "l_q": (q * d).sum(1).mean(),
            "l_ols": (flat - mu).square().sum(1).mean(),
            "v": (q * (p[None, :, :] - mu[:, None, :]).square().sum(-1)).sum(1).mean(),
            "indices": exact_cdist(flat, p).argmin(1),
        })
    return levels


CASES = [  # (input shape, codes per level, pool, windows as tuples)
    ((3, 8, 8, 5), [12, 6], 2, [(2, 2)]),
    ((2, 8, 8, 5), [12, 6, 3], 2, [(2, 2), (2, 2)]),
    ((2, 4, 6, 5), [9, 4], [(2, 3)], [(2, 3)]),
    ((3, 12, 5), [10, 5, 4], [(2,), 3], [(2,), (3,)]),  # a sequence: windows of 2 then 3 tokens
]


@pytest.mark.parametrize("shape, codes, pool, windows", CASES)
def test_every_level_matches_the_reference_and_keeps_the_identity_and_v_nonnegative(shape, codes, pool, windows):
    torch.manual_seed(0)
    hier = HierarchicalDDCL(codes, 5, pool=pool, init="normal", temperature=0.8).double()
    hier.levels[-1].temperature = 0.3  # levels need not share T
    z = torch.randn(shape, dtype=torch.float64) * 1.3 + 0.2
    out = hier(z)
    ref = reference(hier, z, windows)
    assert isinstance(out, HierarchicalOutput) and len(out.terms) == len(codes)
    for level, (terms, r) in enumerate(zip(out.terms, ref, strict=True)):
        for name in ("l_q", "l_ols", "v"):
            torch.testing.assert_close(terms[name], r[name], rtol=1e-12, atol=0, msg=f"level {level} {name}")
        l_q, l_ols, v = (terms[k].item() for k in ("l_q", "l_ols", "v"))
        assert abs(l_q - l_ols - v) / l_q < 1e-12 and terms["identity_residual"].item() < 1e-12, level
        assert v >= 0, level
        torch.testing.assert_close(out.inputs[level], r["input"], rtol=1e-12, atol=1e-14)
        torch.testing.assert_close(out.quantized[level].reshape(-1, 5), r["mu"], rtol=1e-10, atol=1e-13)
        torch.testing.assert_close(out.probs[level].reshape(-1, codes[level]), r["q"], rtol=1e-10, atol=1e-14)
        assert torch.equal(out.indices[level].reshape(-1), r["indices"]), level
    torch.testing.assert_close(out.loss, sum(out.losses))


def test_a_single_level_is_exactly_a_ddcl_quantizer():
    kwargs = {"temperature": 0.5, "restart": Restart(0.5), "prototype_update": Gradient("l_q"),
              "commitment_weight": 0.25}
    torch.manual_seed(3)
    hier = HierarchicalDDCL([16], 4, **kwargs)
    torch.manual_seed(3)
    single = DDCLQuantizer(16, 4, recipe="plain", **kwargs)
    z = torch.randn(2, 4, 4, 4)
    for step in range(2):  # data init on the first step; dead-code restart from the first step's usage on the second
        z1, z2 = z.clone().requires_grad_(), z.clone().requires_grad_()
        torch.manual_seed(10 + step)  # both draw the same tokens for init and restarts
        a = hier(z1)
        torch.manual_seed(10 + step)
        b = single(z2)
        assert torch.equal(a.quantized[0], b.quantized) and torch.equal(a.indices[0], b.indices)
        assert torch.equal(a.probs[0], b.probs) and torch.equal(a.loss, b.loss)
        assert all(torch.equal(a.terms[0][k], b.terms[k]) for k in b.terms)
        (a.quantized[0].square().sum() + a.loss).backward()
        (b.quantized.square().sum() + b.loss).backward()
        assert torch.equal(z1.grad, z2.grad) and torch.equal(hier.levels[0].prototypes.grad, single.prototypes.grad)
    assert hier.levels[0].restarts == single.restarts


def test_gradients_reach_every_level_and_the_input():
    torch.manual_seed(1)
    hier = HierarchicalDDCL([8, 6, 4], 3, pool=2, init="normal", prototype_update=Gradient(weight=0.0))
    z = torch.randn(2, 8, 8, 3, requires_grad=True)
    # Only the top level's output in the objective: the lower levels learn through the pooled inputs above them.
    hier(z).quantized[-1].square().sum().backward()
    for level in hier.levels:
        grad = level.prototypes.grad
        assert grad is not None and torch.isfinite(grad).all() and grad.abs().sum() > 0
    assert z.grad is not None and z.grad.abs().sum() > 0
    # And each level's own loss reaches its own prototypes.
    hier = HierarchicalDDCL([8, 6], 3, pool=2, init="normal")
    out = hier(torch.randn(2, 4, 4, 3))
    torch.autograd.backward(out.losses[1])
    assert hier.levels[1].prototypes.grad.abs().sum() > 0


@pytest.mark.parametrize("shape, codes, pool, grids", [
    ((2, 8, 8, 4), [16], 2, [(8, 8)]),
    ((2, 8, 8, 4), [16, 8], 2, [(8, 8), (4, 4)]),
    ((2, 8, 8, 4), [16, 8, 4], 2, [(8, 8), (4, 4), (2, 2)]),
    ((2, 8, 8, 4), [16, 8, 4], [1, (2, 4)], [(8, 8), (8, 8), (4, 2)]),
    ((2, 16, 4), [16, 8, 4], 4, [(16,), (4,), (1,)]),
    ((0, 8, 8, 4), [16, 8], 2, [(8, 8), (4, 4)]),  # an empty batch
])
def test_shapes_per_level(shape, codes, pool, grids):
    hier = HierarchicalDDCL(codes, 4, pool=pool)
    out = hier(torch.randn(shape))
    assert hier.level_grids(shape[1:-1]) == tuple(grids)
    for level, (k, grid) in enumerate(zip(codes, grids, strict=True)):
        assert out.quantized[level].shape == (shape[0], *grid, 4)
        assert out.inputs[level].shape == (shape[0], *grid, 4)
        assert out.indices[level].shape == (shape[0], *grid) and out.indices[level].dtype == torch.int64
        assert out.probs[level].shape == (shape[0], *grid, k)
        assert set(out.terms[level]) == {"l_q", "l_ols", "v", "identity_residual", "entropy"}
    decoded = hier.decode_indices(out.indices)
    for level, layer in enumerate(hier.levels):
        assert torch.equal(decoded[level], layer.codebook[out.indices[level]])
    assert out.loss.ndim == 0 and len(out.losses) == len(codes)


@pytest.mark.parametrize("codes, pool, kwargs, match", [
    ([], 1, {}, "num_codes must be a non-empty sequence"),
    (16, 1, {}, "num_codes must be a non-empty sequence"),
    ([16, 0], 2, {}, r"num_codes\[1\] \(K_1, the codes of level 1\) must be a positive integer, got 0"),
    ([16, -2, 4], 2, {}, r"num_codes\[1\].*got -2"),
    ([16, 8, 4], [2], {}, r"one window per level above 0 \(2 for 3 levels\), got \[2\]"),
    ([16, 8], [0], {}, "pool window of level 1 must be an int >= 1 or a tuple of them, got 0"),
    ([16, 8], [(2, 0)], {}, r"pool window of level 1 .* got \(2, 0\)"),
    ([16, 8], 2, {"temperature": -1.0}, "temperature must be a positive"),
    ([16, 8], 2, {"no_such_option": 1}, "invalid DDCLQuantizer option.*no_such_option"),
])
def test_invalid_configurations_are_refused_by_name(codes, pool, kwargs, match):
    with pytest.raises(ValueError, match=match):
        HierarchicalDDCL(codes, 4, pool=pool, **kwargs)


def test_invalid_inputs_are_refused_by_name():
    hier = HierarchicalDDCL([16, 8, 4], 4, pool=[2, 3])
    with pytest.raises(ValueError, match=r"level 2: pooling window \(3, 3\) does not divide the grid \(4, 4\) of "
                                         r"level 1"):
        hier(torch.randn(1, 8, 8, 4))
    with pytest.raises(ValueError, match=r"level 1: pooling window \(2,\) does not divide the grid \(7,\)"):
        HierarchicalDDCL([16, 8], 4, pool=2)(torch.randn(1, 7, 4))
    with pytest.raises(ValueError, match=r"pool window \(2, 2\) of level 1 has 2 axes but the token grid has 1"):
        HierarchicalDDCL([16, 8], 4, pool=[(2, 2)])(torch.randn(1, 8, 4))
    with pytest.raises(ValueError, match=r"at least one grid axis, got \(5, 4\)"):
        hier(torch.randn(5, 4))
    with pytest.raises(ValueError, match=r"\(B, \*grid, 4\)"):
        hier(torch.randn(1, 12, 12, 3))
    with pytest.raises(ValueError, match=r"one index tensor per level \(3\), got 2"):
        hier.decode_indices([torch.zeros(1, 2, 2, dtype=torch.long)] * 2)
    with pytest.raises(ValueError, match=r"indices must lie in \[0, 8\)"):
        hier.decode_indices([torch.zeros(1, 4, 4, dtype=torch.long), torch.full((1, 2, 2), 8), torch.zeros(1, 1, 1,
                                                                                                        dtype=torch.long)])


def test_two_level_vqvae_layout_and_errors():
    model = VQVAE(levels=2, num_codes=16, level_codes=8, code_dim=4, width=8, res_hidden=4, res_blocks=1)
    assert isinstance(model.quantizer, HierarchicalDDCL) and model.quantizer.num_codes == (16, 8)
    assert model.decoder.net[0].in_channels == 8  # both levels, 2 x code_dim
    x = torch.rand(3, 3, 32, 32)
    out = model(x)
    assert out.reconstruction.shape == x.shape and [q.shape[1:3] for q in out.quantizer.quantized] == [(8, 8), (4, 4)]
    codes = model.encode(x)
    assert [tuple(c.shape) for c in codes] == [(3, 8, 8), (3, 4, 4)]
    assert model.decode_indices(codes).shape == x.shape
    with pytest.raises(ValueError, match=r"decodes one index grid \(B, h_l, w_l\) per level, got a tensor"):
        model.decode_indices(codes[0])
    with pytest.raises(ValueError, match="levels=2 stacks DDCL codebooks: it needs quantizer='ddcl', got 'hard'"):
        VQVAE("hard", levels=2)
    with pytest.raises(ValueError, match=r"one codebook size per level above 0 \(2 for levels=3\), got \[8\]"):
        VQVAE(levels=3, level_codes=[8])
    with pytest.raises(ValueError, match="levels must be a positive integer, got 0"):
        VQVAE(levels=0)
    # A single level keeps its layout (state-dict keys of existing checkpoints).
    single = VQVAE(num_codes=16, code_dim=4, width=8, res_hidden=4, res_blocks=1)
    assert "quantizer.prototypes" in single.state_dict() and single.decoder.net[0].in_channels == 4
    assert not any("level" in key for key in single.state_dict())


def test_upper_levels_start_on_level_0s_temperature_scale():
    torch.manual_seed(0)
    model = VQVAE(levels=3, num_codes=32, level_codes=16, code_dim=8, width=8, res_hidden=4, res_blocks=1,
                  target_entropy=None)
    seen = []
    model.quantizer.register_forward_hook(lambda module, args, out: seen.append(out))
    x = torch.rand(8, 3, 32, 32)
    model.training_step((x, None), 0)
    variance = [z.reshape(-1, 8).double().var(0, unbiased=False).sum().item() for z in seen[0].inputs]
    temperatures = [layer.temperature for layer in model.quantizer.levels]
    assert temperatures[0] == 4.0
    assert temperatures[1:] == pytest.approx([4.0 * v / variance[0] for v in variance[1:]], rel=1e-9)
    assert variance[1] < variance[0]  # pooled soft centroids spread less than the standardised latents
    model.training_step((x, None), 1)  # only the first batch sets them; later T is the level's own business
    assert [layer.temperature for layer in model.quantizer.levels] == temperatures


TINY = ["--data.train_subset", "64", "--data.val_size", "32", "--data.batch_size", "32", "--model.width", "8",
        "--model.res_hidden", "4", "--model.res_blocks", "1", "--model.num_codes", "16", "--model.code_dim", "4",
        "--data.num_workers", "0", "--trainer.progress_bar", "false"]


def test_two_level_training_writes_per_level_history_and_resumes(tmp_path, tiny_cifar):
    """Per-level usage against references outside the metrics that wrote it: each epoch's utilization and dead codes
    of each level from the distinct indices the stack emitted in that epoch's training steps (a forward hook, a
    Python set), and the last epoch's validation ones from last.ckpt's codes of the validation images."""
    from softvq.data.cifar10 import CIFAR10DataModule

    steps: list[tuple[torch.Tensor, ...]] = []

    def record(module, args, output):  # every training step's per-level indices, as the stack emitted them
        if isinstance(module, HierarchicalDDCL) and module.training:
            steps.append(tuple(i.detach().clone() for i in output.indices))

    out = tmp_path / "two"
    argv = [*TINY, "--data.data_root", str(tiny_cifar["folder"]), "--model.levels", "2", "--model.level_codes", "8",
            "--out", str(out)]
    handle = torch.nn.modules.module.register_module_forward_hook(record)
    try:
        train_vqvae.main([*argv, "--epochs", "1"])
        rows = train_vqvae.main([*argv, "--epochs", "2", "--resume"])["ddcl"]
    finally:
        handle.remove()
    assert [r["epoch"] for r in rows] == [1, 2] and rows[1]["step"] == 4
    assert len(steps) == 4  # 64 images in batches of 32, two epochs
    for row in rows:
        for level, k in ((0, 16), (1, 8)):
            suffix = f"_l{level}"
            used = set(torch.cat([s[level].flatten() for s in steps[2 * row["epoch"] - 2:2 * row["epoch"]]]).tolist())
            assert row["utilization" + suffix] == pytest.approx(len(used) / k, rel=1e-12), (row["epoch"], level)
            assert row["dead_codes" + suffix] == k - len(used), (row["epoch"], level)
            assert 0 < row["utilization" + suffix] <= 1 and 1 <= row["perplexity" + suffix] <= k
            assert row["identity_residual" + suffix] < 1e-5
            assert row["v_min" + suffix] >= 0 and row["v" + suffix] >= row["v_min" + suffix]
            assert row["l_q" + suffix] == pytest.approx(row["l_ols" + suffix] + row["v" + suffix], rel=1e-5)
            assert row["val_utilization" + suffix] is not None and row["temperature" + suffix] > 0
        assert row["utilization"] == row["utilization_l0"] and row["v"] == pytest.approx(row["v_l0"])
    assert rows[1]["temperature_l0"] != rows[1]["temperature_l1"]  # each level controls its own H(Q)
    assert json.loads((out / "config.json").read_text())["model"]["levels"] == 2
    model = VQVAE.load_from_checkpoint(out / "checkpoints" / "last.ckpt", map_location="cpu").eval()
    assert model.levels == 2 and model.quantizer.levels[1].temperature == rows[1]["temperature_l1"]
    data = CIFAR10DataModule(tiny_cifar["folder"], val_size=32, train_subset=64, num_workers=0)
    data.setup("fit")
    val_images = torch.stack([data.val_set[i][0] for i in range(len(data.val_set))])
    for level, (k, val_codes) in enumerate(zip((16, 8), model.encode(val_images), strict=True)):
        used = set(val_codes.flatten().tolist())
        assert rows[1][f"val_utilization_l{level}"] == pytest.approx(len(used) / k, rel=1e-12), level
        assert rows[1][f"val_dead_codes_l{level}"] == k - len(used), level
    x = torch.rand(2, 3, 32, 32)
    codes = model.encode(x)
    assert [tuple(c.shape) for c in codes] == [(2, 8, 8), (2, 4, 4)] and model.decode_indices(codes).shape == x.shape
    with pytest.raises(ValueError, match="levels: checkpoint 2 vs now 1"):
        train_vqvae.main([*TINY, "--data.data_root", str(tiny_cifar["folder"]), "--out", str(out), "--epochs", "3",
                          "--resume"])
    # Tools that read one code grid or one codebook refuse a stack clearly instead of failing on a tuple.
    with pytest.raises(ValueError, match="has 2 levels"):
        extract_codes(model, torch.utils.data.TensorDataset(x, torch.zeros(2, dtype=torch.long)))


@pytest.mark.parametrize("argv, match", [
    (["--model.levels", "2", "--quantizer", "hard"],
     "levels=2 stacks DDCL codebooks: it needs quantizer='ddcl', got 'hard'"),
    (["--model.levels", "3", "--model.level_codes", "[8,8,8]"],
     "level_codes must be an int or hold one codebook size per level above 0 (2 for levels=3), got [8, 8, 8]"),
    (["--model.levels", "2", "--model.level_pool", "3"], "pooling window (3, 3) does not divide the grid (8, 8)"),
    (["--model.levels", "0"], "levels must be a positive integer, got 0"),
    (["--model.levels", "two"], "--model.levels: expected an integer, got 'two'"),
])
def test_bad_level_flags_exit_with_a_message(argv, match, capsys, tmp_path, tiny_cifar):
    """A wrong type is the parser's one ``error:`` line, a bad level configuration the constructor's one ``error:``
    line; both exit 2 before anything is written."""
    out = tmp_path / "run"
    try:
        code = train_vqvae.cli([*TINY, "--data.data_root", str(tiny_cifar["folder"]), "--out", str(out), *argv])
    except SystemExit as exit_:
        code = exit_.code
    assert code == 2
    assert match in capsys.readouterr().err
    assert not out.exists()
