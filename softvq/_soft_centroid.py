"""The DDCL layer's arithmetic: the soft centroid, its loss terms and their hand-written gradient
(docs/design.md, "The layer: L_q = L_OLS + V").

:class:`_SoftCentroid` is one :class:`torch.autograd.Function` so that distances take one ``(N, D) x (D, K)``
matmul, no ``(N, K, D)`` tensor is ever built, and the training objective can send *different* terms to the encoder
and to the prototypes without recomputing the layer. :class:`softvq.DDCLQuantizer` is its only caller (its forward
pass, ``_forward_tokens`` in ``softvq/ddcl.py``); it runs it with autocast off, in float32 (float64 for float64
input). The pieces of its backward pass are ``softvq/_soft_centroid_grad.py``.
"""

from __future__ import annotations

import math
from typing import Any, NamedTuple

import torch
import torch.nn.functional as F
from torch import Tensor

from softvq._kernels import DEVICE_BLOCK_BYTES, max_rows, top_k_rows
from softvq._soft_centroid_grad import (
    _gathered,
    _grad_prototypes,
    _grad_prototypes_top_k,
    _grad_tokens,
    _grad_tokens_top_k,
    _Saved,
    _scaled_grad_d,
    _through_mu,
)


def _mean(x: Tensor) -> Tensor:
    """The mean of per-token values, accumulated in float64: a float32 sum of N values near the largest
    representable square distance would overflow where their mean does not."""
    return x.mean(dtype=torch.float64).to(x.dtype)


def score_operands(pc: Tensor, p_sq: Tensor, t: Tensor) -> tuple[Tensor, Tensor]:
    """The prototypes' side of :func:`logit_scores`, computed once per pass (not per chunk of tokens): ``weight =
    (2 / T) P^T`` ``(D, K)`` and ``bias = -|p|^2 / T`` ``(K,)``. ``1 / T`` scales the ``(K, D)`` side, not the
    ``(N, K)`` result."""
    inv_t = t.reciprocal()
    return (pc * (2.0 * inv_t)).t(), p_sq * -inv_t


def logit_scores(zc: Tensor, weight: Tensor, bias: Tensor) -> Tensor:
    """``(N, K)`` scores ``s = (2 z.p - |p|^2) / T = (|z|^2 - d) / T``: the Boltzmann logits ``-d / T`` plus a per-token
    constant, which the softmax ignores, in one matmul from :func:`score_operands`' ``weight`` and ``bias``; ``|z|^2``
    is never added to every entry (the per-token terms use it once per token)."""
    return torch.addmm(bias, zc, weight)


def softmax_floor(dtype: torch.dtype) -> float:
    """``-C``, the lowest shifted logit the layer's softmaxes keep (:func:`_softmax_floored`, and the first
    temperature's calibration in ``softvq.parts.temperature``): ``exp(-C) = finfo(dtype).tiny ** 0.75``, ``C`` = 65.5
    in float32, 531 in float64."""
    return 0.75 * math.log(torch.finfo(dtype).tiny)


def _softmax_floored(s: Tensor, s_max: Tensor, out: Tensor | None = None) -> Tensor:
    """``softmax(s)`` over dim 1, overwriting ``s`` with ``x = max(s - s_max, -C)`` (:func:`softmax_floor`).

    Why the floor: a float32 ``exp`` whose result would be subnormal or zero (argument below -87) leaves the vector
    fast path (measured here: 7-17x slower per element), and at a small temperature most of a row's prototypes lie
    there. Raising them to ``-C`` changes assignments below ``1.5e-29`` of the row's largest to that value: no sum
    that holds the largest can see it (float32 resolves 6e-8 of it), a prototype's mass over any realistic number of
    tokens stays below the ``sqrt(tiny)`` under which :class:`softvq.DDCLReadout` calls a slot empty, and its product
    with a gradient above ``tiny ** 0.25`` (2e-10) stays a normal number, so the backward pass does not compute on
    subnormals either. The shift comes first: ``s_max - C`` itself would round to ``s_max`` where ``|s_max|`` is
    large.
    """
    x = s.sub_(s_max[:, None]).clamp_(min=softmax_floor(s.dtype))
    if out is None:
        return torch.softmax(x, dim=1)
    return torch._softmax(x, 1, False, out=out)


# Rows of (N, K) work per chunk on a CPU: 2^19 entries (2 MiB in float32) stay in cache from the score matmul to the
# soft centroid's, where whole (N, K) arrays go out to memory between passes (timings:
# docs/scaling.md, "Chunk sizes"). On an accelerator the chunks only bound the memory
# (softvq._kernels.DEVICE_BLOCK_BYTES of scores), one large kernel each.
_CHUNK_ENTRIES = 1 << 19
# At least this many rows per chunk: at large K a thin chunk's matmul and the Python per chunk cost more than the
# cache saves (docs/scaling.md, "Chunk sizes").
_MIN_ROWS = 128
# Entries of the (n, k, D) prototypes a top-k chunk's backward pass gathers (4 MiB in float32 on a CPU).
_TOP_K_ENTRIES = 1 << 20


def _row_chunks(n: int, k: int, device: torch.device, entries: int | None = None) -> list[slice]:
    """Row slices for work of ``k`` entries per row: ``entries`` (default :data:`_CHUNK_ENTRIES`) per chunk on a CPU
    (cache-sized, at least :data:`_MIN_ROWS` rows), blocks of
    :data:`softvq._kernels.DEVICE_BLOCK_BYTES` of float32 on an accelerator (where one large kernel beats several
    small ones, and the blocks only bound the memory)."""
    budget = (entries or _CHUNK_ENTRIES) if device.type == "cpu" else DEVICE_BLOCK_BYTES // 4
    step = max(_MIN_ROWS, budget // max(k, 1))
    return [slice(a, min(a + step, n)) for a in range(0, n, step)] or [slice(0, 0)]


def _assign_rows(zc: Tensor, pc: Tensor, p_sq: Tensor, scores: tuple[Tensor, Tensor], keep_x: bool,
                 q_out: Tensor | None = None) -> tuple[Tensor | None, ...]:
    """The forward pass's ``(N, K)`` work on some rows: ``q`` (written into ``q_out`` when given), ``mu_c``,
    ``q |p|^2``, ``<q, x>``, the largest score, the nearest prototype and (``keep_x``) the shifted, floored scores."""
    s = logit_scores(zc, *scores)  # (n, K) = (|z|^2 - d) / T: the logits -d/T plus a per-token constant
    s_max, indices = max_rows(s)  # the nearest prototype maximises s
    q = _softmax_floored(s, s_max, q_out)  # (n, K); s now holds x = s - s_max, floored
    mu_c = q @ pc  # (n, D); not fused with q @ p_sq into one (K, D + 1) matmul: that ran slower here
    q_p_sq = q @ p_sq  # (n,) sum_k q |p_k|^2
    # <q, x> (n,): in place into x unless the backward pass needs x
    qx = (s * q).sum(1) if keep_x else s.mul_(q).sum(1)
    return q, mu_c, q_p_sq, qx, s_max, indices, s if keep_x else None


def _assign_rows_top_k(zc: Tensor, pc: Tensor, p_sq: Tensor, scores: tuple[Tensor, Tensor], k: int,
                       keep_x: bool, neighbours: Tensor | None = None) -> tuple[Tensor | None, ...]:
    """:func:`_assign_rows` for the distribution truncated to each row's ``k`` largest scores: ``q`` and (``keep_x``)
    ``x`` are ``(n, k)``, beside them the chosen prototypes ``sel (n, k)`` (in no particular order). The soft
    centroid is a weighted sum of ``k`` gathered rows (``embedding_bag``: no ``(n, k, D)`` tensor is built).
    With a ``neighbours (K, R)`` table whose row ``c`` lists ``c`` and ``R - 1`` other prototypes, the set is instead
    taken from the row of the nearest prototype: all of it (``R <= k``), or its ``k`` largest scores: one argmax pass,
    a gather of ``R`` scores and a selection among them, none over ``K``."""
    s = logit_scores(zc, *scores)  # (n, K)
    if neighbours is not None:
        s_max, indices = max_rows(s)  # the nearest prototype, as over all K
        sel = neighbours[indices]  # (n, R): its row holds it, so s_max is among the kept scores
        top = s.gather(1, sel)
        if sel.shape[1] > k > 0:  # the k largest of the R: the row's largest (s_max) among them
            top, where = top.topk(k, dim=1, sorted=False)
            sel = sel.gather(1, where)
    else:
        # the set s.topk(k) returns, in two exact stages where that is faster (unsorted: it holds the row's largest)
        top, sel = top_k_rows(s, k)  # (n, k)
        # the largest score and its prototype from the k kept (no other pass over (n, K)): the first index on a tie,
        # as max_rows gives it over all K
        s_max = top.amax(1)
        indices = torch.where(top == s_max[:, None], sel, pc.shape[0]).amin(1)
    q = _softmax_floored(top, s_max)  # (n, k); top now holds x = top - s_max, floored
    mu_c = F.embedding_bag(sel, pc, per_sample_weights=q, mode="sum")  # (n, D) sum_j q_j p_sel_j
    q_p_sq = (q * p_sq[sel]).sum(1)
    qx = (top * q).sum(1)
    return q, mu_c, q_p_sq, qx, s_max, indices, top if keep_x else None, sel


class Objective(NamedTuple):
    """Where the layer's loss sends its two terms: ``codebook_term`` (``"l_q"``, ``"l_ols"`` or ``"free_energy"``)
    with ``codebook_weight`` reaches only the prototypes, ``commitment_term`` with ``commitment_weight`` only the
    tokens; a weight of 0 drops its term."""

    codebook_term: str
    codebook_weight: float
    commitment_term: str
    commitment_weight: float


class _SoftCentroid(torch.autograd.Function):
    """Soft centroid of ``z (N, D)`` over ``prototypes (K, D)`` with the routed DDCL objective.

    Returns ``mu (N, D)``, ``q (N, K)``, ``indices (N,)``, ``loss ()``, ``stats (4,) = [l_q, l_ols, v, H(q)]``.
    ``loss = (cb_w * L_cb(sg z, P) + cm_w * L_cm(z, sg P)) / D`` (the terms and weights of ``objective``, an
    :class:`Objective`): the codebook term only reaches the prototypes, the commitment term only reaches ``z``;
    ``mu`` and ``q`` are differentiable w.r.t. both. ``record`` (any object with a ``done`` attribute, or ``None``) is
    marked ``done`` when this pass's backward runs: the layer's record of the state this forward pass read, which a
    recomputation during backward (activation checkpointing) replays. ``top_k > 0`` truncates each token's
    distribution to its ``top_k`` nearest prototypes; a ``neighbours (K, R)`` table (row ``c`` lists ``c`` first),
    to the ``top_k`` nearest among the row of its nearest prototype (:func:`_assign_rows_top_k`); ``q`` is then
    ``(N, k)``.

    The backward pass is written out so that it touches each ``(N, K)`` array as few times as possible (it is
    memory-bound on CPU): per side one matmul for ``dL/dq`` and three element-wise passes.
    """

    @staticmethod
    def forward(  # type: ignore[override]
        ctx: Any,
        z: Tensor,
        prototypes: Tensor,
        temperature: Tensor | float,
        objective: Objective,
        record: Any = None,
        top_k: int = 0,
        neighbours: Tensor | None = None,
    ) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor, Tensor]:
        cb_term, cb_weight, cm_term, cm_weight = objective
        n, dim = z.shape
        # () a copy (the layer's temperature control updates its own in place before this backward runs)
        t = torch.as_tensor(temperature, device=z.device).to(z.dtype, copy=True)
        # Distances, q and V are translation invariant: centre both sides on the prototypes' mean so that the
        # expansion |z|^2 - 2 z.p + |p|^2 cancels little when tokens and prototypes sit far from the origin.
        center = prototypes.mean(0)
        zc = z - center  # (N, D)
        pc = prototypes - center  # (K, D)
        p_sq = pc.square().sum(1)  # (K,)
        z_sq = zc.square().sum(1)  # (N,)
        need_d = (cb_term == "l_q" and cb_weight > 0) or (cm_term == "l_q" and cm_weight > 0)
        chunks = _row_chunks(n, pc.shape[0], z.device)
        scores = score_operands(pc, p_sq, t)
        sel = None
        if neighbours is not None or 0 < top_k < pc.shape[0]:  # truncated: each token's top_k, or its code's row
            parts = [_assign_rows_top_k(zc[rows], pc, p_sq, scores, top_k, need_d, neighbours) for rows in chunks]
            q, mu_c, q_p_sq, qx, s_max, indices, x, sel = (torch.cat(part) if part[0] is not None else None
                                                           for part in zip(*parts, strict=True))
            q_argmax = q.amax(1)  # the argmax's assignment (its x is 0, the largest)
        else:
            # eager: every chunk's q written into one (N, K) array (a torch.cat of them cost 8% of the forward
            # pass); compiled: pieces and a cat, which inductor writes in place itself
            q_all = None if torch.compiler.is_compiling() or len(chunks) == 1 else zc.new_empty(n, pc.shape[0])
            parts = [_assign_rows(zc[rows], pc, p_sq, scores, need_d, None if q_all is None else q_all[rows])
                     for rows in chunks]
            q_parts, *rest = zip(*parts, strict=True)
            q = q_all if q_all is not None else torch.cat(q_parts)
            mu_c, q_p_sq, qx, s_max, indices, x = (torch.cat(part) if part[0] is not None else None for part in rest)
            q_argmax = q.gather(1, indices[:, None]).squeeze(1)
        mu = mu_c + center
        lq_n = z_sq - t * (qx + s_max)  # (N,) per-token L_q = sum_k q d = |z|^2 - T <q, s>
        # log sum_k exp(x_k) = -log q_argmax (x is 0 there): no further pass over (N, K)
        log_norm = -q_argmax.log()
        r = zc - mu_c  # (N, D) residual z - mu
        l_ols = _mean(r.square().sum(1))
        v = _mean(q_p_sq - mu_c.square().sum(1))
        l_q = _mean(lq_n)
        entropy = _mean(log_norm - qx)  # H(q) = -sum_k q log q, log q = x - log_norm
        stats = torch.stack([l_q, l_ols, v, entropy])

        def term(name: str) -> Tensor:
            if name == "free_energy":  # F = -T log sum_k exp(-d_k / T) = |z|^2 - T (s_max + log_norm)
                return _mean(z_sq - t * (s_max + log_norm))
            return l_q if name == "l_q" else l_ols

        loss = zc.new_zeros(())
        for name, weight in ((cb_term, cb_weight), (cm_term, cm_weight)):
            if weight > 0:  # a dropped term is not computed (0 * inf would be NaN)
                loss = loss + weight * term(name)
        loss = loss / dim

        ctx.objective = objective
        ctx.record = record
        # d = |z|^2 - T (x + s_max) is rebuilt from x in the backward pass when an L_q term needs it
        ctx.save_for_backward(zc, pc, q, r, mu_c, t, x, lq_n if need_d else None,
                              (z_sq - t * s_max) if need_d else None, sel)
        chosen = sel if sel is not None else indices.new_empty(0)
        ctx.mark_non_differentiable(indices, stats, chosen)
        ctx.set_materialize_grads(False)
        return mu, q, indices, loss, stats, chosen

    @staticmethod
    def backward(  # type: ignore[override]
        ctx: Any,
        g_mu: Tensor | None,
        g_q: Tensor | None,
        _g_idx: Tensor | None,
        g_loss: Tensor | None,
        _g_stats: Tensor | None,
        _g_sel: Tensor | None = None,
    ) -> tuple[Tensor | None, ...]:
        s = _Saved(*ctx.saved_tensors)  # under activation checkpointing, this recomputes the forward pass
        if ctx.record is not None:
            ctx.record.done = True
        cb_term, cb_weight, cm_term, cm_weight = ctx.objective
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

            reuse = (g_mu_z is g_mu_p and lq_cb is None and lq_cm is None and fe_cb is None and fe_cm is None)
            grads_z, grad_p = [], None
            sparse = s.sel is not None  # top-k: (N, k) q and x, O(n k D) per chunk, no (n, K) array
            chunks = (_row_chunks(n, s.sel.shape[1] * dim, s.zc.device, _TOP_K_ENTRIES) if sparse
                      else _row_chunks(n, s.pc.shape[0], s.zc.device))  # cache-sized (N, K) work, as in forward
            for rows in chunks:
                c = s._replace(**{name: v[rows] for name, v in s._asdict().items()  # every per-token field's rows
                                  if name != "pc" and v is not None and v.ndim > 0})
                gq = g_q[rows] if g_q is not None else None
                p_sel = _gathered(c) if sparse else None
                w_p = None
                if ctx.needs_input_grad[1]:
                    gm = g_mu_p[rows] if g_mu_p is not None else None
                    w_p = _scaled_grad_d(c, gm, gq, lq_cb, fe_cb, p_sel)
                    part = _grad_prototypes_top_k(c, gm, w_p) if sparse else _grad_prototypes(c, gm, w_p)
                    grad_p = part if grad_p is None else grad_p.add_(part)
                if ctx.needs_input_grad[0]:
                    gm = g_mu_z[rows] if g_mu_z is not None else None
                    a_ols = a_cm if cm_term == "l_ols" else None
                    w_z = w_p if reuse and w_p is not None else _scaled_grad_d(c, gm, gq, lq_cm, fe_cm, p_sel)
                    grads_z.append(_grad_tokens_top_k(c, p_sel, w_z, lq_cm, fe_cm, a_ols) if sparse
                                   else _grad_tokens(c, w_z, lq_cm, fe_cm, a_ols))
            grad_z = torch.cat(grads_z) if grads_z else None
        return grad_z, grad_p, None, None, None, None, None
