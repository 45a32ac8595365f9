"""The Boltzmann temperature of a soft codebook: where ``T`` lives, how it starts and how it is held at an entropy.

:class:`TemperatureControl` owns ``T`` (a float64 tensor on the module's device), its calibration on the first
training batch (:func:`softvq.parts.calibration.calibrate_temperature`) and the entropy control after each training step
(``log T <- log T + rate (H* - H)``). That rule has one implementation, :func:`entropy_control_factor`, which both
:meth:`TemperatureControl.step` (on the device) and :func:`softvq.adapt_temperature` (on Python floats: the model-side
control of :class:`softvq.models.VQVAE`) call. The stability bound of the control is :func:`max_stable_rate`.
docs/design.md, "Anatomy of the layer", says which layer holds it; annealing schedules are ``softvq/schedule.py``.
"""

from __future__ import annotations

import functools
import math
import warnings
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Literal

import torch
from torch import Tensor

from softvq._checks import STANDARDIZED_MAX, check_float, check_positive_int
from softvq._collectives import all_reduce_sum_, is_distributed
from softvq._precision import FullPrecisionState
from softvq.parts._settings import from_mapping, is_auto
from softvq.parts.calibration import calibrate_temperature  # looked up here at each call (eval.bench_calibration)


@functools.lru_cache(maxsize=64)
def max_varentropy(num_codes: int) -> float:
    """The largest variance of ``-log q`` under ``q`` over distributions ``q`` on ``num_codes`` outcomes (0 for one).

    It is attained by one outcome of mass ``p`` and ``K - 1`` of mass ``(1 - p) / (K - 1)``, where it is
    ``p (1 - p) log((K - 1) p / (1 - p))^2``; maximised over ``p`` on a grid of its logit (0.44 for K = 2, 10.7 for
    K = 512, 24.5 for K = 16384)."""
    if num_codes < 2:
        return 0.0
    logit = torch.linspace(-40.0, 40.0, 200_001, dtype=torch.float64)
    p = torch.sigmoid(logit)
    return float((p * (1 - p) * (logit + math.log(num_codes - 1)).square()).max())


def entropy_control_factor(entropy: Tensor | float, target_entropy: float, rate: float) -> Tensor | float:
    """The entropy control's rule, its one implementation: one step is ``T <- T * factor`` with
    ``factor = exp(rate (target_entropy - entropy))``, so T falls while the assignments are softer than the target.

    ``entropy`` a tensor: ``torch.exp``, on its device, no host-device synchronisation
    (:meth:`TemperatureControl.step`); a Python float: ``math.exp`` (:func:`softvq.adapt_temperature`)."""
    error = rate * (target_entropy - entropy)
    return torch.exp(error) if isinstance(error, Tensor) else math.exp(error)


def max_stable_rate(num_codes: int) -> float:
    """The largest ``rate`` for which the entropy control is stable whatever the codebook and tokens.

    The control is ``log T <- log T + rate (H* - H(T))``. Near its fixed point an error ``e`` in ``log T`` becomes
    ``(1 - rate s) e`` with ``s = dH/dlog T``, which for Boltzmann assignments ``q ∝ exp(-d / T)`` is the variance of
    ``d / T`` under ``q`` (the heat capacity), that is the varentropy of ``q``, averaged over tokens. It is stable
    for ``0 < rate < 2 / s`` and ``s`` never exceeds :func:`max_varentropy` ``(K)``: the bound is ``2 / max_varentropy``
    (0.19 at K = 512, 0.082 at K = 16384); above it a codebook can make ``T`` oscillate with a growing amplitude."""
    v = max_varentropy(num_codes)
    return math.inf if v == 0 else 2.0 / v


DEFAULT_RATE = 0.01  # the entropy control's gain per step unless one is given


def check_entropy_control(num_codes: int, target_entropy: object, rate: object,
                          name: str = "target_entropy") -> tuple[float | None, float]:
    """``(target_entropy, rate)`` of an entropy control over ``num_codes`` codes, checked: the target ``None`` (no
    control) or a number of nats in ``(0, log K)`` (``log K`` is uniform assignments, which no ``T`` reaches; with one
    code there is no entropy to hold), and the rate a positive number below :func:`max_stable_rate` ``(K)`` (above it
    the control can make ``T`` oscillate with a growing amplitude). A ``ValueError`` naming the option and its value
    otherwise. The one check of both, for the constructor of :class:`TemperatureControl` and for assignments."""
    if target_entropy is not None and num_codes == 1:
        raise ValueError(f"{name}={target_entropy!r} cannot be held with num_codes=1: one code takes every token, so "
                         f"the assignment entropy is always 0; leave target_entropy at 'auto' (a fixed temperature) "
                         f"or None")
    target = None if target_entropy is None else check_float(name, target_entropy)
    if target is not None and not target < math.log(num_codes):
        raise ValueError(f"{name} must be below log(num_codes) = {math.log(num_codes):.4g} nats (uniform "
                         f"assignments), got {target_entropy!r}")
    rate_f = check_float("temperature_rate", rate)
    if not rate_f < max_stable_rate(num_codes):
        raise ValueError(f"temperature_rate={rate!r} is too large for the entropy control to be stable with "
                         f"num_codes={num_codes}: it must be below 2 / (the largest varentropy over {num_codes} codes) "
                         f"= {max_stable_rate(num_codes):.4g} (the default 0.01 is well below)")
    return target, rate_f


def min_temperature(dim: int | None = None) -> float:
    """The smallest temperature a layer of token dimension ``dim`` is given: its Boltzmann logits
    ``(2 z.p - |p|^2) / T`` of tokens and codes in the standardised space (coordinates within
    :data:`softvq._checks.STANDARDIZED_MAX`, so partial sums within ``16 D STANDARDIZED_MAX^2``, as
    :func:`softvq._checks.max_token_magnitude` counts them) stay finite in float32: ``16 D 2^32 / finfo(float32).max``
    (3.2e-27 at D = 16). Without ``dim``, the smallest normal float32 (below it ``1 / T`` itself overflows)."""
    finfo = torch.finfo(torch.float32)
    return finfo.tiny if dim is None else 16.0 * dim * STANDARDIZED_MAX**2 / finfo.max


def check_temperature(value: object, dim: int | None = None) -> float:
    """A temperature ``T`` set by hand (the constructor's or an assignment): a positive finite number, at least
    :func:`min_temperature` ``(dim)``; else a ``ValueError`` naming ``temperature``, ``value`` and the bound."""
    t = check_float("temperature", value)
    limit = min_temperature(dim)
    if t < limit:
        if dim is None:
            why = "the layer computes 1 / T in float32: T must be a normal float32"
        else:
            why = (f"the Boltzmann logits of {dim}-dimensional standardised codes (coordinates within 2^16), divided "
                   f"by T, must stay finite in float32: T >= 16 * {dim} * 2^32 / finfo(float32).max")
        raise ValueError(f"temperature={value!r} is too small: {why} = {limit:.3g}")
    return t


@dataclass(frozen=True)
class EntropyControl:
    """An entropy target with a gain of its own, as :class:`softvq.DDCLQuantizer`'s ``target_entropy`` takes it when
    the default gain (0.01 per step) will not do: ``target_entropy=EntropyControl(4.0, rate=0.05)``. A number alone is
    ``EntropyControl(number)``.

    Args:
        target: the H(Q) in nats to hold, or ``"auto"``: ``log(K) / 2``.
        rate: the control's gain per step (``T <- T exp(rate (target - H))``), below :func:`max_stable_rate` ``(K)``.
    """

    target: float | Literal["auto"] = "auto"
    rate: float = DEFAULT_RATE

    def __post_init__(self) -> None:
        if not is_auto(self.target):
            object.__setattr__(self, "target", check_float("target_entropy.target", self.target))
        object.__setattr__(self, "rate", check_float("target_entropy.rate", self.rate))

    @classmethod
    def of(cls, value: object) -> Any:
        """A mapping of the fields (a config file's) as an :class:`EntropyControl`; anything else as it is."""
        return from_mapping(cls, value, "target_entropy") if isinstance(value, Mapping) else value


def auto_target_entropy(num_codes: int, top_k: int | None = None) -> float | None:
    """The recipe's entropy target (``target_entropy="auto"``) for ``num_codes`` codes: ``log(K) / 2``, the entropy of
    sqrt(K) prototypes sharing a token evenly; for assignments truncated to each token's ``top_k < K`` nearest codes,
    ``log(top_k) - 0.5`` (about ``0.6 top_k`` prototypes' worth: the ``top_k`` can hold it, their entropy being at most
    ``log top_k``) when that is lower. ``None`` where there is no entropy to hold (one code, or ``top_k=1``: the
    assignment is the nearest code whatever ``T``)."""
    if num_codes < 2 or top_k == 1:
        return None
    exact = 0.5 * math.log(num_codes)
    return exact if top_k is None or top_k >= num_codes else min(math.log(top_k) - 0.5, exact)


def resolve_target_entropy(value: object, num_codes: int, auto: bool,
                           top_k: int | None = None) -> tuple[float | None, float | None]:
    """``target_entropy`` as the layer takes it -> ``(target, rate)``: ``rate`` ``None`` unless given (an
    :class:`softvq.parts.EntropyControl`); ``"auto"``: :func:`auto_target_entropy` ``(K, top_k)`` with the recipe's
    control (``auto``), else ``None``. The range is checked by :func:`check_entropy_control`."""
    value, rate = EntropyControl.of(value), None
    if isinstance(value, EntropyControl):  # a target with a gain of its own
        value, rate = value.target, value.rate
        if is_auto(value):
            value = auto_target_entropy(num_codes, top_k)
            if value is None:
                raise ValueError(f"target_entropy=EntropyControl(target='auto') has no entropy to hold for "
                                 f"num_codes={num_codes}, top_k={top_k}: pass target_entropy=None (T fixed)")
    elif is_auto(value):  # one code (or top_k=1) has no entropy to control: T fixed
        value = auto_target_entropy(num_codes, top_k) if auto else None
    if isinstance(value, str | bytes):
        raise ValueError(f"target_entropy must be a number of nats, 'auto', a softvq.parts.EntropyControl or None, "
                         f"got {value!r}")
    return value, rate


class TemperatureControl(FullPrecisionState):
    """The temperature ``T`` of Boltzmann assignments ``q ∝ exp(-d / T)`` over ``num_codes`` codes, and the control
    that holds their mean entropy H(Q) at ``target_entropy``.

    ``T`` starts at ``temperature``, or (``temperature=None``) is set on the first training batch by
    :meth:`calibrate` so that that batch's mean H(Q) equals ``target_entropy``. After each training step
    :meth:`step` moves it by ``T <- T exp(rate (target_entropy - H))``; ``target_entropy=None`` holds ``T`` fixed.
    Assigning ``T`` (:meth:`set`) switches the control off unless told otherwise, so an assigned value sticks.

    State: ``temperature_t``, a ``()`` float64 tensor (float64 whatever ``.half()`` or ``.to()`` does), never written
    in place: each change binds a new tensor, so a forward pass whose backward has not run yet keeps the ``T`` it
    used (two forwards before one backward; a compiled backward re-reading its inputs). It is not a state-dict entry:
    the layer that holds this part saves :attr:`temperature` in its extra state, with the rest of its own.

    Args:
        num_codes: ``K``, the number of codes the assignments are over.
        temperature: the starting ``T > 0``, or ``None``: calibrated on the first training batch (needs
            ``target_entropy``).
        target_entropy: the H(Q) in nats to hold, below ``log K``; ``None``: ``T`` stays fixed.
        rate: the control's gain per step, below :func:`max_stable_rate` ``(K)``.
        dim: the tokens' dimension ``D``, or ``None``: what bounds ``T`` from below (:func:`min_temperature`).
    """

    float64_state = ("temperature_t",)  # T keeps float64 through .half() and the like

    def __init__(self, num_codes: int, temperature: float | None = None, target_entropy: float | None = None,
                 rate: float = DEFAULT_RATE, dim: int | None = None) -> None:
        super().__init__()
        self.num_codes = check_positive_int("num_codes", num_codes)
        self._target_entropy, self._rate = check_entropy_control(num_codes, target_entropy, rate)
        if temperature is None and self._target_entropy is None:
            raise ValueError("TemperatureControl needs a temperature or a target_entropy to calibrate one to, got "
                             "neither")
        self.dim = dim  # the tokens' dimension, for the smallest T admitted (min_temperature)
        self.initial = None if temperature is None else check_temperature(temperature, dim)
        # Python-side: reading it costs no device sync, and torch.compile guards on it.
        self.ready = self.initial is not None
        self.register_buffer("temperature_t", torch.tensor(self.initial or 1.0, dtype=torch.float64),
                             persistent=False)
        # what target_entropy="auto" means when assigned (set_target): auto_target_entropy(K, top_k) for a layer of
        # the default recipe, no control (None) for the paper's plain layer; and whether the target is "auto", so that
        # the layer moves it with its top_k
        self.auto_target = False
        self.target_is_auto = False

    @classmethod
    def from_options(cls, num_codes: int, temperature: float | None, target_entropy: object, *, dim: int | None,
                     auto: bool, top_k: int | None = None) -> TemperatureControl:
        """The part a layer builds from its options: ``temperature`` (``None``: calibrated on the first training
        batch) and ``target_entropy`` as the layer takes it (a number, an :class:`EntropyControl`, ``"auto"`` or
        ``None``: :func:`resolve_target_entropy`, ``auto`` saying whether ``"auto"`` is
        :func:`auto_target_entropy` ``(K, top_k)``). Without a target and a starting ``T``, ``T`` is fixed at 1.0."""
        target, rate = resolve_target_entropy(target_entropy, num_codes, auto, top_k)
        part = cls(num_codes, 1.0 if temperature is None and target is None else temperature, target,
                   DEFAULT_RATE if rate is None else rate, dim)
        part.auto_target, part.target_is_auto = auto, _is_auto_target(target_entropy)
        return part

    def set_target(self, value: object, top_k: int | None = None) -> None:
        """Assign the entropy target as the layer's option takes it (:meth:`from_options`): a number sets the target
        and keeps :attr:`rate`, an :class:`EntropyControl` sets both, ``"auto"`` is the part's recipe's for the
        layer's truncation ``top_k`` (:attr:`target_is_auto`: the layer assigns it again when its ``top_k``
        changes), ``None`` holds ``T`` (at 1.0 if it was still to be calibrated). Both checked before either is
        set; ``T`` stays where it is, and the control moves it to the new target."""
        target, rate = resolve_target_entropy(value, self.num_codes, self.auto_target, top_k)
        check_entropy_control(self.num_codes, target, self._rate if rate is None else rate)
        if target is None and not self.ready:
            self.load(1.0)
        if rate is not None:
            self.rate = rate
        self.target_entropy = target
        self.target_is_auto = _is_auto_target(value)

    @property
    def target_entropy(self) -> float | None:
        """The H(Q) in nats the control holds (``None``: ``T`` stays fixed). Assigning it is checked as the constructor
        checks it (:func:`check_entropy_control`, with :attr:`rate`); ``None`` needs a ``T`` to hold (refused until
        one is set or calibrated)."""
        return self._target_entropy

    @target_entropy.setter
    def target_entropy(self, value: float | None) -> None:
        if value is None and not self.ready:
            raise ValueError("target_entropy=None holds T fixed, but T is not set yet (it was to be calibrated to the "
                             "target on the first training batch): set the temperature first")
        self._target_entropy, _ = check_entropy_control(self.num_codes, value, self._rate)

    @property
    def rate(self) -> float:
        """The control's gain per step; assigning it is checked as the constructor checks it
        (:func:`check_entropy_control`: below :func:`max_stable_rate` ``(K)``)."""
        return self._rate

    @rate.setter
    def rate(self, value: float) -> None:
        _, self._rate = check_entropy_control(self.num_codes, self._target_entropy, value)

    @property
    def temperature(self) -> float | None:
        """``T`` as a Python float (``None`` until calibrated); reading it synchronises with the device."""
        return float(self.temperature_t) if self.ready else None

    def set(self, value: float, *, keep_control: bool = False, owner: str = "TemperatureControl") -> None:
        """Set ``T`` to ``value``. With the control on it would bring ``T`` back toward its target within ~100
        steps, so by default the control is switched off (``target_entropy = None``, with a warning naming
        ``owner``); ``keep_control=True`` moves ``T`` and lets the control go on from there."""
        value = check_temperature(value, self.dim)
        if self.target_entropy is not None and not keep_control:
            warnings.warn(f"setting {owner}.temperature switches its entropy control off (target_entropy was "
                          f"{self.target_entropy:g}, now None): T stays where it is set; pass keep_control=True to "
                          f"set_temperature to keep the control", stacklevel=4)
            self._target_entropy = None  # T is set just below: a fixed T to hold
        self.load(value)

    def load(self, value: float | None) -> None:
        """Restore a saved ``T`` (``None``: not calibrated yet), as a new tensor."""
        if value is None:
            self.ready = False
            return
        self.temperature_t = torch.tensor(value, dtype=torch.float64, device=self.temperature_t.device)
        self.ready = True

    @torch.no_grad()
    def calibrate(self, z: Tensor, prototypes: Tensor, keep: bool, top_k: int | None = None) -> Tensor:
        """The ``T`` (a ``()`` float64 tensor) at which tokens ``z (N, D)`` meet ``target_entropy`` over
        ``prototypes (K, D)`` (with ``top_k``: the entropy of the distribution truncated to each token's ``top_k``
        nearest, the one a top-k layer holds), computed on a strided sample of at most ~4,096 tokens (no random draw,
        so restarts draw alike); with ``keep`` it becomes ``T`` (a training batch), else it is used once (evaluation
        before training)."""
        sample = z[:: max(1, z.shape[0] // 4096)]
        t = calibrate_temperature(sample, prototypes, self._target_entropy, top_k or 0).to(self.temperature_t.dtype)
        if keep:
            self.temperature_t = t
            self.ready = True
        return t

    @torch.no_grad()
    def step(self, entropy: Tensor, tokens: int) -> None:
        """After a training step whose ``tokens`` tokens had mean entropy ``entropy`` (a ``()`` tensor; the mean over
        every process's tokens under ``torch.distributed``): ``T <- T exp(rate (target - H))``
        (:func:`entropy_control_factor`, the rule's one implementation), bound as a new tensor; a non-finite entropy
        leaves ``T`` unchanged. No host-device synchronisation."""
        if self._target_entropy is None:
            return
        if is_distributed():
            n = torch.full((), float(tokens), dtype=torch.float64, device=entropy.device)
            total = all_reduce_sum_(torch.stack([entropy.to(torch.float64) * n, n]))
            entropy = total[0] / total[1]
        factor = entropy_control_factor(entropy.to(self.temperature_t.dtype), self._target_entropy, self._rate)
        now = self.temperature_t
        # Bound, not written in place: a second forward pass before the first's backward must not change the T that
        # backward reads (an in-place write is a version-counter error under torch.compile).
        self.temperature_t = torch.where(torch.isfinite(factor), now * factor, now)

    def extra_repr(self) -> str:
        t = "uncalibrated" if not self.ready else f"{self.temperature:g}"
        return f"num_codes={self.num_codes}, temperature={t}, target_entropy={self.target_entropy}, rate={self.rate:g}"


def _is_auto_target(value: object) -> bool:
    """Whether ``target_entropy`` as the layer takes it is the recipe's, ``"auto"`` (alone or an
    :class:`EntropyControl`'s target)."""
    value = EntropyControl.of(value)
    return is_auto(value.target if isinstance(value, EntropyControl) else value)
