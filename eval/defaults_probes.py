"""The probes behind the DDCL layer's defaults, on the validation split: each part of the in-layer recipe against its
alternatives, one change at a time from today's defaults, beside the strongest hard VQ and the plain layer.

    python -m eval.defaults_probes --data-root ../shared/data/cifar10-jpeg.tar.gz --out reports/peers

Every probe is one ``python -m eval.probe`` process (the project's VQ-VAE, K = 512 codes of D = 64, 10,000 training
images, **2 epochs**, seed 0), ``--jobs`` at a time with one torch thread each; its ``RESULT`` line (validation
figures of the last epoch, hard indices) is appended to ``<out>/probes.jsonl``, and a probe already there is read,
not rerun. ``<out>/probes.md`` tabulates them with the commands. A probe ranks ideas on one seed and two epochs; it
does not measure a margin. The test split is never read here: the final figure of the chosen defaults (5 epochs, 3
seeds, test split) comes from ``eval.peers`` (``reports/peers/results.json``) and is quoted beside the table.
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

from eval._provenance import code_commit, study_command
from eval._spread import summarize
from softvq.cli.common import run_command
from softvq.models.files import write_atomic

# (name, label, quantizer, quantizer options, VQVAE options); the DDCL variants change one thing from the default.
# The restart options keep the flat names the probes ran (and reports/peers/probes.md quotes) with: eval.probe reads
# them as today's `restart` (softvq._compat).
PROBES: tuple[tuple[str, str, str, dict[str, Any], dict[str, Any]], ...] = (
    ("default", "**the layer's defaults** (`DDCLQuantizer(512, 64)`)", "ddcl", {}, {}),
    ("output_input", "… codes returned on the input's scale", "ddcl", {"output_scale": "input"}, {}),
    ("soft_ema", "… prototypes by the soft (free-energy) EMA", "ddcl", {"prototype_update": "soft_ema"}, {}),
    ("gradient", "… prototypes by the optimizer (Adam, lr / 0.01, free energy)", "ddcl",
     {"prototype_update": "gradient"}, {}),
    ("entropy_1", "… target entropy 1.0 nats", "ddcl", {"target_entropy": 1.0}, {}),
    ("entropy_4", "… target entropy 4.0 nats", "ddcl", {"target_entropy": 4.0}, {}),
    ("commit_hard", "… commitment to the hard code, 0.25", "ddcl",
     {"commitment_term": "hard", "commitment_weight": 0.25}, {}),
    ("no_restart", "… no dead-code restarts", "ddcl", {"dead_code_threshold": 0.0}, {}),
    ("plain", "the plain layer with the model's help (LatentNorm, T 4 held at H = 2.5, prototypes by Adam, soft "
     "output)", "ddcl", {"recipe": "plain", "temperature": 4.0, "dead_code_threshold": 1.0},
     {"latent_norm": "batch", "target_entropy": 2.5}),
    ("hard_ema", "hard VQ, EMA 0.99 + restart 1 (the strongest peer)", "hard",
     {"ema_decay": 0.99, "dead_code_threshold": 1.0}, {}),
)
EPOCHS, SEED = 2, 0


def probe_argv(name: str, quantizer: str, kwargs: dict, model_kwargs: dict, data_root: str) -> list[str]:
    argv = ["--data-root", data_root, "--name", name, "--quantizer", quantizer, "--epochs", str(EPOCHS),
            "--seed", str(SEED)]
    if kwargs:
        argv += ["--kwargs", json.dumps(kwargs)]
    if model_kwargs:
        argv += ["--model-kwargs", json.dumps(model_kwargs)]
    return argv


def read_results(path: Path) -> dict[str, dict[str, Any]]:
    """The validation RESULT lines in ``path`` by probe name (the last one of a name wins)."""
    if not path.is_file():
        return {}
    rows = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    return {r["name"]: r for r in rows if r.get("split") == "validation" and r.get("epochs") == EPOCHS}


def run_probe(argv: list[str], results: Path, log: Path) -> int:
    env = {**os.environ, "OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1"}
    with open(log, "w") as out:
        return subprocess.run([sys.executable, "-m", "eval.probe", *argv, "--results", str(results)], env=env,
                              stdout=out, stderr=subprocess.STDOUT).returncode


def final_figure(peers: Path) -> str | None:
    """DDCL's and the strongest peer's test figures from ``eval.peers``' results (5 epochs, 3 seeds)."""
    if not peers.is_file():
        return None
    runs = json.loads(peers.read_text())["runs"]
    cells = []
    for method, label in (("ddcl", "DDCL defaults"), ("hard_ema", "HardVQ EMA + restart")):
        values = [r["test"]["psnr_hard"] for r in runs if r["method"] == method]
        if values:
            stats = summarize(values)
            cells.append(f"{label} {stats['mean']:.2f} ± {stats['std']:.2f} dB ({len(values)} seeds)")
    return "; ".join(cells) if cells else None


def render(results: dict[str, dict[str, Any]], argv: list[str] | None, data_root: str, peers: Path) -> str:
    base = results.get("default")
    lines = ["# Probes behind the layer's defaults (validation split)", "",
             f"Regenerate: `{study_command('eval.defaults_probes', argv)}` (each probe: the command in its row)", "",
             f"Code: {code_commit()}", "",
             f"Each probe trains the project's VQ-VAE (width 128, 2 residual blocks, K = 512 codes of D = 64, Adam "
             f"3e-4, batch 128) on 10,000 CIFAR-10 images for **{EPOCHS} epochs**, seed {SEED}, and scores the "
             f"5,000 held-out **validation** images from the hard indices (the test split is not read). The DDCL "
             f"variants change one option of today's defaults. One seed and two epochs rank ideas; they do not "
             f"measure a margin. Raw lines: [probes.jsonl](probes.jsonl).", "",
             "| probe | command (`python -m eval.probe ...`) | val PSNR from hard indices | vs the defaults | "
             "val util % | val perplexity |", "|---|---|---|---|---|---|"]
    for name, label, quantizer, kwargs, model_kwargs in PROBES:
        r = results.get(name)
        argv_p = shlex.join(probe_argv(name, quantizer, kwargs, model_kwargs, data_root)[2:])  # no --data-root
        if r is None:
            lines.append(f"| {label} | `{argv_p}` | not run | | | |")
            continue
        diff = "" if base is None or name == "default" else f"{r['val_psnr_hard'] - base['val_psnr_hard']:+.2f}"
        lines.append(f"| {label} | `{argv_p}` | {r['val_psnr_hard']:.2f} | {diff} | {100 * r['val_util']:.1f} | "
                     f"{r['val_ppl']:.0f} |")
    lines += ["", "What the table says:", ""]
    ddcl = {name: results[name] for name, _, q, _, _ in PROBES if q == "ddcl" and name in results and name != "plain"}
    if base is not None and ddcl:
        best = max(ddcl, key=lambda n: ddcl[n]["val_psnr_hard"])
        if best == "default":
            lines.append("- No one-option change of the defaults beats them on validation: the defaults are kept.")
        else:
            lines.append(f"- `{best}` beats the defaults by {ddcl[best]['val_psnr_hard'] - base['val_psnr_hard']:+.2f} "
                         f"dB on validation (one seed, two epochs): a candidate, not yet a default, until a 5-epoch, "
                         f"3-seed validation run confirms it beyond the seed spread.")
        worse = sorted((n for n in ddcl if n != "default"), key=lambda n: ddcl[n]["val_psnr_hard"])
        lines.append("- Each change from the defaults, in dB of validation PSNR: " + ", ".join(
            f"{n} {ddcl[n]['val_psnr_hard'] - base['val_psnr_hard']:+.2f}" for n in worse) + ".")
    figure = final_figure(peers)
    if figure:
        lines += [f"- The final figure of the defaults (test split, read once, 5 epochs, [report.md](report.md)): "
                  f"{figure}."]
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> dict[str, Any]:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--data-root", default="data", help="CIFAR-10 directory or .tar.gz archive")
    p.add_argument("--out", type=Path, default=Path("reports/peers"), help="where probes.jsonl and probes.md go")
    p.add_argument("--only", nargs="+", choices=[name for name, *_ in PROBES], default=None,
                   help="run these probes only (default: all)")
    p.add_argument("--jobs", type=int, default=2, help="probes at a time, one torch thread each")
    p.add_argument("--no-train", action="store_true", help="only render the probes already in probes.jsonl")
    p.add_argument("--logs", type=Path, default=Path("runs/defaults_probes"), help="each probe's output")
    args = p.parse_args(argv)
    if args.jobs < 1:
        p.error(f"--jobs must be positive, got {args.jobs}")
    args.out.mkdir(parents=True, exist_ok=True)
    results_path = args.out / "probes.jsonl"
    done = read_results(results_path)
    todo = [spec for spec in PROBES if spec[0] not in done and (args.only is None or spec[0] in args.only)]
    if todo and not args.no_train:
        logs = args.logs
        logs.mkdir(parents=True, exist_ok=True)
        with ThreadPoolExecutor(args.jobs) as pool:
            codes = list(pool.map(lambda s: (s[0], run_probe(probe_argv(s[0], s[2], s[3], s[4], args.data_root),
                                                             results_path, logs / f"{s[0]}.log")), todo))
        failed = [name for name, code in codes if code != 0]
        if failed:
            raise RuntimeError(f"probes failed: {failed}; their logs are in {logs}")
    results = read_results(results_path)
    write_atomic(args.out / "probes.md", render(results, argv, str(args.data_root), args.out / "results.json"))
    return results


if __name__ == "__main__":
    sys.exit(run_command(main))
