"""Train VQ-VAEs on CIFAR-10 with a DDCL soft codebook and/or a hard straight-through VQ, side by side.

Examples:
    # both quantizers, 10k training images, 5 epochs, offline from the shared archive:
    python train_vqvae.py --quantizer ddcl hard --epochs 5 --train-subset 10000 \
        --data-root ../shared/data/cifar10-jpeg.tar.gz --out runs/compare
    # continue a run from its last checkpoint (to a larger epoch count):
    python train_vqvae.py --quantizer ddcl --out runs/ddcl --epochs 20 --resume

Every run directory (``--out``, or ``--out/<quantizer>`` when several quantizers are given) holds
``history.jsonl`` (one JSON object per epoch: codebook health, losses, validation metrics), ``config.json``,
``checkpoints/last.ckpt`` and ``checkpoints/best-epochNN.ckpt`` (lowest validation MSE), ``recon_epochNN.png``
(originals / soft / hard-decoded reconstructions) and TensorBoard logs in ``tb/``
(``tensorboard --logdir <out>``). With several quantizers a per-epoch comparison table is printed at the end and
written to ``<out>/comparison.md``.
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import json
import logging
import math
import os
import shutil
import signal
import sys
import warnings
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import lightning as L
from lightning.pytorch.callbacks import ModelCheckpoint
from lightning.pytorch.loggers import TensorBoardLogger
from lightning.pytorch.utilities import rank_zero_only

from models import QUANTIZERS, VQVAE
from models.callbacks import (
    AtomicCheckpointIO,
    HistoryWriter,
    ReconstructionGrid,
    ReplicaCheck,
    read_history,
    remove_stale_temporaries,
    write_atomic,
)
from models.checkpoint_io import checkpoint_classes, load_torch_file
from models.cli import GracefulStop, Interrupted, run_command
from softvq.datasets.cifar10 import CIFAR10DataModule, check_same_classes
from softvq.io import RunLock
from softvq.schedule import SCHEDULES

log = logging.getLogger("softvq")

# Flags that may differ when a run is resumed: they extend it (--epochs), say where the run and the same data are
# (a moved directory) or how to run it, and change no result. Every other flag must be as the run's config.json
# records it (README: Resuming).
RESUME_SAFE = ("epochs", "resume", "overwrite", "out", "data_root", "download", "num_workers", "no_progress_bar",
               "check_replicas", "accelerator", "strategy")
INVOCATIONS = "invocations.jsonl"  # one line per start or resume of a run: when, which pid, the argv, what changed


def _int_check(minimum: int):
    kind = "positive" if minimum == 1 else "non-negative"

    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected a {kind} integer, got {text!r}") from None
        if value < minimum:
            raise argparse.ArgumentTypeError(f"expected a {kind} integer, got {text!r}")
        return value
    return parse


def _float_check(allow_zero: bool):
    def parse(text: str) -> float:
        try:
            value = float(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected a number, got {text!r}") from None
        if not math.isfinite(value) or value < 0 or (value == 0 and not allow_zero):
            raise argparse.ArgumentTypeError(f"expected a {'non-negative' if allow_zero else 'positive'} "
                                             f"finite number, got {text!r}")
        return value
    return parse


_positive_int, _non_negative_int = _int_check(1), _int_check(0)
_positive_float, _non_negative_float = _float_check(False), _float_check(True)


def _entropy_target(text: str) -> float | str:
    return "off" if text == "off" else _non_negative_float(text)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], formatter_class=argparse.ArgumentDefaultsHelpFormatter,
        epilog="Data: --data-root is searched for cifar-10-batches-py/ (official release), train/ + test/ "
               "(ImageFolder), or is itself a .tar.gz of such a tree (extracted once into $SOFTVQ_CACHE, "
               "default ~/.cache/softvq). With internet access, --download fetches the official release.")
    g = p.add_argument_group("run")
    g.add_argument("--quantizer", nargs="+", choices=QUANTIZERS, default=["ddcl"],
                   help="bottleneck(s) to train; several are trained one after the other with the same seed and "
                        "data, each into --out/<quantizer>")
    g.add_argument("--epochs", type=_positive_int, default=10, help="training epochs (total, also when resuming)")
    g.add_argument("--batch-size", type=_positive_int, default=128, help="images per optimizer step")
    g.add_argument("--out", type=Path, default=Path("runs/vqvae"), help="output directory")
    g.add_argument("--seed", type=int, default=0, help="seed for weights, data order and initialisation")
    g.add_argument("--resume", nargs="?", const="last", default=None, metavar="CKPT",
                   help="continue from a checkpoint: a path, or without a value <out>/checkpoints/last.ckpt")
    g.add_argument("--check-replicas", type=_non_negative_int, default=50, metavar="N",
                   help="with several processes (DDP), check every N steps that the codebook is bit-identical on all "
                        "of them and stop if not; 0 = never")
    g.add_argument("--overwrite", action="store_true",
                   help="start afresh in an --out that already holds a run (its history is replaced)")
    g = p.add_argument_group("data")
    g.add_argument("--data-root", type=Path, default=Path("data"), help="CIFAR-10 directory or .tar.gz archive")
    g.add_argument("--download", action="store_true", help="download the official CIFAR-10 if none is found")
    g.add_argument("--train-subset", type=_positive_int, default=None,
                   help="train on this many images (a fixed subset) instead of all 45,000")
    g.add_argument("--val-size", type=_non_negative_int, default=5000,
                   help="training images held out for validation (a fixed split); 0 = no validation")
    g.add_argument("--num-workers", type=_non_negative_int, default=2, help="DataLoader worker processes")
    g = p.add_argument_group("model")
    g.add_argument("--num-codes", type=_positive_int, default=512, help="K, codebook size")
    g.add_argument("--code-dim", type=_positive_int, default=64, help="D, latent channels = code dimension")
    g.add_argument("--width", type=_positive_int, default=128, help="channels of the encoder/decoder trunk (even)")
    g.add_argument("--res-hidden", type=_positive_int, default=32, help="channels inside residual blocks")
    g.add_argument("--res-blocks", type=_non_negative_int, default=2, help="residual blocks in encoder and decoder")
    g.add_argument("--downsamples", type=_positive_int, default=2,
                   help="stride-2 layers: 2 maps 32x32 images to 8x8 latents")
    g = p.add_argument_group("optimization")
    g.add_argument("--lr", type=_positive_float, default=3e-4, help="Adam learning rate of encoder and decoder")
    g.add_argument("--eps", type=_positive_float, default=0.01,
                   help="DDCL timescale ratio: encoder lr / prototype lr (prototypes use lr / eps)")
    g = p.add_argument_group("DDCL codebook (--quantizer ddcl)")
    g.add_argument("--recipe", choices=("auto", "plain"), default="auto",
                   help="auto: the layer's collapse-free recipe (standardised tokens, entropy-controlled T, EMA "
                        "prototypes, restarts, hard output); plain: the paper's layer as written")
    g.add_argument("--temperature", type=_positive_float, default=None,
                   help="Boltzmann temperature T at the first step (squared standardised distances: two random "
                        "tokens are 2 * code-dim apart on average); default: set on the first batch from "
                        "--target-entropy (4 with --levels > 1)")
    g.add_argument("--temperature-schedule", choices=SCHEDULES, default="constant",
                   help="anneal T from --temperature to --temperature-final over the run's steps")
    g.add_argument("--temperature-final", type=_positive_float, default=None,
                   help="T at the last step (needed by every schedule but constant)")
    g.add_argument("--target-entropy", type=_entropy_target, default=None,
                   help="entropy-controlled T: after each step T follows the distance scale so that the mean "
                        "assignment entropy H(Q) stays at this many nats (exp(H) prototypes share a token), or "
                        "'off'; default min(2.5, log(K)/2) with a constant --temperature-schedule, off with any other")
    g.add_argument("--prototype-update", choices=("ema", "soft_ema", "gradient"), default=None,
                   help="how the prototypes learn: EMA of the tokens each wins (k-means step), EMA weighted by the "
                        "soft assignments (free-energy M-step), or the optimizer at lr / eps; default ema (gradient "
                        "with --recipe plain or --levels > 1)")
    g.add_argument("--hard-output", action=argparse.BooleanOptionalAction, default=None,
                   help="the decoder sees the argmax prototype (in training too) while the encoder gets the soft "
                        "centroid's gradient; default on (off with --recipe plain or --levels > 1)")
    g.add_argument("--standardize", action=argparse.BooleanOptionalAction, default=None,
                   help="standardise tokens inside the layer; default on (off with --recipe plain or --levels > 1)")
    g.add_argument("--output-scale", choices=("standardized", "input"), default=None,
                   help="with --standardize: codes in the standardised space (default) or on the encoder's scale")
    g.add_argument("--distance", choices=("euclidean", "cosine"), default="euclidean",
                   help="squared Euclidean, or cosine (tokens and prototypes L2-normalised)")
    g.add_argument("--codebook-term", choices=("free_energy", "l_q", "l_ols"), default="free_energy",
                   help="loss term that trains gradient-updated prototypes (stop-gradient on the encoder)")
    g.add_argument("--codebook-weight", type=_non_negative_float, default=1.0, help="its weight")
    g.add_argument("--commitment-weight", type=_non_negative_float, default=0.0,
                   help="weight of the commitment term (0: the encoder learns from the reconstruction alone)")
    g.add_argument("--commitment-term", choices=("hard", "l_ols", "l_q", "free_energy"), default="l_ols",
                   help="loss term that pulls the encoder to the codebook (hard: to its argmax code; stop-gradient "
                        "on the prototypes)")
    g.add_argument("--init", choices=("data", "normal"), default="data",
                   help="prototype initialisation: tokens of the first batch, or N(0, 1)")
    g.add_argument("--levels", type=_positive_int, default=1,
                   help="hierarchical DDCL: number of stacked codebooks; level l quantizes the pooled soft centroids "
                        "of level l-1, and the decoder sees every level (2: an 8x8 bottom and a 4x4 top grid)")
    g.add_argument("--level-codes", type=_positive_int, nargs="+", default=[128],
                   help="codes of every level above 0 (one value for all, or one per level above 0); level 0 has "
                        "--num-codes")
    g.add_argument("--level-pool", type=_positive_int, default=2,
                   help="pooling window between consecutive levels, on both latent axes (2: 2x2)")
    g = p.add_argument_group("both quantizers")
    g.add_argument("--latent-norm", choices=("none", "batch"), default=None,
                   help="normalise the latents before the quantizer (batch: per-channel standardisation, "
                        "non-affine BatchNorm); default batch for ddcl, none for hard")
    g.add_argument("--dead-code-threshold", type=_non_negative_float, default=None,
                   help="restart codes chosen fewer times per batch (running average) than this; 0 = never; "
                        "default 1 for ddcl (0 with --recipe plain), 0 for hard")
    g = p.add_argument_group("hard VQ (--quantizer hard)")
    g.add_argument("--beta", type=_non_negative_float, default=0.25, help="commitment weight")
    g.add_argument("--ema-decay", type=float, default=None,
                   help="EMA codebook updates with this decay in (0, 1) instead of gradient updates (ddcl: the decay "
                        "of --prototype-update ema, default 0.99)")
    add_hardware_args(p)
    return p


def add_hardware_args(p: argparse.ArgumentParser) -> None:
    """The Lightning hardware flags every trainer script shares (see :func:`hardware_kwargs`)."""
    g = p.add_argument_group("hardware (README: Scaling out)")
    g.add_argument("--accelerator", default="auto", help="Lightning accelerator: auto, cpu, gpu, ...")
    g.add_argument("--devices", default="1",
                   help="Lightning devices per node (a count, a comma-separated list of indices, or 'auto'); more "
                        "than one trains data-parallel (DDP), --batch-size images per device")
    g.add_argument("--num-nodes", type=_positive_int, default=1, help="machines (Lightning num_nodes)")
    g.add_argument("--strategy", default="auto",
                   help="Lightning strategy: auto (DDP for several devices), ddp, ddp_spawn, ddp_notebook, ...")
    g.add_argument("--precision", default="32-true",
                   help="Lightning precision: 32-true, bf16-mixed (autocast; the codebook computes in float32), "
                        "16-mixed, 64-true")
    g.add_argument("--no-progress-bar", action="store_true", help="disable the progress bar (e.g. in CI logs)")


def hardware_kwargs(args: argparse.Namespace) -> dict[str, Any]:
    """``L.Trainer`` arguments from :func:`add_hardware_args`' flags, with checkpoints written atomically."""
    return {"accelerator": args.accelerator, "devices": _devices(args.devices), "num_nodes": args.num_nodes,
            "strategy": args.strategy, "precision": args.precision, "plugins": [AtomicCheckpointIO()]}


def check_args(args: argparse.Namespace, parser: argparse.ArgumentParser) -> None:
    if args.ema_decay is not None and not 0.0 < args.ema_decay < 1.0:
        parser.error(f"argument --ema-decay: expected a number in (0, 1), got {args.ema_decay}")
    if args.target_entropy not in (None, "off") and args.temperature_schedule != "constant":
        parser.error("--target-entropy and --temperature-schedule both set the temperature; choose one")
    if args.temperature_schedule != "constant" and (args.temperature_final is None or args.temperature is None):
        parser.error(f"--temperature-schedule {args.temperature_schedule} needs --temperature and "
                     f"--temperature-final")
    if args.width % 2:
        parser.error(f"argument --width: must be even, got {args.width}")
    if args.resume not in (None, "last") and len(args.quantizer) > 1:
        parser.error("--resume with a checkpoint path needs a single --quantizer (use --resume alone to resume "
                     "every run from its own last checkpoint)")
    if len(set(args.quantizer)) != len(args.quantizer):
        parser.error(f"argument --quantizer: repeated names {args.quantizer}")
    if args.levels > 1 and args.quantizer != ["ddcl"]:
        parser.error(f"--levels {args.levels} stacks DDCL codebooks: it needs --quantizer ddcl alone, got "
                     f"{' '.join(args.quantizer)}")
    if len(args.level_codes) not in (1, args.levels - 1) and args.levels > 1:
        parser.error(f"argument --level-codes: give one value or one per level above 0 ({args.levels - 1}), got "
                     f"{len(args.level_codes)}")
    if args.levels > 1:  # the grid of every level must be divisible by the windows above it
        grid = 32 // 2 ** args.downsamples
        if grid % args.level_pool ** (args.levels - 1):
            parser.error(f"--levels {args.levels} with --level-pool {args.level_pool} needs a latent grid divisible "
                         f"by {args.level_pool ** (args.levels - 1)}; 32x32 images with --downsamples "
                         f"{args.downsamples} give {grid}x{grid}")


def model_config(args: argparse.Namespace, quantizer: str) -> dict[str, Any]:
    """The VQVAE constructor arguments for one quantizer."""
    target = {None: "auto", "off": None}.get(args.target_entropy, args.target_entropy)
    schedule, final = "constant", None
    if quantizer == "ddcl":
        schedule, final = args.temperature_schedule, args.temperature_final
        kwargs = {"temperature": args.temperature, "distance": args.distance, "codebook_term": args.codebook_term,
                  "codebook_weight": args.codebook_weight, "commitment_term": args.commitment_term,
                  "commitment_weight": args.commitment_weight, "init": args.init}
        if args.levels > 1:  # the hierarchy: plain levels, the model's own recipe (models.vqvae.HIERARCHY_DEFAULTS)
            kwargs = {k: v for k, v in kwargs.items() if v is not None}
            if args.dead_code_threshold is not None:
                kwargs["dead_code_threshold"] = args.dead_code_threshold
        else:  # the layer's recipe; None = the recipe's value
            options = {"recipe": args.recipe, "prototype_update": args.prototype_update, "ema_decay": args.ema_decay,
                       "hard_output": args.hard_output, "standardize": args.standardize,
                       "output_scale": args.output_scale,
                       "dead_code_threshold": args.dead_code_threshold}
            kwargs.update({k: v for k, v in options.items() if v is not None})
            if args.recipe == "auto":  # the layer holds the temperature (off for a schedule: models.VQVAE)
                if target != "auto":
                    kwargs["target_entropy"] = target
                target = "auto"
            # recipe plain: the layer's T is fixed and the model controls it (target_entropy below)
    else:
        target = None
        kwargs = {"beta": args.beta, "ema_decay": args.ema_decay,
                  "dead_code_threshold": args.dead_code_threshold or 0.0}
    return {"quantizer": quantizer, "num_codes": args.num_codes, "code_dim": args.code_dim, "quantizer_kwargs": kwargs,
            "width": args.width, "res_hidden": args.res_hidden, "res_blocks": args.res_blocks,
            "downsamples": args.downsamples, "lr": args.lr, "eps": args.eps,
            "temperature_schedule": schedule, "temperature_final": final, "target_entropy": target,
            "latent_norm": args.latent_norm or ("batch" if quantizer == "ddcl" and args.levels > 1 else "none"),
            "levels": args.levels, "level_pool": args.level_pool,
            "level_codes": args.level_codes[0] if len(args.level_codes) == 1 else args.level_codes}


def _flat(config: dict[str, Any], prefix: str = "") -> dict[str, Any]:
    """``{"a": {"b": 1}}`` -> ``{"a.b": 1}``; tuples as lists, so a saved and a fresh config compare alike."""
    out: dict[str, Any] = {}
    for key, value in config.items():
        if isinstance(value, dict):
            out.update(_flat(value, f"{prefix}{key}."))
        else:
            out[f"{prefix}{key}"] = list(value) if isinstance(value, tuple) else value
    return out


def check_checkpoint(path: Path, config: dict[str, Any]) -> dict[str, Any]:
    """A readable Lightning checkpoint (loaded with ``weights_only=True``: nothing in it runs) whose model
    hyperparameters match ``config``; returns it, else a clear error with the per-key differences."""
    if not path.is_file():
        raise FileNotFoundError(f"checkpoint to resume from not found: {path}")
    ckpt = load_torch_file(path, "checkpoint")  # UnsafeCheckpointError / ValueError naming the file
    if not isinstance(ckpt, dict) or "state_dict" not in ckpt:
        raise ValueError(f"{path} is not a Lightning checkpoint of this trainer (no state_dict)")
    saved, now = _flat(ckpt.get("hyper_parameters") or {}), _flat(config)
    diff = [f"{k}: checkpoint {saved[k]!r} vs now {now[k]!r}" for k in now if k in saved and saved[k] != now[k]]
    if diff:
        raise ValueError(f"checkpoint {path} was trained with another model configuration; pass the same "
                         f"flags to resume it:\n  " + "\n  ".join(diff))
    return ckpt


def run_config(args: argparse.Namespace, quantizer: str) -> dict[str, Any]:
    """What config.json records of one run: every flag, with this run's quantizer, as JSON values."""
    return json.loads(json.dumps({**vars(args), "quantizer": quantizer}, default=str))


def resume_changes(args: argparse.Namespace, quantizer: str, out: Path) -> dict[str, list[Any]]:
    """The flags that differ from the run's config.json, ``{flag: [recorded, now]}``; only :data:`RESUME_SAFE` ones
    may. A run without config.json (resumed from a checkpoint file into a new --out) has none to compare.

    Raises:
        ValueError: a flag outside :data:`RESUME_SAFE` differs (listing every difference), or config.json is unreadable.
    """
    path = out / "config.json"
    if not path.is_file():
        return {}
    try:
        recorded = json.loads(path.read_text())
    except (OSError, ValueError) as err:
        raise ValueError(f"{path} is unreadable ({err}); the run's settings cannot be checked") from err
    now = run_config(args, quantizer)
    changed = {k: [recorded[k], v] for k, v in now.items()
               if k in recorded and recorded[k] != v and k not in ("resume", "overwrite")}
    refused = {k: v for k, v in changed.items() if k not in RESUME_SAFE}
    if refused:
        lines = [f"--{k.replace('_', '-')}: run {old!r} vs now {new!r}" for k, (old, new) in refused.items()]
        safe = ", ".join(f"--{k.replace('_', '-')}" for k in RESUME_SAFE if k not in ("resume", "overwrite", "out"))
        raise ValueError(f"--resume would change settings of the run in {out} (its config.json), so it would no "
                         f"longer describe the epochs already trained; nothing was written. Resume with the run's "
                         f"settings (only {safe} may change) or start a new run in another --out:\n  "
                         + "\n  ".join(lines))
    return changed


def prepare_out(args: argparse.Namespace, quantizer: str, out: Path, changed: dict[str, list[Any]] | None = None,
                argv: Sequence[str] | None = None) -> None:
    """Refuse to start afresh over an old run (unless --overwrite, which clears it); write config.json for a new run
    (a resumed one keeps its own) and append this invocation to invocations.jsonl. Call with the run's lock held."""
    if args.resume is None and not args.overwrite and ((out / "history.jsonl").exists()
                                                       or (out / "checkpoints").exists()):
        raise FileExistsError(f"{out} already holds a run; pass --resume to continue it or --overwrite to "
                              f"start afresh (or choose another --out)")
    for directory in (out, out / "checkpoints"):  # a killed run's half-written temporaries, never its outputs
        remove_stale_temporaries(directory)
    if args.overwrite and args.resume is None:  # the previous run's artefacts would mix with the new ones
        for stale_file in (out / "history.jsonl", out / INVOCATIONS):
            stale_file.unlink(missing_ok=True)
        for stale in (out / "checkpoints", out / "tb"):
            shutil.rmtree(stale, ignore_errors=True)
        for png in out.glob("recon_epoch*.png"):
            png.unlink()
    record = {"time": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
              "pid": os.getpid(), "argv": list(sys.argv[1:] if argv is None else argv),
              "resume": args.resume, "changed": changed or {}}
    try:
        out.mkdir(parents=True, exist_ok=True)
        if args.resume is None or not (out / "config.json").exists():
            write_atomic(out / "config.json", json.dumps(run_config(args, quantizer), indent=2))
        log_path = out / INVOCATIONS
        previous = log_path.read_bytes() if log_path.exists() else b""
        write_atomic(log_path, previous + (json.dumps(record) + "\n").encode())
    except OSError as err:
        raise OSError(f"cannot write to the output directory {out}: {err}") from err


def checkpoint_callbacks(dirpath: Path, validation: bool) -> list[ModelCheckpoint]:
    """``last.ckpt`` after every training epoch and, with validation, ``best-epochNN.ckpt`` (lowest val MSE).

    Two callbacks, because Lightning's ``save_last=True`` rewrites ``last.ckpt`` only in an epoch whose top-k
    checkpoint was saved too: after an epoch that did not improve the validation MSE it kept the previous epoch.
    """
    last = ModelCheckpoint(dirpath=dirpath, filename="last", monitor=None, save_top_k=1, save_on_train_epoch_end=True,
                           enable_version_counter=False)
    if not validation:
        return [last]
    best = ModelCheckpoint(dirpath=dirpath, filename="best-epoch{epoch:02d}", auto_insert_metric_name=False,
                           monitor="val/mse", mode="min", save_top_k=1, save_on_train_epoch_end=True)
    return [best, last]


def build_trainer(args: argparse.Namespace, out: Path, validation: bool, steps_per_epoch: int) -> L.Trainer:
    """The Lightning Trainer of one run: history, reconstruction grids, atomic checkpoints, the DDP replica check."""
    callbacks = [HistoryWriter(out / "history.jsonl"), ReconstructionGrid(out),
                 *checkpoint_callbacks(out / "checkpoints", validation=validation)]
    if args.check_replicas:
        callbacks.append(ReplicaCheck(args.check_replicas))
    return L.Trainer(
        max_epochs=args.epochs, default_root_dir=out, **hardware_kwargs(args),
        # The data module shards every split itself (GlobalBatchSampler): N processes with --batch-size B see the
        # batches of one process with N * B. LatentNorm synchronises its batch statistics itself (SyncBatchNorm
        # refuses CPU tensors), so Lightning's sync_batchnorm stays off.
        use_distributed_sampler=False, sync_batchnorm=False,
        logger=TensorBoardLogger(save_dir=str(out), name="tb", version=""), callbacks=callbacks,
        num_sanity_val_steps=0, limit_val_batches=1.0 if validation else 0,
        log_every_n_steps=max(1, min(50, steps_per_epoch)), enable_progress_bar=not args.no_progress_bar)


def train_one(args: argparse.Namespace, quantizer: str, out: Path, stop: GracefulStop | None = None,
              argv: Sequence[str] | None = None) -> list[dict[str, Any]]:
    """Train (or resume) one VQ-VAE into ``out``; returns its history records.

    Everything is checked (the checkpoint, the flags against the run's config.json, the data and its classes) before
    anything is written. Call with ``out``'s :class:`~softvq.io.RunLock` held.

    Raises:
        FloatingPointError: NaN/Inf in a batch, the latents or the loss; the message names the step and the last
            good checkpoint, which is kept.
        Interrupted: SIGTERM/SIGINT (``stop``) ended training; the last good checkpoint is kept.
    """
    config = model_config(args, quantizer)
    ckpt_path, ckpt, changed = None, None, {}
    if args.resume is not None:
        ckpt_path = out / "checkpoints" / "last.ckpt" if args.resume == "last" else Path(args.resume)
        if args.resume == "last" and not ckpt_path.exists() and not (out / "history.jsonl").exists():
            # Stopped before its first checkpoint, or (several quantizers) never started: nothing to resume.
            log.warning("%s holds no checkpoint to resume: this run starts from the beginning", out)
            ckpt_path = None
        else:
            ckpt = check_checkpoint(ckpt_path, config)
        changed = resume_changes(args, quantizer, out)

    L.seed_everything(args.seed, workers=True, verbose=False)
    data = CIFAR10DataModule(args.data_root, batch_size=args.batch_size, val_size=args.val_size,
                             train_subset=args.train_subset, num_workers=args.num_workers, download=args.download,
                             seed=args.seed)
    data.prepare_data()
    data.setup("fit")  # bad or missing data, and train/ and test/ with other classes, fail here, before any write
    saved_classes = checkpoint_classes(ckpt) if ckpt is not None else None
    if saved_classes is not None:
        check_same_classes(saved_classes, data.classes, f"checkpoint {ckpt_path}", f"the data at {args.data_root}")
    if rank_zero_only.rank == 0:  # under DDP the other processes re-run this script: one process owns --out
        prepare_out(args, quantizer, out, changed, argv)

    model = VQVAE(**config)
    # Lightning's DDP strategies re-seed the global random state when fit starts (reset_seed); do the same in one
    # process, so data initialisation and dead-code restarts draw alike whatever the number of processes.
    L.seed_everything(args.seed, workers=True, verbose=False)
    devices = _devices(args.devices)
    per_node = devices if isinstance(devices, int) else len(devices) if isinstance(devices, list) else 1
    steps_per_epoch = math.ceil((args.train_subset or 45_000) / (args.batch_size * max(per_node, 1) * args.num_nodes))
    trainer = build_trainer(args, out, validation=args.val_size > 0, steps_per_epoch=steps_per_epoch)
    with warnings.catch_warnings():
        # One core per worker is the right setting on small machines; Lightning's hint does not apply.
        warnings.filterwarnings("ignore", message=".*does not have many workers.*")
        # Resuming writes into the run's own checkpoint directory on purpose.
        warnings.filterwarnings("ignore", message="Checkpoint directory .* exists and is not empty")
        # Lightning's pytree helper against newer torch; harmless.
        warnings.filterwarnings("ignore", message=".*isinstance\\(treespec, LeafSpec\\)` is deprecated")
        if stop is not None:
            stop.trainer = trainer
        try:
            # weights_only=True: resuming never runs code from the checkpoint (AtomicCheckpointIO enforces it too)
            trainer.fit(model, datamodule=data, ckpt_path=str(ckpt_path) if ckpt_path else None, weights_only=True)
        except FloatingPointError as err:
            raise FloatingPointError(f"{err}\n{last_good_checkpoint(out)}") from err
        except (Exception, SystemExit) as err:  # Lightning ends a stopped fit with SystemExit (SIGTERMException)
            if stop is None or stop.signum is None:
                raise
            kept = last_good_checkpoint(out, "run the same command with --resume")
            raise Interrupted(stop.signum, f"{stop_name(stop.signum)} stopped the training of {out} in epoch "
                                           f"{trainer.current_epoch + 1}. {kept}") from err
        finally:
            if stop is not None:
                stop.trainer = None
    if stop is not None and stop.signum is not None:  # the signal came as the last epoch ended: it is complete
        raise Interrupted(stop.signum, f"{stop_name(stop.signum)} arrived as {out} finished its last epoch; the run "
                                       f"is complete.")
    return read_history(out / "history.jsonl")


def stop_name(signum: int) -> str:
    return signal.Signals(signum).name


def last_good_checkpoint(out: Path, advice: str = "fix the cause and continue with --resume") -> str:
    """Where a failed run can continue from: its ``last.ckpt`` (untouched by the failure), or that there is none."""
    last = out / "checkpoints" / "last.ckpt"
    if not last.is_file():
        return f"Training stopped before its first checkpoint; nothing was saved in {out / 'checkpoints'}."
    try:
        epoch = int(load_torch_file(last, "checkpoint")["epoch"]) + 1
    except Exception as err:  # noqa: BLE001 - a message, not a check
        return f"Training stopped; the last checkpoint is {last}, but it cannot be read: {err}"
    return f"Training stopped; the last good checkpoint, {last} (end of epoch {epoch}), is kept: {advice}."


def _devices(text: str) -> int | str | list[int]:
    if text == "auto":
        return text
    if "," in text:
        return [int(t) for t in text.split(",") if t]
    return int(text)


def comparison_table(histories: dict[str, list[dict[str, Any]]]) -> str:
    """A markdown table with one row per epoch and, per quantizer, utilization, dead codes, perplexity, PSNR."""
    names = list(histories)
    header = ["epoch"] + [f"{n} {col}" for n in names for col in ("util %", "dead", "ppl", "val PSNR (hard)")]
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    epochs = sorted({row["epoch"] for rows in histories.values() for row in rows})
    for epoch in epochs:
        cells = [str(epoch)]
        for name in names:
            row = next((r for r in histories[name] if r["epoch"] == epoch), None)
            if row is None:
                cells += ["", "", "", ""]
                continue
            psnr = "n/a" if row.get("val_psnr") is None else f"{row['val_psnr']:.2f} ({row['val_psnr_hard']:.2f})"
            cells += [f"{100 * row['utilization']:.1f}", str(row["dead_codes"]), f"{row['perplexity']:.1f}", psnr]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def run_locks(args: argparse.Namespace) -> contextlib.ExitStack:
    """The exclusive :class:`~softvq.io.RunLock` of every run directory (and of --out itself with several
    quantizers, for comparison.md), taken at once, before anything is read or written; none under DDP's other
    processes, whose rank 0 holds them."""
    stack = contextlib.ExitStack()
    if rank_zero_only.rank != 0:
        return stack
    several = len(args.quantizer) > 1
    directories = ([args.out] if several else []) + [args.out / q if several else args.out for q in args.quantizer]
    with stack:
        for directory in directories:
            lock = stack.enter_context(RunLock(directory))
            if lock.stale_pid is not None:
                log.warning("%s: recovered the lock of run pid %d, which ended without releasing it", directory,
                            lock.stale_pid)
        return stack.pop_all()


def main(argv: Sequence[str] | None = None) -> dict[str, list[dict[str, Any]]]:
    parser = build_parser()
    args = parser.parse_args(argv)
    check_args(args, parser)
    several = len(args.quantizer) > 1
    histories = {}
    with GracefulStop() as stop, run_locks(args):
        for i, quantizer in enumerate(args.quantizer):
            out = args.out / quantizer if several else args.out
            try:
                histories[quantizer] = train_one(args, quantizer, out, stop, argv)
            except Interrupted as err:
                if not several:
                    raise
                unfinished = ", ".join(f"{q} ({'interrupted' if j == i else 'not started'})"
                                       for j, q in enumerate(args.quantizer) if j >= i)
                raise Interrupted(err.signum, f"{err} Runs not finished: {unfinished}; run the same command with "
                                              f"--resume to finish them.") from err
    table = comparison_table(histories)
    if rank_zero_only.rank != 0:
        return histories
    if several:
        write_atomic(args.out / "comparison.md", table)
    print("\nPer-epoch codebook health and validation PSNR (soft and decoded from hard indices):\n" + table)
    return histories


def cli(argv: Sequence[str] | None = None) -> int:
    """:func:`main` as a command: expected failures (missing or bad data, a bad checkpoint, an unusable or busy
    --out, NaN/Inf in training) print one ``error:`` message and return 2; bad flags exit 2 through argparse;
    SIGTERM / SIGINT stop it at the next batch, keep the last good checkpoint and return 143 / 130."""
    return run_command(main, argv)


if __name__ == "__main__":
    sys.exit(cli())
