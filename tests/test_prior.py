"""CodePrior / CodeTransformer: causality, fitting, sampling against references, evaluation, pairing checks."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

from softvq.data.cifar10 import CLASSES
from softvq.models import VQVAE
from softvq.models.prior import (
    CodePrior,
    check_pairing,
    class_index,
    evaluate_prior,
    load_prior,
    unigram_bits,
    unigram_cross_entropy_bits,
    vqvae_record,
)
from softvq.models.transformer import CausalSelfAttention, PriorConfig


def tiny_prior(num_codes: int = 16, height: int = 8, width: int = 8, num_classes: int = 0, seed: int = 0,
               **kwargs) -> CodePrior:
    torch.manual_seed(seed)
    config = PriorConfig(num_codes, height, width, num_classes, **{"layers": 2, "heads": 2, "dim": 32,
                                                                   "dropout": 0.0, **kwargs})
    return CodePrior(config).eval()


def tiny_vqvae(num_codes: int = 16, downsamples: int = 2) -> VQVAE:
    torch.manual_seed(0)
    return VQVAE("hard", num_codes=num_codes, code_dim=8, width=16, res_hidden=8, res_blocks=1,
                 downsamples=downsamples).eval()


@pytest.mark.parametrize("num_classes", [0, 3])
def test_causal_mask_changing_a_later_code_leaves_earlier_logits_unchanged(num_classes):
    prior = tiny_prior(num_classes=num_classes)
    g = torch.Generator().manual_seed(1)
    codes = torch.randint(16, (4, 8, 8), generator=g)
    labels = torch.tensor([0, 1, 2, 0]) if num_classes else None
    with torch.no_grad():
        base = prior(codes, labels)  # (4, 64, 16)
        for j in (0, 17, 40, 63):
            changed = codes.clone().flatten(1)
            changed[:, j] = (changed[:, j] + 5) % 16
            out = prior(changed.view(4, 8, 8), labels)
            # row i predicts code i from codes < i: rows 0..j cannot see code j
            torch.testing.assert_close(out[:, : j + 1], base[:, : j + 1], atol=1e-6, rtol=0)
            if j < 63:
                assert (out[:, j + 1:] - base[:, j + 1:]).abs().max() > 1e-4  # later rows do see it
            else:
                torch.testing.assert_close(out, base, atol=0, rtol=0)  # the last code is never an input
        # a prefix gives the same logits as the whole sequence at the positions it covers
        torch.testing.assert_close(prior(codes.flatten(1)[:, :10], labels), base[:, :11], atol=1e-5, rtol=1e-5)
        if num_classes:  # the class reaches every position
            other = prior(codes, torch.tensor([1, 2, 0, 1]))
            assert ((other - base).abs().amax(dim=(0, 2)) > 1e-4).all()


def test_causal_attention_matches_an_explicit_masked_softmax():
    torch.manual_seed(0)
    attn = CausalSelfAttention(dim=12, heads=3, dropout=0.0).double()
    x = torch.randn(2, 7, 12, dtype=torch.float64)
    q, k, v = attn.qkv(x).split(12, dim=-1)
    heads = [slice(4 * h, 4 * h + 4) for h in range(3)]
    outs = []
    for s in heads:  # per head: softmax(q k^T / sqrt(e) + mask) v with -inf above the diagonal
        scores = q[..., s] @ k[..., s].transpose(1, 2) / math.sqrt(4)
        scores = scores.masked_fill(torch.ones(7, 7, dtype=torch.bool).triu(1), float("-inf"))
        outs.append(scores.softmax(-1) @ v[..., s])
    reference = attn.proj(torch.cat(outs, dim=-1))
    torch.testing.assert_close(attn(x), reference, atol=1e-12, rtol=1e-10)


@pytest.mark.parametrize("conditional", [True, False])
def test_a_tiny_prior_overfits_eight_sequences(conditional):
    g = torch.Generator().manual_seed(0)
    codes = torch.randint(16, (8, 4, 4), generator=g)
    codes[:, 0, 0] = torch.tensor([0, 0, 1, 2, 3, 4, 5, 6])  # 7 distinct first codes, two sequences share one
    codes[1, 0, 1] = (codes[0, 0, 1] + 1) % 16  # ... and differ at the second
    labels = torch.arange(8) if conditional else None
    torch.manual_seed(0)
    prior = CodePrior(PriorConfig(16, 4, 4, num_classes=8 if conditional else 0, layers=2, heads=2, dim=64,
                                  dropout=0.0))
    prior.train()
    optimizer = torch.optim.Adam(prior.parameters(), lr=3e-3)
    for _ in range(300):
        loss = prior.nll(codes, labels).mean()
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
    nll = prior.eval().nll(codes, labels).detach()  # (8, 16) nats
    if conditional:  # the label identifies the sequence: every code is certain
        assert nll.mean() < 0.01
    else:
        # Without a label the first code is a draw from the 8 sequences' first codes (code 0 twice) and the second
        # code of the two sequences starting with 0 is a coin flip; everything after is determined. The minimum mean
        # NLL is therefore the entropy of those draws spread over the 8 x 16 positions.
        first = -(2 / 8 * math.log(2 / 8) + 6 / 8 * math.log(1 / 8))
        floor = (8 * first + 2 * math.log(2)) / (8 * 16)
        assert floor <= nll.mean() < floor + 0.01
        assert nll[:, 2:].mean() < 0.01


def test_samples_lie_in_range_and_decode_to_images():
    prior = tiny_prior()
    codes = prior.sample(5, generator=torch.Generator().manual_seed(0))
    assert codes.shape == (5, 8, 8) and codes.dtype == torch.long
    assert int(codes.min()) >= 0 and int(codes.max()) < 16
    images = tiny_vqvae().decode_indices(codes)
    assert images.shape == (5, 3, 32, 32) and torch.isfinite(images).all()
    conditional = tiny_prior(num_classes=10)
    drawn = conditional.sample(3, torch.tensor([0, 4, 9]), temperature=0.7, top_k=4)
    assert drawn.shape == (3, 8, 8) and 0 <= int(drawn.min()) and int(drawn.max()) < 16
    # the same generator seed gives the same draws; sampling leaves the module's mode alone
    conditional.train()
    again = conditional.sample(3, torch.tensor([0, 4, 9]), temperature=0.7, top_k=4)
    assert conditional.training and again.shape == drawn.shape
    a = prior.sample(4, generator=torch.Generator().manual_seed(7))
    b = prior.sample(4, generator=torch.Generator().manual_seed(7))
    assert torch.equal(a, b)


def test_top_k_one_equals_greedy_argmax_decoding():
    prior = tiny_prior(num_classes=2, seed=3)
    labels = torch.tensor([0, 1, 1])
    greedy = torch.zeros(3, 64, dtype=torch.long)
    with torch.no_grad():
        for i in range(64):  # reference: the whole (zero-padded) sequence each step; causality hides the padding
            greedy[:, i] = prior(greedy, labels)[:, i].argmax(-1)
    sampled = prior.sample(3, labels, temperature=2.5, top_k=1, generator=torch.Generator().manual_seed(0))
    assert torch.equal(sampled.flatten(1), greedy)


def test_first_code_frequencies_follow_the_tempered_top_k_distribution():
    prior = tiny_prior(num_codes=6, height=1, width=2, seed=1)
    with torch.no_grad():
        prior.net.head.bias.copy_(torch.tensor([2.0, 1.0, 0.5, 0.0, -0.5, -1.0]))  # a clearly non-uniform start
        logits = prior(torch.zeros(1, 0, dtype=torch.long))[0, 0]
    n = 20000
    # top_k = K - 1 (5 of 6) is the largest that truncates: the least likely code (bias -1) is never drawn
    for temperature, top_k in ((1.0, None), (0.5, 3), (1.0, 5)):
        draws = prior.sample(n, temperature=temperature, top_k=top_k, generator=torch.Generator().manual_seed(0))
        freq = torch.bincount(draws[:, 0, 0], minlength=6).double() / n
        expected = (logits.double() / temperature)
        if top_k is not None:
            expected[expected.argsort(descending=True)[top_k:]] = float("-inf")
        expected = expected.softmax(-1)
        assert (freq - expected).abs().max() < 0.015, (freq, expected)
        if top_k is not None:
            assert (freq[expected == 0] == 0).all()


def test_invalid_sampling_and_model_arguments_are_clear_errors():
    prior = tiny_prior()
    for bad in (0.0, -1.0, float("nan")):
        with pytest.raises(ValueError, match="temperature must be a positive finite number"):
            prior.sample(2, temperature=bad)
    for bad in (0, 17, 2.5):
        with pytest.raises(ValueError, match=r"top_k must be an integer in \[1, 16\]"):
            prior.sample(2, top_k=bad)
    with pytest.raises(ValueError, match="n must be a positive integer, got 0"):
        prior.sample(0)
    with pytest.raises(ValueError, match="unconditional"):
        prior.sample(2, torch.tensor([0, 1]))
    conditional = tiny_prior(num_classes=10)
    with pytest.raises(ValueError, match="class-conditional"):
        conditional.sample(2)
    with pytest.raises(ValueError, match=r"indices must lie in \[0, 10\)"):
        conditional.sample(2, torch.tensor([0, 10]))
    with pytest.raises(ValueError, match=r"expected labels of shape \(2,\)"):
        conditional.sample(2, torch.tensor([0, 1, 2]))
    with pytest.raises(ValueError, match=r"indices must lie in \[0, 16\)"):
        prior(torch.full((1, 8, 8), 16))
    with pytest.raises(ValueError, match=r"expected a code grid of shape \(B, 8, 8\)"):
        prior(torch.zeros(1, 4, 4, dtype=torch.long))
    with pytest.raises(ValueError, match="heads must divide dim, got dim=32 and heads=3"):
        PriorConfig(16, heads=3, dim=32)
    with pytest.raises(ValueError, match="dropout must be in"):
        PriorConfig(16, dropout=1.0)
    with pytest.raises(ValueError, match="num_codes must be at least 2"):
        PriorConfig(1)


def test_evaluation_and_unigram_baselines_against_hand_computed_values():
    prior = tiny_prior()
    codes = torch.randint(16, (7, 8, 8), generator=torch.Generator().manual_seed(2))
    result = evaluate_prior(prior, codes, batch_size=3)
    with torch.no_grad():
        logits = prior(codes)
        reference = -logits.log_softmax(-1).gather(-1, codes.flatten(1)[..., None])[..., 0] / math.log(2)
    assert result.sequences == 7 and result.position_bits.shape == (8, 8)
    assert result.bits_per_position == pytest.approx(float(reference.mean()), rel=1e-6)
    torch.testing.assert_close(result.position_bits.flatten(), reference.mean(0), atol=1e-5, rtol=1e-5)
    assert float(F.cross_entropy(logits.transpose(1, 2), codes.flatten(1))) / math.log(2) == pytest.approx(
        result.bits_per_position, rel=1e-6)
    # unigram entropy: codes {0: 2, 1: 1, 3: 1} -> -(1/2 log2 1/2 + 2 * 1/4 log2 1/4) = 1.5 bits; perplexity 2^1.5
    assert unigram_bits(torch.tensor([[0, 0], [1, 3]]), num_codes=4) == pytest.approx(1.5)
    assert unigram_bits(torch.zeros(5, dtype=torch.long), num_codes=4) == 0.0
    # train counts {0: 3, 1: 1} + 0.5 each over K = 4 -> p = (3.5, 1.5, 0.5, 0.5) / 6; test codes 0 and 2
    expected = -(math.log2(3.5 / 6) + math.log2(0.5 / 6)) / 2
    assert unigram_cross_entropy_bits(torch.tensor([0, 0, 0, 1]), torch.tensor([0, 2]), 4) == pytest.approx(expected)


def test_pairing_refuses_another_codebook_size_grid_or_checkpoint(caplog):
    vqvae = tiny_vqvae(num_codes=16)
    prior = CodePrior(PriorConfig(16, layers=1, heads=1, dim=8), vqvae_record(vqvae, "a.ckpt", "a" * 64))
    check_pairing(prior, vqvae, "a" * 64, "a.ckpt")  # its own VQ-VAE: fine
    with pytest.raises(ValueError, match=r"K=16 codes, but b.ckpt has K=32; decode its samples with .*a.ckpt"):
        check_pairing(prior, tiny_vqvae(num_codes=32), "b" * 64, "b.ckpt")
    with pytest.raises(ValueError, match="models 8x8 code grids, but c.ckpt encodes 32x32 images into 4x4 grids"):
        check_pairing(prior, tiny_vqvae(downsamples=3), "c" * 64, "c.ckpt")
    with pytest.raises(ValueError, match="d.ckpt .* is not the VQ-VAE it was trained on .*--allow-other-vqvae"):
        check_pairing(prior, vqvae, "d" * 64, "d.ckpt")
    with caplog.at_level("WARNING", logger="softvq"):
        check_pairing(prior, vqvae, "d" * 64, "d.ckpt", allow_other_vqvae=True)
    assert "meaningless" in caplog.text
    with pytest.raises(ValueError, match="holds no record of the VQ-VAE"):
        check_pairing(tiny_prior(), vqvae, "a" * 64)
    with pytest.raises(ValueError, match=r"config.num_codes \(32\) differs from the VQ-VAE's K \(16\)"):
        CodePrior(PriorConfig(32), vqvae_record(vqvae, "a.ckpt", "a" * 64))


def test_class_names_and_indices():
    assert class_index("horse", CLASSES) == 7 and class_index("3", CLASSES) == 3 and class_index(0, CLASSES) == 0
    with pytest.raises(ValueError, match="class must be one of .*'zebra'"):
        class_index("zebra", CLASSES)
    with pytest.raises(ValueError, match=r"an index in \[0, 10\), got '10'"):
        class_index("10", CLASSES)


def test_load_prior_errors_name_the_file(tmp_path):
    with pytest.raises(FileNotFoundError, match="prior checkpoint not found: .*nope.ckpt"):
        load_prior(tmp_path / "nope.ckpt")
    broken = tmp_path / "broken.ckpt"
    broken.write_bytes(b"not a checkpoint")
    with pytest.raises(ValueError, match="broken.ckpt is truncated, corrupt or not a models.CodePrior checkpoint"):
        load_prior(broken)
