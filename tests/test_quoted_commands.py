"""Every command the README, docs/ and reports/ quote parses with today's command-line parsers: ``softvq-train``,
``-evaluate``, ``-prior``, ``-sample`` (and their scripts ``train_vqvae.py``, ``train_prior.py``, ``sample.py``) and
``python -m eval.*``. Nothing is run: each command's arguments go to its parser only.

Where commands are found: indented and fenced code blocks, and inline code spans, in ``README.md``, ``docs/*.md`` and
``reports/**/*.md``. A shell line is split at ``&&``, ``;``, ``|`` and redirections into commands.

A command that ran at an older commit and is quoted as it was spelled then is written after ``git checkout <commit>
&&`` on its line (``git checkout 62afeb3 && python -m eval.compare ...``): how to run it, and the mark that exempts it
here. ``...`` stands for elided arguments: the values of the flag before it (the flag is then not checked), else
more arguments; a word in capitals or a single letter is a metavariable (``--seed S``, ``--top-k k``), parsed as
``1``; ``[--flag value]`` is an optional group, parsed as if given.

How a command is parsed: the ``softvq-*`` commands by their own parse functions (:func:`softvq.cli.parsing.parse`,
which refuses a former flag by name); an ``eval`` study by running its module as ``__main__`` with
``argparse.ArgumentParser.parse_args`` replaced by one that parses and then stops (:class:`_Parsed`), so the study's
code after its parse never runs.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import io
import re
import runpy
import shlex
import sys
import typing
import warnings
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md")), *sorted((ROOT / "reports").rglob("*.md"))]
FENCE = re.compile(r"^```[^\n]*\n(.*?)^```[ \t]*$", re.S | re.M)
INDENTED = re.compile(r"(?:^(?: {4}|\t)[^\n]*\n?)+", re.M)
SPAN = re.compile(r"(?<!`)`([^`\n]+(?:\n[^`\n]+)*)`(?!`)")  # a span may wrap onto the paragraph's next lines
SCRIPTS = {"train_vqvae.py": "softvq-train", "train_prior.py": "softvq-prior", "sample.py": "softvq-sample"}
COMMANDS = ("softvq-train", "softvq-evaluate", "softvq-prior", "softvq-sample")
OPERATORS = {"&&", "||", ";", "|", "&"}
REDIRECTS = {">", ">>", "<", "2>", "2>>", "&>"}
OLD_COMMIT = re.compile(r"^[0-9a-f]{7,40}$")
PLACEHOLDER = re.compile(r"^(?:[A-Z][A-Z0-9_]*|[a-z])$")


@dataclasses.dataclass(frozen=True)
class Quoted:
    """One quoted command: ``program`` (a ``softvq-*`` name or ``eval.<module>``) and its arguments."""

    page: str
    line: int
    program: str
    args: tuple[str, ...]

    def __str__(self) -> str:
        return f"{self.page}:{self.line}: {self.program} {shlex.join(self.args)}"


def code_texts(text: str) -> Iterator[tuple[str, int]]:
    """``(code, line)`` of every code block and inline code span of a Markdown page (blocks first)."""
    for match in FENCE.finditer(text):
        yield match.group(1), text.count("\n", 0, match.start()) + 2
    rest = FENCE.sub(lambda m: "\n" * m.group(0).count("\n"), text)
    for match in INDENTED.finditer(rest):
        yield match.group(0), rest.count("\n", 0, match.start()) + 1
    prose = INDENTED.sub(lambda m: "\n" * m.group(0).count("\n"), rest)
    for match in SPAN.finditer(prose):
        yield re.sub(r"\s*\n\s*", " ", match.group(1)), prose.count("\n", 0, match.start()) + 1


def shell_lines(code: str, first_line: int) -> Iterator[tuple[list[str], int]]:
    """The shell words of every logical line of ``code`` (``\\``-continued lines joined, comments dropped, a
    variable that an earlier line of the block set, ``S="--epochs 2 ..."``, expanded in the lines after it)."""
    physical = code.split("\n")
    variables: dict[str, str] = {}
    i = 0
    while i < len(physical):
        start, line = i, physical[i]
        while line.rstrip().endswith("\\") and i + 1 < len(physical):
            i += 1
            line = line.rstrip()[:-1] + " " + physical[i]
        i += 1
        for name, value in variables.items():
            line = re.sub(rf"\$(?:{name}\b|{{{name}}})", lambda _, v=value: v, line)
        try:
            words = shlex.split(line, comments=True)
        except ValueError:  # prose in a span (an apostrophe), not a shell line
            continue
        if len(words) == 1 and (assigned := re.match(r"^([A-Za-z_]\w*)=(.*)$", words[0], re.S)):
            variables[assigned.group(1)] = assigned.group(2)
        elif words:
            yield words, first_line + start


def commands_of(words: list[str]) -> Iterator[tuple[str, tuple[str, ...]] | None]:
    """The commands of one shell line as ``(program, args)``; ``None`` for one after ``git checkout <commit>``."""
    old = False
    segment: list[str] = []
    for word in [*words, "&&"]:
        if word not in OPERATORS:
            segment.append(word)
            continue
        while segment and re.match(r"^[A-Z_][A-Z0-9_]*=", segment[0]):  # OMP_NUM_THREADS=1 cmd
            segment = segment[1:]
        if segment[:2] == ["git", "checkout"] and len(segment) == 3 and OLD_COMMIT.match(segment[2]):
            old = True
        found = program_of(segment)
        if found is not None:
            yield None if old else found
        segment = []


def program_of(segment: list[str]) -> tuple[str, tuple[str, ...]] | None:
    """``(program, args)`` of one simple command, or ``None`` when it is not one of the project's commands."""
    if not segment:
        return None
    if segment[0] in COMMANDS:
        program, args = segment[0], segment[1:]
    elif segment[0] in ("python", "python3") and len(segment) > 1 and segment[1] in SCRIPTS:
        program, args = SCRIPTS[segment[1]], segment[2:]
    elif segment[0] in ("python", "python3") and segment[1:2] == ["-m"] and len(segment) > 2 \
            and re.match(r"^eval(?:\.\w+)+$", segment[2]):  # not a pattern (eval.*)
        program, args = segment[2], segment[3:]
    else:
        return None
    if segment == [program]:  # a softvq-* command named in prose, not a command line
        return None
    kept: list[str] = []
    for word in args:
        if word.startswith("[--"):  # an optional group, [--flag value]: its flags must exist all the same
            word = word[1:]
        if word.endswith("]") and not word.startswith("["):
            word = word[:-1]
        if PLACEHOLDER.match(word):  # a metavariable (--seed S, --name NAME, --top-k k)
            word = "1"
        if kept and kept[-1] in REDIRECTS:  # the redirection's file
            kept.pop()
            continue
        if word in REDIRECTS:  # its file is the next word
            kept.append(word)
            continue
        if re.match(r"^\d?>>?\S+$", word):  # >file, 2>&1
            continue
        if word in ("...", "…"):  # elided: the flag's values (the flag goes with them), else more arguments
            if kept and kept[-1].startswith("--"):
                kept.pop()
            continue
        kept.append(word)
    if kept and kept[-1] in REDIRECTS:
        kept.pop()
    return program, tuple(kept)


def quoted_commands(pages: list[Path] = PAGES) -> tuple[list[Quoted], int]:
    """Every quoted command of ``pages`` but the ones marked as run at an older commit, and how many were marked."""
    found, marked = [], 0
    for page in pages:
        name = str(page.relative_to(ROOT)) if page.is_relative_to(ROOT) else page.name
        for code, first in code_texts(page.read_text()):
            for words, line in shell_lines(code, first):
                for command in commands_of(words):
                    if command is None:
                        marked += 1
                    else:
                        found.append(Quoted(name, line, *command))
    return found, marked


class _Parsed(Exception):
    """Raised by the patched ``parse_args`` once a study's arguments parsed: the study goes no further."""


@contextlib.contextmanager
def _stop_after_parsing() -> Iterator[None]:
    original = argparse.ArgumentParser.parse_args

    def parse_then_stop(self, args=None, namespace=None):
        original(self, args, namespace)
        raise _Parsed

    argparse.ArgumentParser.parse_args = parse_then_stop
    try:
        yield
    finally:
        argparse.ArgumentParser.parse_args = original


def _softvq_parser(program: str) -> Callable[[list[str]], object]:
    from softvq.cli import config, evaluate, parsing, prior, sample

    if program == "softvq-train":
        return config.parse
    module = {"softvq-evaluate": evaluate, "softvq-prior": prior, "softvq-sample": sample}[program]
    return lambda args: parsing.parse(module.build_parser(), args)


def parse_error(command: Quoted, empty_config: Path) -> str | None:
    """Why ``command`` does not parse today (the parser's ``error:`` output), or ``None`` when it does."""
    args = list(command.args)
    for i, word in enumerate(args[:-1]):
        if word == "--config":  # the quoted file is the reader's: an empty one stands for it
            args[i + 1] = str(empty_config)
    err = io.StringIO()
    try:
        with contextlib.redirect_stderr(err), contextlib.redirect_stdout(io.StringIO()):
            if command.program.startswith("softvq-"):
                _softvq_parser(command.program)(args)
            else:
                saved = sys.argv
                sys.argv = [command.program, *args]
                try:
                    with _stop_after_parsing(), warnings.catch_warnings():
                        # runpy's note that the module was imported before (by another study): it runs afresh
                        warnings.filterwarnings("ignore", message=".*found in sys.modules", category=RuntimeWarning)
                        runpy.run_module(command.program, run_name="__main__", alter_sys=False)
                finally:
                    sys.argv = saved
                return f"{command.program} returned without parsing its arguments"
    except _Parsed:
        return None
    except SystemExit as stop:
        if stop.code in (0, None):  # --help, --print_config
            return None
        return " / ".join(err.getvalue().strip().splitlines()) or f"exit {stop.code}"
    except ImportError as error:
        return f"no such module: {error}"
    return None


@pytest.fixture(scope="module")
def empty_config(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("config") / "run.yaml"
    path.write_text("{}\n")
    return path


def test_every_quoted_command_parses_today(empty_config):
    commands, marked = quoted_commands()
    assert len(commands) >= 50 and marked > 0  # the extraction found the pages' commands and the marked ones
    failures = [f"{command}\n    -> {why}" for command in commands
                if (why := parse_error(command, empty_config)) is not None]
    assert not failures, f"{len(failures)} of {len(commands)} quoted commands do not parse today (mark one run at " \
                         f"an older commit with 'git checkout <commit> && ...'):\n" + "\n".join(failures)


def test_the_extraction_finds_blocks_spans_continuations_and_variables_and_skips_marked_commands(tmp_path):
    page = tmp_path / "page.md"
    page.write_text(
        "Run `softvq-train --epochs 2\n--out runs/a > log.txt`, then `softvq-evaluate`.\n\n"
        "```bash\nOMP_NUM_THREADS=1 python -m eval.peers --data-root DATA \\\n    --seeds 0 1  # a comment\n```\n\n"
        "    S=\"--epochs 3 --seed 1\"\n    python train_vqvae.py $S --out runs/b\n"
        "    git checkout 62afeb3 && python -m eval.compare --quick\n"
        "    python -m eval.render --check [--only ab] --methods ... --seed S\n")
    commands, marked = quoted_commands([page])
    assert [(c.line, c.program, c.args) for c in commands] == [
        (5, "eval.peers", ("--data-root", "1", "--seeds", "0", "1")),
        (10, "softvq-train", ("--epochs", "3", "--seed", "1", "--out", "runs/b")),
        (12, "eval.render", ("--check", "--only", "ab", "--seed", "1")),
        (1, "softvq-train", ("--epochs", "2", "--out", "runs/a")),
    ]
    assert marked == 1


def _main_job() -> Quoted:
    """The README's main job, as the extraction finds it."""
    return next(c for c in quoted_commands([ROOT / "README.md"])[0] if c.program == "softvq-train")


def test_a_flag_renamed_in_softvq_train_fails_the_readme_main_job(monkeypatch, empty_config):
    """``--epochs`` renamed ``--num_epochs`` in the trainer's settings (its RunOptions dataclass, from which the flag
    is derived): the README's main job, which parses today, is then refused naming the flag."""
    from softvq.cli import config

    main_job = _main_job()
    assert "--epochs" in main_job.args and parse_error(main_job, empty_config) is None
    hints = typing.get_type_hints(config.RunOptions)
    renamed = dataclasses.make_dataclass("RunOptions", [
        ("num_epochs" if f.name == "epochs" else f.name, hints[f.name], dataclasses.field(default=f.default))
        for f in dataclasses.fields(config.RunOptions)])
    monkeypatch.setattr(config, "RunOptions", renamed)
    assert "--epochs" in parse_error(main_job, empty_config)


def test_a_flag_renamed_in_an_eval_study_fails_its_quoted_commands(monkeypatch, empty_config):
    """``--data-root`` renamed ``--data-dir`` in every argparse parser: the quoted ``python -m eval.peers`` commands,
    which parse today, are then refused."""
    peers = [c for c in quoted_commands()[0] if c.program == "eval.peers" and "--data-root" in c.args]
    assert peers and all(parse_error(c, empty_config) is None for c in peers)
    add_argument = argparse.ArgumentParser.add_argument

    def renamed(self, *names, **kwargs):
        return add_argument(self, *("--data-dir" if n == "--data-root" else n for n in names), **kwargs)

    monkeypatch.setattr(argparse.ArgumentParser, "add_argument", renamed)
    assert all("--data-root" in (parse_error(c, empty_config) or "") for c in peers)
