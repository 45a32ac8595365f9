"""Straight-through VQ-VAE quantizer (van den Oord et al. 2017), the baseline DDCL is compared against."""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from softvq import _compat
from softvq._checks import (
    check_bool,
    check_finite_state,
    check_float,
    check_indices,
    check_positive_int,
    check_unit,
    check_weight,
    flatten_tokens,
)
from softvq._kernels import nearest_codes
from softvq._precision import FullPrecisionState, compute_dtype
from softvq._recipe import fixed_option, layer_option
from softvq.parts.ema import EmaPrototypes
from softvq.parts.restart import DeadCodeRestart, Restart, code_counts
from softvq.types import QuantizerOutput, empty_output


class HardVQ(FullPrecisionState):
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
    0.99 without EMA). "EMA 0.99 + restart 1", the hard baseline that docs/design.md ("Dead-code restart at large
    K") compares against, is ``ema_decay=0.99, restart=Restart(1.0, decay=0.99, cap=None)``.

    Every option is an attribute, checked on assignment as the constructor checks it and read by the next call
    (``num_codes`` and ``dim`` are fixed); ``ema_decay`` switches the EMA on (its statistics start at the current
    codes, one pseudo-token each, as a new layer's; the codes then stop requiring gradients) or off (the codes
    require gradients again: rebuild the optimizer's groups), or changes its decay. The state dict records the
    settings that change the result (:meth:`_settings`), and loading one saved with others is refused
    (:func:`softvq._compat.check_state_settings`).

    ``terms`` (detached): ``commitment`` (``mse(z, e)``, element mean), and the DDCL quantities for a one-hot
    assignment, per token: ``l_q = l_ols = mean_n ||z_n - e_n||^2``, ``v = 0`` and the assignment entropy
    ``entropy = 0``, so both quantizers report comparable numbers.

    Args:
        num_codes: ``K``.
        dim: ``D``.
        commitment_weight: the weight of the commitment term (VQ-VAE's ``beta``, the keyword it replaced; ``>= 0``,
            at most 1.8e19).
        ema_decay: ``None`` for a gradient-trained codebook, or a decay in ``(0, 1)`` for EMA updates.
        restart: dead-code restart's settings (:class:`softvq.parts.Restart`, the same part and settings as
            :class:`~softvq.DDCLQuantizer`'s), or ``None``: never.
        epsilon: Laplace smoothing of the EMA cluster sizes (``> 0``; ``num_codes * epsilon`` within half of
            float32's range, or the smoothed sizes overflow).
        check_finite: raise on NaN/Inf input (one device sync per call; skipped inside ``torch.compile``).
    """

    @_compat.refuse_former_options("hard")  # a keyword of earlier versions (beta, ...): refused with its replacement
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
        self._num_codes = check_positive_int("num_codes", num_codes)
        self._dim = check_positive_int("dim", dim)
        self.commitment_weight = commitment_weight  # each option checked by its property's setter, below
        self._ema_decay = _check_ema_decay(ema_decay)
        self._epsilon = _check_epsilon(epsilon, self._num_codes)
        self.check_finite = check_finite
        num_codes, dim, ema_decay = self.num_codes, self.dim, self._ema_decay
        init = torch.empty(num_codes, dim).uniform_(-1.0 / num_codes, 1.0 / num_codes)  # VQ-VAE's init
        # (K, D) the codes; moved by the EMA part, not the optimizer, when ema_decay is set (a frozen Parameter then, as
        # DDCLQuantizer's EMA prototypes are)
        self.prototypes = nn.Parameter(init, requires_grad=self.ema_decay is None)
        if self.ema_decay is not None:
            # the k-means step averaged over batches, with VQ-VAE's Laplace-smoothed masses (softvq.parts.ema)
            self.ema = EmaPrototypes(init, self.ema_decay, epsilon=self.epsilon)
        # usage per batch and restarts (restart: the part's settings, checked there); without restarts the usage is
        # tracked all the same, at the EMA's decay (0.99 without EMA)
        self.dead_codes = DeadCodeRestart(num_codes, restart, idle_decay=self._usage_decay())

    # ---- options: checked on assignment by the constructor's checks, read by the next call ------------------------
    num_codes = fixed_option("num_codes", "build a new HardVQ(num_codes, dim, ...): K sizes the codebook and its "
                             "statistics", "``K``, the number of codes (fixed).")
    dim = fixed_option("dim", "build a new HardVQ(num_codes, dim, ...): D sizes the codebook",
                       "``D``, the token dimension (fixed).")
    commitment_weight = layer_option("commitment_weight",
                                     lambda layer, value: check_weight("commitment_weight", value),
                                     "The commitment term's weight (``>= 0``, at most 1.8e19).")
    check_finite = layer_option("check_finite", lambda layer, value: check_bool("check_finite", value),
                                "Raise on NaN/Inf input.")

    @property
    def ema_decay(self) -> float | None:
        """The EMA's decay in ``(0, 1)``, or ``None``: a gradient-trained codebook. Assigning switches the EMA on (its
        statistics start at the current codes, which stop requiring gradients) or off (the codes require gradients
        again: an optimizer built before holds them as it was built), or changes its decay."""
        return self._ema_decay

    @ema_decay.setter
    def ema_decay(self, value: float | None) -> None:
        value = _check_ema_decay(value)
        if value is None and self._ema_decay is not None:
            del self.ema
        elif value is not None and self._ema_decay is None:  # a new EMA from the codes as they are
            codes = self.prototypes.detach()
            self.ema = EmaPrototypes(codes, value, epsilon=self._epsilon).to(device=codes.device, dtype=codes.dtype)
        elif value is not None:
            self.ema.decay = value
        self.prototypes.requires_grad_(value is None)
        self._ema_decay = value
        self.dead_codes.idle_decay = self._usage_decay()  # the usage, tracked without restarts, decays at it

    @property
    def epsilon(self) -> float:
        """Laplace smoothing of the EMA's cluster sizes (used with ``ema_decay``)."""
        return self._epsilon

    @epsilon.setter
    def epsilon(self, value: float) -> None:
        self._epsilon = _check_epsilon(value, self.num_codes)
        if self._ema_decay is not None:
            self.ema.epsilon = self._epsilon

    @property
    def restart(self) -> Restart | None:
        """Dead-code restart's settings (a :class:`softvq.parts.Restart`; ``None``: never), held by the part
        ``dead_codes``; assigning is checked as the constructor checks it."""
        return self.dead_codes.settings

    @restart.setter
    def restart(self, value: Restart | None) -> None:
        self.dead_codes.settings = value

    def _usage_decay(self) -> float:
        return self._ema_decay if self._ema_decay is not None else 0.99

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

    def get_output_from_indices(self, indices: Tensor) -> Tensor:
        """:meth:`decode_indices` under vector-quantize-pytorch's name (so is ``get_codes_from_indices``: no
        projection here, so the codes are the output)."""
        return self.decode_indices(indices)

    get_codes_from_indices = get_output_from_indices

    # extra-state version: the settings that change the result (a state without an extra state predates it)
    VERSION = 1

    def get_extra_state(self) -> dict[str, Any]:
        return {"version": self.VERSION, "settings": self._settings()}

    def set_extra_state(self, state: Any) -> None:
        if not isinstance(state, dict):  # the settings were checked before (check_state_settings) and restore nothing
            raise ValueError(f"HardVQ extra state must be a dict (from get_extra_state), got {state!r}; is the "
                             f"checkpoint from another layer?")

    def _settings(self) -> dict[str, Any]:
        """The settings that change this layer's result, in plain values, as its extra state records them: the
        commitment weight, the EMA decay (``None``: a gradient-trained codebook) and its smoothing (``None`` without
        EMA, where it acts on nothing), and dead-code restart."""
        ema = self.ema_decay is not None
        return {"commitment_weight": self.commitment_weight, "ema_decay": self.ema_decay,
                "epsilon": self.epsilon if ema else None, "restart": _compat.settings_record(self.restart)}

    def _load_from_state_dict(self, state_dict: dict[str, Any], prefix: str, *args: Any, **kwargs: Any) -> None:
        _compat.upgrade_hard_state(state_dict, prefix)  # a state dict of an earlier layout, brought to today's
        _compat.check_state_settings({"": ("HardVQ", self._settings())}, state_dict, prefix)  # other settings: refused
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
                indices = nearest_codes(zf - center, codebook - center)  # (N,), in row blocks: no (N, K) array
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
        # one-hot assignments as top-1 ones: probs (..., 1) of 1 on the codes prob_codes = indices; the (N, K) one-hot
        # array (dense_probs(K)) is built only where a caller asks for it (at K = 16384 it was 512 MiB of a step's
        # peak memory and a write over (N, K))
        probs = torch.ones(*lead, 1, dtype=ctype, device=z.device)
        return QuantizerOutput(
            quantized=quantized.to(z.dtype).reshape(z.shape),
            indices=indices.reshape(lead),
            probs=probs,
            loss=loss,
            terms=terms,
            prob_codes=indices.reshape(*lead, 1),
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


def _check_ema_decay(value: object) -> float | None:
    """``ema_decay``: ``None`` or a decay in ``(0, 1)``; else a ``ValueError`` naming it."""
    if value is None:
        return None
    try:
        return check_unit("ema_decay", value)
    except ValueError:
        raise ValueError(f"ema_decay must be None or in (0, 1), got {value!r}") from None


def _check_epsilon(value: object, num_codes: int) -> float:
    """``epsilon``, the EMA's Laplace smoothing: positive, with ``num_codes * epsilon`` (added to the total mass) within
    half of float32's range; else a ``ValueError`` naming it and the bound."""
    epsilon = check_float("epsilon", value)
    limit = torch.finfo(torch.float32).max / 2 / num_codes
    if epsilon > limit:
        raise ValueError(f"epsilon={value!r} is too large for num_codes={num_codes}: the smoothed cluster sizes divide "
                         f"by the total mass plus num_codes * epsilon, which must stay within half of "
                         f"finfo(float32).max, so epsilon must be at most {limit:.3g}")
    return epsilon
