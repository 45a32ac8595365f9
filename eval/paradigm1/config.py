"""The settings of the paradigm-1 study (:func:`eval.paradigm1.run_paradigm1`), in a leaf module that the study's
parts import without importing the study."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Paradigm1Config:
    """Settings of :func:`run_paradigm1`. Temperatures are ratios of the mean squared distance between two random
    (standardised) features, ``2 x`` their total variance, so they mean the same at any ``D``."""

    seeds: tuple[int, ...] = (0, 1, 2)  # readout / clustering seeds (the encoders are fixed)
    cluster_mult: int = 4  # the larger K is cluster_mult x C (majority map)
    cluster_tokens: int = 131_072  # training tokens both clusterings fit on (a fixed random subset)
    cluster_steps: int = 400  # Adam steps of the unsupervised DDCL prototypes
    cluster_batch: int = 2048  # features per step
    cluster_lr: float = 0.05  # Adam lr of the prototypes (decays geometrically to a tenth)
    cluster_t_start: float = 0.2  # T at the first step / mean squared distance (geometric annealing; 0.05 left
    # prototypes stuck two to a cluster on synthetic blobs, 0.2 recovered every cluster, 1.0 needed more steps)
    cluster_t_end: float = 0.002  # T at the last step / mean squared distance: nearly hard assignments
    cluster_init: str = "kmeans++"  # DDCL seeds: scikit-learn's k-means++ seeding (k-means' own, same random_state)
    # or "data" (the layer's init: random features; two prototypes often start in one cluster and stay there)
    cluster_term: str = "free_energy"  # the DDCL objective of the prototypes (free_energy: soft k-means; or l_q)
    codes: int = 32  # K of the supervised readout (level 1)
    codes_level2: int = 8  # K of the second level
    temperature: float = 0.03  # T of the supervised readouts / mean squared distance (T = 4 at D = 64)
    epochs: int = 10  # epochs of every Adam-trained head
    batch_size: int = 128  # examples per step
    lr: float = 1e-3  # Adam lr of the heads; readout prototypes at lr / eps
    eps: float = 0.1  # timescale ratio
    logreg_c: tuple[float, ...] = (0.001, 0.01)  # inverse regularisation strengths tried for the bound (0.01 beat
    # 0.1 on held-out VQ-VAE training tokens, 0.430 vs 0.415; each lbfgs fit takes minutes on 10,000 x 8,192 features)
    logreg_iter: int = 200  # lbfgs iterations (100 stopped short of convergence on the VQ-VAE tokens)
