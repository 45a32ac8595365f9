"""The mechanisms a codebook layer is composed of, one ``nn.Module`` each, with its options, state and tests.

- :class:`TokenStandardizer` — tokens standardised per dimension inside the layer (:mod:`softvq.norm`); its
  settings, :class:`Standardize`, are the ``standardize`` option.
- :class:`TemperatureControl` — the Boltzmann temperature: calibrated to an entropy target, then held there.
- :class:`EmaPrototypes` — the codebook moved by an EMA k-means step (hard or soft responsibilities).
- :class:`DeadCodeRestart` — the running usage per code and the restart of codes that fell out of use; its
  settings, :class:`Restart`, are the layers' ``restart`` option.
- :class:`NormalInit` — prototypes drawn from a normal distribution, the ``init`` option's alternative to ``"data"``.
- :class:`EntropyControl` — an entropy target with a gain of its own, as ``target_entropy`` takes it.
- :class:`Commitment` — a commitment term other than VQ-VAE's, as ``commitment_weight`` takes it.
- :class:`Ema` / :class:`Gradient` — how the prototypes move, the ``prototype_update`` option: by the layer's EMA step,
  or by the optimizer on a term of the loss.

:class:`softvq.DDCLQuantizer` holds all four, :class:`softvq.HardVQ` the last two. Which layer composes which part:
docs/design.md, "Anatomy of the layer".
"""

from softvq.norm import Standardize, TokenStandardizer
from softvq.parts.ema import EmaPrototypes
from softvq.parts.init import NormalInit
from softvq.parts.restart import DeadCodeRestart, Restart, code_counts
from softvq.parts.temperature import EntropyControl, TemperatureControl, max_stable_rate
from softvq.parts.update import Commitment, Ema, Gradient

__all__ = ["Commitment", "DeadCodeRestart", "Ema", "EmaPrototypes", "EntropyControl", "Gradient", "NormalInit",
           "Restart", "Standardize", "TemperatureControl", "TokenStandardizer", "code_counts", "max_stable_rate"]
