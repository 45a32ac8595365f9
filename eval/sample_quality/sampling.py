"""Samples of a prior decoded by its VQ-VAE, a VQ-VAE's reconstructions, and the class-conditional prior of the
sample-quality study (the rate-distortion study's prior settings, trained with label dropout for guidance)."""

from __future__ import annotations

from typing import Any

import lightning as L
import torch
from torch.utils.data import DataLoader, TensorDataset

from eval import harness
from softvq.models import VQVAE
from softvq.models.prior import CodePrior
from softvq.models.transformer import PriorConfig


@torch.no_grad()
def draw(vqvae: VQVAE, prior: CodePrior, n: int, temperature: float, seed: int, labels: torch.Tensor | None = None,
         guidance: float = 1.0, batch: int = 1000) -> torch.Tensor:
    """``n`` decoded samples ``(n, 3, 32, 32)`` in ``[0, 1]``, drawn in batches with one seeded generator."""
    g = torch.Generator().manual_seed(seed)
    images = []
    for start in range(0, n, batch):
        y = None if labels is None else labels[start:start + batch]
        codes = prior.sample(min(batch, n - start), y, temperature=temperature, generator=g, guidance=guidance)
        images.append(vqvae.decode_indices(codes).clamp(0, 1))
    return torch.cat(images)


@torch.no_grad()
def reconstruct(vqvae: VQVAE, images: torch.Tensor, batch: int = 500) -> torch.Tensor:
    """The decoded hard codes of ``images (N, 3, 32, 32)``, in ``[0, 1]``."""
    return torch.cat([vqvae.decode_indices(vqvae.encode(images[i:i + batch])).clamp(0, 1)
                      for i in range(0, len(images), batch)])


def fit_conditional_prior(codes: torch.Tensor, labels: torch.Tensor, settings: dict[str, Any], num_codes: int
                          ) -> CodePrior:
    """The study's prior (the same settings) trained class-conditionally with label dropout 0.1 (the default)."""
    grid = tuple(codes.shape[1:])
    config = PriorConfig(num_codes=num_codes, height=grid[0], width=grid[1], num_classes=10,
                         layers=settings["layers"], heads=settings["heads"], dim=settings["dim"],
                         dropout=settings["dropout"])
    L.seed_everything(settings["seed"], workers=True, verbose=False)
    prior = CodePrior(config, lr=settings["lr"], weight_decay=settings["weight_decay"],
                      warmup_steps=settings["warmup_steps"])
    loader = DataLoader(TensorDataset(codes, labels), batch_size=settings["batch_size"], shuffle=True,
                        generator=torch.Generator().manual_seed(settings["seed"]))
    with harness.study_run():
        L.Trainer(max_epochs=settings["epochs"], accelerator="cpu", logger=False, enable_checkpointing=False,
                  enable_progress_bar=False, enable_model_summary=False, limit_val_batches=0).fit(prior, loader)
    return prior.eval()
