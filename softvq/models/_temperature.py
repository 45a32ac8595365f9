"""What a :class:`~softvq.models.VQVAE` does to its DDCL codebooks' temperature: the model side's mechanisms, each a
subclass of the layer's own :class:`softvq.parts.TemperatureControl`.

A DDCL layer with the default recipe holds its own ``T`` (its ``temperature_control``: calibrated on the first
training batch, then held at the layer's target entropy by :meth:`~softvq.parts.TemperatureControl.step` after each
training forward) and the model leaves it alone. For the layers that do not control their own (a hierarchy,
``recipe="plain"``, checkpoints from before the in-layer recipe) the model sets ``T`` by one of the mechanisms below.
At its first training step it puts the mechanism in place of the codebook's ``temperature_control``
(:meth:`ModelTemperature.take_over`): the same part, carrying the same ``T`` and the layer's own settings, so the
layer reads, saves and restores ``T`` as before, and the mechanism steps it:

- :class:`ScheduledTemperature` (``temperature_schedule``, ``temperature_final``): before each training batch, ``T``
  where :func:`softvq.anneal_temperature` puts it from the quantizer's initial ``T`` over the run's optimizer steps;
- :class:`ModelEntropyControl` (``target_entropy``, ``temperature_rate``): after each training step, the layer's
  entropy control rule (:func:`softvq.adapt_temperature`, whose factor is the layer's
  :func:`~softvq.parts.temperature.entropy_control_factor`) applied on the host to the level's H(Q) as the model
  measures it, averaged over processes.

A new model-side mechanism is one more subclass of :class:`ModelTemperature` here. A hierarchy's levels above 0 start
on level 0's temperature scale (``softvq/models/_hierarchy.py``, ``match_temperatures_``).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from torch import Tensor, nn

from softvq._checks import check_choice, check_float
from softvq.models.bottleneck import DDCL_TARGET_ENTROPY
from softvq.parts.temperature import TemperatureControl
from softvq.schedule import SCHEDULES, adapt_temperature, anneal_temperature


class ModelTemperature(TemperatureControl):
    """A codebook's temperature part while its model sets ``T``: a :class:`~softvq.parts.TemperatureControl` (its
    ``T``, calibration, the layer's own entropy control and their checks, unchanged) with the model's rule.

    The model calls :meth:`begin_step` before each training batch and :meth:`end_step`
    after each training step, with the H(Q) of the step; a subclass overrides the one its rule acts at (both do
    nothing here). Its settings are :attr:`settings`, a tuple: :meth:`take_over` compares them to reuse a part.
    """

    settings: tuple[Any, ...] = ()

    @classmethod
    def take_over(cls, layer: nn.Module, *settings: Any) -> ModelTemperature:
        """``layer``'s ``temperature_control`` as this mechanism with ``settings`` (the constructor's arguments after
        the part's own): the part itself if it already is, else a new one in its place, carrying its ``T`` (the
        same tensor, no copy), whether it is set, its starting value and the layer's own target, rate and meaning of
        ``"auto"``."""
        part = layer.temperature_control
        if type(part) is cls and part.settings == settings:
            return part
        # The constructor checks a starting T or a target to calibrate to: the part's, or any T (replaced below).
        start = part.initial if part.initial is not None or part.target_entropy is not None else 1.0
        new = cls(part.num_codes, start, part.target_entropy, part.rate, part.dim, *settings)
        new.initial, new.ready, new.temperature_t = part.initial, part.ready, part.temperature_t
        new.auto_target, new.target_is_auto = part.auto_target, part.target_is_auto
        layer.temperature_control = new.train(part.training)
        return new

    def begin_step(self, model: nn.Module) -> None:
        """Before a training batch of ``model`` (its ``global_step``, its ``trainer``)."""

    def end_step(self, entropy: float) -> None:
        """After a training step whose tokens had mean H(Q) ``entropy`` (nats, averaged over processes)."""


class ScheduledTemperature(ModelTemperature):
    """``T`` on a schedule: before each training batch, :func:`softvq.anneal_temperature` ``(start, final, progress,
    schedule)`` with ``progress`` the model's optimizer step over the run's last, assigned as :meth:`set` assigns it
    (switching the layer's own control off, with a warning, if it was on)."""

    def __init__(self, num_codes: int, temperature: float | None, target_entropy: float | None, rate: float,
                 dim: int | None, start: float, final: float, schedule: str) -> None:
        super().__init__(num_codes, temperature, target_entropy, rate, dim)
        self.settings = (start, final, schedule)

    def begin_step(self, model: nn.Module) -> None:
        start, final, schedule = self.settings
        total = max(int(model.trainer.estimated_stepping_batches) - 1, 1)  # the run's last optimizer step
        self.set(anneal_temperature(start, final, model.global_step / total, schedule), owner="DDCLQuantizer")


class ModelEntropyControl(ModelTemperature):
    """``T`` held at the model's ``target`` entropy: after each training step ``T <- T exp(rate (target - H))``
    (:func:`softvq.adapt_temperature`, the layer's rule on Python floats) with ``H`` the step's H(Q) as the model
    measures it, averaged over processes, so that every process sets the same ``T``. The layer's own control
    (:attr:`target_entropy`) is off."""

    def __init__(self, num_codes: int, temperature: float | None, target_entropy: float | None, rate: float,
                 dim: int | None, target: float, model_rate: float) -> None:
        super().__init__(num_codes, temperature, target_entropy, rate, dim)
        self.settings = (target, model_rate)

    def end_step(self, entropy: float) -> None:
        target, rate = self.settings
        self.set(adapt_temperature(self.temperature, entropy, target, rate), owner="DDCLQuantizer")


def check_settings(model: nn.Module, temperature_schedule: str, temperature_final: float | None,
                   target_entropy: float | str | None, temperature_rate: float) -> None:
    """Checks and sets ``model``'s ``temperature_schedule``, ``temperature_start`` (the quantizer's initial
    temperature), ``temperature_final``, the model-side ``target_entropy`` (as ``_target_entropy``) and
    ``temperature_rate``.

    Raises:
        ValueError: a schedule without ``temperature_final`` or a quantizer temperature, a model-side target for a
            layer that holds its own, or both a schedule and a target (naming the settings).
    """
    model.temperature_schedule = check_choice("temperature_schedule", temperature_schedule, SCHEDULES)
    # the model's mechanisms take the place of a temperature part: a codebook without one has no T for them to set
    parts = [getattr(layer, "temperature_control", None) for layer in model._codebooks()]
    model.temperature_start = parts[0].temperature if all(isinstance(p, TemperatureControl) for p in parts) else None
    if model.temperature_schedule != "constant":
        if model.temperature_start is None:
            raise ValueError(f"temperature_schedule={temperature_schedule!r} needs a quantizer with a temperature")
        if temperature_final is None:
            raise ValueError(f"temperature_schedule={temperature_schedule!r} needs temperature_final")
    model.temperature_final = None if temperature_final is None else check_float("temperature_final",
                                                                                  temperature_final)
    if target_entropy != "auto":
        target_entropy = None if target_entropy is None else check_float("target_entropy", target_entropy)
        if target_entropy is not None and layer_controls_temperature(model):
            raise ValueError("target_entropy: the DDCL layer controls its own temperature; set it with "
                             "quantizer_kwargs={'target_entropy': ...} (softvq-train: --ddcl.target_entropy)")
    model._target_entropy = target_entropy
    model.temperature_rate = check_float("temperature_rate", temperature_rate)
    if model.target_entropy is not None:
        if model.temperature_start is None:
            raise ValueError("target_entropy needs a quantizer with a temperature")
        if model.temperature_schedule != "constant":
            raise ValueError(f"target_entropy (entropy-controlled T) and temperature_schedule="
                             f"{temperature_schedule!r} both set the temperature; choose one")


def layer_controls_temperature(model: nn.Module) -> bool:
    """Whether a codebook of ``model`` holds its own entropy target (the default recipe)."""
    return any(getattr(layer, "target_entropy", None) is not None for layer in model._codebooks())


def target_entropy(model: nn.Module) -> float | None:
    """:attr:`VQVAE.target_entropy`: the model-side target, ``"auto"`` resolved (``DDCL_TARGET_ENTROPY`` for plain DDCL
    layers with a constant schedule that hold no target of their own, else ``None``)."""
    if model._target_entropy != "auto":
        return model._target_entropy
    plain = all(getattr(layer, "recipe", None) == "plain" for layer in model._codebooks())
    # a plain layer given its own target (quantizer_kwargs={"recipe": "plain", "target_entropy": ...}) holds T itself
    auto = (model.hparams.get("quantizer") == "ddcl" and model.temperature_schedule == "constant" and plain
            and not layer_controls_temperature(model))
    return DDCL_TARGET_ENTROPY if auto else None


def mechanism(model: nn.Module) -> list[ModelTemperature]:
    """The model-side temperature mechanism of each codebook, level 0 first, put in place on first use
    (:meth:`ModelTemperature.take_over`): a :class:`ScheduledTemperature` with a schedule, a
    :class:`ModelEntropyControl` with a model-side target, else none (an empty list: the layers hold their own)."""
    if model.temperature_schedule != "constant":
        cls, settings = ScheduledTemperature, (model.temperature_start, model.temperature_final,
                                               model.temperature_schedule)
    elif model.target_entropy is not None:
        cls, settings = ModelEntropyControl, (model.target_entropy, model.temperature_rate)
    else:
        return []
    return [cls.take_over(layer, *settings) for layer in model._codebooks()]


def begin_step_(model: nn.Module) -> None:
    """Before a training batch: each codebook's mechanism (:func:`mechanism`) at :meth:`ModelTemperature.begin_step`
    (a schedule's ``T`` for this optimizer step). Taking over before the first forward, not after it, leaves a
    compiled layer one graph, not one before and one after the part changed."""
    for part in mechanism(model):
        part.begin_step(model)


def end_step_(model: nn.Module, entropies: Sequence[Tensor | None]) -> None:
    """After a training step: each codebook's mechanism at :meth:`ModelTemperature.end_step` with this step's H(Q) of
    its level (``entropies``, level 0 first; ``None``: a level the step did not run, left alone) averaged over
    processes: the same ``T`` on every process (the model-side entropy control's for the next step)."""
    parts = mechanism(model)
    if not parts:
        return
    trainer = model._trainer  # None when the step is called by hand
    for part, level_entropy in zip(parts, entropies, strict=True):
        if level_entropy is None:
            continue
        mean_entropy = model.all_gather(level_entropy).mean() \
            if trainer is not None and trainer.world_size > 1 else level_entropy
        part.end_step(float(mean_entropy))
