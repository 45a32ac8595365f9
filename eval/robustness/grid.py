"""The grid of :mod:`eval.robustness`: its settings, the configurations (each a constructor template that
:func:`build` evaluates, so the report prints the call that ran) and the optimizers."""

from __future__ import annotations

import dataclasses
import math
from typing import Any

import torch
from torch import nn

import softvq
from eval.peers import fsq_levels

ALPHA = 10.0  # weight of the quantizer's loss, as in eval.dropin
VAL_SIZE = 5000  # held out of training, as the project's trainer does; not read here
COLLAPSE = 0.5  # test utilization below this is listed as a collapse


@dataclasses.dataclass(frozen=True)
class Setting:
    """One point of the grid. ``dataset`` is ``"cifar10"`` or ``"cifar10-gray"`` (luminance, repeated on the three
    channels so that the model is unchanged)."""

    num_codes: int = 512
    dim: int = 32
    optimizer: str = "adam"
    batch_size: int = 128
    encoder_scale: float = 1.0
    bf16: bool = False
    dataset: str = "cifar10"

    def __post_init__(self) -> None:
        if self.optimizer not in OPTIMIZERS:
            raise ValueError(f"unknown optimizer {self.optimizer!r}; choose from {sorted(OPTIMIZERS)}")
        if self.dataset not in ("cifar10", "cifar10-gray"):
            raise ValueError(f"unknown dataset {self.dataset!r}; choose 'cifar10' or 'cifar10-gray'")
        if self.num_codes < 2 or self.dim < 1 or self.batch_size < 1 or not self.encoder_scale > 0:
            raise ValueError(f"bad setting {self}")


# The optimizer calls, as a user writes them, on every parameter of the model.
OPTIMIZERS = {
    "adam": "torch.optim.Adam(model.parameters(), lr=3e-4)",
    "adamw": "torch.optim.AdamW(model.parameters(), lr=1e-3)",
    "sgd": "torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)",
}

BASE = Setting()
# id -> (what changes, the setting). Ids are file names.
SETTINGS: dict[str, tuple[str, Setting]] = {
    "base": ("base", BASE),
    "k64": ("K = 64", dataclasses.replace(BASE, num_codes=64)),
    "k4096": ("K = 4096", dataclasses.replace(BASE, num_codes=4096)),
    "d8": ("D = 8", dataclasses.replace(BASE, dim=8)),
    "d128": ("D = 128", dataclasses.replace(BASE, dim=128)),
    "adamw": ("AdamW 1e-3", dataclasses.replace(BASE, optimizer="adamw")),
    "sgd": ("SGD 0.05, momentum 0.9", dataclasses.replace(BASE, optimizer="sgd")),
    "batch16": ("batches of 16", dataclasses.replace(BASE, batch_size=16)),
    "batch256": ("batches of 256", dataclasses.replace(BASE, batch_size=256)),
    "scale0.01": ("encoder output x0.01", dataclasses.replace(BASE, encoder_scale=0.01)),
    "scale100": ("encoder output x100", dataclasses.replace(BASE, encoder_scale=100.0)),
    "bf16": ("bf16 autocast", dataclasses.replace(BASE, bf16=True)),
    "gray": ("grayscale CIFAR-10", dataclasses.replace(BASE, dataset="cifar10-gray")),
    "batch16_k4096": ("batches of 16, K = 4096", dataclasses.replace(BASE, batch_size=16, num_codes=4096)),
    "sgd_d128": ("SGD, D = 128", dataclasses.replace(BASE, optimizer="sgd", dim=128)),
}

# id -> (label, role, calling convention of eval.dropin.SmallAutoencoder, constructor template). The role says
# what the configuration is: a library's defaults, its documented recipe, or both (a method whose documentation
# gives one configuration). {K}, {D} and {levels} are filled in per setting.
CONFIGS: dict[str, tuple[str, str, str, str]] = {
    "ddcl": ("softvq DDCLQuantizer", "defaults = recipe", "ddcl",
             "softvq.DDCLQuantizer({K}, {D}, channel_first=True)"),
    "hard": ("softvq HardVQ", "defaults", "hard", "softvq.HardVQ({K}, {D})"),
    "hard_recipe": ("softvq HardVQ, EMA + restart", "recipe", "hard",
                    "softvq.HardVQ({K}, {D}, ema_decay=0.99, restart=softvq.Restart(1.0, decay=0.99, cap=None))"),
    "vqp_vq": ("vqp VectorQuantize", "defaults", "vqp_vq",
               "VectorQuantize(dim={D}, codebook_size={K}, accept_image_fmap=True)"),
    "vqp_vq_recipe": ("vqp VectorQuantize, README recipe", "recipe", "vqp_vq",
                      "VectorQuantize(dim={D}, codebook_size={K}, accept_image_fmap=True, kmeans_init=True, "
                      "kmeans_iters=10, threshold_ema_dead_code=2, rotation_trick=True)"),
    "vqp_fsq": ("vqp FSQ, the paper's levels", "defaults = recipe", "vqp_fsq",
                "FSQ(levels={levels}, dim={D}, channel_first=True)"),
    "vqp_simvq": ("vqp SimVQ, its README example", "defaults = recipe", "vqp_simvq",
                  "SimVQ(dim={D}, codebook_size={K}, channel_first=True)"),
}
NEEDS_VQP = {key for key, (_, _, _, template) in CONFIGS.items() if not template.startswith("softvq.")}


def constructor(config: str, num_codes: int, dim: int) -> str:
    """The Python call that builds ``config`` for ``num_codes`` codes of dimension ``dim``, as the report prints it."""
    if config not in CONFIGS:
        raise ValueError(f"unknown configuration {config!r}; choose from {tuple(CONFIGS)}")
    template = CONFIGS[config][3]
    levels = fsq_levels(num_codes) if "{levels}" in template else None
    return template.format(K=num_codes, D=dim, levels=levels)


def build(config: str, num_codes: int, dim: int) -> tuple[nn.Module, int, str]:
    """``(quantizer, codebook size, the call that built it)``. The call is evaluated, so the report's constructor is
    the one that ran. FSQ's codebook size is the product of its levels."""
    call = constructor(config, num_codes, dim)
    namespace: dict[str, Any] = {"softvq": softvq}
    if config in NEEDS_VQP:
        try:
            import vector_quantize_pytorch as vqp
        except ImportError as err:
            raise SystemExit("vector-quantize-pytorch is not installed: pip install -e '.[bench]'") from err
        namespace.update(VectorQuantize=vqp.VectorQuantize, FSQ=vqp.FSQ, SimVQ=vqp.SimVQ)
    module = eval(call, {"__builtins__": {}}, namespace)  # our own template, never text from a file
    size = math.prod(fsq_levels(num_codes)) if CONFIGS[config][2] == "vqp_fsq" else num_codes
    return module, size, call


def make_optimizer(name: str, model: nn.Module) -> torch.optim.Optimizer:
    return eval(OPTIMIZERS[name], {"__builtins__": {}}, {"torch": torch, "model": model})
