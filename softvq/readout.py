"""DDCL readout: pool a padded sequence of tokens through the global prototypes at O(T·K) cost
(docs/design.md, "The readout layer").

A drop-in replacement for mean pooling or a CLS token after a ``torch.nn.TransformerEncoder``. The real tokens of
every row (``mask == True``) go through one :class:`~softvq.DDCLQuantizer` call, which gives their assignments
``q_tk``, soft centroids ``mu_t`` and the loss terms; padded tokens are never read. From those, per row ``b``::

    mass_bk   = sum_t q_tk                           over the row's real tokens
    slots_bk  = sum_t q_tk z_t / mass_bk             the tokens pooled per prototype (0 where mass_bk ~ 0)
    pooled_b  = mean_t mu_t = sum_k (mass_bk / n_b) p_k

``pooled`` is the mean soft centroid. (The mass-weighted mean of the slots would be the plain mean token again,
since ``sum_k mass_bk slots_bk = sum_t z_t``: it would add nothing over mean pooling.) Every output is a sum over
the real tokens, so it is invariant to permuting them and to whatever the padded positions hold.
"""

from __future__ import annotations

import inspect
from typing import Any, NamedTuple

import torch
from torch import Tensor, nn

from softvq import _compat
from softvq._checks import check_bool, check_finite_state
from softvq._precision import compute_dtype
from softvq._recipe import fixed_option, layer_option
from softvq.ddcl import DDCLQuantizer
from softvq.parts.update import Commitment, Ema, Gradient

_TERM_NAMES = ("l_q", "l_ols", "v", "identity_residual")
# The readout is the plain layer: where its defaults differ from DDCLQuantizer's.
_DEFAULTS: dict[str, Any] = {"recipe": "plain", "temperature": 1.0, "standardize": False, "hard_output": False,
                             "restart": None}
# DDCLQuantizer keywords the readout cannot honour: the values it accepts, and why it takes no other.
_FIXED: dict[str, tuple[tuple[Any, ...], str]] = {
    "recipe": (("plain",), "the readout is the plain layer; set the parts of the recipe it supports one by one "
                           "(standardize, prototype_update, target_entropy, restart, ...)"),
    "hard_output": ((False, "auto"), "slots and pooled are built from the soft assignments and soft centroids, "
                                   "not from the argmax codes"),
    "channel_first": ((False,), "the readout takes tokens (B, T, D) and a padding mask, not feature maps"),
}


class ReadoutOutput(NamedTuple):
    """What :class:`DDCLReadout` returns for tokens ``(B, T, D)`` and ``K`` prototypes. Fields never change.

    Attributes:
        slots: ``(B, K, D)``, per prototype the assignment-weighted mean of the row's real tokens,
            ``sum_t q_tk z_t / sum_t q_tk``; exactly 0 for a prototype that receives no mass in that row (a mass
            below ``sqrt(torch.finfo(dtype).tiny)``, about 1e-19 in float32, where ``1 / mass^2`` in the
            gradient would overflow, counts as none).
        pooled: ``(B, D)``, one summary vector per row: the mean over real tokens of the soft centroids ``mu_t``.
        assignments: ``(B, T, K)`` float32 (float64 for float64 tokens), ``q_tk``; rows sum to 1 at real
            tokens and are all 0 at padded ones.
        mass: ``(B, K)``, ``sum_t q_tk`` over the row's real tokens (sums to the row's number of real tokens).
        loss: scalar, the quantizer's weighted auxiliary objective over all real tokens of the batch.
        terms: detached scalars ``l_q``, ``l_ols``, ``v``, ``identity_residual``: means over the real tokens of
            the batch (see :class:`~softvq.DDCLQuantizer`).
    """

    slots: Tensor
    pooled: Tensor
    assignments: Tensor
    mass: Tensor
    loss: Tensor
    terms: dict[str, Tensor]


class DDCLReadout(nn.Module):
    """Prototype readout: tokens ``(B, T, D)`` and a padding mask -> per-prototype slots and one pooled vector.

    The prototypes, temperature, distance and loss routing are those of an inner :class:`~softvq.DDCLQuantizer`
    (``self.quantizer``), applied to the real tokens only: time O(B·T·K·D) and memory O(B·T·K), never a
    ``(B, T, K, D)`` tensor nor a ``T x T`` matrix. Add ``out.loss`` to the task loss to train the prototypes
    with DDCL's competitive objective, and build the optimizer with :func:`softvq.param_groups` (prototypes at
    ``lr / eps``). Slots pool the tokens as given (also for ``distance="cosine"``, where only the assignments
    use L2-normalised tokens).

    Args:
        num_codes: ``K``, the number of prototypes.
        dim: ``D``, the token dimension.
        check_finite: raise on NaN/Inf at real positions (padded positions may hold anything).
        **quantizer_kwargs: any :class:`~softvq.DDCLQuantizer` keyword (``temperature``, ``distance``,
            ``prototype_update``, ``commitment_weight``, ``init``, ``standardize``, ...), forwarded to the inner
            quantizer, which only ever sees the real tokens (``init="data"``, dead-code restart, standardisation and
            the in-layer updates draw from them alone). The readout is the plain layer, so its defaults differ as
            follows: ``recipe="plain"`` (the only value accepted), ``temperature=1.0`` (a fixed temperature; with
            ``target_entropy`` the start of the control, ``None`` calibrates it on the first training batch),
            ``standardize=False`` (``True`` standardises the real tokens per dimension, as the default recipe does;
            :meth:`from_quantizer` copies it), ``hard_output=False`` (the only value accepted) and
            ``restart=None`` (no restarts). ``channel_first`` only accepts ``False``. Every other keyword
            has :class:`~softvq.DDCLQuantizer`'s default.

    Raises:
        ValueError: on invalid hyperparameters, a keyword :class:`~softvq.DDCLQuantizer` does not have, or one the
            readout cannot honour (``recipe="auto"``, ``hard_output=True``, ``channel_first=True``; the error names
            it); in ``forward`` on tokens that are not ``(B, T, dim)`` floats, a mask that is not a ``(B, T)`` bool
            tensor, a row without any real token (the error names the row), or non-finite real tokens.

    Example:
        >>> readout = DDCLReadout(num_codes=32, dim=64)
        >>> h = transformer(x, src_key_padding_mask=~mask)       # (B, T, 64); PyTorch masks with True = pad
        >>> out = readout(h, mask)                              # mask: (B, T) bool, True = real token
        >>> logits = head(out.pooled)                           # or head(out.slots.flatten(1))
        >>> loss = F.cross_entropy(logits, y) + out.loss
    """

    def __init__(self, num_codes: int, dim: int, *, check_finite: bool = True, **quantizer_kwargs: Any) -> None:
        super().__init__()
        _check_quantizer_kwargs(quantizer_kwargs)
        # The plain layer: a readout pools soft assignments of tokens, it is not a discrete bottleneck.
        # The inner quantizer only ever sees real tokens, which forward checks itself.
        self.quantizer = DDCLQuantizer(num_codes, dim, **{**_DEFAULTS, **quantizer_kwargs}, check_finite=False)
        self.check_finite = check_finite  # checked by its property's setter (below), as an assignment is

    # ---- options: the readout's own (the inner quantizer's are its: ``readout.quantizer.<option> = ...``) ---------
    num_codes = fixed_option("num_codes", "build a new DDCLReadout(num_codes, dim, ...)",
                             "``K``, the inner quantizer's number of prototypes (fixed).",
                             get=lambda readout: readout.quantizer.num_codes)
    dim = fixed_option("dim", "build a new DDCLReadout(num_codes, dim, ...)",
                       "``D``, the token dimension (fixed).", get=lambda readout: readout.quantizer.dim)
    check_finite = layer_option("check_finite", lambda readout, value: check_bool("check_finite", value),
                                "Raise on NaN/Inf at real positions.")

    @classmethod
    def from_quantizer(cls, quantizer: DDCLQuantizer, freeze: bool = False) -> DDCLReadout:
        """A readout over a copy of a trained quantizer's prototypes, temperature and settings.

        The copy is independent: training the readout never changes ``quantizer``. With ``freeze=True`` the
        prototypes do not require gradients and dead-code restart is off (the codebook is a fixed feature map;
        ``loss`` then only reaches the tokens, through the commitment term); a quantizer that standardises its tokens
        (the default recipe) is then copied with its evaluation statistics frozen, so the readout assigns tokens as the
        trained quantizer does in evaluation. The readout itself is the plain layer: its prototypes learn by the
        gradient (no EMA), at a fixed temperature.

        Raises:
            TypeError: ``quantizer`` is not a :class:`~softvq.DDCLQuantizer`.
            ValueError: its temperature is not calibrated yet (``temperature="auto"`` before the first training
                batch).
        """
        if not isinstance(quantizer, DDCLQuantizer):
            raise TypeError(f"from_quantizer needs a softvq.DDCLQuantizer, got {type(quantizer).__name__}")
        if quantizer.temperature is None:  # "auto": set on the first training batch, which it has not seen
            raise ValueError(f"from_quantizer reuses a trained codebook, but this DDCLQuantizer has seen no training "
                             f"batch: its temperature is not calibrated yet (temperature='auto'); train it first, or "
                             f"build DDCLReadout({quantizer.num_codes}, {quantizer.dim}, ...) to train a readout from "
                             f"scratch")
        readout = cls(quantizer.num_codes, quantizer.dim, temperature=quantizer.temperature,
                      distance=quantizer.distance, prototype_update=_gradient_update(quantizer.prototype_update),
                      commitment_weight=quantizer.commitment_weight if quantizer.commitment_term == "hard" else
                      Commitment(quantizer.commitment_weight, quantizer.commitment_term), init=quantizer.init,
                      restart=None if freeze else quantizer.restart,
                      check_finite=quantizer.check_finite, standardize=quantizer.standardize)
        proto = quantizer.prototypes
        readout.quantizer.to(device=proto.device, dtype=proto.dtype)
        state = quantizer.state_dict()  # prototypes, usage, temperature, initialized; not its settings (the readout's
        state["_extra_state"] = {k: v for k, v in state["_extra_state"].items() if k != "settings"}  # are its own)
        readout.quantizer.load_state_dict(state)
        readout.quantizer.prototypes.requires_grad_(not freeze)
        readout.quantizer.standardizer.frozen = freeze
        return readout

    @property
    def prototypes(self) -> nn.Parameter:
        """``(K, D)``, the inner quantizer's prototypes."""
        return self.quantizer.prototypes

    def _check(self, tokens: Tensor, mask: Tensor | None) -> None:
        if not isinstance(tokens, Tensor) or tokens.ndim != 3 or tokens.shape[-1] != self.dim:
            shape = tuple(tokens.shape) if isinstance(tokens, Tensor) else type(tokens).__name__
            raise ValueError(f"tokens must have shape (B, T, {self.dim}), got {shape}")
        if not tokens.is_floating_point():
            raise ValueError(f"tokens must be floating point, got dtype {tokens.dtype}")
        if mask is None:
            return
        if not isinstance(mask, Tensor) or mask.dtype != torch.bool:
            kind = mask.dtype if isinstance(mask, Tensor) else type(mask).__name__
            raise ValueError(f"mask must be a bool tensor (True = real token), got {kind}")
        if mask.shape != tokens.shape[:2]:
            raise ValueError(f"mask must have shape (B, T) = {tuple(tokens.shape[:2])} like the tokens, "
                             f"got {tuple(mask.shape)}")

    def _real_tokens(self, tokens: Tensor, mask: Tensor | None) -> Tensor:
        """``(N, D)``, the real tokens row by row; a ValueError for a row without any, or a non-finite one."""
        batch, length, dim = tokens.shape
        if batch > 0:
            empty = ~mask.any(1) if mask is not None else torch.full((batch,), length == 0, device=tokens.device)
            if bool(empty.any()):
                rows = empty.nonzero().flatten().tolist()
                raise ValueError(f"row(s) {rows[:10]} of the batch hold no real token (all padding, or T = 0); a "
                                 f"readout of an empty sequence is undefined: drop those rows or unmask a token")
        real = tokens.reshape(-1, dim) if mask is None else tokens[mask]  # (N, D) real tokens, row-major
        if self.check_finite and real.numel() > 0 and not bool(torch.isfinite(real).all()):
            bad = ~torch.isfinite(tokens).all(-1)  # (B, T)
            bad = bad if mask is None else bad & mask
            raise ValueError(f"tokens hold {int(bad.sum())} real token(s) with NaN or Inf, the first in row "
                             f"{int(bad.nonzero()[0, 0])}")
        return real

    def forward(self, tokens: Tensor, mask: Tensor | None = None) -> ReadoutOutput:
        """Read out a batch of token sequences.

        Args:
            tokens: ``(B, T, D)`` float; values at padded positions are ignored (they may even be NaN).
            mask: optional ``(B, T)`` bool, True at real tokens; ``None`` = every token is real. Note that
                ``nn.TransformerEncoder``'s ``src_key_padding_mask`` is the opposite (True = padding).

        Returns:
            :class:`ReadoutOutput`; ``slots``, ``pooled`` and ``mass`` in the dtype of ``tokens``.
        """
        self._check(tokens, mask)
        batch, length, dim = tokens.shape
        k = self.num_codes
        ctype = compute_dtype(tokens.dtype)
        out = self.quantizer(self._real_tokens(tokens, mask))  # mu (N, D), q (N, K), loss and terms over them
        if batch == 0:  # empty batch: empty outputs and a zero loss still connected to the prototypes
            return ReadoutOutput(tokens.new_zeros(batch, k, dim), tokens.new_zeros(batch, dim),
                                 tokens.new_zeros(batch, length, k, dtype=ctype), tokens.new_zeros(batch, k),
                                 out.loss, {name: out.terms[name] for name in _TERM_NAMES})
        with torch.autocast(device_type=tokens.device.type, enabled=False):
            if mask is None:
                assignments = out.dense_probs(k).reshape(batch, length, k)
                zeros_at_pad = tokens.to(ctype)
                centroids = out.quantized.to(ctype).reshape(batch, length, dim)
                count = torch.full((batch, 1), float(length), dtype=ctype, device=tokens.device)
            else:
                m = mask[..., None]
                probs = out.dense_probs(k)
                assignments = probs.new_zeros(batch, length, k).masked_scatter(m, probs)  # (B, T, K)
                # masked_fill, not a product with the mask: 0 * NaN garbage would still be NaN.
                zeros_at_pad = tokens.to(ctype).masked_fill(~m, 0.0)  # (B, T, D)
                centroids = out.quantized.new_zeros(batch, length, dim, dtype=ctype).masked_scatter(
                    m, out.quantized.to(ctype))  # (B, T, D)
                count = mask.sum(1, keepdim=True).to(ctype)  # (B, 1)
            mass = assignments.sum(1)  # (B, K)
            weighted = torch.bmm(assignments.transpose(1, 2), zeros_at_pad)  # (B, K, D) sum_t q_tk z_t
            # Safe division without an epsilon: a slot is empty when its mass is below sqrt(smallest normal number),
            # where the division's gradient (~ 1 / mass^2) would overflow; empty slots are 0 and divide by 1.
            has_mass = mass > torch.finfo(ctype).tiny ** 0.5
            slots = torch.where(has_mass[..., None], weighted / torch.where(has_mass, mass, 1.0)[..., None], 0.0)
            pooled = centroids.sum(1) / count  # (B, D)
        return ReadoutOutput(
            slots=slots.to(tokens.dtype),
            pooled=pooled.to(tokens.dtype),
            assignments=assignments,
            mass=mass.to(tokens.dtype),
            loss=out.loss,
            terms={name: out.terms[name] for name in _TERM_NAMES},
        )

    def _load_from_state_dict(self, state_dict: dict[str, Any], prefix: str, *args: Any, **kwargs: Any) -> None:
        # the whole state checked before any of it loads: a refused file leaves the readout as it was
        _compat.check_state_settings(  # its quantizer saved with other settings: refused
            {name: (type(m).__name__, m._settings()) for name, m in self.named_modules()
             if callable(getattr(m, "_settings", None))},
            state_dict, prefix)
        check_finite_state(state_dict, prefix, "DDCLReadout")
        super()._load_from_state_dict(state_dict, prefix, *args, **kwargs)

    def extra_repr(self) -> str:
        return f"check_finite={self.check_finite}"


def _check_quantizer_kwargs(kwargs: dict[str, Any]) -> None:
    """A ValueError naming the first keyword of ``kwargs`` that DDCLQuantizer does not have or the readout cannot
    honour."""
    own = ("num_codes", "dim", "check_finite")  # the readout's own arguments
    known = [name for name in inspect.signature(DDCLQuantizer).parameters if name not in own]
    _compat.refuse_former_keywords("ddcl", "DDCLReadout", kwargs, known)  # refused with what replaced each
    for name, value in kwargs.items():
        if name not in known:
            raise ValueError(f"DDCLReadout got {name}={value!r}, which is not a DDCLQuantizer keyword; "
                             f"it takes check_finite and {', '.join(known)}")
        if name in _FIXED and not any(value is a or (isinstance(value, str) and value == a) for a in _FIXED[name][0]):
            accepted, why = _FIXED[name]
            raise ValueError(f"DDCLReadout cannot honour {name}={value!r} (only {name}={accepted[0]!r}): {why}")


def _gradient_update(update: Ema | Gradient) -> Gradient:
    """The readout's ``prototype_update`` for a quantizer's: its :class:`~softvq.parts.Gradient`, or for EMA prototypes
    the default one (the readout is the plain layer: its prototypes learn by the gradient)."""
    return update if isinstance(update, Gradient) else Gradient()
