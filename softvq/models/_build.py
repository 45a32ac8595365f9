"""How a :class:`~softvq.models.VQVAE` builds its parts: the quantizer (one codebook, a hierarchy, a residual stack
or a module given) and the autoencoder around it (encoder, decoder, latent norm). The quantizer names and defaults
are ``bottleneck.py``, the encoder and decoder ``autoencoder.py``.

The model calls :func:`build_quantizer_` first, then :func:`build_autoencoder_`: this order fixes the random
initialisation, the parameter order (saved optimizer states rely on it) and the state-dict keys.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from torch import nn

import softvq
from softvq._checks import check_choice, check_positive_int
from softvq.hierarchical import HierarchicalDDCL
from softvq.models._hierarchy import build_hierarchy
from softvq.models.autoencoder import Decoder, Encoder
from softvq.models.bottleneck import HIERARCHY_DEFAULTS, LATENT_NORMS, RESIDUAL_QUANTIZERS, LatentNorm, build_quantizer
from softvq.residual import is_residual


def build_quantizer_(model: nn.Module, quantizer: str | nn.Module, num_codes: int, code_dim: int,
                     quantizer_kwargs: dict[str, Any] | None, temperature_schedule: str, levels: int,
                     level_codes: int | Sequence[int], level_pool: int, num_quantizers: int) -> None:
    """Sets :attr:`quantizer` (the module), ``quantizer_name``, ``levels``, ``num_quantizers`` (residual levels),
    ``level_num_codes`` (``None`` for a single level), ``num_codes`` (level 0's) and ``is_soft``."""
    model.levels = check_positive_int("levels", levels)
    model.num_quantizers = quantizer.num_quantizers if is_residual(quantizer) else \
        check_positive_int("num_quantizers", num_quantizers)
    residual = is_residual(quantizer) or quantizer in RESIDUAL_QUANTIZERS
    if residual and (levels > 1 or temperature_schedule != "constant"):
        raise ValueError(f"a residual quantizer sums its levels on one grid, each level with its own temperature "
                         f"control: it takes neither levels > 1 (got {levels}) nor a temperature schedule (got "
                         f"{temperature_schedule!r})")
    if isinstance(quantizer, HierarchicalDDCL):
        model.levels = quantizer.num_levels
    elif levels > 1 and quantizer != "ddcl":
        name = type(quantizer).__name__ if isinstance(quantizer, nn.Module) else repr(quantizer)
        raise ValueError(f"levels={levels} stacks DDCL codebooks: it needs quantizer='ddcl', got {name}")
    if isinstance(quantizer, nn.Module):
        model.quantizer_name = type(quantizer).__name__
        model.quantizer = quantizer
    elif model.levels > 1:
        model.quantizer_name = quantizer
        model.quantizer = build_hierarchy(num_codes, code_dim, model.levels, level_codes, level_pool,
                                         {**HIERARCHY_DEFAULTS, **(quantizer_kwargs or {})})
    else:
        model.quantizer_name = quantizer
        kwargs = dict(quantizer_kwargs or {})
        if quantizer == "ddcl" and temperature_schedule != "constant":  # the schedule sets T, not the layer
            kwargs.setdefault("target_entropy", None)
        model.quantizer = build_quantizer(quantizer, num_codes, code_dim, num_quantizers=num_quantizers, **kwargs)
    several = model.levels > 1 or is_residual(model.quantizer)
    model.level_num_codes = tuple(layer.num_codes for layer in model._codebooks()) if several else None
    model.num_codes = model.level_num_codes[0] if model.level_num_codes else \
        int(getattr(model.quantizer, "num_codes", num_codes))
    if getattr(model.quantizer, "dim", code_dim) != code_dim:
        raise ValueError(f"the quantizer's dim ({model.quantizer.dim}) differs from code_dim ({code_dim})")
    model.is_soft = not isinstance(model.quantizer, softvq.HardVQ | softvq.ResidualHardVQ)

def build_autoencoder_(model: nn.Module, quantizer: str | nn.Module, code_dim: int, in_channels: int, width: int,
                       res_hidden: int, res_blocks: int, downsamples: int, latent_norm: str | None) -> None:
    """Sets :attr:`encoder`, :attr:`decoder` (which sees every level's ``code_dim`` channels), ``latent_norm``
    and :attr:`norm` (after :func:`build_quantizer_`: it needs ``levels``)."""
    model.in_channels = check_positive_int("in_channels", in_channels)
    model.downsamples = check_positive_int("downsamples", downsamples)
    model.encoder = Encoder(in_channels, width, res_hidden, res_blocks, downsamples, code_dim)
    model.decoder = Decoder(in_channels, width, res_hidden, res_blocks, downsamples, code_dim * model.levels)
    if latent_norm is None:  # a single DDCL layer standardises its own tokens
        latent_norm = "batch" if quantizer == "ddcl" and model.levels > 1 else "none"
    model.latent_norm = check_choice("latent_norm", latent_norm, LATENT_NORMS)
    # Non-affine: the encoder cannot rescale what the quantizer sees (running statistics at eval).
    model.norm = LatentNorm(code_dim) if latent_norm == "batch" else nn.Identity()
