"""The trainer's configuration: flags derived from the constructors' typed signatures and docstrings (jsonargparse,
the Lightning ecosystem's convention), ``--config run.yaml``, ``--print_config``, and the fully resolved
configuration every run saves in its ``config.json``.

Sections, each a constructor's arguments (its checks run when the run starts, before anything is written):

- top level: :class:`RunOptions` (``--out``, ``--epochs``, ``--seed``, ``--resume``, ...) and ``--quantizer``;
- ``--data.*``: :class:`softvq.data.CIFAR10DataModule`;
- ``--model.*``: :class:`softvq.models.VQVAE` (encoder/decoder, optimizer, hierarchy);
- ``--ddcl.*``: :class:`softvq.DDCLQuantizer`, used by ``--quantizer ddcl``;
- ``--hard.*``: :class:`softvq.HardVQ`, used by ``--quantizer hard``;
- ``--rddcl.*`` / ``--rhard.*``: :class:`softvq.ResidualDDCL` / :class:`softvq.ResidualHardVQ`, used by
  ``--quantizer rddcl`` / ``rhard`` with ``--model.num_quantizers`` levels;
- ``--trainer.*``: :class:`softvq.cli.common.Hardware`.
"""

from __future__ import annotations

import inspect
import json
import math
from collections.abc import Sequence
from dataclasses import asdict, dataclass, is_dataclass
from pathlib import Path
from typing import Any

from jsonargparse import ArgumentParser, Namespace

from softvq import DDCLQuantizer, HardVQ, ResidualDDCL, ResidualHardVQ
from softvq._checks import check_non_negative_int, check_positive_int
from softvq._compat import newer_settings, upgrade_settings
from softvq.cli import parsing
from softvq.cli.common import Hardware
from softvq.cli.parsing import command_parser, refuse
from softvq.data import CIFAR10DataModule
from softvq.models import QUANTIZERS, RESIDUAL_QUANTIZERS, VQVAE
from softvq.parts.temperature import DEFAULT_RATE

QUANTIZER_CLASSES = {"ddcl": DDCLQuantizer, "hard": HardVQ, "rddcl": ResidualDDCL, "rhard": ResidualHardVQ}
# Arguments the trainer sets itself: the code count and dimension come from --model (and a residual stack's levels,
# --model.num_quantizers), the layout from the VQ-VAE; ResidualDDCL sets its levels' scale options itself.
LAYER_SKIP = {"num_codes", "dim", "channel_first", "num_quantizers"}
RESIDUAL_SKIP = {"standardize"}
# What may differ when a run is resumed (dotted keys of config.json): they extend it (epochs), say where the run and the
# same data are (a moved directory) or how to run it, and change no result (docs/training.md, "Run directories").
RESUME_SAFE = ("epochs", "out", "data.data_root", "data.download", "data.num_workers",
               "data.cache_dir", "check_replicas", "trainer.accelerator", "trainer.strategy", "trainer.progress_bar",
               "trainer.compile")


@dataclass
class RunOptions:
    """One training command: where it writes, how long it trains, and how it starts.

    Args:
        out: output directory (``<out>/<quantizer>`` per run when several quantizers are given).
        epochs: training epochs, in total (also when resuming: pass a larger number to train on).
        seed: seed of the weights, the data order and the codebook initialisation.
        check_replicas: with several processes (DDP), check every this many steps that the codebook is bit-identical
            on all of them and stop if not; 0 = never.
    """

    out: Path = Path("runs/vqvae")
    epochs: int = 10
    seed: int = 0
    check_replicas: int = 50

    def __post_init__(self) -> None:
        self.out = Path(self.out)
        self.epochs = check_positive_int("epochs", self.epochs)
        self.seed = int(self.seed)
        self.check_replicas = check_non_negative_int("check_replicas", self.check_replicas)


def build_parser() -> ArgumentParser:
    """The ``softvq-train`` parser: every flag comes from a constructor's signature and its docstring."""
    p = command_parser(
        "softvq-train", "Train VQ-VAEs on CIFAR-10 with a DDCL soft codebook and/or a hard "
        "straight-through VQ, side by side (several --quantizer values: the same seed, data and settings).",
        epilog="Data: --data.data_root is searched for cifar-10-batches-py/ (official release), train/ + test/ "
               "(ImageFolder), or is itself a .tar.gz of such a tree (extracted once into $SOFTVQ_CACHE, default "
               "~/.cache/softvq). With internet access, --data.download true fetches the official release. "
               "Write a config file with --print_config > run.yaml and train from it with --config run.yaml.")
    p.add_argument("--quantizer", nargs="+", choices=QUANTIZERS + RESIDUAL_QUANTIZERS, default=["ddcl"],
                   help="bottleneck(s) to train; several are trained one after the other into --out/<quantizer> "
                        "and compared in --out/comparison.md")
    p.add_class_arguments(RunOptions, None)
    # What this invocation does with --out, not settings of the run (config.json does not record them).
    p.add_argument("--resume", nargs="?", const="last", default=None, metavar="CKPT",
                   help="continue from a checkpoint: a path, or without a value <out>/checkpoints/last.ckpt")
    p.add_argument("--overwrite", action="store_true",
                   help="start afresh in an --out that already holds a run (its files are removed); without it the "
                        "command refuses to touch an existing run")
    p.add_class_arguments(CIFAR10DataModule, "data", skip={"seed"})
    p.add_class_arguments(VQVAE, "model", skip={"quantizer", "quantizer_kwargs"})
    for name, cls in QUANTIZER_CLASSES.items():
        skip = LAYER_SKIP & set(inspect.signature(cls).parameters) | (RESIDUAL_SKIP if name == "rddcl" else set())
        p.add_class_arguments(cls, name, skip=skip)
    p.add_class_arguments(Hardware, "trainer")
    return p


def parse(argv: Sequence[str] | None = None) -> Namespace:
    """Parsed flags and config files (:func:`softvq.cli.parsing.parse`: a bad flag, config key or value, or a former
    option name such as ``--ddcl.dead_code_threshold``, exits 2 with one ``error:`` line naming it)."""
    cfg = parsing.parse(build_parser(), argv, tuple(QUANTIZER_CLASSES))
    if len(set(cfg.quantizer)) != len(cfg.quantizer):
        refuse(f"--quantizer: each name once, got {' '.join(cfg.quantizer)}")
    return cfg


def run_options(cfg: Namespace) -> RunOptions:
    return RunOptions(**{name: cfg[name] for name in RunOptions.__dataclass_fields__})


def hardware(cfg: Namespace) -> Hardware:
    return Hardware(**cfg.trainer.as_dict())


def data_kwargs(cfg: Namespace) -> dict[str, Any]:
    return {**cfg.data.as_dict(), "seed": cfg.seed}


def layer_kwargs(cfg: Namespace, quantizer: str) -> dict[str, Any]:
    """The ``quantizer_kwargs`` of one run: the ``--<quantizer>.*`` section. The hierarchy (``--model.levels`` > 1)
    builds plain DDCL levels with the model's own defaults (``softvq.models.vqvae.HIERARCHY_DEFAULTS``): it gets only
    the settings given, i.e. those that differ from :class:`~softvq.DDCLQuantizer`'s defaults."""
    section = cfg[quantizer].as_dict()
    if quantizer == "ddcl" and cfg.model.levels > 1:
        defaults = {k: p.default for k, p in inspect.signature(DDCLQuantizer).parameters.items()}
        section = {k: v for k, v in section.items() if v != defaults.get(k)}
    elif quantizer == "ddcl" and cfg.model.temperature_schedule != "constant" \
            and section.get("target_entropy") == "auto":
        del section["target_entropy"]  # a schedule sets T: VQVAE then turns the layer's entropy control off
    return section


def model_kwargs(cfg: Namespace, quantizer: str) -> dict[str, Any]:
    """The :class:`~softvq.models.VQVAE` constructor arguments of one run. The temperature schedule is DDCL's: a hard
    VQ run next to it keeps ``constant``."""
    model = cfg.model.as_dict()
    if quantizer != "ddcl":
        model.update(temperature_schedule="constant", temperature_final=None)
    if quantizer not in RESIDUAL_QUANTIZERS:  # one codebook beside a residual stack of --model.num_quantizers
        model.update(num_quantizers=1)
    return {**model, "quantizer": quantizer, "quantizer_kwargs": layer_kwargs(cfg, quantizer)}


def check_all(cfg: Namespace) -> dict[str, VQVAE]:
    """Every constructor's checks for every run of the command, before the first one starts: a setting that would
    fail the second run fails the command at once. Each ``--<quantizer>.*`` section is checked by its class even when
    that quantizer is not trained, so that a bad value is never silently carried in a config file. The data module is
    only constructed (nothing is read). Returns the VQ-VAE of every ``--quantizer`` (unseeded: for its settings, not
    its weights)."""
    run_options(cfg)
    hardware(cfg)
    CIFAR10DataModule(**data_kwargs(cfg))
    for name, cls in QUANTIZER_CLASSES.items():
        stack = (cfg.model.num_quantizers,) if name in RESIDUAL_QUANTIZERS else ()
        cls(*stack, cfg.model.num_codes, cfg.model.code_dim, **cfg[name].as_dict())
    return {quantizer: VQVAE(**model_kwargs(cfg, quantizer)) for quantizer in cfg.quantizer}


# "auto" values recorded as "auto": the temperature names a rule the layer applies while it trains (set on the first
# batch).
RUNTIME_AUTO = ("temperature",)


def _resolved(given: dict[str, Any], module: Any) -> dict[str, Any]:
    """``given`` with every null or ``"auto"`` replaced by the value ``module`` resolved it to (its attribute of the
    same name), so that config.json says what the run used rather than "the default" (except :data:`RUNTIME_AUTO`)."""
    out = {}
    for key, value in given.items():
        resolved = getattr(module, key, None)
        if is_dataclass(resolved):  # a part's settings (softvq.parts.Restart, NormalInit) as the layer took them
            value = resolved
        elif value is None or (value == "auto" and key not in RUNTIME_AUTO):
            value = getattr(module, key, value)
        out[key] = asdict(value) if is_dataclass(value) else value
    return out


def resolved_config(cfg: Namespace, quantizer: str, model: VQVAE) -> dict[str, Any]:
    """What config.json records of one run: every setting as the run used it, as JSON values.

    Nulls that stand for a default are replaced by the value the constructors chose (e.g. ``model.latent_norm``,
    ``ddcl.standardize``, ``ddcl.target_entropy``); a null that remains means "off" or "not used". ``"auto"`` remains
    only where it names a rule applied in training (:data:`RUNTIME_AUTO`): ``ddcl.temperature`` set on the first
    training batch to the target entropy (``softvq.parts.calibration.calibrate_temperature``). A part's settings
    (``ddcl.restart``) are recorded field by field.
    """
    layer = model._codebooks()[0]  # level 0 of a hierarchy or a residual stack
    section = layer_kwargs(cfg, quantizer) if model.levels == 1 else {
        k: getattr(layer, k) for k in cfg.ddcl.as_dict() if hasattr(layer, k) and not callable(getattr(layer, k))}
    model_section = _resolved(cfg.model.as_dict(), model)
    model_section["target_entropy"] = model.target_entropy
    # "quantizer" as --quantizer takes it (a list), so that the file is a config that reproduces this run alone
    layer_section = _resolved(section, layer)
    if "target_entropy" in layer_section and getattr(layer, "temperature_rate", DEFAULT_RATE) != DEFAULT_RATE:
        layer_section["target_entropy"] = {"target": layer.target_entropy, "rate": layer.temperature_rate}
    if "standardize" in layer_section and hasattr(layer, "standardizer"):  # off, or its settings field by field
        layer_section["standardize"] = False if not layer.standardize else {
            "renorm_clip": list(layer.standardizer.renorm_clip) if layer.renorm else None,
            "output_scale": layer.output_scale}
    if "commitment_weight" in layer_section:  # the weight of the "hard" term, or {weight, term} for another term
        term = getattr(layer, "commitment_term", "hard")
        layer_section["commitment_weight"] = layer.commitment_weight if term == "hard" else {
            "weight": layer.commitment_weight, "term": term}
    config = {"quantizer": [quantizer], **asdict(run_options(cfg)), "data": cfg.data.as_dict(), "model": model_section,
              quantizer: layer_section, "trainer": asdict(hardware(cfg))}
    return json.loads(json.dumps(config, default=str))


def default_values() -> dict[str, Any]:
    """The parser's defaults as dotted keys (what a setting that a run's config.json predates would have been)."""
    return flat(json.loads(json.dumps(build_parser().get_defaults().as_dict(), default=str)))


def flat(config: dict[str, Any], prefix: str = "") -> dict[str, Any]:
    """``{"a": {"b": 1}}`` -> ``{"a.b": 1}``; tuples as lists, so a saved and a fresh config compare alike."""
    out: dict[str, Any] = {}
    for key, value in config.items():
        if isinstance(value, dict):
            out.update(flat(value, f"{prefix}{key}."))
        else:
            out[f"{prefix}{key}"] = list(value) if isinstance(value, tuple) else value
    return out


def config_changes(recorded: dict[str, Any], now: dict[str, Any], ignore: set[str] = frozenset(),
                   defaults: dict[str, Any] | None = None) -> dict[str, list[Any]]:
    """``{dotted key: [recorded, now]}`` for every setting that differs between two resolved configurations, except
    the keys in ``ignore`` and, with ``defaults`` (:func:`default_values`), a key the record does not have (an option
    newer than the run) whose value now is its default. A record's former option names are today's, and a setting it
    predates has the value it had then (:func:`softvq._compat.upgrade_settings`)."""
    a, b = upgrade_settings(flat(recorded)), flat(now)  # a record's former option names, today's (softvq._compat)
    newer = set() if defaults is None else newer_settings(a, b, defaults, _same)  # options newer than the record
    return {k: [a.get(k), b.get(k)] for k in sorted(a.keys() | b.keys())
            if k not in ignore and k not in newer and not _same(a.get(k), b.get(k))}


def _same(a: Any, b: Any) -> bool:
    if isinstance(a, float) and isinstance(b, float):
        return a == b or (math.isnan(a) and math.isnan(b))
    return a == b
