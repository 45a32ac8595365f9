"""Helpers shared by the tests: exact references and process-group plumbing."""

from __future__ import annotations

import os
import socket
import sys
from pathlib import Path

import torch
from torch.utils._python_dispatch import TorchDispatchMode


def exact_cdist(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """Pairwise Euclidean distances without the matmul shortcut (an independent, exact reference)."""
    return torch.cdist(a, b, compute_mode="donot_use_mm_for_euclid_dist")


def free_port() -> int:
    """A free TCP port on the loopback address, for a gloo process group."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


aten = torch.ops.aten
# Calls that need the device's values on the host: a scalar read (.item(), float(), bool(), int(), Python `if` on a
# tensor) or an output whose shape depends on the data (boolean masks, nonzero, unique, bincount).
_SYNCING = {aten._local_scalar_dense, aten.nonzero, aten.masked_select, aten.unique_dim, aten._unique2,
            aten.unique_consecutive, aten.bincount, aten.repeat_interleave, aten.is_nonzero, aten.item}


class SyncRecorder(TorchDispatchMode):
    """Records every ATen call of :data:`_SYNCING`, and indexing with a boolean mask, made while it is active."""

    def __init__(self) -> None:
        super().__init__()
        self.calls: list[str] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        packet = func._overloadpacket
        masked = packet in (aten.index, aten.index_put, aten.index_put_) and any(
            isinstance(i, torch.Tensor) and i.dtype == torch.bool for i in (args[1] if len(args) > 1 else ()) or ())
        if packet in _SYNCING or masked:
            self.calls.append(str(func))
        return func(*args, **kwargs)


# A run long enough to be interrupted in the middle of epoch 2, with a DataLoader worker and dead-code restarts (of
# both quantizers): the interrupt-and-resume tests of tests/test_kill_resume.py and tests/test_run_directory.py.
INTERRUPTIBLE = ["--epochs", "2", "--data.train_subset", "240", "--data.val_size", "20", "--data.batch_size", "8",
                 "--model.num_codes", "16", "--model.code_dim", "4", "--model.width", "8", "--model.res_hidden", "4",
                 "--model.res_blocks", "1", "--data.num_workers", "1", "--trainer.accelerator", "cpu",
                 "--trainer.progress_bar", "false", "--seed", "5", "--ddcl.restart.threshold", "20",
                 "--hard.restart.threshold", "20", "--hard.restart.decay", "0.99", "--hard.restart.cap", "null"]


ROOT = Path(__file__).resolve().parents[1]


def train_command(data: Path, out: Path, *extra: str) -> list[str]:
    """``train_vqvae.py`` as a process: the data, the run directory, then ``extra`` flags."""
    return [sys.executable, str(ROOT / "train_vqvae.py"), "--data.data_root", str(data), "--out", str(out), *extra]


def train_env() -> dict[str, str]:
    """The environment of a training process: one thread, the clone importable."""
    return {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)}


def running_moments(batches, momentum: float = 0.1) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """A standardiser's running (mean, unbiased variance) after each training batch, by hand: the first batch sets
    them, each later one moves them by ``momentum``."""
    out, mean, var = [], None, None
    for z in batches:
        m, v = z.detach().mean(0), z.detach().var(0, unbiased=True)
        mean, var = (m, v) if mean is None else (mean + momentum * (m - mean), var + momentum * (v - var))
        out.append((mean, var))
    return out


def json_strings(node: object):
    """Every string value of a parsed JSON document, depth first."""
    if isinstance(node, dict):
        for value in node.values():
            yield from json_strings(value)
    elif isinstance(node, list):
        for value in node:
            yield from json_strings(value)
    elif isinstance(node, str):
        yield node


def worse_every_epoch_module():
    """A one-parameter LightningModule whose validation MSE rises every epoch (its value is the epoch: the best
    checkpoint stays at epoch 1), for tests of the trainer's callbacks without a model. Built on call: Lightning is
    imported only by the tests that use it."""
    import lightning as L

    class WorseEveryEpoch(L.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.weight = torch.nn.Parameter(torch.zeros(1))

        def training_step(self, batch, batch_idx):
            return (self.weight - 1.0).pow(2).sum()

        def validation_step(self, batch, batch_idx):
            self.log("val/mse", float(self.current_epoch))

        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=0.1)

    return WorseEveryEpoch()
