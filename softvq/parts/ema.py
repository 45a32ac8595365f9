"""EMA prototypes: the codebook moved by a k-means step averaged over batches, independent of the optimizer.

:class:`EmaPrototypes` keeps, per code, an exponential moving average of the mass of tokens it wins and of their
sum, and sets each code to their ratio after every training batch. It is the codebook update of
:class:`softvq.DDCLQuantizer` (``prototype_update="ema"`` or ``"soft_ema"``) and of :class:`softvq.HardVQ`
(``ema_decay``). No host-device synchronisation; statistics summed over processes under ``torch.distributed``.
"""

from __future__ import annotations

import torch
from torch import Tensor

from softvq._checks import check_float, check_unit
from softvq._collectives import all_reduce_sum_
from softvq._precision import FullPrecisionState


class EmaPrototypes(FullPrecisionState):
    """EMA statistics of a codebook: ``mass`` ``(K,)``, the tokens each code won, and ``weighted_sum`` ``(K, D)``, their
    sum, both averaged over training batches with ``decay``; each code is their ratio.

    Each code starts as one pseudo-token at its initial value (``mass`` 1, ``weighted_sum`` the code), so a code that
    has not won yet keeps its value. :meth:`step_` takes a batch's hard winners (``indices``: the k-means step of
    VQ-VAE's EMA codebook) or its soft assignments (``q``: the M-step of the free energy, tokens weighted by their
    assignments). A code that wins nothing in a batch stays where it is: its statistics decay alike, and it is not
    moved (invariant: a code moves only on a batch it wins tokens).

    Args:
        codebook: ``(K, D)``, the initial codes (copied).
        decay: the EMA's decay in ``(0, 1)``.
        epsilon: ``None``: each code is ``weighted_sum / mass``, averaged by linear interpolation (what
            :class:`softvq.DDCLQuantizer` does). A number: VQ-VAE's Laplace smoothing of the masses,
            ``(mass + eps) / (n + K eps) * n`` with ``n`` the total mass, averaged as ``x * decay + new * (1 - decay)``
            (what :class:`softvq.HardVQ` does, as sonnet's ``VectorQuantizerEMA``).

    State: float32 (float64 under ``.double()``) whatever ``.half()`` does: an EMA step is below bf16 resolution.
    """

    def __init__(self, codebook: Tensor, decay: float = 0.99, epsilon: float | None = None) -> None:
        super().__init__()
        self.decay = check_unit("ema_decay", decay)
        self.epsilon = None if epsilon is None else check_float("epsilon", epsilon)
        self.register_buffer("mass", torch.ones(codebook.shape[0]))
        self.register_buffer("weighted_sum", codebook.detach().clone())

    @torch.no_grad()
    def reset_(self, codebook: Tensor) -> None:
        """Start again from ``codebook (K, D)``: one pseudo-token per code (a data initialisation)."""
        self.weighted_sum.copy_(codebook)
        self.mass.fill_(1.0)

    @torch.no_grad()
    def step_(self, codebook: Tensor, z: Tensor, *, indices: Tensor | None = None, counts: Tensor | None = None,
              q: Tensor | None = None) -> None:
        """One training batch of tokens ``z (N, D)``: fold their hard winners (``indices (N,)`` with their
        ``counts (K,)`` summed over processes, :func:`softvq.parts.restart.code_counts`) or their soft assignments
        (``q (N, K)``) into the statistics and move ``codebook (K, D)`` in place to the codes they give."""
        if q is None:
            mass = counts.to(self.mass.dtype)
            total = torch.zeros_like(self.weighted_sum).index_add_(0, indices, z.to(self.weighted_sum.dtype))
        else:
            mass = all_reduce_sum_(q.sum(0).to(self.mass.dtype))
            total = (q.t() @ z).to(self.weighted_sum.dtype)
        all_reduce_sum_(total)
        if self.epsilon is None:
            self.mass.lerp_(mass, 1.0 - self.decay)
            self.weighted_sum.lerp_(total, 1.0 - self.decay)
            # Once a mass leaves the normal floats (~8,700 batches unwon at decay 0.99) a ratio of subnormals is noise:
            # that code stays put too. A floor on the mass instead would drag a never-winning code to the origin.
            tiny = torch.finfo(self.mass.dtype).tiny
            moved = (mass > 0) & (self.mass > tiny)
            new = self.weighted_sum / self.mass.clamp_min(tiny)[:, None]
        else:
            self.mass.mul_(self.decay).add_(mass, alpha=1.0 - self.decay)
            self.weighted_sum.mul_(self.decay).add_(total, alpha=1.0 - self.decay)
            n = self.mass.sum()
            smoothed = (self.mass + self.epsilon) / (n + self.mass.shape[0] * self.epsilon) * n
            # the smoothed mass of a code that won nothing stays near epsilon while its sum decays toward 0, so the
            # ratio would take a code that never wins to the origin: it is not moved
            moved = mass > 0
            new = self.weighted_sum / smoothed[:, None]
        codebook.copy_(torch.where(moved[:, None], new.to(codebook.dtype), codebook))

    @torch.no_grad()
    def restart_(self, dead: Tensor, codebook: Tensor, mass: float) -> None:
        """The codes ``dead (K,)`` were moved to new values (``codebook``): their statistics restart there, as
        ``mass`` pseudo-tokens."""
        self.weighted_sum.copy_(torch.where(dead[:, None], codebook * mass, self.weighted_sum))
        self.mass.copy_(torch.where(dead, mass, self.mass))

    def extra_repr(self) -> str:
        return f"num_codes={self.mass.shape[0]}, decay={self.decay:g}, epsilon={self.epsilon}"
