"""The readouts that ``eval/readout/`` trains on frozen VQ-VAE latents, and their training loop.

Every readout maps a batch of frozen tokens ``(B, T, D)`` and their hard code indices ``(B, T)`` to class logits
``(B, C)`` and an auxiliary loss (0 where there is none). Linear probes standardise their features with a
``BatchNorm1d`` without affine parameters (a fixed rescaling at test time), as is usual for linear probes, so
that Adam sees features of comparable scale whatever the latent scale of the checkpoint.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

import softvq
from softvq import DDCLQuantizer, DDCLReadout
from softvq.optim import has_trainable_prototypes

READOUTS = ("mean", "histogram", "ddcl_frozen", "ddcl_finetuned", "transformer_cls", "transformer_ddcl")
LABELS = {
    "mean": "(a) mean-pool + linear probe",
    "histogram": "(b) hard-VQ code histogram + linear probe",
    "ddcl_frozen": "(c) DDCLReadout, reused codebook frozen + linear head",
    "ddcl_finetuned": "(d) DDCLReadout, reused codebook fine-tuned + linear head",
    "transformer_cls": "(e) 2-layer transformer + CLS token",
    "transformer_ddcl": "(f) 2-layer transformer + DDCLReadout (64 new prototypes)",
}
# (f)'s readout: new prototypes on the transformer's output (initialised from its first batch), one per token of
# the 8x8 grid, at the temperature of the VQ-VAE recipe for unit-variance tokens (models.vqvae.DDCL_DEFAULTS:
# squared distances between two random tokens average 2 D, T = 4 keeps about a dozen prototypes in play per token).
# The checkpoint's codebook would not fit: it lives in the input space, and its T in the input's units.
TRANSFORMER_CODES = 64
TRANSFORMER_TEMPERATURE = 4.0


def linear_probe(features: int, classes: int) -> nn.Sequential:
    return nn.Sequential(nn.BatchNorm1d(features, affine=False), nn.Linear(features, classes))


def ddcl_features(out: softvq.ReadoutOutput, length: int) -> Tensor:
    """``[pooled (D), mass / T (K), slots (K * D)]`` of a :class:`~softvq.ReadoutOutput` -> ``(B, D + K + K D)``."""
    return torch.cat([out.pooled, out.mass / length, out.slots.flatten(1)], dim=1)


class MeanProbe(nn.Module):
    """(a) The mean token, linear probe."""

    def __init__(self, dim: int, classes: int) -> None:
        super().__init__()
        self.head = linear_probe(dim, classes)

    def forward(self, tokens: Tensor, indices: Tensor) -> tuple[Tensor, Tensor]:
        return self.head(tokens.mean(1)), tokens.new_zeros(())


class HistogramProbe(nn.Module):
    """(b) The normalised histogram of the tokens' hard code indices ``(B, K)``, linear probe."""

    def __init__(self, num_codes: int, classes: int) -> None:
        super().__init__()
        self.num_codes = num_codes
        self.head = linear_probe(num_codes, classes)

    def forward(self, tokens: Tensor, indices: Tensor) -> tuple[Tensor, Tensor]:
        counts = torch.zeros(indices.shape[0], self.num_codes, device=indices.device)
        counts.scatter_add_(1, indices, torch.ones_like(indices, dtype=counts.dtype))  # (B, K)
        return self.head(counts / indices.shape[1]), tokens.new_zeros(())


class DDCLProbe(nn.Module):
    """(c, d) A :class:`~softvq.DDCLReadout` over the reused codebook, linear head on its pooled vector, soft
    code histogram and slots. The readout's DDCL loss is the auxiliary loss (it trains fine-tuned prototypes).

    Fine-tuning is by gradient only: dead-code restart is off, because a restart throws away a slot the head has
    learned to read (on a 1-epoch checkpoint: 526 restarts in 3 epochs, test accuracy 0.25 against 0.30 without).
    """

    def __init__(self, quantizer: DDCLQuantizer, classes: int, freeze: bool) -> None:
        super().__init__()
        self.readout = DDCLReadout.from_quantizer(quantizer, freeze=freeze)
        self.readout.quantizer.restart = None
        k, d = quantizer.num_codes, quantizer.dim
        self.head = linear_probe(d + k + k * d, classes)

    def forward(self, tokens: Tensor, indices: Tensor) -> tuple[Tensor, Tensor]:
        out = self.readout(tokens)
        return self.head(ddcl_features(out, tokens.shape[1])), out.loss


class TransformerReadout(nn.Module):
    """(e, f) Learned positions + a small pre-norm ``nn.TransformerEncoder`` over the tokens ``(B, T, D)``, then
    either a CLS token (``readout=None``; LayerNorm + linear head on its output) or ``readout`` (linear probe on
    its pooled vector, soft code histogram and slots, its DDCL loss added)."""

    def __init__(self, dim: int, length: int, classes: int, heads: int, layers: int,
                 readout: DDCLReadout | None) -> None:
        super().__init__()
        self.position = nn.Parameter(torch.randn(1, length, dim) * 0.02)
        layer = nn.TransformerEncoderLayer(dim, heads, dim_feedforward=4 * dim, dropout=0.1, batch_first=True,
                                           norm_first=True)
        self.encoder = nn.TransformerEncoder(layer, layers, enable_nested_tensor=False)
        self.readout = readout
        if readout is None:
            self.cls = nn.Parameter(torch.randn(1, 1, dim) * 0.02)
            self.head = nn.Sequential(nn.LayerNorm(dim), nn.Linear(dim, classes))
        else:
            self.cls = None
            self.head = linear_probe(dim + readout.num_codes * (1 + dim), classes)

    def forward(self, tokens: Tensor, indices: Tensor) -> tuple[Tensor, Tensor]:
        x = tokens + self.position
        if self.readout is None:
            h = self.encoder(torch.cat([self.cls.expand(x.shape[0], -1, -1), x], dim=1))
            return self.head(h[:, 0]), tokens.new_zeros(())
        out = self.readout(self.encoder(x))
        return self.head(ddcl_features(out, tokens.shape[1])), out.loss


def build_readout(name: str, quantizer: nn.Module, dim: int, length: int, classes: int, heads: int) -> nn.Module:
    """One of :data:`READOUTS` for tokens ``(B, length, dim)``; (c) and (d) reuse ``quantizer``'s codebook."""
    if name == "mean":
        return MeanProbe(dim, classes)
    if name == "histogram":
        return HistogramProbe(quantizer.num_codes, classes)
    if name.startswith("transformer") and dim % heads:
        raise ValueError(f"the token dimension {dim} must be a multiple of the attention heads ({heads}); "
                         f"pass another --heads")
    if name == "transformer_cls":
        return TransformerReadout(dim, length, classes, heads, 2, None)
    if name == "transformer_ddcl":
        readout = DDCLReadout(TRANSFORMER_CODES, dim, temperature=TRANSFORMER_TEMPERATURE)
        return TransformerReadout(dim, length, classes, heads, 2, readout)
    if not isinstance(quantizer, DDCLQuantizer):
        raise ValueError(f"readout {name!r} reuses a DDCL codebook, but the checkpoint's quantizer is "
                         f"{type(quantizer).__name__}; choose other --readouts")
    if name in ("ddcl_frozen", "ddcl_finetuned"):
        return DDCLProbe(quantizer, classes, freeze=name == "ddcl_frozen")
    raise ValueError(f"unknown readout {name!r}; choose from {READOUTS}")


@torch.no_grad()
def accuracy(model: nn.Module, tokens: Tensor, indices: Tensor, labels: Tensor, batch_size: int,
             device: torch.device) -> float:
    """Top-1 accuracy of ``model`` (in eval mode) on ``tokens (N, T, D)``."""
    model.eval()
    correct = 0
    for start in range(0, tokens.shape[0], batch_size):
        sl = slice(start, start + batch_size)
        logits, _ = model(tokens[sl].to(device), indices[sl].to(device))
        correct += int((logits.argmax(1) == labels[sl].to(device)).sum())
    return correct / max(tokens.shape[0], 1)


def fit(model: nn.Module, train: tuple[Tensor, Tensor, Tensor], test: tuple[Tensor, Tensor, Tensor], *,
        epochs: int, batch_size: int, lr: float, eps: float, seed: int, device: torch.device,
        on_epoch_end: Callable[[int], None] | None = None) -> dict[str, Any]:
    """Train ``model`` with Adam on ``train = (tokens, side, labels)`` (cross-entropy + its auxiliary loss) and
    return ``train_acc``, ``test_acc`` (after the last epoch; no selection on the test split), ``seconds``,
    ``params`` and, for readouts over a reused codebook, ``codebook_shift`` (relative change of the prototypes).

    ``side`` is a per-example tensor sliced with the tokens and handed to ``model(tokens, side)``: the hard code
    indices ``(N, T)`` here, the padding mask ``(N, T)`` in ``eval/paradigm1/``. ``on_epoch_end(epoch)`` (0-based)
    is called after every training epoch, before any evaluation."""
    model.to(device)
    readout = getattr(model, "readout", None)
    reused = readout is not None and readout.quantizer.initialized  # (f)'s prototypes start from its first batch
    start_codes = readout.prototypes.detach().clone() if reused else None
    trainable = [p for p in model.parameters() if p.requires_grad]
    groups = softvq.param_groups(model, lr=lr, eps=eps) if has_trainable_prototypes(model) \
        else [{"params": trainable, "lr": lr}]
    optimizer = torch.optim.Adam(groups)
    tokens, indices, labels = train
    generator = torch.Generator().manual_seed(seed)
    begin = time.perf_counter()
    for epoch in range(epochs):
        model.train()
        order = torch.randperm(tokens.shape[0], generator=generator)
        for start in range(0, tokens.shape[0], batch_size):
            batch = order[start:start + batch_size]
            if batch.numel() < 2:  # BatchNorm needs two samples
                continue
            logits, aux = model(tokens[batch].to(device), indices[batch].to(device))
            loss = F.cross_entropy(logits, labels[batch].to(device)) + aux
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            optimizer.step()
        if on_epoch_end is not None:
            on_epoch_end(epoch)
    result = {"train_acc": accuracy(model, *train, batch_size, device),
              "test_acc": accuracy(model, *test, batch_size, device),
              "seconds": time.perf_counter() - begin,
              "params": sum(p.numel() for p in trainable)}
    if start_codes is not None:
        shift = (readout.prototypes.detach() - start_codes).norm() / start_codes.norm().clamp_min(1e-12)
        result["codebook_shift"] = float(shift)
    return result
