"""Classifier-free guidance and key/value-cached sampling of CodePrior: against the full-prefix reference, the
guidance formula by hand, label dropout, and priors saved before the null class existed."""

from __future__ import annotations

import lightning as L
import pytest
import torch

from softvq.models.prior import CodePrior, guide, load_prior
from softvq.models.transformer import PriorConfig


def prior(num_classes: int = 3, null_class: bool = True, seed: int = 0, **kwargs) -> CodePrior:
    torch.manual_seed(seed)
    config = PriorConfig(16, 4, 4, num_classes, null_class=null_class, layers=2, heads=2, dim=32, dropout=0.0)
    model = CodePrior(config, **kwargs).eval()
    with torch.no_grad():  # distinct start tokens: the class and the null class must visibly change the logits
        model.net.start_embedding.weight.normal_(0.0, 1.0)
    return model


def test_cached_step_logits_equal_the_full_prefix_forward():
    model = prior()
    labels = torch.tensor([0, 2, 1])
    codes = torch.randint(16, (3, 16), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        full = model(codes, labels)  # (3, 16, 16): row i from codes < i
        null_full = model(codes, null=True)
        net = model.net
        starts = (net.start_tokens(labels, 3), net.start_tokens(None, 3, null=True))
        for start, reference in zip(starts, (full, null_full), strict=True):
            caches, inputs = net.new_cache(3), start
            for i in range(16):
                torch.testing.assert_close(net.step(inputs, caches), reference[:, i], atol=1e-5, rtol=1e-5)
                inputs = codes[:, i]
            with pytest.raises(ValueError, match="all 16 positions are decoded"):
                net.step(inputs, caches)


@pytest.mark.parametrize("guidance", [1.0, 0.0, 2.5])
def test_cached_sampling_draws_what_uncached_sampling_draws(guidance):
    model = prior(seed=2)
    labels = torch.tensor([0, 1, 2, 2, 1])
    draws = [model.sample(5, labels, temperature=0.8, top_k=6, guidance=guidance, cache=cache,
                          generator=torch.Generator().manual_seed(3)) for cache in (True, False)]
    assert torch.equal(*draws)
    unconditional = prior(num_classes=0, seed=4)
    draws = [unconditional.sample(4, cache=cache, generator=torch.Generator().manual_seed(5))
             for cache in (True, False)]
    assert torch.equal(*draws)


def test_guidance_zero_is_unconditional_one_is_conditional_else_the_formula():
    model = prior(seed=6)
    labels = torch.tensor([2, 0])
    codes = torch.randint(16, (2, 16), generator=torch.Generator().manual_seed(7))
    with torch.no_grad():
        cond, uncond = model(codes, labels), model(codes, null=True)
        assert (cond - uncond).abs().max() > 1e-3  # the label matters, so the cases below are distinguishable
        torch.testing.assert_close(model.guided_logits(codes, labels, 0.0), uncond)
        torch.testing.assert_close(model.guided_logits(codes, labels, 1.0), cond)
        by_hand = uncond + 3.0 * cond - 3.0 * uncond
        torch.testing.assert_close(model.guided_logits(codes, labels, 3.0), by_hand, atol=1e-5, rtol=1e-5)
    assert torch.equal(guide(torch.tensor([2.0]), torch.tensor([1.0]), 0.5), torch.tensor([1.5]))
    # greedy guided decoding follows the argmax of the guided full-prefix logits
    greedy = torch.zeros(2, 16, dtype=torch.long)
    with torch.no_grad():
        for i in range(16):
            greedy[:, i] = model.guided_logits(greedy, labels, 4.0)[:, i].argmax(-1)
    assert torch.equal(model.sample(2, labels, top_k=1, guidance=4.0).flatten(1), greedy)


@pytest.mark.filterwarnings("ignore:You are trying to `self.log\\(\\)`")
def test_label_dropout_trains_the_dropped_sequences_on_the_null_class():
    model = prior(seed=8, label_dropout=0.5)
    codes = torch.randint(16, (64, 4, 4), generator=torch.Generator().manual_seed(9))
    labels = torch.randint(3, (64,), generator=torch.Generator().manual_seed(10))
    torch.manual_seed(11)
    dropped = torch.rand(64) < 0.5
    assert 0 < dropped.sum() < 64
    with torch.no_grad():
        expected = torch.cat([model.nll(codes[~dropped], labels[~dropped]), model.nll(codes[dropped], null=True)])
        torch.manual_seed(11)
        loss = model._common_step((codes, labels), "train")
        torch.testing.assert_close(loss, expected.mean())
        # validation scores the real labels, never dropped
        torch.testing.assert_close(model._common_step((codes, labels), "val"), model.nll(codes, labels).mean())
    assert prior().label_dropout == 0.1 and prior(num_classes=0).label_dropout == 0.0  # the defaults


def test_prior_saved_before_the_null_class_loads_and_samples_as_it_did(tmp_path):
    old = prior(null_class=False, seed=12)
    assert old.net.start_embedding.weight.shape[0] == 3 and old.label_dropout == 0.0
    expected = old.sample(6, torch.tensor([0, 1, 2, 0, 1, 2]), cache=False, generator=torch.Generator().manual_seed(13))
    hparams = dict(old.hparams)
    hparams["config"] = {k: v for k, v in hparams["config"].items() if k != "null_class"}
    hparams.pop("label_dropout")  # neither key existed then
    path = tmp_path / "old.ckpt"
    torch.save({"state_dict": old.state_dict(), "hyper_parameters": hparams,
                "pytorch-lightning_version": L.__version__}, path)
    loaded = load_prior(path)
    assert not loaded.config.has_null_class and loaded.label_dropout == 0.0
    again = loaded.sample(6, torch.tensor([0, 1, 2, 0, 1, 2]), generator=torch.Generator().manual_seed(13))
    assert torch.equal(again, expected)
    with pytest.raises(ValueError, match="needs a class-conditional prior trained with the null class"):
        loaded.sample(2, torch.tensor([0, 1]), guidance=2.0)


def test_bad_guidance_arguments_are_clear_errors():
    model = prior()
    for bad in (-1.0, float("nan"), float("inf")):
        with pytest.raises(ValueError, match="guidance must be a non-negative finite number"):
            model.sample(2, torch.tensor([0, 1]), guidance=bad)
    with pytest.raises(ValueError, match="needs a class-conditional prior"):
        prior(num_classes=0).sample(2, guidance=2.0)
    with pytest.raises(ValueError, match="no null class"):
        prior(num_classes=0)(torch.zeros(1, 16, dtype=torch.long), null=True)
    with pytest.raises(ValueError, match="pass labels=None with null=True"):
        model(torch.zeros(1, 16, dtype=torch.long), torch.tensor([0]), null=True)
    with pytest.raises(ValueError, match=r"label_dropout must be a number in \[0, 1\)"):
        prior(label_dropout=1.0)
    with pytest.raises(ValueError, match="label_dropout=0.2 needs a class-conditional config with null_class=True"):
        prior(null_class=False, label_dropout=0.2)
    with pytest.raises(ValueError, match=r"indices must lie in \[0, 3\)"):  # the null class is not a public label
        model.sample(1, torch.tensor([3]))
