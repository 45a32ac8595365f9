"""DDCL soft codebook: global prototypes, Boltzmann soft assignments, the argmax code with the soft centroid's gradient.

The math is docs/design.md, "The layer: L_q = L_OLS + V" (arXiv 2604.03850). This file holds :class:`DDCLQuantizer`:
its options, state and codebook. The rest of the layer lives beside it:

- ``softvq/_ddcl_forward.py``: the forward pass, step by step;
- ``softvq/_soft_centroid.py``: its core, one :class:`torch.autograd.Function`: one ``(N, D) x (D, K)`` matmul, no
  ``(N, K, D)`` tensor, float32 (float64 for float64 input) under autocast, and *different* terms to the encoder and
  to the prototypes without recomputing the layer;
- the parts it holds (:mod:`softvq.parts`; docs/design.md, "Anatomy of the layer"): the temperature ``T`` and its
  entropy control (``softvq/parts/temperature.py``), the EMA prototypes, dead-code restart and the token standardiser
  (``softvq/norm.py``);
- ``softvq/_recipe.py``: the options, checked, and which the parts get; ``softvq/_compat.py``: the extra state and
  checkpoints of earlier layouts.
"""

from __future__ import annotations

import inspect
from typing import Any, Literal

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from softvq._checks import check_bool, check_choice, check_finite_state, check_indices
from softvq._compat import (
    check_state_settings,
    ddcl_extra_state,
    ddcl_settings,
    load_ddcl_extra_state,
    refuse_former_options,
    upgrade_ddcl_state_dict,
)
from softvq._ddcl_forward import evaluation_codes, forward_tokens, init_from_data
from softvq._precision import apply_keeping_precision
from softvq._recipe import (
    COMMITMENT_TERMS,
    LAYER_OPTIONS,
    PartOption,
    check_distance,
    check_options,
    check_output_scale_of,
    check_top_k,
    fixed_option,
    layer_option,
    options_repr,
    resolve_hard_output,
    set_commitment,
    set_renorm,
    set_restart,
    set_standardize,
    set_target_entropy,
)
from softvq._replay import ForwardRecords
from softvq._soft_centroid import Objective, _SoftCentroid  # noqa: F401 (both importable from here)
from softvq.norm import Standardize, TokenStandardizer
from softvq.parts.ema import EmaPrototypes
from softvq.parts.init import NormalInit
from softvq.parts.restart import DeadCodeRestart, Restart
from softvq.parts.temperature import EntropyControl, TemperatureControl
from softvq.parts.update import TERMS as _TERMS  # noqa: F401 (importable from here)
from softvq.parts.update import Commitment, Ema, Gradient, UpdateOption
from softvq.types import QuantizerOutput, channel_first_forward


class DDCLQuantizer(nn.Module):
    """DDCL differentiable codebook: a bank of ``num_codes`` global prototypes with Boltzmann soft assignments.

    Input: tokens ``(..., dim)`` (channel-last; other dimensions are flattened), or with ``channel_first=True`` feature
    maps ``(B, dim, *spatial)``. Output: a :class:`~softvq.QuantizerOutput`: ``quantized`` (the argmax code with the
    soft centroid's gradient ``(2/T) C_n``, or the soft centroid with ``hard_output=False``; in evaluation it equals
    :meth:`decode_indices` of ``indices``), ``indices``, ``probs`` (float32; float64 for float64 input), ``loss`` (the
    codebook and commitment terms: exactly 0 with the defaults) and detached ``terms``: ``l_q``, ``l_ols``, ``v``,
    ``identity_residual = |l_q - l_ols - v| / l_q`` (float rounding: the identity is exact) and ``entropy`` H(Q).

    **The recipe is in the layer** (``recipe="auto"``): ``DDCLQuantizer(K, D)`` trains collapse-free as the bottleneck
    of any model under any optimizer, with nothing else to set. Its parts (:mod:`softvq.parts`; docs/design.md,
    "Anatomy of the layer"): ``standardizer`` (tokens standardised per dimension), ``temperature_control`` (``T``,
    calibrated on the first training batch, then holding H(Q) at ``target_entropy``), ``ema`` (a k-means step) and
    ``dead_codes`` (restarts); what each does and how its default was chosen, and ``recipe="plain"``, the paper's
    layer: docs/design.md, "The recipe inside the layer". An explicit option overrides the recipe's. A mechanism's
    settings are one option (``restart``, ``standardize``, ``prototype_update``, ...: a settings class of
    :mod:`softvq.parts`), so no option is left to set that does nothing.

    Every option is also an attribute, checked on assignment by the constructor's own check and read by the next call
    (``quantizer.distance = "cosine"``, ``quantizer.standardize = Standardize(output_scale="input")``,
    ``quantizer.prototype_update = Gradient()``, ...); ``num_codes``, ``dim``, ``recipe`` and ``init`` are fixed when
    the layer is built, and assigning one says how to get another value. The state dict records the settings that
    change the result (:func:`softvq._compat.ddcl_settings`), and loading one saved with other settings is refused,
    naming them, with ``strict=False`` too (:func:`softvq._compat.check_state_settings`); a state saved before they
    were recorded loads as before. docs/design.md, "Anatomy of the layer". A keyword of earlier versions
    (``ema_decay``, ``dead_code_threshold``, ...) is refused with the option that replaced it.

    What reaches what (the codebook term: gradient-trained prototypes only; the commitment term: the encoder only):
    docs/design.md, "What reaches the encoder and what reaches the prototypes". Several calls before one backward,
    checkpointing, gradient accumulation, ``.half()`` and steps without a host-device synchronisation:
    docs/design.md, "Anatomy of the layer".

    Args:
        num_codes: ``K``, the number of prototypes.
        dim: ``D``, the token dimension.
        temperature: the starting ``T > 0``, in squared standardised distance, or ``"auto"``: calibrated on the first
            training batch to ``target_entropy`` (1.0 for ``recipe="plain"``). Assigning ``quantizer.temperature``
            switches the entropy control off (:meth:`set_temperature`).
        recipe: ``"auto"`` or ``"plain"``.
        target_entropy: the H(Q) in nats the control holds (its gain 0.01 per step; a
            :class:`softvq.parts.EntropyControl` ``(target, rate)`` for another); ``None``: ``T`` fixed; ``"auto"``:
            ``log(K) / 2`` (the entropy of sqrt(K) prototypes sharing a token evenly), ``None`` for ``recipe="plain"``.
        standardize: standardise tokens inside the layer (:class:`softvq.parts.TokenStandardizer`) as a
            :class:`softvq.parts.Standardize` ``(renorm_clip, output_scale)`` says: clipped batch renormalisation in
            training (``renorm_clip=None``: plain batch standardisation) and codes in the standardised space, on the
            input's scale or times a number; ``True``: ``Standardize()``; ``False``: none; ``"auto"``: the recipe's,
            ``Standardize()`` for ``recipe="auto"``, ``False`` for ``"plain"``.
        prototype_update: how the prototypes move: a :class:`softvq.parts.Ema` ``(decay, soft)``, moved by the layer
            (:class:`softvq.parts.EmaPrototypes`), or a :class:`softvq.parts.Gradient` ``(term, weight)``, trained by
            the optimizer on that term of the loss; ``"ema"`` (``Ema()``: a k-means step, decay 0.99), ``"soft_ema"``
            (``Ema(soft=True)``: the free-energy M-step), ``"gradient"`` (``Gradient()``: the free energy, weight 1)
            or ``"auto"``: the recipe's, ``"ema"`` / ``"gradient"`` for ``"plain"``.
        hard_output: output the argmax prototype with the soft centroid's gradient (``"auto"``: on for
            ``recipe="auto"``).
        distance: ``"euclidean"`` or ``"cosine"`` (tokens and prototypes L2-normalised; ``d = 2 - 2 cos``).
        commitment_weight: the weight (``>= 0``; 0: none) of VQ-VAE's commitment of each token to its argmax code,
            ``||z - sg[p_argmax]||^2``, or a :class:`softvq.parts.Commitment` ``(weight, term)`` for another term
            (``"l_ols"``, to the soft centroid: at weight 0.25 a mean-shift step that pulled the tokens into few modes;
            docs/design.md, "Collapse-free defaults").
        init: ``"data"``: random tokens of the first training batch (:meth:`init_from_data`); a
            :class:`softvq.parts.NormalInit` ``(scale)``: ``N(0, scale^2)`` (``"normal"``: ``NormalInit()``).
        restart: dead-code restart (:class:`softvq.parts.Restart`: a prototype that wins fewer than ``threshold`` tokens
            per training batch, on a running count, moves onto a random token); ``None``: never; ``"auto"``:
            ``Restart()`` (threshold 1, the count's decay scaled with the tokens per code, capped at a quarter of the
            mean tokens per code), ``None`` for ``recipe="plain"``.
        top_k: ``None``: the exact distribution over all ``K``; ``k``: truncated to each token's ``k`` nearest
            prototypes, exactly (``probs`` is ``(..., k)``, ``prob_codes`` says which; ``out.dense_probs(K)`` scatters
            them; docs/scaling.md, "Top-k assignments").
        channel_first: accept ``(B, dim, *spatial)`` feature maps; ``quantized`` keeps their layout.
        check_finite: raise on NaN/Inf input (one device sync per call); skipped inside ``torch.compile``.

    Raises:
        ValueError: on invalid hyperparameters (settings that would overflow float32 in the first steps included:
            ``NormalInit``'s scale, a numeric ``output_scale``, a loss weight, a temperature, each bounded from
            float32's range), a wrong token dimension, non-finite input, or a state dict saved with other settings.
        TypeError: a keyword of earlier versions (a ``ValueError`` too), naming the option that replaced it.
    """

    # extra-state version: 1 (no key) = the plain layer before the in-layer recipe; 3: the settings recorded
    VERSION = 3

    @refuse_former_options("ddcl")  # a keyword of earlier versions: refused with its replacement (softvq._compat)
    def __init__(
        self,
        num_codes: int,
        dim: int,
        temperature: float | Literal["auto"] = "auto",
        *,
        recipe: Literal["auto", "plain"] = "auto",
        target_entropy: float | Literal["auto"] | EntropyControl | None = "auto",
        standardize: bool | Literal["auto"] | Standardize = "auto",
        prototype_update: Literal["auto", "ema", "soft_ema", "gradient"] | Ema | Gradient = "auto",
        hard_output: bool | Literal["auto"] = "auto",
        distance: Literal["euclidean", "cosine"] = "euclidean",
        commitment_weight: float | Commitment = 0.0,
        init: Literal["data", "normal"] | NormalInit = "data",
        restart: Restart | Literal["auto"] | None = "auto",
        top_k: int | None = None,
        channel_first: bool = False,
        check_finite: bool = True,
    ) -> None:
        super().__init__()
        given = {name: value for name, value in locals().items() if name in _DEFAULTS}  # every option, as passed
        o = check_options(given)  # checked, with the recipe's values resolved (softvq._recipe)
        for name in LAYER_OPTIONS:  # the options the layer holds itself, behind the properties below
            setattr(self, f"_{name}", o[name])
        # The parts (softvq.parts; docs/design.md, "Anatomy of the layer"): each owns its options and state.
        self.standardizer = TokenStandardizer(dim, renorm=o["renorm"], renorm_clip=o["renorm_clip"])
        self.temperature_control = TemperatureControl(num_codes, o["temperature"], o["target_entropy"],
                                                      o["temperature_rate"], dim=dim)  # T lives there
        self.dead_codes = DeadCodeRestart(num_codes, threshold=0.0)  # no restarts unless restart sets them
        self.dead_codes.settings = o["restart"]
        scale = 1.0 if o["init"] == "data" else o["init"].scale
        update = o["prototype_update"]  # an Ema or a Gradient
        self.prototypes = nn.Parameter(torch.randn(num_codes, dim) * scale,  # (K, D)
                                       requires_grad=update.kind == "gradient")
        self.ema = EmaPrototypes(self.prototypes, update.decay if isinstance(update, Ema) else 0.99)
        self.prototype_update = update
        # Python-side state (no device sync to read it, and torch.compile guards on it); saved by get_extra_state.
        self._initialized = o["init"] != "data"
        self._warned_start = False  # a batch that could not start the codebook has been reported
        # What each eager training forward read, for a recomputation during its backward (softvq._replay).
        self._records = ForwardRecords()

    # ---- options ----------------------------------------------------------------------------------------------
    # Each is checked on assignment by the constructor's own check (softvq._recipe) and takes effect at the next call;
    # those fixed when the layer is built refuse assignment, saying how to get another value.
    num_codes = fixed_option("num_codes", "build a new DDCLQuantizer(num_codes, dim, ...): K sizes the prototypes and "
                             "every part's state", "``K``, the number of prototypes (fixed).")
    dim = fixed_option("dim", "build a new DDCLQuantizer(num_codes, dim, ...): D sizes the prototypes and the "
                       "standardiser's statistics", "``D``, the token dimension (fixed).")
    recipe = fixed_option("recipe", "it chose the values of the options left at 'auto' when the layer was built: "
                          "build a new DDCLQuantizer(..., recipe=...), or assign those options themselves "
                          "(standardize, prototype_update, target_entropy, restart, hard_output)",
                          "``\"auto\"`` or ``\"plain\"``, as built (fixed); an option assigned ``\"auto\"`` takes "
                          "its value.")
    init = fixed_option("init", "it acts when the layer is built (NormalInit draws the prototypes then; 'data' takes "
                        "the first training batch's tokens): to start the prototypes again call "
                        "init_from_data(tokens), or build a new DDCLQuantizer(..., init=...)",
                        "How the prototypes started (fixed): ``\"data\"`` or a :class:`softvq.parts.NormalInit`.")
    distance = layer_option("distance", lambda layer, value: check_distance(value),
                            "``\"euclidean\"`` or ``\"cosine\"``.")
    top_k = layer_option("top_k", lambda layer, value: check_top_k(value),
                         "``None`` (all ``K`` codes) or a positive integer: the assignments truncated to it.")
    hard_output = layer_option("hard_output",
                               lambda layer, value: resolve_hard_output(value, layer.recipe == "auto"),
                               "Output the argmax code (``True``) or the soft centroid; assigning ``\"auto\"`` is the "
                               "recipe's.")
    commitment_weight = property(lambda self: self._commitment_weight, set_commitment, doc=(
        "The commitment term's weight (``>= 0``; at most 1.8e19). Assigning a number sets the weight and keeps the "
        "term (:attr:`commitment_term`); a :class:`softvq.parts.Commitment` sets both."))
    commitment_term = layer_option("commitment_term",
                                   lambda layer, value: check_choice("commitment_term", value, COMMITMENT_TERMS),
                                   "The commitment term: ``\"hard\"`` (VQ-VAE's), ``\"l_ols\"``, ``\"l_q\"`` or "
                                   "``\"free_energy\"``.")
    check_finite = layer_option("check_finite", lambda layer, value: check_bool("check_finite", value),
                                "Raise on NaN/Inf input.")
    channel_first = layer_option("channel_first", lambda layer, value: check_bool("channel_first", value),
                                 "Take feature maps ``(B, dim, *spatial)``.")
    standardize = property(lambda self: self._standardize, set_standardize, doc=(
        "Whether the layer standardises its tokens (``True`` / ``False``). Assigning takes what the constructor "
        "takes, with its meaning: a :class:`softvq.parts.Standardize` sets the standardisation with its "
        "``output_scale`` and ``renorm_clip`` (``True`` is ``Standardize()``, ``\"auto\"`` the recipe's), ``False`` "
        "switches it off."))
    output_scale = layer_option("output_scale", check_output_scale_of, (
        "Codes in the standardised space (``\"standardized\"``), on the input's scale (``\"input\"``) or times a "
        "number (a standardising layer's; bounded so that the codes' squared distances fit in float32)."))
    renorm = property(lambda self: self.standardizer.renorm, set_renorm, doc=(
        "Training standardises with batch renormalisation (clip: ``standardizer.renorm_clip``), or plain batch "
        "standardisation; ``True`` only on a standardising layer."))
    target_entropy = property(lambda self: self.temperature_control.target_entropy, set_target_entropy, doc=(
        "The H(Q) in nats the entropy control holds (``None``: ``T`` fixed). Assigning takes what the constructor "
        "takes: a number sets the target and keeps :attr:`temperature_rate`, a :class:`softvq.parts.EntropyControl` "
        "sets both, ``\"auto\"`` is the recipe's, ``None`` holds ``T`` (1.0 if not calibrated yet); checked against "
        "``log K`` and the rate's stability bound."))
    temperature_rate = PartOption("temperature_control", "rate")  # checked by the part (below max_stable_rate(K))
    restart = property(lambda self: self.dead_codes.settings, set_restart, doc=(
        "Dead-code restart's settings (a :class:`softvq.parts.Restart`, ``None``: off; assigning ``\"auto\"`` is the "
        "recipe's)."))
    prototype_update = UpdateOption()  # an Ema (its decay the ema part's) or a Gradient (softvq.parts.update)

    # ---- state ------------------------------------------------------------------------------------------------
    @property
    def initialized(self) -> bool:
        """False until data initialisation (``init="data"``) has run."""
        return self._initialized

    @property
    def restarts(self) -> int:
        """How many prototypes dead-code restart has moved so far (cumulative, saved in the ``state_dict``; reading it
        synchronises with the device)."""
        return self.dead_codes.restarts

    @property
    def temperature(self) -> float | None:
        """The Boltzmann temperature ``T``, ``None`` until the first training batch sets it (the part
        ``temperature_control`` holds it). Reading it synchronises with the device: read it per epoch, not per step.
        Assigning it (``quantizer.temperature = t``, e.g. to anneal) is :meth:`set_temperature` ``(t)``."""
        return self.temperature_control.temperature

    @temperature.setter
    def temperature(self, value: float) -> None:
        self.set_temperature(value)

    def set_temperature(self, value: float, *, keep_control: bool = False) -> None:
        """Set ``T`` to ``value``; by default the entropy control is switched off (with a warning), so the value
        sticks; ``keep_control=True`` lets the control go on from there
        (:meth:`softvq.parts.TemperatureControl.set`)."""
        self.temperature_control.set(value, keep_control=keep_control, owner="DDCLQuantizer")

    def get_extra_state(self) -> dict[str, Any]:
        return ddcl_extra_state(self)  # T, initialized, restarts, version, settings (softvq._compat)

    def _settings(self) -> dict[str, Any]:
        """The settings that change this layer's result, as its extra state records them (softvq._compat)."""
        return ddcl_settings(self)

    def set_extra_state(self, state: dict[str, Any]) -> None:
        load_ddcl_extra_state(self, state)

    def _load_from_state_dict(self, state_dict: dict[str, Any], prefix: str, *args: Any, **kwargs: Any) -> None:
        upgrade_ddcl_state_dict(self, state_dict, prefix)  # a state dict of an earlier layout (softvq._compat)
        check_state_settings(self, state_dict, prefix)  # saved with other settings: refused (softvq._compat)
        check_finite_state(state_dict, prefix, "DDCLQuantizer")
        super()._load_from_state_dict(state_dict, prefix, *args, **kwargs)

    def _apply(self, fn: Any, recurse: bool = True) -> DDCLQuantizer:
        # .to(device) moves the state; .half(), .to(torch.bfloat16) and the like leave it in float32 (an EMA step is
        # below bf16 resolution, so the prototypes would stall); the temperature part keeps its float64 value.
        apply_keeping_precision(self, lambda: super(DDCLQuantizer, self)._apply(fn, recurse))
        return self

    def extra_repr(self) -> str:
        return options_repr(self)  # softvq._recipe

    # ---- codebook ---------------------------------------------------------------------------------------------
    @property
    def codebook(self) -> Tensor:
        """``(K, D)``, the codes as the layer outputs them in evaluation (see ``output_scale``)."""
        return evaluation_codes(self)  # softvq._ddcl_forward

    def decode_indices(self, indices: Tensor) -> Tensor:
        """Map code indices ``(...)`` to their codes ``(..., D)`` (for ``channel_first``, ``(B, *spatial)`` to
        ``(B, D, *spatial)``): what :meth:`forward` outputs in evaluation with ``hard_output``."""
        check_indices(indices, self.num_codes)
        codes = F.embedding(indices.long(), self.codebook)
        return codes.movedim(-1, 1) if self.channel_first and codes.ndim > 2 else codes

    def get_output_from_indices(self, indices: Tensor) -> Tensor:
        """:meth:`decode_indices` under vector-quantize-pytorch's name (so is ``get_codes_from_indices``: no
        projection here, so the codes are the output)."""
        return self.decode_indices(indices)

    get_codes_from_indices = get_output_from_indices

    @torch.no_grad()
    def init_from_data(self, z: Tensor) -> None:
        """Set the prototypes to ``K`` random tokens of ``z (..., D)``, the encoder's output, standardised as the
        codebook will see them (no statistic changes); fewer than ``K`` tokens are drawn with replacement and jittered,
        and under ``torch.distributed`` every process draws the same ones from all processes' ``z``
        (:func:`softvq._ddcl_forward.init_from_data`)."""
        init_from_data(self, z)  # softvq._ddcl_forward

    # ---- forward ----------------------------------------------------------------------------------------------
    def forward(self, z: Tensor) -> QuantizerOutput:
        """Quantize tokens ``z (..., dim)`` (or feature maps ``(B, dim, *spatial)`` with ``channel_first``).

        Returns:
            :class:`~softvq.QuantizerOutput` with ``quantized`` (shape and dtype of ``z``), ``indices``, ``probs``
            (float32, or float64 for float64 input), scalar ``loss`` and ``terms``.
        """
        if self.channel_first:
            return channel_first_forward(self._forward_tokens, z, self.dim)
        return self._forward_tokens(z)

    # The forward pass on channel-last tokens, step by step: softvq/_ddcl_forward.py.
    _forward_tokens = forward_tokens


# The constructor's options and defaults (``given`` in ``__init__`` is every option, as passed).
_DEFAULTS: dict[str, Any] = {k: p.default for k, p in inspect.signature(DDCLQuantizer.__init__).parameters.items()
                              if k != "self"}
