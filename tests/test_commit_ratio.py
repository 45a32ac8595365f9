"""eval/commit_ratio.py: the commitment held at a ratio of the decoder's gradient, against the parent layer's gradient
plus the pull written out in float64."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import Tensor

import softvq
from eval.commit_ratio import RatioCommitDDCL


def _pair(rho: float, **options: object) -> tuple[softvq.DDCLQuantizer, RatioCommitDDCL]:
    torch.manual_seed(0)
    plain = softvq.DDCLQuantizer(16, 4, top_k=None).double()
    ratio = RatioCommitDDCL(16, 4, rho=rho, top_k=None, **options).double()
    plain(torch.randn(64, 4, dtype=torch.float64))  # start the codebook (prototypes, T) on one batch
    ratio.load_state_dict(copy.deepcopy(plain.state_dict()))
    return plain, ratio


def _gradients(plain: softvq.DDCLQuantizer, ratio: RatioCommitDDCL) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """One training pass of both layers without the standardiser (the pull acts on the tokens the distances see: here
    the input itself) under a linear loss, whose gradient at the output is ``weight``. Returns ``weight``, the parent's
    gradient on the tokens, the ratio layer's, and each token minus its argmax code (the codes before the pass: the
    training forward moves the EMA prototypes after it). The forward is the parent's, bit for bit."""
    plain.standardize = False
    ratio.standardize = False
    z = torch.randn(32, 4, dtype=torch.float64)
    weight = torch.randn(32, 4, dtype=torch.float64)
    z_plain, z_ratio = z.clone().requires_grad_(), z.clone().requires_grad_()
    codes_before = ratio.prototypes.detach().clone()
    out_plain, out_ratio = plain(z_plain), ratio(z_ratio)
    assert torch.equal(out_plain.quantized, out_ratio.quantized)
    assert torch.equal(out_plain.indices, out_ratio.indices)
    (out_plain.quantized * weight).sum().backward()
    (out_ratio.quantized * weight).sum().backward()
    return weight, z_plain.grad, z_ratio.grad, z - codes_before[out_ratio.indices]


@pytest.mark.parametrize("rho", [0.0, 0.2, 1.5])
def test_gradient_is_the_parents_plus_the_pull(rho: float) -> None:
    weight, g_plain, g_ratio, diff = _gradients(*_pair(rho))
    expected = g_plain + rho * weight.norm() / diff.norm() * diff
    torch.testing.assert_close(g_ratio, expected, rtol=1e-10, atol=1e-12)


def test_evaluation_and_bad_rho() -> None:
    plain, ratio = _pair(0.2)
    plain.eval()
    ratio.eval()
    z = torch.randn(8, 4, dtype=torch.float64)
    assert torch.equal(plain(z).quantized, ratio(z).quantized)
    with pytest.raises(ValueError, match="rho"):
        RatioCommitDDCL(16, 4, rho=-1.0)
    with pytest.raises(ValueError, match="rho"):
        RatioCommitDDCL(16, 4, rho=float("nan"))


@pytest.mark.parametrize("rho", [0.0, 0.2, 1.5])
def test_tokens_ratio_is_held_against_the_tokens_gradient(rho: float) -> None:
    """``against="tokens"``: the pull's norm is ``rho`` times that of the gradient the parent passes to its tokens."""
    _, g_plain, g_ratio, diff = _gradients(*_pair(rho, against="tokens"))
    expected = g_plain + rho * g_plain.norm() / diff.norm() * diff
    torch.testing.assert_close(g_ratio, expected, rtol=1e-10, atol=1e-12)
    with pytest.raises(ValueError, match="against"):
        RatioCommitDDCL(16, 4, against="decoder")


def test_surgery_drops_the_opposing_part_of_the_pull() -> None:
    """``surgery=True``: per token, the pull minus its projection on the tokens' gradient where the two oppose."""
    _, g, g_ratio, diff = _gradients(*_pair(0.3, against="tokens", surgery=True))
    pull = 0.3 * g.norm() / diff.norm() * diff
    expected = g.clone()
    for n in range(len(g)):  # a loop over tokens, the projection written out
        dot = float(pull[n] @ g[n])
        expected[n] += pull[n] - (dot / float(g[n] @ g[n])) * g[n] if dot < 0 else pull[n]
    assert any(float(pull[n] @ g[n]) < 0 for n in range(len(g)))  # the case is exercised
    torch.testing.assert_close(g_ratio, expected, rtol=1e-10, atol=1e-12)
    with pytest.raises(ValueError, match="surgery"):
        RatioCommitDDCL(16, 4, surgery=True)  # against="output" has no tokens' gradient to compare with
