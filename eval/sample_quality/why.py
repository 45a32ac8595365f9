"""Why one VQ-VAE's reconstructions are recognised better than another's at equal PSNR: where the error goes.

For each finished long run (``eval/long_run``: ``K<K>/<method>/seed<S>/`` with ``result.json`` and
``checkpoints/last.ckpt``), on ``--images`` validation images (held-out training images, a fixed subset by
:func:`eval.sample_quality.classifier.images_of`; the test split is never read):

1. the error spectrum: the energy of ``x_hat - x`` (hard-index reconstructions clamped to [0, 1],
   :func:`eval.sample_quality.sampling.reconstruct`) in ``--bands`` radial bands of equal width in ``|f|`` from DC to
   the Nyquist corner (``|f| = sqrt(2) / 2`` cycles per pixel), summed over the colour channels, beside the images'
   own spectrum (:func:`band_energies`; by Parseval the bands sum to the squared error);
2. the cached classifier of ``eval.sample_quality`` (its settings key; it is not trained here, which would read the
   test split) on the images and on their reconstructions, per class, and the share whose predicted class changes;
   and on the reconstructions with one band's error removed (:func:`band_corrected`), band by band;
3. the codes: the plug-in mutual information in bits between an image's class and each of its tokens' hard codes
   (:func:`mutual_information`, every token a sample), with ``H(code)``, ``H(class)`` and the same estimate with the
   images' labels shuffled (seed 0: the estimate's bias at this many tokens, their dependence within an image
   included); each token's margin ``d1 / d2``, its squared distance to the nearest code over that to the second
   nearest in the layer's own space (:func:`code_space`; 0 on a code, 1 on a cell boundary; mean and quartiles), with
   the share of tokens whose nearest code there is the one the layer assigned; and the PSNR when every token's code
   is swapped for its nearest other code and decoded: what one index error costs in pixels.

Usage:
    python -m eval.sample_quality.why --data-root ../shared/data/cifar10-jpeg.tar.gz --long-runs runs/long_run \
        --num-codes 512 --methods ddcl hard_ema vqp_fsq
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
from einops import rearrange
from torch import Tensor, nn
from torchmetrics.functional.image import peak_signal_noise_ratio

import softvq
from eval import peers
from eval._provenance import code_commit, portable, repo_relative
from eval.sample_quality import classifier as clf
from eval.sample_quality.long_runs import final_vqvae, find_runs
from eval.sample_quality.sampling import reconstruct
from softvq.cli.common import run_command
from softvq.data.cifar10 import CIFAR10DataModule, sha256_file
from softvq.models.files import write_atomic

NUM_CLASSES = 10


def band_index(h: int, w: int, bands: int) -> Tensor:
    """``(H, W)`` int64: the radial band of each frequency ``(f_y, f_x)`` of an ``H x W`` image (``torch.fft.fftfreq``,
    cycles per pixel): ``floor(|f| / w)``, ``w = (sqrt(2) / 2) / bands``, the Nyquist corner itself in the last."""
    radius = torch.hypot(torch.fft.fftfreq(h, dtype=torch.float64)[:, None],
                         torch.fft.fftfreq(w, dtype=torch.float64)[None, :])
    return (radius / (math.sqrt(0.5) / bands)).floor().long().clamp_max(bands - 1)


def band_energies(x: Tensor, bands: int) -> Tensor:
    """``(bands,)`` float64: the energy of ``x (N, C, H, W)`` in each radial frequency band (:func:`band_index`),
    summed over images and channels; a frequency's energy is ``|fft2(x)|^2 / (H W)``, so the bands sum to
    ``(x ** 2).sum()`` (Parseval)."""
    h, w = x.shape[-2:]
    band = band_index(h, w, bands)
    power = torch.fft.fft2(x.double()).abs().square().sum((0, 1)) / (h * w)  # (H, W)
    return torch.zeros(bands, dtype=torch.float64).index_add_(0, band.flatten(), power.flatten())


def band_corrected(x: Tensor, recon: Tensor, band: int, bands: int) -> Tensor:
    """``recon`` with its error in one radial band removed: ``recon + P_b(x - recon)``, ``P_b`` keeping the
    frequencies of band ``band`` (:func:`band_index`); float32, not clamped. The bands partition the frequencies, so
    correcting all of them gives back ``x``."""
    keep = (band_index(*x.shape[-2:], bands) == band).to(torch.complex128)
    error = torch.fft.fft2((x - recon).double()) * keep
    return (recon.double() + torch.fft.ifft2(error).real).float()


@torch.no_grad()
def band_accuracy(classifier: nn.Module, x: Tensor, recon: Tensor, labels: Tensor, bands: int) -> list[float]:
    """Per band, the classifier's accuracy on the reconstructions with that band's error removed
    (:func:`band_corrected`): which frequencies hold what a reconstruction loses for the classifier."""
    return [float((clf.predict(classifier, torch.cat([band_corrected(x[i:i + 500], recon[i:i + 500], b, bands)
                                                      for i in range(0, len(x), 500)])) == labels).double().mean())
            for b in range(bands)]


def class_accuracy(labels: Tensor, real: Tensor, reconstructed: Tensor, num_classes: int = NUM_CLASSES
                   ) -> dict[str, Any]:
    """The predictions ``real`` and ``reconstructed`` (``(N,)`` class indices) against ``labels``: each one's accuracy
    overall and per class (``None`` for a class without images), and the share of images whose prediction changed,
    overall and per class."""
    def per_class(hit: Tensor) -> list[float | None]:
        return [float(hit[labels == c].double().mean()) if (labels == c).any() else None for c in range(num_classes)]

    right, right_rec, changed = real == labels, reconstructed == labels, real != reconstructed
    return {"real": {"overall": float(right.double().mean()), "per_class": per_class(right)},
            "reconstruction": {"overall": float(right_rec.double().mean()), "per_class": per_class(right_rec)},
            "changed": {"overall": float(changed.double().mean()), "per_class": per_class(changed)}}


def mutual_information(classes: Tensor, codes: Tensor, num_classes: int, num_codes: int) -> dict[str, float]:
    """The plug-in mutual information in bits between ``classes`` and ``codes`` (``(N,)`` each, one row per token),
    from their joint counts: ``sum p(c, k) log2(p(c, k) / (p(c) p(k)))``; with ``H(code)`` and ``H(class)`` in bits."""
    joint = torch.zeros(num_classes * num_codes, dtype=torch.float64)
    joint = joint.index_add_(0, classes.long() * num_codes + codes.long(), torch.ones(len(codes), dtype=torch.float64))
    p = joint.view(num_classes, num_codes) / len(codes)
    p_class, p_code = p.sum(1, keepdim=True), p.sum(0, keepdim=True)
    seen = p > 0
    mi = (p[seen] * (p[seen] / (p_class * p_code)[seen]).log2()).sum()

    def entropy(q: Tensor) -> float:
        return float(-(q[q > 0] * q[q > 0].log2()).sum())

    return {"bits": float(mi), "h_code_bits": entropy(p_code), "h_class_bits": entropy(p_class)}


def code_space(quantizer: nn.Module, latents: Tensor) -> tuple[Tensor, Tensor]:
    """``(tokens (N, d), codebook (K, d))``: the latents ``(N, D)`` (the quantizer's input) and the codes in the space
    where the layer picks a token's code as the nearest in squared Euclidean distance.

    DDCL: the standardised tokens (evaluation statistics) and the prototypes, both L2-normalised for cosine distance.
    FSQ (vector-quantize-pytorch, one codebook, default bound): the projected tokens bounded as the layer bounds them,
    before rounding, over each level's half width, and the implicit codebook (rounding is the nearest grid point). Any
    other layer (HardVQ, VectorQuantize): the latents and ``quantizer.codebook``."""
    if isinstance(quantizer, softvq.DDCLQuantizer):
        z, p = latents, quantizer.prototypes.detach()
        if quantizer.standardize:
            z = quantizer.standardizer.standardize(z)
        if quantizer.distance == "cosine":
            z, p = F.normalize(z, dim=-1), F.normalize(p, dim=-1)
        return z, p
    fsq = getattr(quantizer, "module", None)
    if getattr(quantizer, "kind", None) == "fsq":
        if fsq.num_codebooks != 1 or any(getattr(fsq, a, False) for a in ("preserve_symmetry", "bound_hard_clamp",
                                                                           "orthogonal_rotation")):
            raise ValueError("code_space reads FSQ with one codebook and its default bound only")
        levels = fsq._levels.to(latents.dtype)
        half_l = (levels - 1) * (1 + 1e-3) / 2  # FSQ.bound's, eps 1e-3
        offset = torch.where(fsq._levels % 2 == 0, 0.5, 0.0).to(latents.dtype)
        bounded = torch.tanh(fsq.project_in(latents) + torch.atanh(offset / half_l)) * half_l - offset
        return bounded / (fsq._levels // 2), fsq.implicit_codebook.to(latents.dtype)
    return latents, quantizer.codebook.to(latents.dtype)


def two_nearest(tokens: Tensor, codebook: Tensor, block: int = 4096) -> tuple[Tensor, Tensor]:
    """``(indices (N, 2), squared distances (N, 2))``: each token's nearest and second-nearest code, in float64 and in
    row blocks (the ``(N, K)`` distances never exist at once)."""
    c = codebook.double()
    found = [torch.cdist(t.double(), c).square().topk(2, dim=1, largest=False) for t in tokens.split(block)]
    return torch.cat([f.indices for f in found]), torch.cat([f.values for f in found])


def psnr(reconstruction: Tensor, x: Tensor) -> float:
    """The mean over images of each image's PSNR (data range 1; torchmetrics'), ``reconstruction`` clamped to
    [0, 1]."""
    per_image = peak_signal_noise_ratio(reconstruction.clamp(0, 1).double(), x.double(), data_range=1.0,
                                        reduction="none", dim=(1, 2, 3))
    return float(per_image.mean())


def spectrum(x: Tensor, recon: Tensor, bands: int) -> dict[str, Any]:
    """Per band: the error's energy (per image, summed over pixels and channels), its share of the total, the
    images' own energy and the error over it."""
    error = sum(band_energies((recon[i:i + 500] - x[i:i + 500]), bands) for i in range(0, len(x), 500)) / len(x)
    signal = sum(band_energies(x[i:i + 500], bands) for i in range(0, len(x), 500)) / len(x)
    return {"error_energy": error.tolist(), "error_share": (error / error.sum()).tolist(),
            "image_energy": signal.tolist(), "error_to_image": (error / signal).tolist(),
            "total_error": float(error.sum())}


@torch.no_grad()
def measure(run: Path, args: argparse.Namespace, classifier: clf.SmallResNet,
            images: dict[int, tuple[Tensor, Tensor, Tensor]]) -> dict[str, Any]:
    """One run's figures on its validation split (``images``: ``val_size -> (x, y, real predictions)``, filled)."""
    result, vqvae, checkpoint = final_vqvae(run)
    method, s = result["method"], result["settings"]
    if s["val_size"] not in images:
        data = CIFAR10DataModule(args.data_root, val_size=s["val_size"], train_subset=s["train_subset"],
                                 num_workers=0)
        data.setup("fit")  # training and validation images only
        x, y = clf.images_of(data.val_set, args.images)
        images[s["val_size"]] = (x, y, clf.predict(classifier, x))
    x, y, real = images[s["val_size"]]
    recon = reconstruct(vqvae, x)
    latents = torch.cat([rearrange(vqvae.latents(x[i:i + 500]), "b d h w -> b h w d") for i in range(0, len(x), 500)])
    indices = vqvae.quantizer(latents).indices  # (N, h, w), as vqvae.encode gives them
    grid, flat = indices.shape[1:], rearrange(latents, "b h w d -> (b h w) d")
    tokens, codebook = code_space(vqvae.quantizer, flat)
    nearest, dist = two_nearest(tokens, codebook)
    assigned = indices.flatten()
    other = torch.where(nearest[:, 0] == assigned, nearest[:, 1], nearest[:, 0])  # the nearest code not assigned
    swapped = torch.cat([vqvae.decode_indices(o).clamp(0, 1)
                         for o in other.view(-1, *grid).split(500)])
    ratio = dist[:, 0] / dist[:, 1].clamp_min(torch.finfo(torch.float64).tiny)
    labels = y.repeat_interleave(grid.numel())
    shuffled = y[torch.randperm(len(y), generator=torch.Generator().manual_seed(0))].repeat_interleave(grid.numel())
    psnr_hard, psnr_swapped = psnr(recon, x), psnr(swapped, x)
    return {"point": run.relative_to(args.long_runs).as_posix(), "method": method, "num_codes": vqvae.num_codes,
            "seed": result["seed"], "run": repo_relative(run), "checkpoint_sha256": sha256_file(checkpoint),
            "settings": s, "images": len(x), "psnr_hard": psnr_hard, "spectrum": spectrum(x, recon, args.bands),
            "accuracy": {**class_accuracy(y, real, clf.predict(classifier, recon)),
                         "band_corrected": band_accuracy(classifier, x, recon, y, args.bands)},
            "codes": {"mutual_information": {**mutual_information(labels, assigned, NUM_CLASSES, vqvae.num_codes),
                                             "shuffled_labels_bits": mutual_information(
                                                 shuffled, assigned, NUM_CLASSES, vqvae.num_codes)["bits"]},
                      "margin": {"mean": float(ratio.mean()), "quartiles": ratio.quantile(
                          torch.tensor([0.25, 0.5, 0.75], dtype=torch.float64)).tolist()},
                      "nearest_is_assigned": float((nearest[:, 0] == assigned).double().mean()),
                      "swap": {"psnr": psnr_swapped, "psnr_drop": psnr_hard - psnr_swapped}}}


def plot(summary: dict[str, Any], path: Path) -> None:
    """Each run's error share per band (left) and error over image energy per band (right), log scales."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    edges = summary["band_edges"]
    centres = [(a + b) / 2 for a, b in zip(edges[:-1], edges[1:], strict=True)]
    fig, (left, right) = plt.subplots(1, 2, figsize=(10, 4))
    for r in summary["runs"]:
        left.plot(centres, r["spectrum"]["error_share"], marker="o", label=f"{r['point']} ({r['psnr_hard']:.2f} dB)")
        right.plot(centres, r["spectrum"]["error_to_image"], marker="o")
    left.set(xlabel="|f| (cycles / pixel), band centre", ylabel="share of the squared error", yscale="log",
             title="Where the reconstruction error goes")
    right.set(xlabel="|f| (cycles / pixel), band centre", ylabel="error energy / image energy", yscale="log")
    left.legend(fontsize=7)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    write_atomic(path, lambda f: fig.savefig(f, format="png", dpi=120))
    plt.close(fig)


CLASSES = ("airplane", "automobile", "bird", "cat", "deer", "dog", "frog", "horse", "ship", "truck")


def report(summary: dict[str, Any]) -> str:
    """``why.md``: the figures of ``why.json`` in tables, one row per run (validation images only)."""
    runs, edges = summary["runs"], summary["band_edges"]
    bands = [f"{a:.2f}-{b:.2f}" for a, b in zip(edges[:-1], edges[1:], strict=True)]
    lines = ["# Where the reconstruction error goes", "", f"Regenerate: `{summary['command']}`", "",
             f"Code: {summary['commit']}. The **validation split** only ({summary['settings']['images']} held-out "
             f"training images, a fixed random subset; the test split is not read). Classifier: "
             f"`{summary['classifier']['file']}` (eval.sample_quality's cached one). Each run is its kept final "
             "checkpoint; the reconstructions decode the hard codes.", "",
             "## The error spectrum", "", "Share of each run's squared error in radial frequency bands (|f| in cycles "
             "per pixel, DC to the Nyquist corner), then the error's total energy per image.", "",
             "| point | PSNR | " + " | ".join(bands) + " | error energy / image |", "|---|---|" + "---|" * len(bands)
             + "---|"]
    lines += [f"| {r['point']} | {r['psnr_hard']:.2f} | " + " | ".join(f"{v:.3f}" for v in r["spectrum"]["error_share"])
              + f" | {r['spectrum']['total_error']:.2f} |" for r in runs]
    lines += ["", "Error energy over the images' own energy, per band:", "",
              "| point | " + " | ".join(bands) + " |", "|---|" + "---|" * len(bands)]
    lines += [f"| {r['point']} | " + " | ".join(f"{v:.3g}" for v in r["spectrum"]["error_to_image"]) + " |"
              for r in runs]
    lines += ["", "## The classifier", "", "Accuracy on the real images and on their reconstructions, and the share of "
              "images whose predicted class changes; then the reconstructions' accuracy per class.", "",
              "| point | real | reconstructions | prediction changed |", "|---|---|---|---|"]
    lines += [f"| {r['point']} | {r['accuracy']['real']['overall']:.3f} | "
              f"{r['accuracy']['reconstruction']['overall']:.3f} | {r['accuracy']['changed']['overall']:.3f} |"
              for r in runs]
    lines += ["", "The reconstructions' accuracy with the error of one band removed (the reconstruction plus that "
              "band of the real image's difference from it): where the reconstruction loses what the classifier "
              "reads.", "", "| point | " + " | ".join(bands) + " |", "|---|" + "---|" * len(bands)]
    lines += [f"| {r['point']} | " + " | ".join(f"{v:.3f}" for v in r["accuracy"]["band_corrected"]) + " |"
              for r in runs]
    lines += ["", "| point | " + " | ".join(CLASSES) + " |", "|---|" + "---|" * len(CLASSES)]
    lines += [f"| {r['point']} | " + " | ".join("-" if v is None else f"{v:.2f}"
                                                for v in r["accuracy"]["reconstruction"]["per_class"]) + " |"
              for r in runs]
    lines += ["", "## The codes", "", "Mutual information between an image's class and each of its tokens' codes "
              "(bits, plug-in), beside the same with the labels shuffled (the estimate's bias); H(code); the margin "
              "d1 / d2 (squared distance to the nearest code over the second nearest, in the layer's own space: 0 on "
              "a code, 1 on a boundary); the share of tokens whose nearest code there is the assigned one; the PSNR "
              "lost when every token takes its nearest other code.", "",
              "| point | I(class; code) | shuffled | H(code) | margin mean | margin median | nearest = assigned | "
              "PSNR lost to one swap |", "|---|---|---|---|---|---|---|---|"]
    for r in runs:
        c = r["codes"]
        mi = c["mutual_information"]
        lines.append(f"| {r['point']} | {mi['bits']:.3f} | {mi['shuffled_labels_bits']:.3f} | "
                     f"{mi['h_code_bits']:.2f} | {c['margin']['mean']:.3f} | {c['margin']['quartiles'][1]:.3f} | "
                     f"{c['nearest_is_assigned']:.3f} | {c['swap']['psnr_drop']:.2f} dB |")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> dict[str, Any]:
    args = parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    runs = find_runs(args.long_runs, args.num_codes, args.methods)
    val_sizes = sorted({json.loads((run / "result.json").read_text())["settings"]["val_size"] for run in runs})
    if len(val_sizes) != 1:  # the classifier must have been trained without every run's validation images
        raise ValueError(f"the runs hold out different validation splits ({val_sizes} images); pick runs of one with "
                         f"--num-codes / --methods")
    settings = clf.study_settings(args.classifier_width, args.classifier_epochs, args.data_root, val_sizes[0])
    path = args.classifier_cache / f"classifier-{clf.settings_key(settings)}.pt"
    if not path.is_file():
        raise FileNotFoundError(f"no cached classifier {path}: train it first with python -m eval.sample_quality "
                                f"(the same --data-root, --classifier-*); training it here would read the test split")
    classifier, record = clf.load_classifier(path)
    images: dict[int, tuple[Tensor, Tensor, Tensor]] = {}
    rows = [measure(run, args, classifier, images) for run in runs]
    summary = portable({"command": args.command, "commit": code_commit(), "split": "validation",
                        "settings": {"images": args.images, "bands": args.bands, "long_runs": str(args.long_runs)},
                        "band_edges": [i * math.sqrt(0.5) / args.bands for i in range(args.bands + 1)],
                        "classifier": {"file": path.name, "sha256": record["sha256"], "settings": settings},
                        "runs": rows})
    args.out.parent.mkdir(parents=True, exist_ok=True)
    write_atomic(args.out, json.dumps(summary, indent=1))
    plot(summary, args.out.with_suffix(".png"))
    write_atomic(args.out.with_suffix(".md"), report(summary))
    return summary


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m eval.sample_quality.why", description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--data-root", type=Path, default=Path("data"), help="CIFAR-10 directory or .tar.gz archive")
    p.add_argument("--long-runs", type=Path, default=Path("runs/long_run"), help="eval.long_run's runs")
    p.add_argument("--num-codes", type=int, nargs="+", default=None, help="only these codebook sizes")
    p.add_argument("--methods", nargs="+", choices=peers.METHODS, default=None, help="only these methods")
    p.add_argument("--classifier-width", type=int, default=32, help="as eval.sample_quality's (the cache key)")
    p.add_argument("--classifier-epochs", type=int, default=8, help="as eval.sample_quality's (the cache key)")
    p.add_argument("--classifier-cache", type=Path, default=Path("runs/classifier"))
    p.add_argument("--images", type=int, default=2000, help="validation images (a fixed random subset)")
    p.add_argument("--bands", type=int, default=8, help="radial frequency bands, DC to the Nyquist corner")
    p.add_argument("--threads", type=int, default=None)
    p.add_argument("--out", type=Path, default=Path("reports/generative/why.json"),
                   help="the JSON; the figure beside it with .png, its tables with .md")
    args = p.parse_args(argv)
    for name in ("images", "bands", "classifier_width", "classifier_epochs"):
        if getattr(args, name) < 1:
            p.error(f"--{name.replace('_', '-')} must be positive, got {getattr(args, name)}")
    if args.threads is not None and args.threads < 1:
        p.error(f"--threads must be positive, got {args.threads}")
    if args.out.suffix != ".json":
        p.error(f"--out must name a .json file (the figure goes beside it as .png), got {args.out}")
    args.command = "python -m eval.sample_quality.why " + " ".join(argv if argv is not None else sys.argv[1:])
    return args


def cli(argv: list[str] | None = None) -> int:
    return run_command(main, argv)


if __name__ == "__main__":
    raise SystemExit(cli())
