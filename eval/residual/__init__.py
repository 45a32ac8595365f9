"""Residual quantizers in the project's VQ-VAE: ResidualDDCL against vector-quantize-pytorch's ResidualVQ and
ResidualFSQ and our residual hard VQ, at equal bits; ``reports/residual/``.

Usage (Q = 4 levels of K = 256, 32 bits per position; the peers' setting: 5 epochs on 10,000 images, 3 seeds):
    pip install -e ".[bench]"          # vector-quantize-pytorch, a benchmark-only extra
    python -m eval.residual --data-root ../shared/data/cifar10-jpeg.tar.gz
    python -m eval.residual --probe-scale --data-root ...   # the scale decision on validation (seed 0)

Methods (``--methods``):
    rddcl       ``softvq.ResidualDDCL(Q, K, D)``, the layer's defaults
    rddcl_per_level  the same with ``scale="per_level"`` (the scale probe only)
    rddcl_dropout  the same with ``quantize_dropout=True`` (measured separately, as the peers run without it: one
                model for 1..Q levels, its PSNR by levels decoded against the headline ResidualDDCL's)
    rhard       ``softvq.ResidualHardVQ(Q, K, D)``: HardVQ per level, EMA 0.99 + restart 1
    vqp_rvq     vector-quantize-pytorch ``ResidualVQ(num_quantizers=Q, codebook_size=K, kmeans_init=True,
                threshold_ema_dead_code=2, rotation_trick=True)``, the recipe its README gives against dead codes
    vqp_rfsq    vector-quantize-pytorch ``ResidualFSQ(levels=[8, 6, 5], num_quantizers=Q)``: 240 codes a level
    ddcl512     the single ``softvq.DDCLQuantizer(512, D)`` (9 bits per position): the PSNR a bit buys; with
                ``--single-runs`` read from the rate-distortion study's DDCL K = 512 points, which train this model

Every run trains with ``eval.peers.fit_run`` into ``--runs/<method>/seed<S>/`` (``result.json``, read when its
settings match). Each run's test record has every level's utilization and perplexity, and the PSNR decoded from its
first 1, 2, ..., Q levels; the per-epoch validation record every level's health.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torchmetrics.image import PeakSignalNoiseRatio

import softvq
from eval import peers
from eval._provenance import code_commit
from softvq.cli.common import run_command
from softvq.models.files import write_atomic
from softvq.types import QuantizerOutput

LABELS = {
    "rddcl": "softvq ResidualDDCL, defaults",
    "rddcl_per_level": "softvq ResidualDDCL, scale='per_level'",
    "rddcl_dropout": "softvq ResidualDDCL, quantize_dropout=True",
    "rddcl_renorm": "softvq ResidualDDCL, standardiser with batch renormalisation",
    "rddcl_no_renorm": "softvq ResidualDDCL(renorm=False)",
    "rhard": "softvq ResidualHardVQ (EMA 0.99 + restart 1 per level)",
    "vqp_rvq": "vqp ResidualVQ (kmeans init, dead < 2, rotation trick)",
    "vqp_rfsq": "vqp ResidualFSQ [8,6,5] (240 codes a level)",
    "ddcl512": "softvq DDCL, K = 512 (one codebook)",
}
METHODS = tuple(LABELS)
FSQ_LEVELS = [8, 6, 5]


class PeerResidual(nn.Module):
    """A vector-quantize-pytorch residual quantizer behind softvq's residual interface (what
    :func:`softvq.residual.is_residual` looks for): tokens ``(..., D)`` in, indices ``(..., Q)``, one-hot ``probs``
    ``(..., Q, K)``, ``level_output``, ``decode_indices(indices, levels)``, and ``levels`` (each wrapped layer, for
    its codebook and restart count). It only reshapes; the wrapped module computes everything."""

    def __init__(self, module: nn.Module, kind: str, num_codes: int, dim: int) -> None:
        super().__init__()
        self.module, self.kind, self.num_codes, self.dim = module, kind, num_codes, dim
        self.num_quantizers = len(module.layers)
        self.levels = nn.ModuleList(peers.PeerAdapter(layer, kind, num_codes, _code_width(layer, kind, dim))
                                    for layer in module.layers)

    def forward(self, z: Tensor) -> QuantizerOutput:
        lead = z.shape[:-1]
        flat = z.reshape(z.shape[0], -1, self.dim)
        if self.kind == "fsq":
            quantized, indices = self.module(flat)
            loss = flat.new_zeros(())
        else:
            quantized, indices, losses = self.module(flat)
            loss = losses.sum()
        indices = indices.reshape(*lead, self.num_quantizers).long()
        probs = F.one_hot(indices.clamp_min(0), self.num_codes).float()
        return QuantizerOutput(quantized.reshape(z.shape), indices, probs, loss, {})

    def level_output(self, out: QuantizerOutput, q: int) -> QuantizerOutput:
        return QuantizerOutput(out.quantized, out.indices[..., q], out.probs[..., q, :], out.loss, {})

    @torch.no_grad()
    def decode_indices(self, indices: Tensor, levels: int | None = None) -> Tensor:
        cut = indices.clone()
        if levels is not None:
            cut[..., levels:] = -1  # the library masks -1: a level that adds nothing
        flat = cut.reshape(cut.shape[0], -1, self.num_quantizers)
        return self.module.get_output_from_indices(flat).reshape(*indices.shape[:-1], self.dim)

    @property
    def codebook(self) -> Tensor:
        return torch.stack([level.codebook for level in self.levels])


def _code_width(layer: nn.Module, kind: str, dim: int) -> int:
    """The width of one level's codes: ``dim`` for VectorQuantize levels, the number of FSQ levels for ResidualFSQ's
    (it projects into that space once, at the top)."""
    if kind != "fsq":
        return dim
    with torch.no_grad():
        return int(layer.indices_to_codes(torch.zeros(1, 1, dtype=torch.long)).shape[-1])


def build(method: str, num_quantizers: int, num_codes: int, dim: int) -> nn.Module:
    """The bottleneck ``method``: ``num_quantizers`` levels of ``num_codes`` codes (FSQ: 240) of dimension ``dim``."""
    if method == "rddcl":
        return softvq.ResidualDDCL(num_quantizers, num_codes, dim)
    if method == "rddcl_per_level":
        return softvq.ResidualDDCL(num_quantizers, num_codes, dim, scale="per_level")
    if method == "rddcl_dropout":
        return softvq.ResidualDDCL(num_quantizers, num_codes, dim, quantize_dropout=True)
    if method == "rddcl_renorm":  # a probe: the shared standardiser with batch renormalisation
        return softvq.ResidualDDCL(num_quantizers, num_codes, dim, renorm=True)
    if method == "rddcl_no_renorm":  # the default before batch renormalisation
        return softvq.ResidualDDCL(num_quantizers, num_codes, dim, renorm=False)
    if method == "rhard":
        return softvq.ResidualHardVQ(num_quantizers, num_codes, dim)
    if method == "ddcl512":
        return softvq.DDCLQuantizer(512, dim)
    vqp = peers._vqp()
    if method == "vqp_rvq":
        return PeerResidual(vqp.ResidualVQ(dim=dim, num_quantizers=num_quantizers, codebook_size=num_codes,
                                           kmeans_init=True, threshold_ema_dead_code=2, rotation_trick=True),
                            "vq", num_codes, dim)
    if method == "vqp_rfsq":
        return PeerResidual(vqp.ResidualFSQ(dim=dim, levels=FSQ_LEVELS, num_quantizers=num_quantizers), "fsq",
                            math.prod(FSQ_LEVELS), dim)
    raise ValueError(f"unknown method {method!r}; choose from {METHODS}")


def bits_per_position(method: str, args: argparse.Namespace) -> float:
    if method == "ddcl512":
        return math.log2(512)
    codes = math.prod(FSQ_LEVELS) if method == "vqp_rfsq" else args.num_codes
    return args.num_quantizers * math.log2(codes)


@torch.no_grad()
def psnr_by_levels(model: nn.Module, loader: Any, levels: int, limit: int = 0) -> list[float]:
    """Test PSNR (per image, averaged; hard indices) decoded from the first 1, 2, ..., ``levels`` levels."""
    model.eval()
    metrics = [PeakSignalNoiseRatio(data_range=1.0, dim=(1, 2, 3)) for _ in range(levels)]
    seen = 0
    for x, _ in loader:
        codes = model.encode(x)
        for q, metric in enumerate(metrics, start=1):
            decoded = model.decode_indices(codes, q) if levels > 1 else model.decode_indices(codes)
            metric.update(decoded.clamp(0, 1), x)
        seen += len(x)
        if limit and seen >= limit:
            break
    return [float(m.compute()) for m in metrics]


def single_from_rate_distortion(seed: int, args: argparse.Namespace) -> dict[str, Any] | None:
    """The one-codebook row (``ddcl512``) of seed ``seed`` read from the rate-distortion study's runs
    (``--single-runs``), whose DDCL K = 512 points train exactly this VQ-VAE (``eval.peers.fit_run`` with
    ``softvq.DDCLQuantizer(512, D)`` and the same settings); ``None`` when that point is missing or was trained
    with other settings."""
    if args.single_runs is None:
        return None
    path = args.single_runs / "ddcl" / "K512" / f"seed{seed}" / "result.json"
    if not path.is_file():
        return None
    stored = json.loads(path.read_text())
    wanted = peers.settings_of(argparse.Namespace(**{**vars(args), "num_codes": 512}))
    if {k: v for k, v in stored.get("settings", {}).items() if k != "prior"} != wanted:
        return None
    return {**{k: v for k, v in stored.items() if k not in ("prior", "neighbours")}, "method": "ddcl512",
            "settings": {**peers.settings_of(args), "num_quantizers": args.num_quantizers}, "levels": 1,
            "bits_per_position": bits_per_position("ddcl512", args),
            "psnr_by_levels": [stored["test"]["psnr_hard"]], "source": str(path)}


def run(method: str, seed: int, args: argparse.Namespace) -> dict[str, Any] | None:
    out = args.runs / method / f"seed{seed}"
    settings = {**peers.settings_of(args), "num_quantizers": args.num_quantizers}
    path = out / "result.json"
    if path.is_file():
        stored = json.loads(path.read_text())
        if stored.get("settings") == settings:
            return stored
    if method == "ddcl512" and (shared := single_from_rate_distortion(seed, args)) is not None:
        return shared
    if args.no_train:
        return None
    print(f"[residual] training {method} seed {seed} -> {out}", flush=True)
    model, data, result = peers.fit_run(method, seed, args, out, quantizer=lambda: build(
        method, args.num_quantizers, args.num_codes, args.code_dim))
    levels = getattr(model, "num_quantizers", 1)
    result.update(settings=settings, commit=args.commit, bits_per_position=bits_per_position(method, args),
                  levels=levels, psnr_by_levels=psnr_by_levels(model, data.test_dataloader(), levels,
                                                               args.test_limit))
    write_atomic(path, json.dumps(result, indent=1))
    return result


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m eval.residual", description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--data-root", type=Path, default=Path("data"))
    p.add_argument("--methods", nargs="+", choices=METHODS, default=["rddcl", "rhard", "vqp_rvq", "vqp_rfsq",
                                                                     "ddcl512"])
    p.add_argument("--probe-scale", action="store_true",
                   help="the scale decision: rddcl and rddcl_per_level, first seed, judged on validation")
    p.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    p.add_argument("--num-quantizers", type=int, default=4)
    p.add_argument("--num-codes", type=int, default=256)
    peers.add_vqvae_arguments(p)
    p.add_argument("--runs", type=Path, default=Path("runs/residual"))
    p.add_argument("--single-runs", type=Path, default=None,
                   help="eval.rate_distortion's --runs: its DDCL K = 512 points (the same VQ-VAE training) are read "
                        "as the ddcl512 rows instead of training them again")
    p.add_argument("--out", type=Path, default=Path("reports/residual"))
    p.add_argument("--no-train", action="store_true")
    p.add_argument("--no-progress-bar", action="store_true")
    args = p.parse_args(argv)
    if args.probe_scale:
        args.methods, args.seeds = ["rddcl", "rddcl_per_level"], args.seeds[:1]
    for name in ("num_quantizers", "num_codes", "epochs", "train_subset", "code_dim"):
        if getattr(args, name) < 1:
            p.error(f"--{name.replace('_', '-')} must be positive, got {getattr(args, name)}")
    args.commit = code_commit()
    args.command = "python -m eval.residual " + " ".join(argv if argv is not None else sys.argv[1:])
    return args


def main(argv: list[str] | None = None) -> dict[str, Any]:
    from eval.residual.report import write_report

    args = parse_args(argv)
    with peers.study_run(args.threads):
        runs = [r for seed in args.seeds for m in args.methods if (r := run(m, seed, args)) is not None]
    if not runs:
        raise FileNotFoundError(f"no finished run in {args.runs} for these settings, and --no-train forbids training")
    return write_report(runs, vars(args) | {"labels": LABELS}, args.out, probe=args.probe_scale)


def cli(argv: list[str] | None = None) -> int:
    return run_command(main, argv)
