"""eval.topk_bound's arithmetic against independent references: the encoder gradient against autograd, the mass
left out by hand, and exactness when k = K."""

from __future__ import annotations

import pytest
import torch

from eval import topk_bound


def test_encoder_gradient_is_the_soft_centroids_vector_jacobian_product():
    g = torch.Generator().manual_seed(0)
    z = torch.randn(5, 3, generator=g, dtype=torch.float64, requires_grad=True)
    p = torch.randn(7, 3, generator=g, dtype=torch.float64)
    up = torch.randn(5, 3, generator=g, dtype=torch.float64)
    t = 0.7
    q = torch.softmax(-torch.cdist(z, p).square() / t, dim=1)
    (q @ p).mul(up).sum().backward()  # autograd through the distances and the softmax
    by_hand = topk_bound._encoder_gradient(q.detach(), p, up, t)
    torch.testing.assert_close(by_hand, z.grad, rtol=1e-10, atol=1e-12)


def test_truncation_errors_by_hand_and_exact_at_k_equal_to_the_codebook():
    z = torch.tensor([[0.0, 0.0]], dtype=torch.float64)
    p = torch.tensor([[1.0, 0.0], [0.0, 2.0], [3.0, 0.0]], dtype=torch.float64)  # squared distances 1, 4, 9
    out = topk_bound.truncation_errors(z, p, 1.0, (1, 2, 3))
    w = torch.exp(-torch.tensor([1.0, 4.0, 9.0], dtype=torch.float64))
    q = w / w.sum()
    assert out["by_k"][1]["mass_mean"] == pytest.approx(float(1 - q[0]))
    assert out["by_k"][2]["mass_mean"] == pytest.approx(float(q[2]))
    assert out["by_k"][3]["mass_mean"] == pytest.approx(0.0, abs=1e-15)
    assert out["by_k"][3]["gradient_error_mean"] == pytest.approx(0.0, abs=1e-12)
    assert out["entropy"] == pytest.approx(float(-(q * q.log()).sum()))
    # k = 1 keeps the nearest prototype alone: the soft centroid is constant, its gradient 0, the error 1
    assert out["by_k"][1]["gradient_error_mean"] == pytest.approx(1.0)
