"""Fingerprints of the bottlenecks' numerics: which reports a code change makes stale, and which it does not.

A method's fingerprint is a hash of a fixed tiny training run of its bottleneck (six steps of a linear encoder on
fixed tensors, one torch thread: the codes, indices, gradients and state after every step (the state's tensors
whatever their names and order), then an evaluation pass),
with its values rounded to 5 significant digits so that the last bits of a float sum do not count. A refactor that
changes no number leaves every fingerprint as it was; a new default changes the fingerprints of the methods that use
it, and only theirs.

``reports/fingerprints.json`` holds, per report, the fingerprints of the methods its numbers come from, taken at the
commits its runs were trained at (``python -m eval.reports --backfill-fingerprints WORKDIR`` takes them for every
report, from git worktrees of those commits). ``python -m eval.reports --check`` compares them with today's code and
names the reports whose methods' numerics changed (:func:`stale_methods`).

    python -m eval.fingerprint                                  # today's fingerprint of every method
    python -m eval.fingerprint --record reports/x/report.md ddcl hard_ema   # after re-running a study
"""

from __future__ import annotations

import argparse
import hashlib
import json
import sys
from collections.abc import Callable, Sequence
from pathlib import Path

import torch
from torch import nn

from eval._provenance import ROOT, portable

STORE = ROOT / "reports" / "fingerprints.json"
SIGNIFICANT = 5  # digits kept of every value hashed


def _builders() -> dict[str, Callable[[], nn.Module]]:
    import softvq
    from eval._hard import HARD_RESTART, HARD_RESTART_CAPPED

    # K = 256 for DDCL: its recipe's rules that depend on K are in their K-dependent range there (the entropy target
    # log K / 2 is above the former 2.5 nats from K = 149 on; 768 tokens a batch put the usage decay 1 - N / (64 K)
    # between its clips), so a change of either changes the fingerprint
    builders: dict[str, Callable[[], nn.Module]] = {
        "ddcl": lambda: softvq.DDCLQuantizer(256, 8),
        "hard": lambda: softvq.HardVQ(16, 8),
        "hard_ema": lambda: softvq.HardVQ(16, 8, ema_decay=0.99, restart=HARD_RESTART),
        # K = 256: 768 tokens a batch give 0.75 a code, so the cap (a quarter of that) is what sets the threshold
        "hard_ema_cap": lambda: softvq.HardVQ(256, 8, ema_decay=0.99, restart=HARD_RESTART_CAPPED),
        "rddcl": lambda: softvq.ResidualDDCL(2, 256, 8),
        "rhard": lambda: softvq.ResidualHardVQ(2, 16, 8),
    }
    return builders


# Names the studies give the same bottleneck at another size or with a study-level option: the same numerics.
ALIASES = {"ddcl512": "ddcl", "DDCLQuantizer": "ddcl", "ResidualDDCL": "rddcl", "ResidualHardVQ": "rhard"}


def methods() -> list[str]:
    """The methods that have a fingerprint."""
    return sorted(_builders())


def canonical(name: str) -> str | None:
    """The fingerprinted method a study's method name stands for (``None``: not one of softvq's bottlenecks)."""
    name = ALIASES.get(name, name)
    return name if name in _builders() else None


def _rounded(t: torch.Tensor) -> bytes:
    t = t.detach().to(torch.float64).contiguous()
    if not t.is_floating_point() or t.numel() == 0:
        return t.numpy().tobytes()
    exponent = torch.floor(torch.log10(t.abs().clamp_min(1e-30)))
    scale = 10.0 ** (SIGNIFICANT - 1 - exponent)
    return (torch.round(t * scale) / scale).numpy().tobytes()


def fingerprint(method: str, build: Callable[[], nn.Module] | None = None) -> str:
    """The fingerprint of ``method`` (or of the bottleneck ``build()`` makes), 16 hex digits."""
    build = build or _builders()[method]
    threads = torch.get_num_threads()
    state = torch.random.get_rng_state()
    torch.set_num_threads(1)
    try:
        torch.manual_seed(0)
        layer = build()
        encoder = nn.Linear(8, 8)
        optimizer = torch.optim.SGD(encoder.parameters(), lr=0.05)
        x = torch.randn(6, 768, 8) * 2 + 0.5
        digest = hashlib.sha256()
        layer.train()
        for batch in x:
            out = layer(encoder(batch))
            loss = (out.quantized - batch).square().mean() + out.loss
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
            for t in (out.quantized, out.indices, encoder.weight.grad, encoder.weight):
                digest.update(_rounded(t))
            # the state whatever its keys are named or ordered (a layer composed of other parts holds the same
            # numbers under other names): each tensor's hash, sorted
            held = sorted(hashlib.sha256(_rounded(t)).hexdigest() for t in layer.state_dict().values()
                          if isinstance(t, torch.Tensor))
            digest.update("".join(held).encode())
        layer.eval()
        with torch.no_grad():
            out = layer(encoder(x[0]))
        digest.update(_rounded(out.quantized))
        digest.update(_rounded(out.indices))
        return digest.hexdigest()[:16]
    finally:
        torch.set_num_threads(threads)
        torch.random.set_rng_state(state)


def today(names: Sequence[str] | None = None) -> dict[str, str]:
    """Today's fingerprint of every method (or of ``names``)."""
    return {m: fingerprint(m) for m in (names or methods())}


def load(store: Path = STORE) -> dict[str, dict[str, list[str]]]:
    """``{report: {method: [fingerprints]}}``: per report and method, the fingerprints of the commits its runs were
    trained at (several when they differ)."""
    return json.loads(store.read_text()) if store.is_file() else {}


def record(report: str, fingerprints: dict[str, list[str]], store: Path = STORE) -> None:
    """Store ``fingerprints`` (method -> the fingerprints its numbers were made with) for ``report``."""
    data = load(store)
    data[report] = {m: sorted(set(v)) for m, v in sorted(fingerprints.items())}
    store.parent.mkdir(parents=True, exist_ok=True)
    store.write_text(json.dumps(portable(dict(sorted(data.items()))), indent=1) + "\n")


def add(report: str, method: str, store: Path = STORE) -> None:
    """Add today's fingerprint of ``method`` (if it has one) to ``report``'s: a study that finishes one run at a time
    (``eval.long_run``) records each run's numerics as it publishes it."""
    name = canonical(method)
    if name is None:
        return
    prints = load(store).get(report, {})
    record(report, {**prints, name: [*prints.get(name, []), fingerprint(name)]}, store)


def stale_methods(stored: dict[str, list[str]], current: dict[str, str]) -> list[str]:
    """The methods whose numerics changed: today's fingerprint is not the one (each one) the report was made with."""
    return sorted(m for m, prints in stored.items() if m in current and any(p != current[m] for p in prints))


def report_methods(report: Path) -> list[str]:
    """The fingerprinted methods a report's numbers come from: the method names in the JSON records beside it."""
    names: set[str] = set()

    def walk(value: object) -> None:
        if isinstance(value, dict):
            for key in ("method", "quantizer"):
                if isinstance(value.get(key), str) and canonical(value[key]):
                    names.add(canonical(value[key]))  # type: ignore[arg-type]
            for v in value.values():
                walk(v)
        elif isinstance(value, list):
            for v in value:
                walk(v)

    for path in sorted([*report.parent.glob("*.json"), *report.parent.glob("runs/*.json")]):
        try:
            walk(json.loads(path.read_text()))
        except json.JSONDecodeError:
            continue
    return sorted(names)


_AT_COMMIT = """
import json, sys
sys.path.insert(0, {env!r})
from eval import fingerprint as f
out = {{}}
for m in {names!r}:
    try:
        out[m] = f.fingerprint(m)
    except Exception as err:  # a method the layer of that commit could not build
        out[m] = None
print(json.dumps(out))
"""


def at_commit(commit: str, names: Sequence[str], work: Path) -> dict[str, str | None]:
    """The fingerprints of ``names`` with the ``softvq`` of ``commit`` (today's fingerprint code): a detached
    worktree of the commit, whose ``softvq/`` is imported in a subprocess (``None`` for a method it cannot build)."""
    import subprocess

    tree, env = work / f"wt_{commit}", work / f"env_{commit}"
    if not tree.exists():
        subprocess.run(["git", "worktree", "add", "-f", "--detach", str(tree), commit], cwd=ROOT, check=True,
                       capture_output=True)
    env.mkdir(parents=True, exist_ok=True)
    for name, target in (("softvq", tree / "softvq"), ("eval", ROOT / "eval")):
        link = env / name
        if not link.exists():
            link.symlink_to(target)
    done = subprocess.run([sys.executable, "-c", _AT_COMMIT.format(env=str(env), names=list(names))], cwd=work,
                          check=True, capture_output=True, text=True)
    return json.loads(done.stdout.strip().splitlines()[-1])


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m eval.fingerprint", description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter, epilog=__doc__)
    p.add_argument("--record", metavar="REPORT", help="store today's fingerprints of METHODS for this report")
    p.add_argument("methods", nargs="*", help="methods (default: all)")
    args = p.parse_args(argv)
    names = [canonical(m) or m for m in args.methods] or methods()
    unknown = [m for m in names if m not in methods()]
    if unknown:
        p.error(f"no fingerprint for {unknown}; fingerprinted: {methods()}")
    prints = today(names)
    if args.record:
        report = Path(args.record)
        if not report.is_file():
            p.error(f"no report {report}")
        record(report.resolve().relative_to(ROOT).as_posix(), {m: [f] for m, f in prints.items()})
    print(json.dumps(prints, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
