"""The in-layer recipe of :class:`softvq.DDCLQuantizer`: its options and the updates it makes in training mode.

:class:`InLayerRecipe` is a mixin of ``DDCLQuantizer`` (which owns the prototypes, the buffers and the forward pass);
it holds what ``recipe="auto"`` adds to the paper's plain layer:

- resolving and validating the recipe options (``recipe`` defaults, then each explicit override);
- the temperature: calibrated on the first training batch to ``target_entropy``, then the entropy control after each
  training step;
- the EMA prototype update (``"ema"``: k-means step; ``"soft_ema"``: free-energy M-step);
- dead-code restart: the running usage per code and moving the dead codes onto tokens of the batch.

Every statistic is summed over processes under ``torch.distributed``, so every process ends a step with the same
state.
"""

from __future__ import annotations

import math

import torch
from torch import Tensor, nn

from softvq.schedule import adapt_temperature
from softvq.utils import (
    all_reduce_sum_,
    check_bool,
    check_choice,
    check_float,
    check_unit,
    restart_dead_codes_,
    squared_distances,
)


class InLayerRecipe:
    """The recipe's part of :class:`softvq.DDCLQuantizer` (see there for what each option does)."""

    # Set by DDCLQuantizer.__init__ (here only to name what the methods below read and write).
    num_codes: int
    recipe: str
    prototypes: nn.Parameter
    usage: Tensor  # (K,) running argmax count per training batch; -1 = no batch seen yet
    ema_mass: Tensor  # (K,)
    ema_sum: Tensor  # (K, D)
    _temperature: float | None
    _restarts: int

    def _set_recipe_options(
        self,
        auto: bool,
        temperature: float | str | None,
        *,
        standardize: bool | None,
        output_scale: str,
        hard_output: bool | None,
        prototype_update: str | None,
        ema_decay: float,
        target_entropy: float | str | None,
        temperature_rate: float,
        dead_code_threshold: float | str | None,
        dead_code_decay: float,
    ) -> None:
        """Validate the options the recipe sets (``auto``: ``recipe="auto"``), an explicit value overriding the
        recipe's, and store them; ``None`` (and ``target_entropy="auto"``) means the recipe's value."""
        num_codes = self.num_codes
        self.standardize = check_bool("standardize", auto if standardize is None else standardize)
        self.output_scale = check_choice("output_scale", output_scale, ("input", "standardized"))
        self.hard_output = check_bool("hard_output", auto if hard_output is None else hard_output)
        self.prototype_update = check_choice("prototype_update", prototype_update or ("ema" if auto else "gradient"),
                                             ("ema", "soft_ema", "gradient"))
        self.ema_decay = check_unit("ema_decay", ema_decay)
        if target_entropy == "auto":
            target_entropy = min(2.5, 0.5 * math.log(num_codes)) if auto else None
        self.target_entropy = None if target_entropy is None else check_float("target_entropy", target_entropy)
        if self.target_entropy is not None and not self.target_entropy < math.log(num_codes):
            raise ValueError(f"target_entropy must be below log(num_codes) = {math.log(num_codes):.4g} nats (uniform "
                             f"assignments), got {target_entropy!r}")
        self.temperature_rate = check_float("temperature_rate", temperature_rate)
        temperature = None if isinstance(temperature, str) and temperature == "auto" else temperature
        dead_code_threshold = None if isinstance(dead_code_threshold, str) and dead_code_threshold == "auto" \
            else dead_code_threshold
        if temperature is None and self.target_entropy is None:
            temperature = 1.0
        self._temperature = None if temperature is None else check_float("temperature", temperature)
        threshold = (1.0 if auto else 0.0) if dead_code_threshold is None else dead_code_threshold
        self.dead_code_threshold = check_float("dead_code_threshold", threshold, allow_zero=True)
        # The recipe's threshold never exceeds a quarter of the mean tokens per code (an explicit one is kept as given)
        self._capped_threshold = dead_code_threshold is None
        self.dead_code_decay = check_unit("dead_code_decay", dead_code_decay)

    def _become_plain(self) -> None:
        """Switch to the plain layer's settings (a checkpoint from before the recipe existed)."""
        self.recipe = "plain"
        self.standardize = self.hard_output = False
        self.prototype_update = "gradient"
        self.prototypes.requires_grad_(True)
        self.target_entropy = None

    # ---- the in-layer updates (training mode) --------------------------------------------------------------------
    @torch.no_grad()
    def _after_step(self, z: Tensor, q: Tensor, indices: Tensor, entropy: Tensor) -> None:
        """After a training forward: usage for dead-code restart, the EMA prototype update and the temperature
        control, each with its statistics summed over processes (every process ends with the same state)."""
        if self.dead_code_threshold > 0 or self.prototype_update == "ema":
            counts = torch.bincount(indices, minlength=self.num_codes).to(self.usage.dtype)  # (K,)
            all_reduce_sum_(counts)
            if self.dead_code_threshold > 0:
                self._update_usage(counts)
        if self.prototype_update != "gradient":
            if self.prototype_update == "ema":
                mass = counts.to(self.ema_mass.dtype)  # summed over processes already
                total = torch.zeros_like(self.ema_sum).index_add_(0, indices, z.to(self.ema_sum.dtype))
            else:  # soft_ema: the free-energy M-step, tokens weighted by their assignments
                mass = all_reduce_sum_(q.sum(0).to(self.ema_mass.dtype))
                total = (q.t() @ z).to(self.ema_sum.dtype)
            all_reduce_sum_(total)
            self.ema_mass.lerp_(mass, 1.0 - self.ema_decay)
            self.ema_sum.lerp_(total, 1.0 - self.ema_decay)
            self.prototypes.copy_(self.ema_sum / self.ema_mass.clamp_min(1e-12)[:, None])
        if self.target_entropy is not None:
            n = torch.tensor([entropy.item() * indices.numel(), indices.numel()], dtype=torch.float64,
                             device=indices.device)
            all_reduce_sum_(n)
            self._temperature = adapt_temperature(self._temperature, float(n[0] / n[1]), self.target_entropy,
                                                  self.temperature_rate)

    @torch.no_grad()
    def _calibrate_temperature(self, z: Tensor, p: Tensor) -> float:
        """The first ``T``: bisection in ``log T`` until the mean assignment entropy of this batch (of every
        process's batch) equals ``target_entropy``; H(Q) rises monotonically with ``T``."""
        sample = z[:: max(1, z.shape[0] // 4096)]  # a strided sample: no random draw, so restarts draw alike
        center = p.mean(0)
        d = squared_distances(sample - center, p - center)  # (n, K)
        total = all_reduce_sum_(torch.stack([d.sum(dtype=torch.float64),
                                             torch.tensor(float(d.numel()), dtype=torch.float64, device=d.device)]))
        scale = max(float(total[0] / total[1]), 1e-12)  # the same bracket on every process
        lo, hi = math.log(scale * 1e-6), math.log(scale * 1e3)
        for _ in range(50):
            mid = 0.5 * (lo + hi)
            logq = torch.log_softmax(d * -math.exp(-mid), dim=1)
            h = torch.stack([-(logq.exp() * logq).sum(1).sum(dtype=torch.float64),
                             torch.tensor(float(d.shape[0]), dtype=torch.float64, device=d.device)])
            all_reduce_sum_(h)
            if float(h[0] / h[1]) > self.target_entropy:
                hi = mid
            else:
                lo = mid
        return math.exp(0.5 * (lo + hi))

    # ---- dead-code restart -------------------------------------------------------------------------------------
    @torch.no_grad()
    def _update_usage(self, counts: Tensor) -> None:
        if bool((self.usage < 0).any()):  # first batch: start from its counts
            self.usage.copy_(counts)
        else:
            self.usage.mul_(self.dead_code_decay).add_(counts, alpha=1.0 - self.dead_code_decay)

    @torch.no_grad()
    def _restart_dead_codes(self, z: Tensor) -> None:
        """Before a training step: prototypes whose running argmax count per batch fell below the threshold (the
        recipe's: at most a quarter of the mean tokens per code) move onto random tokens of this batch (before the
        forward pass, so no tensor saved for backward changes); their EMA statistics restart from that token."""
        if bool((self.usage < 0).any()):
            return
        threshold = self.dead_code_threshold
        if self._capped_threshold:
            threshold = min(threshold, 0.25 * float(self.usage.sum()) / self.num_codes)
        dead = restart_dead_codes_(self.prototypes.data, self.usage, z, threshold)
        if bool(dead.any()):
            self.ema_sum[dead] = self.prototypes.data[dead]
            self.ema_mass[dead] = 1.0
        self._restarts += int(dead.sum())
