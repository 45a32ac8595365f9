"""A short probe of one bottleneck setting in the project's VQ-VAE: the research loop behind the layer's defaults.

    python -m eval.probe --data-root ../shared/data/cifar10-jpeg.tar.gz --quantizer ddcl \
        --kwargs '{"target_entropy": 1.0}' --epochs 2

Trains ``models.VQVAE(quantizer=<module>, **--model-kwargs)`` on ``--train-subset`` CIFAR-10 images (5,000 held out
for validation) for ``--epochs``, prints one JSON line per epoch (codebook health, validation PSNR from hard
indices) and a final ``RESULT`` line with the last epoch's validation figures, and appends that line to
``--results`` if given. A probe chooses settings, so it reads the validation split only: the official test split is
for the final tables (``eval.peers``, ``eval.dropin``, ``eval.robustness``), and this module never loads it.
``--quantizer`` builds ``softvq.DDCLQuantizer(K, D, **kwargs)``, ``softvq.HardVQ(K, D, **kwargs)``,
``softvq.ResidualDDCL(Q, K, D, **kwargs)`` or ``softvq.ResidualHardVQ(Q, K, D, **kwargs)`` (``Q`` =
``--num-quantizers``) from the JSON ``--kwargs``: any option of the layer can be probed without a flag for it.
``--quantizer vqp_vq`` (``vqp_fsq``, ``vqp_simvq``) builds that peer of ``eval.peers`` in its recommended
configuration, ``--kwargs`` overriding its options (``'{"threshold_ema_dead_code": 0}'``: without dead-code
replacement).

``--level-gradient straight_through`` (residual DDCL only) is a probe of the encoder's gradient, not a layer option:
every level still assigns, updates and restarts as DDCL, but passes the decoder's gradient to its input unchanged
(``r + sg(c - r)``, a straight-through level, as hard VQ's) instead of through the soft centroid's Jacobian.
"""

from __future__ import annotations

import argparse
import json
import time
import warnings
from pathlib import Path

import lightning as L
import torch
from torch import Tensor, nn

import softvq
from eval import peers
from softvq._compat import upgrade_quantizer_kwargs
from softvq.data.cifar10 import CIFAR10DataModule
from softvq.models import VQVAE

# The peers of eval.peers (vector-quantize-pytorch, the benchmark-only extra), each in its recommended configuration
# with --kwargs overriding options of it.
PEERS = ("vqp_vq", "vqp_fsq", "vqp_simvq", "vqp_simvq_paper")
KEYS = ("epoch", "utilization", "val_utilization", "val_perplexity", "val_psnr", "val_psnr_hard", "temperature",
        "restarts", "assignment_entropy", "identity_residual", "time_s", "train_mse")


class StraightThroughLevel(nn.Module):
    """A residual level that keeps its quantizer's code, indices, terms and updates but passes the gradient to its
    input unchanged (``r + sg(c - r)``): the probe of what the soft centroid's Jacobian gives a residual stack."""

    def __init__(self, level: nn.Module) -> None:
        super().__init__()
        self.level, self.num_codes, self.dim = level, level.num_codes, level.dim

    def forward(self, r: Tensor) -> softvq.QuantizerOutput:
        out = self.level(r)
        return out._replace(quantized=r + (out.quantized - r).detach())

    def decode_indices(self, indices: Tensor) -> Tensor:
        return self.level.decode_indices(indices)

    @property
    def codebook(self) -> Tensor:
        return self.level.codebook


def build_quantizer(name: str, num_codes: int, dim: int, kwargs: dict, num_quantizers: int = 4,
                    level_gradient: str = "soft_centroid") -> nn.Module:
    """The probed bottleneck (see the module docstring). ``kwargs`` under a layer's former option names (a documented
    probe's ``--kwargs '{"dead_code_threshold": 0.0}'``) are today's (softvq._compat)."""
    if name in PEERS:
        if level_gradient != "soft_centroid":
            raise ValueError("--level-gradient applies to --quantizer rddcl only")
        return peers.build(name, num_codes, dim, kwargs)
    kwargs = upgrade_quantizer_kwargs(name, kwargs) or {}
    if name in ("ddcl", "hard"):
        if level_gradient != "soft_centroid":
            raise ValueError("--level-gradient applies to --quantizer rddcl only")
        return (softvq.DDCLQuantizer if name == "ddcl" else softvq.HardVQ)(num_codes, dim, **kwargs)
    cls = softvq.ResidualDDCL if name == "rddcl" else softvq.ResidualHardVQ
    quantizer = cls(num_quantizers, num_codes, dim, **kwargs)
    if level_gradient == "straight_through":
        if name != "rddcl":
            raise ValueError("--level-gradient straight_through applies to --quantizer rddcl only")
        quantizer.levels = nn.ModuleList(StraightThroughLevel(level) for level in quantizer.levels)
    return quantizer


class _Echo(L.Callback):
    def on_train_epoch_end(self, trainer: L.Trainer, pl_module: VQVAE) -> None:
        record = pl_module.epoch_summary()
        print(json.dumps({k: v for k, v in record.items() if k in KEYS or k.startswith("val_perplexity_l")}),
              flush=True)


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--data-root", type=Path, default=Path("data"))
    p.add_argument("--name", default="probe", help="label of the RESULT line")
    p.add_argument("--quantizer", choices=("ddcl", "hard", "rddcl", "rhard", *PEERS), default="ddcl")
    p.add_argument("--num-quantizers", type=int, default=4, help="levels of a residual quantizer")
    p.add_argument("--level-gradient", choices=("soft_centroid", "straight_through"), default="soft_centroid",
                   help="residual DDCL: what each level passes back to its input (see the module docstring)")
    p.add_argument("--kwargs", type=json.loads, default={}, help="JSON options of the quantizer class")
    p.add_argument("--model-kwargs", type=json.loads, default={}, help="JSON options of models.VQVAE")
    p.add_argument("--adam-betas", type=float, nargs=2, default=None, metavar=("BETA1", "BETA2"),
                   help="Adam's betas (default: torch's 0.9, 0.999), e.g. 0.5 0.9 as SimVQ's authors train")
    p.add_argument("--epochs", type=int, default=2)
    p.add_argument("--val-size", type=int, default=5000, help="training images held out for validation")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--train-subset", type=int, default=10_000)
    p.add_argument("--num-codes", type=int, default=512)
    p.add_argument("--code-dim", type=int, default=64)
    p.add_argument("--num-workers", type=int, default=1)
    p.add_argument("--results", type=Path, default=None, help="append the RESULT line (JSON) to this file")
    args = p.parse_args(argv)
    warnings.filterwarnings("ignore", message=".*does not have many workers.*")
    L.seed_everything(args.seed, workers=True, verbose=False)
    if args.val_size < 1:
        p.error(f"--val-size must be positive (a probe is judged on validation), got {args.val_size}")
    data = CIFAR10DataModule(args.data_root, batch_size=128, val_size=args.val_size, train_subset=args.train_subset,
                             num_workers=args.num_workers, seed=args.seed)
    quantizer = build_quantizer(args.quantizer, args.num_codes, args.code_dim, args.kwargs, args.num_quantizers,
                                args.level_gradient)
    model = VQVAE(quantizer=quantizer, code_dim=args.code_dim, **args.model_kwargs)
    if args.adam_betas is not None:  # the model's own optimizer (and parameter groups), other betas
        configure = model.configure_optimizers

        def configure_optimizers() -> torch.optim.Optimizer:
            optimizer = configure()
            for group in optimizer.param_groups:
                group["betas"] = tuple(args.adam_betas)
            return optimizer

        model.configure_optimizers = configure_optimizers
    L.seed_everything(args.seed, workers=True, verbose=False)
    trainer = L.Trainer(max_epochs=args.epochs, accelerator="cpu", logger=False, enable_checkpointing=False,
                        enable_progress_bar=False, enable_model_summary=False, num_sanity_val_steps=0,
                        callbacks=[_Echo()])
    start = time.time()
    trainer.fit(model, datamodule=data)
    s = model.epoch_summary()  # the last epoch's validation pass
    result = {"name": args.name, "epochs": args.epochs, "seed": args.seed, "split": "validation",
              "val_psnr_hard": s["val_psnr_hard"], "val_psnr": s["val_psnr"], "val_ssim_hard": s["val_ssim_hard"],
              "val_util": s["val_utilization"], "val_ppl": s["val_perplexity"], "wall": round(time.time() - start)}
    levels = getattr(quantizer, "num_quantizers", 1)
    if levels > 1:  # a residual stack: every level's validation health
        result["val_util_levels"] = [s[f"val_utilization_l{q}"] for q in range(levels)]
        result["val_ppl_levels"] = [s[f"val_perplexity_l{q}"] for q in range(levels)]
    print("RESULT", json.dumps(result), flush=True)
    if args.results:
        with open(args.results, "a") as f:
            f.write(json.dumps(result) + "\n")
    return result


if __name__ == "__main__":
    main()
