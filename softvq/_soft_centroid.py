"""The DDCL layer's arithmetic: the soft centroid, its loss terms and their hand-written gradient (DESIGN §1).

:class:`_SoftCentroid` is one :class:`torch.autograd.Function` so that distances take one ``(N, D) x (D, K)``
matmul, no ``(N, K, D)`` tensor is ever built, and the training objective can send *different* terms to the encoder
and to the prototypes without recomputing the layer. :class:`softvq.DDCLQuantizer` is its only caller; it runs it
with autocast off, in float32 (float64 for float64 input).
"""

from __future__ import annotations

from typing import Any, NamedTuple

import torch
from torch import Tensor

from softvq.utils import squared_distances


def _mean(x: Tensor) -> Tensor:
    """The mean of per-token values, accumulated in float64: a float32 sum of N values near the largest
    representable square distance would overflow where their mean does not."""
    return x.mean(dtype=torch.float64).to(x.dtype)


def _rows_dot(a: Tensor, b: Tensor) -> Tensor:
    """``(a * b).sum(-1)`` for ``(N, M)`` matrices, without materialising the product."""
    return torch.linalg.vecdot(a, b)


class _Saved(NamedTuple):
    """What the forward pass keeps for the backward pass (centred on the prototypes' mean)."""

    zc: Tensor  # (N, D) tokens minus the centre
    pc: Tensor  # (K, D) prototypes minus the centre
    q: Tensor  # (N, K) assignments
    r: Tensor  # (N, D) residual z - mu
    mu_c: Tensor  # (N, D) soft centroid minus the centre
    logits: Tensor | None  # (N, K) -d / T, kept only when an L_q term needs it
    lq_n: Tensor | None  # (N,) per-token L_q, likewise


class _SoftCentroid(torch.autograd.Function):
    """Soft centroid of ``z (N, D)`` over ``prototypes (K, D)`` with the routed DDCL objective.

    Returns ``mu (N, D)``, ``q (N, K)``, ``indices (N,)``, ``loss ()``, ``stats (4,) = [l_q, l_ols, v, H(q)]``.
    ``loss = (cb_w * L_cb(sg z, P) + cm_w * L_cm(z, sg P)) / D``: the codebook term only reaches the prototypes,
    the commitment term only reaches ``z``; ``mu`` and ``q`` are differentiable w.r.t. both.

    The backward pass is written out so that it touches each ``(N, K)`` array as few times as possible (it is
    memory-bound on CPU): per side one matmul for ``dL/dq`` and three element-wise passes.
    """

    @staticmethod
    def forward(  # type: ignore[override]
        ctx: Any,
        z: Tensor,
        prototypes: Tensor,
        temperature: float,
        cb_term: str,
        cb_weight: float,
        cm_term: str,
        cm_weight: float,
    ) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor]:
        n, dim = z.shape
        # Distances, q and V are translation invariant: centre both sides on the prototypes' mean so that the
        # expansion |z|^2 - 2 z.p + |p|^2 cancels little when tokens and prototypes sit far from the origin.
        center = prototypes.mean(0)
        zc = z - center  # (N, D)
        pc = prototypes - center  # (K, D)
        p_sq = pc.square().sum(1)  # (K,)
        d = squared_distances(zc, pc)  # (N, K), one matmul
        indices = d.argmin(dim=1)
        logits = d.mul_(-1.0 / temperature)  # in place: d is not kept, d = -T * logits
        lse = torch.logsumexp(logits, dim=1)  # (N,)
        q = (logits - lse[:, None]).exp_()  # (N, K) softmax, log-sum-exp stable; lse also gives H(q) and F
        mu_c = q @ pc  # (N, D)
        mu = mu_c + center

        q_logits = _rows_dot(q, logits)  # (N,) <q, -d / T>
        lq_n = q_logits * -temperature  # (N,) per-token L_q = sum_k q d
        r = zc - mu_c  # (N, D) residual z - mu
        l_ols = _mean(r.square().sum(1))
        v = _mean(q @ p_sq - mu_c.square().sum(1))
        l_q = _mean(lq_n)
        entropy = _mean(lse - q_logits)  # H(q) = -sum_k q log q, log q = logits - lse
        stats = torch.stack([l_q, l_ols, v, entropy])

        def term(name: str) -> Tensor:
            if name == "free_energy":  # F = -T log sum_k exp(-d_k / T) = L_q - T H(q)
                return _mean(lse) * -temperature
            return l_q if name == "l_q" else l_ols

        loss = zc.new_zeros(())
        for name, weight in ((cb_term, cb_weight), (cm_term, cm_weight)):
            if weight > 0:  # a dropped term is not computed (0 * inf would be NaN)
                loss = loss + weight * term(name)
        loss = loss / dim

        ctx.temperature = temperature
        ctx.routing = (cb_term, cb_weight, cm_term, cm_weight)
        need_d = (cb_term == "l_q" and cb_weight > 0) or (cm_term == "l_q" and cm_weight > 0)
        ctx.save_for_backward(zc, pc, q, r, mu_c, logits if need_d else None, lq_n if need_d else None)
        ctx.mark_non_differentiable(indices, stats)
        ctx.set_materialize_grads(False)
        return mu, q, indices, loss, stats

    @staticmethod
    def backward(  # type: ignore[override]
        ctx: Any,
        g_mu: Tensor | None,
        g_q: Tensor | None,
        _g_idx: Tensor | None,
        g_loss: Tensor | None,
        _g_stats: Tensor | None,
    ) -> tuple[Tensor | None, ...]:
        s = _Saved(*ctx.saved_tensors)
        temperature = ctx.temperature
        cb_term, cb_weight, cm_term, cm_weight = ctx.routing
        n, dim = s.zc.shape
        with torch.autocast(device_type=s.zc.device.type, enabled=False):
            # Per-token weights of the two loss terms: d loss / d (per-token term).
            scale = (g_loss / (n * dim)) if g_loss is not None else None
            a_cb = scale * cb_weight if scale is not None and cb_weight > 0 else None
            a_cm = scale * cm_weight if scale is not None and cm_weight > 0 else None
            # L_OLS = mean ||z - mu||^2 enters through mu (dL/dmu = -2 r) and, on z's side, directly (+2 r).
            g_mu_p = _through_mu(g_mu, s.r, a_cb if cb_term == "l_ols" else None)
            g_mu_z = _through_mu(g_mu, s.r, a_cm if cm_term == "l_ols" else None)
            lq_cb = a_cb if cb_term == "l_q" else None
            lq_cm = a_cm if cm_term == "l_q" else None
            fe_cb = a_cb if cb_term == "free_energy" else None
            fe_cm = a_cm if cm_term == "free_energy" else None

            grad_z = grad_p = w_p = None
            if ctx.needs_input_grad[1]:
                w_p = _scaled_grad_d(s, temperature, g_mu_p, g_q, lq_cb, fe_cb)
                grad_p = _grad_prototypes(s, temperature, g_mu_p, w_p)
            if ctx.needs_input_grad[0]:
                reuse = (w_p is not None and g_mu_z is g_mu_p and lq_cb is None and lq_cm is None
                         and fe_cb is None and fe_cm is None)
                w_z = w_p if reuse else _scaled_grad_d(s, temperature, g_mu_z, g_q, lq_cm, fe_cm)
                grad_z = _grad_tokens(s, temperature, w_z, lq_cm, fe_cm, a_cm if cm_term == "l_ols" else None)
        return grad_z, grad_p, None, None, None, None, None


def _through_mu(g_mu: Tensor | None, r: Tensor, a_ols: Tensor | None) -> Tensor | None:
    """The gradient that reaches one side through ``mu``: the task's ``g_mu`` plus ``-2 a r`` from an L_OLS term
    of weight ``a`` on that side."""
    if a_ols is None:
        return g_mu
    return r * (-2.0 * a_ols) if g_mu is None else g_mu - 2.0 * a_ols * r


def _scaled_grad_d(s: _Saved, temperature: float, g_mu: Tensor | None, g_q: Tensor | None,
                   a_lq: Tensor | None, a_fe: Tensor | None) -> Tensor | None:
    """``W`` with ``dL/dd = -W / T``, from mu / q (through the softmax), ``a_lq * L_q`` and ``a_fe * F``.

    Through the softmax (logits = -d/T): dL/dd = -q (g_q - <q, g_q>) / T. From L_q:
    dL_q/dd = q (1 - (d - L_q,n) / T), attraction of near prototypes and repulsion of far ones.
    From the free energy F: dF/dd = q, attraction only (soft k-means).
    Together: -q (g_q + a d - <q, g_q> - a L_q,n - a T - a_fe T) / T.
    """
    q = s.q
    w = None
    row = None  # (N,) per-token constant subtracted inside the bracket
    if g_mu is not None:
        w = g_mu @ s.pc.t()  # (N, K) dL/dq; mu = q @ P and the centre cancels in the softmax
        row = _rows_dot(g_mu, s.mu_c)  # <q, g_mu P^T> = g_mu . mu, an (N, D) product
    if g_q is not None:
        w = g_q.clone() if w is None else w.add_(g_q)
        row = _rows_dot(q, g_q) if row is None else row.add_(_rows_dot(q, g_q))
    if a_lq is not None:
        # a * d = -a T * logits
        w = s.logits * (-temperature * a_lq) if w is None else w.add_(s.logits * (-temperature * a_lq))
        extra = a_lq * (s.lq_n + temperature)
        row = extra if row is None else row.add_(extra)
    if a_fe is not None:
        if w is None:
            w = torch.zeros_like(q)
        extra = (a_fe * temperature).expand(q.shape[0])
        row = extra if row is None else row.add_(extra)
    if w is None:
        return None
    return w.sub_(row[:, None]).mul_(q)


# d_nk = ||z_n - p_k||^2: dd/dp_k = 2 (p_k - z_n), dd/dz_n = 2 (z_n - p_k); with dL/dd = -W / T.
def _grad_prototypes(s: _Saved, temperature: float, g_mu: Tensor | None, w: Tensor | None) -> Tensor:
    """``dL/dP``: the direct path of ``mu = q P`` and, through the distances, ``W``."""
    grad_p = torch.zeros_like(s.pc) if g_mu is None else s.q.t() @ g_mu
    if w is not None:
        grad_p.add_(w.sum(0)[:, None] * s.pc - w.t() @ s.zc, alpha=-2.0 / temperature)
    return grad_p


def _grad_tokens(s: _Saved, temperature: float, w: Tensor | None, a_lq: Tensor | None, a_fe: Tensor | None,
                 a_ols: Tensor | None) -> Tensor:
    """``dL/dz``: through the distances (``W``; its row sums are known in closed form) and the direct terms of
    the commitment loss."""
    grad_z = torch.zeros_like(s.zc)
    if w is not None:
        grad_z.add_(w @ s.pc, alpha=2.0 / temperature)
    if a_lq is not None:
        grad_z.add_(2.0 * a_lq * s.zc)
    if a_fe is not None:
        grad_z.add_(2.0 * a_fe * s.zc)
    if a_ols is not None:
        grad_z.add_(2.0 * a_ols * s.r)
    return grad_z
