"""The in-layer recipe of :class:`softvq.DDCLQuantizer`: checking and resolving its options, refusing the ones that have
no effect, and deciding whether a training batch can start the codebook.

The mechanisms the recipe attaches are the modules of :mod:`softvq.parts` (the temperature control, EMA prototypes,
dead-code restart, the token standardiser); this module only says which options they get. ``recipe="auto"`` gives
each the value docs/design.md ("The recipe inside the layer") measured; ``recipe="plain"`` is the paper's layer.
"""

from __future__ import annotations

import math
import warnings
from typing import Any

import torch
from torch import Tensor, nn

from softvq._checks import check_bool, check_choice, check_float, check_positive_int
from softvq._collectives import all_reduce_sum_, is_distributed
from softvq.norm import Standardize
from softvq.parts.init import NormalInit
from softvq.parts.restart import Restart
from softvq.parts.temperature import DEFAULT_RATE, EntropyControl
from softvq.parts.update import Commitment, Ema, Gradient, prototype_update_of

# The options the layer holds itself; a part holds each of the others (PartOption below).
LAYER_OPTIONS = ("num_codes", "dim", "recipe", "distance", "commitment_term", "commitment_weight", "init",
                 "check_finite", "top_k", "channel_first", "standardize", "output_scale", "hard_output")


def _is_auto(value: object) -> bool:
    return isinstance(value, str) and value == "auto"


def resolve(auto: bool, num_codes: int, temperature: float | str, *, standardize: object,
            hard_output: bool | str, prototype_update: object,
            target_entropy: object, restart: object) -> dict[str, Any]:
    """The options the recipe sets (``auto``: ``recipe="auto"``), an explicit value overriding the recipe's, checked.
    ``"auto"`` means the recipe's value and ``None`` means off, wherever an option takes them (``target_entropy=None``:
    a fixed temperature); an option with nothing to switch off refuses ``None``. The options a part checks itself (the
    entropy target's range, the control's gain) are checked there."""
    given = {"temperature": temperature, "standardize": standardize, "hard_output": hard_output,
             "prototype_update": prototype_update}
    for name, value in given.items():
        if value is None:
            raise ValueError(f"{name}=None: pass 'auto' for the recipe's value (the layer has no {name} to switch "
                             f"off)")
    standardize = Standardize.of((Standardize() if auto else False) if _is_auto(standardize) else standardize)
    if not isinstance(standardize, Standardize):
        standardize = check_bool("standardize", standardize)  # False: no standardisation (True is Standardize())
    on = standardize if isinstance(standardize, Standardize) else None
    target_entropy, rate = EntropyControl.of(target_entropy), DEFAULT_RATE
    if isinstance(target_entropy, EntropyControl):  # a target with a gain of its own
        target_entropy, rate = target_entropy.target, target_entropy.rate
        target_entropy = 0.5 * math.log(num_codes) if _is_auto(target_entropy) else target_entropy
    elif _is_auto(target_entropy):  # sqrt(K) prototypes' worth of entropy; one code has none to control: T fixed
        target_entropy = 0.5 * math.log(num_codes) if auto and num_codes > 1 else None
    start: float | None = None if _is_auto(temperature) else temperature  # None: calibrated on the first batch
    if start is None and target_entropy is None:
        start = 1.0
    return {
        "standardize": on is not None,
        "output_scale": on.output_scale if on else "standardized",
        "renorm": on is not None and on.renorm_clip is not None,
        "renorm_clip": on.renorm_clip if on and on.renorm_clip else Standardize().renorm_clip,
        "hard_output": check_bool("hard_output", auto if _is_auto(hard_output) else hard_output),
        "prototype_update": prototype_update_of(prototype_update, auto=Ema() if auto else Gradient()),
        "target_entropy": target_entropy,
        "temperature_rate": rate,
        "temperature": start,
        "restart": (Restart() if auto else None) if _is_auto(restart) else Restart.of(restart),
    }


def check_options(given: dict[str, Any]) -> dict[str, Any]:
    """``DDCLQuantizer``'s options (``given``: every argument of its constructor, as passed) checked, with the recipe's
    values resolved (:func:`resolve`): what the layer and its parts are built from. The parts check the options they
    own themselves (``renorm_clip``, the entropy control's range, ``restart``'s fields, ...), when they are built."""
    o = dict(given)
    o["num_codes"] = check_positive_int("num_codes", o["num_codes"])
    o["dim"] = check_positive_int("dim", o["dim"])
    o["recipe"] = check_choice("recipe", o["recipe"], ("auto", "plain"))
    o["distance"] = check_choice("distance", o["distance"], ("euclidean", "cosine"))
    commitment = Commitment.of(o["commitment_weight"])  # a number: the weight of the "hard" term
    o["commitment_weight"], o["commitment_term"] = (commitment.weight, commitment.term) if isinstance(
        commitment, Commitment) else (check_float("commitment_weight", commitment, allow_zero=True), "hard")
    o["init"] = NormalInit.of(o["init"])
    o["check_finite"] = check_bool("check_finite", o["check_finite"])
    o["top_k"] = None if o["top_k"] is None else check_positive_int("top_k", o["top_k"])
    o["channel_first"] = check_bool("channel_first", o["channel_first"])
    o.update(resolve(given["recipe"] == "auto", o["num_codes"], given["temperature"],
                     **{name: given[name] for name in ("standardize", "hard_output", "prototype_update",
                                                       "target_entropy", "restart")}))
    return o


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
    so that the value has one place (``DDCLQuantizer.target_entropy`` is its ``temperature_control``'s)."""

    def __init__(self, part: str, attribute: str) -> None:
        self.part, self.attribute = part, attribute

    def __get__(self, layer: nn.Module | None, owner: type) -> Any:
        return self if layer is None else getattr(getattr(layer, self.part), self.attribute)

    def __set__(self, layer: nn.Module, value: Any) -> None:
        setattr(getattr(layer, self.part), self.attribute, value)
