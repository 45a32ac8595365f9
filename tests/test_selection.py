"""The two-stage selection of each row's k largest entries (softvq._kernels.top_k_rows), against torch.topk: the same
set of values with ties, the same columns away from ties, at sizes where the group size does and does not divide the
row, for every group size and k up to K; no host-device synchronisation; torch.compile(fullgraph=True)."""

from __future__ import annotations

import pytest
import torch
from helpers import SyncRecorder

from softvq._kernels import selection_group, top_k_rows


def _sorted(values: torch.Tensor, columns: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    order = columns.argsort(1)
    return values.gather(1, order), columns.gather(1, order)


@pytest.mark.parametrize("num_codes, k, group", [
    (64, 3, 4), (64, 3, 8),  # G divides K
    (67, 3, 4), (67, 5, 8), (100, 7, 4), (100, 2, 16),  # G does not: K - G (K // G) columns join the first groups
    (1000, 1, None), (1000, 13, None), (4099, 16, None), (4096, 64, None),  # the default group size
    (96, 10, 4),  # k close to the number of groups (24)
])
def test_the_k_largest_are_those_of_torch_topk(num_codes, k, group):
    g = torch.Generator().manual_seed(num_codes + k)
    s = torch.randn(37, num_codes, generator=g, dtype=torch.float64)  # continuous: no ties
    values, columns = top_k_rows(s, k, group)
    assert values.shape == columns.shape == (37, k) and columns.dtype == torch.int64
    assert torch.equal(s.gather(1, columns), values)  # each value is its column's
    ref_values, ref_columns = s.topk(k, dim=1)
    got, ref = _sorted(values, columns), _sorted(ref_values, ref_columns)
    assert torch.equal(got[1], ref[1]) and torch.equal(got[0], ref[0])


@pytest.mark.parametrize("k", [1, 2, 5, 11])
@pytest.mark.parametrize("group", [2, 4, 8])
def test_with_ties_the_set_of_values_is_topk_s(k, group):
    """Integer scores, most of them tied: the columns may differ from torch.topk's, the multiset of values may not,
    and no column is chosen twice."""
    g = torch.Generator().manual_seed(k * group)
    s = torch.randint(0, 6, (50, 90), generator=g).float()
    values, columns = top_k_rows(s, k, group)
    assert torch.equal(s.gather(1, columns), values)
    assert torch.equal(values.sort(1).values, s.topk(k, dim=1).values.sort(1).values)
    assert all(len(set(row)) == k for row in columns.tolist())


def test_rows_of_minus_infinity_and_large_k_fall_back_or_stay_exact():
    s = torch.randn(5, 40, dtype=torch.float64)
    s[:, ::3] = float("-inf")  # masked scores are never chosen before a finite one
    values, columns = top_k_rows(s, 4, 4)
    assert torch.isfinite(values).all()
    assert torch.equal(values.sort(1).values, s.topk(4, dim=1).values.sort(1).values)
    for k in (39, 40):  # k G >= K: torch.topk itself
        assert torch.equal(top_k_rows(s, k)[0].sort(1).values, s.topk(k, dim=1).values.sort(1).values)


def test_the_default_group_balances_the_two_passes():
    assert selection_group(16384, 64) == 16 and selection_group(4096, 64) == 8 and selection_group(1024, 16) == 8
    assert selection_group(16384, 16) == 16 and selection_group(65536, 16) == 16  # clamped to [4, 16]
    assert selection_group(64, 64) == 4


def test_no_host_synchronisation():
    s = torch.randn(20, 300)
    recorder = SyncRecorder()
    with recorder:
        top_k_rows(s, 5, 8)
        top_k_rows(s, 5, 7)  # with the extra members of a group size that does not divide K
    assert recorder.calls == []


def test_compiles_with_fullgraph_to_the_same_selection():
    torch._dynamo.reset()
    compiled = torch.compile(top_k_rows, fullgraph=True, backend="aot_eager")
    s = torch.randn(33, 203)
    for group in (4, 8):
        got, ref = _sorted(*compiled(s, 6, group)), _sorted(*top_k_rows(s, 6, group))
        assert torch.equal(got[0], ref[0]) and torch.equal(got[1], ref[1])


def test_a_layer_selecting_in_two_stages_is_the_truncated_distribution_in_float64():
    """k = 32 of K = 256 takes the two-stage path by default: the layer's output, assignments and encoder gradient
    equal the brute-force truncated layer's (tests/test_topk.py's reference)."""
    from test_topk import truncated_brute_force

    from softvq import DDCLQuantizer
    from softvq.parts import Gradient

    torch.manual_seed(0)
    layer = DDCLQuantizer(256, 4, 0.7, recipe="plain", top_k=32, init="normal", prototype_update=Gradient("l_q"))
    layer = layer.double()
    z = torch.randn(50, 4, dtype=torch.float64, requires_grad=True)
    g = torch.randn(50, 4, dtype=torch.float64)
    out = layer(z)
    (out.quantized * g).sum().backward()
    z_ref = z.detach().clone().requires_grad_(True)
    q, mu, _ = truncated_brute_force(z_ref, layer.prototypes.detach(), 0.7, 32)
    (mu * g).sum().backward()
    torch.testing.assert_close(out.dense_probs(256), q.detach(), rtol=1e-12, atol=1e-15)
    torch.testing.assert_close(out.quantized, mu.detach(), rtol=1e-12, atol=1e-13)
    torch.testing.assert_close(z.grad, z_ref.grad, rtol=1e-10, atol=1e-12)
