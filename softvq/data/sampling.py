"""Samplers whose order depends only on (seed, epoch) and that cut global batches across processes."""

from __future__ import annotations

from collections.abc import Iterator

import torch
from torch.utils.data import Sampler

from softvq._checks import check_non_negative_int, check_positive_int


class GlobalBatchSampler(Sampler[int]):
    """The indices one process reads of global batches shared by ``num_replicas`` processes.

    Every epoch the ``n`` indices are put in one order: ``range(n)``, or with ``shuffle`` a permutation drawn from a
    generator seeded with ``seed + epoch`` (call :meth:`set_epoch`; Lightning does, each epoch). The order is cut into
    global batches of ``batch_size * num_replicas``, and process ``rank`` reads the ``rank``-th ``batch_size`` slice of
    each. Use it with ``DataLoader(batch_size=batch_size, sampler=...)``. Hence:

    - ``num_replicas`` processes with batch ``B`` together see exactly the batches that one process with batch
      ``num_replicas * B`` and the same ``seed`` sees, step for step;
    - the order never draws from the global random state, so a run resumed from a checkpoint at an epoch boundary
      reads the same batches as an uninterrupted one, whatever the random state and the number of loader workers.

    The last, incomplete global batch is dropped with ``drop_last``; otherwise it is split into ``num_replicas``
    slices of ``ceil(rest / num_replicas)`` (the last processes may get fewer indices, or none). Every index is read
    by exactly one process. Training under DDP needs ``drop_last=True`` unless ``n`` is a multiple of the global
    batch: processes must take the same number of equally sized steps.

    Args:
        n: dataset length.
        batch_size: indices per batch and process.
        shuffle: draw a new permutation every epoch.
        seed: base seed of that permutation.
        drop_last: drop the last incomplete global batch.
        num_replicas, rank: processes and this process's rank (default: one process).
    """

    def __init__(self, n: int, batch_size: int, shuffle: bool = False, seed: int = 0, drop_last: bool = False,
                 num_replicas: int = 1, rank: int = 0) -> None:
        self.n = check_non_negative_int("n", n)
        self.batch_size = check_positive_int("batch_size", batch_size)
        self.num_replicas = check_positive_int("num_replicas", num_replicas)
        if not 0 <= rank < num_replicas:
            raise ValueError(f"rank must be in [0, {num_replicas}), got {rank}")
        self.rank = rank
        self.shuffle = shuffle
        self.seed = int(seed)
        self.drop_last = drop_last
        self.epoch = 0

    def set_epoch(self, epoch: int) -> None:
        self.epoch = int(epoch)

    def _slices(self) -> list[tuple[int, int]]:
        """``(start, stop)`` positions in the epoch's order read by this process."""
        glob = self.batch_size * self.num_replicas
        full, rest = divmod(self.n, glob)
        out = [(b * glob + self.rank * self.batch_size, b * glob + (self.rank + 1) * self.batch_size)
               for b in range(full)]
        if rest and not self.drop_last:
            share = -(-rest // self.num_replicas)
            start = full * glob + min(self.rank * share, rest)
            stop = full * glob + min((self.rank + 1) * share, rest)
            if stop > start:
                out.append((start, stop))
        return out

    def __iter__(self) -> Iterator[int]:
        if self.shuffle:
            order = torch.randperm(self.n, generator=torch.Generator().manual_seed(self.seed + self.epoch)).tolist()
        else:
            order = list(range(self.n))
        for start, stop in self._slices():
            yield from order[start:stop]

    def __len__(self) -> int:
        return sum(stop - start for start, stop in self._slices())
