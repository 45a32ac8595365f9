"""The settings of ``softvq-prior`` (:mod:`softvq.cli.prior`): its command name and the two dataclasses whose fields
are its flags (:class:`PriorRun` at the top level, :class:`PriorModel` under ``--model.*``). The parser that combines
them with ``--data.*`` and ``--trainer.*`` is :func:`softvq.cli.prior.build_parser`; these names are also importable
from there.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

from softvq._checks import check_float, check_non_negative_int, check_positive_int

PROG = "softvq-prior"
TRAINER_SKIP = {"compile"}  # the prior is not compiled


@dataclass
class PriorRun:
    """One prior-training command: what it models, where it writes, how long it trains.

    Args:
        vqvae: the trained VQ-VAE checkpoint (``softvq-train``'s ``<run>/checkpoints/last.ckpt``) whose code grids
            the prior models; required.
        out: output directory.
        epochs: training epochs, in total (also when resuming: pass a larger number to train on).
        batch_size: code grids per optimizer step.
        seed: seed for the weights, the data order and dropout.
        codes_cache: where the code grids are cached (default ``$SOFTVQ_CACHE/codes``, ``~/.cache/softvq/codes``).
    """

    vqvae: Path | None = None
    out: Path = Path("runs/prior")
    epochs: int = 10
    batch_size: int = 128
    seed: int = 0
    codes_cache: Path | None = None

    def __post_init__(self) -> None:
        if self.vqvae is None:
            raise ValueError("--vqvae is required: the trained VQ-VAE checkpoint whose codes the prior models")
        self.vqvae, self.out = Path(self.vqvae), Path(self.out)
        self.codes_cache = None if self.codes_cache is None else Path(self.codes_cache)
        self.epochs = check_positive_int("epochs", self.epochs)
        self.batch_size = check_positive_int("batch_size", self.batch_size)
        self.seed = int(self.seed)


@dataclass
class PriorModel:
    """The prior's transformer (:class:`~softvq.models.transformer.PriorConfig`) and its optimizer
    (:class:`~softvq.models.prior.CodePrior`).

    Args:
        class_conditional: condition on the CIFAR-10 label (one start token per class, and a null class for
            classifier-free guidance).
        label_dropout: with ``class_conditional``: share of sequences trained with the null class instead of their
            label, the unconditional model that ``softvq-sample --guidance`` mixes in; in [0, 1).
        layers: transformer blocks.
        heads: attention heads (must divide ``dim``).
        dim: model width.
        mlp_ratio: MLP hidden width, in multiples of ``dim``.
        dropout: dropout rate in [0, 1).
        lr: peak AdamW learning rate.
        weight_decay: AdamW weight decay (of the matrices).
        warmup_steps: linear warmup steps.
        min_lr_ratio: the cosine decay ends at this share of ``lr`` at the last step; in [0, 1].
        soft_targets: weight ``a`` in [0, 1] of the cross-entropy to the VQ-VAE's soft assignments in the training
            loss, ``(1 - a)`` on the hard codes' (0: hard codes only; the inputs are the hard codes either way). A
            hard quantizer's assignments are one-hot, so only a soft codebook (DDCL) gives other targets.
        soft_top_k: with ``soft_targets > 0``: the assignments kept per token (its most probable codes,
            renormalised), extracted with the codes and cached beside them.
    """

    class_conditional: bool = False
    label_dropout: float = 0.1
    layers: int = 4
    heads: int = 4
    dim: int = 256
    mlp_ratio: int = 4
    dropout: float = 0.1
    lr: float = 1e-3
    weight_decay: float = 0.01
    warmup_steps: int = 100
    min_lr_ratio: float = 0.1
    soft_targets: float = 0.0
    soft_top_k: int = 16

    def __post_init__(self) -> None:
        for name in ("layers", "heads", "dim", "mlp_ratio"):
            check_positive_int(f"model.{name}", getattr(self, name))
        if self.dim % self.heads:
            raise ValueError(f"model.heads must divide model.dim {self.dim}, got {self.heads}")
        for name in ("dropout", "label_dropout"):
            value = getattr(self, name)
            if not (isinstance(value, (int, float)) and 0.0 <= value < 1.0):
                raise ValueError(f"model.{name} must be a number in [0, 1), got {value!r}")
        self.lr = check_float("model.lr", self.lr)
        self.weight_decay = check_float("model.weight_decay", self.weight_decay, allow_zero=True)
        self.warmup_steps = check_non_negative_int("model.warmup_steps", self.warmup_steps)
        if not 0.0 <= float(self.min_lr_ratio) <= 1.0:
            raise ValueError(f"model.min_lr_ratio must be a number in [0, 1], got {self.min_lr_ratio!r}")
        if not (isinstance(self.soft_targets, (int, float)) and 0.0 <= self.soft_targets <= 1.0):
            raise ValueError(f"model.soft_targets must be a number in [0, 1], got {self.soft_targets!r}")
        self.soft_top_k = check_positive_int("model.soft_top_k", self.soft_top_k)


def cfg_section(cfg: Any, cls: type) -> dict[str, Any]:
    """The top-level keys of ``cfg`` that are fields of the dataclass ``cls``."""
    return {name: cfg[name] for name in cls.__dataclass_fields__}
