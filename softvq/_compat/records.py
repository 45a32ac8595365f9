"""Models and commands (:mod:`softvq.models`, :mod:`softvq.cli`): a prior's recorded config and hyperparameters, a
run record's settings newer than the run, and each command's former flags (refused, never translated).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from softvq._compat.options import FORMER_OPTIONS


def upgrade_prior_config(config: dict[str, Any]) -> dict[str, Any]:
    """A :class:`softvq.models.CodePrior`'s recorded network config (its ``PriorConfig`` as a mapping) in today's
    fields: one saved before the null class existed has no ``null_class`` and no such start token (``False``)."""
    return {"null_class": False, **config}


def upgrade_prior_hparams(hparams: dict[str, Any]) -> dict[str, Any]:
    """A :class:`softvq.models.CodePrior` checkpoint's hyperparameters in today's: its ``config``
    (:func:`upgrade_prior_config`) and ``soft_targets`` 0.0 (the hard codes alone) for one saved before the option."""
    out = {"soft_targets": 0.0, **hparams}
    if isinstance(out.get("config"), dict):
        out["config"] = upgrade_prior_config(out["config"])
    return out


def newer_settings(recorded: dict[str, Any], now: dict[str, Any], defaults: dict[str, Any],
                   same: Callable[[Any, Any], bool]) -> set[str]:
    """The dotted keys of ``now`` (a run's settings) that its record ``recorded`` predates (options newer than the
    run) and whose value in ``now`` is its default in ``defaults`` (compared by ``same``): what the run used without
    a setting for it, which the caller does not count as a change."""
    return {k for k in now.keys() - recorded.keys() if k in defaults and same(now[k], defaults[k])}


# Each command's flags before the shared convention (docs/training.md, "Commands and config files"), refused with
# the flag that replaced it by softvq.cli (softvq.cli._input.FormerFlags), never parsed: "renames" maps a former
# option to today's; "switches" a former on/off flag to the option that replaced it and the value it stood for
# (None: the new one is a flag too). softvq-train's are its quantizer sections' FORMER_OPTIONS as flags.
FORMER_FLAGS: dict[str, dict[str, dict[str, Any]]] = {
    "softvq-evaluate": {
        "renames": {"--data-root": "--data.data_root", "--batch-size": "--data.batch_size",
                    "--num-workers": "--data.num_workers", "--accelerator": "--trainer.accelerator"},
        "switches": {"--download": ("--data.download", "true"),
                     "--no-progress-bar": ("--trainer.progress_bar", "false")}},
    "softvq-prior": {
        "renames": {"--batch-size": "--batch_size", "--cache-dir": "--codes_cache", "--data-root": "--data.data_root",
                    "--train-subset": "--data.train_subset", "--val-size": "--data.val_size",
                    "--num-workers": "--data.num_workers", "--encode-batch-size": "--data.batch_size",
                    "--label-dropout": "--model.label_dropout", "--layers": "--model.layers",
                    "--heads": "--model.heads", "--dim": "--model.dim", "--mlp-ratio": "--model.mlp_ratio",
                    "--dropout": "--model.dropout", "--lr": "--model.lr", "--weight-decay": "--model.weight_decay",
                    "--warmup-steps": "--model.warmup_steps", "--min-lr-ratio": "--model.min_lr_ratio",
                    "--accelerator": "--trainer.accelerator", "--devices": "--trainer.devices",
                    "--num-nodes": "--trainer.num_nodes", "--strategy": "--trainer.strategy",
                    "--precision": "--trainer.precision"},
        "switches": {"--download": ("--data.download", "true"),
                     "--class-conditional": ("--model.class_conditional", "true"),
                     "--no-progress-bar": ("--trainer.progress_bar", "false")}},
    "softvq-sample": {
        "renames": {"--top-k": "--top_k", "--class": "--label"},
        "switches": {"--allow-other-vqvae": ("--allow_other_vqvae", None)}},
}


def former_flags(prog: str, sections: tuple[str, ...] = ()) -> dict[str, dict[str, Any]]:
    """Command ``prog``'s former flags (:data:`FORMER_FLAGS`; none for a command without), with the former option
    names of its quantizer ``sections`` as flags: ``--ddcl.dead_code_threshold`` was renamed
    ``--ddcl.restart.threshold`` (:data:`FORMER_OPTIONS`)."""
    table = FORMER_FLAGS.get(prog, {})
    renames = {**table.get("renames", {}), **{f"--{section}.{old}": f"--{section}.{new}" for section in sections
                                              for old, new in FORMER_OPTIONS.get(section, {}).items()}}
    return {"renames": renames, "switches": dict(table.get("switches", {}))}
