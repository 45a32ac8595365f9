"""The DDCL layer's (N, K) work in row chunks (softvq._soft_centroid): any chunking gives the one-chunk result in
float64 (outputs, indices, terms, gradients to the tokens and the prototypes, the in-layer EMA and usage state), at
chunk sizes that do and do not divide N, exact and top-k; and top-k never materialises an (N, K) array in the forward
or the backward pass (every tensor an operator returns is recorded)."""

from __future__ import annotations

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

import softvq._kernels
import softvq._soft_centroid as sc
from softvq import DDCLQuantizer
from softvq.parts import Gradient


def chunked(monkeypatch, rows: int | None) -> None:
    """Chunks of ``rows`` rows (``None``: one chunk) in the forward and the backward pass."""
    big = 1 << 40
    monkeypatch.setattr(sc, "_MIN_ROWS", rows or big)
    monkeypatch.setattr(sc, "_CHUNK_ENTRIES", 1)
    monkeypatch.setattr(sc, "_TOP_K_ENTRIES", 1)
    assert len(sc._row_chunks(50, 24, torch.device("cpu"))) == (-(-50 // rows) if rows else 1)


def step(monkeypatch, rows, top_k, recipe):
    chunked(monkeypatch, rows)
    torch.manual_seed(0)
    if recipe == "plain":
        layer = DDCLQuantizer(24, 5, 0.7, recipe="plain", top_k=top_k, init="normal", prototype_update=Gradient("l_q"),
                              commitment_weight=0.25)
    else:
        layer = DDCLQuantizer(24, 5, top_k=top_k)  # EMA prototypes, restarts, the entropy control
    layer = layer.double().train()
    z = (torch.randn(50, 5, dtype=torch.float64) * 2 + 1).requires_grad_(True)
    g_mu = torch.randn(50, 5, dtype=torch.float64)
    outs = []
    for _ in range(3):  # three training steps: the state the first two leave is the third's input
        out = layer(z)
        g_q = torch.linspace(-1, 1, out.probs.numel(), dtype=torch.float64).reshape(out.probs.shape)
        ((out.quantized * g_mu).sum() + (out.probs * g_q).sum() + out.loss).backward()
        outs.append(out)
    state = {name: v.detach().clone() for name, v in layer.state_dict().items() if torch.is_tensor(v)}
    grads = {"z": z.grad.clone(), "p": None if layer.prototypes.grad is None else layer.prototypes.grad.clone()}
    return outs, state, grads


@pytest.mark.parametrize("top_k", [None, 6])
@pytest.mark.parametrize("recipe", ["plain", "default"])
@pytest.mark.parametrize("rows", [7, 10])  # 50 tokens: 7 does not divide N, 10 does
def test_any_chunking_gives_the_one_chunk_result_in_float64(monkeypatch, rows, top_k, recipe):
    ref_outs, ref_state, ref_grads = step(monkeypatch, None, top_k, recipe)
    outs, state, grads = step(monkeypatch, rows, top_k, recipe)
    for out, ref in zip(outs, ref_outs, strict=True):
        assert torch.equal(out.indices, ref.indices)
        if top_k:  # the same set per token (topk returns it unordered)
            assert torch.equal(out.prob_codes.sort(1).values, ref.prob_codes.sort(1).values)
        torch.testing.assert_close(out.dense_probs(24), ref.dense_probs(24), rtol=1e-12, atol=1e-14)
        torch.testing.assert_close(out.quantized, ref.quantized, rtol=1e-12, atol=1e-12)
        torch.testing.assert_close(out.loss, ref.loss, rtol=1e-12, atol=1e-14)
        for name in ("l_q", "l_ols", "v", "entropy"):
            torch.testing.assert_close(out.terms[name], ref.terms[name], rtol=1e-12, atol=1e-14)
    assert state.keys() == ref_state.keys()
    for name in state:  # prototypes, their EMA, usage counts
        torch.testing.assert_close(state[name], ref_state[name], rtol=1e-12, atol=1e-12, msg=name)
    torch.testing.assert_close(grads["z"], ref_grads["z"], rtol=1e-12, atol=1e-12)
    assert (grads["p"] is None) == (ref_grads["p"] is None) == (recipe != "plain")
    if grads["p"] is not None:
        torch.testing.assert_close(grads["p"], ref_grads["p"], rtol=1e-12, atol=1e-12)


class LargestOutput(TorchDispatchMode):
    """Records the largest element count of any tensor an operator returns."""

    def __init__(self):
        super().__init__()
        self.largest = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in torch.utils._pytree.tree_leaves(out):
            if isinstance(t, torch.Tensor):
                self.largest = max(self.largest, t.numel())
        return out


@pytest.mark.parametrize("recipe", ["plain", "default"])
def test_top_k_never_builds_an_n_by_k_array(monkeypatch, recipe):
    n, num_codes, k, rows = 1024, 2048, 8, 64
    chunked(monkeypatch, rows)
    torch.manual_seed(0)
    extra = dict(recipe="plain", temperature=0.5, prototype_update=Gradient("l_q")) if recipe == "plain" else {}
    layer = DDCLQuantizer(num_codes, 16, top_k=k, init="normal", **extra).train()
    z = torch.randn(n, 16, requires_grad=True)
    layer(z)  # the first batch calibrates T over (sample, K): not a step of the layer
    with LargestOutput() as seen:
        out = layer(z)
        (out.quantized.square().sum() + out.loss).backward()
    assert out.probs.shape == (n, k)
    # the largest: one chunk's scores (rows, K); the (N, K) array is 16x that
    assert seen.largest == rows * num_codes, seen.largest
    assert z.grad is not None and torch.isfinite(z.grad).all()


def test_a_top_k_layers_first_step_with_its_calibration_never_builds_an_n_by_k_array(monkeypatch):
    """The first training batch (initialisation, and T calibrated on the truncated distribution, a block of distances
    at a time) stays within one block too: the memory of a large codebook's first step is bounded like a later one's."""
    n, num_codes, k, rows = 1024, 2048, 8, 64
    chunked(monkeypatch, rows)
    monkeypatch.setattr(softvq._kernels, "CPU_BLOCK_BYTES", rows * num_codes * 4)  # calibration blocks of 64 rows
    torch.manual_seed(0)
    layer = DDCLQuantizer(num_codes, 16, top_k=k, target_entropy=1.5).train()
    z = torch.randn(n, 16, requires_grad=True)
    with LargestOutput() as seen:
        out = layer(z)
        (out.quantized.square().sum() + out.loss).backward()
    assert layer.temperature_control.ready and out.probs.shape == (n, k)
    assert seen.largest == rows * num_codes, seen.largest  # one block of scores; (N, K) is 16x that
