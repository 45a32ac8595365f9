"""Precision policy: the dtype a quantizer computes in, and its state kept in full precision through ``.half()``,
``.bfloat16()`` and ``.to()``."""

from __future__ import annotations

from collections.abc import Callable

import torch


def compute_dtype(dtype: torch.dtype) -> torch.dtype:
    """float64 stays float64; everything else (bf16, fp16, fp32) is computed in float32."""
    return torch.float64 if dtype == torch.float64 else torch.float32


_LOW_PRECISION = (torch.float16, torch.bfloat16)


class FullPrecisionState(torch.nn.Module):
    """A quantizer (or part) whose state stays in full precision through ``.to()``, ``.half()``, ``.bfloat16()``,
    ``.cuda()``, ...: every floating tensor of the module and its submodules that such a call turns into float16 or
    bfloat16 becomes float32 again, from its value before the call (so nothing is rounded), on the new device; the
    buffers named in :attr:`float64_state` (dotted names) keep their float64 value whatever the call does. Device
    moves and float32 / float64 casts are kept as they are.

    Why: a quantizer's state moves by small steps (an EMA step of 1% of a count, a running moment), below the
    resolution of a 16-bit float, so a bf16 codebook stops moving; its arithmetic runs in float32 anyway
    (:func:`compute_dtype`), so a 16-bit copy of the state would save nothing.
    """

    float64_state: tuple[str, ...] = ()

    def _apply(self, fn: Callable[..., object], recurse: bool = True) -> FullPrecisionState:
        before = {}
        for prefix, sub in self.named_modules():
            for kind in ("_parameters", "_buffers"):
                for name, tensor in getattr(sub, kind).items():
                    if tensor is not None and tensor.is_floating_point():
                        before[(prefix, kind, name)] = tensor.data
        super()._apply(fn, recurse)
        for (prefix, kind, name), old in before.items():
            sub = self.get_submodule(prefix)
            new = getattr(sub, kind)[name]
            dotted = f"{prefix}.{name}" if prefix else name
            if dotted in self.float64_state and new.dtype != torch.float64:
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
        return self
