"""Code written for vector-quantize-pytorch runs unchanged when only the constructor line changes (docs/migrating.md's
promise): the same user function, written against ``VectorQuantize`` / ``ResidualVQ``'s API, run once with their
layer and once with softvq's, gets outputs of the same shapes and dtypes, and the same relations hold in both
(``get_output_from_indices(indices)`` is the evaluation output, it is the ``codebook`` rows of the indices). And the
output type, which iterates as vector-quantize-pytorch's triple, still flattens and rebuilds whole as a pytree (DDP,
torch.compile) and keeps NamedTuple's helpers."""

from __future__ import annotations

import copy
import pickle
from typing import Any

import pytest
import torch
import torch.utils._pytree as pytree

from softvq import DDCLQuantizer, HardVQ, QuantizerOutput, ResidualDDCL, ResidualHardVQ


@pytest.fixture(scope="module")
def vqp():
    return pytest.importorskip("vector_quantize_pytorch")


def _sig(t: torch.Tensor) -> tuple[tuple[int, ...], torch.dtype]:
    return tuple(t.shape), t.dtype


def vector_quantize_user(vq: torch.nn.Module, x: torch.Tensor) -> dict[str, Any]:
    """A user's code for ``VectorQuantize`` (its README's usage): unpack three, add the commitment loss to the task
    loss, backward; in evaluation decode the indices. Returns what it got (shapes and dtypes) and checks, on whichever
    layer it is given, the relations vector-quantize-pytorch's own layer satisfies."""
    x = x.clone().requires_grad_(True)
    vq.train()
    quantized, indices, commit_loss = vq(x)
    loss = quantized.square().mean() + commit_loss
    loss.backward()
    got = {"train": (_sig(quantized), _sig(indices), _sig(commit_loss)), "grad": _sig(x.grad),
           "loss": _sig(loss), "codebook": _sig(vq.codebook)}
    assert torch.isfinite(x.grad).all() and x.grad.abs().sum() > 0

    vq.eval()
    with torch.no_grad():
        quantized, indices, commit_loss = vq(x)
        decoded = vq.get_output_from_indices(indices)
        codes = vq.get_codes_from_indices(indices)
    got["eval"] = (_sig(quantized), _sig(indices), _sig(commit_loss), _sig(decoded), _sig(codes))
    # the semantics: the evaluation output is the decoded indices, and those are the codebook's rows
    torch.testing.assert_close(decoded, quantized, rtol=0, atol=1e-6)
    torch.testing.assert_close(codes, decoded, rtol=0, atol=0)
    rows = vq.codebook[indices]  # (..., D) channel-last
    torch.testing.assert_close(decoded.movedim(1, -1) if decoded.shape != rows.shape else decoded, rows,
                               rtol=0, atol=1e-6)
    assert indices.dtype == torch.long and 0 <= int(indices.min()) and int(indices.max()) < vq.codebook.shape[0]
    return got


def test_readme_image_maps_ddcl_is_a_one_line_swap(vqp):
    """README: ``VectorQuantize(dim=64, codebook_size=512, accept_image_fmap=True)`` becomes
    ``DDCLQuantizer(num_codes=512, dim=64, channel_first=True)``; feature maps (B, 64, H, W)."""
    torch.manual_seed(0)
    x = torch.randn(2, 64, 8, 8)
    theirs = vector_quantize_user(vqp.VectorQuantize(dim=64, codebook_size=512, accept_image_fmap=True), x)
    ours = vector_quantize_user(DDCLQuantizer(num_codes=512, dim=64, channel_first=True), x)
    assert ours == theirs
    assert theirs["train"] == (((2, 64, 8, 8), torch.float32), ((2, 8, 8), torch.long), ((), torch.float32))


@pytest.mark.parametrize("flag, x_shape", [("channel_last", (2, 16, 12)), ("accept_3d_fmap", (1, 16, 2, 4, 4))])
def test_other_channel_first_layouts_are_channel_first_too(vqp, flag, x_shape):
    """``VectorQuantize(channel_last=False)`` (sequences ``(B, D, N)``) and ``accept_3d_fmap=True`` (``(B, D, T, H,
    W)``) are ``channel_first=True`` as well."""
    torch.manual_seed(0)
    x = torch.randn(*x_shape)
    theirs = vector_quantize_user(vqp.VectorQuantize(dim=16, codebook_size=32, **{flag: flag == "accept_3d_fmap"}), x)
    assert vector_quantize_user(DDCLQuantizer(num_codes=32, dim=16, channel_first=True), x) == theirs


@pytest.mark.parametrize("x_shape", [(2, 128, 32), (256, 32)])
@pytest.mark.parametrize("ours", ["ddcl", "hard"])
def test_basic_usage_channel_last_is_a_one_line_swap(vqp, ours, x_shape):
    """vector-quantize-pytorch's README basic usage, sequences ``x (B, N, D)`` (and one token per row, ``(B, D)``):
    ``VectorQuantize(dim=D, codebook_size=K, decay=0.8, commitment_weight=1.)`` becomes ``DDCLQuantizer(num_codes=K,
    dim=D)`` or ``HardVQ(num_codes=K, dim=D, ema_decay=0.8, commitment_weight=1.)``."""
    torch.manual_seed(0)
    x = torch.randn(*x_shape)
    theirs = vector_quantize_user(vqp.VectorQuantize(dim=32, codebook_size=64, decay=0.8, commitment_weight=1.0), x)
    layer = (DDCLQuantizer(num_codes=64, dim=32) if ours == "ddcl"
             else HardVQ(num_codes=64, dim=32, ema_decay=0.8, commitment_weight=1.0))
    assert vector_quantize_user(layer, x) == theirs
    lead = x_shape[:-1]  # the README's comment: (1, 1024, 256), (1, 1024), and the loss a scalar
    assert theirs["train"] == ((x_shape, torch.float32), (lead, torch.long), ((), torch.float32))


def residual_vq_user(rvq: torch.nn.Module, x: torch.Tensor) -> dict[str, Any]:
    """A user's code for ``ResidualVQ`` (its README's usage), which sums the per-level commitment losses."""
    x = x.clone().requires_grad_(True)
    rvq.train()
    quantized, indices, commit_loss = rvq(x)
    (quantized.square().mean() + commit_loss.sum()).backward()
    got = {"train": (_sig(quantized), _sig(indices)), "loss": _sig(commit_loss.sum()), "grad": _sig(x.grad),
           "codebooks": _sig(rvq.codebooks)}
    rvq.eval()
    with torch.no_grad():
        quantized, indices, _ = rvq(x)
        decoded = rvq.get_output_from_indices(indices)
        codes = rvq.get_codes_from_indices(indices)
        coarse = rvq.get_output_from_indices(indices[..., :2])  # the first two levels only
    got["eval"] = (_sig(quantized), _sig(indices), _sig(decoded), _sig(codes), _sig(coarse))
    torch.testing.assert_close(decoded, quantized, rtol=0, atol=1e-5)
    torch.testing.assert_close(codes.sum(0), decoded, rtol=0, atol=1e-5)  # every level's code, summed
    torch.testing.assert_close(coarse, codes[:2].sum(0), rtol=0, atol=1e-5)
    for q in range(codes.shape[0]):  # level q's code is that level's codebook row
        torch.testing.assert_close(codes[q], rvq.codebooks[q][indices[..., q]], rtol=0, atol=1e-6)
    return got, commit_loss


@pytest.mark.parametrize("ours", ["ddcl", "hard"])
def test_residual_basic_usage_is_a_one_line_swap_but_the_loss_is_summed(vqp, ours):
    """``ResidualVQ(dim, num_quantizers=Q, codebook_size=K)`` becomes ``ResidualDDCL(Q, K, dim)`` /
    ``ResidualHardVQ(Q, K, dim)``: the same shapes, decoding and codes, except ``commit_loss``, which is ``(Q,)``
    per level there and the scalar sum here (``commit_loss.sum()`` is the same in both)."""
    torch.manual_seed(0)
    x = torch.randn(1, 128, 16)
    theirs, their_loss = residual_vq_user(
        vqp.ResidualVQ(dim=16, num_quantizers=3, codebook_size=32, quantize_dropout=True), x)
    layer = (ResidualDDCL(num_quantizers=3, num_codes=32, dim=16) if ours == "ddcl"
             else ResidualHardVQ(num_quantizers=3, num_codes=32, dim=16))
    got, our_loss = residual_vq_user(layer, x)
    assert got == theirs
    assert their_loss.shape == (3,) and our_loss.shape == ()


def test_the_triple_is_the_named_fields():
    torch.manual_seed(0)
    layer = DDCLQuantizer(16, 8)
    out = layer(torch.randn(4, 5, 8))
    assert isinstance(out, QuantizerOutput) and len(out) == 3
    assert list(out) == [out.quantized, out.indices, out.loss] == list(out[:])
    assert out[0] is out.quantized and out[1] is out.indices and out[2] is out.loss and out[-1] is out.loss
    # NamedTuple's helpers, as before
    assert QuantizerOutput._fields == ("quantized", "indices", "probs", "loss", "terms", "prob_codes")
    d = out._asdict()
    assert list(d) == list(QuantizerOutput._fields) and all(d[k] is getattr(out, k) for k in d)
    twice = out._replace(loss=out.loss * 2)
    assert twice.probs is out.probs and twice.loss is not out.loss and out.loss.ndim == 0
    rebuilt = QuantizerOutput._make(d.values())
    assert all(getattr(rebuilt, k) is v for k, v in d.items())
    positional = QuantizerOutput(out.quantized, out.indices, out.probs, out.loss, out.terms)
    assert positional.prob_codes is None and positional.terms is out.terms
    # copies and pickles whole
    with torch.no_grad():
        frozen = layer.eval()(torch.randn(3, 8))
    for copied in (copy.deepcopy(frozen), pickle.loads(pickle.dumps(frozen))):
        assert type(copied) is QuantizerOutput and torch.equal(copied.probs, frozen.probs)
        assert copied.terms.keys() == frozen.terms.keys()
    # zero tokens unpack too
    q, i, loss = layer(torch.empty(0, 8))
    assert q.shape == (0, 8) and i.shape == (0,) and loss.shape == ()


@pytest.mark.parametrize("layer", [DDCLQuantizer(16, 8, top_k=3), HardVQ(16, 8), ResidualDDCL(2, 16, 8)],
                         ids=["ddcl_top_k", "hard", "residual"])
def test_pytree_flattens_every_field_and_rebuilds_the_output(layer):
    """DDP's output hooks and torch.compile flatten outputs with torch.utils._pytree: all six fields (the terms
    dict's entries among them) must be leaves, and unflattening must give back the same output, not the triple."""
    torch.manual_seed(0)
    out = layer(torch.randn(6, 8))
    leaves, spec = pytree.tree_flatten(out)
    fields = [out.quantized, out.indices, out.probs, out.loss, *out.terms.values(), out.prob_codes]
    expected = [t for t in fields if t is not None]
    tensors = [t for t in leaves if isinstance(t, torch.Tensor)]
    assert len(tensors) == len(expected) and all(a is b for a, b in zip(tensors, expected, strict=True))
    back = pytree.tree_unflatten(leaves, spec)
    assert type(back) is QuantizerOutput
    assert all(getattr(back, k) is getattr(out, k) for k in ("quantized", "indices", "probs", "loss", "prob_codes"))
    assert back.terms == out.terms
    doubled = pytree.tree_map(lambda t: t * 2 if isinstance(t, torch.Tensor) else t, out)
    assert type(doubled) is QuantizerOutput and torch.equal(doubled.probs, out.probs * 2)
    # DDP's search for the output's tensors (find_unused_parameters) sees every field, not just the triple
    from torch.nn.parallel.distributed import _find_tensors
    assert {id(t) for t in _find_tensors(out)} == {id(t) for t in expected}


def test_a_ddp_wrapped_layer_returns_the_whole_output_and_trains_as_the_plain_one():
    """DDP flattens a module's output to find its tensors (find_unused_parameters) and passes it through its autograd
    sink: the output comes back whole, it unpacks, and the gradients are the plain layer's (one gloo process)."""
    import torch.distributed as dist
    from helpers import free_port
    from torch.nn.parallel import DistributedDataParallel

    torch.manual_seed(0)
    plain = HardVQ(16, 8, check_finite=False)  # a gradient-trained codebook: the loss reaches the prototypes
    wrapped_layer = HardVQ(16, 8, check_finite=False)
    wrapped_layer.load_state_dict(plain.state_dict())
    z = torch.randn(40, 8)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{free_port()}", rank=0, world_size=1)
    try:
        for static_graph in (False, True):
            for layer in (plain, wrapped_layer):
                layer.zero_grad()
            ddp = DistributedDataParallel(wrapped_layer, find_unused_parameters=not static_graph,
                                          static_graph=static_graph)
            out = ddp(z)
            assert type(out) is QuantizerOutput and out.dense_probs(16).shape == (40, 16) and "commitment" in out.terms
            quantized, indices, commit_loss = out
            (quantized.square().mean() + commit_loss).backward()
            ref_q, ref_i, ref_loss = plain(z)
            (ref_q.square().mean() + ref_loss).backward()
            assert torch.equal(indices, ref_i)
            torch.testing.assert_close(wrapped_layer.prototypes.grad, plain.prototypes.grad, rtol=1e-6, atol=1e-7)
    finally:
        dist.destroy_process_group()


def test_unpacking_compiles_without_a_graph_break():
    """User code that unpacks the triple inside ``torch.compile(fullgraph=True)`` (dynamo's tracing only), and a
    compiled layer's output keeps all six fields."""
    torch.manual_seed(0)
    layer = HardVQ(16, 8, check_finite=False)

    def step(z: torch.Tensor) -> torch.Tensor:
        quantized, indices, commit_loss = layer(z)
        return quantized.square().mean() + commit_loss + indices.float().mean() * 0

    z = torch.randn(32, 8)
    torch._dynamo.reset()
    torch.testing.assert_close(torch.compile(step, fullgraph=True, backend="eager")(z), step(z))
    out = torch.compile(layer, fullgraph=True, backend="eager")(z)
    assert type(out) is QuantizerOutput and out.dense_probs(16).shape == (32, 16) and set(out.terms) >= {"commitment"}
