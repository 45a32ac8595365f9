"""DDCL soft codebook: global prototypes, Boltzmann soft assignments, the argmax code with the soft centroid's gradient.

The math is docs/design.md, "The layer: L_q = L_OLS + V" (arXiv 2604.03850). This file holds :class:`DDCLQuantizer`
whole: its options, its state and its forward pass, one method per step in the order they run (:meth:`forward`,
``_forward_tokens``, ``_codebook_space``, ``_pass_temperature``, ``_objective``, ``_output_codes``, ``_assemble``,
``_after_step``). Beside it:

- ``softvq/_soft_centroid.py``: the forward's core, one :class:`torch.autograd.Function`: one ``(N, D) x (D, K)``
  matmul, no ``(N, K, D)`` tensor, float32 (float64 for float64 input) under autocast, and *different* terms to the
  encoder and to the prototypes without recomputing the layer;
- the parts it holds (:mod:`softvq.parts`; docs/design.md, "Anatomy of the layer"), each a mechanism with its
  settings in one file: the token standardiser (``softvq/parts/standardize.py``), the temperature ``T`` and its
  entropy control (``softvq/parts/temperature.py``), the EMA prototypes (``softvq/parts/ema.py``), dead-code restart
  (``softvq/parts/restart.py``) and how the prototypes move (``softvq/parts/update.py``);
- ``softvq/_recipe.py``: each option's check, the recipe's values for the options left at ``"auto"``, and the
  attribute descriptors of the options; ``softvq/_replay.py``: a checkpointed forward's recomputation;
  ``softvq/_compat/``: checkpoints and extra states of earlier layouts (``state.py``).
"""

from __future__ import annotations

import warnings
from typing import Any, Literal

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from softvq import _compat
from softvq._checks import (
    check_bool,
    check_choice,
    check_finite_state,
    check_indices,
    check_positive_int,
    flatten_tokens,
)
from softvq._collectives import codes_from_tokens, is_distributed
from softvq._precision import FullPrecisionState, compute_dtype
from softvq._recipe import (
    COMMITMENT_TERMS,
    PartOption,
    check_commitment,
    check_distance,
    fixed_option,
    layer_option,
    resolve_hard_output,
    resolve_prototype_update,
    resolve_temperature,
    resolve_top_k,
    start_refusal,
)
from softvq._replay import ForwardRecord, ForwardRecords, in_backward, replayed_prototypes
from softvq._soft_centroid import Objective, _SoftCentroid
from softvq.parts._settings import is_auto
from softvq.parts.ema import EmaPrototypes
from softvq.parts.init import NormalInit, check_init
from softvq.parts.restart import DeadCodeRestart, Restart, code_counts
from softvq.parts.standardize import Standardize, TokenStandardizer
from softvq.parts.temperature import EntropyControl, TemperatureControl
from softvq.parts.update import TERMS as _TERMS  # noqa: F401 (importable from here)
from softvq.parts.update import Commitment, Ema, Gradient, prototype_update_of
from softvq.types import QuantizerOutput, channel_first_forward, empty_output, scatter_top_k


class DDCLQuantizer(FullPrecisionState):
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
    change the result (:meth:`_settings`), and loading one saved with other settings is refused, naming them, with
    ``strict=False`` too (:func:`softvq._compat.check_state_settings`); a state saved before they were recorded loads
    as before. docs/design.md, "Anatomy of the layer". A keyword of earlier versions
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
            ``log(K) / 2`` (the entropy of sqrt(K) prototypes sharing a token evenly), or with ``top_k=k``
            ``log(k) - 0.5`` when lower (a target the ``k`` codes can hold), following ``top_k`` when it is assigned;
            ``None`` for ``recipe="plain"``.
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
            (``"l_ols"``, to the soft centroid: a mean-shift step; why it is not the default: docs/design.md,
            "Collapse-free defaults").
        init: ``"data"``: random tokens of the first training batch (:meth:`init_from_data`); a
            :class:`softvq.parts.NormalInit` ``(scale)``: ``N(0, scale^2)`` (``"normal"``: ``NormalInit()``).
        restart: dead-code restart (:class:`softvq.parts.Restart`: a prototype that wins fewer than ``threshold`` tokens
            per training batch, on a running count, moves onto a random token); ``None``: never; ``"auto"``:
            ``Restart()`` (threshold 1, the count's decay scaled with the tokens per code, capped at a quarter of the
            mean tokens per code), ``None`` for ``recipe="plain"``.
        top_k: ``None``: the exact distribution over all ``K``; ``k``: truncated to each token's ``k`` nearest
            prototypes, exactly (``probs`` is ``(..., k)``, ``prob_codes`` says which; ``out.dense_probs(K)`` scatters
            them; docs/scaling.md, "Top-k assignments"); ``"auto"``: the recipe's, chosen per second of training
            (docs/scaling.md, "The default per codebook size"): exact up to K = 2048, 16 codes up to 8192, 32 above;
            ``None`` for ``recipe="plain"``.
        channel_first: accept ``(B, dim, *spatial)`` feature maps; ``quantized`` keeps their layout.
        check_finite: raise on NaN/Inf input (one device sync per call); skipped inside ``torch.compile``.

    Raises:
        ValueError: on invalid hyperparameters (settings that would overflow float32 in the first steps included:
            ``NormalInit``'s scale, a numeric ``output_scale``, a loss weight, a temperature, each bounded from
            float32's range), a wrong token dimension, non-finite input, or a state dict saved with other settings.
        TypeError: a keyword of earlier versions (a ``ValueError`` too), naming the option that replaced it.
    """

    # extra-state version: 1 (no key) = the plain layer before the in-layer recipe; 3: the settings recorded; 4: top_k
    # "auto" truncates large codebooks (a state of 2 or 3 loads into a layer of "auto" options as the exact layer)
    VERSION = 4

    @_compat.refuse_former_options("ddcl")  # a keyword of earlier versions: refused with its replacement
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
        top_k: int | Literal["auto"] | None = "auto",
        channel_first: bool = False,
        check_finite: bool = True,
    ) -> None:
        super().__init__()
        # The options the layer holds itself, each checked by its own rule (softvq._recipe), behind the properties
        # below; "auto" is the recipe's value.
        self._num_codes = check_positive_int("num_codes", num_codes)
        self._dim = check_positive_int("dim", dim)
        self._recipe = check_choice("recipe", recipe, ("auto", "plain"))
        auto = self._recipe == "auto"
        self._distance = check_distance(distance)
        weight, term = check_commitment(commitment_weight)
        self._commitment_weight, self._commitment_term = weight, term or "hard"  # a number: the "hard" term's weight
        self._init = check_init(init, self._dim)
        self._check_finite = check_bool("check_finite", check_finite)
        self._top_k = resolve_top_k(top_k, self._num_codes, auto)
        self._top_k_auto = is_auto(top_k)  # what a state of an earlier version meant by it (_load_from_state_dict)
        self._channel_first = check_bool("channel_first", channel_first)
        update = resolve_prototype_update(prototype_update, auto)  # an Ema or a Gradient
        start = resolve_temperature(temperature, self._dim)  # None: calibrated on the first training batch
        self._hard_output = resolve_hard_output(hard_output, auto)
        # The parts (softvq.parts; docs/design.md, "Anatomy of the layer"): each owns its settings and state, and
        # resolves its option's "auto" to the recipe's value itself.
        self.standardizer = TokenStandardizer.from_setting(self._dim, standardize,
                                                           auto=Standardize() if auto else False)
        self.temperature_control = TemperatureControl.from_options(  # T lives there; its "auto" target follows top_k
            self._num_codes, start, target_entropy, dim=self._dim, auto=auto, top_k=self._top_k)
        self.dead_codes = DeadCodeRestart(self._num_codes, restart, auto=Restart() if auto else None)
        scale = 1.0 if self._init == "data" else self._init.scale
        self.prototypes = nn.Parameter(torch.randn(self._num_codes, self._dim) * scale,  # (K, D)
                                       requires_grad=update.kind == "gradient")
        self.ema = EmaPrototypes(self.prototypes, update.decay if isinstance(update, Ema) else 0.99)
        # How the prototypes move (prototype_update): "ema", "soft_ema" or "gradient", what the forward does (a Python
        # string), and the Gradient's term and weight for optimizer-trained prototypes (None otherwise).
        self._update_kind: str = update.kind
        self._gradient: Gradient | None = update if isinstance(update, Gradient) else None
        # Python-side state (no device sync to read it, and torch.compile guards on it); saved by get_extra_state.
        self._initialized = self._init != "data"
        self._warned_start = False  # a batch that could not start the codebook has been reported
        # What each eager training forward read, for a recomputation during its backward (softvq._replay).
        self._records = ForwardRecords()

    # ---- options ----------------------------------------------------------------------------------------------
    # Each is checked on assignment by the constructor's own check and takes effect at the next call; those fixed when
    # the layer is built refuse assignment, saying how to get another value. The layer's own methods read the values
    # the properties hold (``self._distance``, ...), as they are: the properties are for its users.
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
    hard_output = layer_option("hard_output",
                               lambda layer, value: resolve_hard_output(value, layer.recipe == "auto"),
                               "Output the argmax code (``True``) or the soft centroid; assigning ``\"auto\"`` is the "
                               "recipe's.")
    commitment_term = layer_option("commitment_term",
                                   lambda layer, value: check_choice("commitment_term", value, COMMITMENT_TERMS),
                                   "The commitment term: ``\"hard\"`` (VQ-VAE's), ``\"l_ols\"``, ``\"l_q\"`` or "
                                   "``\"free_energy\"``.")
    check_finite = layer_option("check_finite", lambda layer, value: check_bool("check_finite", value),
                                "Raise on NaN/Inf input.")
    channel_first = layer_option("channel_first", lambda layer, value: check_bool("channel_first", value),
                                 "Take feature maps ``(B, dim, *spatial)``.")
    # held by the standardiser (softvq/parts/standardize.py), checked there
    output_scale = PartOption("standardizer", "output_scale")
    renorm = PartOption("standardizer", "renorm")
    temperature_rate = PartOption("temperature_control", "rate")  # checked by the part (below max_stable_rate(K))

    @property
    def commitment_weight(self) -> float:
        """The commitment term's weight (``>= 0``; at most 1.8e19). Assigning a number sets the weight and keeps the
        term (:attr:`commitment_term`); a :class:`softvq.parts.Commitment` sets both."""
        return self._commitment_weight

    @commitment_weight.setter
    def commitment_weight(self, value: float | Commitment) -> None:
        weight, term = check_commitment(value)
        self._commitment_weight = weight
        if term is not None:
            self._commitment_term = term

    @property
    def standardize(self) -> bool:
        """Whether the layer standardises its tokens (``True`` / ``False``). Assigning takes what the constructor
        takes, with its meaning: a :class:`softvq.parts.Standardize` sets the standardisation with its
        ``output_scale`` and ``renorm_clip`` (``True`` is ``Standardize()``, ``"auto"`` the recipe's), ``False``
        switches it off (the standardiser's :attr:`~softvq.parts.TokenStandardizer.settings`)."""
        return self.standardizer.on

    @standardize.setter
    def standardize(self, value: bool | Literal["auto"] | Standardize) -> None:
        self.standardizer.settings = value

    @property
    def top_k(self) -> int | None:
        """``None`` (all ``K`` codes) or ``k``: the assignments truncated to each token's ``k`` nearest codes.
        Assigning takes what the constructor takes (``"auto"``: the recipe's for this ``K``); an entropy target left
        at ``"auto"`` follows it (:func:`softvq.parts.temperature.auto_target_entropy`), a number stays."""
        return self._top_k

    @top_k.setter
    def top_k(self, value: int | Literal["auto"] | None) -> None:
        self._top_k = resolve_top_k(value, self._num_codes, self._recipe == "auto")
        self._top_k_auto = is_auto(value)
        if self.temperature_control.target_is_auto:  # the recipe's target for the new truncation, the rate kept
            self.temperature_control.set_target("auto", self._top_k)

    @property
    def target_entropy(self) -> float | None:
        """The H(Q) in nats the entropy control holds (``None``: ``T`` fixed). Assigning takes what the constructor
        takes: a number sets the target and keeps :attr:`temperature_rate`, a :class:`softvq.parts.EntropyControl`
        sets both, ``"auto"`` is the recipe's, ``None`` holds ``T`` (1.0 if not calibrated yet); checked against
        ``log K`` and the rate's stability bound."""
        return self.temperature_control.target_entropy

    @target_entropy.setter
    def target_entropy(self, value: float | Literal["auto"] | EntropyControl | None) -> None:
        self.temperature_control.set_target(value, self._top_k)

    @property
    def restart(self) -> Restart | None:
        """Dead-code restart's settings (a :class:`softvq.parts.Restart`, ``None``: off), held by the part
        ``dead_codes``; assigning goes to the part, as the constructor's option does (``"auto"``: the recipe's)."""
        return self.dead_codes.settings

    @restart.setter
    def restart(self, value: Restart | Literal["auto"] | None) -> None:
        self.dead_codes.settings = value

    @property
    def prototype_update(self) -> Ema | Gradient:
        """How the prototypes move: an :class:`softvq.parts.Ema` (its decay the ``ema`` part's) or the
        :class:`softvq.parts.Gradient` it was given. Assigning one (or ``"ema"``, ...; ``"auto"``: the recipe's)
        switches what the next call does, as the constructor would have set it up: the prototypes require gradients
        exactly for a :class:`~softvq.parts.Gradient` (an optimizer built before the switch holds them or not as it
        was built: rebuild its groups, :func:`softvq.param_groups`), and a switch from a
        :class:`~softvq.parts.Gradient` to an :class:`~softvq.parts.Ema` starts the EMA's statistics again at the
        current prototypes (one pseudo-token each, as a new layer's)."""
        return Ema(self.ema.decay, self._update_kind == "soft_ema") if self._gradient is None else self._gradient

    @prototype_update.setter
    def prototype_update(self, value: Literal["auto", "ema", "soft_ema", "gradient"] | Ema | Gradient) -> None:
        value = prototype_update_of(value, auto=Ema() if self.recipe == "auto" else Gradient())
        if isinstance(value, Ema) and self._update_kind == "gradient":  # stale statistics
            self.ema.reset_(self.prototypes.detach())
        self.prototypes.requires_grad_(value.kind == "gradient")
        self._gradient = value if isinstance(value, Gradient) else None
        if isinstance(value, Ema):
            self.ema.decay = value.decay
        self._update_kind = value.kind

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
        """What the layer saves besides its tensors: ``T`` (``None`` until calibrated), whether data initialisation
        ran, the restart count, the layout's :attr:`VERSION` and the settings that change its result
        (:meth:`_settings`; loading compares them, :func:`softvq._compat.check_state_settings`)."""
        return {"temperature": self.temperature, "initialized": self._initialized, "restarts": self.restarts,
                "version": self.VERSION, "settings": self._settings()}

    def set_extra_state(self, state: dict[str, Any]) -> None:
        temperature, initialized, restarts = _compat.read_ddcl_extra_state(state)  # any version, checked
        self.temperature_control.load(temperature)
        self._initialized = initialized
        self.dead_codes.restart_count.fill_(restarts)

    def _settings(self) -> dict[str, Any]:
        """The settings that change this layer's result (its outputs, loss or training), as its constructor takes
        them, in plain values (str, float, int, bool, None, lists and mappings of a settings class's fields): what its
        extra state records. A setting that acts on nothing is left out of its value (the rate of an entropy control
        that is off, the term of a commitment of weight 0), so that layers that compute alike compare equal. Not
        recorded: ``init`` (how the prototypes started: the state holds them), ``channel_first`` (the layout, not the
        values) and ``check_finite``."""
        standardize = self.standardizer.settings
        target, weight = self.target_entropy, self.commitment_weight
        return {
            "recipe": self.recipe,
            "distance": self.distance,
            "standardize": False if standardize is None else _compat.settings_record(standardize),
            "prototype_update": _compat.settings_record(self.prototype_update),
            "hard_output": self.hard_output,
            "commitment_weight": {"weight": weight, "term": self.commitment_term} if weight > 0 else 0.0,
            "target_entropy": None if target is None else {"target": target, "rate": self.temperature_rate},
            "restart": _compat.settings_record(self.restart),
            "top_k": self.top_k,
        }

    def _load_from_state_dict(self, state_dict: dict[str, Any], prefix: str, *args: Any, **kwargs: Any) -> None:
        # a state dict of an earlier layout, brought to today's; one saved before the recipe existed (the plain layer)
        # gives the settings it was trained with, which this layer takes so that it evaluates and trains on alike
        trained_with = _compat.upgrade_ddcl_state(state_dict, prefix, self.prototypes, self.recipe,
                                                  lambda: TokenStandardizer(self.dim).state_dict())
        if "recipe" in trained_with:  # fixed once built: set as the saved layer was built
            self._set_recipe(trained_with.pop("recipe"))
        trained_with.update(_compat.former_auto_settings(state_dict, prefix, self.num_codes, self.recipe,
                                                         self._top_k_auto, self.temperature_control.target_is_auto))
        for name, value in trained_with.items():
            setattr(self, name, value)
        _compat.check_state_settings({"": ("DDCLQuantizer", self._settings())}, state_dict, prefix)
        check_finite_state(state_dict, prefix, "DDCLQuantizer")
        super()._load_from_state_dict(state_dict, prefix, *args, **kwargs)

    def _set_recipe(self, recipe: str) -> None:
        """The recipe, and what ``"auto"`` means when a part's option is assigned it from now on."""
        self._recipe = recipe
        auto = recipe == "auto"
        self.standardizer.auto = Standardize() if auto else False
        self.dead_codes.auto = Restart() if auto else None
        self.temperature_control.auto_target = auto

    def extra_repr(self) -> str:
        """The options in effect (``temperature=auto`` until calibrated)."""
        t = "auto" if not self.temperature_control.ready else f"{self.temperature:g}"
        return (
            f"num_codes={self.num_codes}, dim={self.dim}, recipe={self.recipe!r}, temperature={t}, "
            f"target_entropy={self.target_entropy}, standardize={self.standardize}, "
            f"prototype_update={self.prototype_update}, hard_output={self.hard_output}, distance={self.distance!r}, "
            f"commitment={self.commitment_weight:g}*{self.commitment_term}, init={self.init!r}, "
            f"restart={self.restart}"
            + (f", top_k={self.top_k}" if self.top_k is not None else "")
        )

    # ---- codebook ---------------------------------------------------------------------------------------------
    @property
    def codebook(self) -> Tensor:
        """``(K, D)``, the codes as the layer outputs them in evaluation: the prototypes in the space of the
        distances (standardised; L2-normalised for cosine), on the output's scale (``output_scale``)."""
        p = self.prototypes.detach()
        p = F.normalize(p, dim=-1) if self._distance == "cosine" else p
        return self.standardizer.evaluation_output(p)

    def decode_indices(self, indices: Tensor) -> Tensor:
        """Map code indices ``(...)`` to their codes ``(..., D)`` (for ``channel_first``, ``(B, *spatial)`` to
        ``(B, D, *spatial)``): what :meth:`forward` outputs in evaluation with ``hard_output``."""
        check_indices(indices, self._num_codes)
        codes = F.embedding(indices.long(), self.codebook)
        return codes.movedim(-1, 1) if self._channel_first and codes.ndim > 2 else codes

    def get_output_from_indices(self, indices: Tensor) -> Tensor:
        """:meth:`decode_indices` under vector-quantize-pytorch's name (so is ``get_codes_from_indices``: no
        projection here, so the codes are the output)."""
        return self.decode_indices(indices)

    get_codes_from_indices = get_output_from_indices

    @torch.no_grad()
    def init_from_data(self, z: Tensor) -> None:
        """Set the prototypes to ``K`` random tokens of ``z (..., D)``, the encoder's output, standardised as the
        codebook will see them (with ``standardize``; :meth:`softvq.parts.TokenStandardizer.standardize`: the
        evaluation statistics once a training batch has set them, else ``z``'s own moments, as the first training
        batch will be standardised; no statistic changes). With fewer than ``K`` tokens, tokens are drawn with
        replacement and jittered by 1e-3 of their standard deviation so no two prototypes coincide. Under
        ``torch.distributed`` the tokens are drawn from every process's ``z`` together
        (:func:`softvq._collectives.codes_from_tokens`): every process gets the same prototypes, the ones a single
        process would draw from the concatenated batches."""
        flat = flatten_tokens(z, self._dim, check_finite=True)
        if flat.shape[0] == 0 and not is_distributed():
            raise ValueError("init_from_data needs at least one token, got an empty tensor")
        if self.standardize:
            flat = self.standardizer.standardize(flat.to(compute_dtype(flat.dtype)))
        self._init_from_tokens(flat)

    @torch.no_grad()
    def _init_from_tokens(self, flat: Tensor) -> None:
        """:meth:`init_from_data` on validated tokens ``(N, D)``, without a synchronisation in one process: the
        prototypes (and their EMA) become ``K`` tokens drawn by :func:`softvq._collectives.codes_from_tokens`."""
        chosen = codes_from_tokens(flat, self._num_codes, self.prototypes.dtype)
        if chosen is None:
            raise ValueError("init_from_data needs at least one token, got an empty tensor")
        self.prototypes.copy_(chosen)
        self.ema.reset_(chosen)
        self._initialized = True

    # ---- forward: each step a method, in the order they run -------------------------------------------------------
    def forward(self, z: Tensor) -> QuantizerOutput:
        """Quantize tokens ``z (..., dim)`` (or feature maps ``(B, dim, *spatial)`` with ``channel_first``).

        Returns:
            :class:`~softvq.QuantizerOutput` with ``quantized`` (shape and dtype of ``z``), ``indices``, ``probs``
            (float32, or float64 for float64 input), scalar ``loss`` and ``terms``.
        """
        if self._channel_first:
            return channel_first_forward(self._forward_tokens, z, self._dim)
        return self._forward_tokens(z)

    def _forward_tokens(self, z: Tensor) -> QuantizerOutput:
        """:meth:`forward` on channel-last tokens ``z (..., D)``: the outline, each step a method below."""
        flat = flatten_tokens(z, self._dim, check_finite=self._check_finite)  # (N, D)
        if flat.shape[0] == 0:
            return empty_output(z, self._num_codes, self.prototypes,
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
        start = update and not (self._initialized and self.temperature_control.ready)
        deferred = start and not self._can_start(flat)
        with torch.autocast(device_type=z.device.type, enabled=False):
            zf, mean, std = self._codebook_space(flat.to(ctype), update, update and not deferred)
            p_raw = self.prototypes.to(ctype)
            if replay is not None:
                p_raw = replayed_prototypes(p_raw, replay)
            p = F.normalize(p_raw, dim=-1) if self._distance == "cosine" else p_raw
            temperature = self._pass_temperature(zf, p, replay, keep=update and not deferred)
            record = self._records.push(p_raw, temperature) if eager and update else None
            mu, q, indices, loss, stats, chosen = _SoftCentroid.apply(zf, p, temperature, self._objective(), record,
                                                                      self._top_k or 0,
                                                                      self._neighbour_table(p, update, replay))
            out, loss = self._output_codes(zf, p, mu, indices, loss, mean, std)
        if update and not deferred:
            soft = q.detach()
            if chosen.numel() > 0 and self._update_kind == "soft_ema":  # its M-step reads every code's column
                soft = scatter_top_k(soft, chosen, self._num_codes)
            self._after_step(zf.detach(), soft, indices, stats[3])  # stats: l_q, l_ols, v, entropy
        return self._assemble(z, out, q, indices, loss, stats, chosen)

    def _can_start(self, flat: Tensor) -> bool:
        """Whether a training batch ``flat (N, D)`` can start the codebook (:func:`softvq._recipe.start_refusal`);
        the first time one cannot, a warning says why."""
        why = start_refusal(flat, self._num_codes, self.target_entropy, self._check_finite)
        if why is not None and not self._warned_start:
            self._warned_start = True
            warnings.warn(f"DDCLQuantizer(num_codes={self._num_codes}): a training batch cannot start the codebook: "
                          f"{why}. It was used for its output only; the prototypes and the temperature start on the "
                          f"first training batch that can", stacklevel=4)
        return why is None

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
        if update_codebook and self.dead_codes.threshold > 0:  # before the forward: no tensor saved for backward moves
            dead = self.dead_codes.restart_(self.prototypes.data, zf.detach())
            self.ema.restart_(dead, self.prototypes.data, 1.0)  # a restarted code's EMA: one pseudo-token there
        if self._distance == "cosine":
            zf = F.normalize(zf, dim=-1)
        return zf, mean, std

    def _pass_temperature(self, zf: Tensor, p: Tensor, replay: ForwardRecord | None, keep: bool) -> Tensor:
        """The ``T`` (a ``()`` float64 tensor) this pass uses: the one the first pass read, for a recomputation
        (``replay``); else the ``temperature_control``'s (softvq/parts/temperature.py, where ``T`` lives), calibrated
        on ``zf`` over ``p`` while it has none (kept with ``keep``: a training batch that starts the codebook; an
        evaluation before it keeps nothing)."""
        control = self.temperature_control
        if replay is not None:
            return replay.temperature
        if control.ready:
            return control.temperature_t
        return control.calibrate(zf.detach(), p.detach(), keep=keep, top_k=self._top_k)

    def _neighbour_table(self, p: Tensor, update: bool, replay: ForwardRecord | None) -> Tensor | None:
        """A ``(K, r)`` table truncating each token's distribution to the row of its nearest prototype, or ``None``:
        the exact or ``top_k`` distribution (this layer's). A hook for the per-second candidates of eval/ (prototypes
        ``p`` of this pass; ``update``: a training step; ``replay``: a recomputation, which must see the same table)."""
        return None

    def _objective(self) -> Objective:
        """The terms the autograd function computes: the codebook term only for gradient-trained prototypes, the
        commitment term unless it is ``"hard"`` (added outside it, by :meth:`_output_codes`)."""
        soft_commitment = ("l_ols", 0.0) if self._commitment_term == "hard" else (self._commitment_term,
                                                                                  self._commitment_weight)
        gradient = self._gradient  # a Gradient for optimizer-trained prototypes, else None (no codebook term)
        return Objective(gradient.term if gradient else "free_energy", gradient.weight if gradient else 0.0,
                         *soft_commitment)

    def _output_codes(self, zf: Tensor, p: Tensor, mu: Tensor, indices: Tensor, loss: Tensor, mean: Tensor | None,
                      std: Tensor | None) -> tuple[Tensor, Tensor]:
        """The ``(N, D)`` output and the loss with the hard commitment term: the soft centroid ``mu``, or with
        ``hard_output`` the argmax prototype with ``mu``'s gradient; on the output's scale (the standardiser's
        :meth:`~softvq.parts.TokenStandardizer.output`, with its ``mean`` and ``std``)."""
        out = mu
        if self._hard_output or self._commitment_term == "hard":
            codes = F.embedding(indices, p.detach())  # (N, D) the argmax prototypes
            if self._hard_output:
                # the code in value, bit for bit (mu - sg(mu) is exactly 0), and the soft centroid's Jacobian
                out = codes + (mu - mu.detach())
            if self._commitment_term == "hard" and self._commitment_weight > 0:
                loss = loss + self._commitment_weight * F.mse_loss(zf, codes)
        return self.standardizer.output(out, mean, std), loss

    @staticmethod
    def _assemble(z: Tensor, out: Tensor, q: Tensor, indices: Tensor, loss: Tensor, stats: Tensor,
                  chosen: Tensor) -> QuantizerOutput:
        """The :class:`~softvq.QuantizerOutput` of tokens ``z (..., D)``: ``out``, ``indices`` and ``q`` reshaped to
        ``z``'s leading dimensions, and the detached terms from ``stats`` (``l_q``, ``l_ols``, ``v``, ``entropy``) with
        the identity's residual. Top-k: ``q`` is ``(N, k)``, the assignments of the prototypes ``chosen``, kept so
        (the caller asks for dense)."""
        lead = z.shape[:-1]
        l_q, l_ols, v, entropy = stats.unbind()
        sparse = chosen.numel() > 0
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

    @torch.no_grad()
    def _after_step(self, z: Tensor, q: Tensor, indices: Tensor, entropy: Tensor) -> None:
        """After a training forward: the usage for dead-code restart, the EMA prototype update and the temperature
        control, each with its statistics summed over processes (every process ends with the same state). No
        host-device synchronisation."""
        if self.dead_codes.threshold > 0 or self._update_kind == "ema":
            counts = code_counts(indices, self._num_codes, self.dead_codes.usage.dtype)
            if self.dead_codes.threshold > 0:
                self.dead_codes.update(counts)
        if self._update_kind == "ema":
            self.ema.step_(self.prototypes, z, indices=indices, counts=counts)
        elif self._update_kind == "soft_ema":  # the free-energy M-step, tokens weighted by their assignments
            self.ema.step_(self.prototypes, z, q=q)
        self.temperature_control.step(entropy, indices.numel())  # T's rule: softvq/parts/temperature.py
