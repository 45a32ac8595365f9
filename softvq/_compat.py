"""What earlier versions saved, brought to today's names: the one place that maps an old layout to the current one.

- State dicts: each layer's ``_load_from_state_dict`` calls :func:`upgrade_state_dict` (:func:`upgrade_ddcl_state_dict`
  for ``DDCLQuantizer``), so a checkpoint saved before the layers were composed of :mod:`softvq.parts` (its buffers at
  the layer's top level, under their former names) loads into today's layer unchanged in value.
- The extra state (:func:`ddcl_extra_state`, :func:`load_ddcl_extra_state`): what ``DDCLQuantizer`` saves besides its
  tensors (the temperature, whether data initialisation ran, the restart count, the layout's version), and its reading.
- Options: a model's recorded ``quantizer_kwargs`` (:func:`upgrade_quantizer_kwargs`, when a checkpoint is loaded) and a
  run's recorded settings (:func:`upgrade_settings`, when a run is resumed) take today's option names, and a setting
  a record predates counts as the value it had then (:data:`PREDATED`).

Saving always writes today's layout and names.
"""

from __future__ import annotations

from dataclasses import asdict, is_dataclass
from typing import Any

import torch
from torch import nn

from softvq._checks import check_float
from softvq.norm import Standardize
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


def upgrade_ddcl_state_dict(layer: nn.Module, state_dict: dict[str, Any], prefix: str) -> None:
    """Bring a :class:`softvq.DDCLQuantizer` state dict of any earlier version to today's layout, in place.

    Version 1 (an extra state without ``"version"``) is a layer saved before the in-layer recipe existed, the plain
    layer: ``layer`` switches to the settings it was trained with (:func:`become_plain`), so that evaluation, readout
    and the prior see the same codebook, and the keys version 1 lacks are completed (usage came late in it). A
    current state dict is loaded as it is: a key missing from it is an error under strict loading, naming it."""
    upgrade_state_dict(state_dict, prefix)
    extra = state_dict.get(prefix + "_extra_state")
    if not (isinstance(extra, dict) and "version" not in extra):
        return
    if layer.recipe == "auto":
        become_plain(layer)
    state_dict.setdefault(prefix + "dead_codes.usage", torch.full_like(layer.dead_codes.usage, -1.0))
    prototypes = state_dict.get(prefix + "prototypes", layer.prototypes)
    state_dict.setdefault(prefix + "ema.mass", torch.ones_like(layer.ema.mass))
    state_dict.setdefault(prefix + "ema.weighted_sum", prototypes.detach().clone())
    for name, value in type(layer.standardizer)(layer.dim).state_dict().items():  # a fresh one: never used by v1
        state_dict.setdefault(f"{prefix}standardizer.{name}", value)


def ddcl_extra_state(layer: nn.Module) -> dict[str, Any]:
    """What a :class:`softvq.DDCLQuantizer` saves besides its tensors (its ``get_extra_state``): the temperature (its
    ``temperature_control``'s ``T``, ``None`` until calibrated), whether data initialisation ran, the restart count
    and the layout's version (``layer.VERSION``; a state without one is version 1, the plain layer)."""
    return {"temperature": layer.temperature, "initialized": layer._initialized, "restarts": layer.restarts,
            "version": layer.VERSION}


def load_ddcl_extra_state(layer: nn.Module, state: dict[str, Any]) -> None:
    """Restore what :func:`ddcl_extra_state` saved (its ``set_extra_state``); a state of version 1 has no restart
    count. A ValueError for anything else (a checkpoint of another layer)."""
    if not isinstance(state, dict) or not {"temperature", "initialized"} <= state.keys():
        raise ValueError(f"DDCLQuantizer extra state must be a dict with 'temperature' and 'initialized' "
                         f"(from get_extra_state), got {state!r}; is the checkpoint from another layer?")
    t = state["temperature"]
    layer.temperature_control.load(None if t is None else check_float("temperature", t))
    layer._initialized = bool(state["initialized"])
    layer.dead_codes.restart_count.fill_(int(state.get("restarts", 0)))


def become_plain(layer: nn.Module) -> None:
    """Switch a :class:`softvq.DDCLQuantizer` to the plain layer's settings (a checkpoint from before the recipe
    existed), so that it evaluates and trains on as it was trained: no standardisation, soft-centroid output,
    gradient-trained prototypes, a fixed temperature, no restarts."""
    layer.recipe = "plain"
    layer.standardize = layer.hard_output = False
    layer.prototype_update = "gradient"
    layer.prototypes.requires_grad_(True)
    layer.target_entropy = None
    layer.restart = None


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


def _restart_of_flat(quantizer: object, get: Any) -> dict[str, Any] | None:
    """The ``restart`` setting (a mapping of :class:`softvq.parts.Restart`'s fields, or ``None``) that a record's flat
    options (``get(name, default)``) meant for quantizer ``quantizer``."""
    if quantizer in ("ddcl", "rddcl"):
        threshold = get("dead_code_threshold", "auto")
        if threshold == "auto":
            threshold = 1.0 if get("recipe", "auto") == "auto" else 0.0
        decay, cap = get("dead_code_decay", "auto"), get("dead_code_cap", 0.25)
    else:
        threshold = get("dead_code_threshold", 1.0 if quantizer == "rhard" else 0.0)
        decay, cap = get("ema_decay", 0.99 if quantizer == "rhard" else None) or 0.99, None
    return None if not threshold else {"threshold": float(threshold), "decay": decay, "cap": cap}

# The standardiser's flat options, before ``standardize`` took a softvq.parts.Standardize. A run record (config.json,
# a checkpoint's hyperparameters) that predates ``renorm`` / ``renorm_clip`` trained with plain batch standardisation
# and Ioffe's clip (3, 5), the defaults then (PREDATED), not with today's; building a model from such a checkpoint
# takes today's (they act in training only).
_FLAT_STANDARDIZE = ("output_scale", "renorm", "renorm_clip")
PREDATED: dict[str, Any] = {"renorm": False, "renorm_clip": [3.0, 5.0]}


def _standardize_of_flat(get: Any, standardize: object, predated: bool) -> object:
    """``standardize`` (``False``, or a mapping of :class:`softvq.parts.Standardize`'s fields) for a record's
    ``standardize`` (a bool or ``"auto"``: the recipe's) and the flat options beside it (``get(name, default)``; with
    ``predated``, an absent one had its :data:`PREDATED` value)."""
    on = standardize is True or (standardize == "auto" and get("recipe", "auto") == "auto")
    if not on:
        return False
    default = PREDATED if predated else {"renorm": True, "renorm_clip": list(Standardize().renorm_clip)}
    renorm, clip = get("renorm", default["renorm"]), get("renorm_clip", default["renorm_clip"])
    return {"renorm_clip": list(clip) if renorm else None, "output_scale": get("output_scale", "standardized")}


def _upgrade_options(quantizer: object, out: dict[str, Any], predated: bool) -> dict[str, Any]:
    """The options of one quantizer ``quantizer`` (its name, e.g. ``"hard"``), today's: former names renamed, DDCL's
    former ``None`` for "the recipe's value" as ``"auto"``, and the flat options that one option replaced (restart,
    prototype update, standardisation, commitment, entropy control, initialisation) as that option, a mapping of its
    fields where it has them. ``predated``: a run record, whose absent standardiser options had their former defaults
    (:data:`PREDATED`). ``out`` is changed in place and returned."""
    ddcl = quantizer in ("ddcl", "rddcl")
    for quantizers, old, new in _RENAMED_OPTIONS:
        if quantizer in quantizers and old in out and new not in out:
            out[new] = out.pop(old)
    quantizers, names = _AUTO_WAS_NONE
    if quantizer in quantizers:
        out.update({name: "auto" for name in names if name in out and out[name] is None})
    if "restart" not in out and any(name in out for name in _FLAT_RESTART):
        out["restart"] = _restart_of_flat(quantizer, out.get)
    if ddcl and any(name in out for name in _FLAT_UPDATE):
        out["prototype_update"] = _update_of_flat(out.get, out.get("prototype_update", "auto"))
    standardize = out.get("standardize", "auto")
    flat_standardize = any(name in out for name in _FLAT_STANDARDIZE) and not isinstance(standardize, dict)
    if quantizer == "ddcl" and (flat_standardize or (predated and standardize is True)):
        out["standardize"] = _standardize_of_flat(out.get, standardize, predated)
    if ddcl and "commitment_term" in out:
        out["commitment_weight"] = _commitment_of_flat(out.get("commitment_weight", 0.0), out["commitment_term"])
    if ddcl and "temperature_rate" in out:
        entropy = _entropy_of_flat(out.get, out["temperature_rate"])
        if isinstance(entropy, dict):  # else the target, as recorded, is the whole setting
            out["target_entropy"] = entropy
    if ddcl and "init_scale" in out:
        out.update(_init_of_flat(out.get("init", "data"), out["init_scale"]))
    for name in (*_FLAT_RESTART, *(_FLAT_UPDATE if ddcl else ()), *(_FLAT_STANDARDIZE if quantizer == "ddcl" else ()),
                 *(("commitment_term", "temperature_rate", "init_scale") if ddcl else ())):
        out.pop(name, None)
    return out


def upgrade_quantizer_kwargs(quantizer: object, kwargs: dict[str, Any] | None) -> dict[str, Any] | None:
    """``kwargs`` of quantizer ``quantizer`` (its name, e.g. ``"hard"``) in today's options (:func:`_upgrade_options`),
    settings classes as plain mappings (a checkpoint's hyperparameters load with ``weights_only``)."""
    if not kwargs:
        return kwargs
    out = _upgrade_options(quantizer, dict(kwargs), predated=False)
    return {name: asdict(value) if is_dataclass(value) else value for name, value in out.items()}


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
