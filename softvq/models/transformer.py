"""CodeTransformer: a GPT-style causal transformer over a VQ-VAE's grid of code indices, in raster order."""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass
from typing import Any

import torch
import torch.nn.functional as F
from einops import rearrange
from torch import Tensor, nn

from softvq._checks import check_indices, check_non_negative_int, check_positive_int


@dataclass(frozen=True)
class PriorConfig:
    """The shape of a :class:`CodeTransformer`; validated on construction.

    The sequence is the ``height x width`` code grid read row by row (raster order), ``L = height * width`` codes.
    """

    num_codes: int  # K: the VQ-VAE's codebook size, the prior's vocabulary
    height: int = 8  # h: rows of the latent grid (32x32 images, 2 stride-2 layers -> 8)
    width: int = 8  # w: columns of the latent grid
    num_classes: int = 0  # 0: unconditional (one learned start token); C > 0: one start token per class label
    # With num_classes > 0: one more start token, the null class, for classifier-free guidance (the prior is trained
    # with labels dropped to it, and samples mix in its unconditional logits). False: priors saved before it existed.
    null_class: bool = True
    layers: int = 4  # transformer blocks
    heads: int = 4  # attention heads per block; must divide dim
    dim: int = 256  # model width (embedding size)
    mlp_ratio: int = 4  # hidden width of each block's MLP, in multiples of dim
    dropout: float = 0.1  # on the embeddings, the attention weights and both residual branches

    def __post_init__(self) -> None:
        for name in ("num_codes", "height", "width", "layers", "heads", "dim", "mlp_ratio"):
            check_positive_int(name, getattr(self, name))
        check_non_negative_int("num_classes", self.num_classes)
        if self.num_codes < 2:
            raise ValueError(f"num_codes must be at least 2, got {self.num_codes}")
        if self.dim % self.heads:
            raise ValueError(f"heads must divide dim, got dim={self.dim} and heads={self.heads}")
        if not 0.0 <= float(self.dropout) < 1.0:
            raise ValueError(f"dropout must be in [0, 1), got {self.dropout!r}")

    @property
    def has_null_class(self) -> bool:
        """Whether the start tokens include the null class (row ``num_classes``): a guided conditional prior."""
        return self.num_classes > 0 and bool(self.null_class)

    @property
    def length(self) -> int:
        """``L = height * width``, the number of code positions."""
        return self.height * self.width

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


class KVCache:
    """One attention layer's keys and values of the positions decoded so far, preallocated for the whole sequence.

    Sampling decodes one position at a time; with the cache each step computes the new position's query, key and
    value only and attends over the stored ones, ``O(L)`` work per step instead of re-running the prefix (``O(L^2)``).
    """

    def __init__(self, batch: int, heads: int, length: int, head_dim: int, device: torch.device,
                 dtype: torch.dtype) -> None:
        self.keys = torch.empty(batch, heads, length, head_dim, device=device, dtype=dtype)
        self.values = torch.empty_like(self.keys)
        self.size = 0  # positions stored

    def append(self, k: Tensor, v: Tensor) -> tuple[Tensor, Tensor]:
        """Store ``k, v (B, H, 1, E)`` of the next position; return every stored key and value ``(B, H, size, E)``."""
        if self.size >= self.keys.shape[2]:
            raise ValueError(f"the cache holds {self.keys.shape[2]} positions, the sequence length; it is full")
        self.keys[:, :, self.size] = k[:, :, 0]
        self.values[:, :, self.size] = v[:, :, 0]
        self.size += 1
        return self.keys[:, :, : self.size], self.values[:, :, : self.size]


class CausalSelfAttention(nn.Module):
    """Multi-head self-attention in which position ``i`` attends to positions ``<= i`` only.

    Args:
        dim: token width ``D``.
        heads: attention heads (``D`` divisible by it).
        dropout: dropout on the attention weights (training only) and on the output projection.
    """

    def __init__(self, dim: int, heads: int, dropout: float) -> None:
        super().__init__()
        self.heads = heads
        self.dropout = dropout
        self.qkv = nn.Linear(dim, 3 * dim)
        self.proj = nn.Linear(dim, dim)
        self.proj_dropout = nn.Dropout(dropout)

    def forward(self, x: Tensor, cache: KVCache | None = None) -> Tensor:
        """``x (B, T, D)`` -> ``(B, T, D)``. With ``cache``, ``x`` is the next position alone (``T = 1``): it attends
        over the cached positions and itself, and its key and value join the cache."""
        q, k, v = rearrange(self.qkv(x), "b t (three h e) -> three b h t e", three=3, h=self.heads)
        if cache is None:
            y = F.scaled_dot_product_attention(q, k, v, dropout_p=self.dropout if self.training else 0.0,
                                               is_causal=True)
        else:
            if x.shape[1] != 1:
                raise ValueError(f"a cached step decodes one position, got {x.shape[1]}")
            k, v = cache.append(k, v)
            y = F.scaled_dot_product_attention(q, k, v)  # one query: every stored position is in its past
        return self.proj_dropout(self.proj(rearrange(y, "b h t e -> b t (h e)")))


class Block(nn.Module):
    """Pre-norm transformer block: ``x + attn(ln(x))``, then ``x + mlp(ln(x))``."""

    def __init__(self, dim: int, heads: int, mlp_ratio: int, dropout: float) -> None:
        super().__init__()
        self.ln_attn = nn.LayerNorm(dim)
        self.attn = CausalSelfAttention(dim, heads, dropout)
        self.ln_mlp = nn.LayerNorm(dim)
        self.mlp = nn.Sequential(nn.Linear(dim, mlp_ratio * dim), nn.GELU(), nn.Linear(mlp_ratio * dim, dim),
                                 nn.Dropout(dropout))

    def forward(self, x: Tensor, cache: KVCache | None = None) -> Tensor:
        x = x + self.attn(self.ln_attn(x), cache)
        return x + self.mlp(self.ln_mlp(x))


class CodeTransformer(nn.Module):
    """An autoregressive model of code grids: ``p(c) = prod_i p(c_i | c_<i, class)`` in raster order.

    The input sequence is a start token (one learned embedding, or one per class when ``num_classes > 0``, plus the
    null class of classifier-free guidance) followed by the codes, each plus a learned position embedding. The output
    at position ``i`` is the distribution of code ``i`` given the start token and codes ``0 .. i-1``.

    Args:
        config: a :class:`PriorConfig`.
    """

    def __init__(self, config: PriorConfig) -> None:
        super().__init__()
        self.config = config
        c = config
        self.code_embedding = nn.Embedding(c.num_codes, c.dim)
        # row y: the start token of class y; row num_classes: the null class (config.has_null_class)
        self.start_embedding = nn.Embedding(max(c.num_classes, 1) + int(c.has_null_class), c.dim)
        self.position_embedding = nn.Parameter(torch.zeros(c.length, c.dim))
        self.dropout = nn.Dropout(c.dropout)
        self.blocks = nn.ModuleList(Block(c.dim, c.heads, c.mlp_ratio, c.dropout) for _ in range(c.layers))
        self.ln_out = nn.LayerNorm(c.dim)
        self.head = nn.Linear(c.dim, c.num_codes)
        self.apply(self._init_weights)
        for name, param in self.named_parameters():  # GPT-2: residual projections scaled by the depth
            if name.endswith(("attn.proj.weight", "mlp.2.weight")):
                nn.init.normal_(param, std=0.02 / math.sqrt(2 * c.layers))
        nn.init.normal_(self.position_embedding, std=0.02)

    @staticmethod
    def _init_weights(module: nn.Module) -> None:
        if isinstance(module, nn.Linear):
            nn.init.normal_(module.weight, std=0.02)
            nn.init.zeros_(module.bias)
        elif isinstance(module, nn.Embedding):
            nn.init.normal_(module.weight, std=0.02)

    def check_labels(self, labels: Tensor | None, batch: int) -> Tensor:
        """The ``(B,)`` start-token rows: ``labels`` for a class-conditional model, zeros otherwise."""
        c = self.config
        device = self.head.weight.device
        if c.num_classes == 0:
            if labels is not None:
                raise ValueError("this prior is unconditional (num_classes=0); do not pass class labels")
            return torch.zeros(batch, dtype=torch.long, device=device)
        if labels is None:
            raise ValueError(f"this prior is class-conditional ({c.num_classes} classes); pass labels of shape (B,)")
        if labels.shape != (batch,):
            raise ValueError(f"expected labels of shape ({batch},), got {tuple(labels.shape)}")
        check_indices(labels, c.num_classes)
        return labels.to(device=device, dtype=torch.long)

    def start_tokens(self, labels: Tensor | None, batch: int, null: bool = False) -> Tensor:
        """The ``(B, D)`` start tokens: of ``labels`` (see :meth:`check_labels`), or with ``null`` of the null class
        (``labels`` must then be ``None``): the unconditional model of a guided conditional prior."""
        if not null:
            return self.start_embedding(self.check_labels(labels, batch))
        if not self.config.has_null_class:
            raise ValueError("this prior has no null class (unconditional, or saved before classifier-free guidance "
                             "existed): it has no unconditional model to guide with")
        if labels is not None:
            raise ValueError("pass labels=None with null=True: the null class replaces every label")
        rows = torch.full((batch,), self.config.num_classes, dtype=torch.long, device=self.head.weight.device)
        return self.start_embedding(rows)

    def forward(self, codes: Tensor, labels: Tensor | None = None, null: bool = False) -> Tensor:
        """Next-code logits for code sequences or their prefixes.

        Args:
            codes: ``(B, t)`` integer codes in ``[0, K)``, ``0 <= t <= L``, raster order (``(B, h, w)`` grids are
                flattened row by row). For training pass whole sequences (``t = L``).
            labels: ``(B,)`` class labels for a class-conditional model, ``None`` for an unconditional one.
            null: start from the null class instead of ``labels`` (a guided conditional prior's unconditional model).

        Returns:
            ``(B, min(t + 1, L), K)`` logits: row ``i`` is the distribution of code ``i`` given codes ``< i``. For a
            whole sequence that is every position (the last code is never an input); for a prefix of length
            ``t < L`` the last row predicts the next code ``t``.
        """
        c = self.config
        if codes.ndim == 3:
            if codes.shape[1:] != (c.height, c.width):
                raise ValueError(f"expected a code grid of shape (B, {c.height}, {c.width}), "
                                 f"got {tuple(codes.shape)}")
            codes = rearrange(codes, "b h w -> b (h w)")
        if codes.ndim != 2 or codes.shape[1] > c.length:
            raise ValueError(f"expected codes of shape (B, t) with t <= {c.length} or (B, {c.height}, {c.width}), "
                             f"got {tuple(codes.shape)}")
        check_indices(codes, c.num_codes)
        start = self.start_tokens(labels, codes.shape[0], null)[:, None]  # (B, 1, D)
        inputs = codes[:, : c.length - 1].to(self.head.weight.device, torch.long)
        x = torch.cat([start, self.code_embedding(inputs)], dim=1)  # (B, T, D), T = min(t + 1, L)
        x = self.dropout(x + self.position_embedding[: x.shape[1]])
        for block in self.blocks:
            x = block(x)
        return self.head(self.ln_out(x))  # (B, T, K)


    def new_cache(self, batch: int) -> list[KVCache]:
        """Empty key/value caches, one per block, for decoding ``batch`` sequences with :meth:`step`."""
        c = self.config
        weight = self.head.weight
        return [KVCache(batch, c.heads, c.length, c.dim // c.heads, weight.device, weight.dtype) for _ in self.blocks]

    def step(self, inputs: Tensor, caches: list[KVCache]) -> Tensor:
        """Decode the next position: ``inputs`` are the start tokens ``(B, D)`` (:meth:`start_tokens`) at the first
        step, then the codes ``(B,)`` drawn at the step before; ``caches`` from :meth:`new_cache`. Returns the
        ``(B, K)`` logits of the next code: what :meth:`forward` gives at that position, in eval mode."""
        position = caches[0].size
        if position >= self.config.length:
            raise ValueError(f"all {self.config.length} positions are decoded")
        if position == 0:
            x = inputs
        else:
            check_indices(inputs, self.config.num_codes)
            x = self.code_embedding(inputs.to(self.head.weight.device, torch.long))
        x = self.dropout(x + self.position_embedding[position])[:, None]  # (B, 1, D)
        for block, cache in zip(self.blocks, caches, strict=True):
            x = block(x, cache)
        return self.head(self.ln_out(x))[:, 0]
