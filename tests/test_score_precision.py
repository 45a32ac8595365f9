"""The pure pieces of eval/score_precision.py on synthetic data."""

from __future__ import annotations

import torch

from eval.score_precision import (
    PRECISIONS,
    distance_increase,
    nearest,
    psnr_per_image,
    score_operands,
    tf32_truncate,
)


def test_float32_against_itself_changes_nothing() -> None:
    g = torch.Generator().manual_seed(0)
    z, p = torch.randn(300, 8, generator=g), torch.randn(64, 8, generator=g)
    ops = score_operands(z, p, 0.7)
    a = nearest(*ops, PRECISIONS["float32"], rows=128)
    b = nearest(*ops, PRECISIONS["float32"], rows=128)
    found = distance_increase(z, p, a, b)
    assert found["changed"] == 0 and found["fraction_changed"] == 0.0 and found["rel_increase_max"] is None
    x = torch.rand(4, 3, 8, 8, generator=g)
    rec = x + 0.01 * torch.randn(4, 3, 8, 8, generator=g)
    # per-image PSNR against 10 log10(1 / mse) of the clamped reconstruction (torchmetrics keeps float32 constants)
    mse = (rec.clamp(0, 1).double() - x.double()).square().flatten(1).mean(1)
    torch.testing.assert_close(psnr_per_image(rec, x), 10 * torch.log10(1 / mse), rtol=1e-6, atol=1e-5)


def test_scores_argmax_is_the_nearest_code() -> None:
    g = torch.Generator().manual_seed(1)
    z, p = torch.randn(200, 6, generator=g) + 3.0, torch.randn(96, 6, generator=g) + 3.0
    found = nearest(*score_operands(z, p, 1.3), PRECISIONS["float32"], rows=64)
    exact = torch.cdist(z.double(), p.double()).argmin(1)
    assert torch.equal(found, exact)


def test_layer_codes_are_reproduced() -> None:
    import softvq

    torch.manual_seed(0)
    layer = softvq.DDCLQuantizer(64, 8)
    layer(torch.randn(512, 8) * 2 + 1)  # a training batch: initialises the codebook, statistics and T
    layer.eval()
    z = torch.randn(256, 8) * 2 + 1
    with torch.no_grad():
        ref = layer(z).indices
        zf = layer.standardizer.standardize(z)
        ops = score_operands(zf, layer.prototypes.detach().float(), layer.temperature_control.temperature_t)
    assert torch.equal(nearest(*ops, PRECISIONS["float32"]), ref)


def test_tf32_truncation() -> None:
    x = torch.tensor([1.0 + 2**-10, 1.0 + 2**-11, -(1.0 + 2**-10 + 2**-12), 3.0, 0.1])
    y = tf32_truncate(x)
    assert y[0] == 1.0 + 2**-10  # 10 mantissa bits kept
    assert y[1] == 1.0  # the 11th cut, toward zero
    assert y[2] == -(1.0 + 2**-10)  # toward zero for negatives too
    assert y[3] == 3.0
    assert 0.0 < 0.1 - float(y[4]) < 0.1 * 2**-10
    assert int((y.view(torch.int32) & 0x1FFF).abs().sum()) == 0
    assert torch.equal(tf32_truncate(y), y)


def test_near_tie_flips_under_bf16_and_a_clear_winner_does_not() -> None:
    zc = torch.ones(2, 1)
    bias = torch.zeros(2)
    near = torch.tensor([[1.0, 1.0 + 1e-3]])  # scores 1 and 1.001: one bf16 value apart of less than its step
    clear = torch.tensor([[1.0, 1.5]])
    assert nearest(zc, near, bias, PRECISIONS["float32"]).tolist() == [1, 1]
    assert nearest(zc, near, bias, PRECISIONS["bfloat16"]).tolist() == [0, 0]  # rounded to a tie: the first wins
    for name in PRECISIONS:
        assert nearest(zc, clear, bias, PRECISIONS[name]).tolist() == [1, 1], name


def test_distance_increase_of_a_known_change() -> None:
    z = torch.tensor([[0.0, 0.0], [1.0, 0.0]])
    p = torch.tensor([[1.0, 0.0], [2.0, 0.0], [0.0, 1.1]])
    ref, found = torch.tensor([0, 0]), torch.tensor([2, 0])
    out = distance_increase(z, p, ref, found)
    assert out["changed"] == 1 and out["fraction_changed"] == 0.5
    assert abs(out["rel_increase_max"] - 0.21) < 1e-6  # d 1.21 against 1 (1.1 in float32)
