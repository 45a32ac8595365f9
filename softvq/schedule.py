"""Temperature control for DDCL (docs/design.md, "Temperature, initialisation, restarts": cooling T keeps prototypes
separated; T -> 0 is hard VQ).

Two ways: :func:`anneal_temperature`, a schedule over the run's progress, and :func:`adapt_temperature`, a feedback
rule that keeps the assignments' entropy H(Q) at a target, i.e. ties T to the current distance scale. The rule itself
lives in ``softvq/parts/temperature.py`` (:func:`softvq.parts.temperature.entropy_control_factor`), with the
temperature of a DDCL layer (:class:`softvq.parts.TemperatureControl`); this is its form on Python floats. A VQ-VAE
applies both to layers that do not hold their own ``T`` through subclasses of that part
(``softvq/models/_temperature.py``).
"""

from __future__ import annotations

import math
from typing import Literal

from softvq._checks import check_choice, check_float
from softvq.parts.temperature import entropy_control_factor

Schedule = Literal["constant", "linear", "cosine", "exponential"]
SCHEDULES: tuple[str, ...] = ("constant", "linear", "cosine", "exponential")


def anneal_temperature(start: float, end: float, progress: float, schedule: Schedule = "exponential") -> float:
    """The temperature at ``progress`` in ``[0, 1]`` of an anneal from ``start`` to ``end``.

    - ``"constant"``: ``start`` throughout (``end`` is ignored);
    - ``"linear"``: ``start + (end - start) * progress``;
    - ``"cosine"``: ``end + (start - end) * (1 + cos(pi * progress)) / 2``;
    - ``"exponential"``: geometric, ``start * (end / start) ** progress`` (constant ratio per step, the usual
      choice for a quantity that spans orders of magnitude).

    ``progress`` outside ``[0, 1]`` is clamped, so a run extended past its schedule stays at ``end``.

    Example:
        >>> anneal_temperature(1.0, 0.01, 0.5, "exponential")
        0.1

    Raises:
        ValueError: non-positive or non-finite temperatures, a non-finite progress, an unknown schedule.
    """
    start = check_float("start", start)
    end = check_float("end", end)
    check_choice("schedule", schedule, SCHEDULES)
    if not math.isfinite(float(progress)):
        raise ValueError(f"progress must be a finite number, got {progress!r}")
    t = min(max(float(progress), 0.0), 1.0)
    if schedule == "constant":
        return start
    if schedule == "linear":
        return start + (end - start) * t
    if schedule == "cosine":
        return end + (start - end) * 0.5 * (1.0 + math.cos(math.pi * t))
    return start * (end / start) ** t


def adapt_temperature(temperature: float, entropy: float, target_entropy: float, rate: float = 0.01) -> float:
    """One step of entropy control: ``temperature * exp(rate * (target_entropy - entropy))``.

    ``entropy`` is the measured mean assignment entropy H(Q) in nats (:func:`softvq.assignment_entropy`). Above the
    target (assignments too soft for the current distance scale) T falls, below it T rises, by at most a factor
    ``exp(rate * |error|)`` per step. H(Q) depends on the distances only through ``d / T``, so this holds the
    number of prototypes that share a token (about ``exp(target_entropy)``) fixed while the codebook tightens.

    Example:
        >>> round(adapt_temperature(4.0, entropy=3.0, target_entropy=2.5, rate=0.1), 4)
        3.8049

    Raises:
        ValueError: a non-positive or non-finite temperature or rate, or a non-finite or negative entropy/target.
    """
    temperature = check_float("temperature", temperature)
    rate = check_float("rate", rate)
    entropy = check_float("entropy", entropy, allow_zero=True)
    target_entropy = check_float("target_entropy", target_entropy, allow_zero=True)
    return temperature * entropy_control_factor(entropy, target_entropy, rate)  # the rule: softvq/parts/temperature.py
