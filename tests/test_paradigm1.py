"""eval/paradigm1/ against independent references: known clusters, brute-force masses and decompositions, bad
input."""

from __future__ import annotations

import argparse
import json
import math

import pytest
import torch
from helpers import exact_cdist

from eval import paradigm1
from eval.paradigm1 import encoders
from eval.paradigm1.encoders import TokenSet, load_token_file
from eval.paradigm1.heads import ReadoutHead, masked_mean
from eval.paradigm1.vit import ViTConfig
from softvq.models.checkpoint_io import UnsafeCheckpointError

TINY = paradigm1.Paradigm1Config(seeds=(0, 1, 2), cluster_tokens=1024, cluster_steps=40, cluster_batch=128,
                                 cluster_mult=2, codes=6, codes_level2=3, epochs=2, batch_size=64, lr=1e-2,
                                 logreg_c=(1.0,), logreg_iter=50)


@pytest.fixture(autouse=True)
def _one_thread():
    """Tiny tensors: one intra-op thread is faster, and much faster beside other CPU-bound processes."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def blobs(n: int, classes: int = 3, length: int = 6, dim: int = 5, seed: int = 0, pad: bool = True) -> TokenSet:
    """Sequences whose tokens lie around their class's centre (well separated); ragged lengths, NaN padding."""
    g = torch.Generator().manual_seed(seed)
    centres = torch.tensor([[8.0 * (c == j) for j in range(dim)] for c in range(classes)])
    labels = torch.arange(n) % classes
    tokens = centres[labels][:, None] + 0.5 * torch.randn(n, length, dim, generator=g)
    mask = None
    if pad:
        mask = torch.arange(length)[None] < torch.randint(2, length + 1, (n,), generator=g)[:, None]
        tokens[~mask] = float("nan")  # padding may hold anything
    return TokenSet(tokens, labels, mask, tokens[:, 0].nan_to_num() + 0.1)


def test_ddcl_clustering_recovers_known_clusters_and_matches_kmeans():
    train, test = paradigm1.standardize(blobs(120), blobs(60, seed=1))[:2]
    out = paradigm1.clustering(train, test, 3, seed=0, cfg=TINY)
    assert set(out) == {f"{m}_{s}_k{k}" for m in ("kmeans", "ddcl") for s in ("pooled", "tokens") for k in (3, 6)}
    for space in ("pooled", "tokens"):
        for method in ("kmeans", "ddcl"):
            r = out[f"{method}_{space}_k3"]
            assert r["acc"] == 1.0 and r["nmi"] == pytest.approx(1.0) and r["ari"] == pytest.approx(1.0)
        assert out[f"ddcl_{space}_k6"]["acc"] == 1.0  # the majority map of 6 clusters onto 3 classes
        assert out[f"ddcl_{space}_k3"]["max_identity_residual"] < 1e-4  # float32, relative to a small L_q


def test_cluster_of_an_example_is_its_largest_mass_against_brute_force():
    data = blobs(40, seed=2)
    train = paradigm1.standardize(data, data)[0]
    readout, _ = paradigm1.fit_ddcl_clusters(train.tokens[train.mask], 4, seed=0, cfg=TINY)
    got = paradigm1.ddcl_clusters(readout, train.tokens, train.mask, batch=7)
    p, t = readout.prototypes.detach().double(), readout.quantizer.temperature
    for b in range(len(got)):
        z = train.tokens[b][train.mask[b]].double()
        q = torch.softmax(-exact_cdist(z, p).square() / t, dim=1)
        assert got[b] == int(q.sum(0).argmax())


def test_vote_is_the_majority_cluster_of_the_real_tokens():
    mask = torch.tensor([[True, True, True, False], [True, False, False, False], [True, True, False, False]])
    tokens = [2, 0, 2, 1, 0, 1]  # clusters of tokens[mask], row-major; row 2 ties 0-1 -> the lower index
    assert paradigm1.vote(tokens, mask, 3).tolist() == [2, 1, 0]


def test_standardize_uses_only_real_tokens_and_zeroes_padding():
    data = blobs(50)
    train, test, scaling = paradigm1.standardize(data, blobs(20, seed=3))
    real = train.tokens[train.mask].double()
    torch.testing.assert_close(real.mean(0), torch.zeros(5, dtype=torch.float64), atol=1e-5, rtol=0)
    assert real.square().mean().item() == pytest.approx(1.0, rel=1e-5) and scaling["scale"] > 1
    assert torch.equal(train.tokens[~train.mask], torch.zeros_like(train.tokens[~train.mask]))
    assert torch.isfinite(test.tokens).all() and test.mask is not None
    torch.testing.assert_close(masked_mean(train.tokens, train.mask)[0], train.tokens[0][train.mask[0]].mean(0))


def test_two_level_readout_decomposes_at_every_level_against_brute_force():
    torch.manual_seed(0)
    data = blobs(32, dim=4)
    s = paradigm1.standardize(data, data)[0]
    head = ReadoutHead(4, 3, (5, 3), temperature=1.0, temperature_ratio=0.05).double().train()
    tokens = s.tokens.double()
    head(tokens, s.mask)
    assert len(head.history) == 1 and len(head.history[0]) == 2
    r1, r2 = head.readouts
    assert r2.quantizer.temperature == pytest.approx(0.05 * 2 * (r1(tokens, s.mask).assignments[s.mask]
                                                                @ r1.prototypes.detach()).var(0).sum().item())
    # Brute force: every level's L_q, L_OLS and V from its inputs and prototypes, and L_q = L_OLS + V.
    x = tokens[s.mask]
    for level, readout in enumerate(head.readouts):
        p, t = readout.prototypes.detach(), readout.quantizer.temperature
        d = exact_cdist(x, p).square()
        q = torch.softmax(-d / t, dim=1)
        mu = q @ p
        l_q, l_ols = (q * d).sum(1).mean(), (x - mu).square().sum(1).mean()
        v = (q * exact_cdist(mu, p).square()).sum(1).mean()
        assert v >= 0 and float(l_q) == pytest.approx(float(l_ols + v), rel=1e-10)
        terms = {k: float(val) for k, val in readout(x[:, None].contiguous()).terms.items()}
        assert terms["v"] == pytest.approx(float(v), rel=1e-6) and terms["identity_residual"] < 1e-10
        assert head.history[0][level]["v"] == pytest.approx(float(v), rel=1e-6)
        x = mu.detach()  # level 2 reads level 1's soft centroids


def test_run_paradigm1_end_to_end_records_v_per_level_and_epoch():
    result = paradigm1.run_paradigm1(blobs(90), blobs(45, seed=1), paradigm1.replace(TINY, seeds=(0, 1)))
    assert set(result["supervised"]) == {"cls", "mean", "ddcl_pooled", "ddcl_slots", "ddcl_2level"}
    assert result["supervised"]["ddcl_slots"]["test_acc"]["mean"] == 1.0
    assert result["logreg"]["test_acc"] == 1.0 and result["logreg"]["features"] == 30
    epochs = result["hierarchy"]["per_seed"]
    assert len(epochs) == 2 and [e["epoch"] for e in epochs[0]] == [1, 2] and len(epochs[0][0]["levels"]) == 2
    assert result["hierarchy"]["v_min"] >= 0 and result["hierarchy"]["identity_residual_max"] < 1e-5
    assert len(result["clustering"]["ddcl_tokens_k3"]["acc"]["values"]) == 2


@pytest.mark.parametrize(("change", "message"), [
    (lambda tr: tr._replace(tokens=tr.tokens[0]), r"train tokens must be a float tensor \(N, T, D\), got shape"),
    (lambda tr: tr._replace(labels=tr.labels[:-1]), "train: 29 labels for 30 token sequences"),
    (lambda tr: tr._replace(labels=tr.labels.float()), "train labels must be a 1-D integer tensor"),
    (lambda tr: tr._replace(tokens=tr.tokens.masked_fill(torch.eye(6, dtype=torch.bool)[None, :, :1].expand(30, 6, 5)
                                                         & tr.mask[..., None], float("nan"))),
     "train tokens hold 30 real token.* NaN or Inf, the first in row 0"),
    (lambda tr: tr._replace(mask=tr.mask[:, :3]), r"train mask must be a bool tensor of shape \(30, 6\)"),
    (lambda tr: tr._replace(mask=tr.mask & (torch.arange(30) != 4)[:, None]), r"train row\(s\) \[4\] have no real"),
    (lambda tr: tr._replace(cls=None), "cls features must be given for both splits or for neither"),
    (lambda tr: tr._replace(labels=torch.zeros(30, dtype=torch.long)), "need at least 2 classes"),
])
def test_bad_inputs_are_clear_errors(change, message):
    with pytest.raises(ValueError, match=message):
        paradigm1.check_inputs(change(blobs(30)), blobs(12, seed=1))
    with pytest.raises(ValueError, match="train and test tokens must share D"):
        paradigm1.check_inputs(blobs(30), blobs(12, dim=7))


def test_token_file_round_trip_and_bad_files(tmp_path):
    tr, te = blobs(30), blobs(12, seed=1)
    good = {"train_tokens": tr.tokens, "train_labels": tr.labels, "train_mask": tr.mask.long(),  # 0/1 like BERT's
            "test_tokens": te.tokens, "test_labels": te.labels, "test_mask": te.mask}
    path = tmp_path / "tokens.pt"
    torch.save(good, path)
    train, test = load_token_file(path)
    assert train.mask.dtype == torch.bool and torch.equal(train.mask, tr.mask) and train.cls is None
    assert torch.equal(test.tokens.nan_to_num(), te.tokens.nan_to_num()) and paradigm1.check_inputs(train, test) == 3
    with pytest.raises(FileNotFoundError, match="tokens file not found: .*missing.pt"):
        load_token_file(tmp_path / "missing.pt")
    broken = tmp_path / "broken.pt"
    broken.write_bytes(path.read_bytes()[:200])
    with pytest.raises(ValueError, match="broken.pt"):
        load_token_file(broken)
    unsafe = tmp_path / "unsafe.pt"
    torch.save({**good, "train_labels": argparse.Namespace(x=1)}, unsafe)
    with pytest.raises(UnsafeCheckpointError):
        load_token_file(unsafe)  # weights_only=True: refused, nothing ran
    no_test_labels = {k: v for k, v in good.items() if k != "test_labels"}
    for bad, message in [([tr.tokens], "must hold a dict of tensors"),
                         (no_test_labels, r"lacks the key\(s\) \['test_labels'\]"),
                         ({**good, "extra": tr.tokens}, r"unknown key\(s\) \['extra'\]"),
                         ({**good, "train_labels": [0, 1]}, "train_labels must be a tensor, got list")]:
        torch.save(bad, path)
        with pytest.raises(ValueError, match=message):
            load_token_file(path)


def test_main_on_a_token_file_writes_report_and_results(tmp_path, monkeypatch):
    tr, te = blobs(60), blobs(30, seed=1)
    path = tmp_path / "bert.pt"
    torch.save({"train_tokens": tr.tokens, "train_labels": tr.labels, "train_mask": tr.mask, "train_cls": tr.cls,
                "test_tokens": te.tokens, "test_labels": te.labels, "test_mask": te.mask, "test_cls": te.cls}, path)
    monkeypatch.setattr(paradigm1, "QUICK", {k: v for k, v in TINY.__dict__.items() if k != "epochs"})
    out = tmp_path / "report"
    results = paradigm1.main(["--tokens", str(path), "--quick", "--out", str(out), "--seeds", "0"])
    saved = json.loads((out / "results.json").read_text())
    assert saved["encoders"]["tokens"]["classes"] == 3 and set(results["encoders"]) == {"tokens"}
    text = (out / "report.md").read_text()
    assert f"python -m eval.paradigm1 --tokens {path}" in text and "The paper's claims, here" in text
    assert text.count("| pooled |") == 2 and "logistic regression on all 30 token features" in text
    with pytest.raises(SystemExit):
        paradigm1.parse_args(["--epochs", "0"])


def test_vit_tokens_train_once_cache_and_never_see_the_readout_images(tiny_cifar, tmp_path, monkeypatch):
    cfg = ViTConfig(dim=16, depth=1, heads=2, patch=8, epochs=1, batch_size=32)
    args = argparse.Namespace(data_root=tiny_cifar["folder"], num_workers=0, train_subset=100, vit_train=64,
                              test_subset=20, vit_seed=0, cache_dir=tmp_path / "cache", progress=False)
    train, test, facts = encoders.vit_tokens(args, cfg)
    assert train.tokens.shape == (100, 16, 16) and train.cls.shape == (100, 16) and test.tokens.shape == (20, 16, 16)
    assert facts["train_images"] == 64 and 0 <= facts["test_acc"] <= 1 and math.isfinite(facts["train_seconds"])
    assert paradigm1.check_inputs(train, test) == 10
    # The readout's images are the first 100 of the permutation, the ViT's the last 64 of 300: disjoint.
    _, readout_set, vit_set, _ = encoders._images(args)
    assert not set(readout_set.dataset.indices[i] for i in readout_set.indices) & set(
        vit_set.dataset.indices[i] for i in vit_set.indices)
    monkeypatch.setattr(encoders, "train_vit", None)  # a second call must come from the cache
    again, _, _ = encoders.vit_tokens(args, cfg)
    assert torch.equal(again.tokens, train.tokens)
    args.vit_train = 250
    with pytest.raises(ValueError, match="--train-subset 100 \\+ --vit-train 250 exceed the 300 training images"):
        encoders.vit_tokens(args, cfg)
    with pytest.raises(ValueError, match="the vqvae encoder needs --checkpoint"):
        encoders.vqvae_tokens(argparse.Namespace(checkpoint=None))
