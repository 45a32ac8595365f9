"""Robust by default: every quantizer, with its library's defaults and with its documented recipe, over a grid of
settings a user meets, in the foreign autoencoder of :mod:`eval.dropin`; ``reports/robustness/``.

Usage:
    pip install -e ".[bench]"          # vector-quantize-pytorch, a benchmark-only extra
    python -m eval.robustness --data-root ../shared/data/cifar10-jpeg.tar.gz --jobs 2
    python -m eval.robustness --quick --data-root ../shared/data/cifar10-jpeg.tar.gz    # a smoke run, a minute

The design is one-at-a-time: a base setting (K = 512, D = 32, Adam 3e-4, 128 images a batch, the encoder's output
as built, float32, CIFAR-10), every setting of :data:`SETTINGS` changes one axis of it, and two corners change two
that users hit together (small batches with a large codebook; SGD with wide codes). The full product of the axes
is not run. Every setting trains every configuration of :data:`CONFIGS` for the same number of optimizer steps on
the 45,000 training images (the project's 5,000 validation images are held out and unused: nothing here is tuned,
every configuration is fixed in advance by its own documentation) and scores it once on the official test split:
PSNR of the images decoded from the hard indices alone, utilization and perplexity / K of those indices.

The only line that differs between configurations is the quantizer's constructor, printed in the report exactly as
:func:`build` evaluates it. The loss is ``L1(reconstruction, x) + 10 * quantizer loss``, as in :mod:`eval.dropin`.

Every run is one JSON file under ``--runs``; a run whose file has the same settings is read, not retrained, so an
interrupted grid resumes where it stopped. ``--jobs 2`` trains two runs at a time, one thread each.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import subprocess
import sys
import time
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path
from typing import Any

import lightning as L
import torch
from torch import Tensor, nn
from torch.utils.data import DataLoader
from torchmetrics.image import PeakSignalNoiseRatio

import softvq
from eval.dropin import SmallAutoencoder
from eval.peers import fsq_levels
from softvq.cli.common import run_command
from softvq.data.cifar10 import CIFAR10DataModule
from softvq.models.files import write_atomic

ALPHA = 10.0  # weight of the quantizer's loss, as in eval.dropin
VAL_SIZE = 5000  # held out of training, as the project's trainer does; not read here
COLLAPSE = 0.5  # test utilization below this is listed as a collapse


@dataclasses.dataclass(frozen=True)
class Setting:
    """One point of the grid. ``dataset`` is ``"cifar10"`` or ``"cifar10-gray"`` (luminance, repeated on the three
    channels so that the model is unchanged)."""

    num_codes: int = 512
    dim: int = 32
    optimizer: str = "adam"
    batch_size: int = 128
    encoder_scale: float = 1.0
    bf16: bool = False
    dataset: str = "cifar10"

    def __post_init__(self) -> None:
        if self.optimizer not in OPTIMIZERS:
            raise ValueError(f"unknown optimizer {self.optimizer!r}; choose from {sorted(OPTIMIZERS)}")
        if self.dataset not in ("cifar10", "cifar10-gray"):
            raise ValueError(f"unknown dataset {self.dataset!r}; choose 'cifar10' or 'cifar10-gray'")
        if self.num_codes < 2 or self.dim < 1 or self.batch_size < 1 or not self.encoder_scale > 0:
            raise ValueError(f"bad setting {self}")


# The optimizer calls, as a user writes them, on every parameter of the model.
OPTIMIZERS = {
    "adam": "torch.optim.Adam(model.parameters(), lr=3e-4)",
    "adamw": "torch.optim.AdamW(model.parameters(), lr=1e-3)",
    "sgd": "torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)",
}

BASE = Setting()
# id -> (what changes, the setting). Ids are file names.
SETTINGS: dict[str, tuple[str, Setting]] = {
    "base": ("base", BASE),
    "k64": ("K = 64", dataclasses.replace(BASE, num_codes=64)),
    "k4096": ("K = 4096", dataclasses.replace(BASE, num_codes=4096)),
    "d8": ("D = 8", dataclasses.replace(BASE, dim=8)),
    "d128": ("D = 128", dataclasses.replace(BASE, dim=128)),
    "adamw": ("AdamW 1e-3", dataclasses.replace(BASE, optimizer="adamw")),
    "sgd": ("SGD 0.05, momentum 0.9", dataclasses.replace(BASE, optimizer="sgd")),
    "batch16": ("batches of 16", dataclasses.replace(BASE, batch_size=16)),
    "batch256": ("batches of 256", dataclasses.replace(BASE, batch_size=256)),
    "scale0.01": ("encoder output x0.01", dataclasses.replace(BASE, encoder_scale=0.01)),
    "scale100": ("encoder output x100", dataclasses.replace(BASE, encoder_scale=100.0)),
    "bf16": ("bf16 autocast", dataclasses.replace(BASE, bf16=True)),
    "gray": ("grayscale CIFAR-10", dataclasses.replace(BASE, dataset="cifar10-gray")),
    "batch16_k4096": ("batches of 16, K = 4096", dataclasses.replace(BASE, batch_size=16, num_codes=4096)),
    "sgd_d128": ("SGD, D = 128", dataclasses.replace(BASE, optimizer="sgd", dim=128)),
}

# id -> (label, role, calling convention of eval.dropin.SmallAutoencoder, constructor template). The role says
# what the configuration is: a library's defaults, its documented recipe, or both (a method whose documentation
# gives one configuration). {K}, {D} and {levels} are filled in per setting.
CONFIGS: dict[str, tuple[str, str, str, str]] = {
    "ddcl": ("softvq DDCLQuantizer", "defaults = recipe", "ddcl",
             "softvq.DDCLQuantizer({K}, {D}, channel_first=True)"),
    "hard": ("softvq HardVQ", "defaults", "hard", "softvq.HardVQ({K}, {D})"),
    "hard_recipe": ("softvq HardVQ, EMA + restart", "recipe", "hard",
                    "softvq.HardVQ({K}, {D}, ema_decay=0.99, dead_code_threshold=1.0)"),
    "vqp_vq": ("vqp VectorQuantize", "defaults", "vqp_vq",
               "VectorQuantize(dim={D}, codebook_size={K}, accept_image_fmap=True)"),
    "vqp_vq_recipe": ("vqp VectorQuantize, README recipe", "recipe", "vqp_vq",
                      "VectorQuantize(dim={D}, codebook_size={K}, accept_image_fmap=True, kmeans_init=True, "
                      "kmeans_iters=10, threshold_ema_dead_code=2, rotation_trick=True)"),
    "vqp_fsq": ("vqp FSQ, the paper's levels", "defaults = recipe", "vqp_fsq",
                "FSQ(levels={levels}, dim={D}, channel_first=True)"),
    "vqp_simvq": ("vqp SimVQ, its README example", "defaults = recipe", "vqp_simvq",
                  "SimVQ(dim={D}, codebook_size={K}, channel_first=True)"),
}
NEEDS_VQP = {key for key, (_, _, _, template) in CONFIGS.items() if not template.startswith("softvq.")}


def constructor(config: str, num_codes: int, dim: int) -> str:
    """The Python call that builds ``config`` for ``num_codes`` codes of dimension ``dim``, as the report prints it."""
    if config not in CONFIGS:
        raise ValueError(f"unknown configuration {config!r}; choose from {tuple(CONFIGS)}")
    template = CONFIGS[config][3]
    levels = fsq_levels(num_codes) if "{levels}" in template else None
    return template.format(K=num_codes, D=dim, levels=levels)


def build(config: str, num_codes: int, dim: int) -> tuple[nn.Module, int, str]:
    """``(quantizer, codebook size, the call that built it)``. The call is evaluated, so the report's constructor is
    the one that ran. FSQ's codebook size is the product of its levels."""
    call = constructor(config, num_codes, dim)
    namespace: dict[str, Any] = {"softvq": softvq}
    if config in NEEDS_VQP:
        try:
            import vector_quantize_pytorch as vqp
        except ImportError as err:
            raise SystemExit("vector-quantize-pytorch is not installed: pip install -e '.[bench]'") from err
        namespace.update(VectorQuantize=vqp.VectorQuantize, FSQ=vqp.FSQ, SimVQ=vqp.SimVQ)
    module = eval(call, {"__builtins__": {}}, namespace)  # our own template, never text from a file
    size = math.prod(fsq_levels(num_codes)) if CONFIGS[config][2] == "vqp_fsq" else num_codes
    return module, size, call


def make_optimizer(name: str, model: nn.Module) -> torch.optim.Optimizer:
    return eval(OPTIMIZERS[name], {"__builtins__": {}}, {"torch": torch, "model": model})


# ----------------------------------------------------------------------------------------------------------- data
def load_images(data_root: Path, cache: Path | None, val_size: int = VAL_SIZE) -> dict[str, Tensor]:
    """``{"train": (45000, 3, 32, 32) uint8, "test": (10000, 3, 32, 32) uint8}``: the training images less the
    ``val_size`` validation ones, and the test split, decoded once and kept as one tensor file (loaded with
    ``weights_only``), because every run of the grid reads the same images and decoding JPEGs would cost more than
    training the small model."""
    key = f"{data_root.resolve()} val_size={val_size}"
    if cache is not None and cache.is_file():
        stored = torch.load(cache, weights_only=True)
        if stored.get("source") == key:
            return {"train": stored["train"], "test": stored["test"]}
    data = CIFAR10DataModule(data_root, batch_size=1000, val_size=val_size, num_workers=0)
    data.setup("fit")
    data.setup("test")

    def as_uint8(dataset) -> Tensor:
        loader = DataLoader(dataset, batch_size=1000, shuffle=False)
        return torch.cat([(x * 255).round().to(torch.uint8) for x, _ in loader])

    images = {"train": as_uint8(data.train_set), "test": as_uint8(data.test_set)}
    if cache is not None:
        cache.parent.mkdir(parents=True, exist_ok=True)
        tmp = cache.with_suffix(".tmp")
        torch.save({**images, "source": key}, tmp)
        tmp.replace(cache)
    return images


def to_input(batch: Tensor, dataset: str) -> Tensor:
    """uint8 images -> float ``[0, 1]``; ``cifar10-gray`` takes the ITU-R 601 luminance on all three channels."""
    x = batch.float() / 255.0
    if dataset == "cifar10-gray":
        weights = torch.tensor([0.299, 0.587, 0.114]).view(1, 3, 1, 1)
        x = (x * weights).sum(1, keepdim=True).expand(-1, 3, -1, -1).contiguous()
    return x


# ------------------------------------------------------------------------------------------------------------ runs
def train_and_score(config: str, setting: Setting, seed: int, steps: int, images: dict[str, Tensor],
                    test_limit: int = 0) -> dict[str, Any]:
    """Train one configuration in one setting and score it on the test split. A run that raises or whose loss
    stops being finite is returned with ``"failed"`` (the reason) and no test figures."""
    L.seed_everything(seed, verbose=False)
    quantizer = build(config, setting.num_codes, setting.dim)
    model = SmallAutoencoder(CONFIGS[config][2], setting.num_codes, dim=setting.dim, quantizer=quantizer[:2],
                             encoder_scale=setting.encoder_scale)
    run: dict[str, Any] = {"config": config, "seed": seed, "constructor": quantizer[2],
                           "optimizer": OPTIMIZERS[setting.optimizer]}
    optimizer = make_optimizer(setting.optimizer, model)
    train = images["train"]
    order = torch.Generator().manual_seed(seed)
    autocast = torch.autocast("cpu", dtype=torch.bfloat16, enabled=setting.bf16)
    start, step = time.perf_counter(), 0
    model.train()
    try:
        while step < steps:
            permutation = torch.randperm(len(train), generator=order)
            for first in range(0, len(train) - setting.batch_size + 1, setting.batch_size):
                x = to_input(train[permutation[first:first + setting.batch_size]], setting.dataset)
                with autocast:
                    reconstruction, _, loss = model(x)
                    total = (reconstruction.float() - x).abs().mean() + ALPHA * loss.float()
                if not torch.isfinite(total):
                    raise FloatingPointError(f"the loss is {float(total)} at step {step}")
                optimizer.zero_grad(set_to_none=True)
                total.backward()
                optimizer.step()
                step += 1
                if step >= steps:
                    break
    except Exception as err:  # a run that fails is a result of the grid, not the end of it
        return {**run, "failed": f"{type(err).__name__}: {err}".splitlines()[0][:300], "train_s": time.perf_counter()
                - start, "steps_done": step}
    run["train_s"] = time.perf_counter() - start
    run["test"] = score(model, images["test"], setting, test_limit)
    return run


@torch.no_grad()
def score(model: SmallAutoencoder, test: Tensor, setting: Setting, test_limit: int = 0) -> dict[str, float]:
    """Hard-index PSNR (per image, averaged), utilization and perplexity / K of the test split, under the setting's
    autocast as a user of that setting would infer."""
    model.eval()
    psnr = PeakSignalNoiseRatio(data_range=1.0, dim=(1, 2, 3))
    counts = torch.zeros(model.num_codes, dtype=torch.long)
    test = test[:test_limit] if test_limit else test
    for first in range(0, len(test), 500):
        x = to_input(test[first:first + 500], setting.dataset)
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=setting.bf16):
            _, indices, _ = model(x)
            decoded = model.decode_indices(indices)
        psnr.update(decoded.float().clamp(0.0, 1.0), x)
        counts += torch.bincount(indices.reshape(-1).long(), minlength=model.num_codes)
    usage = softvq.functional.usage_from_counts(counts)
    return {"psnr_hard": float(psnr.compute()), "utilization": float(usage["utilization"]),
            "perplexity_per_code": float(usage["perplexity"]) / model.num_codes, "num_codes": model.num_codes,
            "images": len(test)}


def code_commit() -> str:
    """The repository's commit, ``+`` when ``softvq/`` or ``eval/`` differ from it; ``"unknown"`` outside a clone."""
    root = Path(__file__).resolve().parent.parent
    try:
        head = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=root, capture_output=True, text=True,
                              check=True).stdout.strip()
        dirty = subprocess.run(["git", "diff", "--quiet", "HEAD", "--", "softvq", "eval"], cwd=root).returncode != 0
    except (OSError, subprocess.CalledProcessError):
        return "unknown"
    return head + ("+" if dirty else "")


def _run_settings(setting: Setting, steps: int, test_limit: int) -> dict[str, Any]:
    return {**dataclasses.asdict(setting), "steps": steps, "test_limit": test_limit, "alpha": ALPHA}


_IMAGES: dict[str, Tensor] = {}


def _worker_init(data_root: str, cache: str | None, threads: int, val_size: int = VAL_SIZE) -> None:
    torch.set_num_threads(threads)
    _IMAGES.update(load_images(Path(data_root), Path(cache) if cache else None, val_size))


def _task(job: tuple[str, str, int, int, int, str]) -> dict[str, Any]:
    setting_id, config, seed, steps, test_limit, path = job
    run = train_and_score(config, SETTINGS[setting_id][1], seed, steps, _IMAGES, test_limit)
    run.update(setting=setting_id, settings=_run_settings(SETTINGS[setting_id][1], steps, test_limit),
               commit=code_commit())
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    write_atomic(Path(path), json.dumps(run, indent=1))
    return run


def _cost(setting: Setting) -> float:
    """A rough order for the queue (largest first, so that two workers finish together)."""
    return setting.batch_size * (setting.num_codes + 64) * (setting.dim + 16)


# ------------------------------------------------------------------------------------------------- gradient gain
def gradient_gain(quantizer: nn.Module, dim: int, seed: int = 0, tokens: int = 8192, clusters: int = 64,
                  warmup: int = 20) -> dict[str, float]:
    """How much of the decoder's gradient reaches the encoder through ``quantizer`` (channel-last), on clustered
    tokens (``clusters`` unit-normal centres plus noise of std 0.5) after ``warmup`` training steps: the gain
    ``||dL/dz|| / ||dL/dq||`` and the cosine between the two, for a random upstream gradient ``dL/dq``. A
    straight-through quantizer passes the gradient unchanged (gain 1, cosine 1); DDCL passes ``J^T g`` with the soft
    centroid's Jacobian ``J = (2/T) Cov_q(P)``, whose size depends on T and D. Under SGD the gain is a factor on the
    encoder's learning rate; Adam divides most of it out."""
    generator = torch.Generator().manual_seed(seed)
    centres = torch.randn(clusters, dim, generator=generator)

    def batch() -> Tensor:
        pick = torch.randint(clusters, (tokens,), generator=generator)
        return centres[pick] + 0.5 * torch.randn(tokens, dim, generator=generator)

    quantizer.train()
    with torch.no_grad():
        for _ in range(warmup):
            quantizer(batch())
    z = batch()
    return gain_at(quantizer, z, torch.randn(z.shape, generator=generator))


def gain_at(quantizer: nn.Module, z: Tensor, upstream: Tensor) -> dict[str, float]:
    """``||J^T g|| / ||g||`` and ``cos(J^T g, g)`` for the upstream gradient ``g`` at tokens ``z`` (channel-last)."""
    z = z.detach().requires_grad_(True)
    (dz,) = torch.autograd.grad(quantizer(z).quantized, z, upstream)
    return {"gain": float(dz.norm() / upstream.norm()),
            "cosine": float(torch.nn.functional.cosine_similarity(dz.flatten(), upstream.flatten(), dim=0))}


def gradient_gain_table(dims: tuple[int, ...] = (8, 32, 128), num_codes: int = 512) -> list[str]:
    """The Markdown table of :func:`gradient_gain` for DDCL's defaults and HardVQ with EMA + restart at each D."""
    lines = ["| D | DDCL gain | DDCL cosine | DDCL T | HardVQ EMA + restart gain | cosine |",
             "|---|---|---|---|---|---|"]
    for dim in dims:
        torch.manual_seed(0)
        ddcl = softvq.DDCLQuantizer(num_codes, dim)
        d = gradient_gain(ddcl, dim)
        h = gradient_gain(softvq.HardVQ(num_codes, dim, ema_decay=0.99, dead_code_threshold=1.0), dim)
        lines.append(f"| {dim} | {d['gain']:.3f} | {d['cosine']:.3f} | {float(ddcl.temperature):.3g} | "
                     f"{h['gain']:.3f} | {h['cosine']:.3f} |")
    return lines


# ---------------------------------------------------------------------------------------------------------- report
def regrets(means: dict[str, dict[str, float | None]]) -> dict[str, dict[str, float]]:
    """``regret[setting][config]``: how many dB the configuration's mean PSNR falls below the best configuration of
    any method in that setting (0 for the best). A configuration that failed (``None`` or NaN) has regret ``inf``."""
    out: dict[str, dict[str, float]] = {}
    for setting, row in means.items():
        finite = [v for v in row.values() if v is not None and math.isfinite(v)]
        best = max(finite) if finite else math.nan
        out[setting] = {c: (best - v if v is not None and math.isfinite(v) else math.inf) for c, v in row.items()}
    return out


def worst_case(regret: dict[str, dict[str, float]]) -> dict[str, tuple[float, str]]:
    """Per configuration, its largest regret over the settings and the setting where it happens."""
    worst: dict[str, tuple[float, str]] = {}
    for setting, row in regret.items():
        for config, value in row.items():
            if config not in worst or value > worst[config][0]:
                worst[config] = (value, setting)
    return worst


def _stats(runs: list[dict[str, Any]], metric: str) -> tuple[float, float, int]:
    """Mean, sample std and count of a test metric over the runs that did not fail (NaN when none)."""
    vals = torch.tensor([r["test"][metric] for r in runs if "test" in r], dtype=torch.float64)
    if len(vals) == 0:
        return math.nan, math.nan, 0
    return float(vals.mean()), float(vals.std()) if len(vals) > 1 else 0.0, len(vals)


def write_report(runs: list[dict[str, Any]], args: argparse.Namespace, wall_s: float | None) -> dict[str, Any]:
    settings = [s for s in SETTINGS if s in args.settings]
    configs = [c for c in CONFIGS if c in args.configs]
    cell: dict[str, dict[str, list]] = {s: {c: [] for c in configs} for s in settings}
    for run in runs:
        cell[run["setting"]][run["config"]].append(run)
    means = {s: {c: (_stats(cell[s][c], "psnr_hard")[0] if len(cell[s][c]) and all("test" in r for r in cell[s][c])
                     else None) for c in configs} for s in settings}
    regret = regrets(means)
    worst = worst_case(regret)

    def fmt(value: float) -> str:
        return "failed" if math.isinf(value) else f"{value:.2f}"

    head = "| setting | " + " | ".join(f"`{c}`" for c in configs) + " |"
    rule = "|---|" + "---|" * len(configs)
    commits: dict[str, int] = {}
    for run in runs:
        commits[run.get("commit", "not recorded")] = commits.get(run.get("commit", "not recorded"), 0) + 1
    lines = ["# Robust by default: every quantizer over a grid of settings, defaults and recipes", "",
             f"Regenerate: `{args.command}`", "",
             f"Code: report written at {code_commit()}; runs trained at " +
             ", ".join(f"{c} ({n} runs)" for c, n in commits.items()) + ".", "",
             f"The foreign autoencoder of `eval/dropin.py` (encoder output D channels on an 8x8 grid), {args.steps} "
             f"optimizer steps per run, L1 + {ALPHA:g}·quantizer loss, seeds {args.seeds}. Trained on the 45,000 "
             f"training images (the 5,000 validation images held out, unused: nothing is tuned here), scored once on "
             f"the official test split ({args.test_limit or 10000} images): PSNR of the images decoded from the hard "
             f"indices alone. One axis changes at a time around the base setting, plus two corners.", ""]
    if wall_s is not None:
        lines += [f"Wall time of the grid: {wall_s / 60:.0f} min with {args.jobs} job(s) of {args.threads} thread(s) "
                  f"each; sum of the runs' training times {sum(r['train_s'] for r in runs) / 60:.0f} min.", ""]
    lines += ["## Configurations", "", "| id | method | role | constructor (base setting) |", "|---|---|---|---|"]
    for c in configs:
        label, role, _, _ = CONFIGS[c]
        lines.append(f"| `{c}` | {label} | {role} | `{constructor(c, BASE.num_codes, BASE.dim)}` |")
    lines += ["", "Each run's exact constructor and optimizer call are in `results.json`. Optimizers: " +
              "; ".join(f"{k}: `{v}`" for k, v in OPTIMIZERS.items()) + ".", "",
              "## Settings", "", "| id | change from base | K | D | optimizer | batch | encoder scale | bf16 | data |",
              "|---|---|---|---|---|---|---|---|---|"]
    for s in settings:
        what, st = SETTINGS[s]
        lines.append(f"| `{s}` | {what} | {st.num_codes} | {st.dim} | {st.optimizer} | {st.batch_size} | "
                     f"{st.encoder_scale:g} | {'on' if st.bf16 else 'off'} | {st.dataset} |")
    for title, metric, scale, fmt_ in (("Test PSNR from hard indices (dB), mean ± std over seeds", "psnr_hard", 1.0,
                                        "{:.2f} ± {:.2f}"),
                                       ("Test utilization (%), mean ± std", "utilization", 100.0, "{:.1f} ± {:.1f}"),
                                       ("Test perplexity / K, mean ± std", "perplexity_per_code", 1.0,
                                        "{:.2f} ± {:.2f}")):
        lines += ["", f"## {title}", "", head, rule]
        for s in settings:
            cells = []
            for c in configs:
                m, sd, n = _stats(cell[s][c], metric)
                failed = sum("failed" in r for r in cell[s][c])
                text = (fmt_ if n > 1 else fmt_.split(" ±")[0]).format(m * scale, sd * scale) if n else "—"
                cells.append(text + (f" ({failed} failed)" if failed else ""))
            lines.append(f"| `{s}` | " + " | ".join(cells) + " |")
    lines += ["", "## Regret (dB below the best configuration of any method in the setting)", "", head, rule]
    for s in settings:
        lines.append(f"| `{s}` | " + " | ".join(("**0.00**" if regret[s][c] == 0 else fmt(regret[s][c]))
                                               for c in configs) + " |")
    lines.append("| **worst case** | " + " | ".join(f"{fmt(worst[c][0])} (`{worst[c][1]}`)" for c in configs) + " |")
    collapses = [(s, r["config"], r["seed"], r["test"]["utilization"]) for s in settings for c in configs
                 for r in cell[s][c] if "test" in r and r["test"]["utilization"] < COLLAPSE]
    failures = [(s, r["config"], r["seed"], r["failed"]) for s in settings for c in configs for r in cell[s][c]
                if "failed" in r]
    lines += ["", f"## Collapses (test utilization < {100 * COLLAPSE:.0f}% on a seed) and failed runs", "",
              "Per configuration, every setting where a seed collapsed: the lowest seed's test utilization and how "
              "many seeds collapsed.", ""]
    for c in configs:
        hits = {}
        for s, config, _, u in collapses:
            if config == c:
                low, n = hits.get(s, (1.0, 0))
                hits[s] = (min(low, u), n + 1)
        if hits:
            where = ", ".join(f"`{s}` {100 * low:.1f}% ({n}/{len(cell[s][c])})" for s, (low, n) in hits.items())
            lines.append(f"- `{c}`, {len(hits)} of {len(settings)} settings: {where}")
    if not collapses:
        lines.append("- no collapse")
    lines += [f"- `{c}` in `{s}`, seed {seed} failed: {why}" for s, c, seed, why in failures]
    verdict = targets(regret, worst, cell, settings, configs)
    lines += ["", "## Targets", "", *verdict, ""]
    args.out.mkdir(parents=True, exist_ok=True)
    plot_regret(regret, settings, configs, args.out / "regret.png")
    lines[lines.index("## Targets"):lines.index("## Targets")] = ["![regret per setting](regret.png)", ""]
    write_atomic(args.out / "report.md", "\n".join(lines))
    summary = {"command": args.command, "steps": args.steps, "seeds": args.seeds, "wall_s": wall_s,
               "regret": regret, "worst_case": worst, "runs": runs}
    write_atomic(args.out / "results.json", json.dumps(summary, indent=1))
    return summary


def plot_regret(regret: dict[str, dict[str, float]], settings: list[str], configs: list[str], path: Path) -> None:
    """A settings x configurations heat map of the regret (dB, clipped at 4; failed runs in black)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    values = torch.tensor([[regret[s][c] for c in configs] for s in settings], dtype=torch.float64)
    shown = torch.where(values.isinf(), 5.0, values.clamp(max=4.0)).numpy()  # only a failed run is over vmax
    cmap = plt.get_cmap("viridis_r").copy()
    cmap.set_over("black")
    fig, ax = plt.subplots(figsize=(1.3 * len(configs) + 2.5, 0.42 * len(settings) + 1.6))
    image = ax.imshow(shown, cmap=cmap, vmin=0.0, vmax=4.0, aspect="auto")
    for i, s in enumerate(settings):
        for j, c in enumerate(configs):
            v = regret[s][c]
            ax.text(j, i, "failed" if math.isinf(v) else f"{v:.2f}", ha="center", va="center", fontsize=7,
                    color="white" if min(v, 4.0) > 2.0 else "black")
    ax.set_xticks(range(len(configs)), configs, rotation=30, ha="right", fontsize=8)
    ax.set_yticks(range(len(settings)), settings, fontsize=8)
    ax.set_title("regret: dB below the best configuration in each setting (test split; black: failed)", fontsize=9)
    fig.colorbar(image, ax=ax, label="dB (clipped at 4)")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def targets(regret, worst, cell, settings, configs) -> list[str]:
    """The issue's three targets for DDCL's defaults, each stated with its numbers, true or false."""
    if "ddcl" not in configs:
        return ["- DDCL was not run."]
    others = {c: w for c, w in worst.items() if c != "ddcl"}
    best_other = min(others, key=lambda c: others[c][0]) if others else None
    d_worst, d_where = worst["ddcl"]
    lines = []
    if best_other is not None:
        o_worst, o_where = others[best_other]
        holds = d_worst < o_worst
        lines.append(f"- Smallest worst-case regret: {'met' if holds else 'NOT met'}. DDCL {fmt_db(d_worst)} "
                     f"(in `{d_where}`); the smallest of the others is `{best_other}`, {fmt_db(o_worst)} "
                     f"(in `{o_where}`).")
    over = [s for s in settings if regret[s]["ddcl"] > 0.5]
    lines.append(f"- Regret ≤ 0.5 dB in every setting: {'met' if not over else 'NOT met'}"
                 + ("" if not over else " — over it in " + ", ".join(f"`{s}` ({fmt_db(regret[s]['ddcl'])})"
                                                                  for s in over)) + ".")
    low = [(s, min(r["test"]["utilization"] for r in cell[s]["ddcl"] if "test" in r)) for s in settings
           if any("test" in r for r in cell[s]["ddcl"])]
    under = [(s, u) for s, u in low if u < 0.95]
    lowest = min(low, key=lambda t: t[1]) if low else None
    lines.append(f"- Test utilization ≥ 95% in every setting (lowest seed): {'met' if not under else 'NOT met'}"
                 + (f"; lowest {100 * lowest[1]:.1f}% in `{lowest[0]}`" if lowest else "")
                 + ("" if not under else " — under it in " + ", ".join(f"`{s}` ({100 * u:.1f}%)" for s, u in under))
                 + ".")
    return lines


def fmt_db(value: float) -> str:
    return "failed" if math.isinf(value) else f"{value:.2f} dB"


# ------------------------------------------------------------------------------------------------------------- cli
def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--data-root", type=Path, default=Path("data"), help="CIFAR-10 directory or .tar.gz archive")
    p.add_argument("--settings", nargs="+", choices=list(SETTINGS), default=list(SETTINGS))
    p.add_argument("--configs", nargs="+", choices=list(CONFIGS), default=list(CONFIGS))
    p.add_argument("--seeds", type=int, nargs="+", default=[0, 1])
    p.add_argument("--steps", type=int, default=200, help="optimizer steps per run")
    p.add_argument("--val-size", type=int, default=VAL_SIZE,
                   help="training images held out (unused: nothing is tuned here), as the project's trainer does")
    p.add_argument("--test-limit", type=int, default=0, help="score on this many test images (0: all)")
    p.add_argument("--jobs", type=int, default=1, help="runs trained at a time, in worker processes")
    p.add_argument("--threads", type=int, default=1, help="torch threads per job")
    p.add_argument("--out", type=Path, default=Path("reports/robustness"))
    p.add_argument("--runs", type=Path, default=Path("runs/robustness"),
                   help="one result file per run (and the decoded images, images.pt)")
    p.add_argument("--no-train", action="store_true", help="write the report from the stored runs only")
    p.add_argument("--gradient-gain", action="store_true",
                   help="print how much of the decoder's gradient reaches the encoder through DDCL and HardVQ at "
                        "D = 8, 32, 128 (seconds), and write it to --out/gradient_gain.md; trains nothing else")
    p.add_argument("--quick", action="store_true", help="a smoke run: 5 steps, settings base and k64, 512 test images")
    args = p.parse_args(argv)
    if args.quick:
        args.steps, args.test_limit, args.seeds = 5, 512, args.seeds[:1]
        args.settings = [s for s in args.settings if s in ("base", "k64")] or ["base"]
    if args.steps < 1 or args.jobs < 1 or args.threads < 1 or args.test_limit < 0 or args.val_size < 0:
        p.error("--steps, --jobs and --threads must be positive and --test-limit and --val-size not negative")
    # The command that makes this report: without --no-train (with the runs stored, it reads them just the same).
    args.command = "python -m eval.robustness " + " ".join(a for a in (argv if argv is not None else sys.argv[1:])
                                                         if a != "--no-train")
    return args


def main(argv: list[str] | None = None) -> dict[str, Any]:
    args = parse_args(argv)
    if args.gradient_gain:
        table = gradient_gain_table()
        print("\n".join(table))
        args.out.mkdir(parents=True, exist_ok=True)
        write_atomic(args.out / "gradient_gain.md", "\n".join([
            "# How much of the decoder's gradient reaches the encoder", "", f"Regenerate: `{args.command}`", "",
            f"Code: {code_commit()}. See `eval.robustness.gradient_gain`: clustered synthetic tokens, K = 512, 20 "
            "training steps, then ||dL/dz|| / ||dL/dq|| and their cosine for a random upstream gradient.", "",
            *table, ""]))
        return {"gradient_gain": table}
    runs, jobs = [], []
    for setting_id in sorted(args.settings, key=lambda s: -_cost(SETTINGS[s][1])):
        wanted = _run_settings(SETTINGS[setting_id][1], args.steps, args.test_limit)
        for seed in args.seeds:
            for config in args.configs:
                path = args.runs / setting_id / config / f"seed{seed}.json"
                stored = json.loads(path.read_text()) if path.is_file() else {}
                if stored.get("settings") == wanted:
                    runs.append(stored)
                elif args.no_train:
                    raise SystemExit(f"no stored run with these settings at {path}; run without --no-train")
                else:
                    jobs.append((setting_id, config, seed, args.steps, args.test_limit, str(path)))
    start = time.perf_counter()
    cache = str(args.runs / "images.pt")
    if jobs and args.jobs == 1:
        _worker_init(str(args.data_root), cache, args.threads, args.val_size)
        done = map(_task, jobs)
    elif jobs:
        load_images(args.data_root, Path(cache), args.val_size)  # decoded once here; workers load the tensors
        pool = ProcessPoolExecutor(args.jobs, initializer=_worker_init,
                                   initargs=(str(args.data_root), cache, args.threads, args.val_size),
                                   mp_context=torch.multiprocessing.get_context("spawn"))
        done = pool.map(_task, jobs)
    else:
        done = iter(())
    for run in done:
        t = run.get("test")
        print(f"[robustness] {run['setting']} {run['config']} seed {run['seed']}: "
              + (f"PSNR {t['psnr_hard']:.2f} dB, {100 * t['utilization']:.1f}% used" if t else
                 f"FAILED ({run['failed']})") + f" ({run['train_s']:.0f} s)", flush=True)
        runs.append(run)
    wall = time.perf_counter() - start if jobs else None
    previous = args.out / "results.json"
    if wall is None and previous.is_file():  # a report rewritten from stored runs keeps the grid's wall time
        stored = json.loads(previous.read_text())
        if stored.get("steps") == args.steps and stored.get("seeds") == args.seeds:
            wall = stored.get("wall_s")
    return write_report(runs, args, wall)


def cli(argv: list[str] | None = None) -> int:
    return run_command(main, argv)


if __name__ == "__main__":
    raise SystemExit(cli())
