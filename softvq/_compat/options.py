"""Former option names: a recorded ``quantizer_kwargs`` or run setting upgraded to today's options, and a constructor's
former keyword refused with the option that replaced it.
"""

from __future__ import annotations

import functools
import inspect
from dataclasses import asdict, is_dataclass
from typing import Any

from torch import nn

from softvq._compat.state import shown_setting
from softvq.parts.temperature import DEFAULT_RATE

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
        parts.append(f"{name} was replaced by {replaced_by}; pass {option}={shown_setting(option, value)}")
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
