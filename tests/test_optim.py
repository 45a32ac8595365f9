"""param_groups: the prototypes' learning rate is lr / eps."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from softvq import DDCLQuantizer, HardVQ, param_groups
from softvq.optim import has_trainable_prototypes


class Tiny(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.encoder = nn.Linear(3, 4)
        self.quantizer = DDCLQuantizer(8, 4, prototype_update="gradient")
        self.decoder = nn.Linear(4, 3)


def test_prototypes_get_lr_over_eps_and_no_weight_decay():
    model = Tiny()
    groups = param_groups(model, lr=3e-4, eps=0.05, weight_decay=0.01)
    by_name = {g["name"]: g for g in groups}
    assert by_name["prototypes"]["params"] == [model.quantizer.prototypes]
    assert by_name["prototypes"]["lr"] == pytest.approx(3e-4 / 0.05)
    assert by_name["prototypes"]["weight_decay"] == 0.0
    assert by_name["model"]["lr"] == 3e-4 and by_name["model"]["weight_decay"] == 0.01
    every = [p for g in groups for p in g["params"]]
    assert len(every) == len(list(model.parameters())) == len({id(p) for p in every})
    optimizer = torch.optim.Adam(groups)
    assert optimizer.param_groups[1]["lr"] == pytest.approx(6e-3)


def test_frozen_parameters_are_left_out():
    model = Tiny()
    model.encoder.requires_grad_(False)
    groups = param_groups(model, lr=1e-3, eps=0.1)
    assert sum(len(g["params"]) for g in groups) == 3  # quantizer prototypes + decoder weight and bias


@pytest.mark.parametrize("kwargs,match", [({"lr": 0}, "lr"), ({"eps": -0.1}, "eps"),
                                          ({"weight_decay": -1}, "weight_decay")])
def test_invalid_arguments(kwargs, match):
    with pytest.raises(ValueError, match=match):
        param_groups(Tiny(), **{"lr": 1e-3, **kwargs})


def test_model_without_ddcl_is_an_error():
    with pytest.raises(ValueError, match="no trainable DDCLQuantizer"):
        param_groups(nn.Sequential(nn.Linear(2, 2), HardVQ(4, 2)), lr=1e-3)


def test_has_trainable_prototypes_matches_what_param_groups_accepts():
    ddcl = nn.Sequential(nn.Linear(4, 4), DDCLQuantizer(8, 4, prototype_update="gradient"))
    assert not has_trainable_prototypes(nn.Sequential(DDCLQuantizer(8, 4)))  # the default: the layer moves them
    assert has_trainable_prototypes(ddcl)
    hard = nn.Sequential(nn.Linear(4, 4), HardVQ(8, 4))
    assert not has_trainable_prototypes(hard)
    with pytest.raises(ValueError, match="no trainable DDCLQuantizer prototypes"):
        param_groups(hard, lr=1e-3)
    ddcl[1].prototypes.requires_grad_(False)
    assert not has_trainable_prototypes(ddcl)
