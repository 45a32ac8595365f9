"""Every committed report, the code commit it was measured at, and whether that code has changed since.

    python -m eval.reports            # list: report, recorded commit, command, status
    python -m eval.reports --check    # exit 1 if a report lacks its header or its code changed after it ran
    python -m eval.reports --headers  # exit 1 only if a report lacks its header (what CI runs: no history needed)

A report (any ``reports/**/*.md``) starts with a header of two lines:

    Regenerate: `python -m eval.<study> ...`     (or ``Regenerate:`` followed by the command, indented)
    Code: <commit> ...                          (every commit the numbers came from: the runs', the report's)

A report with fingerprints (``reports/fingerprints.json``, :mod:`eval.fingerprint`: per report, a hash of a tiny
fixed training run of each method its numbers come from, taken at its commits) is **stale** exactly when today's code
gives one of those methods another fingerprint: a refactor that changes no number flags nothing, a new default flags
the reports of the methods that use it. The print is the same on every CPU, so is the verdict. A report whose records
name no method carries every method's prints (``--backfill-fingerprints``). A report without prints (one committed
since the last backfill) is **stale** when ``softvq/`` or its study's own modules
(every file of the package ``eval/<study>/`` when the study is one, else ``eval/<study>.py``) changed in a commit
that is not an ancestor of (or equal to) every commit its ``Code:`` line names: its numbers may not be what today's
code gives. A commit this clone does not have (a shallow
clone, another repository) is reported as unknown, not stale. ``+`` after a commit (uncommitted changes when the
study ran) is read as that commit.

A finished one-off study leaves the tree and keeps its report: the report's command starts ``git checkout <commit> &&``
(the commit that holds the study's code), and the list marks it ``retired`` beside the same verdict as any report's
(judged by its fingerprints, or by ``softvq/`` alone).
"""

from __future__ import annotations

import argparse
import json
import re
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from eval._provenance import ROOT, git

REGENERATE = re.compile(r"^Regenerate:\s*(.*)$")
CODE = re.compile(r"^Code:\s*(.*)$")
COMMIT = re.compile(r"(?<![0-9a-zA-Z])[0-9a-f]{7,40}(?![0-9a-zA-Z])")
STUDY = re.compile(r"python -m (eval\.[A-Za-z_0-9]+)")
RETIRED = re.compile(r"^git checkout ([0-9a-f]{7,40}) && ")  # a retired study's command: its code is at that commit
HEADER_LINES = 40  # the header sits at the top; a "Code:" line further down is a table's, not the report's


@dataclass
class Header:
    path: Path
    command: str | None
    commits: list[str]

    @property
    def complete(self) -> bool:
        return bool(self.command) and bool(self.commits)

    @property
    def retired_at(self) -> str | None:
        """The commit that holds a retired study's code (its command starts ``git checkout <commit> &&``), else
        ``None``."""
        match = RETIRED.match(self.command or "")
        return match.group(1) if match else None

    def modules(self, root: Path) -> list[str]:
        """The study's own modules, repository-relative: its package ``eval/<study>/`` (all of its files: the study,
        its command, its report writer and other parts) when it is one, else the single file ``eval/<study>.py``."""
        match = STUDY.search(self.command or "")
        if not match or self.retired_at:  # a retired study's modules are not in the tree
            return []
        name = match.group(1).split(".", 1)[1]
        if (root / "eval" / name / "__init__.py").is_file():
            return [f"eval/{name}/"]
        return [f"eval/{name}.py"] if (root / "eval" / f"{name}.py").is_file() else []


def read_header(path: Path) -> Header:
    """The ``Regenerate:`` command and the commits of the ``Code:`` line in the first lines of ``path``."""
    lines = path.read_text(encoding="utf-8").splitlines()[:HEADER_LINES]
    command, commits = None, []
    for i, line in enumerate(lines):
        if command is None and (m := REGENERATE.match(line)):
            text = m.group(1).strip()
            if not text:  # the command on the next indented line
                text = next((nxt.strip() for nxt in lines[i + 1:] if nxt.startswith("    ")), "")
            command = text.split("`")[1] if text.count("`") >= 2 else text
        elif not commits and (m := CODE.match(line)):
            commits = COMMIT.findall(m.group(1))
    return Header(path, command or None, commits)


def find_reports(root: Path) -> list[Path]:
    return sorted((root / "reports").rglob("*.md"))


def last_change(paths: list[str], root: Path) -> str | None:
    """The newest commit that touched any of ``paths`` (``None``: none did)."""
    return git("log", "-1", "--format=%H", "--", *paths, cwd=root) or None


def known(commit: str, root: Path) -> bool:
    try:
        git("cat-file", "-e", f"{commit}^{{commit}}", cwd=root)
    except subprocess.CalledProcessError:
        return False
    return True


def is_ancestor(older: str, newer: str, root: Path) -> bool:
    """``older`` is ``newer`` or one of its ancestors."""
    return subprocess.run(["git", "merge-base", "--is-ancestor", older, newer], cwd=root).returncode == 0


def status(header: Header, root: Path = ROOT, prints: dict[str, list[str]] | None = None,
           current: dict[str, Any] | None = None) -> str:
    """``"fresh"``, ``"no header: ..."``, ``"unknown commit ..."`` or ``"stale: ..."``.

    With ``prints`` (the report's stored fingerprints, :mod:`eval.fingerprint`) and ``current`` (today's), the
    report is judged by its methods' numerics: stale exactly when one of them changed, whatever else did. Without,
    by the code's history (the module docstring's rule)."""
    if not header.command:
        return "no header: no 'Regenerate:' line"
    if not header.commits:
        return "no header: no commit on a 'Code:' line"
    if prints and current is not None:
        from eval.fingerprint import stale_methods

        changed = stale_methods(prints, current)
        if changed:
            return f"stale: the numerics of {', '.join(changed)} changed (fingerprints)"
        return f"fresh: the numerics of {', '.join(sorted(prints))} are unchanged (fingerprints)"
    missing = [c for c in header.commits if not known(c, root)]
    if missing:
        return f"unknown commit {', '.join(missing)} (not in this clone)"
    watched = ["softvq", *header.modules(root)]
    change = last_change(watched, root)
    if change is None:
        return "fresh"
    behind = [c for c in header.commits if not is_ancestor(change, c, root)]
    if behind:
        return f"stale: {' / '.join(watched)} changed in {change[:7]}, after {', '.join(behind)}"
    return "fresh"


def backfill_record_fingerprints(records: Path, work: Path, refresh: bool = False) -> bool:
    """Give each record in ``records`` (``runs/*.json`` of a study that logs every start of a run, as
    :mod:`eval.long_run` does) the ``fingerprints`` of its method at the commits its run was started or resumed at
    (each start's own ``fingerprint`` too); whether there were such records. A record that holds them already is left
    as it is, unless ``refresh`` (the fingerprint itself changed)."""
    from eval import fingerprint

    found = False
    for path in sorted(records.glob("*.json")):
        rec = json.loads(path.read_text())
        name = fingerprint.canonical(rec.get("method", ""))
        commits = [i["code"].rstrip("+") for i in rec.get("invocations", []) if i.get("code")]
        if not name or not commits:
            continue
        found = True
        if (rec.get("fingerprints") and not refresh) or not all(known(c, ROOT) for c in commits):
            continue
        at = {c: fingerprint.at_commit(c, [name], work)[name] for c in dict.fromkeys(commits)}
        for start in rec.get("invocations", []):
            if start.get("code"):
                start["fingerprint"] = at[start["code"].rstrip("+")]
        rec["fingerprints"] = sorted({p for p in at.values() if p})
        path.write_text(json.dumps(rec, indent=1) + "\n")
    return found


def report_fingerprints(records: Path, stored: dict[str, list[str]]) -> dict[str, list[str]]:
    """Per fingerprinted method, the fingerprints its records in ``records`` were trained with (each record's
    ``fingerprints``, one per start or resume of its run): a run trained again replaces its record, and so its
    prints. A method with a record from before records held them keeps its ``stored`` prints."""
    from eval import fingerprint

    prints: dict[str, set[str]] = {}
    older: set[str] = set()
    for path in sorted(records.glob("*.json")):
        rec = json.loads(path.read_text())
        name = fingerprint.canonical(rec.get("method", ""))
        if name is None:
            continue
        if rec.get("fingerprints"):
            prints.setdefault(name, set()).update(rec["fingerprints"])
        else:
            older.add(name)
    for name in older:
        prints.setdefault(name, set()).update(stored.get(name, []))
    return {m: sorted(v) for m, v in prints.items() if v}


def backfill_fingerprints(work: Path, store: Path | None = None, refresh: bool = False) -> None:
    """Record, for every committed report, the fingerprints of the methods its numbers come from at the commits on its
    ``Code:`` line (the report's runs and its writing): what ``eval.reports --check`` compares today's code with. A
    report whose records name no fingerprinted method is charged with every method's (its numbers may come from any
    of the bottlenecks): judged by numerics all the same, it is not flagged by a change that moves no number. A
    study whose records log the commit of every start of their run (:mod:`eval.long_run`) gets each record's own
    prints instead (:func:`backfill_record_fingerprints`), so that a method is not charged with the commits only
    another method's runs were trained at. A report that holds prints already is left as it is, unless ``refresh``
    (the fingerprint itself changed)."""
    from eval import fingerprint

    store = store or fingerprint.STORE
    for report in find_reports(ROOT):
        key = report.relative_to(ROOT).as_posix()
        if fingerprint.load(store).get(key) and not refresh:
            continue
        if backfill_record_fingerprints(report.parent / "runs", work, refresh):
            fingerprint.record(key, report_fingerprints(report.parent / "runs", fingerprint.load(store).get(key, {})),
                               store)
            print(f"{report.relative_to(ROOT)}: per record", flush=True)
            continue
        names = fingerprint.report_methods(report) or fingerprint.methods()
        commits = [c for c in read_header(report).commits if known(c, ROOT)]
        if not commits:
            continue
        prints: dict[str, list[str]] = {m: [] for m in names}
        for commit in dict.fromkeys(commits):
            for m, value in fingerprint.at_commit(commit, names, work).items():
                if value is not None:
                    prints[m].append(value)
        fingerprint.record(report.relative_to(ROOT).as_posix(), {m: v for m, v in prints.items() if v}, store)
        print(f"{report.relative_to(ROOT)}: {len(commits)} commit(s), {names}", flush=True)


def main(argv: list[str] | None = None, root: Path = ROOT, store: Path | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter, epilog=__doc__)
    mode = p.add_mutually_exclusive_group()
    mode.add_argument("--check", action="store_true", help="exit 1 on a missing header or a stale report")
    mode.add_argument("--headers", action="store_true", help="exit 1 on a missing header only (no git history read)")
    mode.add_argument("--backfill-fingerprints", metavar="WORKDIR", type=Path,
                      help="record every report's fingerprints at the commits on its Code: line (git worktrees of "
                           "them under WORKDIR) in reports/fingerprints.json")
    p.add_argument("--refresh", action="store_true",
                   help="with --backfill-fingerprints: take every print again, also those already recorded (after a "
                        "change of the fingerprint itself)")
    args = p.parse_args(argv)
    if args.backfill_fingerprints:
        backfill_fingerprints(args.backfill_fingerprints, refresh=args.refresh)
        return 0
    reports = find_reports(root)
    if not reports:
        print(f"error: no reports under {root / 'reports'}", file=sys.stderr)
        return 1
    bad = []
    stored, current = {}, None
    if not args.headers:  # the numerics' fingerprints: stored per report, today's computed once
        from eval import fingerprint

        stored = fingerprint.load(store or root / "reports" / "fingerprints.json")
        if stored:
            current = fingerprint.runs(sorted({m for prints in stored.values() for m in prints}))
    print("| report | commit(s) | command | status |\n|---|---|---|---|")
    for path in reports:
        header = read_header(path)
        if args.headers:
            state = "header present" if header.complete else status(header, root)
        else:
            state = status(header, root, stored.get(path.relative_to(root).as_posix()), current)
        failing = not header.complete if args.headers else not state.startswith(("fresh", "unknown commit"))
        bad += [path] if failing else []
        state = f"retired (code at {header.retired_at}); {state}" if header.retired_at else state
        command = (header.command or "-").replace("|", "\\|")
        print(f"| {path.relative_to(root)} | {', '.join(header.commits) or '-'} | `{command}` | {state} |")
    if (args.check or args.headers) and bad:
        what = "lack a header" if args.headers else "lack a header or are stale"
        print(f"\n{len(bad)} of {len(reports)} reports {what}: "
              f"{', '.join(str(p.relative_to(root)) for p in bad)}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
