"""Straight-through VQ-VAE quantizer (van den Oord et al. 2017), the baseline DDCL is compared against."""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from softvq._checks import (
    check_bool,
    check_finite_state,
    check_float,
    check_indices,
    check_positive_int,
    check_unit,
    flatten_tokens,
)
from softvq._compat import upgrade_state_dict
from softvq._kernels import max_rows, squared_distances
from softvq._precision import apply_keeping_precision, compute_dtype
from softvq._recipe import PartOption
from softvq.parts.ema import EmaPrototypes
from softvq.parts.restart import DeadCodeRestart, Restart, code_counts
from softvq.types import QuantizerOutput, empty_output


class HardVQ(nn.Module):
    """Nearest-code vector quantizer with a straight-through gradient (the VQ-VAE bottleneck).

    Input: channel-last tokens ``z (..., dim)``; the last dimension is the space in which to quantize, all
    other dimensions are flattened. ``quantized = z + sg[e - z]`` equals the nearest code ``e`` in value and
    passes the output's gradient to ``z`` unchanged.

    Loss (element-mean MSE, as in VQ-VAE): ``mse(sg[z], e) + commitment_weight * mse(z, sg[e])``; with ``ema_decay`` set
    the codebook is instead an exponential moving average of its assigned tokens (updated in training mode
    only, Laplace-smoothed counts; a code that wins no token in a step stays where it is) and the loss is
    ``commitment_weight * mse(z, sg[e])`` alone. In training, ``quantized`` is the code the token was assigned,
    before that step's EMA update or restart moves it. The codebook and its statistics stay float32 under ``.half()`` or
    ``.to(torch.bfloat16)`` (float64 under ``.double()``); the distances are computed in float32 whatever the input.

    Dead-code restart (``restart``, a :class:`softvq.parts.Restart`; off by default, as in VQ-VAE): every training step
    a code whose running number of assigned tokens per batch (it starts from the first training batch's counts) is
    below the threshold is replaced by a random token of the current batch; with EMA its statistics restart as
    ``threshold`` pseudo-tokens at the new value. The usage is tracked without restarts too (decay ``ema_decay``, or
    0.99 without EMA). The setting of this project's studies, "EMA 0.99 + restart 1": ``ema_decay=0.99,
    restart=Restart(1.0, decay=0.99, cap=None)``.

    ``terms`` (detached): ``commitment`` (``mse(z, e)``, element mean), and the DDCL quantities for a one-hot
    assignment, per token: ``l_q = l_ols = mean_n ||z_n - e_n||^2``, ``v = 0`` and the assignment entropy
    ``entropy = 0``, so both quantizers report comparable numbers.

    Args:
        num_codes: ``K``.
        dim: ``D``.
        commitment_weight: the weight of the commitment term (VQ-VAE's ``beta``; ``>= 0``).
        ema_decay: ``None`` for a gradient-trained codebook, or a decay in ``(0, 1)`` for EMA updates.
        restart: dead-code restart's settings (:class:`softvq.parts.Restart`, the same part and settings as
            :class:`~softvq.DDCLQuantizer`'s), or ``None``: never.
        epsilon: Laplace smoothing of the EMA cluster sizes.
        check_finite: raise on NaN/Inf input (one device sync per call; skipped inside ``torch.compile``).
    """

    def __init__(
        self,
        num_codes: int,
        dim: int,
        commitment_weight: float = 0.25,
        ema_decay: float | None = None,
        restart: Restart | None = None,
        epsilon: float = 1e-5,
        check_finite: bool = True,
    ) -> None:
        super().__init__()
        self.num_codes = check_positive_int("num_codes", num_codes)
        self.dim = check_positive_int("dim", dim)
        self.commitment_weight = check_float("commitment_weight", commitment_weight, allow_zero=True)
        if ema_decay is not None:
            try:
                ema_decay = check_unit("ema_decay", ema_decay)
            except ValueError:
                raise ValueError(f"ema_decay must be None or in (0, 1), got {ema_decay!r}") from None
        self.ema_decay = ema_decay
        self.epsilon = check_float("epsilon", epsilon)
        self.check_finite = check_bool("check_finite", check_finite)
        num_codes, dim = self.num_codes, self.dim
        init = torch.empty(num_codes, dim).uniform_(-1.0 / num_codes, 1.0 / num_codes)  # VQ-VAE's init
        # (K, D) the codes; moved by the EMA part, not the optimizer, when ema_decay is set (a frozen Parameter then, as
        # DDCLQuantizer's EMA prototypes are)
        self.prototypes = nn.Parameter(init, requires_grad=self.ema_decay is None)
        if self.ema_decay is not None:
            # the k-means step averaged over batches, with VQ-VAE's Laplace-smoothed masses (softvq.parts.ema)
            self.ema = EmaPrototypes(init, self.ema_decay, epsilon=self.epsilon)
        # usage per batch and restarts; without restarts the usage is tracked all the same (decay ema_decay, or 0.99)
        self.dead_codes = DeadCodeRestart(num_codes, 0.0, decay=self.ema_decay if self.ema_decay is not None else 0.99)
        self.dead_codes.settings = restart

    restart = PartOption("dead_codes", "settings")  # a Restart, or None: no restarts (one place: the part)

    @property
    def restarts(self) -> int:
        """How many codes dead-code restart has moved since this module was built (reported per epoch beside the
        training-epoch utilization, which counts restarted codes as used; reading it synchronises with the device)."""
        return self.dead_codes.restarts

    @property
    def codebook(self) -> Tensor:
        """``(K, D)``, the codes."""
        return self.prototypes.detach()

    def decode_indices(self, indices: Tensor) -> Tensor:
        """Map code indices ``(...)`` to their codes ``(..., D)``."""
        check_indices(indices, self.num_codes)
        return F.embedding(indices.long(), self.codebook)

    def _apply(self, fn: Any, recurse: bool = True) -> HardVQ:
        # .half(), .to(torch.bfloat16): the codebook and its EMA statistics stay float32 (an EMA step is below bf16
        # resolution); device moves and float32 / float64 casts apply as usual
        apply_keeping_precision(self, lambda: super(HardVQ, self)._apply(fn, recurse))
        return self

    def _load_from_state_dict(self, state_dict: dict[str, Any], prefix: str, *args: Any, **kwargs: Any) -> None:
        upgrade_state_dict(state_dict, prefix)  # a state dict saved before softvq.parts
        check_finite_state(state_dict, prefix, "HardVQ")
        super()._load_from_state_dict(state_dict, prefix, *args, **kwargs)

    def extra_repr(self) -> str:
        return (f"num_codes={self.num_codes}, dim={self.dim}, commitment_weight={self.commitment_weight:g}, "
                f"ema_decay={self.ema_decay}, "
                f"restart={self.restart}")

    def forward(self, z: Tensor) -> QuantizerOutput:
        """Quantize channel-last tokens ``z (..., dim)``; see :class:`~softvq.QuantizerOutput`."""
        flat = flatten_tokens(z, self.dim, check_finite=self.check_finite)  # (N, D)
        lead = z.shape[:-1]
        ctype = compute_dtype(z.dtype)
        if flat.shape[0] == 0:
            return empty_output(z, self.num_codes, self.prototypes, ("commitment", "l_q", "l_ols", "v", "entropy"))

        with torch.autocast(device_type=z.device.type, enabled=False):
            zf = flat.to(ctype)
            with torch.no_grad():
                codebook = self.prototypes.detach().to(ctype)
                center = codebook.mean(0)  # distances are translation invariant; centring keeps them accurate
                indices = max_rows(squared_distances(zf - center, codebook - center), largest=False)[1]  # (N,)
            # (N, D) the code each token was assigned, looked up before this step's EMA update or restart moves it (as
            # sonnet and vector-quantize-pytorch return it); gradient to the codebook if no EMA
            codes = F.embedding(indices, self.prototypes.to(ctype))
            if self.training:
                self._update_codebook(zf.detach(), indices)
            commitment = F.mse_loss(zf, codes.detach())
            if self.ema_decay is None:
                loss = F.mse_loss(codes, zf.detach()) + self.commitment_weight * commitment
            else:
                loss = self.commitment_weight * commitment
            quantized = zf + (codes - zf).detach()  # straight-through
        per_token = commitment.detach() * self.dim
        terms = {"commitment": commitment.detach(), "l_q": per_token, "l_ols": per_token,
                 "v": torch.zeros_like(per_token), "entropy": torch.zeros_like(per_token)}
        # one-hot assignments written once in the compute dtype (F.one_hot builds int64, twice the bytes, then copies)
        probs = torch.zeros(indices.shape[0], self.num_codes, dtype=ctype, device=z.device)
        probs.scatter_(1, indices[:, None], 1.0)
        return QuantizerOutput(
            quantized=quantized.to(z.dtype).reshape(z.shape),
            indices=indices.reshape(lead),
            probs=probs.reshape(*lead, self.num_codes),
            loss=loss,
            terms=terms,
        )

    @torch.no_grad()
    def _update_codebook(self, z: Tensor, indices: Tensor) -> None:
        """EMA codebook update and dead-code restart (training mode only); counts summed across processes. No
        host-device synchronisation, so torch.compile traces it whole."""
        counts = code_counts(indices, self.num_codes, self.dead_codes.usage.dtype)
        self.dead_codes.update(counts)
        if self.ema_decay is not None:
            self.ema.step_(self.prototypes, z, indices=indices, counts=counts)
        if self.dead_codes.threshold > 0:
            dead = self.dead_codes.restart_(self.prototypes, z)
            if self.ema_decay is not None:  # a restarted code's statistics: threshold pseudo-tokens at its new value
                self.ema.restart_(dead, self.prototypes, self.dead_codes.threshold)
