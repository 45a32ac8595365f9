"""Fingerprints of the bottlenecks' numerics: which reports a code change makes stale, and which it does not.

A method's fingerprint is a hash of a fixed tiny training run of its bottleneck (six steps of a linear encoder on
fixed tensors: the codes, indices, assignments, loss, gradients and state after every step (the state's tensors
whatever their names and order), then an evaluation pass). It means the same on every machine: the run is float64
throughout (the layer built and trained with float64 as the default dtype, its inputs drawn in float64), every tensor
is summarised by a few float64 projections, and these are rounded to multiples of 2^-18 (:data:`GRID`), with the
values that sit on a rounding jump handled (:class:`Run`). Measured on one AMD EPYC: the raw values differ by
1.9e-15 at most between ``ATEN_CPU_CAPABILITY=avx2`` and ``avx512`` (and by 2.8e-7 under ``default`` before the
draws were float64: float32 normal draws are vectorised differently), 14 orders of magnitude inside a step. A
refactor that changes no number leaves every fingerprint as it was on every CPU, kernel set and thread count; a new
default changes the fingerprints of the methods that use it, and only theirs. What it cannot see: a change confined
to float32 arithmetic (a compute precision, a float32-only floor): the golden file (tests/golden) checks float32.

``reports/fingerprints.json`` holds, per report, the fingerprints of the methods its numbers come from, taken at the
commits its runs were trained at (``python -m eval.reports --backfill-fingerprints WORKDIR`` takes them for every
report, from git worktrees of those commits). ``python -m eval.reports --check`` compares them with today's code and
names the reports whose methods' numerics changed (:func:`stale_methods`).

    python -m eval.fingerprint                                  # today's fingerprint of every method
    python -m eval.fingerprint --record reports/x/report.md ddcl hard_ema   # after re-running a study
"""

from __future__ import annotations

import argparse
import functools
import hashlib
import json
import re
import sys
from collections.abc import Callable, Sequence
from pathlib import Path

import numpy as np
import torch
from torch import nn

from eval._provenance import ROOT, portable

STORE = ROOT / "reports" / "fingerprints.json"
# Values are rounded to multiples of GRID (an absolute step, about 3.8e-6: the tiny run's values are of order 1 to
# 1e3, so this keeps 6 to 9 significant digits); a value within NEAR steps (about 3.8e-11) of the rounding jump of its
# cell has that cell's jump moved, and the move recorded with the print (:class:`Run`).
GRID = 2.0 ** -18
NEAR = 1e-5
PROJECTIONS = 3  # random projections of every tensor, beside its sum of squares


def _hard_ema(num_codes: int, capped: bool = False) -> nn.Module:
    """HardVQ "EMA 0.99 + restart 1" (``capped``: the restart threshold capped at a quarter of the mean tokens per
    code), built with the options of the ``softvq`` at hand: an older one (``eval.reports --backfill-fingerprints``
    imports the ``softvq`` of the commit a report ran at) had the restart as the flat ``dead_code_threshold``, its
    usage decayed at the EMA's decay and uncapped, the same numerics as ``HARD_RESTART``."""
    import softvq

    if hasattr(softvq, "Restart"):
        from eval._hard import HARD_RESTART, HARD_RESTART_CAPPED

        return softvq.HardVQ(num_codes, 8, ema_decay=0.99, restart=HARD_RESTART_CAPPED if capped else HARD_RESTART)
    if capped:
        raise RuntimeError("this softvq has no capped restart")
    return softvq.HardVQ(num_codes, 8, ema_decay=0.99, dead_code_threshold=1.0)


def _builders() -> dict[str, Callable[[], nn.Module]]:
    import softvq

    # K = 256 for DDCL: its recipe's rules that depend on K are in their K-dependent range there (the entropy target
    # log K / 2 is above the former 2.5 nats from K = 149 on; 768 tokens a batch put the usage decay 1 - N / (64 K)
    # between its clips), so a change of either changes the fingerprint
    builders: dict[str, Callable[[], nn.Module]] = {
        "ddcl": lambda: softvq.DDCLQuantizer(256, 8),
        "hard": lambda: softvq.HardVQ(16, 8),
        "hard_ema": lambda: _hard_ema(16),
        # K = 256: 768 tokens a batch give 0.75 a code, so the cap (a quarter of that) is what sets the threshold
        "hard_ema_cap": lambda: _hard_ema(256, capped=True),
        # K = 32: the second level starts from the first one's residuals, of which the K tokens that became codes of
        # the first level are exactly zero; at K = 256 (of 768 tokens) it drew 80 coincident zero codes, whose ties
        # the last bits of a matmul decide (Run); at 32 it draws none
        "rddcl": lambda: softvq.ResidualDDCL(2, 32, 8),
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


@functools.lru_cache(maxsize=64)
def _weights(n: int) -> np.ndarray:
    """``(PROJECTIONS, n)`` fixed projection weights for a tensor of ``n`` values, drawn in float64 (float64 normal
    draws are the same under every kernel set; float32 ones are not) from a seed of ``n`` alone, so that a tensor's
    summary does not depend on its name."""
    g = torch.Generator().manual_seed(n)
    return torch.randn(PROJECTIONS, n, generator=g, dtype=torch.float64).numpy()


def _dense(out: object, layer: torch.nn.Module) -> torch.Tensor:
    """A layer output's ``probs`` over every code (``prob_codes`` scattered; outputs of older versions have none)."""
    codes = getattr(out, "prob_codes", None)
    if codes is None:
        return out.probs
    return out.probs.new_zeros(*out.probs.shape[:-1], layer.num_codes).scatter(-1, codes, out.probs)  # type: ignore[attr-defined]


def _summary(t: torch.Tensor) -> np.ndarray:
    """A tensor's numbers as ``PROJECTIONS + 1`` float64 values: its projections on fixed random directions and its
    sum of squares (float64 sums of float64 values: their rounding, 1e-16 relative, is far below :data:`GRID`). Any
    change of a value by more than about ``GRID`` moves a projection by more than a step."""
    x = t.detach().cpu().to(torch.float64).reshape(-1).numpy()
    if x.size == 0:
        return np.zeros(PROJECTIONS + 1)
    return np.concatenate([_weights(x.size) @ x, [x @ x]])


Steps = list[tuple[list[np.ndarray], list[np.ndarray]]]  # per step: (ordered summaries, the state's in any order)


# Methods whose run is cut short (then without the evaluation pass): their steps would reach coincident codes.
# hard_ema_cap's restarts at the end of step 0 draw 179 tokens of 768 with replacement, 17 of them twice.
_STEPS = {"hard_ema_cap": 1}


def _check_distinct(layer: nn.Module, method: str, where: str) -> None:
    """A RuntimeError if a codebook of ``layer`` holds coincident codes before ``where``: a token's nearest code is
    then a tie that the last bits of a matmul decide (a BLAS kernel rounds a column at the edge of its block
    otherwise than an inner one; measured: copies of one code at columns 10 and 255 of 256), which differ between
    machines, and the runs part from there."""
    for name, module in layer.named_modules():
        codes = getattr(module, "prototypes", None)
        if isinstance(codes, torch.Tensor) and codes.ndim == 2:
            same = codes.shape[0] - torch.unique(codes.detach(), dim=0).shape[0]
            if same:
                raise RuntimeError(f"fingerprint {method}: {same} coincident code(s) in {name or 'the layer'} before "
                                   f"{where}; their ties are decided by the last bits of a matmul, which differ "
                                   f"between machines: shorten the run (_STEPS) or change its setting")


def _collect(method: str, build: Callable[[], nn.Module]) -> Steps:
    """The fixed tiny training run of the layer ``build()`` makes, summarised: per step, the summaries of what it
    returned, the encoder's gradient and weight (in that order), then one summary per state tensor (in no order:
    :class:`Run` sorts them), and after the steps the evaluation pass. Everything in float64: the layer is built and
    trained with float64 as the default dtype, so that its own random draws (a normal initialisation, float32 draws
    of which differ between PyTorch's kernel sets) are float64 ones."""
    dtype = torch.get_default_dtype()
    state = torch.random.get_rng_state()
    torch.set_default_dtype(torch.float64)
    try:
        torch.manual_seed(0)
        layer = build().to(torch.float64)
        gen = torch.Generator().manual_seed(1)  # float64 draws: the same under every kernel set
        encoder = nn.Linear(8, 8)
        with torch.no_grad():
            encoder.weight.copy_(torch.randn(8, 8, generator=gen) / 8 ** 0.5)
            encoder.bias.copy_(torch.randn(8, generator=gen) * 0.1)
        optimizer = torch.optim.SGD(encoder.parameters(), lr=0.05)
        x = torch.randn(6, 768, 8, generator=gen) * 2 + 0.5
        steps: Steps = []
        layer.train()
        for step, batch in enumerate(x[:_STEPS.get(method, len(x))]):
            _check_distinct(layer, method, f"step {step}")
            out = layer(encoder(batch))
            loss = (out.quantized - batch).square().mean() + out.loss
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
            # probs as the dense (N, K) array: HardVQ's one-hot became (N, 1) ones with prob_codes (no numerics
            # changed), and its prints stay those of earlier commits
            shown = [out.quantized, out.indices, _dense(out, layer), out.loss, encoder.weight.grad, encoder.weight]
            held = [_summary(t) for t in layer.state_dict().values() if isinstance(t, torch.Tensor)]
            steps.append(([_summary(t) for t in shown], held))
        if method not in _STEPS:
            _check_distinct(layer, method, "the evaluation pass")
            layer.eval()
            with torch.no_grad():
                out = layer(encoder(x[0]))
            steps.append(([_summary(out.quantized), _summary(out.indices), _summary(_dense(out, layer))], []))
        return steps
    finally:
        torch.set_default_dtype(dtype)
        torch.random.set_rng_state(state)


_MOVE = re.compile(r"(-?\d+)([+-])")


class Run:
    """The summaries of one fingerprint run, and its print: a hash of them rounded to multiples of :data:`GRID`.

    Rounding is where a portable fingerprint can break: two machines' values differ in their last bits (float64
    kernels of other vector widths sum in other orders: about 1e-15 here), and a value that lies on a rounding jump
    rounds one way on one machine and the other way on another. So the print records those values: a cell ``k``
    (the values in ``[k, k + 1)`` steps) with a value within :data:`NEAR` steps of its jump at ``k + 1/2`` has the
    jump moved to ``k + 3/4`` (``"k+"``) or, when another value sits there, to ``k + 1/4`` (``"k-"``), and the moves
    are written after the hash (``"0123456789abcdef@17+,-4-"``; about 1 print in 100 has one). Comparing with a stored
    print (:meth:`matches`) rounds with its moves: each value is then at least :data:`NEAR` steps from a jump, so
    values that agree to better than that (the same numerics on another CPU, kernel set or thread count) give the
    same hash, and a change of more than a step gives another."""

    def __init__(self, steps: Steps) -> None:
        self.steps = steps
        self.units = np.concatenate([s for shown, held in steps for s in (*shown, *held)]) / GRID

    @classmethod
    def of(cls, method: str, build: Callable[[], nn.Module] | None = None) -> Run:
        return cls(_collect(method, build or _builders()[method]))

    def _moves(self) -> dict[int, int]:
        """The cells whose jump a value sits on, and where it moves (+1: to 3/4, -1: to 1/4)."""
        cell = np.floor(self.units)
        frac = self.units - cell
        moves: dict[int, int] = {}
        for k in sorted({int(c) for c in cell[np.abs(frac - 0.5) < NEAR]}):
            here = frac[cell == k]
            for sign in (1, -1):
                if not (np.abs(here - (0.5 + 0.25 * sign)) < NEAR).any():
                    moves[k] = sign
                    break
            else:  # three values of one cell on three candidate jumps, each within 4e-11: never seen
                raise RuntimeError(f"fingerprint: cell {k} has values on every candidate rounding jump")
        return moves

    def _digest(self, moves: dict[int, int]) -> str:
        def rounded(values: np.ndarray) -> np.ndarray:
            u = np.asarray(values, dtype=np.float64) / GRID
            k = np.floor(u)
            jump = 0.5 + 0.25 * np.array([moves.get(int(c), 0) for c in k.ravel()]).reshape(k.shape)
            return (k + (u - k >= jump)).astype(np.int64)

        digest = hashlib.sha256()
        for shown, held in self.steps:
            for s in shown:
                digest.update(rounded(s).tobytes())
            # the state whatever its keys are named or ordered (a layer composed of other parts holds the same
            # numbers under other names): its tensors' rounded summaries, sorted
            digest.update(b"".join(sorted(rounded(s).tobytes() for s in held)))
        return digest.hexdigest()[:16]

    def print(self) -> str:
        """The fingerprint to store: 16 hex digits, and the moved jumps after an ``@`` when there are any."""
        moves = self._moves()
        marks = ",".join(f"{k}{'+' if s > 0 else '-'}" for k, s in sorted(moves.items()))
        return self._digest(moves) + (f"@{marks}" if marks else "")

    def matches(self, stored: str) -> bool:
        """Whether ``stored`` (a print of :meth:`print`, taken on any machine) is this run's numerics."""
        digest, _, marks = stored.partition("@")
        moves = {int(k): 1 if s == "+" else -1 for k, s in _MOVE.findall(marks)}
        return self._digest(moves) == digest


def fingerprint(method: str, build: Callable[[], nn.Module] | None = None) -> str:
    """The fingerprint of ``method`` (or of the bottleneck ``build()`` makes): :meth:`Run.print`."""
    return Run.of(method, build).print()


def today(names: Sequence[str] | None = None) -> dict[str, str]:
    """Today's fingerprint of every method (or of ``names``)."""
    return {m: fingerprint(m) for m in (names or methods())}


def runs(names: Sequence[str] | None = None) -> dict[str, Run]:
    """Today's fingerprint run of every method (or of ``names``), to compare stored prints with
    (:func:`stale_methods`)."""
    return {m: Run.of(m) for m in (names or methods())}


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


def stale_methods(stored: dict[str, list[str]], current: dict[str, Run]) -> list[str]:
    """The methods whose numerics changed: today's run (:func:`runs`) does not match the print (each print) the report
    was made with."""
    return sorted(m for m, prints in stored.items() if m in current and not all(current[m].matches(p) for p in prints))


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
