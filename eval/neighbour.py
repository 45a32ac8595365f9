"""A DDCL layer truncated to the neighbourhood of each token's code: the per-second candidates ``ddcl_n16``,
``ddcl_n32`` and ``ddcl_c16`` of eval.per_second (a prototype, not yet the library's).

The layer (docs/design.md's notation). :class:`softvq.DDCLQuantizer` with ``top_k`` truncation, except for the set a
token's distribution spans in a training step: instead of its ``r`` nearest prototypes (a selection over all ``K``
scores, 4-7x an argmax pass on a CPU: reports/per_second/selection.md), the ``r`` prototypes nearest to its nearest
prototype ``c_n``,

    q_n = softmax_j(-||z_n - p_j||^2 / T) over j in S(c_n),   S(c) = {c} and the r - 1 codes nearest to p_c,

which holds the argmax and, for a token near its code, some of the same codes as its own ``r`` nearest. With
``candidates`` ``R > r`` the lists hold ``c`` and its ``R - 1`` nearest codes, and the set is the token's ``r`` nearest
among them (``ddcl_c16``: 16 of 64), nearer its own ``r`` nearest. So the step is the exact layer's score matmul, one
argmax pass (HardVQ's search), a gather of ``R`` scores per token (and a selection of ``r`` among them) and the top-k
layer's ``O(N r D)`` soft centroid and backward pass. The encoder's gradient is the soft centroid's Jacobian
``(2/T) Cov_q(P)`` of this ``q`` (the set held fixed within the step, as ``top_k``'s is), and ``L_q = L_OLS + V``
holds exactly for it: the reported terms are those of the stated ``q``, over all tokens.

The lists ``S(c)`` (a ``(K, r)`` table) are computed for every code at the first training step and after a load, then
refreshed for ``K / 32`` codes per step and at most 512 (round robin: all of them every 32 steps up to K = 16384),
at ``K / 32 x K x D`` multiply-adds, a 64th of the search's at K = 4096 and N = 8192 tokens, a 16th from K = 16384
on (at K = 65,536 a list is refreshed every 128 steps). A list goes stale as the prototypes move, but always holds its
own code (its first entry), so the stated ``q`` always holds the token's nearest prototype. The temperature is
calibrated and evaluation runs on the parent's ``top_k = r`` truncation (each token's own ``r`` nearest).
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor

import softvq
from softvq._kernels import nearest_k_codes
from softvq._replay import ForwardRecord
from softvq.parts.temperature import auto_target_entropy


class RefreshCursor:
    """Which codes' neighbour lists a training step refreshes: every code the first time (and after :meth:`reset`, as
    when a state is loaded), then ``count`` codes a step, round robin (``eval/neighbour.py``, ``eval/amortised.py``)."""

    def __init__(self) -> None:
        self.fresh = False  # lists computed for the current codebook (all of them)
        self.cursor = 0  # the next code whose list is refreshed

    def reset(self) -> None:
        self.fresh = False

    def next(self, num_codes: int, count: int, device: torch.device) -> Tensor:
        """The codes to refresh now, ``(n,)``."""
        if not self.fresh:
            self.fresh, self.cursor = True, 0
            return torch.arange(num_codes, device=device)
        codes = (torch.arange(count, device=device) + self.cursor) % num_codes
        self.cursor = (self.cursor + count) % num_codes
        return codes


class NeighbourDDCL(softvq.DDCLQuantizer):
    """:class:`softvq.DDCLQuantizer` whose training distribution spans ``neighbours`` codes near each token's code:
    the code's nearest, or the token's nearest among the code's ``candidates`` nearest (module docstring); the entropy
    target defaults to ``log(r) - 0.5`` nats (at most ``log K / 2``). Other options: the parent's."""

    def __init__(self, num_codes: int, dim: int, neighbours: int = 16, candidates: int | None = None,
                 refresh_every: int = 32, max_refresh: int = 512, **options: Any) -> None:
        if refresh_every < 1:
            raise ValueError(f"refresh_every must be a positive number of steps, got {refresh_every}")
        if max_refresh < 1:
            raise ValueError(f"max_refresh must be a positive number of codes, got {max_refresh}")
        r = max(1, min(neighbours, num_codes))
        width = max(r, min(candidates or r, num_codes))  # R: the lists' width
        options.setdefault("target_entropy", auto_target_entropy(num_codes, r))  # the recipe's for top_k = r
        super().__init__(num_codes, dim, top_k=r, **options)
        self.neighbours, self.candidates, self.refresh_every, self.max_refresh = r, width, refresh_every, max_refresh
        self.register_buffer("neighbour_index", torch.zeros(num_codes, width, dtype=torch.long), persistent=False)
        self._lists = RefreshCursor()

    def _load_from_state_dict(self, *args: Any, **kwargs: Any) -> None:
        super()._load_from_state_dict(*args, **kwargs)
        self._lists.reset()

    @torch.no_grad()
    def refresh(self, p: Tensor) -> None:
        """The lists of ``K / refresh_every`` codes, at most ``max_refresh`` (all of them the first time), round
        robin: each code first, then its ``R - 1`` nearest other codes of ``p (K, D)``."""
        k = p.shape[0]
        codes = self._lists.next(k, max(1, min(k // self.refresh_every, self.max_refresh)), p.device)
        distances, index = nearest_k_codes(p[codes], p, self.candidates)
        # the code itself first (a duplicate prototype may tie with it at distance 0 and take its place in the k
        # nearest: it is then put back, in place of the farthest)
        is_self = index == codes[:, None]
        order = distances.masked_fill(is_self, -1.0).argsort(1)
        index = index.gather(1, order)
        shifted = torch.cat([codes[:, None], index[:, :-1]], 1)
        self.neighbour_index[codes] = torch.where(is_self.any(1, keepdim=True), index, shifted)

    def _neighbour_table(self, p: Tensor, update: bool, replay: ForwardRecord | None) -> Tensor | None:
        if not self.training or torch.compiler.is_compiling():
            return None  # evaluation (and a compiled graph): the parent's top_k = r
        if update and replay is None:
            self.refresh(p.detach())
        return self.neighbour_index if self._lists.fresh else None


def neighbour_layer(num_codes: int, dim: int, r: int, candidates: int | None = None,
                    extra: dict[str, Any] | None = None) -> NeighbourDDCL:
    """``ddcl_n16`` / ``ddcl_n32`` / ``ddcl_c16``: :class:`NeighbourDDCL` with ``r`` neighbours (at most ``K / 4``)
    among ``candidates`` (at most ``K / 2``), and the entropy target of the truncated layers, ``log(r) - 0.5`` nats (at
    most ``log K / 2``)."""
    r = min(r, max(1, num_codes // 4))
    width = min(candidates, max(1, num_codes // 2)) if candidates else None
    return NeighbourDDCL(num_codes, dim, neighbours=r, candidates=width, **(extra or {}))
