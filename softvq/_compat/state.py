"""Checkpoints of earlier layouts: a layer's state dict and extra state brought to today's, and the settings a
state records checked against the layer that loads it (the layers' ``_load_from_state_dict``).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import asdict, is_dataclass
from typing import Any

import torch
from torch import Tensor

from softvq._checks import check_float

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


def former_auto_settings(state_dict: dict[str, Any], prefix: str, num_codes: int, recipe: str, top_k_auto: bool,
                         target_auto: bool) -> dict[str, Any]:
    """The settings a :class:`softvq.DDCLQuantizer` of ``recipe`` takes to load a state dict (at ``prefix``) of
    versions 2 and 3, saved before ``top_k="auto"`` truncated large codebooks (version 4): ``"auto"`` then meant
    the exact distribution and the entropy target ``log(K) / 2``. A layer that left ``top_k`` at ``"auto"``
    (``top_k_auto``) takes ``top_k=None`` (a target left at ``"auto"`` follows it); one that set ``top_k`` and left
    the target at ``"auto"`` (``target_auto``) takes ``log(K) / 2``. Anything else the state records is compared as
    it is (:func:`check_state_settings`)."""
    extra = state_dict.get(prefix + "_extra_state")
    version = extra.get("version") if isinstance(extra, dict) else None
    if recipe != "auto" or not isinstance(version, int) or version >= 4:
        return {}
    if top_k_auto:
        return {"top_k": None}
    return {"target_entropy": 0.5 * math.log(num_codes)} if target_auto and num_codes > 1 else {}


# The plain layer's settings (a checkpoint from before the recipe existed), in the order a layer takes them: it
# evaluates and trains on as it was trained, with no standardisation, soft-centroid output, gradient-trained
# prototypes, a fixed temperature and no restarts.
PLAIN_SETTINGS: dict[str, Any] = {"recipe": "plain", "top_k": None, "standardize": False, "hard_output": False,
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


def shown_setting(name: str, value: Any) -> str:
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
            listed = "; ".join(f"{option}: saved {shown_setting(option, saved[option])}, this layer "
                               f"{shown_setting(option, now[option])}" for option in differ)
            how = "; ".join(_assignment(option, saved[option]) for option in differ)
            raise ValueError(
                f"{kind} state {key!r} was saved by a layer with other settings: {listed}. Its tensors mean something "
                f"else under this layer's settings, so it is refused (with strict=False too). Build the layer with "
                f"the saved settings, or assign them to it before loading ({how}); to load the tensors under this "
                f"layer's settings regardless, delete the 'settings' entry of state_dict[{key!r}]")


def _assignment(option: str, value: Any) -> str:
    """How a setting is given its saved value, for :func:`check_state_settings`'s error: an assignment, or for the
    recipe (fixed once the layer is built) the constructor keyword."""
    shown = shown_setting(option, value)
    return f"a new layer with recipe={shown}" if option == "recipe" else f"layer.{option} = {shown}"
