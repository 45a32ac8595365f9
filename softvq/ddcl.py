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

import math
import warnings
from typing import Any, Literal

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from softvq.norm import TokenStandardizer
from softvq.schedule import adapt_temperature
from softvq.types import QuantizerOutput
from softvq.utils import (
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

Term = Literal["l_q", "l_ols", "free_energy"]
CommitTerm = Literal["hard", "l_q", "l_ols", "free_energy"]
_TERMS = ("l_q", "l_ols", "free_energy")


def _mean(x: Tensor) -> Tensor:
    """The mean of per-token values, accumulated in float64: a float32 sum of N values near the largest
    representable square distance would overflow where their mean does not."""
    return x.mean(dtype=torch.float64).to(x.dtype)


def _rows_dot(a: Tensor, b: Tensor) -> Tensor:
    """``(a * b).sum(-1)`` for ``(N, M)`` matrices, without materialising the product."""
    return torch.linalg.vecdot(a, b)


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

    Input: tokens ``z`` of shape ``(..., dim)`` (channel-last; all other dimensions are flattened), or with
    ``channel_first=True`` feature maps ``(B, dim, *spatial)``. Output: a :class:`~softvq.QuantizerOutput`.

    **The recipe is in the layer** (``recipe="auto"``, the default). ``DDCLQuantizer(num_codes=K, dim=D)`` trains
    collapse-free as the bottleneck of any model under any optimizer, with nothing else to set:

    - *token scale*: tokens are standardised per dimension (:class:`softvq.norm.TokenStandardizer`: batch statistics
      in training, over every process under DDP; running statistics in evaluation), so the encoder cannot shrink
      what the codebook sees. Codes are returned in that standardised space (``output_scale``).
    - *temperature*: ``T`` is set on the first training batch so that the mean assignment entropy H(Q) equals
      ``target_entropy``, and after every training step ``T <- T exp(temperature_rate (target - H(Q)))`` keeps it
      there (checkpointed with the layer), so ``T`` follows the distance scale and nobody tunes it.
    - *prototype timescale*: the prototypes are not trained by the optimizer; every training step moves them by an
      exponential moving average (``ema_decay``) toward the mean of the tokens they win (``prototype_update="ema"``,
      a k-means step; ``"soft_ema"`` weights the tokens by ``q``, the free-energy M-step). That is the eps -> 0 limit
      of the paper's timescale theorem, and it does not depend on the user's learning rate or optimizer.
    - *dead codes*: a prototype whose running count of won tokens per batch falls below ``dead_code_threshold``
      is moved onto a random token of the batch.
    - *discrete codes*: with ``hard_output=True`` the output equals the argmax prototype in value, in training as at
      test time, while the encoder's gradient is the DDCL soft-centroid Jacobian
      ``d mu_n / d z_n = (2/T) C_n`` (``quantized = mu + sg(p_argmax - mu)``). The decoder learns on the codes it will
      be given, so the soft -> hard gap is zero by construction.

    ``recipe="plain"`` is the paper's layer as written: no standardisation, a fixed temperature (1.0 unless given),
    prototypes trained by the gradient (build the optimizer with :func:`softvq.param_groups`, ``eps = encoder lr /
    prototype lr``), the soft centroid ``mu = q P`` as output, no restarts. Every option below overrides its recipe
    value.

    **What reaches what** (gradient-trained prototypes): the task's gradient through ``quantized`` reaches ``z`` and
    the prototypes; ``codebook_weight * codebook_term(sg[z], P) / dim`` reaches only the prototypes;
    ``commitment_weight * commitment_term(z, sg[P]) / dim`` only the encoder. ``loss`` is the sum of the two terms.
    With ``prototype_update="ema"`` the codebook term is not used (the prototypes have no gradient).

    ``terms`` (detached means over tokens, in the standardised space the codebook lives in): ``l_q``, ``l_ols``, ``v``,
    ``identity_residual = |l_q - l_ols - v| / l_q`` (float rounding on every batch: ``L_q = L_OLS + V`` is exact) and
    ``entropy`` H(Q).

    Args:
        num_codes: ``K``, the number of prototypes.
        dim: ``D``, the token dimension.
        temperature: Boltzmann ``T > 0`` in units of squared (standardised) distance at the start, or ``None``: set on
            the first training batch from ``target_entropy`` (``recipe="auto"``; 1.0 for ``"plain"``). It may be
            assigned during training (``quantizer.temperature = t``) and is saved in the ``state_dict``.
        recipe: ``"auto"`` (the defaults above) or ``"plain"``.
        target_entropy: the H(Q) in nats that the temperature control holds, ``None`` for a fixed ``T``; ``"auto"``:
            ``min(2.5, log(K) / 2)`` for ``recipe="auto"`` (about 12 prototypes share a token at K = 512), ``None``
            for ``"plain"``.
        temperature_rate: gain of the temperature control per step.
        standardize: standardise tokens inside the layer (``recipe`` default: on for ``"auto"``).
        output_scale: with ``standardize``, return codes in the standardised space the codebook lives in
            (``"standardized"``, the default: unit variance per dimension, whatever the encoder's scale) or on the
            input's scale (``"input"``: ``code * std + mean``, as a straight-through VQ returns them). Measured in the
            project's VQ-VAE (README, "Collapse-free defaults"): a decoder fed unit-scale codes learned faster (train
            MSE 0.025 against 0.036 after one epoch) because a fresh encoder's outputs are ~100x smaller.
        prototype_update: ``"ema"``, ``"soft_ema"`` or ``"gradient"`` (``recipe`` default: ``"ema"`` / ``"gradient"``).
        ema_decay: decay of the prototype update, in ``(0, 1)``.
        hard_output: output the argmax prototype (with the soft-centroid gradient) instead of the soft centroid
            (``recipe`` default: on for ``"auto"``).
        distance: ``"euclidean"`` or ``"cosine"`` (tokens and prototypes L2-normalised first; ``d = 2 - 2 cos``).
        codebook_term: ``"free_energy"``, ``"l_q"`` or ``"l_ols"``, the term whose gradient trains the prototypes
            (``prototype_update="gradient"``). ``free_energy`` ``F = -T log sum_k exp(-d_k / T)`` only attracts a
            prototype to its tokens (soft k-means); ``l_q`` pushes far prototypes away, which strands them under Adam.
        codebook_weight: its weight (``>= 0``).
        commitment_term: ``"hard"`` (``||z - sg[p_argmax]||^2``, VQ-VAE's commitment to the code), ``"l_ols"``,
            ``"l_q"`` or ``"free_energy"``: the term that pulls the encoder to the codebook.
        commitment_weight: its weight (``>= 0``; default 0: committing to the *soft* centroid is a mean-shift step
            that pulled the tokens into few modes here).
        init: ``"data"`` copies random tokens of the first training batch into the prototypes; ``"normal"`` draws
            ``N(0, init_scale^2)``.
        init_scale: standard deviation of the ``"normal"`` initialisation.
        dead_code_threshold: restart a prototype whose running number of won tokens per batch (decay
            ``dead_code_decay``) is below this; 0 = never. ``None``: the recipe's, 1.0 for ``"auto"`` (but never above
            a quarter of the mean tokens per code, so that a small batch does not restart live codes) and 0 for
            ``"plain"``.
        dead_code_decay: decay of that running count, in ``(0, 1)``.
        channel_first: accept ``(B, dim, *spatial)`` feature maps (like vector-quantize-pytorch's
            ``accept_image_fmap``); ``quantized`` has the input's layout, ``indices`` is ``(B, *spatial)`` and
            ``probs`` ``(B, *spatial, K)``.
        check_finite: raise on NaN/Inf input (one device sync per call; disable in tuned GPU loops).

    Raises:
        ValueError: on invalid hyperparameters, a wrong token dimension, or non-finite input.
    """

    VERSION = 2  # extra-state version: 1 (no key) = the plain layer before the in-layer recipe

    def __init__(
        self,
        num_codes: int,
        dim: int,
        temperature: float | None = None,
        *,
        recipe: Literal["auto", "plain"] = "auto",
        target_entropy: float | Literal["auto"] | None = "auto",
        temperature_rate: float = 0.01,
        standardize: bool | None = None,
        output_scale: Literal["input", "standardized"] = "standardized",
        prototype_update: Literal["ema", "soft_ema", "gradient"] | None = None,
        ema_decay: float = 0.99,
        hard_output: bool | None = None,
        distance: Literal["euclidean", "cosine"] = "euclidean",
        codebook_term: Term = "free_energy",  # attraction only; l_q strands far prototypes under Adam
        codebook_weight: float = 1.0,
        commitment_term: CommitTerm = "l_ols",
        commitment_weight: float = 0.0,  # soft commitment is mean-shift: it collapses the tokens into few modes
        init: Literal["data", "normal"] = "data",
        init_scale: float = 1.0,
        dead_code_threshold: float | None = None,
        dead_code_decay: float = 0.9,
        channel_first: bool = False,
        check_finite: bool = True,
    ) -> None:
        super().__init__()
        self.num_codes = check_positive_int("num_codes", num_codes)
        self.dim = check_positive_int("dim", dim)
        self.recipe = check_choice("recipe", recipe, ("auto", "plain"))
        auto = recipe == "auto"
        self.distance = check_choice("distance", distance, ("euclidean", "cosine"))
        self.codebook_term = check_choice("codebook_term", codebook_term, _TERMS)
        self.commitment_term = check_choice("commitment_term", commitment_term, (*_TERMS, "hard"))
        self.codebook_weight = check_float("codebook_weight", codebook_weight, allow_zero=True)
        self.commitment_weight = check_float("commitment_weight", commitment_weight, allow_zero=True)
        self.init = check_choice("init", init, ("data", "normal"))
        init_scale = check_float("init_scale", init_scale)
        self.check_finite = bool(check_finite)
        self.channel_first = _check_bool("channel_first", channel_first)
        self.standardize = _check_bool("standardize", auto if standardize is None else standardize)
        self.output_scale = check_choice("output_scale", output_scale, ("input", "standardized"))
        self.hard_output = _check_bool("hard_output", auto if hard_output is None else hard_output)
        self.prototype_update = check_choice("prototype_update", prototype_update or ("ema" if auto else "gradient"),
                                             ("ema", "soft_ema", "gradient"))
        self.ema_decay = _check_unit("ema_decay", ema_decay)
        if target_entropy == "auto":
            target_entropy = min(2.5, 0.5 * math.log(num_codes)) if auto else None
        self.target_entropy = None if target_entropy is None else check_float("target_entropy", target_entropy)
        if self.target_entropy is not None and not self.target_entropy < math.log(num_codes):
            raise ValueError(f"target_entropy must be below log(num_codes) = {math.log(num_codes):.4g} nats (uniform "
                             f"assignments), got {target_entropy!r}")
        self.temperature_rate = check_float("temperature_rate", temperature_rate)
        if temperature is None and self.target_entropy is None:
            temperature = 1.0
        self._temperature = None if temperature is None else check_float("temperature", temperature)
        threshold = (1.0 if auto else 0.0) if dead_code_threshold is None else dead_code_threshold
        self.dead_code_threshold = check_float("dead_code_threshold", threshold, allow_zero=True)
        # The recipe's threshold never exceeds a quarter of the mean tokens per code (an explicit one is kept as given)
        self._capped_threshold = dead_code_threshold is None
        self.dead_code_decay = _check_unit("dead_code_decay", dead_code_decay)
        # Python-side state (no device sync to read it); saved through get_extra_state.
        self._initialized = init != "data"
        self._restarts = 0  # prototypes restarted so far (dead-code restart)
        self.prototypes = nn.Parameter(torch.randn(num_codes, dim) * init_scale,  # (K, D)
                                       requires_grad=self.prototype_update == "gradient")
        self.standardizer = TokenStandardizer(dim)
        # Running average of argmax assignments per training batch (for dead-code restart); -1 = no batch seen yet.
        self.register_buffer("usage", torch.full((num_codes,), -1.0))
        # EMA prototype update: won mass per code and the weighted sum of its tokens (one pseudo-token each).
        self.register_buffer("ema_mass", torch.ones(num_codes))
        self.register_buffer("ema_sum", self.prototypes.detach().clone())

    # ---- temperature and checkpointed state --------------------------------------------------------------------
    @property
    def temperature(self) -> float | None:
        """The Boltzmann temperature ``T`` (``None`` until the first training batch sets it); assign to anneal."""
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
        return {"temperature": self._temperature, "initialized": self._initialized, "restarts": self._restarts,
                "version": self.VERSION}

    def set_extra_state(self, state: dict[str, Any]) -> None:
        if not isinstance(state, dict) or not {"temperature", "initialized"} <= state.keys():
            raise ValueError(f"DDCLQuantizer extra state must be a dict with 'temperature' and 'initialized' "
                             f"(from get_extra_state), got {state!r}; is the checkpoint from another layer?")
        t = state["temperature"]
        self._temperature = None if t is None else check_float("temperature", t)
        self._initialized = bool(state["initialized"])
        self._restarts = int(state.get("restarts", 0))

    def _load_from_state_dict(self, state_dict: dict[str, Any], prefix: str, *args: Any, **kwargs: Any) -> None:
        extra = state_dict.get(prefix + "_extra_state")
        if isinstance(extra, dict) and "version" not in extra and self.recipe == "auto":
            # A layer saved before the in-layer recipe existed (version 1) is the plain layer: switch this one to the
            # settings it was trained with, so that evaluation, readout and the prior see the same codebook.
            self._become_plain()
        # Buffers newer than the state dict start afresh (usage: dead-code restart; standardizer and EMA: v2).
        state_dict.setdefault(prefix + "usage", torch.full_like(self.usage, -1.0))
        for name, value in (("ema_mass", self.ema_mass), ("ema_sum", self.ema_sum)):
            state_dict.setdefault(prefix + name, value.detach().clone())
        for name, value in self.standardizer.state_dict().items():
            state_dict.setdefault(f"{prefix}standardizer.{name}", value.clone())
        super()._load_from_state_dict(state_dict, prefix, *args, **kwargs)

    def _become_plain(self) -> None:
        self.recipe = "plain"
        self.standardize = self.hard_output = False
        self.prototype_update = "gradient"
        self.prototypes.requires_grad_(True)
        self.target_entropy = None

    def extra_repr(self) -> str:
        t = "auto" if self._temperature is None else f"{self._temperature:g}"
        return (
            f"num_codes={self.num_codes}, dim={self.dim}, recipe={self.recipe!r}, temperature={t}, "
            f"target_entropy={self.target_entropy}, standardize={self.standardize}, "
            f"prototype_update={self.prototype_update!r}, hard_output={self.hard_output}, "
            f"distance={self.distance!r}, codebook={self.codebook_weight:g}*{self.codebook_term}, "
            f"commitment={self.commitment_weight:g}*{self.commitment_term}, init={self.init!r}, "
            f"dead_code_threshold={self.dead_code_threshold:g}"
        )

    # ---- codebook ---------------------------------------------------------------------------------------------
    def _unit_codebook(self) -> Tensor:
        """``(K, D)``, the prototypes in the space of the distances (standardised; L2-normalised for cosine)."""
        p = self.prototypes.detach()
        return F.normalize(p, dim=-1) if self.distance == "cosine" else p

    @property
    def codebook(self) -> Tensor:
        """``(K, D)``, the codes as the layer outputs them in evaluation (see ``output_scale``)."""
        p = self._unit_codebook()
        if self.standardize and self.output_scale == "input":
            p = p * self.standardizer.running_std().to(p.dtype) + self.standardizer.running_mean.to(p.dtype)
        return p

    def decode_indices(self, indices: Tensor) -> Tensor:
        """Map code indices ``(...)`` to their codes ``(..., D)`` (for ``channel_first``, ``(B, *spatial)`` to
        ``(B, D, *spatial)``): what :meth:`forward` outputs in evaluation with ``hard_output``."""
        check_indices(indices, self.num_codes)
        codes = F.embedding(indices.long(), self.codebook)
        return codes.movedim(-1, 1) if self.channel_first and codes.ndim > 2 else codes

    @torch.no_grad()
    def init_from_data(self, z: Tensor) -> None:
        """Set the prototypes to ``K`` random tokens of ``z (..., D)`` (standardised tokens, when the layer
        standardises: pass what the codebook sees).

        With fewer than ``K`` tokens, tokens are drawn with replacement and jittered by 1e-3 of their standard
        deviation so no two prototypes coincide. Under ``torch.distributed`` the tokens are drawn from every process's
        ``z`` together (:func:`softvq.utils.pick_tokens`): every process gets the same prototypes, the ones a single
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
        self.ema_sum.copy_(chosen)
        self.ema_mass.fill_(1.0)
        self._initialized = True

    # ---- forward ----------------------------------------------------------------------------------------------
    def forward(self, z: Tensor) -> QuantizerOutput:
        """Quantize tokens ``z (..., dim)`` (or feature maps ``(B, dim, *spatial)`` with ``channel_first``).

        Returns:
            :class:`~softvq.QuantizerOutput` with ``quantized`` (shape and dtype of ``z``), ``indices``, ``probs``
            (float32, or float64 for float64 input), scalar ``loss`` and ``terms``.
        """
        if self.channel_first:
            if not isinstance(z, Tensor) or z.ndim < 2 or z.shape[1] != self.dim:
                shape = tuple(z.shape) if isinstance(z, Tensor) else type(z).__name__
                raise ValueError(f"channel_first=True expects feature maps of shape (B, {self.dim}, ...), got {shape}")
            out = self._forward_tokens(z.movedim(1, -1))
            return out._replace(quantized=out.quantized.movedim(-1, 1))
        return self._forward_tokens(z)

    def _forward_tokens(self, z: Tensor) -> QuantizerOutput:
        flat = flatten_tokens(z, self.dim, check_finite=self.check_finite)  # (N, D)
        lead = z.shape[:-1]
        if flat.shape[0] == 0:
            return empty_output(z, self.num_codes, self.prototypes,
                                ("l_q", "l_ols", "v", "identity_residual", "entropy"))
        ctype = compute_dtype(z.dtype)
        with torch.autocast(device_type=z.device.type, enabled=False):
            zf = flat.to(ctype)
            mean = std = None
            if self.standardize:
                zf, mean, std = self.standardizer(zf)
            if not self._initialized:
                if self.training:
                    self.init_from_data(zf.detach())
                else:
                    warnings.warn("DDCLQuantizer(init='data') runs in eval mode before a training batch initialised "
                                  "its prototypes: it is using random placeholder prototypes", stacklevel=3)
            if self.training and self.dead_code_threshold > 0:
                self._restart_dead_codes(zf.detach())
            if self.distance == "cosine":
                zf = F.normalize(zf, dim=-1)
            p = self.prototypes.to(ctype)
            p = F.normalize(p, dim=-1) if self.distance == "cosine" else p
            temperature = self._temperature
            if temperature is None:  # set by the first training batch; evaluation before it calibrates, keeps nothing
                temperature = self._calibrate_temperature(zf.detach(), p.detach())
                if self.training:
                    self._temperature = temperature
            gradient = self.prototype_update == "gradient"
            mu, q, indices, loss, stats = _SoftCentroid.apply(
                zf, p, temperature,
                self.codebook_term, self.codebook_weight if gradient else 0.0,
                *self._soft_commitment(),
            )
            out = mu
            if self.hard_output or self.commitment_term == "hard":
                codes = F.embedding(indices, p.detach())  # (N, D) the argmax prototypes
                if self.hard_output:
                    # the code in value, bit for bit (mu - sg(mu) is exactly 0), and the soft centroid's Jacobian
                    out = codes + (mu - mu.detach())
                if self.commitment_term == "hard" and self.commitment_weight > 0:
                    loss = loss + self.commitment_weight * F.mse_loss(zf, codes)
            if std is not None and self.output_scale == "input":
                out = out * std + mean
        l_q, l_ols, v, entropy = stats.unbind()
        if self.training:
            self._after_step(zf.detach(), q.detach(), indices, entropy)
        residual = (l_q - l_ols - v).abs() / l_q.abs().clamp_min(torch.finfo(stats.dtype).tiny)
        terms = {"l_q": l_q, "l_ols": l_ols, "v": v, "identity_residual": residual, "entropy": entropy}
        return QuantizerOutput(
            quantized=out.to(z.dtype).reshape(z.shape),
            indices=indices.reshape(lead),
            probs=q.reshape(*lead, self.num_codes),
            loss=loss,
            terms=terms,
        )

    def _soft_commitment(self) -> tuple[str, float]:
        """The commitment term the autograd function computes (``"hard"`` is added outside it)."""
        if self.commitment_term == "hard":
            return "l_ols", 0.0
        return self.commitment_term, self.commitment_weight

    # ---- the in-layer updates (training mode) --------------------------------------------------------------------
    @torch.no_grad()
    def _after_step(self, z: Tensor, q: Tensor, indices: Tensor, entropy: Tensor) -> None:
        """After a training forward: usage for dead-code restart, the EMA prototype update and the temperature
        control, each with its statistics summed over processes (every process ends with the same state)."""
        if self.dead_code_threshold > 0 or self.prototype_update == "ema":
            counts = torch.bincount(indices, minlength=self.num_codes).to(self.usage.dtype)  # (K,)
            all_reduce_sum_(counts)
            if self.dead_code_threshold > 0:
                self._update_usage(counts)
        if self.prototype_update != "gradient":
            if self.prototype_update == "ema":
                mass = counts.to(self.ema_mass.dtype)  # summed over processes already
                total = torch.zeros_like(self.ema_sum).index_add_(0, indices, z.to(self.ema_sum.dtype))
            else:  # soft_ema: the free-energy M-step, tokens weighted by their assignments
                mass = all_reduce_sum_(q.sum(0).to(self.ema_mass.dtype))
                total = (q.t() @ z).to(self.ema_sum.dtype)
            all_reduce_sum_(total)
            self.ema_mass.lerp_(mass, 1.0 - self.ema_decay)
            self.ema_sum.lerp_(total, 1.0 - self.ema_decay)
            self.prototypes.copy_(self.ema_sum / self.ema_mass.clamp_min(1e-12)[:, None])
        if self.target_entropy is not None:
            n = torch.tensor([entropy.item() * indices.numel(), indices.numel()], dtype=torch.float64,
                             device=indices.device)
            all_reduce_sum_(n)
            self._temperature = adapt_temperature(self._temperature, float(n[0] / n[1]), self.target_entropy,
                                                  self.temperature_rate)

    @torch.no_grad()
    def _calibrate_temperature(self, z: Tensor, p: Tensor) -> float:
        """The first ``T``: bisection in ``log T`` until the mean assignment entropy of this batch (of every
        process's batch) equals ``target_entropy``; H(Q) rises monotonically with ``T``."""
        sample = z[:: max(1, z.shape[0] // 4096)]  # a strided sample: no random draw, so restarts draw alike
        center = p.mean(0)
        d = squared_distances(sample - center, p - center)  # (n, K)
        total = all_reduce_sum_(torch.stack([d.sum(dtype=torch.float64),
                                             torch.tensor(float(d.numel()), dtype=torch.float64, device=d.device)]))
        scale = max(float(total[0] / total[1]), 1e-12)  # the same bracket on every process
        lo, hi = math.log(scale * 1e-6), math.log(scale * 1e3)
        for _ in range(50):
            mid = 0.5 * (lo + hi)
            logq = torch.log_softmax(d * -math.exp(-mid), dim=1)
            h = torch.stack([-(logq.exp() * logq).sum(1).sum(dtype=torch.float64),
                             torch.tensor(float(d.shape[0]), dtype=torch.float64, device=d.device)])
            all_reduce_sum_(h)
            if float(h[0] / h[1]) > self.target_entropy:
                hi = mid
            else:
                lo = mid
        return math.exp(0.5 * (lo + hi))

    # ---- dead-code restart -------------------------------------------------------------------------------------
    @torch.no_grad()
    def _update_usage(self, counts: Tensor) -> None:
        if bool((self.usage < 0).any()):  # first batch: start from its counts
            self.usage.copy_(counts)
        else:
            self.usage.mul_(self.dead_code_decay).add_(counts, alpha=1.0 - self.dead_code_decay)

    @torch.no_grad()
    def _restart_dead_codes(self, z: Tensor) -> None:
        """Before a training step: prototypes whose running argmax count per batch fell below the threshold (the
        recipe's: at most a quarter of the mean tokens per code) move onto random tokens of this batch (before the
        forward pass, so no tensor saved for backward changes); their EMA statistics restart from that token."""
        if bool((self.usage < 0).any()):
            return
        threshold = self.dead_code_threshold
        if self._capped_threshold:
            threshold = min(threshold, 0.25 * float(self.usage.sum()) / self.num_codes)
        dead = restart_dead_codes_(self.prototypes.data, self.usage, z, threshold)
        if bool(dead.any()):
            self.ema_sum[dead] = self.prototypes.data[dead]
            self.ema_mass[dead] = 1.0
        self._restarts += int(dead.sum())


def _check_bool(name: str, value: Any) -> bool:
    if not isinstance(value, bool):
        raise ValueError(f"{name} must be True or False, got {value!r}")
    return value


def _check_unit(name: str, value: float) -> float:
    """A float strictly inside (0, 1)."""
    value_f = check_float(name, value)
    if not value_f < 1.0:
        raise ValueError(f"{name} must be in (0, 1), got {value!r}")
    return value_f
