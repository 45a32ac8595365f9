"""The checkpointed state of :class:`softvq.DDCLQuantizer`: its temperature, its extra state, loading state dicts of
every version, and the precision of its state under ``.to()``.

:class:`LayerState` is a mixin of ``DDCLQuantizer`` (which owns the buffers; ``softvq._recipe.InLayerRecipe`` holds
the updates that change them in training).
"""

from __future__ import annotations

import warnings
from typing import Any

import torch
from torch import Tensor, nn

from softvq._checks import check_finite_state, check_float
from softvq._precision import apply_keeping_precision
from softvq.norm import TokenStandardizer


class LayerState:
    """The state part of :class:`softvq.DDCLQuantizer` (see there)."""

    # Set by DDCLQuantizer (here only to name what the methods below read and write).
    VERSION: int
    dim: int
    recipe: str
    target_entropy: float | None
    temperature_t: Tensor
    _has_temperature: bool
    _initialized: bool
    restart_count: Tensor
    prototypes: nn.Parameter
    usage: Tensor
    ema_mass: Tensor

    @property
    def temperature(self) -> float | None:
        """The Boltzmann temperature ``T`` (``None`` until the first training batch sets it).

        Assigning it (``quantizer.temperature = t``, e.g. to anneal) is :meth:`set_temperature` ``(t)``: ``T`` becomes
        ``t`` and stays there, so the entropy control is switched off (``target_entropy`` becomes ``None``, with a
        warning if it was on). Reading it copies the device's value to the host (a synchronisation on a GPU): read it
        per epoch, not per step.
        """
        return float(self.temperature_t) if self._has_temperature else None

    @temperature.setter
    def temperature(self, value: float) -> None:
        self.set_temperature(value)

    def set_temperature(self, value: float, *, keep_control: bool = False) -> None:
        """Set ``T`` to ``value``. With the entropy control on (``target_entropy`` set) it would bring ``T`` back
        toward its target within ~100 steps, so an assigned temperature would not stick: by default the control is
        switched off (``target_entropy = None``, with a warning); ``keep_control=True`` moves ``T`` and lets the
        control go on from there (a new starting point)."""
        value = check_float("temperature", value)
        if self.target_entropy is not None and not keep_control:
            warnings.warn(f"setting DDCLQuantizer.temperature switches its entropy control off (target_entropy was "
                          f"{self.target_entropy:g}, now None): T stays where it is set; pass keep_control=True to "
                          f"set_temperature to keep the control", stacklevel=3)
            self.target_entropy = None
        self._set_temperature(value)

    def _set_temperature(self, value: float) -> None:
        # a new tensor, not an in-place write (InLayerRecipe.temperature_t)
        self.temperature_t = torch.tensor(value, dtype=torch.float64, device=self.temperature_t.device)
        self._has_temperature = True

    def get_extra_state(self) -> dict[str, Any]:
        return {"temperature": self.temperature, "initialized": self._initialized, "restarts": self.restarts,
                "version": self.VERSION}

    def set_extra_state(self, state: dict[str, Any]) -> None:
        if not isinstance(state, dict) or not {"temperature", "initialized"} <= state.keys():
            raise ValueError(f"DDCLQuantizer extra state must be a dict with 'temperature' and 'initialized' "
                             f"(from get_extra_state), got {state!r}; is the checkpoint from another layer?")
        t = state["temperature"]
        if t is None:
            self._has_temperature = False
        else:
            self._set_temperature(check_float("temperature", t))
        self._initialized = bool(state["initialized"])
        self.restart_count.fill_(int(state.get("restarts", 0)))

    def _load_from_state_dict(self, state_dict: dict[str, Any], prefix: str, *args: Any, **kwargs: Any) -> None:
        extra = state_dict.get(prefix + "_extra_state")
        if isinstance(extra, dict) and "version" not in extra:
            # Version 1: a layer saved before the in-layer recipe existed, the plain layer. Switch this one to the
            # settings it was trained with, so that evaluation, readout and the prior see the same codebook, and
            # complete exactly the keys version 1 lacks (usage came late in it). A current state dict is loaded as it
            # is: a key missing from it is an error under strict loading, naming it.
            if self.recipe == "auto":
                self._become_plain()
            state_dict.setdefault(prefix + "usage", torch.full_like(self.usage, -1.0))
            prototypes = state_dict.get(prefix + "prototypes", self.prototypes)
            state_dict.setdefault(prefix + "ema_mass", torch.ones_like(self.ema_mass))
            state_dict.setdefault(prefix + "ema_sum", prototypes.detach().clone())
            for name, value in TokenStandardizer(self.dim).state_dict().items():  # a fresh one: never used by v1
                state_dict.setdefault(f"{prefix}standardizer.{name}", value)
        check_finite_state(state_dict, prefix, "DDCLQuantizer")
        super()._load_from_state_dict(state_dict, prefix, *args, **kwargs)

    def _apply(self, fn: Any, recurse: bool = True) -> LayerState:
        # .to(device) moves the state; .half(), .to(torch.bfloat16) and the like leave it in float32 (an EMA step is
        # below bf16 resolution, so the prototypes would stall), and the temperature keeps its float64 value.
        apply_keeping_precision(self, lambda: super(LayerState, self)._apply(fn, recurse),
                                float64=("temperature_t",))
        return self
