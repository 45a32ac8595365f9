"""What earlier versions saved, brought to today's names: the one place that maps an old layout to the current one.

- State dicts: each layer's ``_load_from_state_dict`` calls one function here (:func:`upgrade_ddcl_state`,
  :func:`upgrade_hard_state`, :func:`upgrade_standardizer_state`), so a checkpoint saved before the layers were
  composed of :mod:`softvq.parts` (its buffers at the layer's top level, under their former names), before the in-layer
  recipe (``DDCLQuantizer`` version 1) or before the standardiser kept its applied statistics loads into today's layer
  unchanged in value.
- The extra state (:func:`read_ddcl_extra_state`): ``DDCLQuantizer``'s of any version, read.
- Settings in the state (:func:`check_state_settings`): the settings that change a layer's result (each layer's
  ``_settings()``, in plain values: :func:`settings_record`), recorded in its extra state and compared when a state
  loads; a state that predates them loads unchecked.
- Options: a model's recorded ``quantizer_kwargs`` (:func:`upgrade_quantizer_kwargs`, when a checkpoint is loaded) and a
  run's recorded settings (:func:`upgrade_settings`, when a run is resumed) take today's option names, and a setting
  a record predates counts as the value it had then (:data:`PREDATED`); a constructor given a former name refuses it
  with the option that replaced it (:func:`refuse_former_options`).

Saving always writes today's layout and names.
"""

from __future__ import annotations

import functools
import inspect
from collections.abc import Callable
from dataclasses import asdict, is_dataclass
from typing import Any

import torch
from torch import Tensor, nn

from softvq._checks import check_float
from softvq.parts.temperature import DEFAULT_RATE

# former top-level buffer name -> its place in today's parts (both layers' former vocabularies)
_RENAMED = {
    "usage": "dead_codes.usage",  # DDCLQuantizer and HardVQ
    "ema_mass": "ema.mass",  # DDCLQuantizer
    "ema_sum": "ema.weighted_sum",
    "ema_cluster_size": "ema.mass",  # HardVQ
    "ema_embed_sum": "ema.weighted_sum",
    "embedding": "prototypes",  # HardVQ's codes: one name for both layers
}


def upgrade_state_dict(state_dict: dict[str, Any], prefix: str) -> None:
    """Rename, in place, the keys under ``prefix`` that an earlier layout used (``prefix + "usage"`` becomes
    ``prefix + "dead_codes.usage"``, ...); a key already in today's layout is left alone."""
    for old, new in _RENAMED.items():
        if prefix + old in state_dict and prefix + new not in state_dict:
            state_dict[prefix + new] = state_dict.pop(prefix + old)


def upgrade_ddcl_state(state_dict: dict[str, Any], prefix: str, prototypes: Tensor, recipe: str,
                       fresh_standardizer: Callable[[], dict[str, Tensor]]) -> dict[str, Any]:
    """Bring a :class:`softvq.DDCLQuantizer` state dict (at ``prefix``) of any earlier version to today's layout, in
    place, for a layer of ``recipe`` whose ``prototypes`` are given (their shape and device); returns the settings
    the layer is to take (``{}``: none). ``fresh_standardizer()`` is the state dict of a new standardiser of the
    layer's ``dim`` (given by the layer: the standardiser loads its own state through this module).

    Version 1 (an extra state without ``"version"``) is a layer saved before the in-layer recipe existed, the plain
    layer: a layer of ``recipe="auto"`` takes the settings it was trained with (:data:`PLAIN_SETTINGS`, returned), so
    that evaluation, readout and the prior see the same codebook, and the keys version 1 lacks are completed (usage
    came late in it). A current state dict is loaded as it is: a key missing from it is an error under strict
    loading, naming it."""
    upgrade_state_dict(state_dict, prefix)
    extra = state_dict.get(prefix + "_extra_state")
    if not (isinstance(extra, dict) and "version" not in extra):
        return {}
    num_codes = prototypes.shape[0]
    state_dict.setdefault(prefix + "dead_codes.usage", torch.full((num_codes,), -1.0, device=prototypes.device))
    saved = state_dict.get(prefix + "prototypes", prototypes)
    state_dict.setdefault(prefix + "ema.mass", torch.ones(num_codes, device=prototypes.device))
    state_dict.setdefault(prefix + "ema.weighted_sum", saved.detach().clone())
    for name, value in fresh_standardizer().items():  # a fresh one: never used by version 1
        state_dict.setdefault(f"{prefix}standardizer.{name}", value)
    return dict(PLAIN_SETTINGS) if recipe == "auto" else {}


# The plain layer's settings (a checkpoint from before the recipe existed), in the order a layer takes them: it
# evaluates and trains on as it was trained, with no standardisation, soft-centroid output, gradient-trained
# prototypes, a fixed temperature and no restarts.
PLAIN_SETTINGS: dict[str, Any] = {"recipe": "plain", "standardize": False, "hard_output": False,
                                  "prototype_update": "gradient", "target_entropy": None, "restart": None}


def upgrade_hard_state(state_dict: dict[str, Any], prefix: str) -> None:
    """Bring a :class:`softvq.HardVQ` state dict (at ``prefix``) of any earlier layout to today's, in place: the
    former top-level names (:func:`upgrade_state_dict`), and an empty extra state for one saved before the settings
    were recorded (it loads unchecked)."""
    upgrade_state_dict(state_dict, prefix)
    state_dict.setdefault(prefix + "_extra_state", {})


def upgrade_standardizer_state(state_dict: dict[str, Any], prefix: str, std: Callable[[Tensor], Tensor]) -> None:
    """Complete, in place, a :class:`softvq.parts.TokenStandardizer` state dict (at ``prefix``) saved before the
    applied statistics were kept: evaluation starts from the running moments it used then (so the loaded layer
    evaluates as it did when saved; ``std`` is the part's scale of a variance) and follows training from there."""
    running_mean, running_var = state_dict.get(prefix + "running_mean"), state_dict.get(prefix + "running_var")
    if prefix + "applied_mean" not in state_dict and running_mean is not None:
        state_dict[prefix + "applied_mean"] = running_mean.clone()
    if prefix + "applied_var" not in state_dict and running_var is not None:
        state_dict[prefix + "applied_var"] = std(running_var).square()


def read_ddcl_extra_state(state: object) -> tuple[float | None, bool, int]:
    """A :class:`softvq.DDCLQuantizer` extra state of any version -> ``(temperature, initialized, restarts)``
    (``temperature`` ``None``: not calibrated); a state of version 1 has no restart count (0). The settings it records
    are checked before (:func:`check_state_settings`) and restore nothing. A ValueError for anything else (a
    checkpoint of another layer)."""
    if not isinstance(state, dict) or not {"temperature", "initialized"} <= state.keys():
        raise ValueError(f"DDCLQuantizer extra state must be a dict with 'temperature' and 'initialized' "
                         f"(from get_extra_state), got {state!r}; is the checkpoint from another layer?")
    t = state["temperature"]
    return None if t is None else check_float("temperature", t), bool(state["initialized"]), \
        int(state.get("restarts", 0))


# The first extra-state version of each layer that records its settings: an earlier state loads unchecked.
SETTINGS_VERSION = {"DDCLQuantizer": 3, "HardVQ": 1}


def settings_record(value: Any) -> Any:
    """A settings class as a mapping of its fields, tuples as lists: plain values that ``torch.load(...,
    weights_only=True)`` reads and that compare equal after a round trip (what a layer's ``_settings()`` records)."""
    if is_dataclass(value):
        value = asdict(value)
    if isinstance(value, dict):
        return {k: settings_record(v) for k, v in value.items()}
    return list(value) if isinstance(value, tuple) else value


# How a recorded setting's mapping of fields is shown: the settings class that has those fields.
_SETTINGS_CLASSES = {"standardize": "Standardize", "restart": "Restart", "target_entropy": "EntropyControl",
                     "commitment_weight": "Commitment", "init": "NormalInit"}


def _shown(name: str, value: Any) -> str:
    """A setting's value as code that passes it (``softvq.parts.Ema(decay=0.9, soft=False)`` for a mapping of Ema's
    fields); not checked, so that any recorded value can be shown."""
    if not isinstance(value, dict):
        return repr(value)
    cls = _SETTINGS_CLASSES.get(name) or ("Ema" if "decay" in value or "soft" in value else "Gradient")
    fields = ", ".join(f"{k}={tuple(v) if isinstance(v, list) else v!r}" for k, v in value.items())
    return f"softvq.parts.{cls}({fields})"


def check_state_settings(layers: dict[str, tuple[str, dict[str, Any]]], state_dict: dict[str, Any],
                         prefix: str) -> None:
    """Refuse a state dict (loaded at ``prefix``) in which a layer was saved with other settings than it has now:
    ``layers`` maps each layer's name in the loading module (``""``: the module itself) to its class name and its
    settings (its ``_settings()``: every :class:`softvq.DDCLQuantizer` and :class:`softvq.HardVQ`). A ``ValueError``
    names the layer's state entry and, for each setting that differs, the saved value and this layer's.

    Such a state's tensors mean something else under the layer's settings (EMA statistics under a gradient-trained
    codebook, prototypes of a standardised space under an unstandardised layer, ...): it would load without a word,
    the keys being the same, and compute something else. It is refused whether ``strict`` is ``True`` or ``False``
    (``strict`` is about which keys a state holds, as ``torch.nn.Module.load_state_dict`` still refuses a tensor of
    another shape without it), before any tensor of ``module`` is copied. A state that records no settings (saved
    before they were recorded, :data:`SETTINGS_VERSION`) loads as before. To load the tensors under other settings on
    purpose, delete the ``"settings"`` entry of the layer's ``_extra_state``. Containers (a residual stack, a hierarchy,
    a readout) call this for all their layers before loading the first one, so a refused file
    leaves them whole."""
    for name, (kind, now) in layers.items():
        key = f"{prefix}{name}._extra_state" if name else f"{prefix}_extra_state"
        extra = state_dict.get(key)
        if not isinstance(extra, dict) or "settings" not in extra:
            continue
        version = extra.get("version", 1)
        if not isinstance(version, int) or version < SETTINGS_VERSION.get(kind, 1):
            continue
        saved = extra["settings"]
        if not isinstance(saved, dict):
            raise ValueError(f"{kind} state {key!r} records settings that are not a mapping: {saved!r}; is the "
                             f"checkpoint from another layer?")
        differ = [option for option, value in now.items() if option in saved and saved[option] != value]
        if differ:
            listed = "; ".join(f"{option}: saved {_shown(option, saved[option])}, this layer "
                               f"{_shown(option, now[option])}" for option in differ)
            how = "; ".join(_assignment(option, saved[option]) for option in differ)
            raise ValueError(
                f"{kind} state {key!r} was saved by a layer with other settings: {listed}. Its tensors mean something "
                f"else under this layer's settings, so it is refused (with strict=False too). Build the layer with "
                f"the saved settings, or assign them to it before loading ({how}); to load the tensors under this "
                f"layer's settings regardless, delete the 'settings' entry of state_dict[{key!r}]")


def _assignment(option: str, value: Any) -> str:
    """How a setting is given its saved value, for :func:`check_state_settings`'s error: an assignment, or for the
    recipe (fixed once the layer is built) the constructor keyword."""
    shown = _shown(option, value)
    return f"a new layer with recipe={shown}" if option == "recipe" else f"layer.{option} = {shown}"


# Options renamed: (the quantizers that had it, its former name, today's name). HardVQ's ``beta`` is the commitment
# weight, which both layers now call ``commitment_weight``.
_RENAMED_OPTIONS = ((("hard", "rhard"), "beta", "commitment_weight"),)
# DDCLQuantizer options whose "the recipe's value" was None before it was "auto" (None now means off, and these have
# nothing to switch off): a record's None is "auto".
_AUTO_WAS_NONE = (("ddcl", "rddcl"), ("temperature", "standardize", "prototype_update", "hard_output",
                                      "dead_code_threshold"))
# Dead-code restart's flat options, before they became the fields of one ``restart`` option (softvq.parts.Restart).
# DDCL's: a threshold ("auto": 1, or 0 for the plain recipe; 0: off), the usage's decay and the cap. HardVQ's: a
# threshold alone (0 by default; 1 for ResidualHardVQ), its usage decayed at the layer's EMA decay (0.99 without EMA)
# and uncapped.
_FLAT_RESTART = ("dead_code_threshold", "dead_code_decay", "dead_code_cap")


# DDCLQuantizer's flat options of its two prototype updates, before ``prototype_update`` took an Ema or a Gradient.
_FLAT_UPDATE = ("ema_decay", "codebook_term", "codebook_weight")


def _update_of_flat(get: Any, kind: object) -> object:
    """The ``prototype_update`` (a mapping of :class:`softvq.parts.Ema`'s or :class:`~softvq.parts.Gradient`'s fields)
    that a record's update ``kind`` and flat options (``get(name, default)``) meant; a kind that is already a
    mapping is left as it is."""
    if kind == "auto":
        kind = "ema" if get("recipe", "auto") == "auto" else "gradient"
    if kind in ("ema", "soft_ema"):
        return {"decay": float(get("ema_decay", 0.99)), "soft": kind == "soft_ema"}
    if kind == "gradient":
        return {"term": get("codebook_term", "free_energy"), "weight": float(get("codebook_weight", 1.0))}
    return kind


def _commitment_of_flat(weight: object, term: object) -> object:
    """``commitment_weight`` for a record's weight and the former ``commitment_term`` beside it: a
    :class:`softvq.parts.Commitment` (as a mapping) for a term other than ``"hard"`` with a weight; else the weight (a
    weight of 0 had no term: "l_ols", the former default, was recorded there)."""
    return {"weight": float(weight), "term": term} if isinstance(weight, int | float) and weight > 0 and \
        term != "hard" else weight


def _entropy_of_flat(get: Any, rate: object) -> object:
    """``target_entropy`` for a record's target (``get("target_entropy", "auto")``) and the former ``temperature_rate``
    beside it: an :class:`softvq.parts.EntropyControl` (as a mapping) where the rate was not the default and acted (a
    control was on: not ``None``, nor the plain recipe's ``"auto"``); else the target as it was."""
    target = get("target_entropy", "auto")
    off = target is None or (target == "auto" and get("recipe", "auto") != "auto")
    return target if off or float(rate) == DEFAULT_RATE else {"target": target, "rate": float(rate)}


def _init_of_flat(init: object, scale: object) -> dict[str, Any]:
    """``{"init": ...}`` for a record's ``init`` and the former ``init_scale`` beside it: ``"normal"`` with its scale
    is a :class:`softvq.parts.NormalInit` (as a mapping); ``"data"`` had no use for the scale."""
    return {"init": {"scale": float(scale)} if init == "normal" else init}


def _restart_of_flat(kind: object, get: Any) -> dict[str, Any] | None:
    """The ``restart`` setting (a mapping of :class:`softvq.parts.Restart`'s fields, or ``None``) that a record's flat
    options (``get(name, default)``) meant for quantizer ``kind``."""
    if kind in ("ddcl", "rddcl"):
        threshold = get("dead_code_threshold", "auto")
        if threshold == "auto":
            threshold = 1.0 if get("recipe", "auto") == "auto" else 0.0
        decay, cap = get("dead_code_decay", "auto"), get("dead_code_cap", 0.25)
    else:
        threshold = get("dead_code_threshold", 1.0 if kind == "rhard" else 0.0)
        decay, cap = get("ema_decay", 0.99 if kind == "rhard" else None) or 0.99, None
    return None if not threshold else {"threshold": float(threshold), "decay": decay, "cap": cap}

# The standardiser's flat options, before ``standardize`` took a softvq.parts.Standardize. A run record (config.json,
# a checkpoint's hyperparameters) that predates ``renorm`` / ``renorm_clip`` trained with plain batch standardisation
# and Ioffe's clip (3, 5), the defaults then (PREDATED), not with today's; building a model from such a checkpoint
# takes today's (they act in training only).
_FLAT_STANDARDIZE = ("output_scale", "renorm", "renorm_clip")
PREDATED: dict[str, Any] = {"renorm": False, "renorm_clip": [3.0, 5.0]}
# ... and the defaults of the flat options when they were replaced (Standardize()'s fields then and now)
_FLAT_DEFAULTS: dict[str, Any] = {"renorm": True, "renorm_clip": [1.1, 0.1]}


def _standardize_of_flat(get: Any, standardize: object, predated: bool) -> object:
    """``standardize`` (``False``, or a mapping of :class:`softvq.parts.Standardize`'s fields) for a record's
    ``standardize`` (a bool or ``"auto"``: the recipe's) and the flat options beside it (``get(name, default)``; with
    ``predated``, an absent one had its :data:`PREDATED` value)."""
    on = standardize is True or (standardize == "auto" and get("recipe", "auto") == "auto")
    if not on:
        return False
    default = PREDATED if predated else _FLAT_DEFAULTS
    renorm, clip = get("renorm", default["renorm"]), get("renorm_clip", default["renorm_clip"])
    return {"renorm_clip": list(clip) if renorm else None, "output_scale": get("output_scale", "standardized")}


def _upgrade_options(kind: object, out: dict[str, Any], predated: bool) -> dict[str, Any]:
    """The options of one quantizer ``kind`` (its name, e.g. ``"hard"``), today's: former names renamed, DDCL's
    former ``None`` for "the recipe's value" as ``"auto"``, and the flat options that one option replaced (restart,
    prototype update, standardisation, commitment, entropy control, initialisation) as that option, a mapping of its
    fields where it has them. ``predated``: a run record, whose absent standardiser options had their former defaults
    (:data:`PREDATED`). ``out`` is changed in place and returned."""
    ddcl = kind in ("ddcl", "rddcl")
    for quantizers, old, new in _RENAMED_OPTIONS:
        if kind in quantizers and old in out and new not in out:
            out[new] = out.pop(old)
    quantizers, names = _AUTO_WAS_NONE
    if kind in quantizers:
        out.update({name: "auto" for name in names if name in out and out[name] is None})
    if "restart" not in out and any(name in out for name in _FLAT_RESTART):
        out["restart"] = _restart_of_flat(kind, out.get)
    if ddcl and any(name in out for name in _FLAT_UPDATE):
        out["prototype_update"] = _update_of_flat(out.get, out.get("prototype_update", "auto"))
    standardize = out.get("standardize", "auto")
    flat_standardize = any(name in out for name in _FLAT_STANDARDIZE) and not isinstance(standardize, dict)
    if kind == "ddcl" and (flat_standardize or (predated and standardize is True)):
        out["standardize"] = _standardize_of_flat(out.get, standardize, predated)
    if ddcl and "commitment_term" in out:
        out["commitment_weight"] = _commitment_of_flat(out.get("commitment_weight", 0.0), out["commitment_term"])
    if ddcl and "temperature_rate" in out:
        entropy = _entropy_of_flat(out.get, out["temperature_rate"])
        if isinstance(entropy, dict):  # else the target, as recorded, is the whole setting
            out["target_entropy"] = entropy
    if ddcl and "init_scale" in out:
        out.update(_init_of_flat(out.get("init", "data"), out["init_scale"]))
    for name in (*_FLAT_RESTART, *(_FLAT_UPDATE if ddcl else ()), *(_FLAT_STANDARDIZE if kind == "ddcl" else ()),
                 *(("commitment_term", "temperature_rate", "init_scale") if ddcl else ())):
        out.pop(name, None)
    return out


def upgrade_quantizer_kwargs(kind: object, kwargs: dict[str, Any] | None) -> dict[str, Any] | None:
    """``kwargs`` of quantizer ``kind`` (its name, e.g. ``"hard"``) in today's options (:func:`_upgrade_options`),
    settings classes as plain mappings (a checkpoint's hyperparameters load with ``weights_only``)."""
    if not kwargs:
        return kwargs
    out = _upgrade_options(kind, dict(kwargs), predated=False)
    return {name: asdict(value) if is_dataclass(value) else value for name, value in out.items()}


class FormerOptionError(TypeError, ValueError):
    """A keyword a layer took in earlier versions: a ``TypeError`` as Python's own for a keyword a function does not
    take, and a ``ValueError`` as the library's for an option it refuses."""


def former_option_error(kind: str, layer: str, kwargs: dict[str, Any], former: list[str]) -> FormerOptionError:
    """The error for keywords ``former`` of ``kwargs`` that a layer (``layer``, quantizer name ``kind``) took
    in earlier versions: each named with the option that replaced it (:data:`FORMER_OPTIONS`) and, where the former
    values say it (:func:`_upgrade_options`, the records' upgrade), that option as it would be passed."""
    try:
        today = _upgrade_options(kind, dict(kwargs), predated=False)
    except (TypeError, ValueError):  # a former value that no record could hold: name the option alone
        today = {}
    parts = []
    for name in former:
        replaced_by = FORMER_OPTIONS[kind][name]
        option, _, field = replaced_by.partition(".")
        value = today.get(option)
        if field and not (isinstance(value, dict) and field in value):  # the upgrade did not carry it (codebook_weight
            value = {field: kwargs[name]}  # beside an EMA update, ...): the field alone, in the class that has it
        parts.append(f"{name} was replaced by {replaced_by}; pass {option}={_shown(option, value)}")
    given = ", ".join(f"{name}={kwargs[name]!r}" for name in former)
    return FormerOptionError(f"{layer} got {given}, an option of earlier versions: {'; '.join(parts)}")


def refuse_former_keywords(kind: str, owner: str, kwargs: dict[str, Any], accepted: set[str] | list[str]) -> None:
    """Refuse the keywords of ``kwargs`` that quantizer ``kind`` took in earlier versions (:data:`FORMER_OPTIONS`) and
    that are not ``accepted`` now: a :class:`FormerOptionError` (:func:`former_option_error`) naming ``owner``, the
    layer given them."""
    former = [name for name in kwargs if name in FORMER_OPTIONS[kind] and name not in accepted]
    if former:
        raise former_option_error(kind, owner, kwargs, former)


def refuse_former_options(kind: str) -> Any:
    """A decorator of a layer's ``__init__`` (quantizer name ``kind``: ``"ddcl"``, ``"hard"``): a keyword the
    layer took in earlier versions (:data:`FORMER_OPTIONS`) and takes no more is refused with the option that replaced
    it (:class:`FormerOptionError`, :func:`former_option_error`), not with Python's bare "unexpected keyword
    argument". The signature, as ``inspect`` and the command line's parser read it, is the ``__init__``'s own."""

    def decorate(init: Any) -> Any:
        accepted = set(inspect.signature(init).parameters)

        @functools.wraps(init)
        def checked(self: nn.Module, *args: Any, **kwargs: Any) -> None:
            refuse_former_keywords(kind, type(self).__name__, kwargs, accepted)
            init(self, *args, **kwargs)

        return checked

    return decorate


def upgrade_settings(flat: dict[str, Any]) -> dict[str, Any]:
    """Recorded settings as dotted keys (a run's config.json, or a checkpoint's hyperparameters) in today's options:
    each quantizer's section (``hard.beta`` becomes ``hard.commitment_weight``, and ``quantizer_kwargs.beta`` likewise
    when the record's quantizer is one that had it) upgraded as :func:`_upgrade_options` does, an option that became a
    settings class recorded field by field (``ddcl.restart.threshold``)."""
    out = dict(flat)
    named = out.get("quantizer")
    named = set(named) if isinstance(named, list) else {named}
    quantizers = ("ddcl", "rddcl", "hard", "rhard")
    for section, quantizer in [*((q, q) for q in quantizers), *(("quantizer_kwargs", q) for q in named
                                                               if q in quantizers)]:
        prefix = f"{section}."
        keys = [key for key in out if key.startswith(prefix)]
        options = _upgrade_options(quantizer, {key[len(prefix):]: out.pop(key) for key in keys}, predated=True)
        for name, value in options.items():
            if isinstance(value, dict):  # a settings class's fields (a dotted record holds no other mapping)
                out.update({f"{prefix}{name}.{field}": v for field, v in value.items()})
            else:
                out[f"{prefix}{name}"] = value
    return out


# A quantizer's former option names, as user input would spell them (a flag ``--ddcl.dead_code_threshold``, a key of a
# ``--config`` file), and the name that replaced each (dotted: a field of today's option). The commands refuse them
# with that name (softvq.cli.parsing); a run's record that has them is upgraded instead (upgrade_settings).
_FORMER_DDCL = {"dead_code_threshold": "restart.threshold", "dead_code_decay": "restart.decay",
                "dead_code_cap": "restart.cap", "ema_decay": "prototype_update.decay",
                "codebook_term": "prototype_update.term", "codebook_weight": "prototype_update.weight",
                "commitment_term": "commitment_weight.term", "temperature_rate": "target_entropy.rate",
                "init_scale": "init.scale"}
_FORMER_HARD = {"beta": "commitment_weight", "dead_code_threshold": "restart.threshold"}
FORMER_OPTIONS: dict[str, dict[str, str]] = {
    "ddcl": {**_FORMER_DDCL, "output_scale": "standardize.output_scale", "renorm": "standardize.renorm_clip",
             "renorm_clip": "standardize.renorm_clip"},
    "rddcl": dict(_FORMER_DDCL),  # ResidualDDCL sets its levels' standardisation itself (its own renorm options)
    "hard": dict(_FORMER_HARD),
    "rhard": dict(_FORMER_HARD),
}


# ---- models and commands (softvq.models, softvq.cli) ---------------------------------------------------------------
# A VQVAE's recorded quantizer_kwargs take today's names through upgrade_quantizer_kwargs (above); a run's recorded
# settings through upgrade_settings (above) and newer_settings; a CodePrior's recorded config and hyperparameters
# through upgrade_prior_config and upgrade_prior_hparams; a command's former flag names are FORMER_FLAGS, refused
# (never translated) by softvq.cli.


def upgrade_prior_config(config: dict[str, Any]) -> dict[str, Any]:
    """A :class:`softvq.models.CodePrior`'s recorded network config (its ``PriorConfig`` as a mapping) in today's
    fields: one saved before the null class existed has no ``null_class`` and no such start token (``False``)."""
    return {"null_class": False, **config}


def upgrade_prior_hparams(hparams: dict[str, Any]) -> dict[str, Any]:
    """A :class:`softvq.models.CodePrior` checkpoint's hyperparameters in today's: its ``config``
    (:func:`upgrade_prior_config`) and ``soft_targets`` 0.0 (the hard codes alone) for one saved before the option."""
    out = {"soft_targets": 0.0, **hparams}
    if isinstance(out.get("config"), dict):
        out["config"] = upgrade_prior_config(out["config"])
    return out


def newer_settings(recorded: dict[str, Any], now: dict[str, Any], defaults: dict[str, Any],
                   same: Callable[[Any, Any], bool]) -> set[str]:
    """The dotted keys of ``now`` (a run's settings) that its record ``recorded`` predates (options newer than the
    run) and whose value in ``now`` is its default in ``defaults`` (compared by ``same``): what the run used without
    a setting for it, which the caller does not count as a change."""
    return {k for k in now.keys() - recorded.keys() if k in defaults and same(now[k], defaults[k])}


# Each command's flags before the shared convention (docs/training.md, "Commands and config files"), refused with
# the flag that replaced it by softvq.cli (softvq.cli._input.FormerFlags), never parsed: "renames" maps a former
# option to today's; "switches" a former on/off flag to the option that replaced it and the value it stood for
# (None: the new one is a flag too). softvq-train's are its quantizer sections' FORMER_OPTIONS as flags.
FORMER_FLAGS: dict[str, dict[str, dict[str, Any]]] = {
    "softvq-evaluate": {
        "renames": {"--data-root": "--data.data_root", "--batch-size": "--data.batch_size",
                    "--num-workers": "--data.num_workers", "--accelerator": "--trainer.accelerator"},
        "switches": {"--download": ("--data.download", "true"),
                     "--no-progress-bar": ("--trainer.progress_bar", "false")}},
    "softvq-prior": {
        "renames": {"--batch-size": "--batch_size", "--cache-dir": "--codes_cache", "--data-root": "--data.data_root",
                    "--train-subset": "--data.train_subset", "--val-size": "--data.val_size",
                    "--num-workers": "--data.num_workers", "--encode-batch-size": "--data.batch_size",
                    "--label-dropout": "--model.label_dropout", "--layers": "--model.layers",
                    "--heads": "--model.heads", "--dim": "--model.dim", "--mlp-ratio": "--model.mlp_ratio",
                    "--dropout": "--model.dropout", "--lr": "--model.lr", "--weight-decay": "--model.weight_decay",
                    "--warmup-steps": "--model.warmup_steps", "--min-lr-ratio": "--model.min_lr_ratio",
                    "--accelerator": "--trainer.accelerator", "--devices": "--trainer.devices",
                    "--num-nodes": "--trainer.num_nodes", "--strategy": "--trainer.strategy",
                    "--precision": "--trainer.precision"},
        "switches": {"--download": ("--data.download", "true"),
                     "--class-conditional": ("--model.class_conditional", "true"),
                     "--no-progress-bar": ("--trainer.progress_bar", "false")}},
    "softvq-sample": {
        "renames": {"--top-k": "--top_k", "--class": "--label"},
        "switches": {"--allow-other-vqvae": ("--allow_other_vqvae", None)}},
}


def former_flags(prog: str, sections: tuple[str, ...] = ()) -> dict[str, dict[str, Any]]:
    """Command ``prog``'s former flags (:data:`FORMER_FLAGS`; none for a command without), with the former option
    names of its quantizer ``sections`` as flags: ``--ddcl.dead_code_threshold`` was renamed
    ``--ddcl.restart.threshold`` (:data:`FORMER_OPTIONS`)."""
    table = FORMER_FLAGS.get(prog, {})
    renames = {**table.get("renames", {}), **{f"--{section}.{old}": f"--{section}.{new}" for section in sections
                                              for old, new in FORMER_OPTIONS.get(section, {}).items()}}
    return {"renames": renames, "switches": dict(table.get("switches", {}))}
