"""The package as a user installs it: a wheel, installed outside the repository, whose console scripts train and
evaluate; and the library core importable without the extras.

The wheel's virtual environment reuses this environment's third-party packages (torch is not reinstalled) through a
path entry, which adds their directory to ``sys.path`` without running the ``.pth`` hooks in it, so the repository's
editable install is not visible there: whatever ``softvq`` it imports comes from the wheel.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import site
import subprocess
import sys
import sysconfig
import zipfile
from importlib import metadata
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
EXTRAS = ("lightning", "torchvision", "tensorboard", "matplotlib", "einops", "tqdm", "jsonargparse", "scipy",
          "sklearn", "vector_quantize_pytorch", "PIL")


def requirement_closure(*names: str) -> list[metadata.Distribution]:
    """The installed distributions ``names`` need (their non-optional requirements, recursively)."""
    seen: dict[str, metadata.Distribution] = {}
    todo = list(names)
    while todo:
        name = re.split(r"[ ;<>=!~\[(]", todo.pop(), maxsplit=1)[0].lower().replace("_", "-")
        if name in seen:
            continue
        try:
            dist = metadata.distribution(name)
        except metadata.PackageNotFoundError:
            continue  # a marker-excluded requirement (another platform or Python)
        seen[name] = dist
        todo += [r for r in dist.requires or [] if "extra ==" not in r]
    return list(seen.values())


def core_only_site(directory: Path) -> Path:
    """A directory of links to the files of torch, torchmetrics and what they require, nothing else."""
    directory.mkdir()
    for dist in requirement_closure("torch", "torchmetrics"):
        for file in dist.files or []:
            top = file.parts[0]
            source = Path(dist.locate_file(top))
            if ".." in file.parts or top == "__pycache__":  # files outside site-packages (scripts), caches
                continue
            if source.exists() and not (directory / top).exists():
                (directory / top).symlink_to(source)
    return directory


TINY = ["--epochs", "1", "--data.batch_size", "16", "--data.train_subset", "32", "--data.val_size", "16",
        "--data.num_workers", "0", "--model.num_codes", "8", "--model.code_dim", "4", "--model.width", "8",
        "--model.res_hidden", "4", "--model.res_blocks", "1", "--trainer.accelerator", "cpu",
        "--trainer.progress_bar", "false"]


@pytest.fixture(scope="module")
def wheel(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("wheel")
    # Built from a copy of what the wheel is made of, so that setuptools' build/ never lands in the repository.
    source = tmp_path_factory.mktemp("source")
    shutil.copytree(ROOT / "softvq", source / "softvq", ignore=shutil.ignore_patterns("__pycache__"))
    for name in ("pyproject.toml", "README.md"):
        shutil.copy(ROOT / name, source / name)
    subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q", "-w", str(out),
                    str(source)], check=True, capture_output=True, text=True)
    (path,) = out.glob("softvq-*.whl")
    return path


@pytest.fixture(scope="module")
def installed(wheel, tmp_path_factory) -> Path:
    """A fresh virtual environment outside the repository holding the wheel; returns its bin/ directory."""
    env = tmp_path_factory.mktemp("venv") / "env"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(env)], check=True)
    bin_dir = env / ("Scripts" if os.name == "nt" else "bin")
    purelib = Path(subprocess.run([str(bin_dir / "python"), "-c", "import sysconfig; print(sysconfig.get_paths()"
                                   "['purelib'])"], check=True, capture_output=True, text=True).stdout.strip())
    deps = [sysconfig.get_paths()["purelib"], *site.getsitepackages()]
    (purelib / "_softvq_test_deps.pth").write_text("\n".join(dict.fromkeys(deps)) + "\n")
    subprocess.run([sys.executable, "-m", "pip", "--python", str(bin_dir / "python"), "install", "--no-deps",
                    "--no-index", "-q", str(wheel)], check=True, capture_output=True, text=True)
    return bin_dir


def test_wheel_holds_only_the_softvq_package(wheel):
    names = zipfile.ZipFile(wheel).namelist()
    top = {n.split("/")[0] for n in names if not n.startswith("softvq-")}
    assert top == {"softvq"}, top  # no generic top-level `models` or `eval` in site-packages
    for module in ("softvq/models/vqvae.py", "softvq/cli/train.py", "softvq/cli/evaluate.py", "softvq/data/cifar10.py"):
        assert module in names
    entry_points = next(n for n in names if n.endswith("entry_points.txt"))
    scripts = zipfile.ZipFile(wheel).read(entry_points).decode()
    for command in ("softvq-train", "softvq-evaluate", "softvq-prior", "softvq-sample"):
        assert f"{command} = softvq.cli." in scripts


def test_installed_wheel_trains_and_evaluates_through_its_commands(installed, tiny_cifar, tmp_path):
    cwd = tmp_path / "elsewhere"  # outside the repository: nothing of the clone is importable from here
    cwd.mkdir()
    where = subprocess.run([str(installed / "python"), "-c", "import softvq, softvq.models; print(softvq.__file__); "
                            "print(softvq.models.VQVAE.__module__)"], cwd=cwd, check=True, capture_output=True,
                           text=True).stdout.split()
    assert str(ROOT) not in where[0] and "site-packages" in where[0], where
    assert where[1] == "softvq.models.vqvae"
    out = tmp_path / "run"
    train = subprocess.run([str(installed / "softvq-train"), "--data.data_root", str(tiny_cifar["folder"]),
                            "--out", str(out), "--quantizer", "hard", *TINY], cwd=cwd, capture_output=True, text=True)
    assert train.returncode == 0, train.stderr[-3000:]
    history = [json.loads(line) for line in (out / "history.jsonl").read_text().splitlines()]
    assert [row["epoch"] for row in history] == [1]
    assert json.loads((out / "config.json").read_text())["model"]["num_codes"] == 8
    metrics = tmp_path / "metrics.json"
    evaluate = subprocess.run([str(installed / "softvq-evaluate"), str(out / "checkpoints" / "last.ckpt"),
                               "--data.data_root", str(tiny_cifar["folder"]), "--out", str(metrics),
                               "--data.num_workers", "0", "--trainer.progress_bar", "false"], cwd=cwd,
                              capture_output=True, text=True)
    assert evaluate.returncode == 0, evaluate.stderr[-3000:]
    saved = json.loads(metrics.read_text())
    assert json.loads(evaluate.stdout)["psnr"] == saved["psnr"]  # stdout is the JSON, progress goes elsewhere
    assert saved["images"] == 50  # the tiny test split (tests/conftest.py)


def test_core_imports_without_the_extras(wheel, tmp_path):
    """``import softvq`` and a DDCL forward/backward in an environment that holds only the wheel, torch, torchmetrics
    and their own requirements; ``softvq.models`` then says which extra it misses."""
    env = tmp_path / "core-env"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(env)], check=True)
    python = env / ("Scripts" if os.name == "nt" else "bin") / "python"
    purelib = Path(subprocess.run([str(python), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                                  check=True, capture_output=True, text=True).stdout.strip())
    (purelib / "_core_deps.pth").write_text(str(core_only_site(tmp_path / "core-site")) + "\n")
    subprocess.run([sys.executable, "-m", "pip", "--python", str(python), "install", "--no-deps", "--no-index", "-q",
                    str(wheel)], check=True, capture_output=True, text=True)
    code = ("import importlib.util, torch, softvq\n"
            f"assert not any(importlib.util.find_spec(m) for m in {EXTRAS!r})\n"
            "q = softvq.DDCLQuantizer(8, 4)\n"
            "out = q(torch.randn(2, 5, 4, requires_grad=True)); out.loss.backward()\n"
            "assert out.quantized.shape == (2, 5, 4)\n"
            "usage = softvq.CodebookUsage(8); usage.update(out.indices); print(usage.compute()['utilization'] > 0)\n"
            "try:\n    import softvq.models\nexcept ModuleNotFoundError as err:\n    print('models:', err)\n")
    result = subprocess.run([str(python), "-c", code], cwd=tmp_path, capture_output=True, text=True)
    assert result.returncode == 0, result.stderr[-3000:]
    assert "tensor(True)" in result.stdout
    assert "models: No module named 'lightning'" in result.stdout


def _import_graph(package: Path) -> dict[str, set[str]]:
    """Module -> the modules of the same tree it imports (at the top or inside a function, ``TYPE_CHECKING`` too):
    ``from a import b`` counts as an import of ``a.b`` alone when ``b`` is a module."""
    import ast

    root = package.parent
    modules = {}
    for file in package.rglob("*.py"):
        parts = file.relative_to(root).with_suffix("").parts
        modules[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = file
    graph: dict[str, set[str]] = {name: set() for name in modules}
    for name, file in modules.items():
        for node in ast.walk(ast.parse(file.read_text())):
            if isinstance(node, ast.Import):
                graph[name] |= {a.name for a in node.names if a.name in modules}
            elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module in modules:
                submodules = {f"{node.module}.{a.name}" for a in node.names} & modules.keys()
                graph[name] |= submodules if len(submodules) == len(node.names) else {node.module} | submodules
    return graph


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Every import loop, each once, as the path from its smallest module back to it."""
    found = []

    def walk(start: str, node: str, path: list[str]) -> None:
        for nxt in sorted(graph[node]):
            if nxt == start:
                found.append(path)
            elif nxt > start and nxt not in path:
                walk(start, nxt, [*path, nxt])

    for start in sorted(graph):
        walk(start, start, [start])
    return found


def test_the_import_graph_finds_a_loop_and_neither_the_library_nor_the_studies_have_one(tmp_path):
    fake = tmp_path / "pkg"
    (fake / "sub").mkdir(parents=True)
    (fake / "__init__.py").write_text("from pkg import a\n")
    (fake / "a.py").write_text("def f():\n    from pkg.sub.b import g\n")
    (fake / "sub" / "__init__.py").write_text("")
    (fake / "sub" / "b.py").write_text("import pkg.a\n")  # a -> sub.b -> a
    assert _cycles(_import_graph(fake)) == [["pkg.a", "pkg.sub.b"]]
    assert _cycles(_import_graph(ROOT / "softvq")) == []
    assert _cycles(_import_graph(ROOT / "eval")) == []
