"""DDCL soft codebook: global prototypes, Boltzmann soft assignments, soft-centroid output.

Math (DESIGN §1, arXiv 2604.03850). Tokens ``z_n``, prototypes ``p_k``, temperature ``T``::

    d_nk  = ||z_n - p_k||^2                    (cosine: z and p L2-normalised first)
    q_nk  = softmax_k(-d_nk / T)               assignments, rows sum to 1
    mu_n  = sum_k q_nk p_k                     soft centroid, the layer's output
    L_q   = mean_n sum_k q_nk d_nk             competitive loss
    L_OLS = mean_n ||z_n - mu_n||^2            reconstruction term
    V     = mean_n sum_k q_nk ||p_k - mu_n||^2 prototype variance, >= 0
    L_q   = L_OLS + V                          exact identity

The forward pass and its gradient are one :class:`torch.autograd.Function` so that distances take one
``(N, D) x (D, K)`` matmul, no ``(N, K, D)`` tensor is ever built, everything runs in float32 (float64 for
float64 input) under autocast, and the training objective can send *different* terms to the encoder and to
the prototypes without recomputing the layer (see :class:`DDCLQuantizer`).
"""

from __future__ import annotations

import warnings
from typing import Any, Literal

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from softvq._utils import (
    all_reduce_sum_,
    broadcast_,
    check_choice,
    check_float,
    check_indices,
    check_positive_int,
    compute_dtype,
    empty_output,
    flatten_tokens,
    pick_tokens,
    restart_dead_codes_,
    squared_distances,
)
from softvq.types import QuantizerOutput

Term = Literal["l_q", "l_ols", "free_energy"]
_TERMS = ("l_q", "l_ols", "free_energy")


def _rows_dot(a: Tensor, b: Tensor) -> Tensor:
    """``(a * b).sum(-1)`` for ``(N, M)`` matrices, without materialising the product."""
    return torch.linalg.vecdot(a, b)


class _SoftCentroid(torch.autograd.Function):
    """Soft centroid of ``z (N, D)`` over ``prototypes (K, D)`` with the routed DDCL objective.

    Returns ``mu (N, D)``, ``q (N, K)``, ``indices (N,)``, ``loss ()``, ``stats (3,) = [l_q, l_ols, v]``.
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
        q = torch.softmax(logits, dim=1)  # (N, K), log-sum-exp stable
        mu_c = q @ pc  # (N, D)
        mu = mu_c + center

        lq_n = _rows_dot(q, logits).mul_(-temperature)  # (N,) per-token L_q = sum_k q d
        r = zc - mu_c  # (N, D) residual z - mu
        l_ols = r.square().sum(1).mean()
        v = (q @ p_sq - mu_c.square().sum(1)).mean()
        l_q = lq_n.mean()
        stats = torch.stack([l_q, l_ols, v])

        def term(name: str) -> Tensor:
            if name == "free_energy":  # F = -T log sum_k exp(-d_k / T) = L_q - T H(q)
                return torch.logsumexp(logits, dim=1).mean() * -temperature
            return l_q if name == "l_q" else l_ols

        loss = (cb_weight * term(cb_term) + cm_weight * term(cm_term)) / dim

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
        zc, pc, q, r, mu_c, logits, lq_n = ctx.saved_tensors
        temperature = ctx.temperature
        cb_term, cb_weight, cm_term, cm_weight = ctx.routing
        n, dim = zc.shape
        with torch.autocast(device_type=zc.device.type, enabled=False):
            # Per-token weights of the two loss terms: d loss / d (per-token term).
            scale = (g_loss / (n * dim)) if g_loss is not None else None
            a_cb = scale * cb_weight if scale is not None and cb_weight > 0 else None
            a_cm = scale * cm_weight if scale is not None and cm_weight > 0 else None

            def scaled_grad_d(g_mu_side: Tensor | None, a_lq: Tensor | None,
                              a_fe: Tensor | None) -> Tensor | None:
                """``W`` with ``dL/dd = -W / T``, from mu / q (through the softmax), ``a_lq * L_q`` and ``a_fe * F``.

                Through the softmax (logits = -d/T): dL/dd = -q (g_q - <q, g_q>) / T. From L_q:
                dL_q/dd = q (1 - (d - L_q,n) / T), attraction of near prototypes and repulsion of far ones.
                From the free energy F: dF/dd = q, attraction only (soft k-means).
                Together: -q (g_q + a d - <q, g_q> - a L_q,n - a T - a_fe T) / T.
                """
                w = None
                row = None  # (N,) per-token constant subtracted inside the bracket
                if g_mu_side is not None:
                    w = g_mu_side @ pc.t()  # (N, K) dL/dq; mu = q @ P and the centre cancels in the softmax
                    row = _rows_dot(g_mu_side, mu_c)  # <q, g_mu P^T> = g_mu . mu, an (N, D) product
                if g_q is not None:
                    w = g_q.clone() if w is None else w.add_(g_q)
                    row = _rows_dot(q, g_q) if row is None else row.add_(_rows_dot(q, g_q))
                if a_lq is not None:
                    # a * d = -a T * logits
                    w = logits * (-temperature * a_lq) if w is None else w.add_(logits * (-temperature * a_lq))
                    extra = a_lq * (lq_n + temperature)
                    row = extra if row is None else row.add_(extra)
                if a_fe is not None:
                    if w is None:
                        w = torch.zeros_like(q)
                    extra = (a_fe * temperature).expand(n)
                    row = extra if row is None else row.add_(extra)
                if w is None:
                    return None
                return w.sub_(row[:, None]).mul_(q)

            # L_OLS = mean ||z - mu||^2 enters through mu (dL/dmu = -2 r) and, on z's side, directly (+2 r).
            g_mu_p = g_mu
            if a_cb is not None and cb_term == "l_ols":
                g_mu_p = r * (-2.0 * a_cb) if g_mu_p is None else g_mu_p - 2.0 * a_cb * r
            g_mu_z = g_mu
            if a_cm is not None and cm_term == "l_ols":
                g_mu_z = r * (-2.0 * a_cm) if g_mu_z is None else g_mu_z - 2.0 * a_cm * r
            lq_cb = a_cb if cb_term == "l_q" else None
            lq_cm = a_cm if cm_term == "l_q" else None
            fe_cb = a_cb if cb_term == "free_energy" else None
            fe_cm = a_cm if cm_term == "free_energy" else None

            # d_nk = ||z_n - p_k||^2: dd/dp_k = 2 (p_k - z_n), dd/dz_n = 2 (z_n - p_k); with dL/dd = -W / T.
            grad_z = grad_p = w_p = None
            if ctx.needs_input_grad[1]:
                w_p = scaled_grad_d(g_mu_p, lq_cb, fe_cb)
                grad_p = torch.zeros_like(pc) if g_mu_p is None else q.t() @ g_mu_p  # direct path of mu
                if w_p is not None:
                    grad_p.add_(w_p.sum(0)[:, None] * pc - w_p.t() @ zc, alpha=-2.0 / temperature)
            if ctx.needs_input_grad[0]:
                reuse = (w_p is not None and g_mu_z is g_mu_p and lq_cb is None and lq_cm is None
                         and fe_cb is None and fe_cm is None)
                w_z = w_p if reuse else scaled_grad_d(g_mu_z, lq_cm, fe_cm)
                grad_z = torch.zeros_like(zc)
                if w_z is not None:
                    grad_z.add_(w_z @ pc, alpha=2.0 / temperature)  # the row sums of W are known in closed form
                if lq_cm is not None:
                    grad_z.add_(2.0 * lq_cm * zc)
                if fe_cm is not None:
                    grad_z.add_(2.0 * fe_cm * zc)
                if a_cm is not None and cm_term == "l_ols":
                    grad_z.add_(2.0 * a_cm * r)
        return grad_z, grad_p, None, None, None, None, None


class DDCLQuantizer(nn.Module):
    """DDCL differentiable codebook: a bank of ``num_codes`` global prototypes with Boltzmann soft assignments.

    Input: channel-last tokens ``z`` of shape ``(..., dim)``; the last dimension is the space in which to
    quantize, all other dimensions are flattened. Output: a :class:`~softvq.QuantizerOutput` whose
    ``quantized`` is the soft centroid ``mu = probs @ codebook`` (no straight-through estimator: gradients
    flow through the assignments and the prototypes).

    **What reaches what.** Three gradient paths leave this layer:

    1. the task's gradient through ``quantized`` (and ``probs`` if used) reaches ``z`` *and* the prototypes,
       via ``d mu_n / d z_n = (2/T) C_n`` (the assignment covariance, ``trace C_n = V_n``) and ``mu = q P``;
    2. ``codebook_weight * codebook_term(sg[z], P) / dim`` reaches **only the prototypes**;
    3. ``commitment_weight * commitment_term(z, sg[P]) / dim`` reaches **only the encoder** (``z``).

    ``loss`` is the sum of 2 and 3 (``sg`` = stop-gradient). Both terms are divided by ``dim`` so that the
    weights sit on the scale of an element-mean MSE reconstruction loss, like VQ-VAE's ``beta``. Set a weight to 0
    to drop a term. The prototypes' learning rate should exceed the encoder's: build the optimizer with
    :func:`softvq.param_groups` (``eps = encoder lr / prototype lr``, DESIGN §2).

    **Defaults, and why** (measured on CIFAR-10 VQ-VAEs; see the README, "Collapse-free defaults"):

    - ``codebook_term="free_energy"``: the prototypes minimise ``F = -T log sum_k exp(-d_k / T) = L_q - T H(q)``
      (soft k-means, the paper's Lyapunov function), whose gradient only *attracts* each prototype to the tokens
      it is assigned to (``dF/dd_k = q_k``). ``L_q`` itself pushes every prototype that is farther than average
      by more than ``T`` even farther away (``dL_q/dd_k = q_k (1 - (d_k - L_q) / T)``); Adam turns that tiny
      gradient into a full-size step, and those prototypes leave the data for good (dead codes).
    - ``commitment_weight=0``: committing the encoder to its *soft* centroid (``z -> mu(z)``) is a mean-shift step
      over the prototypes' kernel density; it pulls tokens into a few modes, which collapsed the codebook here.
      The encoder learns from the reconstruction alone, through ``d mu / d z = (2/T) C_n``.
    - The identity ``L_q = L_OLS + V`` and ``V >= 0`` hold whatever terms train the layer; ``terms`` reports them.
    - Not set by this layer but needed for collapse-freedom: tokens on a fixed scale (the encoder must not be able
      to shrink them; :class:`models.VQVAE` standardises them with a non-affine BatchNorm), ``T`` chosen relative to
      that scale, and ``dead_code_threshold > 0``.

    ``terms`` (detached, unweighted means over tokens): ``l_q``, ``l_ols``, ``v`` and ``identity_residual``
    ``= |l_q - l_ols - v| / max(l_q, tiny)``, which stays at float rounding on every batch.

    Args:
        num_codes: ``K``, the number of prototypes.
        dim: ``D``, the token dimension.
        temperature: Boltzmann ``T > 0`` in units of squared distance; lower = harder assignments, ``T -> 0``
            is hard VQ. May be changed during training (``quantizer.temperature = t``) for annealing; it is
            saved in the ``state_dict``.
        distance: ``"euclidean"`` (squared Euclidean) or ``"cosine"`` (tokens and prototypes L2-normalised
            first; then ``d = 2 - 2 cos``, the output lies in the unit ball, and a useful ``T`` is ~0.01-0.5).
        codebook_term: ``"free_energy"``, ``"l_q"`` or ``"l_ols"``, the term whose gradient trains the
            prototypes.
        codebook_weight: its weight (``>= 0``).
        commitment_term: ``"l_ols"``, ``"l_q"`` or ``"free_energy"``, the term whose gradient pulls the encoder to
            the codebook (only used with ``commitment_weight > 0``).
        commitment_weight: its weight (``>= 0``); 0 by default (see above).
        init: ``"data"`` copies random tokens of the first training batch into the prototypes (or call
            :meth:`init_from_data` yourself); ``"normal"`` draws ``N(0, init_scale^2)``.
        init_scale: standard deviation of the ``"normal"`` initialisation (also the placeholder values that
            ``"data"`` overwrites).
        dead_code_threshold: before each training step, move every prototype whose running number of tokens per
            batch (argmax assignments, exponential average with ``dead_code_decay``) is below this onto a random
            token of the batch; 0 = never. :attr:`restarts` counts the moves.
        dead_code_decay: decay of that running average, in ``(0, 1)`` (0.9: about the last 10 batches).
        check_finite: raise on NaN/Inf input (one device sync per call; disable in tuned GPU loops).

    Raises:
        ValueError: on invalid hyperparameters, a wrong last dimension, or non-finite input.
    """

    def __init__(
        self,
        num_codes: int,
        dim: int,
        temperature: float = 1.0,
        distance: Literal["euclidean", "cosine"] = "euclidean",
        codebook_term: Term = "free_energy",  # attraction only; l_q strands far prototypes under Adam
        codebook_weight: float = 1.0,
        commitment_term: Term = "l_ols",
        commitment_weight: float = 0.0,  # soft commitment is mean-shift: it collapses the tokens into few modes
        init: Literal["data", "normal"] = "data",
        init_scale: float = 1.0,
        dead_code_threshold: float = 0.0,
        dead_code_decay: float = 0.9,
        check_finite: bool = True,
    ) -> None:
        super().__init__()
        self.num_codes = check_positive_int("num_codes", num_codes)
        self.dim = check_positive_int("dim", dim)
        self.distance = check_choice("distance", distance, ("euclidean", "cosine"))
        self.codebook_term = check_choice("codebook_term", codebook_term, _TERMS)
        self.commitment_term = check_choice("commitment_term", commitment_term, _TERMS)
        self.codebook_weight = check_float("codebook_weight", codebook_weight, allow_zero=True)
        self.commitment_weight = check_float("commitment_weight", commitment_weight, allow_zero=True)
        self.init = check_choice("init", init, ("data", "normal"))
        init_scale = check_float("init_scale", init_scale)
        self.check_finite = bool(check_finite)
        self._temperature = check_float("temperature", temperature)
        self.dead_code_threshold = check_float("dead_code_threshold", dead_code_threshold, allow_zero=True)
        self.dead_code_decay = check_float("dead_code_decay", dead_code_decay)
        if not self.dead_code_decay < 1.0:
            raise ValueError(f"dead_code_decay must be in (0, 1), got {dead_code_decay!r}")
        # Python-side state (no device sync to read it); saved through get_extra_state.
        self._initialized = init != "data"
        self._restarts = 0  # prototypes restarted so far (dead-code restart)
        self.prototypes = nn.Parameter(torch.randn(num_codes, dim) * init_scale)  # (K, D)
        # Running average of argmax assignments per training batch (for dead-code restart); -1 = no batch seen yet.
        self.register_buffer("usage", torch.full((num_codes,), -1.0))

    # ---- temperature (annealing) and checkpointed state -------------------------------------------------
    @property
    def temperature(self) -> float:
        """The Boltzmann temperature ``T``; assign a new value to anneal."""
        return self._temperature

    @temperature.setter
    def temperature(self, value: float) -> None:
        self._temperature = check_float("temperature", value)

    @property
    def initialized(self) -> bool:
        """False until data initialisation (``init="data"``) has run."""
        return self._initialized

    @property
    def restarts(self) -> int:
        """How many prototypes dead-code restart has moved so far (cumulative, saved in the ``state_dict``)."""
        return self._restarts

    def get_extra_state(self) -> dict[str, Any]:
        return {"temperature": self._temperature, "initialized": self._initialized, "restarts": self._restarts}

    def set_extra_state(self, state: dict[str, Any]) -> None:
        if not isinstance(state, dict) or not {"temperature", "initialized"} <= state.keys():
            raise ValueError(f"DDCLQuantizer extra state must be a dict with 'temperature' and 'initialized' "
                             f"(from get_extra_state), got {state!r}; is the checkpoint from another layer?")
        self.temperature = state["temperature"]
        self._initialized = bool(state["initialized"])
        self._restarts = int(state.get("restarts", 0))

    def _load_from_state_dict(self, state_dict: dict[str, Any], prefix: str, *args: Any, **kwargs: Any) -> None:
        # State dicts written before dead-code restart existed have no usage buffer: start it afresh.
        state_dict.setdefault(prefix + "usage", torch.full_like(self.usage, -1.0))
        super()._load_from_state_dict(state_dict, prefix, *args, **kwargs)

    def extra_repr(self) -> str:
        return (
            f"num_codes={self.num_codes}, dim={self.dim}, temperature={self._temperature:g}, "
            f"distance={self.distance!r}, codebook={self.codebook_weight:g}*{self.codebook_term}, "
            f"commitment={self.commitment_weight:g}*{self.commitment_term}, init={self.init!r}, "
            f"dead_code_threshold={self.dead_code_threshold:g}"
        )

    # ---- codebook ---------------------------------------------------------------------------------------
    @property
    def codebook(self) -> Tensor:
        """``(K, D)``, the prototypes as the layer uses them (L2-normalised for ``distance="cosine"``)."""
        p = self.prototypes.detach()
        return F.normalize(p, dim=-1) if self.distance == "cosine" else p

    def decode_indices(self, indices: Tensor) -> Tensor:
        """Map code indices ``(...)`` to their prototypes ``(..., D)`` (the hard decode of a soft codebook)."""
        check_indices(indices, self.num_codes)
        return F.embedding(indices.long(), self.codebook)

    @torch.no_grad()
    def init_from_data(self, z: Tensor) -> None:
        """Set the prototypes to ``K`` random tokens of ``z (..., D)``.

        With fewer than ``K`` tokens, tokens are drawn with replacement and jittered by 1e-3 of their standard
        deviation so no two prototypes coincide. Under ``torch.distributed`` the tokens are drawn from every process's
        ``z`` together (:func:`softvq._utils.pick_tokens`): every process gets the same prototypes, the ones a single
        process would draw from the concatenated batches.
        """
        flat = flatten_tokens(z, self.dim, check_finite=True)
        k = self.num_codes
        chosen = pick_tokens(flat, lambda n: torch.randperm(n, device=flat.device)[:k] if n >= k
                             else torch.randint(n, (k,), device=flat.device))
        if chosen is None:
            raise ValueError("init_from_data needs at least one token, got an empty tensor")
        chosen = chosen.to(self.prototypes.dtype)
        if torch.unique(chosen, dim=0).shape[0] < k:  # fewer tokens than codes: drawn with replacement
            spread = chosen.std() if k > 1 else chosen.abs().mean()
            chosen = broadcast_(chosen + torch.randn_like(chosen) * 1e-3 * spread.clamp_min(1e-6))
        self.prototypes.copy_(chosen)
        self._initialized = True

    # ---- forward ----------------------------------------------------------------------------------------
    def forward(self, z: Tensor) -> QuantizerOutput:
        """Quantize channel-last tokens.

        Args:
            z: ``(..., dim)`` float tensor.

        Returns:
            :class:`~softvq.QuantizerOutput` with ``quantized (..., D)`` (dtype of ``z``), ``indices (...)``,
            ``probs (..., K)`` (float32, or float64 for float64 input), scalar ``loss`` and ``terms``.
        """
        flat = flatten_tokens(z, self.dim, check_finite=self.check_finite)  # (N, D)
        lead = z.shape[:-1]
        if flat.shape[0] == 0:
            return empty_output(z, self.num_codes, self.prototypes, ("l_q", "l_ols", "v", "identity_residual"))
        if not self._initialized:
            if self.training:
                self.init_from_data(flat.detach())
            else:
                warnings.warn("DDCLQuantizer(init='data') runs in eval mode before a training batch initialised its "
                              "prototypes: it is using random placeholder prototypes", stacklevel=2)
        if self.training and self.dead_code_threshold > 0:
            self._restart_dead_codes(flat.detach())
        ctype = compute_dtype(z.dtype)
        with torch.autocast(device_type=z.device.type, enabled=False):
            zf = flat.to(ctype)
            p = self.prototypes.to(ctype)
            if self.distance == "cosine":
                zf = F.normalize(zf, dim=-1)
                p = F.normalize(p, dim=-1)
            mu, q, indices, loss, stats = _SoftCentroid.apply(
                zf, p, self._temperature,
                self.codebook_term, self.codebook_weight,
                self.commitment_term, self.commitment_weight,
            )
        if self.training and self.dead_code_threshold > 0:
            self._update_usage(indices)
        l_q, l_ols, v = stats.unbind()
        residual = (l_q - l_ols - v).abs() / l_q.abs().clamp_min(torch.finfo(stats.dtype).tiny)
        terms = {"l_q": l_q, "l_ols": l_ols, "v": v, "identity_residual": residual}
        return QuantizerOutput(
            quantized=mu.to(z.dtype).reshape(z.shape),
            indices=indices.reshape(lead),
            probs=q.reshape(*lead, self.num_codes),
            loss=loss,
            terms=terms,
        )

    # ---- dead-code restart -------------------------------------------------------------------------------
    @torch.no_grad()
    def _update_usage(self, indices: Tensor) -> None:
        counts = torch.bincount(indices, minlength=self.num_codes).to(self.usage.dtype)  # (K,)
        all_reduce_sum_(counts)
        if bool((self.usage < 0).any()):  # first batch: start from its counts
            self.usage.copy_(counts)
        else:
            self.usage.mul_(self.dead_code_decay).add_(counts, alpha=1.0 - self.dead_code_decay)

    @torch.no_grad()
    def _restart_dead_codes(self, z: Tensor) -> None:
        """Before a training step: prototypes whose running argmax count per batch fell below the threshold move
        onto random tokens of this batch (done before the forward pass, so no tensor saved for backward changes)."""
        if bool((self.usage < 0).any()):
            return
        dead = restart_dead_codes_(self.prototypes.data, self.usage, z, self.dead_code_threshold)
        self._restarts += int(dead.sum())
