"""The foreign-model check: each quantizer dropped into a small autoencoder it was not tuned for, with its library's
defaults and nothing else changed; ``reports/dropin/``.

Usage:
    pip install -e ".[bench]"          # vector-quantize-pytorch, a benchmark-only extra
    python -m eval.dropin --data-root ../shared/data/cifar10-jpeg.tar.gz
    python -m eval.dropin --quick --data-root ../shared/data/cifar10-jpeg.tar.gz    # seconds

The model has the shape of vector-quantize-pytorch's own autoencoder example (written here, not copied): conv 16 ->
max-pool -> GELU -> conv 32 -> max-pool -> quantizer (D = 32 on an 8x8 grid of a 32x32 image) -> upsample -> conv 16
-> GELU -> upsample -> conv 3. Loss ``L1(reconstruction, x) + 10 * quantizer loss``, plain
``torch.optim.Adam(model.parameters(), lr=3e-4)``, a fixed number of steps on CIFAR-10 training images. No
BatchNorm is added, no parameter groups, no temperature code: the only line that differs between methods is the
quantizer's constructor, each with its library's defaults:

    ddcl          softvq.DDCLQuantizer(num_codes=K, dim=32, channel_first=True)
    hard          softvq.HardVQ(K, 32)                        (channel-last only: the model permutes around it)
    vqp_vq        VectorQuantize(dim=32, codebook_size=K, accept_image_fmap=True)
    vqp_fsq       FSQ(levels=[8, 6, 5], dim=32, channel_first=True)   (the FSQ paper's set for ~2^8 codes: 240)
    vqp_simvq     SimVQ(dim=32, codebook_size=K, channel_first=True)

Residual quantizers, Q = ``--num-quantizers`` levels of K codes (``--methods rddcl vqp_rvq``; compared with each
other, not with the single codebooks, which spend a quarter of the bits at Q = 4):

    rddcl         softvq.ResidualDDCL(Q, K, 32, channel_first=True)
    vqp_rvq       ResidualVQ(dim=32, num_quantizers=Q, codebook_size=K)   (channel-last: its accept_image_fmap
                  fails in forward in vector-quantize-pytorch 1.32, so the model permutes around it as for HardVQ)

Scored on the official test split (``--split validation``: on ``--val-size`` held-out training images, for probes): PSNR
of the images decoded from the hard indices alone (each library's own index -> code function), utilization, dead
codes and perplexity of those indices (of a residual stack: the lowest level's utilization and perplexity, the dead
codes of all levels together, and every level's figures in ``results.json``).
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import lightning as L
import torch
from einops import rearrange
from torch import Tensor, nn
from torchmetrics.image import PeakSignalNoiseRatio

import softvq
from eval import render
from eval._provenance import code_commit, portable
from eval._spread import by_seed, describe
from eval.peers.report import group, test_table, values
from softvq.cli.common import run_command
from softvq.data.cifar10 import CIFAR10DataModule
from softvq.models.files import write_atomic
from softvq.parts import TokenStandardizer

LABELS = {"ddcl": "softvq DDCLQuantizer(K, D), defaults", "hard": "softvq HardVQ(K, D), defaults",
          "vqp_vq": "vqp VectorQuantize, defaults", "vqp_fsq": "vqp FSQ [8,6,5]", "vqp_simvq": "vqp SimVQ, defaults",
          "rddcl": "softvq ResidualDDCL(Q, K, D), defaults", "vqp_rvq": "vqp ResidualVQ(Q, K, D), defaults"}
METHODS = tuple(LABELS)
TEST_COLUMNS = (("psnr_hard", "PSNR from hard indices (dB)", "{:.2f}", 1.0),
                ("utilization", "test util %", "{:.1f}", 100.0), ("dead_codes", "dead", "{:.0f}", 1.0),
                ("perplexity", "perplexity", "{:.0f}", 1.0), ("num_codes", "K", "{:.0f}", 1.0))


def columns(split: str) -> tuple[tuple[str, str, str, float], ...]:
    """The table's columns, the utilization named after the split it was scored on (``"test"`` or ``"validation"``;
    the figures sit under ``"test"`` in a record either way)."""
    name = "test" if split == "test" else "val"
    return tuple((key, f"{name} util %" if key == "utilization" else title, fmt, scale)
                 for key, title, fmt, scale in TEST_COLUMNS)
SINGLE = ("ddcl", "hard", "vqp_vq", "vqp_fsq", "vqp_simvq")
RESIDUAL = ("rddcl", "vqp_rvq")  # indices (B, h, w, Q)
DIM = 32
NUM_QUANTIZERS = 4


def make_quantizer(method: str, num_codes: int, num_quantizers: int = NUM_QUANTIZERS) -> tuple[nn.Module, int]:
    """The quantizer as its library's documentation constructs it, and its codebook size (per level for a residual
    stack of ``num_quantizers`` levels)."""
    if method == "ddcl":
        return softvq.DDCLQuantizer(num_codes=num_codes, dim=DIM, channel_first=True), num_codes
    if method == "hard":
        return softvq.HardVQ(num_codes, DIM), num_codes
    if method == "rddcl":
        return softvq.ResidualDDCL(num_quantizers, num_codes, DIM, channel_first=True), num_codes
    try:
        import vector_quantize_pytorch as vqp
    except ImportError as err:
        raise SystemExit("vector-quantize-pytorch is not installed: pip install -e '.[bench]'") from err
    if method == "vqp_vq":
        return vqp.VectorQuantize(dim=DIM, codebook_size=num_codes, accept_image_fmap=True), num_codes
    if method == "vqp_fsq":
        return vqp.FSQ(levels=[8, 6, 5], dim=DIM, channel_first=True), 240
    if method == "vqp_simvq":
        return vqp.SimVQ(dim=DIM, codebook_size=num_codes, channel_first=True), num_codes
    if method == "vqp_rvq":
        return vqp.ResidualVQ(dim=DIM, num_quantizers=num_quantizers, codebook_size=num_codes), num_codes
    raise ValueError(f"unknown method {method!r}; choose from {METHODS}")


class SmallAutoencoder(nn.Module):
    """The foreign model: two conv + max-pool stages down, the quantizer on ``(B, dim, 8, 8)``, two up.

    Args:
        method: the quantizer's calling convention (one of :data:`METHODS`); with ``quantizer=None`` also which
            library-default quantizer :func:`make_quantizer` builds.
        num_codes: codebook size asked for.
        dim: channels of the encoder's output, the code dimension.
        quantizer: ``(module, codebook size)`` built elsewhere (a probe's options), called with ``method``'s
            convention.
    """

    def __init__(self, method: str, num_codes: int, *, dim: int = DIM, quantizer: tuple[nn.Module, int] | None = None,
                 num_quantizers: int = NUM_QUANTIZERS) -> None:
        super().__init__()
        if method not in METHODS:
            raise ValueError(f"unknown method {method!r}; choose from {METHODS}")
        self.method = method
        self.down = nn.Sequential(nn.Conv2d(3, 16, 3, padding=1), nn.MaxPool2d(2), nn.GELU(),
                                  nn.Conv2d(16, dim, 3, padding=1), nn.MaxPool2d(2))
        self.quantizer, self.num_codes = (quantizer if quantizer is not None
                                          else make_quantizer(method, num_codes, num_quantizers))
        self.up = nn.Sequential(nn.Upsample(scale_factor=2), nn.Conv2d(dim, 16, 3, padding=1), nn.GELU(),
                                nn.Upsample(scale_factor=2), nn.Conv2d(16, 3, 3, padding=1))

    def quantize(self, z: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        """``(quantized (B, D, h, w), indices (B, h, w) or (B, h, w, Q), loss)`` in each library's calling
        convention."""
        if self.method == "hard":
            out = self.quantizer(rearrange(z, "b d h w -> b h w d"))
            return rearrange(out.quantized, "b h w d -> b d h w"), out.indices, out.loss
        if self.method == "vqp_rvq":
            h = z.shape[-2]
            quantized, indices, losses = self.quantizer(rearrange(z, "b d h w -> b (h w) d"))
            return (rearrange(quantized, "b (h w) d -> b d h w", h=h), rearrange(indices, "b (h w) q -> b h w q", h=h),
                    losses.sum())
        if self.method in ("ddcl", "rddcl"):
            out = self.quantizer(z)
            return out.quantized, out.indices, out.loss
        if self.method == "vqp_fsq":
            quantized, indices = self.quantizer(z)
            return quantized, indices, z.new_zeros(())
        quantized, indices, loss = self.quantizer(z)
        return quantized, indices, loss.sum()

    def decode_indices(self, indices: Tensor) -> Tensor:
        """Images from hard indices alone, through each library's own index -> code function."""
        if self.method == "vqp_rvq":
            codes = rearrange(self.quantizer.get_output_from_indices(indices), "b h w d -> b d h w")
        elif self.method in ("hard", "ddcl", "rddcl"):
            codes = self.quantizer.decode_indices(indices)
            codes = rearrange(codes, "b h w d -> b d h w") if self.method == "hard" else codes
        elif self.method == "vqp_vq":
            codes = self.quantizer.get_output_from_indices(indices)
        else:  # FSQ and SimVQ, channel_first: (B, D, h, w)
            codes = self.quantizer.indices_to_codes(indices)
        return self.up(codes)

    def forward(self, x: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        z = self.down(x)
        quantized, indices, loss = self.quantize(z)
        return self.up(quantized), indices, loss


def _score(model: nn.Module, method: str, args: argparse.Namespace, data: CIFAR10DataModule
           ) -> tuple[float, Tensor, int]:
    """Hard-index PSNR (per image, averaged) over the scored split, the per-level code counts and the images seen."""
    psnr = PeakSignalNoiseRatio(data_range=1.0, dim=(1, 2, 3))
    levels = args.num_quantizers if method in RESIDUAL else 1
    counts = torch.zeros(levels, model.num_codes, dtype=torch.long)
    seen = 0
    with torch.no_grad():
        for x, _ in data.val_dataloader() if args.split == "validation" else data.test_dataloader():
            _, indices, _ = model(x)
            psnr.update(model.decode_indices(indices).clamp(0.0, 1.0), x)
            for q, level in enumerate(indices.reshape(-1, levels).long().unbind(-1)):
                counts[q] += torch.bincount(level, minlength=model.num_codes)
            seen += x.shape[0]
            if args.test_limit and seen >= args.test_limit:
                break
    return float(psnr.compute()), counts, seen


def train_and_score(method: str, seed: int, args: argparse.Namespace, data: CIFAR10DataModule) -> dict[str, Any]:
    L.seed_everything(seed, verbose=False)
    quantizer = (softvq.DDCLQuantizer(num_codes=args.num_codes, dim=DIM, channel_first=True, **args.ddcl_kwargs),
                 args.num_codes) if method == "ddcl" and args.ddcl_kwargs else None
    model = SmallAutoencoder(method, args.num_codes, num_quantizers=args.num_quantizers, quantizer=quantizer)
    optimizer = torch.optim.Adam(model.parameters(), lr=args.lr)
    loader = data.train_dataloader()
    step, start = 0, time.perf_counter()
    model.train()
    epoch = 0
    while step < args.steps:
        loader.sampler.set_epoch(epoch)  # a new order every pass, as a training loop would
        epoch += 1
        for x, _ in loader:
            reconstruction, _, loss = model(x)
            total = (reconstruction - x).abs().mean() + args.alpha * loss
            optimizer.zero_grad(set_to_none=True)
            total.backward()
            optimizer.step()
            step += 1
            if step >= args.steps:
                break
    train_s = time.perf_counter() - start
    model.eval()
    psnr, counts, seen = _score(model, method, args, data)
    # a standardising layer's evaluation with the running moments, beside its default (the applied statistics)
    standardisers = [m for m in model.modules() if isinstance(m, TokenStandardizer)]
    running = None
    if standardisers:
        kinds = [m.eval_statistics for m in standardisers]
        for m in standardisers:
            m.eval_statistics = "running"
        running = _score(model, method, args, data)[0]
        for m, kind in zip(standardisers, kinds, strict=True):
            m.eval_statistics = kind
    usage = [{k: float(v) for k, v in softvq.functional.usage_from_counts(c).items()} for c in counts]
    test = {"psnr_hard": psnr, "utilization": min(u["utilization"] for u in usage),
            "dead_codes": int(sum(u["dead_codes"] for u in usage)), "perplexity": min(u["perplexity"] for u in usage),
            "num_codes": model.num_codes, "images": seen}
    if running is not None:
        test["psnr_hard_running_stats"] = running
    if method in RESIDUAL:
        test["levels"] = usage
    return {"method": method, "seed": seed, "train_s": train_s, "test": test}


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--data-root", type=Path, default=Path("data"), help="CIFAR-10 directory or .tar.gz archive")
    p.add_argument("--methods", nargs="+", choices=METHODS, default=list(SINGLE),
                   help=f"single codebooks {SINGLE}; residual stacks {RESIDUAL} (compared with each other)")
    p.add_argument("--num-quantizers", type=int, default=NUM_QUANTIZERS, help="levels of a residual stack")
    p.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    p.add_argument("--steps", type=int, default=1000, help="optimizer steps per model")
    p.add_argument("--batch-size", type=int, default=256)
    p.add_argument("--num-codes", type=int, default=256)
    p.add_argument("--lr", type=float, default=3e-4)
    p.add_argument("--alpha", type=float, default=10.0, help="weight of the quantizer's loss")
    p.add_argument("--test-limit", type=int, default=0, help="score on this many test images (0: all)")
    p.add_argument("--num-workers", type=int, default=1)
    p.add_argument("--out", type=Path, default=Path("reports/dropin"))
    p.add_argument("--runs", type=Path, default=Path("runs/dropin"),
                   help="one result file per run; a run whose file has the same settings is read, not retrained")
    p.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's)")
    p.add_argument("--split", choices=("test", "validation"), default="test",
                   help="score on the official test split (the report) or, for probes, on --val-size held-out "
                        "training images (the model then trains on the others)")
    p.add_argument("--val-size", type=int, default=5000, help="held-out training images of --split validation")
    p.add_argument("--ddcl-kwargs", type=json.loads, default={}, metavar="JSON",
                   help="DDCLQuantizer options for a probe, today's names, e.g. "
                        "'{\"standardize\": {\"renorm_clip\": null}}' (recorded with the run)")
    p.add_argument("--quick", action="store_true", help="a smoke test: 20 steps, 2 seeds, 512 test images")
    args = p.parse_args(argv)
    if args.quick:
        args.steps, args.seeds, args.test_limit = 20, args.seeds[:2], 512
    if args.steps < 1 or args.batch_size < 1 or args.num_codes < 2 or args.num_quantizers < 1:
        p.error("--steps, --batch-size and --num-quantizers must be positive and --num-codes at least 2")
    args.command = "python -m eval.dropin " + " ".join(argv if argv is not None else __import__("sys").argv[1:])
    return args


def main(argv: list[str] | None = None) -> dict[str, Any]:
    args = parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    validation = args.split == "validation"
    data = CIFAR10DataModule(args.data_root, batch_size=args.batch_size, val_size=args.val_size if validation else 0,
                             num_workers=args.num_workers)
    data.setup("fit")
    data.setup("test")
    runs = []
    common = {k: getattr(args, k) for k in ("steps", "batch_size", "num_codes", "lr", "alpha", "test_limit")}
    if validation:  # recorded only when not the report's (the stored test runs stay valid)
        common.update(split="validation", val_size=args.val_size)
    for seed in args.seeds:
        for method in args.methods:
            settings = {**common, "num_quantizers": args.num_quantizers} if method in RESIDUAL else dict(common)
            if method == "ddcl" and args.ddcl_kwargs:
                settings["ddcl_kwargs"] = args.ddcl_kwargs
            path = args.runs / method / f"seed{seed}.json"
            stored = json.loads(path.read_text()) if path.is_file() else {}
            if stored.get("settings") == settings:
                runs.append(stored)
                continue
            run = {**train_and_score(method, seed, args, data), "settings": settings}
            print(f"[dropin] {method} seed {seed}: hard PSNR {run['test']['psnr_hard']:.2f} dB, utilization "
                  f"{100 * run['test']['utilization']:.1f}%, perplexity {run['test']['perplexity']:.0f} "
                  f"({run['train_s']:.0f} s)", flush=True)
            path.parent.mkdir(parents=True, exist_ok=True)
            write_atomic(path, json.dumps(run, indent=1))
            runs.append(run)
    return write_report(runs, args)


def write_report(runs: list[dict[str, Any]], args: argparse.Namespace) -> dict[str, Any]:
    groups: dict[str, list[dict[str, Any]]] = {}
    for run in runs:
        groups.setdefault(run["method"], []).append(run)
    verdict = []
    for ours, kind in (("ddcl", SINGLE), ("rddcl", RESIDUAL)):  # a residual stack against residual stacks only
        if ours not in groups:
            continue
        name = "DDCL" if ours == "ddcl" else "ResidualDDCL"
        mine = sorted(groups[ours], key=lambda r: r["seed"])
        for key, group_runs in groups.items():
            if key == ours or key not in kind:
                continue
            rule = by_seed(*({r["seed"]: r["test"]["psnr_hard"] for r in runs_} for runs_ in (mine, group_runs)))
            side = "ahead of" if rule["margin"] >= 0 else "behind"
            a, b = ([r["test"]["psnr_hard"] for r in runs_ if r["seed"] in rule["seeds"]]
                    for runs_ in (mine, group_runs))
            verdict.append(f"- {name} {side} {LABELS[key]} by {abs(rule['margin']):.2f} dB "
                           f"({statistics.fmean(a):.2f} vs {statistics.fmean(b):.2f}), {describe(rule)}.")
        util = float(values(groups[ours], "utilization").min()) * 100
        verdict.append(f"- {name} {args.split} utilization, lowest seed" + (" and level" if ours == "rddcl" else "")
                       + f": {util:.1f}% (target ≥ 99%).")
    lines = ["# Drop-in check: each quantizer in a foreign autoencoder, with its library's defaults", "",
             f"Regenerate: `{args.command}`", "", f"Code: {code_commit()} (the report; runs read back from --runs "
             "keep no commit of their own)", "",
             f"vector-quantize-pytorch's example shape on CIFAR-10 (D = {DIM}, 8x8 grid), {args.steps} steps of "
             f"{args.batch_size} images, L1 + {args.alpha:g}·quantizer loss, Adam({args.lr:g}) on "
             f"`model.parameters()`, seeds {args.seeds}; " + (
                 f"validation split ({args.val_size} held-out training images; a probe, not the report)"
                 if args.split == "validation" else f"test split ({args.test_limit or 10000} images)") + ", "
             "images decoded from the hard indices alone" + (
                 f"; residual stacks: {args.num_quantizers} levels of K codes, lowest level's utilization and "
                 f"perplexity, every level's dead codes" if set(groups) & set(RESIDUAL) else "")
             + ". See the module docstring of `eval/dropin.py` for each constructor. A margin counts beyond the seed "
             "spread when it exceeds the sum of the two sample stds over >= 3 paired seeds, with one sign on "
             "every seed.", "", *test_table(groups, LABELS, columns(args.split)), "", *verdict, ""]
    args.out.mkdir(parents=True, exist_ok=True)
    write_atomic(args.out / "report.md", "\n".join(lines))
    summary = {"settings": {k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()}, "runs": runs}
    write_atomic(args.out / "results.json", json.dumps(portable(summary), indent=1))
    return summary


def cli(argv: list[str] | None = None) -> int:
    return run_command(main, argv)


if __name__ == "__main__":
    raise SystemExit(cli())


def render_test(sources: Sequence[tuple[Path, str]], flags: Sequence[str] = ()) -> list[str]:
    """The README/docs block ``dropin_test`` (:mod:`eval.render`): the test table of ``eval.dropin`` results files."""

    def setting(s: dict[str, Any]) -> str:
        return f"{s['steps']} steps of {s['batch_size']} images, K = {s['num_codes']}, " \
               f"seeds {', '.join(map(str, s['seeds']))}"

    runs, lines = render.merged(sources, setting, lambda s: s.get("split", "test"))
    return [*test_table(group(runs), render.labels_of(LABELS, flags), TEST_COLUMNS), "", *lines]
