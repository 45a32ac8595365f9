"""Dead-code restarts: the codebook rows whose usage fell below a threshold take random tokens of the batch of every
process together."""

from __future__ import annotations

import torch
from torch import Tensor

from softvq._collectives import random_tokens


@torch.no_grad()
def restart_dead_codes_(codebook: Tensor, usage: Tensor, z: Tensor, threshold: float | Tensor) -> Tensor:
    """Replace the rows of ``codebook (K, D)`` whose running ``usage (K,)`` is below ``threshold`` by random tokens of
    ``z (N, D)`` and set their usage to ``threshold``; returns the ``(K,)`` mask of restarted rows. Nothing is
    restarted while ``usage`` still holds the -1 of "no batch seen yet", or when there are no tokens.

    Without a host-device synchronisation (no ``.item()``, no data-dependent shape): every code draws a candidate
    token (:func:`random_tokens`) and the dead ones take theirs, so a GPU step never waits on the CPU and
    ``torch.compile`` traces it whole. Under ``torch.distributed`` the tokens are drawn from every process's batch
    together, so the result is the same on every process and equals a single process's restart on the concatenated
    batch with rank 0's random state.
    """
    rows, any_token = random_tokens(z, codebook.shape[0])
    dead = (usage < threshold) & (usage >= 0).all()  # usage is summed across processes: every process agrees
    if any_token is False:
        return torch.zeros_like(dead)
    if any_token is not True:
        dead &= any_token
    codebook.copy_(torch.where(dead[:, None], rows.to(codebook.dtype), codebook))
    usage.copy_(torch.where(dead, threshold, usage))
    return dead
