"""A long run's last checkpoint for the tools that score it (:mod:`eval.long_run.jacobian_span`,
:mod:`eval.long_run.modes`): the trained VQ-VAE, the run's data as it drew it, and the record those tools write."""

from __future__ import annotations

import argparse
import json
import math
from itertools import islice
from pathlib import Path
from typing import Any

import torch
from torch import Tensor

from eval import peers
from eval._provenance import code_commit, repo_relative
from softvq.data.cifar10 import CIFAR10DataModule
from softvq.models import VQVAE
from softvq.models.checkpoint_io import load_torch_file
from softvq.models.files import write_atomic


def tool_parser(prog: str, doc: str, images: int) -> argparse.ArgumentParser:
    """The command line every tool on a run's checkpoint shares (``--data-root``, ``--run``, ``--images`` with
    ``images`` as its default, ``--out``); a tool adds its own flags."""
    p = argparse.ArgumentParser(prog=prog, description=doc.split("\n\n")[0])
    p.add_argument("--data-root", type=Path, default=Path("data"))
    p.add_argument("--run", type=Path, required=True, help="a long run directory (K<K>/<method>/seed<S>)")
    p.add_argument("--images", type=int, default=images, help="validation images scored")
    p.add_argument("--out", type=Path, default=None, help="JSON file the result is written to")
    return p


def load_run(run: Path) -> tuple[VQVAE, dict[str, Any]]:
    """The VQ-VAE of a long run's directory (``--runs/K<K>/<method>/seed<S>``) at its last checkpoint, and the run's
    settings (``settings.json``) with its ``epoch``, ``method`` and ``seed`` (from the directory's name); its method
    must be DDCL's (``ddcl`` or a ``ddcl_*`` candidate).

    Raises:
        ValueError: the run is another method's.
    """
    settings = json.loads((run / "settings.json").read_text())
    method = run.parent.name
    if method != "ddcl" and not method.startswith("ddcl_"):
        raise ValueError(f"{run} is a {method} run; these tools score a DDCL layer (ddcl or ddcl_*)")
    checkpoint = load_torch_file(run / "checkpoints" / "last.ckpt", "checkpoint")
    model = VQVAE(quantizer=peers.build(method, settings["num_codes"], settings["code_dim"]),
                  code_dim=settings["code_dim"], width=settings["width"], res_blocks=settings["res_blocks"],
                  res_hidden=settings["res_hidden"], lr=settings["lr"])
    model.load_state_dict(checkpoint["state_dict"])
    seed = int(run.name.removeprefix("seed"))
    return model, {**settings, "epoch": int(checkpoint["epoch"]) + 1, "method": method, "seed": seed}


def run_data(data_root: Path, settings: dict[str, Any]) -> CIFAR10DataModule:
    """The data module of the run with ``settings`` (:func:`load_run`'s), set up: its training and validation splits
    are drawn from its seed and held-out size, as the run drew them."""
    data = CIFAR10DataModule(data_root, batch_size=settings["batch_size"], val_size=settings["val_size"],
                             train_subset=settings["train_subset"], num_workers=0, seed=settings["seed"])
    data.setup("fit")
    return data


def validation_images(data: CIFAR10DataModule, count: int) -> Tensor:
    """The first ``count`` images of ``data``'s validation split."""
    batches = islice(data.val_dataloader(), math.ceil(count / data.batch_size))
    return torch.cat([x for x, _ in batches])[:count]


def training_batches(data: CIFAR10DataModule, count: int) -> list[Tensor]:
    """The first ``count`` image batches of ``data``'s training split, in the loader's order for its seed."""
    return [x for x, _ in islice(data.train_dataloader(), count)]


def write_record(run: Path, settings: dict[str, Any], images: Tensor, scores: dict[str, Any],
                 out: Path | None) -> dict[str, Any]:
    """The record of a tool's ``scores`` on ``images`` of the run (which checkpoint, code commit, split), printed as
    JSON and, with ``out``, written there; returned."""
    record = {"run": repo_relative(run), "epoch": settings["epoch"], "method": settings["method"],
              "seed": settings["seed"], "images": len(images), "code": code_commit(), "split": "validation", **scores}
    text = json.dumps(record, indent=1)
    print(text)
    if out is not None:
        write_atomic(out, text + "\n")
    return record
