"""The README's main job as a report: what its first command printed and drew, on a stated machine, in stated time.

    softvq-train ... --out runs/cifar10           # the README's main job (its first command, after the setup)
    python -m eval.main_job --run runs/cifar10 --seconds 262 --threads 2

reads the finished run directory's ``comparison.md`` (the per-epoch table the command printed) and
``comparison.png`` (its curves) and writes ``report.md`` into ``--out`` (default ``reports/main_job``), the table in it
and the plot beside it: the command, the commit, the machine and the wall time (measured around the command by
whoever ran it: the run directory holds the training epochs' times only). The README shows the table and the plot
through the render block ``<!-- render: main_job reports/main_job -->`` (:func:`render_table`), so the two cannot
disagree.
"""

from __future__ import annotations

import argparse
import shutil
from collections.abc import Sequence
from pathlib import Path

import torch

from eval._provenance import ROOT, code_commit, cpu_model
from eval.render import report_commits

OUT = ROOT / "reports" / "main_job"
COMMAND = ("softvq-train --quantizer ddcl hard --hard.ema_decay 0.99 --hard.restart.threshold 1 "
           "--hard.restart.decay 0.99 --hard.restart.cap null --epochs 3 --data.train_subset 10000 "
           "--data.data_root ../shared/data/cifar10-jpeg.tar.gz --out runs/cifar10")
SETTING = "K = 512, 3 epochs on 10,000 training images, seed 0"
FILES = ("comparison.md", "comparison.png")


def table_lines(text: str) -> list[str]:
    """The markdown table of a ``comparison.md`` (its lines that start with ``|``)."""
    lines = [line for line in text.splitlines() if line.startswith("|")]
    if len(lines) < 3:
        raise ValueError("comparison.md holds no table (a header, its rule and at least one epoch row)")
    return lines


def write_report(run: Path, seconds: float, threads: int, out: Path = OUT, commit: str | None = None) -> str:
    """``out/report.md`` (returned) with the run's comparison table, and its plot copied beside it."""
    missing = [name for name in FILES if not (run / name).is_file()]
    if missing:
        raise FileNotFoundError(f"{run} is not a finished main-job run directory: no {', '.join(missing)}")
    if seconds <= 0 or threads < 1:
        raise ValueError(f"--seconds must be positive and --threads at least 1, got {seconds} and {threads}")
    table = table_lines((run / "comparison.md").read_text(encoding="utf-8"))
    out.mkdir(parents=True, exist_ok=True)
    shutil.copyfile(run / "comparison.png", out / "comparison.png")
    minutes, rest = divmod(round(seconds), 60)
    text = "\n".join([
        "# The README's main job: DDCL against hard VQ with EMA + restart, 3 epochs on 10,000 images", "",
        f"Regenerate: `{COMMAND}` (the README's first command, after its setup; then `python -m eval.main_job --run "
        f"runs/cifar10 --seconds {seconds:.0f} --threads {threads}` with its measured wall time)", "",
        f"Code: {commit or code_commit()}", "",
        f"{SETTING} (the command's default), 5,000 held-out training images as the validation split; {cpu_model()} "
        f"({torch.backends.cpu.get_cpu_capability()}), "
        f"{threads} torch thread{'s' if threads > 1 else ''}, other jobs paused: {minutes} min {rest:02d} s for the "
        "whole command (data unpacked beforehand, install not counted). Codebook health on the validation split; "
        "restarts are the training epoch's; PSNR from the hard indices (the soft decode in brackets). The table is "
        "the command's `comparison.md`, the plot its `comparison.png`.", "",
        *table, "", "![per-epoch curves of both runs](comparison.png)", ""])
    (out / "report.md").write_text(text, encoding="utf-8")
    return text


def render_table(sources: Sequence[tuple[Path, str]], flags: Sequence[str]) -> list[str]:
    """The README block: the report's table and plot, and where they came from (the report's commit and setting)."""
    (folder, rel), = sources
    name, link = rel.split("|")
    text = (folder / "report.md").read_text(encoding="utf-8")
    table, report = table_lines(text), text.splitlines()
    timing = next((line for line in report if " min " in line and "thread" in line), "")
    when = timing.split(": ")[-1].split(" (")[0] if timing else "time not recorded"
    code = ", ".join(report_commits(folder / "report.md")) or "not recorded"
    return [*table, "", f"![per-epoch curves of both runs]({link}/comparison.png)", "",
            f"Source: [{name}]({link}/report.md) (code {code}; {SETTING}; validation split; {when})."]


def main(argv: Sequence[str] | None = None) -> None:
    p = argparse.ArgumentParser(prog="python -m eval.main_job", description=__doc__.split("\n\n")[0])
    p.add_argument("--run", type=Path, required=True, help="the main job's finished --out directory")
    p.add_argument("--seconds", type=float, required=True, help="the command's measured wall time")
    p.add_argument("--threads", type=int, required=True, help="the torch threads it ran with")
    p.add_argument("--out", type=Path, default=OUT)
    p.add_argument("--commit", default=None, help="the commit the command ran at (default: HEAD, + if edited)")
    args = p.parse_args(argv)
    print(write_report(args.run, args.seconds, args.threads, args.out, args.commit))
