"""Helpers shared by the tests: exact references and process-group plumbing."""

from __future__ import annotations

import socket

import torch


def exact_cdist(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """Pairwise Euclidean distances without the matmul shortcut (an independent, exact reference)."""
    return torch.cdist(a, b, compute_mode="donot_use_mm_for_euclid_dist")


def free_port() -> int:
    """A free TCP port on the loopback address, for a gloo process group."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]
