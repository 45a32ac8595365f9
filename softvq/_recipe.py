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

import functools
import math
import warnings

import torch
from torch import Tensor, nn

from softvq._checks import check_bool, check_choice, check_float, check_unit
from softvq._collectives import all_reduce_sum_, is_distributed
from softvq._kernels import squared_distances
from softvq._restart import restart_dead_codes_
from softvq._soft_centroid import softmax_floor

# dead_code_decay="auto": the running usage per code remembers at least this many tokens a code wins on average (its
# memory, 1 / (1 - decay) batches, times N / K tokens per code per batch), and never less than USAGE_DECAY_FLOOR's
# memory. A short memory at a large K (2 tokens per code per batch at K = 4096, N = 8192) sends live codes whose count
# dipped by chance to restart; docs/design.md, "Dead-code restart at large K".
USAGE_MEMORY_TOKENS = 64.0
USAGE_DECAY_FLOOR = 0.9
# ... and at most 0.97's memory (33 batches): a longer one leaves dead codes unrestarted for epochs at K = 16384
# (docs/design.md, "Dead-code restart at large K").
USAGE_DECAY_CEILING = 0.97


@functools.lru_cache(maxsize=64)
def max_varentropy(num_codes: int) -> float:
    """The largest variance of ``-log q`` under ``q`` over distributions ``q`` on ``num_codes`` outcomes (0 for one).

    It is attained by one outcome of mass ``p`` and ``K - 1`` of mass ``(1 - p) / (K - 1)``, where it is
    ``p (1 - p) log((K - 1) p / (1 - p))^2``; maximised over ``p`` on a grid of its logit (0.44 for K = 2, 10.7 for
    K = 512, 24.5 for K = 16384)."""
    if num_codes < 2:
        return 0.0
    logit = torch.linspace(-40.0, 40.0, 200_001, dtype=torch.float64)
    p = torch.sigmoid(logit)
    return float((p * (1 - p) * (logit + math.log(num_codes - 1)).square()).max())


def max_stable_rate(num_codes: int) -> float:
    """The largest ``temperature_rate`` for which the entropy control is stable whatever the codebook and tokens.

    The control is ``log T <- log T + rate (H* - H(T))``. Near its fixed point an error ``e`` in ``log T`` becomes
    ``(1 - rate s) e`` with ``s = dH/dlog T``, which for Boltzmann assignments ``q ∝ exp(-d / T)`` is the variance of
    ``d / T`` under ``q`` (the heat capacity), that is the varentropy of ``q``, averaged over tokens. It is stable
    for ``0 < rate < 2 / s`` and ``s`` never exceeds :func:`max_varentropy` ``(K)``: the bound is ``2 / max_varentropy``
    (0.19 at K = 512, 0.082 at K = 16384); above it a codebook can make ``T`` oscillate with a growing amplitude."""
    v = max_varentropy(num_codes)
    return math.inf if v == 0 else 2.0 / v


class InLayerRecipe:
    """The recipe's part of :class:`softvq.DDCLQuantizer` (see there for what each option does)."""

    # Set by DDCLQuantizer.__init__ (here only to name what the methods below read and write).
    num_codes: int
    recipe: str
    prototypes: nn.Parameter
    usage: Tensor  # (K,) running argmax count per training batch; -1 = no batch seen yet
    ema_mass: Tensor  # (K,)
    ema_sum: Tensor  # (K, D)
    # () float64, the temperature (meaningful once _has_temperature). Never written in place: every change binds a
    # new tensor, so a forward pass whose backward has not run yet (two forwards before one backward, or a compiled
    # backward that re-reads its inputs) keeps the T it used.
    temperature_t: Tensor
    restart_count: Tensor  # () int64, prototypes restarted so far
    _has_temperature: bool
    check_finite: bool
    _warned_start: bool  # a batch that could not start the codebook has been reported

    def _set_recipe_options(
        self,
        auto: bool,
        temperature: float | str | None,
        *,
        standardize: bool | None,
        output_scale: str | float,
        hard_output: bool | None,
        prototype_update: str | None,
        ema_decay: float,
        target_entropy: float | str | None,
        temperature_rate: float,
        dead_code_threshold: float | str | None,
        dead_code_decay: float | str,
        dead_code_cap: float | None,
    ) -> None:
        """Validate the options the recipe sets (``auto``: ``recipe="auto"``), an explicit value overriding the
        recipe's, and store them; ``None`` (and ``target_entropy="auto"``) means the recipe's value."""
        num_codes = self.num_codes
        self.standardize = check_bool("standardize", auto if standardize is None else standardize)
        if isinstance(output_scale, str):
            self.output_scale: str | float = check_choice("output_scale", output_scale, ("input", "standardized"))
        else:  # a number: the standardised code times it
            self.output_scale = check_float("output_scale", output_scale)
        self.hard_output = check_bool("hard_output", auto if hard_output is None else hard_output)
        self.prototype_update = check_choice("prototype_update", prototype_update or ("ema" if auto else "gradient"),
                                             ("ema", "soft_ema", "gradient"))
        self.ema_decay = check_unit("ema_decay", ema_decay)
        if target_entropy == "auto":  # one code has no entropy to control: T is fixed, as for "plain"
            target_entropy = min(2.5, 0.5 * math.log(num_codes)) if auto and num_codes > 1 else None
        elif target_entropy is not None and num_codes == 1:
            raise ValueError(f"target_entropy={target_entropy!r} cannot be held with num_codes=1: one code takes every "
                             f"token, so the assignment entropy is always 0; leave target_entropy at 'auto' (a fixed "
                             f"temperature) or None")
        self.target_entropy = None if target_entropy is None else check_float("target_entropy", target_entropy)
        if self.target_entropy is not None and not self.target_entropy < math.log(num_codes):
            raise ValueError(f"target_entropy must be below log(num_codes) = {math.log(num_codes):.4g} nats (uniform "
                             f"assignments), got {target_entropy!r}")
        self.temperature_rate = check_float("temperature_rate", temperature_rate)
        if self.target_entropy is not None and not self.temperature_rate < max_stable_rate(num_codes):
            raise ValueError(f"temperature_rate={temperature_rate!r} is too large for the entropy control to be stable "
                             f"with num_codes={num_codes}: it must be below 2 / (the largest varentropy over "
                             f"{num_codes} codes) = {max_stable_rate(num_codes):.4g} (the default 0.01 is well below)")
        temperature = None if isinstance(temperature, str) and temperature == "auto" else temperature
        dead_code_threshold = None if isinstance(dead_code_threshold, str) and dead_code_threshold == "auto" \
            else dead_code_threshold
        if temperature is None and self.target_entropy is None:
            temperature = 1.0
        self._initial_temperature = None if temperature is None else check_float("temperature", temperature)
        threshold = (1.0 if auto else 0.0) if dead_code_threshold is None else dead_code_threshold
        self.dead_code_threshold = check_float("dead_code_threshold", threshold, allow_zero=True)
        self.dead_code_decay: float | str = "auto" if isinstance(dead_code_decay, str) and dead_code_decay == "auto" \
            else check_unit("dead_code_decay", dead_code_decay)
        self.dead_code_cap = None if dead_code_cap is None else check_float("dead_code_cap", dead_code_cap)

    # Options that only act in some combinations: (option, the option it depends on, when it has no effect, why).
    _INERT = (
        ("codebook_term", "prototype_update", lambda s: s.prototype_update != "gradient",
         "the codebook term trains gradient-trained prototypes; EMA prototypes are moved by the layer itself"),
        ("codebook_weight", "prototype_update", lambda s: s.prototype_update != "gradient",
         "the codebook term trains gradient-trained prototypes; EMA prototypes are moved by the layer itself"),
        ("output_scale", "standardize", lambda s: not s.standardize,
         "without standardisation the codes are on the input's scale already"),
        ("renorm", "standardize", lambda s: not s.standardize,
         "it is how the layer's standardisation trains, and there is none"),
        ("renorm_clip", "renorm", lambda s: not (s.standardize and s.renorm),
         "it clips batch renormalisation's corrections, which only renorm=True (with standardize) applies"),
        ("ema_decay", "prototype_update", lambda s: s.prototype_update == "gradient",
         "gradient-trained prototypes have no EMA"),
        ("temperature_rate", "target_entropy", lambda s: s.target_entropy is None,
         "it is the gain of the entropy control, which target_entropy=None turns off"),
        ("init_scale", "init", lambda s: s.init == "data", "it scales init='normal' prototypes"),
        ("dead_code_decay", "dead_code_threshold", lambda s: s.dead_code_threshold == 0,
         "it is the decay of the usage that dead-code restart reads, and a threshold of 0 never restarts"),
        ("dead_code_cap", "dead_code_threshold", lambda s: s.dead_code_threshold == 0,
         "it caps the restart threshold, and a threshold of 0 never restarts"),
        ("commitment_term", "commitment_weight", lambda s: s.commitment_weight == 0,
         "a commitment weight of 0 drops the term"),
    )

    # Values an option had as its default in earlier releases, which every configuration and checkpoint saved then
    # records: inert there, they load and replay as the default does (commitment_term was "l_ols" until the hard
    # commitment measured better on validation; renorm was False until clipped batch renormalisation did, and its
    # clip was Ioffe's (3, 5) until the tight one measured level in a foreign model; dead_code_decay was 0.9 until
    # "auto" scaled it with the tokens per code).
    _FORMER_DEFAULTS = {"commitment_term": ("l_ols",), "renorm": (False,), "renorm_clip": ((3.0, 5.0),),
                        "dead_code_decay": (0.9,)}

    def inert_options(self) -> set[str]:
        """The options that have no effect in this layer's combination, whatever their value (a resumed run may
        differ in them from its record without changing anything)."""
        return {name for name, _, inert, _ in self._INERT if inert(self)}

    def _refuse_inert_options(self, given: dict[str, object], defaults: dict[str, object]) -> None:
        """A ValueError for an option set to a value other than its default (``defaults``: the constructor's) that
        has no effect in the combination given, naming both options. Compared with the default, not "was it passed":
        the trainer and config files pass every option."""
        for name, other, inert, why in self._INERT:
            value = given[name]
            if value != defaults[name] and value not in self._FORMER_DEFAULTS.get(name, ()) and inert(self):
                raise ValueError(f"{name}={value!r} has no effect with {other}={getattr(self, other)!r} ({why}); "
                                 f"leave {name} at its default ({defaults[name]!r}) or change {other}")

    def _become_plain(self) -> None:
        """Switch to the plain layer's settings (a checkpoint from before the recipe existed), so that it evaluates and
        trains on as it was trained: no standardisation, soft-centroid output, gradient-trained prototypes, a fixed
        temperature, no restarts."""
        self.recipe = "plain"
        self.standardize = self.hard_output = False
        self.prototype_update = "gradient"
        self.prototypes.requires_grad_(True)
        self.target_entropy = None
        self.dead_code_threshold = 0.0

    # ---- the first training batch ------------------------------------------------------------------------------
    def _can_start(self, flat: Tensor) -> bool:
        """Whether a training batch ``flat (N, D)`` (every process's, together) can start the codebook: initialise
        the prototypes from its tokens and calibrate the temperature to ``target_entropy``.

        It cannot when it holds too few tokens for ``K`` codes at the target entropy: with ``N e^H <= K`` the data
        initialisation puts ``K / N >= e^H`` jittered copies of each token in the codebook, and the entropy target is
        met among a token's own copies, at a temperature of the jitter's scale (1e-5 instead of about 1 for 32 tokens
        and K = 512; a one-token "shape check" in training mode). A count, so no synchronisation. With
        ``check_finite`` it also cannot when its tokens are all equal (nothing to initialise from, a temperature near
        0): that reads one number on the host, as the finite check does; with ``check_finite=False`` (a step that
        never synchronises) an all-equal first batch is the caller's to avoid."""
        n = flat.shape[0] * (torch.distributed.get_world_size() if is_distributed() else 1)
        why = None
        if self.target_entropy is not None and n * math.exp(self.target_entropy) <= self.num_codes:
            needed = self.num_codes * math.exp(-self.target_entropy)
            why = (f"{n} token(s) are too few for {self.num_codes} codes at the target entropy of "
                   f"{self.target_entropy:g} nats (more than K e^-H = {needed:.1f} are needed)")
        elif self.check_finite and not torch.compiler.is_compiling():
            tokens = flat.detach()  # nothing recorded for autograd: a checkpoint's recomputation skips this test
            spread = (tokens.amax(0) - tokens.amin(0)).amax().to(torch.float64)  # N > 0 here
            if not float(all_reduce_sum_(spread)) > 0:  # every process decides alike
                why = f"its {n} token(s) are all equal"
        if why is not None and not self._warned_start:
            self._warned_start = True
            warnings.warn(f"DDCLQuantizer(num_codes={self.num_codes}): a training batch cannot start the codebook: "
                          f"{why}. It was used for its output only; the prototypes and the temperature start on the "
                          f"first training batch that can", stacklevel=4)
        return why is None

    # ---- the in-layer updates (training mode) --------------------------------------------------------------------
    # None of them synchronises the host with the device (no .item(), no data-dependent shape), so a GPU step never
    # waits on the CPU and torch.compile traces them whole; the state they change is all in tensors.
    @torch.no_grad()
    def _after_step(self, z: Tensor, q: Tensor, indices: Tensor, entropy: Tensor) -> None:
        """After a training forward: usage for dead-code restart, the EMA prototype update and the temperature
        control, each with its statistics summed over processes (every process ends with the same state)."""
        if self.dead_code_threshold > 0 or self.prototype_update == "ema":
            # index_add_ rather than bincount: a fixed (K,) shape that torch.compile can trace
            counts = torch.zeros(self.num_codes, dtype=self.usage.dtype, device=indices.device)
            counts.index_add_(0, indices, torch.ones_like(indices, dtype=counts.dtype))
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
            # A code that won nothing keeps its place: its mass and sum decay alike, so their ratio is the prototype
            # (and once the mass leaves the normal floats, after ~8,700 steps at decay 0.99, a ratio of subnormals is
            # noise, so the code stays put). Invariant: a code moves only on a step it wins tokens; a floor on the mass
            # instead of this test would drag a never-winning code to the origin.
            tiny = torch.finfo(self.ema_mass.dtype).tiny
            moved = (mass > 0) & (self.ema_mass > tiny)
            new = self.ema_sum / self.ema_mass.clamp_min(tiny)[:, None]
            self.prototypes.copy_(torch.where(moved[:, None], new.to(self.prototypes.dtype), self.prototypes))
        if self.target_entropy is not None:
            if is_distributed():  # the mean entropy over every process's tokens
                n = torch.full((), float(indices.numel()), dtype=torch.float64, device=indices.device)
                total_h = all_reduce_sum_(torch.stack([entropy.to(torch.float64) * n, n]))
                entropy = total_h[0] / total_h[1]
            self._control_temperature(entropy)

    @torch.no_grad()
    def _control_temperature(self, entropy: Tensor) -> None:
        """``T <- T exp(rate (target - H))`` (:func:`softvq.adapt_temperature`) on the device, bound as a new tensor
        (see ``temperature_t``); a non-finite entropy leaves ``T`` unchanged."""
        factor = torch.exp(self.temperature_rate * (self.target_entropy - entropy.to(self.temperature_t.dtype)))
        now = self.temperature_t
        # Bound, not written in place: a second forward pass before the first's backward must not change the T that
        # backward reads (an in-place write is a version-counter error under torch.compile).
        self.temperature_t = torch.where(torch.isfinite(factor), now * factor, now)

    @torch.no_grad()
    def _calibrate_temperature(self, z: Tensor, p: Tensor) -> Tensor:
        """The first ``T`` (a ``()`` tensor): bisection in ``log T`` until the mean assignment entropy of this batch
        (of every process's batch) equals ``target_entropy`` (:func:`calibrate_temperature`)."""
        sample = z[:: max(1, z.shape[0] // 4096)]  # a strided sample: no random draw, so restarts draw alike
        return calibrate_temperature(sample, p, self.target_entropy).to(self.temperature_t.dtype)

    # ---- dead-code restart -------------------------------------------------------------------------------------
    @torch.no_grad()
    def _update_usage(self, counts: Tensor) -> None:
        """The running argmax count per batch; the first batch (usage still -1) starts it from its counts."""
        if self.dead_code_decay == "auto":
            decay = self.usage_decay(counts.sum())  # counts are summed over processes: the global batch
            # where the floor holds, the arithmetic of a fixed decay of 0.9 (Python scalars), bit for bit: batches
            # where "auto" is 0.9 (K = 512 with 8,192 tokens) update exactly as before it existed; a smaller batch
            # (an epoch's ragged last one) gets its own, longer decay
            floor = self.usage * USAGE_DECAY_FLOOR + counts * (1.0 - USAGE_DECAY_FLOOR)
            running = torch.where(decay > USAGE_DECAY_FLOOR, self.usage * decay + counts * (1.0 - decay), floor)
        else:
            running = self.usage * self.dead_code_decay + counts * (1.0 - self.dead_code_decay)
        self.usage.copy_(torch.where((self.usage < 0).any(), counts, running))

    def usage_decay(self, tokens: Tensor | float) -> Tensor | float:
        """The decay of the running usage for a training batch of ``tokens`` tokens (over every process): the
        ``dead_code_decay`` given, or for ``"auto"`` ``1 - tokens / (K * 64)`` clipped to ``[0.9, 0.97]``, so that the
        running count remembers at least 64 tokens per code where 33 batches hold them: 0.9 up to 6.4 codes per token
        of a batch (K = 512 and 1024 at 8,192 tokens), 0.969 at K = 4096, 0.97 beyond. A tensor ``tokens`` gives a
        tensor (no host-device sync)."""
        if self.dead_code_decay != "auto":
            return self.dead_code_decay
        fraction = tokens / (self.num_codes * USAGE_MEMORY_TOKENS)
        if isinstance(fraction, Tensor):
            return (1.0 - fraction).clamp(min=USAGE_DECAY_FLOOR, max=USAGE_DECAY_CEILING)
        return min(USAGE_DECAY_CEILING, max(USAGE_DECAY_FLOOR, 1.0 - fraction))

    @torch.no_grad()
    def _restart_dead_codes(self, z: Tensor) -> None:
        """Before a training step: prototypes whose running argmax count per batch fell below the threshold (at most
        ``dead_code_cap`` times the mean tokens per code) move onto random tokens of this batch (before the forward
        pass, so no tensor saved for backward changes); their EMA statistics restart from that token."""
        threshold: float | Tensor = self.dead_code_threshold
        if self.dead_code_cap is not None:
            threshold = torch.clamp(self.dead_code_cap * self.usage.sum() / self.num_codes,
                                    max=self.dead_code_threshold)
        dead = restart_dead_codes_(self.prototypes.data, self.usage, z, threshold)
        self.ema_sum.copy_(torch.where(dead[:, None], self.prototypes.data, self.ema_sum))
        self.ema_mass.copy_(torch.where(dead, 1.0, self.ema_mass))
        self.restart_count.add_(dead.sum())


# Halvings of the calibration bracket (a factor 1e9 in T): its width ends at 20.7 / 2^34 = 1.2e-9 in log T.
_BISECTIONS = 34


# A custom op so that torch.compile sees one opaque call instead of tracing (and compiling) the unrolled bisection: it
# runs once, on the first training batch, and tracing it cost a minute of compilation on 2 CPU cores.
@torch.library.custom_op("softvq::calibrate_temperature", mutates_args=())
def calibrate_temperature(z: Tensor, prototypes: Tensor, target_entropy: float) -> Tensor:
    """The temperature ``T`` (a ``()`` float64 tensor) at which the mean assignment entropy of tokens ``z (n, D)``
    over ``prototypes (K, D)`` equals ``target_entropy``, summed over processes under ``torch.distributed``.

    Bisection in ``log T`` over a bracket of a factor 1e9 around the mean squared distance (H(Q) rises monotonically
    with ``T``), a fixed number of halvings on tensors: no host-device synchronisation.
    """
    center = prototypes.mean(0)
    d = squared_distances(z - center, prototypes - center).to(torch.float64)  # (n, K)
    count = torch.full((), float(d.shape[0]), dtype=torch.float64, device=d.device)
    total = all_reduce_sum_(torch.stack([d.mean(1).sum(), count]))
    scale = (total[0] / total[1]).clamp_min(1e-12)  # the same bracket on every process
    lo, hi = torch.log(scale * 1e-6), torch.log(scale * 1e3)
    for _ in range(_BISECTIONS):
        mid = 0.5 * (lo + hi)
        x = d * -torch.exp(-mid)
        # entropy from log-softmax, floored as the layer's own softmax is (the floor keeps exp on its fast path)
        x = (x - x.amax(1, keepdim=True)).clamp_(min=softmax_floor(x.dtype))
        logq = torch.log_softmax(x, dim=1)
        h = all_reduce_sum_(torch.stack([-(logq.exp() * logq).sum(), count]))
        above = h[0] / h[1] > target_entropy
        hi = torch.where(above, mid, hi)
        lo = torch.where(above, lo, mid)
    return torch.exp(0.5 * (lo + hi))


@calibrate_temperature.register_fake
def _(z: Tensor, prototypes: Tensor, target_entropy: float) -> Tensor:
    return z.new_empty((), dtype=torch.float64)
