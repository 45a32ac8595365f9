"""The rules of :class:`softvq.DDCLQuantizer`'s own options, as functions of the values: each option's check (the one
place of its rule, for the constructor and for assignments), the recipe's value of an option left at ``"auto"``
(``recipe="auto"``: docs/design.md, "The recipe inside the layer"; ``recipe="plain"``: the paper's layer), whether a
training batch can start the codebook (:func:`start_refusal`), and the descriptors that make the options attributes
checked on assignment (:func:`layer_option`, :func:`fixed_option`, :class:`PartOption`), which the other layers use too.

An option that a part of :mod:`softvq.parts` holds is resolved and checked by that part (``standardize`` by the
token standardiser, ``restart`` by dead-code restart, ``target_entropy`` by the temperature control).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import torch
from torch import Tensor, nn

from softvq._checks import check_bool, check_choice, check_positive_int, check_weight
from softvq._collectives import all_reduce_sum_, is_distributed
from softvq.parts._settings import is_auto
from softvq.parts.temperature import check_temperature
from softvq.parts.update import TERMS, Commitment, Ema, Gradient, prototype_update_of

DISTANCES = ("euclidean", "cosine")
COMMITMENT_TERMS = ("hard", *TERMS)


def _not_none(name: str, value: object) -> None:
    if value is None:
        raise ValueError(f"{name}=None: pass 'auto' for the recipe's value (the layer has no {name} to switch off)")


# ---- each option's check: the one place of its rule, for the constructor (check_options) and for assignments ----
def check_distance(value: object) -> str:
    return check_choice("distance", value, DISTANCES)


def check_top_k(value: object) -> int | None:
    """``None`` (every code) or a positive integer."""
    return None if value is None else check_positive_int("top_k", value)


# top_k="auto" (the recipe's): the exact distribution up to EXACT_UP_TO codes, above it each token's k nearest, k
# from AUTO_TOP_K (the first row whose K bound holds). Chosen per second of training on validation, where the exact
# layer's step grows with K and the truncation's far less; the measurements:
# docs/scaling.md, "The default per codebook size".
EXACT_UP_TO = 2048
AUTO_TOP_K: tuple[tuple[float, int], ...] = ((8192, 16), (math.inf, 32))


def auto_top_k(num_codes: int) -> int | None:
    """The recipe's ``top_k`` for ``num_codes`` codes: ``None`` (exact) up to :data:`EXACT_UP_TO`, else the ``k`` of
    :data:`AUTO_TOP_K`: 16 up to K = 8192, 32 above."""
    if num_codes <= EXACT_UP_TO:
        return None
    return next(k for bound, k in AUTO_TOP_K if num_codes <= bound)


def resolve_top_k(value: object, num_codes: int, auto: bool) -> int | None:
    """``top_k`` as the layer takes it -> ``None`` or ``k``: ``"auto"`` is :func:`auto_top_k` ``(K)`` for the recipe
    (``auto``) and ``None`` (the exact distribution, the paper's) for the plain layer; else :func:`check_top_k`."""
    if is_auto(value):
        return auto_top_k(num_codes) if auto else None
    return check_top_k(value)


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
    return check_bool("hard_output", auto if is_auto(value) else value)


def resolve_prototype_update(value: object, auto: bool) -> Ema | Gradient:
    """``prototype_update`` as the constructor takes it -> an :class:`~softvq.parts.Ema` or a
    :class:`~softvq.parts.Gradient` (:func:`softvq.parts.update.prototype_update_of`; ``"auto"``: ``Ema()`` for the
    recipe, ``auto``, ``Gradient()`` for the plain layer); ``None`` is refused (the prototypes always move somehow)."""
    _not_none("prototype_update", value)
    return prototype_update_of(value, auto=Ema() if auto else Gradient())


def resolve_temperature(value: object, dim: int) -> float | None:
    """The starting ``T`` (``None``: ``"auto"``, calibrated on the first training batch), at least
    :func:`softvq.parts.temperature.min_temperature` ``(dim)``."""
    _not_none("temperature", value)
    return None if is_auto(value) else check_temperature(value, dim)


def layer_option(name: str, check: Callable[[nn.Module, Any], Any], doc: str) -> property:
    """A layer's option held on the layer as ``_<name>``: reading it returns that; assigning it stores
    ``check(layer, value)``, the constructor's check of the option (a ``ValueError`` naming it and the value), which
    the next call reads."""
    slot = f"_{name}"

    def get(self: nn.Module) -> Any:
        return getattr(self, slot)

    def set_(self: nn.Module, value: Any) -> None:
        setattr(self, slot, check(self, value))

    return property(get, set_, doc=doc)


def fixed_option(name: str, how: str, doc: str, get: Callable[[nn.Module], Any] | None = None) -> property:
    """A layer's option fixed when it is built (held as ``_<name>``, or read by ``get(layer)``): reading it returns
    it; assigning it is an ``AttributeError`` saying ``how`` to get another value."""
    slot = f"_{name}"

    def held(self: nn.Module) -> Any:
        return getattr(self, slot)

    def set_(self: nn.Module, value: Any) -> None:
        raise AttributeError(f"{type(self).__name__}.{name} cannot be assigned (got {value!r}): it is fixed when the "
                             f"layer is built; {how}")

    return property(get or held, set_, doc=doc)


def start_refusal(flat: Tensor, num_codes: int, target_entropy: float | None, check_finite: bool) -> str | None:
    """Why a training batch ``flat (N, D)`` (every process's, together) cannot start a codebook of ``num_codes`` codes
    held at ``target_entropy`` (initialise the prototypes from its tokens and calibrate the temperature), or ``None``
    when it can.

    It cannot when it holds too few tokens for ``K`` codes at the target entropy: with ``N e^H <= K`` the data
    initialisation puts ``K / N >= e^H`` jittered copies of each token in the codebook, and the entropy target is
    met among a token's own copies, at a temperature of the jitter's scale (a one-token "shape check" in training
    mode). A count, so no synchronisation. With ``check_finite`` it also cannot when its tokens are all equal (nothing
    to initialise from, a temperature near 0): that reads one number on the host, as the finite check does; with
    ``check_finite=False`` (a step that never synchronises) an all-equal first batch is the caller's to avoid."""
    n = flat.shape[0] * (torch.distributed.get_world_size() if is_distributed() else 1)
    if target_entropy is not None and n * math.exp(target_entropy) <= num_codes:
        needed = num_codes * math.exp(-target_entropy)
        return (f"{n} token(s) are too few for {num_codes} codes at the target entropy of {target_entropy:g} nats "
                f"(more than K e^-H = {needed:.1f} are needed)")
    if check_finite and not torch.compiler.is_compiling():
        tokens = flat.detach()  # nothing recorded for autograd: a checkpoint's recomputation skips this test
        spread = (tokens.amax(0) - tokens.amin(0)).amax().to(torch.float64)  # N > 0 here
        if not float(all_reduce_sum_(spread)) > 0:  # every process decides alike
            return f"its {n} token(s) are all equal"
    return None


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
