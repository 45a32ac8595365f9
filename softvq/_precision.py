"""Precision policy: the dtype a quantizer computes in, and its state kept in full precision through ``.half()``,
``.bfloat16()`` and ``.to()``."""

from __future__ import annotations

from collections.abc import Callable

import torch


def compute_dtype(dtype: torch.dtype) -> torch.dtype:
    """float64 stays float64; everything else (bf16, fp16, fp32) is computed in float32."""
    return torch.float64 if dtype == torch.float64 else torch.float32


_LOW_PRECISION = (torch.float16, torch.bfloat16)


def apply_keeping_precision(module: torch.nn.Module, apply: Callable[[], object],
                            float64: tuple[str, ...] = ()) -> None:
    """Run ``apply()`` (``nn.Module._apply``: ``.to()``, ``.half()``, ``.bfloat16()``, ``.cuda()``, ...) on a
    quantizer and keep its state in full precision: every floating tensor of ``module`` and its submodules that the
    call turned into float16 or bfloat16 becomes float32 again, from its value before the call (so nothing is
    rounded), on the new device; the buffers named in ``float64`` (dotted names) keep their float64 value whatever
    the call does. Device moves and float32 / float64 casts are kept as they are.

    Why: a quantizer's state moves by small steps (an EMA step of 1% of a count, a running moment), below the
    resolution of a 16-bit float, so a bf16 codebook stops moving; its arithmetic runs in float32 anyway
    (:func:`compute_dtype`), so a 16-bit copy of the state would save nothing.
    """
    before = {}
    for prefix, sub in module.named_modules():
        for kind in ("_parameters", "_buffers"):
            for name, tensor in getattr(sub, kind).items():
                if tensor is not None and tensor.is_floating_point():
                    before[(prefix, kind, name)] = tensor.data
    apply()
    for (prefix, kind, name), old in before.items():
        sub = module.get_submodule(prefix)
        new = getattr(sub, kind)[name]
        dotted = f"{prefix}.{name}" if prefix else name
        if dotted in float64 and new.dtype != torch.float64:
            dtype = torch.float64
        elif new.dtype in _LOW_PRECISION:
            dtype = torch.float32
        else:
            continue
        restored = old.to(device=new.device, dtype=dtype)
        if kind == "_parameters":
            new.data = restored  # the same Parameter object: optimizers and hooks holding it stay valid
            if new.grad is not None:
                new.grad = new.grad.to(dtype)
        else:
            sub._buffers[name] = restored
