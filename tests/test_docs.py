"""The README and docs/ say what the code does: every ```python block runs, every relative link and anchor resolves,
and every docstring that cites a section of docs/ names a heading that exists.

Each Markdown file's ```python blocks run in order in one namespace (a later block may use an earlier one's names), in
a temporary working directory, with a fixed seed. Code meant for users is fenced ```python and so runs here; shell
commands are fenced ```bash or indented, and no other fence language is allowed, so no code can dodge the test.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
FENCE = re.compile(r"^```(\S*)[^\n]*\n(.*?)^```[ \t]*$", re.S | re.M)
LINK = re.compile(r"\[[^\]]*\]\(([^)\s]+)(?:\s+\"[^\"]*\")?\)")
CITE = re.compile(r"docs/(\w+)\.md, [\"']([^\"']+)[\"']")
FENCE_LANGUAGES = {"python", "bash"}


def fenced_blocks(text: str) -> list[tuple[str, str, int]]:
    """``(language, code, line of the opening fence)`` of every fenced block."""
    return [(m.group(1), m.group(2), text.count("\n", 0, m.start()) + 1) for m in FENCE.finditer(text)]


def prose(text: str) -> str:
    """The text outside fenced blocks, indented code blocks and inline code spans (where `](` is not a link)."""
    text = FENCE.sub("", text)
    text = re.sub(r"(?m)^(?: {4}|\t).*$", "", text)
    return re.sub(r"`[^`\n]*`", "", text)


def slug(heading: str) -> str:
    """GitHub's anchor for a heading: lower case, punctuation dropped (``_`` and ``-`` kept), spaces to ``-``."""
    heading = re.sub(r"\[([^\]]*)\]\([^)]*\)", r"\1", heading.strip().lower())  # a link in a heading: its text
    return re.sub(r"[^\w\- ]", "", heading).replace(" ", "-")


def headings(path: Path) -> list[str]:
    """The headings of a Markdown file (outside fenced blocks), as written."""
    return [m.group(1).strip() for m in re.finditer(r"(?m)^#{1,6}\s+(.+?)\s*#*\s*$", FENCE.sub("", path.read_text()))]


def anchors(path: Path) -> set[str]:
    """Every anchor GitHub gives ``path``'s headings, duplicates numbered ``-1``, ``-2``, ... as GitHub does."""
    seen: dict[str, int] = {}
    out = set()
    for heading in headings(path):
        base = slug(heading)
        n = seen.get(base, 0)
        seen[base] = n + 1
        out.add(base if n == 0 else f"{base}-{n}")
    return out


def broken_links(path: Path) -> list[str]:
    """The relative links of a Markdown file whose file, or whose ``#anchor`` in a Markdown file, does not exist."""
    bad = []
    for target in LINK.findall(prose(path.read_text())):
        if re.match(r"[a-z][a-z0-9+.-]*:", target):  # http:, https:, mailto: ...
            continue
        file_part, _, anchor = target.partition("#")
        linked = (path.parent / file_part).resolve() if file_part else path
        if not linked.exists():
            bad.append(f"{target}: no file {linked}")
        elif anchor and linked.suffix == ".md" and anchor not in anchors(linked):
            bad.append(f"{target}: no heading with anchor #{anchor} in {linked.name}")
    return bad


def run_blocks(path: Path) -> int:
    """Run ``path``'s ```python blocks in order in one namespace; returns how many ran."""
    blocks = [(code, line) for language, code, line in fenced_blocks(path.read_text()) if language == "python"]
    namespace: dict = {"__name__": f"docs_{path.stem}"}
    torch.manual_seed(0)
    for code, line in blocks:
        exec(compile(code, f"{path.name}, block at line {line}", "exec"), namespace)
    return len(blocks)


@pytest.mark.parametrize("path", DOCS, ids=lambda p: str(p.relative_to(ROOT)))
def test_python_blocks_run(path, tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)  # a block may write files (torch.save); they land here
    ran = run_blocks(path)
    if path.name == "README.md":
        assert ran >= 1, "the README shows the API in a ```python block"


@pytest.mark.parametrize("path", DOCS, ids=lambda p: str(p.relative_to(ROOT)))
def test_code_is_fenced_as_python_or_bash(path):
    languages = {language for language, _, _ in fenced_blocks(path.read_text())}
    assert languages <= FENCE_LANGUAGES, f"fence languages {languages - FENCE_LANGUAGES}: code is ```python " \
                                         "(and runs in this test), shell ```bash or indented"


@pytest.mark.parametrize("path", DOCS, ids=lambda p: str(p.relative_to(ROOT)))
def test_relative_links_resolve(path):
    assert broken_links(path) == []


def test_docstrings_cite_sections_that_exist():
    sources = [p for folder in ("softvq", "eval", "models", "tests") for p in sorted((ROOT / folder).rglob("*.py"))
               if p.resolve() != Path(__file__).resolve()]
    cited, bad = 0, []
    for source in sources:
        text = source.read_text()
        assert "DESIGN §" not in text, f"{source.relative_to(ROOT)} cites DESIGN, a file not in the repository"
        for doc, section in CITE.findall(text):
            cited += 1
            target = ROOT / "docs" / f"{doc}.md"
            titles = [h.replace("`", "") for h in headings(target)] if target.exists() else []
            if not any(title.startswith(section) for title in titles):
                bad.append(f"{source.relative_to(ROOT)}: docs/{doc}.md has no section {section!r}")
    assert cited > 0 and bad == []


def test_the_link_checker_catches_a_missing_file_and_a_missing_anchor(tmp_path):
    (tmp_path / "other.md").write_text("# Other\n\n## A heading: `with code`\n")
    page = tmp_path / "page.md"
    page.write_text("[ok](other.md#a-heading-with-code) [file](missing.md) [anchor](other.md#nope) [self](#page)\n\n"
                    "# Page\n\n    [not a link](in-an-indented-block.md)\n")
    assert [b.split(":")[0] for b in broken_links(page)] == ["missing.md", "other.md#nope"]


def test_a_failing_block_fails(tmp_path):
    page = tmp_path / "page.md"
    page.write_text("```python\nx = 1\n```\n\ntext\n\n```python\nassert x == 2, 'x is 1'\n```\n")
    with pytest.raises(AssertionError, match="x is 1"):
        run_blocks(page)


def test_no_markdown_cites_a_file_outside_the_repository():
    pages = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md")), *sorted((ROOT / "reports").rglob("*.md"))]
    citing = [str(p.relative_to(ROOT)) for p in pages
              if any(mark in p.read_text() for mark in ("DESIGN §", "shared/DESIGN"))]
    assert citing == [], f"these cite DESIGN, a file not in the repository: {citing}"
