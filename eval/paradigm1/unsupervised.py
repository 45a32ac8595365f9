"""The unsupervised half of ``eval/paradigm1/``: DDCL readout prototypes as clusters against k-means, on the pooled
features and on the tokens, scored by ACC (Hungarian, or the majority map for more clusters than classes), NMI and
ARI on the test split. See that module's docstring for the study."""

from __future__ import annotations

import time
from typing import Any

import numpy as np
import torch
from torch import Tensor

from eval.clustering import cluster_owners, clustering_accuracy
from eval.paradigm1.config import Paradigm1Config
from eval.paradigm1.encoders import TokenSet
from eval.paradigm1.heads import masked_mean
from softvq import DDCLReadout
from softvq.parts import Gradient


def pair_distance(x: Tensor) -> float:
    """Mean squared distance between two random rows of ``x (N, D)``: ``2 x`` the total variance."""
    return float(2 * x.double().var(0, unbiased=False).sum())


# ---- unsupervised -------------------------------------------------------------------------------------------------
def fit_ddcl_clusters(x: Tensor, k: int, seed: int, cfg: Paradigm1Config) -> tuple[DDCLReadout, float]:
    """``k`` DDCL readout prototypes trained on features ``x (M, D)`` by their DDCL objective alone (no labels):
    ``cfg.cluster_term`` (``free_energy``: attraction only, soft k-means; ``l_q``: the competitive loss), Adam on
    mini-batches, ``T`` annealed geometrically from ``cluster_t_start`` to ``cluster_t_end`` times the mean squared
    distance, prototypes seeded by ``cluster_init``. Returns the readout (eval mode) and
    the largest identity residual ``|L_q - L_OLS - V| / L_q`` seen."""
    torch.manual_seed(seed)
    g = torch.Generator().manual_seed(seed)
    scale = pair_distance(x)
    readout = DDCLReadout(k, x.shape[1], temperature=cfg.cluster_t_start * scale,
                          prototype_update=Gradient(cfg.cluster_term),
                          init="normal" if cfg.cluster_init == "kmeans++" else "data")
    if cfg.cluster_init == "kmeans++":
        from sklearn.cluster import kmeans_plusplus

        seeds, _ = kmeans_plusplus(x.numpy(), k, random_state=seed)
        with torch.no_grad():
            readout.prototypes.copy_(torch.from_numpy(seeds))
    optimizer = torch.optim.Adam(readout.parameters(), lr=cfg.cluster_lr)
    worst, steps = 0.0, cfg.cluster_steps
    for step in range(steps):
        frac = step / max(steps - 1, 1)
        readout.quantizer.temperature = scale * cfg.cluster_t_start * (cfg.cluster_t_end / cfg.cluster_t_start) ** frac
        for group in optimizer.param_groups:
            group["lr"] = cfg.cluster_lr * 0.1**frac
        batch = x[torch.randint(x.shape[0], (max(cfg.cluster_batch, k),), generator=g)]
        out = readout.quantizer(batch)  # the readout's loss on one-token sequences, without building slots
        optimizer.zero_grad(set_to_none=True)
        out.loss.backward()
        optimizer.step()
        worst = max(worst, float(out.terms["identity_residual"]))
    return readout.eval(), worst


@torch.no_grad()
def ddcl_clusters(readout: DDCLReadout, tokens: Tensor, mask: Tensor, batch: int = 512) -> np.ndarray:
    """Per example the prototype with the largest assignment mass ``sum_t q_tk`` over its real tokens."""
    return torch.cat([readout(tokens[i:i + batch], mask[i:i + batch]).mass.argmax(1)
                      for i in range(0, tokens.shape[0], batch)]).numpy()


def vote(token_labels: np.ndarray, mask: Tensor, k: int) -> np.ndarray:
    """Per example the cluster most of its real tokens fall in (ties: the lowest index); ``token_labels`` are the
    clusters of ``tokens[mask]`` in row-major order."""
    rows = torch.arange(mask.shape[0])[:, None].expand_as(mask)[mask]
    counts = torch.zeros(mask.shape[0], k, dtype=torch.long)
    counts.index_put_((rows, torch.as_tensor(token_labels, dtype=torch.long)), torch.ones_like(rows), accumulate=True)
    return counts.argmax(1).numpy()


def scores(y_test: Tensor, pred_test: np.ndarray, y_train: Tensor, pred_train: np.ndarray, k: int,
           classes: int) -> dict[str, float]:
    """ACC (Hungarian for ``k == classes``, else the training split's majority map), NMI, ARI on the test split."""
    from sklearn.metrics import adjusted_rand_score, normalized_mutual_info_score

    if k == classes:
        acc = clustering_accuracy(y_test, pred_test)
    else:
        owners = cluster_owners(y_train, pred_train, k)
        acc = float((owners[torch.as_tensor(pred_test)] == y_test).float().mean())
    return {"acc": acc, "nmi": float(normalized_mutual_info_score(y_test.numpy(), pred_test)),
            "ari": float(adjusted_rand_score(y_test.numpy(), pred_test)),
            "clusters_used": int(np.unique(pred_test).size)}


def clustering(train: TokenSet, test: TokenSet, classes: int, seed: int, cfg: Paradigm1Config) -> dict[str, Any]:
    """DDCL vs k-means at ``K = C`` and ``K = cluster_mult x C`` on the pooled features and on the tokens."""
    from sklearn.cluster import KMeans

    pooled_train, pooled_test = masked_mean(train.tokens, train.mask), masked_mean(test.tokens, test.mask)
    c, s = pooled_train.mean(0), float((pooled_train - pooled_train.mean(0)).square().mean().sqrt())
    pooled_train, pooled_test = (pooled_train - c) / s, (pooled_test - c) / s
    real = train.tokens[train.mask]
    pick = torch.randperm(real.shape[0], generator=torch.Generator().manual_seed(10_000 + seed))
    token_fit = real[pick[: cfg.cluster_tokens]]  # the same training tokens for both methods
    out: dict[str, Any] = {}
    for k in (classes, cfg.cluster_mult * classes):
        for space in ("pooled", "tokens"):
            x_fit = pooled_train if space == "pooled" else token_fit
            begin = time.perf_counter()
            km = KMeans(n_clusters=k, n_init="auto", random_state=seed).fit(x_fit.numpy())
            if space == "pooled":
                km_train, km_test = km.predict(pooled_train.numpy()), km.predict(pooled_test.numpy())
            else:
                km_train = vote(km.predict(train.tokens[train.mask].numpy()), train.mask, k)
                km_test = vote(km.predict(test.tokens[test.mask].numpy()), test.mask, k)
            km_seconds = time.perf_counter() - begin
            begin = time.perf_counter()
            readout, residual = fit_ddcl_clusters(x_fit, k, seed, cfg)
            if space == "pooled":
                one = torch.ones(pooled_train.shape[0], 1, dtype=torch.bool)
                dd_train = ddcl_clusters(readout, pooled_train[:, None], one)
                dd_test = ddcl_clusters(readout, pooled_test[:, None], one[: pooled_test.shape[0]])
            else:
                dd_train = ddcl_clusters(readout, train.tokens, train.mask)
                dd_test = ddcl_clusters(readout, test.tokens, test.mask)
            dd_seconds = time.perf_counter() - begin
            out[f"kmeans_{space}_k{k}"] = {**scores(test.labels, km_test, train.labels, km_train, k, classes),
                                          "seconds": km_seconds}
            out[f"ddcl_{space}_k{k}"] = {**scores(test.labels, dd_test, train.labels, dd_train, k, classes),
                                        "seconds": dd_seconds, "max_identity_residual": residual}
    return out
