"""The mechanisms a codebook layer is composed of: one module each, holding a mechanism (an ``nn.Module`` with its
state) and the settings class of the layer option that configures it, so that a mechanism is one file.

- ``standardize.py``: :class:`TokenStandardizer`, tokens standardised per dimension inside the layer, and its
  settings :class:`Standardize` (the ``standardize`` option, which the part holds whole).
- ``temperature.py``: :class:`TemperatureControl`, the Boltzmann temperature, calibrated to an entropy target and held
  there, and :class:`EntropyControl` (``target_entropy`` with a gain of its own); :func:`max_stable_rate`.
- ``ema.py``: :class:`EmaPrototypes`, the codebook moved by an EMA k-means step (hard or soft responsibilities).
- ``restart.py``: :class:`DeadCodeRestart`, the running usage per code and the restart of codes that fell out of use,
  and its settings :class:`Restart` (the ``restart`` option, which the part holds whole); :func:`code_counts`.
- ``update.py``: :class:`Ema` / :class:`Gradient`, how the prototypes move (the ``prototype_update`` option: by the
  layer's EMA step or by the optimizer on a term of the loss), and :class:`Commitment` (``commitment_weight`` with a
  term other than VQ-VAE's).
- ``init.py``: :class:`NormalInit`, prototypes drawn from a normal distribution (``init``'s alternative to ``"data"``).

:class:`softvq.DDCLQuantizer` holds the four mechanisms (``standardizer``, ``temperature_control``, ``ema``,
``dead_codes``); :class:`softvq.HardVQ` holds ``dead_codes`` and, with ``ema_decay``, ``ema``. docs/design.md,
"Anatomy of the layer".
"""

from softvq.parts.ema import EmaPrototypes
from softvq.parts.init import NormalInit
from softvq.parts.restart import DeadCodeRestart, Restart, code_counts
from softvq.parts.standardize import Standardize, TokenStandardizer
from softvq.parts.temperature import EntropyControl, TemperatureControl, max_stable_rate
from softvq.parts.update import Commitment, Ema, Gradient

__all__ = ["Commitment", "DeadCodeRestart", "Ema", "EmaPrototypes", "EntropyControl", "Gradient", "NormalInit",
           "Restart", "Standardize", "TemperatureControl", "TokenStandardizer", "code_counts", "max_stable_rate"]
