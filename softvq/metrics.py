"""CodebookUsage: per-epoch codebook health as a torchmetrics Metric (counts reduce by sum across processes)."""

from __future__ import annotations

import torch
from torch import Tensor
from torchmetrics import Metric

from softvq._checks import check_positive_int
from softvq.functional import batch_counts, usage_from_counts


class CodebookUsage(Metric):
    """Accumulates how often each of ``num_codes`` codes is chosen, e.g. over a training epoch.

    ``update(indices, probs=None)`` takes integer indices of any shape and, optionally, the soft assignments
    ``(..., K)`` (or top-k ones ``(..., k)`` with their codes, ``prob_codes``: a quantizer output's
    ``probs, prob_codes``). ``compute()`` returns a dict with ``utilization`` (share of codes chosen at least once),
    ``dead_codes`` (codes never chosen), ``perplexity`` (``exp`` of the entropy of the hard usage) and, when
    probs were given, ``soft_perplexity`` (from the summed soft assignments). Counts are summed across
    processes under DDP, so every rank reports the usage of the whole epoch.

    Example:
        >>> usage = CodebookUsage(num_codes=4)
        >>> usage.update(torch.tensor([0, 0, 1, 2]))
        >>> round(float(usage.compute()["utilization"]), 2)
        0.75
    """

    full_state_update = False
    is_differentiable = False
    higher_is_better = True

    def __init__(self, num_codes: int, **kwargs) -> None:  # kwargs: torchmetrics Metric options (sync etc.)
        super().__init__(**kwargs)
        self.num_codes = check_positive_int("num_codes", num_codes)
        self.add_state("hard_counts", torch.zeros(num_codes, dtype=torch.long), dist_reduce_fx="sum")
        self.add_state("soft_mass", torch.zeros(num_codes, dtype=torch.float32), dist_reduce_fx="sum")
        self.add_state("soft_tokens", torch.zeros((), dtype=torch.long), dist_reduce_fx="sum")

    def update(self, indices: Tensor, probs: Tensor | None = None, prob_codes: Tensor | None = None) -> None:
        counts, soft = batch_counts(indices, self.num_codes, probs, prob_codes)
        self.hard_counts += counts
        if soft is not None:
            self.soft_mass += soft
            self.soft_tokens += indices.numel()

    def compute(self) -> dict[str, Tensor]:
        soft = self.soft_mass if int(self.soft_tokens) > 0 else None
        return usage_from_counts(self.hard_counts, soft)
