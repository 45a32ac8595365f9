"""Optimizer parameter groups that realise DDCL's timescale separation (the paper's Theorem 1; docs/design.md,
"The recipe inside the layer": ``recipe="plain"`` and ``prototype_update="gradient"``)."""

from __future__ import annotations

from typing import Any

from torch import nn

from softvq._checks import check_float
from softvq.ddcl import DDCLQuantizer


def _trainable_prototype_ids(model: nn.Module) -> set[int]:
    return {id(m.prototypes) for m in model.modules() if isinstance(m, DDCLQuantizer) and m.prototypes.requires_grad}


def has_trainable_prototypes(model: nn.Module) -> bool:
    """Whether ``model`` holds a :class:`~softvq.DDCLQuantizer` with trainable prototypes (what
    :func:`param_groups` needs)."""
    return bool(_trainable_prototype_ids(model))


def param_groups(model: nn.Module, lr: float, eps: float = 0.1, weight_decay: float = 0.0) -> list[dict[str, Any]]:
    """Split ``model``'s trainable parameters into encoder/decoder and DDCL-prototype groups.

    The prototypes of every :class:`~softvq.DDCLQuantizer` inside ``model`` get learning rate ``lr / eps`` and
    no weight decay; every other parameter gets ``lr`` and ``weight_decay``. ``eps = eta_theta / eta_P`` is the
    paper's timescale ratio: prototypes must learn faster than the encoder, ``eps`` in ``[0.01, 0.1]`` is the
    recommended stable range, and ``eps = 1`` collapsed in the paper's ablation.

    Example:
        >>> optimizer = torch.optim.Adam(softvq.param_groups(model, lr=3e-4, eps=0.1))

    Raises:
        ValueError: on a non-positive ``lr``/``eps``, a negative ``weight_decay``, or a model without any
            trainable DDCL prototypes (``eps`` would silently do nothing).
    """
    lr = check_float("lr", lr)
    eps = check_float("eps", eps)
    weight_decay = check_float("weight_decay", weight_decay, allow_zero=True)
    prototype_ids = _trainable_prototype_ids(model)
    if not prototype_ids:
        raise ValueError(f"model ({type(model).__name__}) holds no trainable DDCLQuantizer prototypes; "
                         f"use its plain parameters() instead")
    prototypes, others = [], []
    for p in model.parameters():
        if p.requires_grad:
            (prototypes if id(p) in prototype_ids else others).append(p)
    groups = [{"params": prototypes, "lr": lr / eps, "weight_decay": 0.0, "name": "prototypes"}]
    if others:
        groups.insert(0, {"params": others, "lr": lr, "weight_decay": weight_decay, "name": "model"})
    return groups
