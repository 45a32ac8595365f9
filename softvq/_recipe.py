"""The in-layer recipe of :class:`softvq.DDCLQuantizer`: checking and resolving its options, refusing the ones that have
no effect, and deciding whether a training batch can start the codebook.

The mechanisms the recipe attaches are the modules of :mod:`softvq.parts` (the temperature control, EMA prototypes,
dead-code restart, the token standardiser); this module only says which options they get. ``recipe="auto"`` gives
each the value docs/design.md ("The recipe inside the layer") measured; ``recipe="plain"`` is the paper's layer.
"""

from __future__ import annotations

import math
import warnings
from collections.abc import Callable
from typing import Any

import torch
from torch import Tensor, nn

from softvq._checks import check_bool, check_choice, check_positive_int, check_weight
from softvq._collectives import all_reduce_sum_, is_distributed
from softvq.norm import Standardize, check_output_scale
from softvq.parts.init import check_init
from softvq.parts.restart import Restart
from softvq.parts.temperature import DEFAULT_RATE, EntropyControl, check_entropy_control, check_temperature
from softvq.parts.update import TERMS, Commitment, Ema, Gradient, prototype_update_of

# The options the layer holds itself (each as ``_<name>``, behind a property of that name: :func:`layer_option`,
# :func:`fixed_option`); a part holds each of the others (:class:`PartOption`).
LAYER_OPTIONS = ("num_codes", "dim", "recipe", "distance", "commitment_term", "commitment_weight", "init",
                 "check_finite", "top_k", "channel_first", "standardize", "output_scale", "hard_output")
DISTANCES = ("euclidean", "cosine")
COMMITMENT_TERMS = ("hard", *TERMS)


def _is_auto(value: object) -> bool:
    return isinstance(value, str) and value == "auto"


def _not_none(name: str, value: object) -> None:
    if value is None:
        raise ValueError(f"{name}=None: pass 'auto' for the recipe's value (the layer has no {name} to switch off)")


# ---- each option's check: the one place of its rule, for the constructor (check_options) and for assignments ----
def check_distance(value: object) -> str:
    return check_choice("distance", value, DISTANCES)


def check_top_k(value: object) -> int | None:
    """``None`` (every code) or a positive integer."""
    return None if value is None else check_positive_int("top_k", value)


def check_commitment(value: object) -> tuple[float, str | None]:
    """``commitment_weight`` as the layer takes it -> ``(weight, term)``: a :class:`softvq.parts.Commitment` (or a
    mapping of its fields) gives both; a number is a weight (:func:`softvq._checks.check_weight`) and ``None`` for
    the term (the constructor's ``"hard"``; an assignment keeps the layer's)."""
    commitment = Commitment.of(value)
    if isinstance(commitment, Commitment):
        return commitment.weight, commitment.term
    return check_weight("commitment_weight", commitment), None


def resolve_hard_output(value: object, auto: bool) -> bool:
    _not_none("hard_output", value)
    return check_bool("hard_output", auto if _is_auto(value) else value)


def resolve_standardize(value: object, auto: bool, dim: int) -> Standardize | None:
    """``standardize`` as the layer takes it -> its :class:`Standardize`, or ``None`` for none (``False``);
    ``"auto"``: the recipe's (``auto``); the output scale checked against ``dim``
    (:func:`softvq.norm.check_output_scale`)."""
    _not_none("standardize", value)
    value = Standardize.of((Standardize() if auto else False) if _is_auto(value) else value)
    if not isinstance(value, Standardize):
        check_bool("standardize", value)  # False: no standardisation (True is Standardize())
        return None
    check_output_scale(value.output_scale, dim)
    return value


def resolve_target_entropy(value: object, num_codes: int, auto: bool) -> tuple[float | None, float | None]:
    """``target_entropy`` as the layer takes it -> ``(target, rate)``: ``rate`` ``None`` unless given (an
    :class:`softvq.parts.EntropyControl`); ``"auto"``: ``log(K) / 2`` with the recipe's control (``auto``; one code
    has no entropy to hold), else ``None``. The range is the part's to check
    (:func:`softvq.parts.temperature.check_entropy_control`)."""
    value, rate = EntropyControl.of(value), None
    if isinstance(value, EntropyControl):  # a target with a gain of its own
        value, rate = value.target, value.rate
        value = 0.5 * math.log(num_codes) if _is_auto(value) else value
    elif _is_auto(value):  # sqrt(K) prototypes' worth of entropy; one code has none to control: T fixed
        value = 0.5 * math.log(num_codes) if auto and num_codes > 1 else None
    if isinstance(value, str | bytes):
        raise ValueError(f"target_entropy must be a number of nats, 'auto', a softvq.parts.EntropyControl or None, "
                         f"got {value!r}")
    return value, rate


def resolve_restart(value: object, auto: bool) -> Restart | None:
    return (Restart() if auto else None) if _is_auto(value) else Restart.of(value)


def resolve_temperature(value: object, dim: int) -> float | None:
    """The starting ``T`` (``None``: ``"auto"``, calibrated on the first training batch), at least
    :func:`softvq.parts.temperature.min_temperature` ``(dim)``."""
    _not_none("temperature", value)
    return None if _is_auto(value) else check_temperature(value, dim)


def resolve(auto: bool, num_codes: int, dim: int, temperature: float | str, *, standardize: object,
            hard_output: bool | str, prototype_update: object,
            target_entropy: object, restart: object) -> dict[str, Any]:
    """The options the recipe sets (``auto``: ``recipe="auto"``), an explicit value overriding the recipe's, checked.
    ``"auto"`` means the recipe's value and ``None`` means off, wherever an option takes them (``target_entropy=None``:
    a fixed temperature); an option with nothing to switch off refuses ``None``. The options a part checks itself (the
    entropy target's range, the control's gain) are checked there."""
    _not_none("prototype_update", prototype_update)
    start = resolve_temperature(temperature, dim)  # None: calibrated on the first batch
    on = resolve_standardize(standardize, auto, dim)
    target_entropy, rate = resolve_target_entropy(target_entropy, num_codes, auto)
    if start is None and target_entropy is None:
        start = 1.0
    return {
        "standardize": on is not None,
        "output_scale": on.output_scale if on else "standardized",
        "renorm": on is not None and on.renorm_clip is not None,
        "renorm_clip": on.renorm_clip if on and on.renorm_clip else Standardize().renorm_clip,
        "hard_output": resolve_hard_output(hard_output, auto),
        "prototype_update": prototype_update_of(prototype_update, auto=Ema() if auto else Gradient()),
        "target_entropy": target_entropy,
        "temperature_rate": DEFAULT_RATE if rate is None else rate,
        "temperature": start,
        "restart": resolve_restart(restart, auto),
    }


def check_options(given: dict[str, Any]) -> dict[str, Any]:
    """``DDCLQuantizer``'s options (``given``: every argument of its constructor, as passed) checked, with the recipe's
    values resolved (:func:`resolve`): what the layer and its parts are built from. The parts check the options they
    own themselves (``renorm_clip``, the entropy control's range, ``restart``'s fields, ...), when they are built. Each
    check is the function an assignment to the option calls (``layer.distance = ...``: :func:`check_distance`, ...)."""
    o = dict(given)
    o["num_codes"] = check_positive_int("num_codes", o["num_codes"])
    o["dim"] = check_positive_int("dim", o["dim"])
    o["recipe"] = check_choice("recipe", o["recipe"], ("auto", "plain"))
    o["distance"] = check_distance(o["distance"])
    weight, term = check_commitment(o["commitment_weight"])
    o["commitment_weight"], o["commitment_term"] = weight, term or "hard"  # a number: the weight of the "hard" term
    o["init"] = check_init(o["init"], o["dim"])
    o["check_finite"] = check_bool("check_finite", o["check_finite"])
    o["top_k"] = check_top_k(o["top_k"])
    o["channel_first"] = check_bool("channel_first", o["channel_first"])
    o.update(resolve(o["recipe"] == "auto", o["num_codes"], o["dim"], given["temperature"],
                     **{name: given[name] for name in ("standardize", "hard_output", "prototype_update",
                                                       "target_entropy", "restart")}))
    return o


# ---- assignments: each option's setter, which checks with the constructor's check and sets what it sets -----
def set_commitment(layer: nn.Module, value: object) -> None:
    """``layer.commitment_weight = value``: a number sets the weight and keeps the term (``commitment_term``), a
    :class:`softvq.parts.Commitment` sets both (:func:`check_commitment`)."""
    weight, term = check_commitment(value)
    layer._commitment_weight = weight
    if term is not None:
        layer._commitment_term = term


def set_standardize(layer: nn.Module, value: object) -> None:
    """``layer.standardize = value``, as the constructor takes it (:func:`resolve_standardize`): ``False`` switches
    standardisation off; a :class:`Standardize` (``True``: ``Standardize()``; ``"auto"``: the recipe's) sets it, its
    ``output_scale``, and batch renormalisation with its clip (``renorm_clip=None``: plain batch standardisation)."""
    on = resolve_standardize(value, layer.recipe == "auto", layer.dim)
    layer._standardize = on is not None
    layer._output_scale = on.output_scale if on else "standardized"
    layer.standardizer.renorm = on is not None and on.renorm_clip is not None
    if on is not None and on.renorm_clip is not None:
        layer.standardizer.renorm_clip = on.renorm_clip


def _needs_standardize(layer: nn.Module, name: str, value: object) -> None:
    if not layer.standardize:
        raise ValueError(f"{name}={value!r} acts on standardised tokens, and this layer does not standardise "
                         f"(standardize=False): assign standardize=softvq.parts.Standardize(...) with it instead")


def check_output_scale_of(layer: nn.Module, value: object) -> object:
    """``layer.output_scale = value``: the constructor's check of ``Standardize.output_scale`` at the layer's ``dim``
    (:func:`softvq.norm.check_output_scale`), on a layer that standardises."""
    value = check_output_scale(value, layer.dim, "output_scale")
    if value != "standardized":
        _needs_standardize(layer, "output_scale", value)
    return value


def set_renorm(layer: nn.Module, value: object) -> None:
    """``layer.renorm = value``: batch renormalisation (with the standardiser's ``renorm_clip``) on a layer that
    standardises, or plain batch standardisation."""
    value = check_bool("renorm", value)
    if value:
        _needs_standardize(layer, "renorm", value)
    layer.standardizer.renorm = value


def set_target_entropy(layer: nn.Module, value: object) -> None:
    """``layer.target_entropy = value``, as the constructor takes it (:func:`resolve_target_entropy`; ``"auto"``: the
    recipe's): a number sets the target and keeps the rate (``temperature_rate``), an
    :class:`softvq.parts.EntropyControl` sets both, ``None`` holds ``T`` fixed (at 1.0 if it was still to be
    calibrated, the constructor's ``T`` without a target). Checked by the part
    (:func:`softvq.parts.temperature.check_entropy_control`)."""
    control = layer.temperature_control
    target, rate = resolve_target_entropy(value, layer.num_codes, layer.recipe == "auto")
    check_entropy_control(layer.num_codes, target, control.rate if rate is None else rate)  # both, before either
    if target is None and not control.ready:
        control.load(1.0)
    if rate is not None:
        control._rate = rate
    control.target_entropy = target


def set_restart(layer: nn.Module, value: object) -> None:
    """``layer.restart = value``, as the constructor takes it (:func:`resolve_restart`; ``"auto"``: the recipe's)."""
    layer.dead_codes.settings = resolve_restart(value, layer.recipe == "auto")


def layer_option(name: str, check: Callable[[nn.Module, Any], Any], doc: str) -> property:
    """A layer's option held on the layer as ``_<name>``: reading it returns that; assigning it stores
    ``check(layer, value)``, the constructor's check of the option (a ``ValueError`` naming it and the value), which
    the next call reads."""
    slot = f"_{name}"

    def get(layer: nn.Module) -> Any:
        return getattr(layer, slot)

    def set_(layer: nn.Module, value: Any) -> None:
        setattr(layer, slot, check(layer, value))

    return property(get, set_, doc=doc)


def fixed_option(name: str, how: str, doc: str, get: Callable[[nn.Module], Any] | None = None) -> property:
    """A layer's option fixed when it is built (held as ``_<name>``, or read by ``get(layer)``): reading it returns
    it; assigning it is an ``AttributeError`` saying ``how`` to get another value."""
    slot = f"_{name}"

    def held(layer: nn.Module) -> Any:
        return getattr(layer, slot)

    def set_(layer: nn.Module, value: Any) -> None:
        raise AttributeError(f"{type(layer).__name__}.{name} cannot be assigned (got {value!r}): it is fixed when the "
                             f"layer is built; {how}")

    return property(get or held, set_, doc=doc)


def options_repr(layer: nn.Module) -> str:
    """``DDCLQuantizer``'s options in effect, as its ``repr`` shows them (``temperature=auto`` until calibrated)."""
    t = "auto" if not layer.temperature_control.ready else f"{layer.temperature:g}"
    return (
        f"num_codes={layer.num_codes}, dim={layer.dim}, recipe={layer.recipe!r}, temperature={t}, "
        f"target_entropy={layer.target_entropy}, standardize={layer.standardize}, "
        f"prototype_update={layer.prototype_update}, hard_output={layer.hard_output}, distance={layer.distance!r}, "
        f"commitment={layer.commitment_weight:g}*{layer.commitment_term}, init={layer.init!r}, "
        f"restart={layer.restart}"
        + (f", top_k={layer.top_k}" if layer.top_k is not None else "")
    )


def can_start(layer: nn.Module, flat: Tensor) -> bool:
    """Whether a training batch ``flat (N, D)`` (every process's, together) can start the codebook: initialise
    the prototypes from its tokens and calibrate the temperature to ``target_entropy``.

    It cannot when it holds too few tokens for ``K`` codes at the target entropy: with ``N e^H <= K`` the data
    initialisation puts ``K / N >= e^H`` jittered copies of each token in the codebook, and the entropy target is
    met among a token's own copies, at a temperature of the jitter's scale (1e-5 instead of about 1 for 32 tokens
    and K = 512; a one-token "shape check" in training mode). A count, so no synchronisation. With
    ``check_finite`` it also cannot when its tokens are all equal (nothing to initialise from, a temperature near
    0): that reads one number on the host, as the finite check does; with ``check_finite=False`` (a step that
    never synchronises) an all-equal first batch is the caller's to avoid."""
    n = flat.shape[0] * (torch.distributed.get_world_size() if is_distributed() else 1)
    why = None
    if layer.target_entropy is not None and n * math.exp(layer.target_entropy) <= layer.num_codes:
        needed = layer.num_codes * math.exp(-layer.target_entropy)
        why = (f"{n} token(s) are too few for {layer.num_codes} codes at the target entropy of "
               f"{layer.target_entropy:g} nats (more than K e^-H = {needed:.1f} are needed)")
    elif layer.check_finite and not torch.compiler.is_compiling():
        tokens = flat.detach()  # nothing recorded for autograd: a checkpoint's recomputation skips this test
        spread = (tokens.amax(0) - tokens.amin(0)).amax().to(torch.float64)  # N > 0 here
        if not float(all_reduce_sum_(spread)) > 0:  # every process decides alike
            why = f"its {n} token(s) are all equal"
    if why is not None and not layer._warned_start:
        layer._warned_start = True
        warnings.warn(f"DDCLQuantizer(num_codes={layer.num_codes}): a training batch cannot start the codebook: "
                      f"{why}. It was used for its output only; the prototypes and the temperature start on the "
                      f"first training batch that can", stacklevel=4)
    return why is None


class PartOption:
    """A layer's option that one of its parts owns: ``layer.<name>`` reads and writes ``layer.<part>.<attribute>``,
    so that the value has one place (``DDCLQuantizer.temperature_rate`` is its ``temperature_control``'s ``rate``),
    and an assignment is checked where the part checks its own (the part's property setter, which its constructor's
    check is)."""

    def __init__(self, part: str, attribute: str) -> None:
        self.part, self.attribute = part, attribute

    def __get__(self, layer: nn.Module | None, owner: type) -> Any:
        return self if layer is None else getattr(getattr(layer, self.part), self.attribute)

    def __set__(self, layer: nn.Module, value: Any) -> None:
        setattr(getattr(layer, self.part), self.attribute, value)
