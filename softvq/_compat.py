"""Loading state dicts saved by earlier versions of the layers: the one place that maps an old layout to today's.

Each layer's ``_load_from_state_dict`` calls :func:`upgrade_state_dict` before loading, so a checkpoint saved before
the layers were composed of :mod:`softvq.parts` (its buffers at the layer's top level, under their former names)
loads into today's layer unchanged in value. Saving always writes today's layout.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

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


def become_plain(layer: nn.Module) -> None:
    """Switch a :class:`softvq.DDCLQuantizer` to the plain layer's settings (a checkpoint from before the recipe
    existed), so that it evaluates and trains on as it was trained: no standardisation, soft-centroid output,
    gradient-trained prototypes, a fixed temperature, no restarts."""
    layer.recipe = "plain"
    layer.standardize = layer.hard_output = False
    layer.prototype_update = "gradient"
    layer.prototypes.requires_grad_(True)
    layer.target_entropy = None
    layer.dead_code_threshold = 0.0
