"""Training steps that are not "one forward, then its backward": what :class:`softvq.DDCLQuantizer` does when its
forward pass is recomputed during backward (activation checkpointing, ``torch.utils.checkpoint``).

A training forward pass changes the layer's state after it has read it (EMA prototypes, restarts, the temperature
control, the standardiser's running moments, the first batch's initialisation). A checkpointed forward pass runs a
second time during backward, after those changes: without help it would see the moved prototypes and the next
temperature, and change the state a second time. So every eager training forward keeps a :class:`ForwardRecord` of
the prototypes and the temperature it used until its backward has run, and a forward pass made during backward (a
recomputation) replays the newest record whose backward has not run yet, and changes nothing.

Why the newest: autograd runs the backward of a later forward pass before that of an earlier one (its nodes have
higher sequence numbers and run first once ready), so with several checkpointed calls pending, the recomputation
that comes first is the one of the latest call. Records of forward passes that never get a backward (a training-mode
call under ``torch.no_grad()``, or a loss that is dropped) are kept only up to :data:`LIMIT`.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor

LIMIT = 4  # records kept of forward passes whose backward has not run (each holds a (K, D) copy of the prototypes)


class ForwardRecord:
    """What one training forward pass read: ``prototypes`` (a copy, ``(K, D)``) and ``temperature`` (the ``()``
    tensor, never written in place). ``done`` is set once its backward has run or a recomputation replayed it."""

    __slots__ = ("prototypes", "temperature", "done")

    def __init__(self, prototypes: Tensor, temperature: Tensor) -> None:
        self.prototypes = prototypes
        self.temperature = temperature
        self.done = False


class ForwardRecords:
    """The records of recent training forward passes, oldest first."""

    def __init__(self) -> None:
        self._records: list[ForwardRecord] = []

    def push(self, prototypes: Tensor, temperature: Tensor) -> ForwardRecord:
        record = ForwardRecord(prototypes.detach().clone(), temperature)
        self._records = [r for r in self._records if not r.done][-(LIMIT - 1):] + [record]
        return record

    def replay(self) -> ForwardRecord | None:
        """The newest record whose backward has not run, marked done (``None`` if there is none)."""
        for record in reversed(self._records):
            if not record.done:
                record.done = True
                return record
        return None

    def __len__(self) -> int:
        return sum(not r.done for r in self._records)

    def __deepcopy__(self, memo: dict[int, Any]) -> ForwardRecords:
        return ForwardRecords()  # a copy of a layer has run no forward pass


def in_backward() -> bool:
    """Whether autograd's engine is running a backward pass in this thread: a forward pass called now is a
    recomputation (``torch.utils.checkpoint``, reentrant or not)."""
    return torch._C._current_graph_task_id() != -1


class _ValueOf(torch.autograd.Function):
    """``value`` in the forward pass (bit for bit) with the gradient routed to ``source``: a recomputed forward pass
    computes with the prototypes the first pass used, while a reentrant checkpoint's backward still reaches the
    parameter."""

    @staticmethod
    def forward(ctx: Any, source: Tensor, value: Tensor) -> Tensor:  # type: ignore[override]
        return value.clone()

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[Tensor, None]:  # type: ignore[override]
        return grad, None


def replayed_prototypes(source: Tensor, record: ForwardRecord) -> Tensor:
    """The prototypes of ``record`` in value, differentiable with respect to ``source`` (the layer's parameter)."""
    value = record.prototypes.to(source.dtype)
    return _ValueOf.apply(source, value) if source.requires_grad else value
