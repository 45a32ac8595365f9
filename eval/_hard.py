"""HardVQ "EMA 0.99 + restart 1", the strongest hard VQ here and every study's baseline, in one place.

Restart below one token per batch, the usage decayed at the EMA's 0.99 and uncapped (VQ-VAE EMA's convention, which
HardVQ's restart followed before ``restart`` took a :class:`softvq.Restart`): ``softvq.HardVQ(K, D, ema_decay=0.99,
restart=HARD_RESTART)``, or the trainer's ``--hard.ema_decay 0.99`` with :data:`HARD_RESTART_FLAGS`.
"""

from __future__ import annotations

import softvq

HARD_RESTART = softvq.Restart(1.0, decay=0.99, cap=None)
HARD_RESTART_FLAGS = ("--hard.restart.threshold", "1", "--hard.restart.decay", "0.99", "--hard.restart.cap", "null")
