"""Does evaluating with the token standardiser's running statistics cost a DDCL VQ-VAE accuracy?

In training a DDCL layer standardises each batch's tokens with that batch's mean and variance; in evaluation it uses
running averages of them (momentum 0.1 per step, ``softvq.parts.TokenStandardizer``). When the encoder's output drifts
faster than the running averages follow, evaluation sees codes the decoder was not trained on. This study trains one
VQ-VAE exactly as ``eval.peers`` / ``eval.residual`` do (``eval.peers.fit_run``), keeps its weights, and scores the
**validation** split's hard-index PSNR with the standardiser's statistics taken three ways:

    running    the running moments (``eval_statistics="running"``)
    applied    the running average of the shift and scale training applied (``eval_statistics="applied"``, what
               ``model.eval()`` uses by default)
    batch      each validation batch's own moments (what plain batch standardisation trains with; batch
               renormalisation is off for this pass), updating nothing
    precise    the moments of every training image's tokens under the final encoder (one pass, no gradient)

Usage:
    python -m eval.standardiser_stats --method rddcl --seed 1 --data-root ../shared/data/cifar10-jpeg.tar.gz

``--method``: a bottleneck of ``eval.residual`` (``rddcl``, ...) or of ``eval.peers`` (``ddcl``, ...). The run is
kept in ``--runs/<method>/seed<S>/`` (``vqvae.pt``, ``result.json``: read, not retrained, when its settings match).
``fit_run`` scores one test batch (``--test-limit``) that this study never reads.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

import torch
from torchmetrics.image import PeakSignalNoiseRatio

from eval import peers, residual
from eval._provenance import code_commit
from softvq.cli.common import run_command
from softvq.data.cifar10 import CIFAR10DataModule
from softvq.models import VQVAE
from softvq.models.checkpoint_io import load_torch_file
from softvq.models.files import write_atomic
from softvq.norm import bessel
from softvq.parts import TokenStandardizer

MODES = ("running", "applied", "batch", "precise")


def standardisers(model: VQVAE) -> list[TokenStandardizer]:
    """Every token standardiser the bottleneck applies: a residual stack's shared one (``scale="shared"``) and those of
    the DDCL layers that standardise (a single layer; the levels of ``scale="per_level"``)."""
    q = model.quantizer
    found = [q.standardizer] if isinstance(getattr(q, "standardizer", None), TokenStandardizer) and not hasattr(
        q, "standardize") else []
    layers = [q, *getattr(q, "levels", [])]
    return found + [m.standardizer for m in layers if getattr(m, "standardize", False)]


@torch.no_grad()
def precise_statistics(model: VQVAE, loader: Any, standardiser: TokenStandardizer) -> tuple[torch.Tensor, torch.Tensor]:
    """Mean and unbiased variance of the tokens ``standardiser`` sees, over every image of ``loader``, in float64.
    Only the shared top standardiser of a residual stack or a single layer's sees the encoder's tokens directly."""
    total = total_sq = None
    count = 0
    for x, _ in loader:
        tokens = model.latents(x).movedim(1, -1).reshape(-1, standardiser.dim).double()
        total = tokens.sum(0) if total is None else total + tokens.sum(0)
        total_sq = tokens.square().sum(0) if total_sq is None else total_sq + tokens.square().sum(0)
        count += tokens.shape[0]
    mean = total / count
    var = (total_sq / count - mean.square()) * bessel(torch.tensor(count))
    return mean, var


@torch.no_grad()
def val_psnr(model: VQVAE, loader: Any, mode: str) -> float:
    """Validation PSNR (per image, averaged) of the hard-index reconstruction, the standardisers in ``mode``."""
    model.eval()
    found = standardisers(model)
    renorm, kinds = [s.renorm for s in found], [s.eval_statistics for s in found]
    for s in found:
        s.eval_statistics = "applied" if mode == "applied" else "running"
    if mode == "batch":  # training-mode statistics; the quantizer is in eval mode, so nothing is updated
        for s in found:  # batch renormalisation would standardise with the running statistics in value: off here
            s.train()
            s.renorm = False
    metric = PeakSignalNoiseRatio(data_range=1.0, dim=(1, 2, 3))
    try:
        for x, _ in loader:
            metric.update(model(x).reconstruction.clamp(0, 1), x)
    finally:
        for s, flag, kind in zip(found, renorm, kinds, strict=True):
            s.renorm, s.eval_statistics = flag, kind
        model.eval()
    return float(metric.compute())


def study(model: VQVAE, data: CIFAR10DataModule, trajectory: dict[str, torch.Tensor] | None = None,
          momenta: tuple[float, ...] = ()) -> dict[str, float]:
    """The validation PSNRs of :data:`MODES` (``precise`` replaces the running statistics on a copy of the state,
    restored) and, given the training ``trajectory``, of every rule of :func:`policies` at the layer's momentum (as
    ``policy_<name>``) and of its per-step rules at each of ``momenta`` (``policy_<name>_m<m>``)."""
    figures = {mode: val_psnr(model, data.val_dataloader(), mode) for mode in ("running", "applied", "batch")}
    found = standardisers(model)
    if trajectory is not None and len(found) == 1:
        (s,) = found
        saved = s.applied_mean.clone(), s.applied_var.clone()
        rules = policies(trajectory, s.eval_momentum)
        for m in momenta:
            rules.update({f"{name}_m{m:g}": stats for name, stats in policies(trajectory, m).items()
                          if name.endswith("_step")})
        for name, (mean, std) in rules.items():
            s.applied_mean.copy_(mean.to(s.applied_mean.dtype))
            s.applied_var.copy_((std**2).to(s.applied_var.dtype))
            figures[f"policy_{name}"] = val_psnr(model, data.val_dataloader(), "applied")
        s.applied_mean.copy_(saved[0])
        s.applied_var.copy_(saved[1])
    if len(found) != 1:
        raise ValueError(f"the precise pass needs one standardiser on the encoder's tokens, found {len(found)}")
    (s,) = found
    saved = s.running_mean.clone(), s.running_var.clone()
    mean, var = precise_statistics(model.eval(), data.train_dataloader(), s)
    s.running_mean.copy_(mean.to(s.running_mean.dtype))
    s.running_var.copy_(var.to(s.running_var.dtype))
    figures["precise"] = val_psnr(model, data.val_dataloader(), "running")
    s.running_mean.copy_(saved[0])
    s.running_var.copy_(saved[1])
    figures["running_mean_shift"] = float((saved[0].double() - mean).norm() / var.sqrt().norm())
    figures["running_var_ratio_max"] = float((saved[1].double() / var).max())
    figures["running_var_ratio_min"] = float((saved[1].double() / var).min())
    return figures


class Trajectory:
    """What a standardiser saw and applied at every training step (a forward hook): the batch's moments (biased
    variance), the shift and scale the step applied, and its token count; float64 on the CPU."""

    KEYS = ("batch_mean", "batch_var", "shift", "scale", "count")

    def __init__(self) -> None:
        self.steps: list[tuple[torch.Tensor, ...]] = []

    def hook(self, module: TokenStandardizer, inputs: tuple, outputs: tuple) -> None:
        if module.training and not module.frozen:
            z = inputs[0].detach().double()
            self.steps.append((z.mean(0), z.var(0, unbiased=False), outputs[1].detach().double(),
                               outputs[2].detach().double(), torch.tensor(float(z.shape[0]), dtype=torch.float64)))

    def state(self) -> dict[str, torch.Tensor]:
        return {k: torch.stack([step[i] for step in self.steps]) for i, k in enumerate(self.KEYS)}


def _ema(values: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
    """``x <- x + w_t (v_t - x)`` over the rows of ``values``, from the first row (weight 1)."""
    x = values[0].clone()
    for v, w in zip(values[1:], weights[1:], strict=True):
        x += w * (v - x)
    return x


def policies(traj: dict[str, torch.Tensor], momentum: float = 0.5) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
    """Evaluation statistics ``(mean, std)`` computed from a training trajectory, one per rule: the applied shift and
    scale averaged with ``momentum`` per step (the layer's default), per token (a batch of ``n`` tokens weighs
    ``1 - (1 - momentum)^(n / n_max)``: an epoch's short last batch counts for its size), without short batches, and
    the batches' own moments averaged the same ways (what training would apply without renormalisation's clip)."""
    n = traj["count"]
    per_step = torch.full_like(n, momentum)
    per_token = 1 - (1 - momentum) ** (n / n.max())
    full = n == n.max()
    eps = 1e-5
    batch_std = (traj["batch_var"] + eps * traj["batch_var"].mean(1, keepdim=True)).sqrt()
    out = {}
    for name, weights, rows in (("step", per_step, slice(None)), ("token", per_token, slice(None)),
                                ("full_batches", per_step[full], full)):
        out[f"applied_{name}"] = (_ema(traj["shift"][rows], weights), _ema(traj["scale"][rows] ** 2, weights).sqrt())
        out[f"batch_{name}"] = (_ema(traj["batch_mean"][rows], weights), _ema(batch_std[rows] ** 2, weights).sqrt())
    return out


def build(method: str, args: argparse.Namespace) -> torch.nn.Module:
    if method in residual.METHODS:
        return residual.build(method, args.num_quantizers, args.num_codes, args.code_dim)
    return peers.build(method, args.num_codes, args.code_dim)


def main(argv: list[str] | None = None) -> dict[str, Any]:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--data-root", type=Path, default=Path("data"))
    p.add_argument("--method", default="rddcl", help="a bottleneck of eval.residual or eval.peers")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--num-codes", type=int, default=256)
    p.add_argument("--num-quantizers", type=int, default=4)
    peers.add_vqvae_arguments(p)
    p.add_argument("--runs", type=Path, default=Path("runs/standardiser_stats"))
    p.add_argument("--out", type=Path, default=None, help="write the figures as JSON here")
    p.add_argument("--momenta", type=float, nargs="*", default=[],
                   help="also score the per-step evaluation rules at these momenta (needs a recorded trajectory)")
    p.add_argument("--no-progress-bar", action="store_true")
    args = p.parse_args(argv)
    if not args.test_limit:
        args.test_limit = args.batch_size  # fit_run's test pass: one batch, never read here
    out = args.runs / args.method / f"seed{args.seed}"
    settings = {**peers.settings_of(args), "num_quantizers": args.num_quantizers}
    with peers.study_run(args.threads):
        stored = json.loads((out / "result.json").read_text()) if (out / "result.json").is_file() else {}
        if stored.get("settings") == settings and (out / "vqvae.pt").is_file():
            model = VQVAE(quantizer=build(args.method, args), code_dim=args.code_dim, width=args.width,
                          res_blocks=args.res_blocks, res_hidden=args.res_hidden, lr=args.lr)
            model.load_state_dict(load_torch_file(out / "vqvae.pt", "VQ-VAE state"))
            data = CIFAR10DataModule(args.data_root, batch_size=args.batch_size, val_size=args.val_size,
                                     train_subset=args.train_subset, num_workers=args.num_workers, seed=args.seed)
            data.setup("fit")
            history = stored["history"]
        else:
            recorder = Trajectory()

            def watched() -> torch.nn.Module:
                bottleneck = build(args.method, args)
                found = [m for m in bottleneck.modules() if isinstance(m, TokenStandardizer)]
                if len(found) == 1:
                    found[0].register_forward_hook(recorder.hook)
                return bottleneck

            model, data, result = peers.fit_run(args.method, args.seed, args, out, quantizer=watched)
            if recorder.steps:
                torch.save(recorder.state(), out / "trajectory.pt")
            torch.save(model.state_dict(), out / "vqvae.pt")
            write_atomic(out / "result.json", json.dumps({**result, "settings": settings,
                                                          "commit": code_commit()}, indent=1))
            history = result["history"]
        trajectory = (load_torch_file(out / "trajectory.pt", "standardiser trajectory")
                      if (out / "trajectory.pt").is_file() else None)
        figures = study(model, data, trajectory, tuple(args.momenta))
    summary = {"method": args.method, "seed": args.seed, "split": "validation", "settings": settings,
               "history_last_val_psnr_hard": history[-1]["val_psnr_hard"], **figures,
               "command": "python -m eval.standardiser_stats " + " ".join(argv if argv is not None else sys.argv[1:])}
    print(json.dumps({k: v for k, v in summary.items() if k != "settings"}), flush=True)
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        write_atomic(args.out, json.dumps(summary, indent=1))
    return summary


def cli(argv: list[str] | None = None) -> int:
    return run_command(main, argv)


if __name__ == "__main__":
    raise SystemExit(cli())
