"""eval.reports: every committed report has its header; staleness is judged from a real git history."""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest
from helpers import json_strings

from eval import reports


def test_every_committed_report_has_its_header(capsys):
    assert reports.main(["--headers"]) == 0, capsys.readouterr().err
    listed = [line for line in capsys.readouterr().out.splitlines() if line.startswith("| reports/")]
    assert len(listed) == len(reports.find_reports(reports.ROOT)) > 10


def test_header_parsing_of_both_layouts(tmp_path):
    inline = tmp_path / "a.md"
    inline.write_text("# T\n\nRegenerate: `python -m eval.peers --seeds 0` (runs kept)\n\n"
                      "Code: report written at abc1234; runs trained at 0123456789abcdef0123456789abcdef01234567+.\n")
    h = reports.read_header(inline)
    assert h.command == "python -m eval.peers --seeds 0"
    assert h.commits == ["abc1234", "0123456789abcdef0123456789abcdef01234567"]  # "+" (dirty) read as the commit
    block = tmp_path / "b.md"
    block.write_text("# T\n\nRegenerate:\n\n    python -m eval.paradigm1 --x 1\n\nCode: unknown\n")
    h = reports.read_header(block)
    assert h.command == "python -m eval.paradigm1 --x 1" and h.commits == [] and not h.complete
    assert reports.status(h, tmp_path) == "no header: no commit on a 'Code:' line"
    assert reports.status(reports.Header(block, None, ["abc1234"]), tmp_path).startswith("no header: no 'Regenerate:'")


def git(repo: Path, *args: str) -> str:
    return subprocess.run(["git", *args], cwd=repo, capture_output=True, text=True, check=True).stdout.strip()


@pytest.fixture
def repo(tmp_path):
    for d in ("softvq", "eval", "reports/peers", "reports/other"):
        (tmp_path / d).mkdir(parents=True)
    git(tmp_path, "init", "-q")
    git(tmp_path, "config", "user.email", "t@t")
    git(tmp_path, "config", "user.name", "t")
    (tmp_path / "softvq" / "layer.py").write_text("x = 1\n")
    (tmp_path / "eval" / "peers").mkdir()  # a study with parts: a package
    (tmp_path / "eval" / "peers" / "__init__.py").write_text("y = 1\n")
    (tmp_path / "eval" / "peers" / "report.py").write_text("r = 1\n")
    (tmp_path / "eval" / "other.py").write_text("z = 1\n")  # a study in one file
    (tmp_path / "eval" / "_spread.py").write_text("s = 1\n")  # a helper of several studies
    git(tmp_path, "add", "-A")
    git(tmp_path, "commit", "-qm", "code")
    return tmp_path


def write_report(repo: Path, name: str, commit: str) -> None:
    (repo / "reports" / name / "report.md").write_text(
        f"# R\n\nRegenerate: `python -m eval.{name} --seeds 0`\n\nCode: {commit}\n")


def test_a_study_is_its_package_or_its_one_file(repo):
    def modules(command: str) -> list[str]:
        return reports.Header(repo / "r.md", command, ["abc1234"]).modules(repo)

    assert modules("python -m eval.peers --seeds 0") == ["eval/peers/"]  # every file of the package
    assert modules("OMP_NUM_THREADS=1 python -m eval.other --x") == ["eval/other.py"]
    assert modules("python -m eval.missing") == [] and modules("python train_vqvae.py --epochs 3") == []


def test_a_retired_study_is_listed_with_the_commit_that_holds_it_and_judged_by_the_library_alone(repo, capsys):
    measured = git(repo, "rev-parse", "--short", "HEAD")
    (repo / "reports" / "other" / "report.md").write_text(
        f"# R\n\nRegenerate: `git checkout {measured} && python -m eval.other --x`\n\nCode: {measured}\n")
    header = reports.read_header(repo / "reports" / "other" / "report.md")
    assert header.retired_at == measured and header.modules(repo) == []  # its module may be gone from the tree
    assert reports.Header(repo / "r.md", "python -m eval.other --x", [measured]).retired_at is None
    git(repo, "add", "-A")
    git(repo, "commit", "-qm", "report")
    (repo / "eval" / "other.py").unlink()  # the study leaves the tree: the report stays fresh
    git(repo, "commit", "-qam", "retire eval.other")
    assert reports.main(["--check"], root=repo) == 0
    row = next(line for line in capsys.readouterr().out.splitlines() if line.startswith("| reports/other/"))
    assert row.endswith(f"| retired (code at {measured}); fresh |")
    (repo / "softvq" / "layer.py").write_text("x = 2\n")  # the library it measured changes: stale, as any report
    git(repo, "commit", "-qam", "library changed")
    assert reports.main(["--check"], root=repo) == 1
    assert f"retired (code at {measured}); stale: softvq changed in" in capsys.readouterr().out


def test_a_report_goes_stale_when_its_study_or_the_library_changes(repo, capsys):
    measured = git(repo, "rev-parse", "--short", "HEAD")
    write_report(repo, "peers", measured)
    write_report(repo, "other", measured)
    git(repo, "add", "-A")
    git(repo, "commit", "-qm", "reports")  # a later commit that only adds reports leaves them fresh
    assert reports.main(["--check"], root=repo) == 0
    (repo / "eval" / "_spread.py").write_text("s = 2\n")  # a shared helper is no study's own module
    git(repo, "commit", "-qam", "helper changed")
    assert reports.main(["--check"], root=repo) == 0
    (repo / "eval" / "peers" / "report.py").write_text("r = 2\n")  # a part of one report's study changes
    git(repo, "commit", "-qam", "peers' report writer changed")
    assert reports.main(["--check"], root=repo) == 1
    out, err = capsys.readouterr()
    assert "stale: softvq / eval/peers/ changed in" in out and "reports/other/report.md" not in err
    assert "1 of 2 reports lack a header or are stale: reports/peers/report.md" in err
    write_report(repo, "peers", git(repo, "rev-parse", "HEAD"))
    (repo / "eval" / "other.py").write_text("z = 2\n")  # a one-file study changes
    git(repo, "commit", "-qam", "other changed")
    assert reports.main(["--check"], root=repo) == 1
    out, err = capsys.readouterr()
    assert "stale: softvq / eval/other.py changed in" in out
    assert "1 of 2 reports lack a header or are stale: reports/other/report.md" in err
    (repo / "softvq" / "layer.py").write_text("x = 2\n")  # the library changes: every report is stale
    git(repo, "commit", "-qam", "library changed")
    assert reports.main(["--check"], root=repo) == 1
    assert "2 of 2 reports" in capsys.readouterr().err
    assert reports.main(["--headers"], root=repo) == 0  # headers are there all along
    write_report(repo, "other", git(repo, "rev-parse", "HEAD"))  # re-measured at today's code
    assert reports.main(["--check"], root=repo) == 1
    assert "1 of 2 reports lack a header or are stale: reports/peers/report.md" in capsys.readouterr().err
    write_report(repo, "peers", "deadbee")
    reports.main(["--check"], root=repo)
    assert "unknown commit deadbee (not in this clone)" in capsys.readouterr().out


def test_no_committed_results_file_holds_an_absolute_path():
    """A record names paths relative to the repository: an absolute one names the machine it ran on."""
    import json
    import re

    absolute = re.compile(r"(?:^|[\s=])/[^\s'\"/]+/")
    files = sorted((reports.ROOT / "reports").rglob("*.json"))
    assert len(files) > 10
    offending = [f"{path.relative_to(reports.ROOT)}: {text[:80]}" for path in files
                 for text in json_strings(json.loads(path.read_text())) if absolute.search(text)]
    assert offending == []


def test_portable_makes_paths_relative_and_leaves_other_text():
    from eval._provenance import ROOT, portable

    record = {"data": str(ROOT.parent / "shared" / "x.tar.gz"), "runs": ROOT / "runs" / "a",
              "command": f"python -m eval.x --out={ROOT}/runs/b --data-root {ROOT.parent}/d/e --seeds 0 1",
              "note": "mean / K, 1/2 of it, a ratio a/b", "values": [1.5, None, {"p": f"{ROOT}/reports/x"}]}
    assert portable(record) == {
        "data": "../shared/x.tar.gz", "runs": "runs/a",
        "command": "python -m eval.x --out=runs/b --data-root ../d/e --seeds 0 1",
        "note": "mean / K, 1/2 of it, a ratio a/b", "values": [1.5, None, {"p": "reports/x"}]}


def test_fingerprints_flag_exactly_the_reports_whose_methods_numerics_changed(tmp_path, monkeypatch, capsys):
    """A refactor that changes no number flags nothing; a toy new default of DDCL flags the DDCL report only."""
    import softvq
    from eval import fingerprint

    for name in ("a", "b"):
        (tmp_path / "reports" / name).mkdir(parents=True)
        (tmp_path / "reports" / name / "report.md").write_text(
            f"# R\n\nRegenerate: `python -m eval.{name} --seeds 0`\n\nCode: abc1234\n")
    store = tmp_path / "reports" / "fingerprints.json"
    prints = fingerprint.today(["ddcl", "hard_ema"])
    assert prints == fingerprint.today(["ddcl", "hard_ema"])  # the same code, the same fingerprint
    fingerprint.record("reports/a/report.md", {"ddcl": [prints["ddcl"]]}, store)
    fingerprint.record("reports/b/report.md", {"hard_ema": [prints["hard_ema"]]}, store)
    assert reports.main(["--check"], root=tmp_path, store=store) == 0
    assert capsys.readouterr().out.count("fresh: the numerics of") == 2

    builders = fingerprint._builders()
    new_default = softvq.parts.Ema(0.98)  # "a new default"
    toy = {**builders, "ddcl": lambda: softvq.DDCLQuantizer(256, 8, prototype_update=new_default)}
    monkeypatch.setattr(fingerprint, "_builders", lambda: toy)
    assert reports.main(["--check"], root=tmp_path, store=store) == 1
    table = capsys.readouterr().out
    assert "| reports/a/report.md | abc1234 |" in table and "stale: the numerics of ddcl changed" in table
    assert "fresh: the numerics of hard_ema are unchanged" in table


def test_the_ddcl_fingerprint_sees_the_recipes_rules_that_depend_on_k():
    """The recipe's entropy target (min(2.5, log K / 2) before, log K / 2 now) and usage decay differ only for some K:
    the fingerprint's layer is at a size where a change of either rule changes it."""
    import math

    import softvq
    from eval import fingerprint

    k = fingerprint._builders()["ddcl"]().num_codes
    today = fingerprint.fingerprint("ddcl")
    layer = softvq.DDCLQuantizer(k, 8)
    target, decay = layer.target_entropy, layer.dead_codes.usage_decay(768)
    same = fingerprint.fingerprint("ddcl", lambda: softvq.DDCLQuantizer(k, 8, target_entropy=target,
                                                                        restart=softvq.Restart(decay=decay)))
    assert same == today  # the rules' values at this size, passed explicitly: the same numerics
    targets = {min(2.5, 0.5 * math.log(k)), 0.5 * math.log(k)}
    assert len(targets) == 2  # the two entropy rules differ here
    assert len({fingerprint.fingerprint("ddcl", lambda t=t: softvq.DDCLQuantizer(k, 8, target_entropy=t))
                for t in targets}) == 2
    decays = {fingerprint.fingerprint("ddcl", lambda d=d: softvq.DDCLQuantizer(k, 8, restart=softvq.Restart(decay=d)))
              for d in (0.9, 0.97)}  # the usage decay's clips: the rule itself sits between them at this size
    assert today not in decays


def test_a_run_published_twice_at_the_same_numerics_adds_its_fingerprint_once(tmp_path, monkeypatch):
    from eval import fingerprint

    prints = iter(["aaaa", "aaaa", "bbbb", "aaaa"])
    monkeypatch.setattr(fingerprint, "fingerprint", lambda name: next(prints))
    store = tmp_path / "fingerprints.json"
    for _ in range(4):
        fingerprint.add("reports/x/report.md", "ddcl", store)
    assert fingerprint.load(store) == {"reports/x/report.md": {"ddcl": ["aaaa", "bbbb"]}}  # each numerics once


def test_the_same_numbers_under_other_names_and_in_another_order_have_the_same_fingerprint():
    """A refactor may rename a layer's state or register it in another order (parts holding what the layer held):
    the fingerprint reads the numbers only."""
    from collections import OrderedDict

    from torch import nn

    import softvq
    from eval import fingerprint

    class Moved(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.inner = softvq.DDCLQuantizer(256, 8)  # the fingerprint's layer

        def forward(self, z):
            return self.inner(z)

        def state_dict(self, *args, **kwargs):
            items = super().state_dict(*args, **kwargs).items()
            return OrderedDict((f"renamed_{k}", v) for k, v in reversed(list(items)))

    assert fingerprint.fingerprint("ddcl", Moved) == fingerprint.fingerprint("ddcl")


def test_the_capped_hard_fingerprint_is_taken_where_the_cap_sets_the_threshold():
    """hard_ema_cap differs from hard_ema only where a quarter of the mean tokens per code is below one token: the
    fingerprint's layer is at such a size, so a change of the cap's rule changes it."""
    import dataclasses

    import softvq
    from eval import fingerprint
    from eval._hard import HARD_RESTART_CAPPED

    k = fingerprint._builders()["hard_ema_cap"]().num_codes
    assert HARD_RESTART_CAPPED.cap * 768 / k < HARD_RESTART_CAPPED.threshold  # 768 tokens a fingerprint batch
    uncapped = dataclasses.replace(HARD_RESTART_CAPPED, cap=None)
    assert fingerprint.fingerprint("hard_ema_cap") != fingerprint.fingerprint(
        "hard_ema_cap", lambda: softvq.HardVQ(k, 8, ema_decay=0.99, restart=uncapped))
