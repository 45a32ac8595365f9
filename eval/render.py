"""Numbers in README.md and docs/ rendered from the results files they come from, never typed by hand.

A rendered block in a markdown file is a pair of comments around generated text:

    <!-- render: peers_test reports/peers/k512_9998ce5/results.json -->
    | bottleneck | seeds | PSNR from hard indices (dB) | ...
    Source: reports/peers/k512_9998ce5/results.json (code 9998ce5; ...)
    <!-- /render -->

The first comment names a renderer (:data:`eval.registry.RENDERERS`, filled by the studies) and its sources, results
files or folders under ``reports/``, repository-relative. Each renderer is the study's own report code (the report and
the README cannot disagree), imported only when a block names it; it draws the table with the helpers here and ends
with ``Source:`` lines: the file, the commits and the setting the numbers were measured at. Where several results files
of one study are named, a method's rows come from the first file that has it, and each ``Source:`` line says which
methods it gave. The flag ``former-defaults`` after the sources (``<!-- render: peers_test
reports/peers/k512_908f6de/results.json former-defaults -->``) marks results whose DDCL rows trained with the defaults
of their commit before the entropy target became ``log(K) / 2`` (:data:`FORMER_DEFAULTS`): their labels say so. The
flag ``vqp-threshold-2`` marks results whose vector-quantize-pytorch ``VectorQuantize`` ran its README's former
recipe, an absolute dead-code threshold of 2 (:data:`FORMER_VQP`; version 1.32 or older), not today's ratio of 0.1.

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

from eval import registry
from eval._provenance import ROOT
from eval.reports import read_header

BLOCK = re.compile(r"(<!-- render: (?P<spec>[^>]*?) -->\n)(?P<body>.*?)(<!-- /render -->)", re.DOTALL)
FILES = ("README.md", "docs/*.md")
FLAGS = ("former-defaults", "vqp-threshold-2")
# what a DDCL row's label adds under ``former-defaults``: the entropy target those runs' defaults held (2.5 nats at
# every K from 149 on, the only sizes the flag marks)
FORMER_DEFAULTS = " at the time (target entropy 2.5 nats)"
DDCL_METHODS = ("ddcl", "rddcl")
# vqp_vq's label under ``vqp-threshold-2``: the recipe of vector-quantize-pytorch's README up to 1.32 (eval._hard)
FORMER_VQP = {"vqp_vq": "vqp VectorQuantize (kmeans init, dead < 2, rotation trick)"}


def labels_of(labels: dict[str, str], flags: Sequence[str]) -> dict[str, str]:
    """``labels`` with each DDCL method's marked as the former defaults' under the flag ``former-defaults``, and
    vector-quantize-pytorch's former recipe named under ``vqp-threshold-2``."""
    if "former-defaults" in flags:
        labels = {k: v + FORMER_DEFAULTS if k in DDCL_METHODS else v for k, v in labels.items()}
    if "vqp-threshold-2" in flags:
        labels = {**labels, **{k: v for k, v in FORMER_VQP.items() if k in labels}}
    return labels


def load(path: Path) -> Any:
    return json.loads(path.read_text(encoding="utf-8"))


def report_commits(source: Path) -> list[str]:
    """The commits of the ``Code:`` line of the report beside ``source`` (its study writes both at once)."""
    report = source.parent / "report.md"
    return read_header(report).commits if report.is_file() else []


def setting_of(settings: dict[str, Any]) -> str:
    images = f"{settings['train_subset']:,}" if settings.get("train_subset") else "all 45,000"
    parts = [f"K = {settings['num_codes']}" if "num_codes" in settings else None,
             f"{settings['epochs']} epochs on {images} training images" if "epochs" in settings else None,
             f"seeds {', '.join(map(str, settings['seeds']))}" if settings.get("seeds") else None]
    return ", ".join(p for p in parts if p)


def source_line(rel: str, commits: Sequence[str], setting: str, split: str, methods: Sequence[str] = ()) -> str:
    """``rel`` is ``"<repository-relative path>|<link from the markdown file>"`` (see :func:`render_block`)."""
    name, link = rel.split("|")
    code = ", ".join(dict.fromkeys(commits)) or "not recorded"
    which = f"{', '.join(methods)}: " if methods else ""
    return f"Source: {which}[{name}]({link}) (code {code}; {setting}; {split} split)."


def merged(sources: Sequence[tuple[Path, str]], setting: Callable[[dict[str, Any]], str],
           split: Callable[[dict[str, Any]], str]) -> tuple[list[dict[str, Any]], list[str]]:
    """The runs of several results files, each method from the first file that has it, and one ``Source:`` line
    per file that gave some."""
    runs: list[dict[str, Any]] = []
    lines: list[str] = []
    for path, rel in sources:
        data = load(path)
        taken = {r["method"] for r in runs}
        new = [r for r in data["runs"] if r["method"] not in taken]
        if new:
            runs += new
            methods = list(dict.fromkeys(r["method"] for r in new)) if len(sources) > 1 else []
            lines.append(source_line(rel, report_commits(path), setting(data["settings"]), split(data["settings"]),
                                     methods))
    return runs, lines


def render_block(spec: str, root: Path = ROOT, where: Path | None = None) -> str:
    """The text of one block (``spec``: a renderer's name and repository-relative sources), ending in a newline;
    links are relative to the folder ``where`` of the markdown file (default: the repository root)."""
    name, *words = spec.split()
    flags = [w for w in words if w in FLAGS]
    rels = [w for w in words if w not in FLAGS]
    if name not in registry.RENDERERS or not rels:
        raise ValueError(f"a render block needs one of {sorted(registry.RENDERERS)} and a source, got {spec!r}")
    sources = []
    for rel in rels:
        path = (root / rel).resolve()
        if root.resolve() not in path.parents or not path.exists():
            raise ValueError(f"render block {spec!r}: {rel!r} is not an existing path inside the repository")
        link = os.path.relpath(path, (where or root).resolve())
        sources.append((path, f"{rel}|{link}"))
    return "\n".join(registry.renderer(name)(sources, flags)) + "\n"


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


def render_files(root: Path = ROOT, only_unedited: bool = False) -> list[Path]:
    """Re-render every page's blocks in place (``only_unedited``: leave alone each page with uncommitted changes, see
    :func:`unedited`); the pages whose text changed."""
    return [path for path in markdown_files(root)
            if not (only_unedited and not unedited(path, root)) and render_file(path, root)]


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
    for path in render_files(root, args.unedited):
        print(f"rendered {path.relative_to(root)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
