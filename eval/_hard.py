"""HardVQ "EMA 0.99 + restart 1", the strongest hard VQ here and every study's baseline, and vector-quantize-pytorch's
recommended VectorQuantize (:data:`VQP_RECIPE`), in one place.

Restart below one token per batch, the usage decayed at the EMA's 0.99 and uncapped (VQ-VAE EMA's convention, which
HardVQ's restart followed before ``restart`` took a :class:`softvq.Restart`): ``softvq.HardVQ(K, D, ema_decay=0.99,
restart=HARD_RESTART)``, or the trainer's ``--hard.ema_decay 0.99`` with :data:`HARD_RESTART_FLAGS`.
"""

from __future__ import annotations

import dataclasses

import softvq

HARD_RESTART = softvq.Restart(1.0, decay=0.99, cap=None)
HARD_RESTART_FLAGS = ("--hard.restart.threshold", "1", "--hard.restart.decay", "0.99", "--hard.restart.cap", "null")

# The same with the threshold capped as softvq.Restart's defaults cap it (a quarter of the mean tokens per code per
# batch): the cap binds from K = N / 4, and from K = N on the mean code wins under one token a batch, where the
# uncapped threshold restarts most codes every step (eval.peers' hard_ema_cap; docs/studies.md, "Long training").
HARD_RESTART_CAPPED = dataclasses.replace(HARD_RESTART, cap=softvq.Restart().cap)

# vector-quantize-pytorch's VectorQuantize as its README recommends against dead codes: k-means initialisation, the
# rotation trick, and codes whose EMA cluster size falls below a tenth of the mean replaced by batch samples. Since
# 1.34 the threshold is that ratio of the mean; before, the README's recipe was an absolute
# ``threshold_ema_dead_code=2`` (tokens per code), which 1.34 converts to a ratio of 2 / K and refuses for K <= 2. The
# peers' reports measured before 7 December 2026 ran that former recipe on vector-quantize-pytorch <= 1.32
# (docs/studies.md).
VQP_RECIPE = {"kmeans_init": True, "dead_code_threshold_ratio": 0.1, "rotation_trick": True}
