"""The hand-written backward pass of :class:`softvq._soft_centroid._SoftCentroid` (the DDCL layer's soft centroid and
loss terms; docs/design.md, "The layer: L_q = L_OLS + V"): what the forward pass keeps for it (:class:`_Saved`) and
the gradients it assembles chunk by chunk, so that it touches each ``(N, K)`` array as few times as possible.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import torch.nn.functional as F
from torch import Tensor


def _rows_dot(a: Tensor, b: Tensor) -> Tensor:
    """``(a * b).sum(-1)`` for ``(N, D)`` matrices."""
    return torch.linalg.vecdot(a, b)


class _Saved(NamedTuple):
    """What the forward pass keeps for the backward pass (centred on the prototypes' mean)."""

    zc: Tensor  # (N, D) tokens minus the centre
    pc: Tensor  # (K, D) prototypes minus the centre
    q: Tensor  # (N, K) assignments
    r: Tensor  # (N, D) residual z - mu
    mu_c: Tensor  # (N, D) soft centroid minus the centre
    t: Tensor  # () the temperature
    x: Tensor | None  # (N, K) the shifted, floored scores, kept only when an L_q term needs d = d0 - T x
    lq_n: Tensor | None  # (N,) per-token L_q, likewise
    d0: Tensor | None  # (N,) |z|^2 - T s_max (the distance to the nearest prototype), likewise
    sel: Tensor | None  # (N, k) top-k: the prototypes each row's q and x refer to (None: q and x are (N, K))


def _gathered(c: _Saved) -> Tensor:
    """``(n, k, D)``: the prototypes a top-k chunk's ``q`` refers to (``pc[sel]``), built once per chunk for both
    sides' gradients (a chunk holds few enough rows that this stays small: ``softvq._soft_centroid._TOP_K_ENTRIES``)."""
    return F.embedding(c.sel, c.pc)


def _grad_prototypes_top_k(s: _Saved, g_mu: Tensor | None, w_row: tuple[Tensor, Tensor] | None) -> Tensor:
    """:func:`_grad_prototypes` of a top-k chunk, ``(K, D)``: each token's ``k`` rows ``q_j g_mu + (2 / T) W_j z``
    added to its chosen prototypes' rows (``index_add_``), and ``-(2 / T) (sum_n W_nj) p_j``."""
    grad_p = torch.zeros_like(s.pc)
    n, k = s.q.shape
    rows = s.q[:, :, None] * g_mu[:, None, :] if g_mu is not None else None  # (n, k, D)
    weight = None
    if w_row is not None:
        w = torch.addcmul(w_row[0], s.q, w_row[1][:, None], value=-1.0)  # (n, k) W = W' - q row
        zw = (w * (2.0 / s.t))[:, :, None] * s.zc[:, None, :]
        rows = zw if rows is None else rows.add_(zw)
        weight = torch.zeros(s.pc.shape[0], dtype=w.dtype, device=w.device).index_add_(0, s.sel.reshape(-1),
                                                                                       w.reshape(-1))
    if rows is not None:
        grad_p.index_add_(0, s.sel.reshape(-1), rows.reshape(n * k, -1))
    if weight is not None:
        grad_p.addcmul_(weight[:, None], s.pc, value=-2.0 / s.t)
    return grad_p


def _grad_tokens_top_k(s: _Saved, p_sel: Tensor, w_row: tuple[Tensor, Tensor] | None, a_lq: Tensor | None,
                       a_fe: Tensor | None, a_ols: Tensor | None) -> Tensor:
    """:func:`_grad_tokens` of a top-k chunk: ``W' P`` as ``sum_j W'_j p_sel_j``."""
    if w_row is not None:
        w, row = w_row
        wp = torch.bmm(w[:, None, :], p_sel).squeeze(1)  # (n, D)
        grad_z = torch.addcmul(wp, row[:, None], s.mu_c, value=-1.0).mul_(2.0 / s.t)
    else:
        grad_z = torch.zeros_like(s.zc)
    return _direct_token_terms(grad_z, s, a_lq, a_fe, a_ols)


def _through_mu(g_mu: Tensor | None, r: Tensor, a_ols: Tensor | None) -> Tensor | None:
    """The gradient that reaches one side through ``mu``: the task's ``g_mu`` plus ``-2 a r`` from an L_OLS term
    of weight ``a`` on that side."""
    if a_ols is None:
        return g_mu
    return r * (-2.0 * a_ols) if g_mu is None else g_mu - 2.0 * a_ols * r


def _scaled_grad_d(s: _Saved, g_mu: Tensor | None, g_q: Tensor | None, a_lq: Tensor | None,
                   a_fe: Tensor | None, p_sel: Tensor | None = None) -> tuple[Tensor, Tensor] | None:
    """``(W', row)`` with ``dL/dd = -W / T`` and ``W = W' - q row``, from mu / q (through the softmax), ``a_lq * L_q``
    and ``a_fe * F``; ``None`` when nothing reaches the distances.

    Through the softmax (logits = -d/T): dL/dd = -q (g_q - <q, g_q>) / T. From L_q:
    dL_q/dd = q (1 - (d - L_q,n) / T), attraction of near prototypes and repulsion of far ones.
    From the free energy F: dF/dd = q, attraction only (soft k-means).
    Together: W = q (g_q + a d - <q, g_q> - a L_q,n - a T - a_fe T), with ``g_q`` here including ``g_mu P^T``.
    The per-token ``row`` is returned apart: its share of ``W @ P`` is ``row * mu`` (an ``(N, D)`` product), so the
    encoder's side never subtracts it from an ``(N, K)`` array.

    A top-k chunk passes ``p_sel (n, k, D)`` (:func:`_gathered`): ``W'`` is then ``(n, k)``, one column per chosen
    prototype (the truncated distribution's gradient is the exact formula's with ``q = 0`` off the chosen k), in
    ``O(n k D)`` instead of ``O(n K D)``.
    """
    q, t = s.q, s.t
    if g_mu is None and g_q is None and a_lq is None and a_fe is None:
        return None
    row = torch.zeros(q.shape[0], dtype=q.dtype, device=q.device)  # (N,)
    if g_mu is not None:
        row = row + _rows_dot(g_mu, s.mu_c)  # <q, g_mu P^T> = g_mu . mu, an (N, D) product
    if g_q is not None:
        row = row + (q * g_q).sum(1)
    if a_lq is not None:
        row = row + a_lq * (s.lq_n + t)
    if a_fe is not None:
        row = row + a_fe * t
    if g_mu is not None:
        # dL/dq through mu = q P (the centre cancels in the softmax): g_mu . p_k for every k, or for the chosen k
        w = g_mu @ s.pc.t() if p_sel is None else torch.bmm(p_sel, g_mu[:, :, None]).squeeze(2)
        if g_q is not None:
            w.add_(g_q)
    else:
        w = g_q.clone() if g_q is not None else torch.zeros_like(q)
    if a_lq is not None:
        w.add_((s.d0[:, None] - t * s.x) * a_lq)  # a d, with d = d0 - T x
    return w.mul_(q), row


# d_nk = ||z_n - p_k||^2: dd/dp_k = 2 (p_k - z_n), dd/dz_n = 2 (z_n - p_k); with dL/dd = -W / T.
def _grad_prototypes(s: _Saved, g_mu: Tensor | None, w_row: tuple[Tensor, Tensor] | None) -> Tensor:
    """``dL/dP``: the direct path of ``mu = q P`` and, through the distances, ``W``."""
    grad_p = torch.zeros_like(s.pc) if g_mu is None else s.q.t() @ g_mu
    if w_row is not None:
        w = torch.addcmul(w_row[0], s.q, w_row[1][:, None], value=-1.0)  # W = W' - q row
        grad_p.add_((w.sum(0)[:, None] * s.pc - w.t() @ s.zc) * (-2.0 / s.t))
    return grad_p


def _grad_tokens(s: _Saved, w_row: tuple[Tensor, Tensor] | None, a_lq: Tensor | None, a_fe: Tensor | None,
                 a_ols: Tensor | None) -> Tensor:
    """``dL/dz``: through the distances (``W = W' - q row``, so ``W P = W' P - row mu``) and the direct terms of the
    commitment loss."""
    if w_row is not None:
        w, row = w_row
        grad_z = torch.addcmul(w @ s.pc, row[:, None], s.mu_c, value=-1.0).mul_(2.0 / s.t)
    else:
        grad_z = torch.zeros_like(s.zc)
    return _direct_token_terms(grad_z, s, a_lq, a_fe, a_ols)


def _direct_token_terms(grad_z: Tensor, s: _Saved, a_lq: Tensor | None, a_fe: Tensor | None,
                        a_ols: Tensor | None) -> Tensor:
    """``grad_z`` plus the commitment terms' direct paths to ``z`` (not through the distances)."""
    if a_lq is not None:
        grad_z.add_(2.0 * a_lq * s.zc)
    if a_fe is not None:
        grad_z.add_(2.0 * a_fe * s.zc)
    if a_ols is not None:
        grad_z.add_(2.0 * a_ols * s.r)
    return grad_z
