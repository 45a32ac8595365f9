"""A small vision transformer for ``eval/paradigm1/``: trained on CIFAR-10 labels, then frozen as a token encoder.

The paper's first paradigm reads out a pretrained, frozen text encoder (BERT). No pretrained encoder can be downloaded
here, so this module trains one: images ``(B, 3, 32, 32)`` -> ``patch x patch`` patches -> a linear patch embedding
-> a CLS token and learned positions -> a pre-norm ``nn.TransformerEncoder`` -> a final LayerNorm. Its
:meth:`ViT.tokens` returns what a readout sees, like BERT's ``last_hidden_state``: the patch tokens
``(B, (32 / patch)^2, dim)`` and the CLS vector ``(B, dim)``. Training (Lightning) uses AdamW with a cosine learning
rate, random crops (4-pixel zero padding) and horizontal flips, and is checkpointed so a second run loads it.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass

import lightning as L
import torch
import torch.nn.functional as F
from einops import rearrange
from torch import Tensor, nn


@dataclass(frozen=True)
class ViTConfig:
    """Sizes of :class:`ViT` and its training run."""

    dim: int = 128  # token width D
    depth: int = 4  # transformer layers
    heads: int = 4  # attention heads (dim must be a multiple)
    mlp_ratio: int = 2  # feed-forward width / dim
    patch: int = 4  # patch side: 32 / 4 = 8 -> an 8x8 grid of T = 64 tokens
    classes: int = 10  # CIFAR-10
    epochs: int = 12  # training epochs (about 1 min each on 20,000 images on 2 CPU cores)
    batch_size: int = 128  # images per step
    lr: float = 1e-3  # AdamW peak learning rate (cosine decay to 0 over the run, no warm-up)
    weight_decay: float = 0.05  # AdamW weight decay


class ViT(nn.Module):
    """Patch embedding + CLS + learned positions + pre-norm transformer encoder + LayerNorm; a linear head on CLS."""

    def __init__(self, cfg: ViTConfig) -> None:
        super().__init__()
        if 32 % cfg.patch or cfg.dim % cfg.heads:
            raise ValueError(f"patch must divide 32 and heads must divide dim, got patch={cfg.patch}, "
                             f"dim={cfg.dim}, heads={cfg.heads}")
        self.cfg = cfg
        self.embed = nn.Conv2d(3, cfg.dim, cfg.patch, stride=cfg.patch)  # one linear map per patch
        length = (32 // cfg.patch) ** 2
        self.position = nn.Parameter(torch.randn(1, length + 1, cfg.dim) * 0.02)
        self.cls = nn.Parameter(torch.zeros(1, 1, cfg.dim))
        layer = nn.TransformerEncoderLayer(cfg.dim, cfg.heads, dim_feedforward=cfg.mlp_ratio * cfg.dim, dropout=0.0,
                                           activation="gelu", batch_first=True, norm_first=True)
        self.encoder = nn.TransformerEncoder(layer, cfg.depth, enable_nested_tensor=False)
        self.norm = nn.LayerNorm(cfg.dim)
        self.head = nn.Linear(cfg.dim, cfg.classes)

    def tokens(self, images: Tensor) -> tuple[Tensor, Tensor]:
        """``images (B, 3, 32, 32)`` in [0, 1] -> patch tokens ``(B, T, D)`` (row-major over the grid) and the
        CLS vector ``(B, D)``, both after the final LayerNorm (what the classifier head reads)."""
        x = rearrange(self.embed(images * 2 - 1), "b d h w -> b (h w) d")
        x = torch.cat([self.cls.expand(x.shape[0], -1, -1), x], dim=1) + self.position
        h = self.norm(self.encoder(x))  # (B, 1 + T, D)
        return h[:, 1:], h[:, 0]

    def forward(self, images: Tensor) -> Tensor:
        return self.head(self.tokens(images)[1])


def augment(images: Tensor, generator: torch.Generator | None = None) -> Tensor:
    """Random 32x32 crops of the images zero-padded by 4 pixels, and random horizontal flips, per image."""
    b = images.shape[0]
    padded = F.pad(images, (4, 4, 4, 4))
    dx, dy = torch.randint(0, 9, (2, b), generator=generator).tolist()
    out = torch.stack([padded[i, :, y:y + 32, x:x + 32] for i, (x, y) in enumerate(zip(dx, dy, strict=True))])
    flip = torch.rand(b, generator=generator) < 0.5
    out[flip] = out[flip].flip(-1)
    return out


class ViTClassifier(L.LightningModule):
    """Lightning wrapper: cross-entropy on augmented images, stage-prefixed logs."""

    def __init__(self, cfg: dict, steps: int) -> None:
        super().__init__()
        self.save_hyperparameters()
        self.cfg = ViTConfig(**cfg)
        self.model = ViT(self.cfg)
        self.steps = steps

    def _common_step(self, batch: tuple[Tensor, Tensor], stage: str) -> Tensor:
        x, y = batch
        if stage == "train":
            x = augment(x)
        logits = self.model(x)
        loss = F.cross_entropy(logits, y)
        self.log(f"{stage}/loss", loss, prog_bar=True)
        self.log(f"{stage}/acc", (logits.argmax(1) == y).float().mean(), prog_bar=True)
        return loss

    def training_step(self, batch: tuple[Tensor, Tensor], batch_idx: int) -> Tensor:
        return self._common_step(batch, "train")

    def configure_optimizers(self):
        optimizer = torch.optim.AdamW(self.parameters(), lr=self.cfg.lr, weight_decay=self.cfg.weight_decay)

        def cosine(step: int) -> float:
            return 0.5 * (1 + math.cos(math.pi * min(step, self.steps) / self.steps))

        schedule = torch.optim.lr_scheduler.LambdaLR(optimizer, cosine)
        return {"optimizer": optimizer, "lr_scheduler": {"scheduler": schedule, "interval": "step"}}


def train_vit(cfg: ViTConfig, train_set: torch.utils.data.Dataset, seed: int, num_workers: int,
              progress: bool = False) -> ViT:
    """Train a :class:`ViT` on ``train_set`` (images, labels) with Lightning on the CPU or one GPU; returns it in
    eval mode with gradients off (frozen)."""
    L.seed_everything(seed, workers=True, verbose=False)
    loader = torch.utils.data.DataLoader(train_set, batch_size=cfg.batch_size, shuffle=True, num_workers=num_workers,
                                         drop_last=True, persistent_workers=num_workers > 0,
                                         generator=torch.Generator().manual_seed(seed))
    module = ViTClassifier(asdict(cfg), steps=cfg.epochs * len(loader))
    trainer = L.Trainer(max_epochs=cfg.epochs, devices=1, logger=False, enable_checkpointing=False,
                        enable_progress_bar=progress, enable_model_summary=False, deterministic=False)
    trainer.fit(module, loader)
    model = module.model.eval()
    model.requires_grad_(False)
    return model
