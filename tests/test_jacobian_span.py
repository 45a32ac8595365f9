"""eval.long_run.jacobian_span: the participation ratio against per-token eigenvalues (numpy, float64) and known
small cases, and the temperature that meets an entropy target against the entropy it gives."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from eval.long_run.jacobian_span import assignment_radius, entropy_of, participation_ratio, temperature_for_entropy


def test_participation_ratio_against_the_eigenvalues_of_each_tokens_covariance():
    g = torch.Generator().manual_seed(0)
    q = torch.softmax(torch.randn(5, 12, generator=g, dtype=torch.float64) * 2, -1)
    p = torch.randn(12, 4, generator=g, dtype=torch.float64)
    got = participation_ratio(q, p)
    for n in range(5):
        qn, pn = q[n].numpy(), p.numpy()
        cov = np.cov(pn.T, aweights=qn, bias=True)  # sum_k q_k (p_k - mu)(p_k - mu)^T
        eig = np.linalg.eigvalsh(cov)
        assert got[n].item() == pytest.approx(eig.sum() ** 2 / (eig ** 2).sum(), rel=1e-10)
        assert assignment_radius(q[n:n + 1], p).item() == pytest.approx(math.sqrt(np.trace(cov)), rel=1e-10)


def test_known_cases_one_hot_a_line_and_an_isotropic_simplex():
    p = torch.eye(3, dtype=torch.float64)  # three prototypes at the corners of a simplex in D = 3
    assert participation_ratio(torch.tensor([[1.0, 0.0, 0.0]]), p).item() == 0  # one-hot: no gradient at all
    assert participation_ratio(torch.tensor([[0.5, 0.5, 0.0]]), p).item() == pytest.approx(1.0)  # a line
    # uniform over the 3 corners: the covariance spans the plane x + y + z = 1 isotropically, 2 directions
    assert participation_ratio(torch.full((1, 3), 1 / 3), p).item() == pytest.approx(2.0)


def test_the_temperature_found_gives_the_target_mean_entropy():
    g = torch.Generator().manual_seed(1)
    d = torch.rand(200, 64, generator=g, dtype=torch.float64) * 10
    for target in (0.5, 2.5, 4.0):
        t = temperature_for_entropy(d, target)
        assert float(entropy_of(d, t).mean()) == pytest.approx(target, abs=1e-6)
    with pytest.raises(ValueError, match="log K"):
        temperature_for_entropy(d, math.log(64))
