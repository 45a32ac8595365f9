"""eval/commit_ratio.py: the commitment held at a ratio of the decoder's gradient, against the parent layer's gradient
plus the pull written out in float64."""

from __future__ import annotations

import copy

import pytest
import torch

import softvq
from eval.commit_ratio import RatioCommitDDCL


def _pair(rho: float) -> tuple[softvq.DDCLQuantizer, RatioCommitDDCL]:
    torch.manual_seed(0)
    plain = softvq.DDCLQuantizer(16, 4, top_k=None).double()
    ratio = RatioCommitDDCL(16, 4, rho=rho, top_k=None).double()
    plain(torch.randn(64, 4, dtype=torch.float64))  # start the codebook (prototypes, T) on one batch
    ratio.load_state_dict(copy.deepcopy(plain.state_dict()))
    return plain, ratio


@pytest.mark.parametrize("rho", [0.0, 0.2, 1.5])
def test_gradient_is_the_parents_plus_the_pull(rho: float) -> None:
    plain, ratio = _pair(rho)
    plain.standardize = False
    ratio.standardize = False  # the pull acts on the tokens the distances see: here the input itself
    z = torch.randn(32, 4, dtype=torch.float64)
    weight = torch.randn(32, 4, dtype=torch.float64)  # a linear loss: its gradient g at the output is `weight`
    z_plain, z_ratio = z.clone().requires_grad_(), z.clone().requires_grad_()
    codes_before = ratio.prototypes.detach().clone()  # the training forward moves the EMA prototypes after it
    out_plain, out_ratio = plain(z_plain), ratio(z_ratio)
    assert torch.equal(out_plain.quantized, out_ratio.quantized)  # the forward is the parent's, bit for bit
    assert torch.equal(out_plain.indices, out_ratio.indices)
    (out_plain.quantized * weight).sum().backward()
    (out_ratio.quantized * weight).sum().backward()
    diff = z - codes_before[out_ratio.indices]  # each token minus its argmax code
    expected = z_plain.grad + rho * weight.norm() / diff.norm() * diff
    torch.testing.assert_close(z_ratio.grad, expected, rtol=1e-10, atol=1e-12)


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
    plain, ratio = _pair(rho)
    ratio = RatioCommitDDCL(16, 4, rho=rho, against="tokens", top_k=None).double()
    ratio.load_state_dict(copy.deepcopy(plain.state_dict()))
    plain.standardize = False
    ratio.standardize = False
    z = torch.randn(32, 4, dtype=torch.float64)
    weight = torch.randn(32, 4, dtype=torch.float64)
    z_plain, z_ratio = z.clone().requires_grad_(), z.clone().requires_grad_()
    codes_before = ratio.prototypes.detach().clone()
    out_plain, out_ratio = plain(z_plain), ratio(z_ratio)
    assert torch.equal(out_plain.quantized, out_ratio.quantized)
    (out_plain.quantized * weight).sum().backward()
    (out_ratio.quantized * weight).sum().backward()
    diff = z - codes_before[out_ratio.indices]
    expected = z_plain.grad + rho * z_plain.grad.norm() / diff.norm() * diff
    torch.testing.assert_close(z_ratio.grad, expected, rtol=1e-10, atol=1e-12)
    with pytest.raises(ValueError, match="against"):
        RatioCommitDDCL(16, 4, against="decoder")


def test_surgery_drops_the_opposing_part_of_the_pull() -> None:
    """``surgery=True``: per token, the pull minus its projection on the tokens' gradient where the two oppose."""
    plain, _ = _pair(0.3)
    ratio = RatioCommitDDCL(16, 4, rho=0.3, against="tokens", surgery=True, top_k=None).double()
    ratio.load_state_dict(copy.deepcopy(plain.state_dict()))
    plain.standardize = False
    ratio.standardize = False
    z = torch.randn(32, 4, dtype=torch.float64)
    weight = torch.randn(32, 4, dtype=torch.float64)
    z_plain, z_ratio = z.clone().requires_grad_(), z.clone().requires_grad_()
    codes_before = ratio.prototypes.detach().clone()
    out_plain, out_ratio = plain(z_plain), ratio(z_ratio)
    (out_plain.quantized * weight).sum().backward()
    (out_ratio.quantized * weight).sum().backward()
    g = z_plain.grad
    diff = z - codes_before[out_ratio.indices]
    pull = 0.3 * g.norm() / diff.norm() * diff
    expected = g.clone()
    for n in range(len(z)):  # a loop over tokens, the projection written out
        dot = float(pull[n] @ g[n])
        expected[n] += pull[n] - (dot / float(g[n] @ g[n])) * g[n] if dot < 0 else pull[n]
    assert any(float(pull[n] @ g[n]) < 0 for n in range(len(z)))  # the case is exercised
    torch.testing.assert_close(z_ratio.grad, expected, rtol=1e-10, atol=1e-12)
    with pytest.raises(ValueError, match="surgery"):
        RatioCommitDDCL(16, 4, surgery=True)  # against="output" has no tokens' gradient to compare with
