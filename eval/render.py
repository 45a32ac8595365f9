"""Numbers in README.md and docs/ rendered from the results files they come from, never typed by hand.

A rendered block in a markdown file is a pair of comments around generated text:

    <!-- render: peers_test reports/peers/k512_9998ce5/results.json -->
    | bottleneck | seeds | PSNR from hard indices (dB) | ...
    Source: reports/peers/k512_9998ce5/results.json (code 9998ce5; ...)
    <!-- /render -->

The first comment names a renderer (:data:`RENDERERS`) and its sources, results files or folders under ``reports/``,
repository-relative. Each renderer draws the table with the study's own report code (the report and the README cannot
disagree) and ends with ``Source:`` lines: the file, the commits and the setting the numbers were measured at. Where
several results files of one study are named, a method's rows come from the first file that has it, and each
``Source:`` line says which methods it gave. The flag ``former-defaults`` after the sources (``<!-- render: peers_test
reports/peers/k512_908f6de/results.json former-defaults -->``) marks results whose DDCL rows trained with the defaults
of their commit before the entropy target became ``log(K) / 2`` (:data:`FORMER_DEFAULTS`): their labels say so.

    python -m eval.render            # fill every block of README.md and docs/*.md
    python -m eval.render --check    # exit 1 naming every block whose text differs from its source (a test runs it)
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from eval._provenance import ROOT

BLOCK = re.compile(r"(<!-- render: (?P<spec>[^>]*?) -->\n)(?P<body>.*?)(<!-- /render -->)", re.DOTALL)
FILES = ("README.md", "docs/*.md")
FLAGS = ("former-defaults",)
# what a DDCL row's label adds under ``former-defaults``: the entropy target those runs' defaults held (2.5 nats at
# every K from 149 on, the only sizes the flag marks)
FORMER_DEFAULTS = " at the time (target entropy 2.5 nats)"
DDCL_METHODS = ("ddcl", "rddcl")


def _labels(labels: dict[str, str], flags: Sequence[str]) -> dict[str, str]:
    """``labels`` with each DDCL method's marked as the former defaults' under the flag ``former-defaults``."""
    if "former-defaults" not in flags:
        return labels
    return {k: v + FORMER_DEFAULTS if k in DDCL_METHODS else v for k, v in labels.items()}


def _load(path: Path) -> Any:
    return json.loads(path.read_text(encoding="utf-8"))


def _report_commits(source: Path) -> list[str]:
    """The commits of the ``Code:`` line of the report beside ``source`` (its study writes both at once)."""
    from eval.reports import read_header

    report = source.parent / "report.md"
    return read_header(report).commits if report.is_file() else []


def _setting(settings: dict[str, Any]) -> str:
    images = f"{settings['train_subset']:,}" if settings.get("train_subset") else "all 45,000"
    parts = [f"K = {settings['num_codes']}" if "num_codes" in settings else None,
             f"{settings['epochs']} epochs on {images} training images" if "epochs" in settings else None,
             f"seeds {', '.join(map(str, settings['seeds']))}" if settings.get("seeds") else None]
    return ", ".join(p for p in parts if p)


def _source(rel: str, commits: Sequence[str], setting: str, split: str, methods: Sequence[str] = ()) -> str:
    """``rel`` is ``"<repository-relative path>|<link from the markdown file>"`` (see :func:`render_block`)."""
    name, link = rel.split("|")
    code = ", ".join(dict.fromkeys(commits)) or "not recorded"
    which = f"{', '.join(methods)}: " if methods else ""
    return f"Source: {which}[{name}]({link}) (code {code}; {setting}; {split} split)."


def _merged(sources: Sequence[tuple[Path, str]], setting: Callable[[dict[str, Any]], str],
            split: Callable[[dict[str, Any]], str]) -> tuple[list[dict[str, Any]], list[str]]:
    """The runs of several results files, each method from the first file that has it, and one ``Source:`` line
    per file that gave some."""
    runs: list[dict[str, Any]] = []
    lines: list[str] = []
    for path, rel in sources:
        data = _load(path)
        taken = {r["method"] for r in runs}
        new = [r for r in data["runs"] if r["method"] not in taken]
        if new:
            runs += new
            methods = list(dict.fromkeys(r["method"] for r in new)) if len(sources) > 1 else []
            lines.append(_source(rel, _report_commits(path), setting(data["settings"]), split(data["settings"]),
                                 methods))
    return runs, lines


def peers_test(sources: Sequence[tuple[Path, str]], flags: Sequence[str] = ()) -> list[str]:
    """The test table of ``eval.peers`` results files (``eval.peers.report.test_table``)."""
    from eval.harness import LABELS
    from eval.peers.report import group, test_table

    runs, lines = _merged(sources, _setting, lambda s: "test")
    return [*test_table(group(runs), _labels(LABELS, flags)), "", *lines]


def dropin_test(sources: Sequence[tuple[Path, str]], flags: Sequence[str] = ()) -> list[str]:
    """The test table of ``eval.dropin`` results files."""
    from eval.dropin import LABELS, TEST_COLUMNS
    from eval.peers.report import group, test_table

    def setting(s: dict[str, Any]) -> str:
        return f"{s['steps']} steps of {s['batch_size']} images, K = {s['num_codes']}, " \
               f"seeds {', '.join(map(str, s['seeds']))}"

    runs, lines = _merged(sources, setting, lambda s: s.get("split", "test"))
    return [*test_table(group(runs), _labels(LABELS, flags), TEST_COLUMNS), "", *lines]


def long_run_test(sources: Sequence[tuple[Path, str]], flags: Sequence[str] = ()) -> list[str]:
    """Per K, the test table of the long-training study's finished runs (the records in ``<folder>/runs/``)."""
    from eval.long_run.report import _groups, load_records, test_table

    lines: list[str] = []
    for path, rel in sources:
        for k, methods in _groups(load_records(path)).items():
            runs = [r for rs in methods.values() for r in rs]
            commits = [r["code"] for r in runs if r.get("code")]
            settings = {**runs[0]["settings"], "num_codes": k}
            lines += [*test_table(methods), "", _source(rel, commits, _setting(settings), "test"), ""]
    return lines[:-1]


def long_run_curves(sources: Sequence[tuple[Path, str]], flags: Sequence[str] = ()) -> list[str]:
    """Per K, every method's validation hard PSNR after each epoch, the mean over its finished seeds."""
    from eval.long_run.report import _groups, _label, load_records

    lines: list[str] = []
    for path, rel in sources:
        for k, methods in _groups(load_records(path)).items():
            runs = [r for rs in methods.values() for r in rs]
            epochs = max(len(r["history"]) for r in runs)
            lines += [f"| K = {k} | n | " + " | ".join(str(e + 1) for e in range(epochs)) + " |",
                      "|---|---|" + "---|" * epochs]
            for rs in methods.values():
                cells = []
                for e in range(epochs):
                    vals = [r["history"][e].get("val_psnr_hard") for r in rs if len(r["history"]) > e]
                    vals = [v for v in vals if v is not None]
                    cells.append(f"{sum(vals) / len(vals):.2f}" if vals else "–")
                lines.append(f"| {_label(rs[0])} | {len(rs)} | " + " | ".join(cells) + " |")
            settings = {**runs[0]["settings"], "num_codes": k}
            lines += ["", _source(rel, [r["code"] for r in runs if r.get("code")], _setting(settings),
                                  "validation"), ""]
    return lines[:-1]


def generative_test(sources: Sequence[tuple[Path, str]], flags: Sequence[str] = ()) -> list[str]:
    """The long runs' sample-quality study (``eval.sample_quality --long-runs``): its by-method table and its targets'
    verdicts, from its ``results.json``."""
    from eval.sample_quality.long_report import TARGETS_RULE, methods_table, targets_table, trained_at

    lines: list[str] = []
    for path, rel in sources:
        data = _load(path)
        s = data["prior"]["settings"]
        setting = (f"K = {', '.join(str(k) for k in sorted({r['num_codes'] for r in data['rows']}))}, the long runs' "
                   f"final checkpoints; priors of {s['layers']} layers, width {s['dim']}, {s['epochs']} epochs; "
                   f"protocol chosen on validation")
        lines += [*methods_table(data["methods"]), "", *targets_table(data["targets"]), "", TARGETS_RULE, "",
                  _source(rel, [*trained_at(data["rows"]), data["commit"]], setting, "test"), ""]
    return lines[:-1]


# every renderer takes the block's flags; the long run's ignore them: its records name their own methods
# (``ddcl_h25``: the former defaults)
RENDERERS: dict[str, Callable[[Sequence[tuple[Path, str]], Sequence[str]], list[str]]] = {
    "peers_test": peers_test,
    "dropin_test": dropin_test,
    "long_run_test": long_run_test,
    "long_run_curves": long_run_curves,
    "generative_test": generative_test,
}


def render_block(spec: str, root: Path = ROOT, where: Path | None = None) -> str:
    """The text of one block (``spec``: a renderer's name and repository-relative sources), ending in a newline;
    links are relative to the folder ``where`` of the markdown file (default: the repository root)."""
    name, *words = spec.split()
    flags = [w for w in words if w in FLAGS]
    rels = [w for w in words if w not in FLAGS]
    if name not in RENDERERS or not rels:
        raise ValueError(f"a render block needs one of {sorted(RENDERERS)} and a source, got {spec!r}")
    sources = []
    for rel in rels:
        path = (root / rel).resolve()
        if root.resolve() not in path.parents or not path.exists():
            raise ValueError(f"render block {spec!r}: {rel!r} is not an existing path inside the repository")
        link = os.path.relpath(path, (where or root).resolve())
        sources.append((path, f"{rel}|{link}"))
    return "\n".join(RENDERERS[name](sources, flags)) + "\n"


def render_text(text: str, root: Path = ROOT, where: Path | None = None) -> str:
    """``text`` (a markdown file in folder ``where``) with every block's body replaced by what its source gives."""
    return BLOCK.sub(lambda m: m.group(1) + render_block(m.group("spec"), root, where) + m.group(4), text)


def markdown_files(root: Path = ROOT) -> list[Path]:
    return sorted({p for pattern in FILES for p in root.glob(pattern)})


def render_file(path: Path, root: Path = ROOT) -> bool:
    """Re-render the blocks of one markdown file in place; whether its text changed."""
    text = path.read_text(encoding="utf-8")
    new = render_text(text, root, path.parent)
    if new != text:
        path.write_text(new, encoding="utf-8")
    return new != text


def differing(root: Path = ROOT) -> list[str]:
    """``file: spec`` for every block whose text is not what its source gives."""
    out = []
    for path in markdown_files(root):
        for m in BLOCK.finditer(path.read_text(encoding="utf-8")):
            if m.group("body") != render_block(m.group("spec"), root, path.parent):
                out.append(f"{path.relative_to(root)}: {m.group('spec')}")
    return out


def unedited(path: Path, root: Path = ROOT) -> bool:
    """Whether ``path`` has no uncommitted changes in the git repository at ``root`` (False where git cannot tell)."""
    try:
        subprocess.run(["git", "diff", "--quiet", "HEAD", "--", str(path)], cwd=root, check=True,
                       capture_output=True)
        return True
    except (OSError, subprocess.CalledProcessError):
        return False


def main(argv: list[str] | None = None, root: Path = ROOT) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--check", action="store_true", help="exit 1 naming the blocks that differ from their sources")
    p.add_argument("--unedited", action="store_true",
                   help="leave alone every page with uncommitted changes (someone is editing it); a study that "
                        "commits its results runs this and commits the pages it prints")
    args = p.parse_args(argv)
    if args.check:
        stale = differing(root)
        for line in stale:
            print(f"differs from its source: {line}")
        return 1 if stale else 0
    for path in markdown_files(root):
        if args.unedited and not unedited(path, root):
            continue
        if render_file(path, root):
            print(f"rendered {path.relative_to(root)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
