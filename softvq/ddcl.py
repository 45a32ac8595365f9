"""DDCL soft codebook: global prototypes, Boltzmann soft assignments, the argmax code with the soft centroid's gradient.

Math (docs/design.md, "The layer: L_q = L_OLS + V"; arXiv 2604.03850). Tokens ``z_n``, prototypes ``p_k``,
temperature ``T``::

    d_nk  = ||z_n - p_k||^2                    (cosine: z and p L2-normalised first)
    q_nk  = softmax_k(-d_nk / T)               assignments, rows sum to 1
    mu_n  = sum_k q_nk p_k                     soft centroid (the output of recipe="plain"; the defaults output
                                               the argmax code in the standardised space, with mu_n's gradient)
    L_q   = mean_n sum_k q_nk d_nk             competitive loss
    L_OLS = mean_n ||z_n - mu_n||^2            reconstruction term
    V     = mean_n sum_k q_nk ||p_k - mu_n||^2 prototype variance, >= 0
    L_q   = L_OLS + V                          exact identity

The forward pass and its gradient are one :class:`torch.autograd.Function` (``softvq._soft_centroid``) so that
distances take one ``(N, D) x (D, K)`` matmul, no ``(N, K, D)`` tensor is ever built, everything runs in float32
(float64 for float64 input) under autocast, and the training objective can send *different* terms to the encoder
and to the prototypes without recomputing the layer (see :class:`DDCLQuantizer`). The in-layer recipe's options and
training-mode updates (temperature, EMA prototypes, dead-code restart) are the mixin ``softvq._recipe.InLayerRecipe``.
"""

from __future__ import annotations

import inspect
import warnings
from typing import Any, Literal

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from softvq._checks import (
    check_bool,
    check_choice,
    check_feature_maps,
    check_float,
    check_indices,
    check_positive_int,
    flatten_tokens,
)
from softvq._collectives import broadcast_, is_distributed, pick_tokens
from softvq._layer_state import LayerState
from softvq._precision import compute_dtype
from softvq._recipe import InLayerRecipe
from softvq._replay import ForwardRecords, in_backward, replayed_prototypes
from softvq._soft_centroid import _SoftCentroid
from softvq.norm import TokenStandardizer
from softvq.types import QuantizerOutput, empty_output, scatter_top_k

Term = Literal["l_q", "l_ols", "free_energy"]
CommitTerm = Literal["hard", "l_q", "l_ols", "free_energy"]
_TERMS = ("l_q", "l_ols", "free_energy")


class DDCLQuantizer(LayerState, InLayerRecipe, nn.Module):
    """DDCL differentiable codebook: a bank of ``num_codes`` global prototypes with Boltzmann soft assignments.

    Input: tokens ``z`` of shape ``(..., dim)`` (channel-last; all other dimensions are flattened), or with
    ``channel_first=True`` feature maps ``(B, dim, *spatial)``. Output: a :class:`~softvq.QuantizerOutput`.

    **The recipe is in the layer** (``recipe="auto"``, the default): ``DDCLQuantizer(num_codes=K, dim=D)`` trains
    collapse-free as the bottleneck of any model under any optimizer, with nothing else to set. Tokens are
    standardised per dimension (:class:`softvq.norm.TokenStandardizer`), so the encoder cannot shrink what the codebook
    sees; ``T`` is calibrated on the first training batch and then held at ``target_entropy`` by an entropy control
    (checkpointed with the layer); the prototypes follow the tokens they win by an EMA, a k-means step that does not
    depend on the optimizer; a prototype that wins too little is restarted on a token of the batch; and the output is
    the argmax code with the soft centroid's gradient ``(2/T) C_n`` (``quantized = mu + sg(p_argmax - mu)``), so the
    decoder learns on the codes it will be given. Each part, its option and how its default was chosen:
    docs/design.md, "The recipe inside the layer".

    ``recipe="plain"`` is the paper's layer as written: no standardisation, a fixed temperature (1.0 unless given),
    prototypes trained by the gradient (build the optimizer with :func:`softvq.param_groups`), the soft centroid
    ``mu = q P`` as output, no restarts. Every option below overrides its recipe value; an option set to a value other
    than its default where it has no effect (e.g. ``ema_decay`` with ``prototype_update="gradient"``) is a
    ``ValueError`` naming both options.

    **On an accelerator**: with ``check_finite=False`` a training step never synchronises the host with the device,
    and the layer compiles with ``torch.compile(fullgraph=True)``; docs/scaling.md, "Throughput".

    **What it returns** (:class:`~softvq.QuantizerOutput`): ``quantized``, the argmax code (``hard_output``) or the
    soft centroid, in the space ``output_scale`` names; in evaluation with ``hard_output`` it equals
    :meth:`decode_indices` of ``indices``. ``loss``, the codebook and commitment terms below: exactly 0 with the
    defaults (EMA prototypes take no codebook term, ``commitment_weight`` is 0), so adding it changes nothing.

    **Training steps beyond one forward and its backward.** Calling the layer several times before one backward
    (two views of a batch) gives each call the gradient of the state it read, eager and compiled (the temperature is
    never written in place, and the prototypes each call used are saved). Under activation checkpointing
    (``torch.utils.checkpoint`` around the layer or the encoder, reentrant or not) the forward pass recomputed during
    backward reproduces the first one bit for bit and changes no state (:mod:`softvq._replay`). With gradient
    accumulation every micro-batch is a training step of the layer: it is standardised with its own moments, moves
    the EMA prototypes, may restart codes and steps the temperature control. The layer's state (prototypes, EMA
    statistics, usage, the standardiser's running moments) stays float32 under ``.half()`` / ``.to(torch.bfloat16)``
    (float64 under ``.double()``; the temperature is always float64): its updates are steps below bf16 resolution.

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
        temperature: Boltzmann ``T > 0`` in units of squared (standardised) distance at the start, or ``"auto"`` (or
            ``None``): set on the first training batch from ``target_entropy`` (``recipe="auto"``; 1.0 for
            ``"plain"``). It is saved in the ``state_dict``; assigning it during training (``quantizer.temperature =
            t``, e.g. to anneal) switches the entropy control off, so that the assigned value sticks
            (:meth:`set_temperature`).
        recipe: ``"auto"`` (the defaults above) or ``"plain"``.
        target_entropy: the H(Q) in nats that the temperature control holds, ``None`` for a fixed ``T``; ``"auto"``:
            ``min(2.5, log(K) / 2)`` for ``recipe="auto"`` (about 12 prototypes share a token at K = 512), ``None``
            for ``"plain"``.
        temperature_rate: gain of the temperature control per step.
        standardize: standardise tokens inside the layer (``recipe`` default: on for ``"auto"``).
        output_scale: with ``standardize``, return codes in the standardised space the codebook lives in
            (``"standardized"``, the default: unit variance per dimension, whatever the encoder's scale) or on the
            input's scale (``"input"``: ``code * std + mean``, as a straight-through VQ returns them), or a number
            ``s``: the standardised code times ``s`` (the decoder sees codes of standard deviation ``s``). The scale
            the decoder sees sets how fast its first layer moves under Adam; docs/design.md, "Training to the end",
            has what each scale measured.
        renorm: with ``standardize``, train with batch renormalisation (the default;
            :class:`softvq.norm.TokenStandardizer`): tokens are standardised *in value* with the running moments
            (momentum 0.1), with batch standardisation's gradient, so that the per-dimension shift and scale of the
            tokens is not wholly invisible to the loss. The
            corrections are clipped tightly (``renorm_clip``), so that while the encoder moves fast training stays
            close to batch standardisation (what it measured: docs/design.md, "Batch renormalisation").
            ``False``: plain batch standardisation (inert without ``standardize``).
        renorm_clip: ``(r_max, d_max)``: batch renormalisation's corrections are clipped to ``r`` in
            ``[1 / r_max, r_max]`` and ``d`` in ``[-d_max, d_max]`` (:class:`softvq.norm.TokenStandardizer`). The
            default (1.1, 0.1) keeps each token's standardisation within 10% in scale and 0.1 standard deviations in
            shift of batch standardisation's (Ioffe's (3, 5) is looser; docs/design.md compares them).
        prototype_update: ``"ema"``, ``"soft_ema"`` or ``"gradient"`` (``recipe`` default: ``"ema"`` / ``"gradient"``).
        ema_decay: decay of the prototype update, in ``(0, 1)``.
        hard_output: output the argmax prototype (with the soft-centroid gradient) instead of the soft centroid
            (``recipe`` default: on for ``"auto"``).
        distance: ``"euclidean"`` or ``"cosine"`` (tokens and prototypes L2-normalised first; ``d = 2 - 2 cos``).
        codebook_term: ``"free_energy"``, ``"l_q"`` or ``"l_ols"``, the term whose gradient trains the prototypes
            (``prototype_update="gradient"``). ``free_energy`` ``F = -T log sum_k exp(-d_k / T)`` only attracts a
            prototype to its tokens (soft k-means); ``l_q`` pushes far prototypes away, which strands them under Adam.
        codebook_weight: its weight (``>= 0``).
        commitment_term: ``"hard"`` (``||z - sg[p_argmax]||^2``, VQ-VAE's commitment to the code, the default),
            ``"l_ols"`` (to the soft centroid), ``"l_q"`` or ``"free_energy"``: the term that pulls the encoder to the
            codebook when ``commitment_weight > 0`` (``"hard"`` and ``"l_ols"`` compared: docs/design.md,
            "Collapse-free defaults").
        commitment_weight: its weight (``>= 0``; default 0: committing to the *soft* centroid is a mean-shift step
            that pulled the tokens into few modes here).
        init: ``"data"`` copies random tokens of the first training batch into the prototypes; ``"normal"`` draws
            ``N(0, init_scale^2)``.
        init_scale: standard deviation of the ``"normal"`` initialisation.
        dead_code_threshold: restart a prototype whose running number of won tokens per batch (decay
            ``dead_code_decay``) is below this (capped by ``dead_code_cap``); 0 = never. ``"auto"`` (or ``None``): the
            recipe's, 1.0 for ``"auto"`` and 0 for ``"plain"``.
        dead_code_decay: decay of that running count, in ``(0, 1)``. ``"auto"`` (the default): 0.9, or longer when a
            batch has few tokens per code, so that the count remembers at least 64 tokens per code, up to 0.97
            (0.9 at K = 512 and 1024 with 8,192 tokens a batch, 0.969 at K = 4096, 0.97 at 16384; ``usage_decay``).
            A short memory at a large K restarts live codes whose count dipped by chance (docs/design.md,
            "Dead-code restart at large K").
        dead_code_cap: the threshold in effect never exceeds this fraction of the mean tokens per code per batch
            (0.25: with 64 tokens a batch for K = 256 codes, a threshold of 1 becomes 1/16), so that a batch too
            small to give every code a token does not restart live codes; ``None``: the threshold as given.
        top_k: ``None`` (the default): the exact Boltzmann distribution over all ``K`` prototypes. An integer ``k``:
            the distribution truncated to each token's ``k`` nearest prototypes (the softmax over their scores; the
            soft centroid, ``L_q = L_OLS + V`` and the Jacobian are those of the truncated distribution, exactly),
            which saves ``(N, k)`` assignments for the backward pass instead of ``(N, K)``. ``probs`` is then
            ``(..., k)`` and ``prob_codes`` says which codes (``out.dense_probs(K)`` scatters them into the dense
            ``(..., K)``, zero off the top ``k``); ``k >= K`` is the exact layer, dense ``probs``. How large ``k``
            must be for the truncation to stay below a given error is measured in docs/scaling.md ("Top-k
            assignments"): at the default entropy target about ``K / 4`` at K = 512 and ``K / 8`` at K = 4096.
        channel_first: accept ``(B, dim, *spatial)`` feature maps (like vector-quantize-pytorch's
            ``accept_image_fmap``); ``quantized`` has the input's layout, ``indices`` is ``(B, *spatial)`` and
            ``probs`` ``(B, *spatial, K)`` (``k`` under ``top_k``).
        check_finite: raise on NaN/Inf input (one device sync per call; disable in tuned GPU loops). Skipped inside
            ``torch.compile``, where the layer runs with no graph break (``fullgraph=True``) and no synchronisation.

    Raises:
        ValueError: on invalid hyperparameters, a wrong token dimension, or non-finite input.
    """

    VERSION = 2  # extra-state version: 1 (no key) = the plain layer before the in-layer recipe

    def __init__(
        self,
        num_codes: int,
        dim: int,
        temperature: float | Literal["auto"] | None = "auto",
        *,
        recipe: Literal["auto", "plain"] = "auto",
        target_entropy: float | Literal["auto"] | None = "auto",
        temperature_rate: float = 0.01,
        standardize: bool | None = None,
        output_scale: Literal["input", "standardized"] | float = "standardized",
        renorm: bool = True,  # training standardises in value with the running moments, clipped to the batch's
        renorm_clip: tuple[float, float] = (1.1, 0.1),  # within 10% in scale, 0.1 std in shift of the batch's own
        prototype_update: Literal["ema", "soft_ema", "gradient"] | None = None,
        ema_decay: float = 0.99,
        hard_output: bool | None = None,
        distance: Literal["euclidean", "cosine"] = "euclidean",
        codebook_term: Term = "free_energy",  # attraction only; l_q strands far prototypes under Adam
        codebook_weight: float = 1.0,
        commitment_term: CommitTerm = "hard",  # better than "l_ols" at weight 0.25 on validation (docs/design.md)
        commitment_weight: float = 0.0,  # soft commitment is mean-shift: it collapses the tokens into few modes
        init: Literal["data", "normal"] = "data",
        init_scale: float = 1.0,
        dead_code_threshold: float | Literal["auto"] | None = "auto",
        dead_code_decay: float | Literal["auto"] = "auto",
        dead_code_cap: float | None = 0.25,
        top_k: int | None = None,
        channel_first: bool = False,
        check_finite: bool = True,
    ) -> None:
        super().__init__()
        self.num_codes = check_positive_int("num_codes", num_codes)
        self.dim = check_positive_int("dim", dim)
        self.recipe = check_choice("recipe", recipe, ("auto", "plain"))
        self.distance = check_choice("distance", distance, ("euclidean", "cosine"))
        self.codebook_term = check_choice("codebook_term", codebook_term, _TERMS)
        self.commitment_term = check_choice("commitment_term", commitment_term, (*_TERMS, "hard"))
        self.codebook_weight = check_float("codebook_weight", codebook_weight, allow_zero=True)
        self.commitment_weight = check_float("commitment_weight", commitment_weight, allow_zero=True)
        self.init = check_choice("init", init, ("data", "normal"))
        init_scale = check_float("init_scale", init_scale)
        self.check_finite = check_bool("check_finite", check_finite)
        self.top_k = None if top_k is None else check_positive_int("top_k", top_k)
        self.channel_first = check_bool("channel_first", channel_first)
        self._set_recipe_options(recipe == "auto", temperature, standardize=standardize, output_scale=output_scale,
                                 hard_output=hard_output, prototype_update=prototype_update, ema_decay=ema_decay,
                                 target_entropy=target_entropy, temperature_rate=temperature_rate,
                                 dead_code_threshold=dead_code_threshold, dead_code_decay=dead_code_decay,
                                 dead_code_cap=dead_code_cap)
        self.standardizer = TokenStandardizer(dim, renorm=check_bool("renorm", renorm), renorm_clip=renorm_clip)
        self._refuse_inert_options(
            {"codebook_term": codebook_term, "codebook_weight": codebook_weight, "output_scale": output_scale,
             "renorm": renorm, "renorm_clip": self.standardizer.renorm_clip, "ema_decay": ema_decay,
             "temperature_rate": temperature_rate, "init_scale": init_scale,
             "dead_code_decay": dead_code_decay, "dead_code_cap": dead_code_cap, "commitment_term": commitment_term},
            _DEFAULTS)
        # Python-side state (no device sync to read it, and torch.compile guards on it); saved through
        # get_extra_state.
        self._initialized = init != "data"
        self._has_temperature = self._initial_temperature is not None
        self._warned_start = False  # a batch that could not start the codebook has been reported
        # Tensor state that training steps change (so that a step never waits on the host): the temperature and the
        # restart count. Not state-dict entries of their own: get_extra_state saves them as numbers, as before. The
        # temperature is float64 (the precision a Python float had; the distances see it in their compute dtype) and
        # is never written in place (softvq._recipe, InLayerRecipe.temperature_t).
        self.register_buffer("temperature_t", torch.tensor(self._initial_temperature or 1.0, dtype=torch.float64),
                             persistent=False)
        self.register_buffer("restart_count", torch.zeros((), dtype=torch.long), persistent=False)
        self.prototypes = nn.Parameter(torch.randn(num_codes, dim) * init_scale,  # (K, D)
                                       requires_grad=self.prototype_update == "gradient")
        # Running average of argmax assignments per training batch (for dead-code restart); -1 = no batch seen yet.
        self.register_buffer("usage", torch.full((num_codes,), -1.0))
        # EMA prototype update: won mass per code and the weighted sum of its tokens (one pseudo-token each).
        self.register_buffer("ema_mass", torch.ones(num_codes))
        self.register_buffer("ema_sum", self.prototypes.detach().clone())
        # What each eager training forward read, for a recomputation during its backward (softvq._replay).
        self._records = ForwardRecords()

    # ---- state (the temperature, the extra state and loading: softvq._layer_state) ---------------------------
    @property
    def initialized(self) -> bool:
        """False until data initialisation (``init="data"``) has run."""
        return self._initialized

    @property
    def renorm(self) -> bool:
        """Whether training standardises with batch renormalisation (the ``renorm`` option)."""
        return self.standardizer.renorm

    @property
    def restarts(self) -> int:
        """How many prototypes dead-code restart has moved so far (cumulative, saved in the ``state_dict``; reading it
        synchronises with the device)."""
        return int(self.restart_count)

    def extra_repr(self) -> str:
        t = "auto" if not self._has_temperature else f"{self.temperature:g}"
        return (
            f"num_codes={self.num_codes}, dim={self.dim}, recipe={self.recipe!r}, temperature={t}, "
            f"target_entropy={self.target_entropy}, standardize={self.standardize}, "
            f"prototype_update={self.prototype_update!r}, hard_output={self.hard_output}, "
            f"distance={self.distance!r}, codebook={self.codebook_weight:g}*{self.codebook_term}, "
            f"commitment={self.commitment_weight:g}*{self.commitment_term}, init={self.init!r}, "
            f"dead_code_threshold={self.dead_code_threshold:g}, dead_code_cap={self.dead_code_cap}"
            + (f", top_k={self.top_k}" if self.top_k is not None else "")
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
            mean, std = self.standardizer.evaluation_statistics()
            p = p * std.to(p.dtype) + mean.to(p.dtype)
        elif self.standardize and not isinstance(self.output_scale, str):
            p = p * self.output_scale
        return p

    def decode_indices(self, indices: Tensor) -> Tensor:
        """Map code indices ``(...)`` to their codes ``(..., D)`` (for ``channel_first``, ``(B, *spatial)`` to
        ``(B, D, *spatial)``): what :meth:`forward` outputs in evaluation with ``hard_output``."""
        check_indices(indices, self.num_codes)
        codes = F.embedding(indices.long(), self.codebook)
        return codes.movedim(-1, 1) if self.channel_first and codes.ndim > 2 else codes

    @torch.no_grad()
    def init_from_data(self, z: Tensor) -> None:
        """Set the prototypes to ``K`` random tokens of ``z (..., D)``, the tokens as the layer takes them (the
        encoder's output): with ``standardize`` they are first standardised as the codebook will see them
        (:meth:`softvq.norm.TokenStandardizer.standardize`: the evaluation statistics once a training batch has set
        them, else ``z``'s own moments, as the first training batch will be standardised; no statistic changes).

        With fewer than ``K`` tokens, tokens are drawn with replacement and jittered by 1e-3 of their standard
        deviation so no two prototypes coincide. Under ``torch.distributed`` the tokens are drawn from every process's
        ``z`` together (:func:`softvq.utils.pick_tokens`): every process gets the same prototypes, the ones a single
        process would draw from the concatenated batches.
        """
        flat = flatten_tokens(z, self.dim, check_finite=True)
        if flat.shape[0] == 0 and not is_distributed():
            raise ValueError("init_from_data needs at least one token, got an empty tensor")
        if self.standardize:
            flat = self.standardizer.standardize(flat.to(compute_dtype(flat.dtype)))
        self._init_from_tokens(flat)

    @torch.no_grad()
    def _init_from_tokens(self, flat: Tensor) -> None:
        """:meth:`init_from_data` on validated tokens ``(N, D)``, without a synchronisation in one process (the
        "drawn with replacement" test is on the token count, a shape, not on the values)."""
        k = self.num_codes
        with_replacement = []

        def draw(n: int) -> Tensor:
            with_replacement.append(n < k)
            return torch.randperm(n, device=flat.device)[:k] if n >= k else torch.randint(n, (k,), device=flat.device)

        chosen = pick_tokens(flat, draw)
        if chosen is None:
            raise ValueError("init_from_data needs at least one token, got an empty tensor")
        chosen = chosen.to(self.prototypes.dtype)
        if with_replacement[0]:  # fewer tokens than codes: jitter, so that no two prototypes coincide
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
            check_feature_maps(z, self.dim)
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
        # A training forward pass made during backward is a recomputation (activation checkpointing): it replays what
        # the first pass read and changes no state (softvq._replay). Under torch.compile the compiler recomputes
        # inside its own graph, and no Python runs in the backward pass.
        eager = self.training and not torch.compiler.is_compiling()
        recompute = eager and in_backward()
        replay = self._records.replay() if recompute else None
        update = self.training and not recompute
        # a batch that cannot start the codebook (initialise it, calibrate T) is used for its output only
        start = update and not (self._initialized and self._has_temperature)
        deferred = start and not self._can_start(flat)
        with torch.autocast(device_type=z.device.type, enabled=False):
            zf, mean, std = self._codebook_space(flat.to(ctype), update, update and not deferred)
            p_raw = self.prototypes.to(ctype)
            if replay is not None:
                p_raw = replayed_prototypes(p_raw, replay)
            p = F.normalize(p_raw, dim=-1) if self.distance == "cosine" else p_raw
            if replay is not None:
                temperature = replay.temperature
            elif self._has_temperature:
                temperature = self.temperature_t
            else:  # set by the first training batch; evaluation before it calibrates, keeps nothing
                temperature = self._calibrate_temperature(zf.detach(), p.detach())
                if update and not deferred:
                    self.temperature_t = temperature
                    self._has_temperature = True
            record = self._records.push(p_raw, temperature) if eager and update else None
            gradient = self.prototype_update == "gradient"
            mu, q, indices, loss, stats, chosen = _SoftCentroid.apply(
                zf, p, temperature,
                self.codebook_term, self.codebook_weight if gradient else 0.0,
                *self._soft_commitment(), record, self.top_k or 0,
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
            elif std is not None and not isinstance(self.output_scale, str):
                out = out * self.output_scale
        l_q, l_ols, v, entropy = stats.unbind()
        # top-k: ``q`` is (N, k), the assignments of the prototypes ``chosen``; kept so (the caller asks for dense)
        sparse = chosen.numel() > 0
        if update and not deferred:
            soft = q.detach()
            if sparse and self.prototype_update == "soft_ema":  # its M-step reads every code's (N, K) column
                soft = scatter_top_k(soft, chosen, self.num_codes)
            self._after_step(zf.detach(), soft, indices, entropy)
        residual = (l_q - l_ols - v).abs() / l_q.abs().clamp_min(torch.finfo(stats.dtype).tiny)
        terms = {"l_q": l_q, "l_ols": l_ols, "v": v, "identity_residual": residual, "entropy": entropy}
        return QuantizerOutput(
            quantized=out.to(z.dtype).reshape(z.shape),
            indices=indices.reshape(lead),
            probs=q.reshape(*lead, q.shape[-1]),
            loss=loss,
            terms=terms,
            prob_codes=chosen.reshape(*lead, chosen.shape[-1]) if sparse else None,
        )

    def _codebook_space(self, zf: Tensor, update: bool, update_codebook: bool) -> tuple[Tensor, Tensor | None,
                                                                                      Tensor | None]:
        """Tokens ``(N, D)`` in the compute dtype -> the tokens the distances see (standardised; L2-normalised for
        cosine) and the standardiser's ``mean`` and ``std`` (``None`` without ``standardize``). With ``update`` (a
        training step, not a recomputation) moves the standardiser's running statistics; with ``update_codebook``
        (such a step on a batch that can start the codebook) first initialises the prototypes from data and restarts
        dead codes, both on the standardised tokens."""
        mean = std = None
        if self.standardize:
            zf, mean, std = self.standardizer(zf, update=update)
        if not self._initialized:
            if update_codebook:
                self._init_from_tokens(zf.detach())
            elif not self.training:
                warnings.warn("DDCLQuantizer(init='data') runs in eval mode before a training batch initialised "
                              "its prototypes: it is using random placeholder prototypes", stacklevel=4)
        if update_codebook and self.dead_code_threshold > 0:
            self._restart_dead_codes(zf.detach())
        if self.distance == "cosine":
            zf = F.normalize(zf, dim=-1)
        return zf, mean, std

    def _soft_commitment(self) -> tuple[str, float]:
        """The commitment term the autograd function computes (``"hard"`` is added outside it)."""
        if self.commitment_term == "hard":
            return "l_ols", 0.0
        return self.commitment_term, self.commitment_weight


# The constructor's defaults, which an inert option is compared with (InLayerRecipe._refuse_inert_options).
_DEFAULTS: dict[str, Any] = {k: p.default for k, p in inspect.signature(DDCLQuantizer.__init__).parameters.items()}
