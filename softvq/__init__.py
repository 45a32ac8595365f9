"""softvq: collapse-free soft vector quantization (DDCL-Attention) for PyTorch.

Public API:

- :class:`DDCLQuantizer` — the DDCL soft codebook (``L_q = L_OLS + V``): with its defaults it outputs the argmax code
  with the soft centroid's gradient; ``recipe="plain"`` outputs the soft centroid itself.
- :class:`HardVQ` — the straight-through VQ-VAE baseline (optionally EMA, dead-code restart).
- :class:`QuantizerOutput` — what both return: fields by name, and unpacked vector-quantize-pytorch's triple
  ``(quantized, indices, loss)``.
- :class:`HierarchicalDDCL` — stacked DDCL codebooks, level l quantizing the pooled soft centroids of level l-1, with
  per-level L_q, L_OLS, V; returns a :class:`HierarchicalOutput`.
- :class:`DDCLReadout` — the DDCL prototypes as a readout for padded token sequences ``(B, T, D)`` (slots, one
  pooled vector, assignments) at O(T·K), replacing mean pooling or a CLS token; returns a :class:`ReadoutOutput`.
- :class:`ResidualDDCL` — residual quantization: ``Q`` DDCL codebooks, level q quantizing what levels ``< q`` left
  (indices ``(..., Q)``, decoding from any number of levels, quantize dropout); :class:`ResidualHardVQ`, the hard
  baseline with EMA and restarts per level; :class:`ResidualQuantizer`, the stack over any softvq layers.
- :mod:`softvq.parts` — the mechanisms the layers are composed of (``TemperatureControl``, ``EmaPrototypes``,
  ``DeadCodeRestart``, ``TokenStandardizer``), for a codebook of one's own; :class:`Restart`, the settings of
  dead-code restart that the layers' ``restart`` option takes.
- :class:`CodebookUsage` — utilization, dead codes and perplexity as a torchmetrics ``Metric``.
- :func:`param_groups` — optimizer groups with prototype lr = lr / eps.
- :func:`anneal_temperature` — constant / linear / cosine / exponential temperature schedules.
- :func:`adapt_temperature` — entropy control: T follows the distance scale so that H(Q) stays at a target.
- :mod:`softvq.functional` — ``codebook_usage``, ``prototype_separation`` (S(P)), ``assignment_entropy`` (H(Q)).

The core needs only torch and torchmetrics. With the ``train`` extra (``pip install "softvq[train]"``):

- :mod:`softvq.models` — the VQ-VAE (``VQVAE``, ``load_vqvae``), its encoder/decoder and the code prior.
- :mod:`softvq.data` — ``CIFAR10DataModule`` (offline-capable CIFAR-10).
- :mod:`softvq.cli` — the ``softvq-train``, ``softvq-evaluate``, ``softvq-prior`` and ``softvq-sample`` commands.
"""

from softvq import functional, parts, utils
from softvq.ddcl import DDCLQuantizer
from softvq.functional import assignment_entropy, codebook_usage, prototype_separation
from softvq.hard_vq import HardVQ
from softvq.hierarchical import HierarchicalDDCL, HierarchicalOutput
from softvq.metrics import CodebookUsage
from softvq.optim import param_groups
from softvq.parts.restart import Restart
from softvq.readout import DDCLReadout, ReadoutOutput
from softvq.residual import ResidualDDCL, ResidualHardVQ, ResidualQuantizer
from softvq.schedule import adapt_temperature, anneal_temperature
from softvq.types import QuantizerOutput

__version__ = "0.1.0"

__all__ = [
    "CodebookUsage",
    "DDCLQuantizer",
    "DDCLReadout",
    "HardVQ",
    "HierarchicalDDCL",
    "HierarchicalOutput",
    "QuantizerOutput",
    "ReadoutOutput",
    "ResidualDDCL",
    "ResidualHardVQ",
    "ResidualQuantizer",
    "Restart",
    "adapt_temperature",
    "anneal_temperature",
    "assignment_entropy",
    "codebook_usage",
    "functional",
    "param_groups",
    "parts",
    "prototype_separation",
    "utils",
]
