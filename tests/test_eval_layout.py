"""The layout of eval/: one package per study with parts, its command in ``__main__.py``, imports that only go down.

A study with helper modules is a package ``eval/<study>/``: ``__init__.py`` the study, ``__main__.py`` its command
(``python -m eval.<study>``), its parts beside them. A flat private module ``eval/_<name>.py`` is a helper of several
studies; one that a single study uses belongs in that study's package. Parts never import their own package's
``__init__`` (a part that needs something of the study's main module means that thing moves into a part), and no
chain of imports comes back to where it started, counting that importing ``eval.a.b`` from outside ``eval.a`` first
runs ``eval/a/__init__.py``.
"""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
EVAL = ROOT / "eval"


def modules(package: Path) -> dict[str, Path]:
    """Every module of the tree under ``package``, by dotted name (a package by its own name)."""
    out = {}
    for file in sorted(package.rglob("*.py")):
        parts = file.relative_to(package.parent).with_suffix("").parts
        out[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = file
    return out


def import_graph(package: Path) -> dict[str, set[str]]:
    """Module -> the modules of the same tree that importing it runs (imports at the top or inside a function):
    ``from a import b`` is an import of ``a.b`` alone when ``b`` is a module, and importing ``a.b`` from outside the
    package ``a`` also runs ``a`` (its ``__init__``)."""
    found = modules(package)
    graph: dict[str, set[str]] = {}
    for name, file in found.items():
        targets = set()
        for node in ast.walk(ast.parse(file.read_text())):
            if isinstance(node, ast.Import):
                targets |= {a.name for a in node.names if a.name in found}
            elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module in found:
                submodules = {f"{node.module}.{a.name}" for a in node.names} & found.keys()
                targets |= submodules if len(submodules) == len(node.names) else {node.module} | submodules
        # the packages that are already running when name runs: its own and those above it
        own = {".".join(name.split(".")[:i]) for i in range(1, name.count(".") + 2 - (file.name != "__init__.py"))}
        parents = {".".join(t.split(".")[:i]) for t in targets for i in range(1, t.count(".") + 1)}
        graph[name] = (targets | (parents & found.keys()) - own) - {name}
    return graph


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Every import loop, each once, as the path from its smallest module back to it."""
    loops = []

    def walk(start: str, node: str, path: list[str]) -> None:
        for nxt in sorted(graph[node]):
            if nxt == start:
                loops.append(path)
            elif nxt > start and nxt not in path:
                walk(start, nxt, [*path, nxt])

    for start in sorted(graph):
        walk(start, start, [start])
    return loops


def packages() -> list[Path]:
    return sorted(p.parent for p in EVAL.glob("*/__init__.py"))


def top_level_names(tree: ast.Module) -> dict[str, ast.stmt]:
    """The names a module binds at its top level (functions, classes, assignments, imports)."""
    names: dict[str, ast.stmt] = {}
    for node in tree.body:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            names[node.name] = node
        elif isinstance(node, (ast.Assign, ast.AnnAssign)):
            for target in node.targets if isinstance(node, ast.Assign) else [node.target]:
                names.update({n.id: node for n in ast.walk(target) if isinstance(n, ast.Name)})
        elif isinstance(node, (ast.Import, ast.ImportFrom)):
            names.update({(a.asname or a.name).split(".")[0]: node for a in node.names})
    return names


def test_the_graph_sees_a_loop_through_a_package_init_and_an_upward_import(tmp_path):
    fake = tmp_path / "ev"
    (fake / "study").mkdir(parents=True)
    (fake / "__init__.py").write_text("")
    (fake / "study" / "__init__.py").write_text("from ev.study.part import f\n")
    (fake / "study" / "part.py").write_text("def f():\n    from ev.other import g\n")
    (fake / "other.py").write_text("from ev.study.part import f\n")  # runs ev/study/__init__.py first
    graph = import_graph(fake)
    assert graph == {"ev": set(), "ev.study": {"ev.study.part"}, "ev.study.part": {"ev.other"},
                     "ev.other": {"ev.study", "ev.study.part"}}
    assert cycles(graph) == [["ev.other", "ev.study", "ev.study.part"], ["ev.other", "ev.study.part"]]
    (fake / "other.py").write_text("")
    (fake / "study" / "part.py").write_text("from ev.study import f\n")  # a part importing its own __init__
    assert cycles(import_graph(fake)) == [["ev.study", "ev.study.part"]]


def test_no_import_loop_among_the_eval_modules():
    graph = import_graph(EVAL)
    assert "eval.peers.report" in graph["eval.dropin"]  # the graph does see the studies' imports
    assert cycles(graph) == []


TOOLS = {"eval.registry", "eval.reports", "eval.fingerprint", "eval.render"}


def test_render_and_reports_import_no_study():
    """eval.render and eval.reports reach the studies through eval.registry (by module path, imported when a block
    names one), never by an import: what importing them runs is the registry and the shared helpers alone."""
    graph = import_graph(EVAL)
    for tool in ("eval.render", "eval.reports"):
        reached, todo = set(), [tool]
        while todo:
            for nxt in graph[todo.pop()] - reached:
                reached.add(nxt)
                todo.append(nxt)
        # the report tools and the private helpers; anything else under eval/ is a study, a benchmark or the harness
        studies = {m for m in reached if m.count(".") > 1 or not (m.split(".")[1].startswith("_") or m in TOOLS)}
        assert studies == set(), f"{tool} imports {sorted(studies)}"
    assert graph["eval.registry"] == set()


def test_every_registered_renderer_is_its_studys_function():
    from eval import registry

    for name, path in registry.RENDERERS.items():
        module, _, function = path.partition(":")
        assert module.split(".")[1] in {p.name for p in packages()} | {"dropin"}, path  # a study's own code
        assert callable(registry.renderer(name)) and registry.renderer(name).__name__ == function
    with pytest.raises(KeyError, match="no renderer 'nope'; the registry has"):
        registry.renderer("nope")


def test_no_part_imports_its_own_package():
    """A part takes what it needs from other parts (leaves), never from its package's ``__init__`` (even where the
    ``__init__`` does not import that part, so that no loop shows)."""
    bad = [f"{name} imports {name.rsplit('.', 1)[0]}" for name, targets in import_graph(EVAL).items()
           if name.count(".") == 2 and not name.endswith(".__main__") and name.rsplit(".", 1)[0] in targets]
    assert bad == []


def test_every_study_package_has_its_command():
    """``__init__`` with a ``main`` or ``cli`` -> ``__main__.py`` that imports it from the package and calls it."""
    assert len(packages()) >= 4
    for package in packages():
        entry = {"main", "cli"} & top_level_names(ast.parse((package / "__init__.py").read_text())).keys()
        if not entry:
            continue
        main = package / "__main__.py"
        assert main.is_file(), f"{package.relative_to(ROOT)} has {sorted(entry)} but no __main__.py"
        tree = ast.parse(main.read_text())
        imported = {a.name for n in ast.walk(tree) if isinstance(n, ast.ImportFrom)
                    and n.module == f"eval.{package.name}" for a in n.names}
        guards = [n for n in tree.body if isinstance(n, ast.If) and "__main__" in ast.unparse(n.test)]
        assert guards, f"{main.relative_to(ROOT)} runs on import: its call belongs under if __name__ == '__main__'"
        used = {n.id for guard in guards for n in ast.walk(guard) if isinstance(n, ast.Name)}  # called or passed on
        assert imported & entry & used, f"{main.relative_to(ROOT)} does not run eval.{package.name}'s entry point"


def test_every_study_package_runs_as_python_m():
    """``python -m eval.<study> --help`` for every package with a command, in one process (runpy runs the package's
    ``__main__`` as ``-m`` does); each parser names the command a user types."""
    names = [p.name for p in packages() if (p / "__main__.py").is_file()]
    code = ("import contextlib, io, runpy, sys\n"
            f"for name in {names!r}:\n"
            "    sys.argv = [name, '--help']\n"
            "    out = io.StringIO()\n"
            "    with contextlib.redirect_stdout(out):\n"
            "        try:\n"
            "            runpy.run_module(f'eval.{name}', run_name='__main__', alter_sys=True)\n"
            "        except SystemExit as stop:\n"
            "            assert stop.code in (0, None), (name, stop.code)\n"
            "    print(name, '|', out.getvalue().split(chr(10))[0])\n")
    proc = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    usage = dict(line.split(" | ", 1) for line in proc.stdout.splitlines() if " | " in line)
    assert sorted(usage) == sorted(names)
    for name, line in usage.items():
        assert line.startswith(f"usage: python -m eval.{name} "), line


def test_no_flat_helper_of_one_study_is_left():
    """No ``eval/_<study>_<part>.py`` beside a study package, and every flat ``eval/_<name>.py`` serves several
    studies (top-level modules or packages of eval/), else it is a part of the one that uses it."""
    studies = {p.name for p in packages()}
    left = [p.name for p in EVAL.glob("_*.py") if any(p.name.startswith(f"_{s}_") for s in studies)]
    assert left == [], f"flat helpers of a study package: {left}"
    users: dict[str, set[str]] = {}
    for name, targets in import_graph(EVAL).items():
        unit = name.split(".")[1] if name.count(".") else name
        for target in targets:
            if target.count(".") == 1 and target.split(".")[1].startswith("_"):
                users.setdefault(target, set()).add(unit)
    helpers = {f"eval.{p.stem}" for p in EVAL.glob("_*.py") if p.name != "__init__.py"}
    single = {h: sorted(users.get(h, set()) - {h.split(".")[1]}) for h in helpers}
    assert {h: u for h, u in single.items() if len(u) < 2} == {}, "a flat helper that one study uses"


def test_no_package_shadows_one_of_its_parts():
    """A name bound at the top of ``eval/<study>/__init__.py`` that is also a part's name would make
    ``eval.<study>.<part>`` that object, not the module (``paradigm1.clustering`` is a function, so its part is
    ``unsupervised.py``)."""
    bad = []
    for package in packages():
        parts = {p.stem for p in package.glob("*.py")} - {"__init__", "__main__"}
        for name, node in top_level_names(ast.parse((package / "__init__.py").read_text())).items():
            if name not in parts:
                continue
            binds_the_part = isinstance(node, ast.ImportFrom) and node.module == f"eval.{package.name}" and any(
                a.name == name and a.asname in (None, name) for a in node.names)
            if not binds_the_part:
                bad.append(f"eval.{package.name}.{name}")
    assert bad == []
