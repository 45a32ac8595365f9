"""Dead-code restart: a running count of the tokens each code wins per training batch, and moving the codes whose
count fell below a threshold onto random tokens of the batch (of every process's batch together).

:class:`DeadCodeRestart` is the part both :class:`softvq.DDCLQuantizer` and :class:`softvq.HardVQ` hold;
:func:`code_counts` counts a batch's winners, which the EMA update (:class:`softvq.parts.EmaPrototypes`) reads too.
None of it synchronises the host with the device (no ``.item()``, no data-dependent shape), so a GPU step never
waits on the CPU and ``torch.compile`` traces it whole.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Literal

import torch
from torch import Tensor

from softvq._checks import check_float, check_positive_int, check_unit
from softvq._collectives import all_reduce_sum_, random_tokens
from softvq._precision import FullPrecisionState
from softvq.parts._settings import from_mapping, is_auto

# decay="auto": the running count remembers at least this many tokens a code wins on average (its memory,
# 1 / (1 - decay) batches, times N / K tokens per code per batch), and never less than USAGE_DECAY_FLOOR's memory, so
# that a live code's count does not dip below the threshold by chance ...
USAGE_MEMORY_TOKENS = 64.0
USAGE_DECAY_FLOOR = 0.9
# ... and at most 0.97's memory (33 batches), so that a dead code is restarted within that many batches. Why these
# values: docs/design.md, "Dead-code restart at large K".
USAGE_DECAY_CEILING = 0.97


def check_cap(value: object, name: str = "restart.cap") -> float:
    """Restart's cap: a fraction of the mean tokens per code per batch, in ``(0, 1]`` (above 1 the cap would let the
    threshold exceed the mean count, and restart codes that win as many tokens as the average one); else a
    ``ValueError`` naming ``name`` and ``value``."""
    cap = check_float(name, value)
    if cap > 1.0:
        raise ValueError(f"{name} is a fraction of the mean tokens per code per batch, in (0, 1], got {value!r}")
    return cap


@dataclass(frozen=True)
class Restart:
    """The settings of dead-code restart (:class:`DeadCodeRestart`), as a layer's ``restart`` option takes them:
    ``DDCLQuantizer(K, D, restart=Restart(threshold=2.0))``, ``HardVQ(K, D, restart=Restart())``; ``restart=None``
    switches restarts off. A config file or the trainer's flags give it as a mapping (``--ddcl.restart.threshold 2``).

    Args:
        threshold: restart a code whose running number of won tokens per training batch is below this (``> 0``).
        decay: that running count's decay in ``(0, 1)``, or ``"auto"``: ``1 - N / (64 K)`` for a batch of ``N``
            tokens, clipped to ``[0.9, 0.97]`` (:meth:`DeadCodeRestart.usage_decay`;
            docs/design.md, "Dead-code restart at large K").
        cap: the threshold in effect is at most this fraction (in ``(0, 1]``) of the mean tokens per code per batch, so
            that a batch too small to give every code a token restarts no live code; ``None``: uncapped.
    """

    threshold: float = 1.0
    decay: float | Literal["auto"] = "auto"
    cap: float | None = 0.25

    def __post_init__(self) -> None:
        object.__setattr__(self, "threshold", check_float("restart.threshold", self.threshold))
        if not is_auto(self.decay):
            object.__setattr__(self, "decay", check_unit("restart.decay", self.decay))
        if self.cap is not None:
            object.__setattr__(self, "cap", check_cap(self.cap))

    @classmethod
    def of(cls, value: object, name: str = "restart") -> Restart | None:
        """``value`` as a layer's ``restart`` option takes it: a :class:`Restart`, ``None`` (off) or a mapping of its
        fields (a config file's); anything else is a ``ValueError`` naming ``name``."""
        if value is None or isinstance(value, cls):
            return value
        if isinstance(value, Mapping):
            return from_mapping(cls, value, name)
        raise ValueError(f"{name} must be a softvq.parts.Restart, a mapping of its fields or None, got {value!r}")


@torch.no_grad()
def code_counts(indices: Tensor, num_codes: int, dtype: torch.dtype) -> Tensor:
    """``(K,)`` how many of ``indices (N,)`` pick each code, summed over processes under ``torch.distributed``."""
    counts = torch.zeros(num_codes, dtype=dtype, device=indices.device)
    counts.index_add_(0, indices, torch.ones_like(indices, dtype=dtype))  # bincount's shape is the data's; this is (K,)
    return all_reduce_sum_(counts)


@torch.no_grad()
def restart_dead_codes_(codebook: Tensor, usage: Tensor, z: Tensor, threshold: float | Tensor) -> Tensor:
    """Replace the rows of ``codebook (K, D)`` whose running ``usage (K,)`` is below ``threshold`` by random tokens of
    ``z (N, D)`` and set their usage to ``threshold``; returns the ``(K,)`` mask of restarted rows. Nothing is
    restarted while ``usage`` still holds the -1 of "no batch seen yet", or when there are no tokens.

    Every code draws a candidate token (:func:`softvq._collectives.random_tokens`) and the dead ones take theirs.
    Under ``torch.distributed`` the tokens are drawn from every process's batch together, so the result is the same
    on every process and equals a single process's restart on the concatenated batch with rank 0's random state.
    """
    rows, any_token = random_tokens(z, codebook.shape[0])
    dead = (usage < threshold) & (usage >= 0).all()  # usage is summed across processes: every process agrees
    if any_token is False:
        return torch.zeros_like(dead)
    if any_token is not True:
        dead &= any_token
    codebook.copy_(torch.where(dead[:, None], rows.to(codebook.dtype), codebook))
    usage.copy_(torch.where(dead, threshold, usage))
    return dead


class DeadCodeRestart(FullPrecisionState):
    """The running number of tokens each of ``num_codes`` codes wins per training batch, and the restart of the codes
    whose number fell below the threshold of its settings (:class:`Restart`).

    :meth:`update` folds a batch's :func:`code_counts` into the running ``usage`` (the first batch starts it from its
    counts: starting from 0 would restart nearly every live code in the first steps); :meth:`restart_` moves the
    codebook rows whose usage is below the threshold onto random tokens of a batch and counts them.

    The part holds its layer's ``restart`` option whole (:attr:`settings`) and decides from it whether restarts are on:
    ``None`` is off (``threshold`` reads 0), and a layer with a recipe passes what its ``"auto"`` means (``auto``).

    State: ``usage`` ``(K,)`` (float32 under ``.half()``; -1 until the first batch) and ``restart_count``, the codes
    moved so far (a ``()`` int64 tensor, not a state-dict entry: the layer that holds this part saves it).

    Args:
        num_codes: ``K``.
        settings: a :class:`Restart`, a mapping of its fields, ``None`` (no restarts) or ``"auto"`` (``auto``).
        auto: what ``settings="auto"`` means (a layer recipe's :class:`Restart`, or ``None``: off); ``"refused"``
            (the default): ``"auto"`` is refused, as a layer without a recipe refuses it.
        idle_decay: the running usage's decay while restarts are off (a layer that tracks the usage all the same, as
            :class:`softvq.HardVQ` does), in ``(0, 1)`` or ``"auto"`` (:meth:`usage_decay`).
    """

    def __init__(self, num_codes: int, settings: Restart | Mapping[str, Any] | Literal["auto"] | None = None, *,
                 auto: Restart | Literal["refused"] | None = "refused",
                 idle_decay: float | Literal["auto"] = "auto") -> None:
        super().__init__()
        self.num_codes = check_positive_int("num_codes", num_codes)
        self.auto = auto
        self.idle_decay = idle_decay
        self._restart: Restart | None = None
        self.settings = settings
        self.register_buffer("usage", torch.full((num_codes,), -1.0))
        self.register_buffer("restart_count", torch.zeros((), dtype=torch.long), persistent=False)

    @property
    def settings(self) -> Restart | None:
        """The part's settings (a :class:`Restart`; ``None``: no restarts). Assigning takes what a layer's ``restart``
        option takes (a :class:`Restart`, a mapping of its fields, ``None``, or ``"auto"``: :attr:`auto`), checked by
        :meth:`Restart.of`."""
        return self._restart

    @settings.setter
    def settings(self, value: Restart | Mapping[str, Any] | Literal["auto"] | None) -> None:
        if is_auto(value) and not isinstance(self.auto, str):
            value = self.auto
        self._restart = Restart.of(value)

    @property
    def idle_decay(self) -> float | str:
        """The running usage's decay while restarts are off (``"auto"``: :meth:`usage_decay`'s rule)."""
        return self._idle_decay

    @idle_decay.setter
    def idle_decay(self, value: float | Literal["auto"]) -> None:
        self._idle_decay = "auto" if is_auto(value) else check_unit("restart.decay", value)

    @property
    def threshold(self) -> float:
        """The settings' threshold; 0 while restarts are off."""
        return 0.0 if self._restart is None else self._restart.threshold

    @property
    def decay(self) -> float | str:
        """The running usage's decay: the settings', or :attr:`idle_decay` while restarts are off."""
        return self._idle_decay if self._restart is None else self._restart.decay

    @property
    def cap(self) -> float | None:
        """The settings' cap (``None``: uncapped, or restarts off)."""
        return None if self._restart is None else self._restart.cap

    @property
    def restarts(self) -> int:
        """How many codes were restarted so far (reading it synchronises with the device)."""
        return int(self.restart_count)

    def usage_decay(self, tokens: Tensor | float) -> Tensor | float:
        """The decay of the running usage for a training batch of ``tokens`` tokens (over every process): ``decay`` as
        given, or for ``"auto"`` ``1 - tokens / (K * 64)`` clipped to ``[0.9, 0.97]``, so that the running count
        remembers at least 64 tokens per code where 33 batches hold them: 0.9 up to 6.4 codes per token of a batch
        (K = 512 and 1024 at 8,192 tokens), 0.969 at K = 4096, 0.97 beyond. A tensor ``tokens`` gives a tensor (no
        host-device sync)."""
        if self.decay != "auto":
            return self.decay
        fraction = tokens / (self.num_codes * USAGE_MEMORY_TOKENS)
        if isinstance(fraction, Tensor):
            return (1.0 - fraction).clamp(min=USAGE_DECAY_FLOOR, max=USAGE_DECAY_CEILING)
        return min(USAGE_DECAY_CEILING, max(USAGE_DECAY_FLOOR, 1.0 - fraction))

    @torch.no_grad()
    def update(self, counts: Tensor) -> None:
        """Fold a training batch's ``counts (K,)`` (:func:`code_counts`, summed over processes) into the usage."""
        if self.decay == "auto":
            decay = self.usage_decay(counts.sum())
            # where the floor holds, the arithmetic of a fixed decay of 0.9 (Python scalars): batches where "auto" is
            # 0.9 update bit for bit as a decay of 0.9 given; a smaller batch (an epoch's ragged last one) gets its own
            floor = self.usage * USAGE_DECAY_FLOOR + counts * (1.0 - USAGE_DECAY_FLOOR)
            running = torch.where(decay > USAGE_DECAY_FLOOR, self.usage * decay + counts * (1.0 - decay), floor)
        else:
            running = self.usage * self.decay + counts * (1.0 - self.decay)
        self.usage.copy_(torch.where((self.usage < 0).any(), counts, running))

    @torch.no_grad()
    def restart_(self, codebook: Tensor, z: Tensor) -> Tensor:
        """Move the rows of ``codebook (K, D)`` whose usage is below the threshold in effect (at most ``cap`` times
        the mean usage) onto random tokens of ``z (N, D)``, in place; returns the ``(K,)`` mask of moved rows."""
        threshold: float | Tensor = self.threshold
        if self.cap is not None:
            threshold = torch.clamp(self.cap * self.usage.sum() / self.num_codes, max=self.threshold)
        dead = restart_dead_codes_(codebook, self.usage, z, threshold)
        self.restart_count.add_(dead.sum())
        return dead

    def extra_repr(self) -> str:
        return f"num_codes={self.num_codes}, threshold={self.threshold:g}, decay={self.decay}, cap={self.cap}"
