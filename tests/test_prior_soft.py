"""Soft targets for the prior: the stored top-k assignments against the layer's dense distribution, the soft
cross-entropy against one written out in float64, and a prior trained on one-hot soft targets against today's."""

from __future__ import annotations

import warnings

import lightning as L
import pytest
import torch
from torch.utils.data import DataLoader, TensorDataset

import softvq
from softvq.models import VQVAE
from softvq.models.codes import extract_codes, top_k_assignments
from softvq.models.prior import CodePrior
from softvq.models.transformer import PriorConfig


def _ddcl_output(top_k: int | None = None, num_codes: int = 32):
    torch.manual_seed(0)
    layer = softvq.DDCLQuantizer(num_codes, 8, top_k=top_k)
    layer(torch.randn(4, 64, 8))  # the first batch calibrates the temperature
    return layer.eval()(torch.randn(3, 5, 8))


@pytest.mark.parametrize("k", [1, 5, 32])
def test_top_k_assignments_are_the_dense_distributions_k_largest_renormalised(k):
    out = _ddcl_output()
    soft = top_k_assignments(out, k)
    dense = out.probs.double()
    # written out: sort every token's distribution, keep the first k, divide by their sum
    ordered = dense.sort(-1, descending=True).values[..., :k]
    assert torch.allclose(soft.probs.double(), ordered / ordered.sum(-1, keepdim=True), atol=1e-6)
    assert torch.allclose(soft.mass.double(), ordered.sum(-1), atol=1e-6)
    assert torch.allclose(dense.gather(-1, soft.codes), ordered, atol=0)  # the kept codes hold those values
    assert torch.equal(soft.codes[..., 0], out.indices)  # the first entry is the hard code
    if k == 32:  # everything kept: the stored targets are the layer's distribution itself
        back = torch.zeros_like(dense).scatter(-1, soft.codes, soft.probs.double())
        assert torch.allclose(back, dense, atol=1e-6) and torch.allclose(soft.mass, torch.ones(3, 5), atol=1e-6)


def test_top_k_assignments_of_the_top_k_form_and_of_hard_vq_pad_with_zeros_on_the_hard_code():
    out = _ddcl_output(top_k=4)
    soft = top_k_assignments(out, 6)
    dense = out.dense_probs(32).double()
    ordered = dense.sort(-1, descending=True).values[..., :6]
    assert torch.allclose(soft.probs.double(), ordered / ordered.sum(-1, keepdim=True), atol=1e-6)
    assert torch.equal(soft.codes[..., 4:], out.indices[..., None].expand(3, 5, 2))
    torch.manual_seed(0)
    hard = softvq.HardVQ(16, 8).eval()(torch.randn(2, 3, 8))
    soft = top_k_assignments(hard, 3)
    assert torch.equal(soft.probs, torch.tensor([1.0, 0.0, 0.0]).expand(2, 3, 3))
    assert torch.equal(soft.codes, hard.indices[..., None].expand(2, 3, 3)) and torch.equal(soft.mass,
                                                                                           torch.ones(2, 3))


def test_extracted_soft_codes_are_the_quantizers_assignments_of_each_image():
    torch.manual_seed(0)
    model = VQVAE("ddcl", num_codes=16, code_dim=8, width=16, res_hidden=8, res_blocks=1)
    images = torch.rand(6, 3, 32, 32)
    model.train()(images)  # calibrates the temperature
    model.eval()
    data = TensorDataset(images, torch.arange(6))
    got = extract_codes(model, data, batch_size=4, soft_top_k=16)
    assert torch.equal(got.codes, extract_codes(model, data, batch_size=4).codes)
    with torch.no_grad():
        for i in range(6):  # one image at a time: the layer's dense probabilities
            dense = model.quantizer(model.latents(images[i:i + 1]).movedim(1, -1)).probs[0].double()
            back = torch.zeros_like(dense).scatter(-1, got.soft.codes[i], got.soft.probs[i].double())
            assert torch.allclose(back, dense, atol=1e-5)


def _prior(soft_targets: float) -> CodePrior:
    torch.manual_seed(0)
    return CodePrior(PriorConfig(8, 2, 2, 0, layers=1, heads=2, dim=16, dropout=0.0), warmup_steps=1,
                     soft_targets=soft_targets)


def test_soft_cross_entropy_against_one_written_out_and_one_hot_targets_give_the_hard_nll():
    prior = _prior(0.5).double()
    g = torch.Generator().manual_seed(1)
    codes = torch.randint(8, (3, 2, 2), generator=g)
    q = torch.rand(3, 2, 2, 8, generator=g, dtype=torch.float64).softmax(-1)
    values, where = q.topk(3, dim=-1)
    values = values / values.sum(-1, keepdim=True)
    log_p = prior(codes).log_softmax(-1).reshape(3, 2, 2, 8)
    dense = torch.zeros_like(q).scatter(-1, where, values)
    expected = -(dense * log_p).sum(-1).reshape(3, 4)
    assert torch.allclose(prior.soft_nll(codes, values, where), expected, atol=1e-12)
    one_hot = torch.zeros(3, 2, 2, 3, dtype=torch.float64)
    one_hot[..., 0] = 1.0
    on_hard = torch.cat([codes[..., None], where[..., 1:]], -1)  # the hard code first, weight-0 codes after it
    assert torch.allclose(prior.soft_nll(codes, one_hot, on_hard), prior.nll(codes).double(), atol=1e-6)
    with pytest.raises(ValueError, match="soft targets must be"):
        prior.soft_nll(codes, values[..., :2], where)


def test_the_training_loss_weighs_the_hard_codes_by_one_minus_a_and_the_soft_targets_by_a():
    """The loss of soft_targets = a written out: (1 - a) times the hard codes' cross-entropy plus a times the soft
    targets', each from the logits' log-softmax. The soft targets here lie off the hard codes (one-hot targets on them
    would make the two terms equal, and any weights would pass), and a = 0.3 is not 1/2, so swapped weights differ."""
    a = 0.3
    prior = _prior(a).double()
    g = torch.Generator().manual_seed(3)
    codes = torch.randint(8, (3, 2, 2), generator=g)
    where = torch.stack([(codes + 1) % 8, (codes + 2) % 8], -1)  # two codes other than the hard one
    probs = torch.rand(3, 2, 2, 2, generator=g, dtype=torch.float64).softmax(-1)
    log_p = prior(codes).log_softmax(-1).reshape(3, 2, 2, 8)
    hard = -log_p.gather(-1, codes[..., None])[..., 0]
    soft = -(probs * log_p.gather(-1, where)).sum(-1)
    expected = ((1 - a) * hard + a * soft).mean()
    assert not torch.allclose(expected, (a * hard + (1 - a) * soft).mean(), atol=1e-3)  # the weights matter here
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # self.log without a Trainer
        loss = prior.training_step((codes, torch.zeros(3, dtype=torch.long), probs, where), 0)
    torch.testing.assert_close(loss, expected, rtol=1e-6, atol=1e-6)  # the hard term is computed in float32


def _fit(soft_targets: float, batches: list[tuple[torch.Tensor, ...]]) -> CodePrior:
    prior = _prior(soft_targets)
    L.seed_everything(0, verbose=False)
    trainer = L.Trainer(max_epochs=1, accelerator="cpu", logger=False, enable_checkpointing=False,
                        enable_progress_bar=False, enable_model_summary=False)
    tensors = [torch.cat(parts) for parts in zip(*batches, strict=True)]
    trainer.fit(prior, DataLoader(TensorDataset(*tensors), batch_size=4))
    return prior


def test_a_prior_trained_on_one_hot_soft_targets_is_todays_prior():
    g = torch.Generator().manual_seed(2)
    codes = torch.randint(8, (12, 2, 2), generator=g)
    labels = torch.zeros(12, dtype=torch.long)
    one_hot = torch.zeros(12, 2, 2, 2)
    one_hot[..., 0] = 1.0
    on_hard = torch.stack([codes, (codes + 1) % 8], -1)
    today = _fit(0.0, [(codes, labels)])
    for weight in (0.0, 1.0, 0.3):  # 0: the soft targets are ignored, bit for bit; else equal up to rounding
        soft = _fit(weight, [(codes, labels, one_hot, on_hard)])
        for (name, a), b in zip(today.state_dict().items(), soft.state_dict().values(), strict=True):
            if weight == 0.0:
                assert torch.equal(a, b), name
            else:
                assert torch.allclose(a, b, atol=1e-5), name
    # soft targets that differ from the hard codes train another prior
    spread = torch.full((12, 2, 2, 2), 0.5)
    other = _fit(1.0, [(codes, labels, spread, on_hard)])
    assert any(not torch.allclose(a, b, atol=1e-4)
               for a, b in zip(today.state_dict().values(), other.state_dict().values(), strict=True))


def test_soft_targets_options_are_checked():
    with pytest.raises(ValueError, match="soft_targets must be a number in"):
        _prior(1.5)
    prior = _prior(0.5)
    codes = torch.zeros(2, 2, 2, dtype=torch.long)
    with pytest.raises(ValueError, match="needs batches with soft targets"):
        prior.training_step((codes, torch.zeros(2, dtype=torch.long)), 0)
