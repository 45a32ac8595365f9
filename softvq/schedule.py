"""Temperature annealing for DDCL (DESIGN §2: cooling T keeps prototypes separated; T -> 0 is hard VQ)."""

from __future__ import annotations

import math
from typing import Literal

from softvq._utils import check_choice, check_float

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
