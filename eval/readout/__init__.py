"""Codebook reuse on CIFAR-10: readouts trained on the frozen 8x8 latents of a trained VQ-VAE, test accuracy.

    python -m eval.readout --checkpoint runs/cifar10/ddcl/checkpoints/last.ckpt \\
        --data-root ../shared/data/cifar10-jpeg.tar.gz            # 10,000 training images, 10 epochs, 3 seeds
    python -m eval.readout --checkpoint CKPT --data-root DATA --quick --out /tmp/readout     # a smoke run

The checkpoint's encoder and codebook are frozen; every image becomes its 8x8 latent grid read as ``T = 64`` tokens
of dimension ``D`` (row-major over the grid), plus the hard code index of every token (the quantizer's own
``indices``). Tokens of a fixed subset of the official training split (``--train-subset``) and of the official
test split are computed once and cached (``$SOFTVQ_CACHE/readout/``, keyed by the checkpoint's SHA-256 and the
data selection). Every readout sees the tokens standardised by one fixed affine map from the training tokens,
applied to the codebook too so that its assignments do not change (:func:`standardize`); ``--readout-temperature``
overrides the codebook's temperature for the DDCL readouts. Readouts (``eval/readout/heads.py``), each trained
with Adam on the training labels for ``--epochs`` epochs and scored on the test split after the last epoch (no
selection on the test split):

(a) mean token + linear probe; (b) normalised histogram of the hard codes + linear probe; (c) a
:class:`softvq.DDCLReadout` over the checkpoint's codebook, frozen, and a linear head on its pooled vector, soft
code histogram and slots; (d) the same with the codebook fine-tuned (prototypes at ``lr / eps``, DDCL loss
added, no dead-code restart); (e) a 2-layer transformer encoder over the tokens with a CLS token; (f) the same
transformer with a DDCLReadout (64 new prototypes, T = 4, trained with it) instead of the CLS token.

Writes ``report.md`` (mean +- sample std over ``--seeds``) and ``results.json`` (every run) to ``--out``.
"""

from __future__ import annotations

import argparse
import copy
import json
import logging
import math
import statistics
import time
from pathlib import Path
from typing import Any

import torch
from einops import rearrange
from torch import Tensor, nn
from torch.utils.data import DataLoader, Dataset, Subset

from eval._provenance import code_commit, portable, study_command
from eval.readout.heads import LABELS, READOUTS, build_readout, fit
from softvq import DDCLQuantizer, assignment_entropy
from softvq.data.cifar10 import CIFAR10DataModule, check_same_classes, default_cache_dir, sha256_file
from softvq.models.checkpoint_io import load_torch_file
from softvq.models.vqvae import VQVAE, load_vqvae

log = logging.getLogger("eval.readout")
CLASSES = 10
Split = tuple[Tensor, Tensor, Tensor]  # tokens (N, T, D) float32, indices (N, T) int64, labels (N,) int64


@torch.no_grad()
def encode(model: VQVAE, dataset: Dataset, batch_size: int, num_workers: int, device: torch.device) -> Split:
    """Frozen tokens ``(N, h*w, D)`` (what the quantizer sees: :meth:`models.VQVAE.latents`, after the latent
    norm), hard code indices ``(N, h*w)`` and labels ``(N,)`` of a data set."""
    tokens, indices, labels = [], [], []
    for x, y in DataLoader(dataset, batch_size=batch_size, shuffle=False, num_workers=num_workers):
        latents = model.latents(x.to(device))  # (B, D, h, w)
        grid = rearrange(latents, "b d h w -> b h w d")
        indices.append(model.quantizer(grid).indices.flatten(1).cpu())
        tokens.append(rearrange(grid, "b h w d -> b (h w) d").float().cpu())
        labels.append(y)
    return torch.cat(tokens), torch.cat(indices), torch.cat(labels)


def latents(args: argparse.Namespace, model: VQVAE, digest: str, device: torch.device) -> tuple[Split, Split]:
    """Train and test splits of frozen tokens, from the cache when it holds exactly this selection."""
    data = CIFAR10DataModule(args.data_root, batch_size=256, val_size=0, train_subset=args.train_subset,
                             num_workers=args.num_workers)
    data.setup()  # resolves (and extracts) the data; raises with instructions when there is none
    if model.class_names is not None:  # the readout's labels must mean the classes the model was trained on
        check_same_classes(model.class_names, data.classes, f"checkpoint {args.checkpoint}",
                           f"the data at {args.data_root}")
    test_set: Dataset = data.test_set
    if args.test_subset is not None and args.test_subset < len(test_set):
        order = torch.randperm(len(test_set), generator=torch.Generator().manual_seed(0))
        test_set = Subset(test_set, order[: args.test_subset].tolist())
    key = {"tokens": "after the latent norm", "checkpoint_sha256": digest, "data": str(data.source[1]),
           "train": len(data.train_set), "test": len(test_set)}
    cache = args.cache or default_cache_dir() / "readout" / (f"latents-{digest[:16]}-{key['train']}-"
                                                             f"{key['test']}.pt")
    if cache.is_file():
        try:
            saved = load_torch_file(cache, "latent cache")  # weights_only=True: nothing in the file runs
            if saved.get("key") == key:
                log.info("latents from the cache %s", cache)
                return tuple(saved["train"]), tuple(saved["test"])
        except Exception as err:  # an interrupted write, an unsafe file: recompute (and replace it)
            log.warning("ignoring the latent cache %s: %s", cache, err)
    begin = time.perf_counter()
    train = encode(model, data.train_set, 256, args.num_workers, device)
    test = encode(model, test_set, 256, args.num_workers, device)
    log.info("encoded %d + %d images in %.1f s", len(train[2]), len(test[2]), time.perf_counter() - begin)
    cache.parent.mkdir(parents=True, exist_ok=True)
    partial = cache.with_suffix(".tmp")
    torch.save({"key": key, "train": list(train), "test": list(test)}, partial)
    partial.replace(cache)
    return train, test


def standardize(train: Split, test: Split, quantizer: nn.Module) -> tuple[Split, Split, nn.Module, dict[str, float]]:
    """Map tokens by ``z' = (z - m) / s`` (``m`` the mean training token, ``s`` the RMS deviation from it) and a
    copy of a DDCL codebook the same way, with ``T' = T / s^2``: every squared distance is divided by ``s^2``, so
    the codebook's assignments do not change while every readout sees tokens of unit scale. For
    ``distance="cosine"`` only ``s`` applies (``m = 0``), which keeps the angles."""
    flat = train[0].reshape(-1, train[0].shape[-1]).double()
    cosine = getattr(quantizer, "distance", "euclidean") == "cosine"
    center = torch.zeros(flat.shape[1], dtype=torch.float64) if cosine else flat.mean(0)
    scale = float((flat - center).square().sum(1).mean().sqrt() / math.sqrt(flat.shape[1]))
    scale = scale if scale > 0 else 1.0
    mapped = copy.deepcopy(quantizer)
    if isinstance(mapped, DDCLQuantizer) and mapped.standardize:
        # The layer standardises its tokens itself: map its statistics (both kinds), and the prototypes (which live
        # in the standardised space) and T stay as they are.
        sd = mapped.standardizer
        with torch.no_grad():
            for mean, var in ((sd.running_mean, sd.running_var), (sd.applied_mean, sd.applied_var)):
                mean.sub_(center.to(mean.dtype)).div_(scale)
                var.div_(scale**2)
    elif isinstance(mapped, DDCLQuantizer):
        with torch.no_grad():
            mapped.prototypes.sub_(center.to(mapped.prototypes.dtype)).div_(scale)
        if not cosine:
            mapped.set_temperature(quantizer.temperature / scale**2, keep_control=True)  # the same layer, rescaled

    def apply(split: Split) -> Split:
        return (split[0] - center.float()) / scale, split[1], split[2]

    own = isinstance(mapped, DDCLQuantizer) and bool(mapped.standardize)
    return apply(train), apply(test), mapped, {"center_norm": float(center.norm()), "scale": scale,
                                               "layer_standardizes": own}


def codebook_entropy(quantizer: nn.Module, tokens: Tensor, images: int = 256) -> float | None:
    """``H(Q) / log K`` of a DDCL codebook's assignments on (a spread-out sample of) ``tokens (N, T, D)``: 1 means
    uniform assignments (the readout then sees little more than the mean token), 0 one-hot."""
    if not isinstance(quantizer, DDCLQuantizer):
        return None
    sample = tokens[:: max(1, tokens.shape[0] // images)]
    with torch.no_grad():
        return float(assignment_entropy(quantizer(sample).probs)) / math.log(quantizer.num_codes)


def summarize(runs: list[dict[str, Any]]) -> dict[str, float]:
    out = {}
    for name in ("test_acc", "train_acc", "seconds", "codebook_shift"):
        values = [r[name] for r in runs if name in r]
        if values:
            out[f"{name}_mean"] = statistics.fmean(values)
            out[f"{name}_std"] = statistics.stdev(values) if len(values) > 1 else 0.0
    return out


def report(results: dict[str, Any]) -> str:
    c = results["config"]
    lines = [
        "# Readouts on frozen VQ-VAE latents (CIFAR-10)", "",
        f"Regenerate: `{results.get('command', 'python -m eval.readout')}`", "",
        f"Code: {results.get('commit', 'unknown')}", "",
        f"Checkpoint `{c['checkpoint']}` (sha256 {c['checkpoint_sha256'][:16]}...): {c['quantizer']} with "
        f"K = {c['num_codes']}, D = {c['dim']}; the {c['grid']} latent grid read as T = {c['tokens']} tokens. "
        f"Encoder and codebook frozen.", "",
        f"Data: {c['train_images']} training images (a fixed subset of the official training split) and "
        f"{c['test_images']} test images (official test split). Adam, lr {c['lr']:g} (DDCL prototypes "
        f"lr / eps = {c['lr'] / c['eps']:g}), batch {c['batch_size']}, {c['epochs']} epoch(s); test accuracy "
        f"after the last epoch, mean ± sample std over seeds {c['seeds']}.", "",
        f"Every readout sees the tokens standardised by one fixed map z' = (z - m) / s from the training tokens "
        f"(|m| = {c['center_norm']:.3g}, s = {c['scale']:.3g}); "
        + ("the layer standardises its tokens itself: its running statistics are mapped the same way, its "
           "prototypes and T stay as they are" if c.get("layer_standardizes") else
           "the codebook is mapped the same way with T / s^2")
        + f", so its assignments are unchanged.{entropy_note(c)}", "",
        "| readout | test accuracy | train accuracy | trainable params | codebook shift | seconds per seed |",
        "|---|---|---|---|---|---|",
    ]
    for r in results["readouts"].values():
        s = r["summary"]
        shift = f"{s['codebook_shift_mean']:.3f}" if "codebook_shift_mean" in s else "—"
        lines.append(f"| {r['label']} | {s['test_acc_mean']:.4f} ± {s['test_acc_std']:.4f} | "
                     f"{s['train_acc_mean']:.4f} | {r['runs'][0]['params']:,} | {shift} | {s['seconds_mean']:.1f} |")
    lines += ["", "Codebook shift: ||P_after - P_checkpoint|| / ||P_checkpoint|| of the readout's prototypes "
              "(0 when frozen).", f"Total time per seed (all readouts): {results['seconds_per_seed']:.1f} s; "
              f"latents: {results['encode_seconds']:.1f} s (encoding them, or loading the cache).", ""]
    return "\n".join(lines)


def entropy_note(c: dict[str, Any]) -> str:
    if c["assignment_entropy_ratio"] is None:
        return ""
    return (f" Its assignments on test tokens at T = {c['temperature']:g} (checkpoint units) have entropy "
            f"H(Q) = {c['assignment_entropy_ratio']:.3f} log K (1 = uniform).")


def run(args: argparse.Namespace) -> dict[str, Any]:
    device = torch.device(args.device)
    model = load_vqvae(args.checkpoint).to(device)
    if getattr(model, "num_quantizers", 1) > 1:
        raise ValueError(f"{args.checkpoint} quantizes with {model.quantizer_name}, {model.num_quantizers} residual "
                         f"levels; the readout study reads a single codebook")
    if model.levels > 1:
        raise ValueError(f"{args.checkpoint} is a {model.levels}-level VQ-VAE; the readout study reads one level of "
                         f"tokens and a single codebook (train with --model.levels 1)")
    digest = sha256_file(args.checkpoint)
    begin = time.perf_counter()
    train, test = latents(args, model, digest, device)
    encode_seconds = time.perf_counter() - begin
    _, length, dim = train[0].shape
    quantizer = copy.deepcopy(model.quantizer).cpu()
    if args.readout_temperature is not None:
        if not isinstance(quantizer, DDCLQuantizer):
            raise ValueError("--readout-temperature needs a DDCL checkpoint")
        quantizer.set_temperature(args.readout_temperature, keep_control=True)  # read out, never trained on
    raw_temperature = getattr(quantizer, "temperature", None)
    train, test, quantizer, scaling = standardize(train, test, quantizer)
    entropy = codebook_entropy(quantizer, test[0])
    if entropy is not None and entropy > 0.95:
        log.warning("the codebook's assignments are nearly uniform on these tokens (H(Q) = %.3f log K) at T = %g: "
                    "its DDCL readouts see little more than the mean token; try a smaller --readout-temperature",
                    entropy, raw_temperature)
    readouts: dict[str, Any] = {}
    for name in args.readouts:
        runs = []
        for seed in args.seeds:
            torch.manual_seed(seed)
            head = build_readout(name, quantizer, dim, length, CLASSES, args.heads)
            runs.append({"seed": seed, **fit(head, train, test, epochs=args.epochs, batch_size=args.batch_size,
                                              lr=args.lr, eps=args.eps, seed=seed, device=device)})
            log.info("%-16s seed %d: test %.4f train %.4f (%.1f s)", name, seed, runs[-1]["test_acc"],
                     runs[-1]["train_acc"], runs[-1]["seconds"])
        readouts[name] = {"label": LABELS[name], "runs": runs, "summary": summarize(runs)}
    side = int(round(length ** 0.5))
    config = {"checkpoint": str(args.checkpoint), "checkpoint_sha256": digest,
              "quantizer": type(quantizer).__name__, "num_codes": quantizer.num_codes, "dim": dim,
              "tokens": length, "grid": f"{side}x{side}" if side * side == length else f"{length}-token",
              "train_images": len(train[2]), "test_images": len(test[2]), "lr": args.lr, "eps": args.eps,
              "batch_size": args.batch_size, "epochs": args.epochs, "seeds": args.seeds, "heads": args.heads,
              "device": str(device), "threads": torch.get_num_threads(), "temperature": raw_temperature,
              "assignment_entropy_ratio": entropy, **scaling}
    per_seed = sum(r["summary"]["seconds_mean"] for r in readouts.values())
    return {"config": config, "readouts": readouts, "seconds_per_seed": per_seed, "encode_seconds": encode_seconds}


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m eval.readout", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--checkpoint", type=Path, required=True, help="a models.VQVAE Lightning checkpoint (.ckpt)")
    p.add_argument("--data-root", type=Path, default=Path("data"),
                   help="CIFAR-10 directory or .tar.gz archive (as for train_vqvae.py)")
    p.add_argument("--train-subset", type=int, default=None,
                   help="training images (a fixed subset of the official 50,000; default 10000, --quick 1000)")
    p.add_argument("--test-subset", type=int, default=None,
                   help="test images (a fixed subset of the official 10,000; default all, --quick 1000)")
    p.add_argument("--epochs", type=int, default=None, help="epochs per readout (default 10, --quick 1)")
    p.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2], help="seeds (default 0 1 2)")
    p.add_argument("--readouts", nargs="+", choices=READOUTS, default=list(READOUTS), help="readouts to train")
    p.add_argument("--out", type=Path, default=Path("reports/readout"), help="where report.md and results.json go")
    p.add_argument("--quick", action="store_true", help="a smoke run: small subsets and one epoch")
    p.add_argument("--lr", type=float, default=1e-3, help="Adam learning rate (default 1e-3)")
    p.add_argument("--eps", type=float, default=0.1, help="readout lr / prototype lr for fine-tuned codebooks")
    p.add_argument("--readout-temperature", type=float, default=None,
                   help="T of the DDCL readouts in the checkpoint's squared-distance units (default: the checkpoint's)")
    p.add_argument("--batch-size", type=int, default=128,
                   help="readout training batch (default 128; 256 is slower on CPU: its (B, K, D) slots pass 32 MiB)")
    p.add_argument("--heads", type=int, default=4, help="attention heads of the transformer readouts (default 4)")
    p.add_argument("--cache", type=Path, default=None, help="latent cache file (default under $SOFTVQ_CACHE)")
    p.add_argument("--num-workers", type=int, default=2, help="DataLoader workers while encoding (default 2)")
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu", help="device")
    args = p.parse_args(argv)
    if args.train_subset is None:
        args.train_subset = 1000 if args.quick else 10_000
    if args.test_subset is None and args.quick:
        args.test_subset = 1000
    if args.epochs is None:
        args.epochs = 1 if args.quick else 10
    positive = {"--train-subset": args.train_subset, "--epochs": args.epochs, "--batch-size": args.batch_size,
                "--heads": args.heads, "--test-subset": 1 if args.test_subset is None else args.test_subset}
    for flag, value in positive.items():
        if value < 1:
            p.error(f"argument {flag}: expected a positive integer, got {value}")
    temperature_ok = args.readout_temperature is None or args.readout_temperature > 0
    if not (args.lr > 0 and args.eps > 0 and temperature_ok) or args.num_workers < 0:
        p.error("--lr, --eps and --readout-temperature must be positive and --num-workers non-negative")
    return args


def main(argv: list[str] | None = None) -> dict[str, Any]:
    args = parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    results = run(args)
    results["command"] = study_command("eval.readout", argv)
    results["commit"] = code_commit()
    args.out.mkdir(parents=True, exist_ok=True)
    text = report(results)
    (args.out / "report.md").write_text(text)
    (args.out / "results.json").write_text(json.dumps(portable(results), indent=2))
    print(text)
    return results
