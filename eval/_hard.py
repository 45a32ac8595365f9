"""HardVQ "EMA 0.99 + restart 1", the strongest hard VQ here and every study's baseline, in one place.

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
