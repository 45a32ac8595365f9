"""What a :class:`~softvq.models.VQVAE` does to its DDCL codebooks' temperature: the one place of the model side.

A DDCL layer with the default recipe holds its own ``T`` (``softvq/parts/temperature.py``: ``TemperatureControl``,
calibrated on the first training batch, then held at the layer's target entropy) and the model leaves it alone. For
the layers that do not control their own (a hierarchy, ``recipe="plain"``, checkpoints from before the in-layer
recipe) the model sets ``T`` in one of two ways:

- a schedule (``temperature_schedule``, ``softvq/schedule.py``: :func:`softvq.anneal_temperature`) from the
  quantizer's initial ``T`` to ``temperature_final`` over the run's optimizer steps (:func:`anneal_`);
- an entropy control (``target_entropy``, ``temperature_rate``; :func:`control_`): :func:`softvq.adapt_temperature`
  after every training step, whose rule is the layer's own (``softvq/parts/temperature.py``,
  ``entropy_control_factor``), applied on the host to each level's H(Q) averaged over processes.

A hierarchy's levels above 0 start on level 0's temperature scale (``softvq/models/_hierarchy.py``,
``match_temperatures_``).
"""

from __future__ import annotations

from collections.abc import Sequence

from torch import Tensor, nn

import softvq
from softvq._checks import check_choice, check_float
from softvq.models.bottleneck import DDCL_TARGET_ENTROPY
from softvq.schedule import SCHEDULES, anneal_temperature


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
    model.temperature_start = getattr(model._codebooks()[0], "temperature", None)
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


def anneal_(model: nn.Module) -> None:
    """Before a training batch: every codebook's ``T`` where the schedule puts it at this optimizer step (nothing with
    the constant schedule)."""
    if model.temperature_schedule == "constant":
        return
    total = max(int(model.trainer.estimated_stepping_batches) - 1, 1)
    temperature = anneal_temperature(
        model.temperature_start, model.temperature_final, model.global_step / total, model.temperature_schedule)
    for layer in model._codebooks():
        layer.temperature = temperature


def control_(model: nn.Module, entropies: Sequence[Tensor | None]) -> None:
    """Entropy-controlled temperature (:func:`softvq.adapt_temperature`) for the next step, each level its own,
    from this step's H(Q) per level (``entropies``) averaged over processes: the same ``T`` on every process."""
    trainer = model._trainer  # None when the step is called by hand
    for layer, level_entropy in zip(model._codebooks(), entropies, strict=True):
        if level_entropy is None:  # a level this step did not run
            continue
        mean_entropy = model.all_gather(level_entropy).mean() \
            if trainer is not None and trainer.world_size > 1 else level_entropy
        # the rule is the layer's own control's (softvq/parts/temperature.py, entropy_control_factor), on floats
        layer.temperature = softvq.adapt_temperature(
            layer.temperature, float(mean_entropy), model.target_entropy, model.temperature_rate)
