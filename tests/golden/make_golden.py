"""The public layers' numerics, step by step: a golden file that every machine checks within float rounding, a
bit-for-bit record for a refactor on one machine, and one old state dict per layer that must still load and evaluate.

Every case trains one public layer (or recipe) for :data:`STEPS` steps on fixed tensors: a linear "encoder" ``W``
maps fixed inputs to tokens, the layer quantizes them, the loss is the squared distance of its output to a fixed
target plus the layer's own loss, and Adam steps ``W`` and the layer's parameters. Step ``s`` starts from
``torch.manual_seed(SEED + s)``, so a step can be replayed from its starting state alone.

**The golden file** (``trajectories/<case>.pt``, checked by tests/test_golden.py on any CPU): at the steps in
:data:`CHECKED`, the layer's state and ``W`` at the start of the step, and what the step gave: every tensor of the
output, the gradients (``W``'s and the layer's parameters') and the layer's state after the step's forward and
backward. The check replays each of those steps from its recorded start and compares (:func:`compare`): integer
tensors (indices, counts) exactly, floating ones within :func:`tolerance`. Replaying one step at a time keeps the
comparison one step deep: a free run of 50 steps drifts apart on another CPU as rounding compounds (measured under
``ATEN_CPU_CAPABILITY=default`` against ``avx512``, 1e-5 after 10 steps and, once a near-tie flips a code, by whole
codes: residual_ddcl 14, hierarchy 11), so nothing in it would be a tolerance of the computation.

**The bit-for-bit record** (``--bits FILE``, never committed): SHA-256 digests of every step of the free 50-step
run. A refactor records it at its start and compares after each step on the same machine (``--bits-check FILE``):
bits are the refactor's tool, not a committed test, since they change with the CPU, its kernels and the thread
count.

    python tests/golden/make_golden.py                       # rewrite trajectories/*.pt (after a change of numerics)
    python tests/golden/make_golden.py --cases ddcl_top_k    # rewrite one case's (a change that moves only it)
    python tests/golden/make_golden.py --check               # what tests/test_golden.py does
    python tests/golden/make_golden.py --bits runs/bits.json         # a refactor's start, on this machine
    python tests/golden/make_golden.py --bits-check runs/bits.json   # after each of its steps

``states/`` holds old state dicts (last written at bde0227, before settings were recorded in a state; never
re-recorded since), each with the output of an
evaluation forward on a fixed batch: an old checkpoint of every kind, loaded into a freshly built layer.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import subprocess
import sys
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import torch
from torch import Tensor, nn

import softvq

HERE = Path(__file__).resolve().parent
TRAJECTORIES = HERE / "trajectories"
STATES = HERE / "states"
STEPS = 50
SEED = 1000  # step s starts from torch.manual_seed(SEED + s)
# The steps the golden file holds: the first ones (initialisation from data, temperature calibration, the first
# restarts), then spread over the run (restarts, the entropy control under way, EMA statistics built up).
CHECKED = (0, 1, 2, 5, 13, 34, 49)
K, D, D_IN = 16, 8, 6
# The conditioning the tolerance takes at most (tolerance 4 u 2^15 = 7.8e-3 in float32): above it the float64
# replay made another discrete choice (a restart, a tie among the coincident zero codes of a residual level), so
# the difference is not a rounding error and measures nothing.
KAPPA_MAX = 2.0 ** 15
# HardVQ "EMA 0.99 + restart 1": its usage decayed at the EMA's 0.99, uncapped (as eval._hard.HARD_RESTART)
HARD_RESTART = softvq.Restart(1.0, decay=0.99, cap=None)

# name -> (builder, input shape (leading dims, D_in), dtype). Small sizes: the file pins behaviour, not speed.
CASES: dict[str, tuple[Callable[[], nn.Module], tuple[int, ...], torch.dtype]] = {
    "ddcl": (lambda: softvq.DDCLQuantizer(K, D), (48,), torch.float32),
    "ddcl_float64": (lambda: softvq.DDCLQuantizer(K, D), (48,), torch.float64),
    "ddcl_plain": (lambda: softvq.DDCLQuantizer(K, D, recipe="plain"), (48,), torch.float32),
    "ddcl_plain_float64": (lambda: softvq.DDCLQuantizer(K, D, recipe="plain"), (48,), torch.float64),
    "ddcl_soft_ema": (lambda: softvq.DDCLQuantizer(K, D, prototype_update="soft_ema"), (48,), torch.float32),
    "ddcl_gradient": (lambda: softvq.DDCLQuantizer(K, D, prototype_update="gradient"), (48,), torch.float32),
    "ddcl_cosine": (lambda: softvq.DDCLQuantizer(K, D, distance="cosine"), (48,), torch.float32),
    "ddcl_top_k": (lambda: softvq.DDCLQuantizer(K, D, top_k=4), (48,), torch.float32),
    "ddcl_restarting": (lambda: softvq.DDCLQuantizer(K, D, restart=softvq.Restart(4.0, cap=None)), (48,),
                        torch.float32),
    "hard": (lambda: softvq.HardVQ(K, D), (48,), torch.float32),
    "hard_ema_restart": (lambda: softvq.HardVQ(K, D, ema_decay=0.99, restart=HARD_RESTART), (48,), torch.float32),
    "residual_ddcl": (lambda: softvq.ResidualDDCL(3, K, D), (48,), torch.float32),
    "residual_hard": (lambda: softvq.ResidualHardVQ(3, K, D), (48,), torch.float32),
    "hierarchy": (lambda: softvq.HierarchicalDDCL([K, 8], D, pool=2), (4, 4, 4), torch.float32),
    "readout": (lambda: softvq.DDCLReadout(K, D), (4, 12), torch.float32),
}


def tokens_of(lead: tuple[int, ...]) -> int:
    return int(torch.Size(lead).numel())


def tolerance(name: str, kappa: float = 0.0) -> float:
    """The largest difference, relative to the largest magnitude of a tensor (for ``W``'s gradient, of the terms
    its sum over the tokens adds up: ``max |x|^T |dL/dz|``), that one step of case ``name`` may show between two
    machines with the same numerics: ``8 u (N + K + D)``.

    ``u`` is the unit roundoff of the case's dtype (``2^-24`` for float32, ``2^-53`` for float64). A sum of ``n``
    terms computed in any order is within ``n u`` of the exact sum, relative to the sum of the terms' magnitudes
    (Higham, "Accuracy and Stability of Numerical Algorithms", 2002, section 4.2); the longest sums of a step are
    over the batch's ``N`` tokens (the standardiser's moments, the EMA's and the gradients' sums), over the ``K``
    codes (the softmax, the soft centroid) and over the ``D`` dimensions (the distances), and a value can pass
    through one of each. The factor 8 covers the elementwise functions (``exp``, ``log``, ``sqrt``: up to 1 ulp
    apart between PyTorch's vectorised and scalar kernels), the distances' expansion ``|z|^2 - 2 z.e + |e|^2``
    (whose rounding is relative to ``|z|^2 + |e|^2``, not to the distance) and the division by the temperature.
    For 48 float32 tokens, 16 codes and 8 dimensions: 3.4e-5. Measured (an AMD EPYC, torch 2.14.1, replaying the
    file recorded under ``avx512``): the largest difference is 0.2 of its tolerance under
    ``ATEN_CPU_CAPABILITY=default`` (readout, W's gradient), 0.05 under ``avx2``, 0 with 2 threads; a changed EMA
    decay (0.98 for 0.99) differs by far more (tests/test_golden.py)."""
    build, lead, dtype = CASES[name]
    u = torch.finfo(dtype).eps / 2
    return max(8 * u * (tokens_of(lead) + K + D), 4 * u * min(kappa, KAPPA_MAX))


def tensors_of(value: Any, prefix: str = "") -> Iterator[tuple[str, Tensor]]:
    """Every tensor inside an output (tensor, named tuple, tuple, dict), with its path; other values as tensors."""
    if isinstance(value, Tensor):
        yield prefix, value
    elif hasattr(value, "_asdict"):
        for k, v in value._asdict().items():
            yield from tensors_of(v, f"{prefix}.{k}")
    elif isinstance(value, dict):
        for k in sorted(value):
            yield from tensors_of(value[k], f"{prefix}.{k}")
    elif isinstance(value, (tuple, list)):
        for i, v in enumerate(value):
            yield from tensors_of(v, f"{prefix}[{i}]")
    elif isinstance(value, bool):
        yield prefix, torch.tensor(int(value), dtype=torch.int64)
    elif isinstance(value, (int, float)):  # float64 / int64 whatever holds it (an extra state's float, a buffer)
        yield prefix, torch.tensor(value, dtype=torch.float64 if isinstance(value, float) else torch.int64)


def numbers_of(state: dict[str, Any]) -> dict[str, Tensor]:
    """A state dict's numbers, keyed by path: its tensors and the numbers of its extra states (the temperature, the
    restart count, ...); strings (settings) are the loader's to check, not numbers."""
    return {path: t.detach().clone() for key, value in state.items() for path, t in tensors_of(value, key)}


def _loss(name: str, out: Any, target: Tensor) -> Tensor:
    if name == "readout":
        return (out.pooled - target[:, 0]).square().mean() + out.loss
    if name == "hierarchy":
        return (out.quantized[0] - target).square().mean() + out.loss
    return (out.quantized - target).square().mean() + out.loss


def _data(name: str) -> tuple[Tensor, Tensor, Tensor]:
    """The case's starting ``W``, inputs and targets, drawn in float64 (float64 normal draws are the same under every
    kernel set; float32 ones are not) and cast."""
    _, lead, dtype = CASES[name]
    gen = torch.Generator().manual_seed(1)
    encoder = torch.randn(D_IN, D, generator=gen, dtype=torch.float64).to(dtype)
    xs = torch.randn(STEPS + 1, *lead, D_IN, generator=gen, dtype=torch.float64).to(dtype) * 2 + 0.5
    targets = torch.randn(STEPS, *lead, D, generator=gen, dtype=torch.float64).to(dtype)
    return encoder, xs, targets


def _build(name: str) -> nn.Module:
    build, _, dtype = CASES[name]
    torch.manual_seed(0)
    return build().to(dtype).train()


def _step(name: str, layer: nn.Module, encoder: nn.Parameter, step: int, x: Tensor, target: Tensor,
          ) -> dict[str, dict[str, Tensor]]:
    """One step's forward and backward from the layer's current state: the output's tensors, the gradients and the
    layer's numbers after it (no optimizer step: Adam is PyTorch's, not the layers')."""
    torch.manual_seed(SEED + step)
    z = x @ encoder
    z.retain_grad()
    out = layer(z)
    for p in (encoder, *layer.parameters()):
        p.grad = None
    _loss(name, out, target).backward()
    params = [encoder, *(p for p in layer.parameters() if p.requires_grad)]
    # W's gradient is a sum over the tokens of x_n g_n^T (g_n = dL/dz_n), which cancels: its rounding is relative to
    # the sum of the terms' magnitudes, |x|^T |g| (tolerance())
    terms = x.reshape(-1, D_IN).abs().t() @ z.grad.reshape(-1, D).abs()
    return {"output": {k: t.detach().clone() for k, t in tensors_of(out, "out")},
            "grads": {f"grad{i}": p.grad.detach().clone() for i, p in enumerate(params) if p.grad is not None},
            "state": numbers_of(layer.state_dict()),
            "scales": {"grad0": terms.abs().max().detach().double()}}


def run(name: str, record: bool = True) -> tuple[dict[int, dict[str, Any]], list[dict[str, str]]]:
    """The free run of case ``name``: the golden record of each step in :data:`CHECKED` (its start and what it
    gave), and the digests of every step (the bit-for-bit record)."""
    layer = _build(name)
    w0, xs, targets = _data(name)
    encoder = nn.Parameter(w0.clone())
    params = [encoder, *(p for p in layer.parameters() if p.requires_grad)]
    optimizer = torch.optim.Adam(params, lr=1e-2)
    golden: dict[int, dict[str, Any]] = {}
    digests = []
    for step in range(STEPS):
        start = None
        if record and step in CHECKED:
            start = {"state": {k: v.clone() if isinstance(v, Tensor) else v for k, v in layer.state_dict().items()},
                     "encoder": encoder.detach().clone()}
        got = _step(name, layer, encoder, step, xs[step], targets[step])
        optimizer.step()
        if start is not None:
            golden[step] = {"start": start, **got}
        digests.append({group: digest(got[group].items()) for group in ("output", "grads", "state")})
    return golden, digests


def digest(tensors: Any) -> str:
    h = hashlib.sha256()
    for name, t in tensors:
        t = t.detach().cpu().contiguous()
        h.update(f"{name}|{t.dtype}|{tuple(t.shape)}|".encode())
        h.update(t.reshape(-1).numpy().tobytes())  # the raw bytes: any change of any bit shows
    return h.hexdigest()[:24]


def replay(name: str, step: int, start: dict[str, Any], dtype: torch.dtype | None = None,
           change: Callable[[nn.Module], None] | None = None) -> dict[str, dict[str, Tensor]]:
    """Step ``step`` of case ``name`` from its recorded ``start``: a freshly built layer loads the state (strictly),
    ``W`` is the recorded one, and the step runs as in the free run; with ``dtype``, all of it cast to ``dtype``
    first (the float64 reference of :func:`conditioning`); ``change`` is applied to the loaded layer (a test's
    control: an option assigned after loading)."""
    layer = _build(name)
    layer.load_state_dict(start["state"])
    if change is not None:
        change(layer)
    _, xs, targets = _data(name)
    encoder = nn.Parameter(start["encoder"].clone())
    if dtype is not None:
        layer, encoder = layer.to(dtype), nn.Parameter(encoder.detach().to(dtype))
        xs, targets = xs.to(dtype), targets.to(dtype)
    return _step(name, layer, encoder, step, xs[step], targets[step])


def conditioning(name: str, step: int, rec: dict[str, Any]) -> dict[str, float]:
    """Per floating tensor of a recorded float32 step, its measured rounding error in units of float32's unit
    roundoff: the step replayed in float64 from the same start, their largest difference relative to the tensor's
    scale, divided by ``2^-24``. A sum that cancels (the soft centroid's covariance where the assignments are nearly
    one-hot, under the plain recipe's fixed temperature) has a rounding error far above ``u (N + K + D)`` relative
    to its result; this measures it where it happens. Float64 cases get the conditioning of their float32
    twin (:func:`tolerance`)."""
    reference = replay(name, step, rec["start"], dtype=torch.float64)

    def as_recorded(values: dict[str, Tensor], like: dict[str, Tensor]) -> dict[str, Tensor]:
        # rounded to the recorded dtype (the float32 answer closest to the exact one), then compared in float64
        return {k: v.to(like[k].dtype).double() if v.is_floating_point() and k in like else v
                for k, v in values.items()}

    groups = ("output", "grads", "state")
    ref = {g: as_recorded(reference[g], rec[g]) for g in groups}
    got = {**{g: as_recorded(rec[g], rec[g]) for g in groups}, "scales": rec["scales"]}  # the scales as recorded
    u = torch.finfo(torch.float32).eps / 2
    return {what: diff / u for what, diff in differences(name, ref, got) if diff != float("inf")}


def differences(name: str, got: dict[str, dict[str, Tensor]], want: dict[str, dict[str, Tensor]],
                ) -> list[tuple[str, float]]:
    """Per tensor of one step, its largest difference relative to its largest magnitude (``inf`` for integer
    tensors that differ, or a changed shape or key)."""
    out = []
    for group in ("output", "grads", "state"):
        if got[group].keys() != want[group].keys():
            out.append((f"{group}: keys {sorted(set(got[group]) ^ set(want[group]))}", float("inf")))
            continue
        for key, w in want[group].items():
            g = got[group][key]
            if g.shape != w.shape or g.dtype != w.dtype:
                out.append((f"{group} {key}: {tuple(g.shape)} {g.dtype} vs {tuple(w.shape)} {w.dtype}", float("inf")))
            elif not w.is_floating_point():
                out.append((f"{group} {key}", 0.0 if torch.equal(g, w) else float("inf")))
            elif key.rsplit(".", 1)[-1].startswith("identity_residual"):
                continue  # itself a rounding error (|l_q - l_ols - v| / l_q), of l_q, l_ols and v, which are compared
            elif w.numel():
                scale = want.get("scales", {}).get(key, w.abs().max().double()).clamp_min(torch.finfo(w.dtype).tiny)
                diff = (g.double() - w.double()).abs().max()
                out.append((f"{group} {key}", float(diff / scale) if torch.isfinite(diff) else float("inf")))
    return out


def compare(name: str, golden: dict[int, dict[str, Any]] | None = None,
            change: Callable[[nn.Module], None] | None = None) -> str | None:
    """``None`` when every recorded step of case ``name`` replays within :func:`tolerance`, else the first step and
    tensor that does not, with its difference."""
    golden = golden if golden is not None else load(name)
    for step, rec in sorted(golden.items()):
        got = replay(name, step, rec["start"], change=change)
        for what, diff in differences(name, got, rec):
            tol = tolerance(name, rec.get("kappa", {}).get(what, 0.0))
            if not diff <= tol:
                group = what.split(" ")[0].rstrip(":")
                return f"{name}: step {step}, {group} differs ({what}: {diff:.3g} > {tol:.3g} of its scale)"
    return None


def twin_kappa(twin: str, step: int) -> dict[str, float]:
    """The conditioning of float32 case ``twin`` at ``step`` (recorded before its float64 twin's)."""
    return load(twin)[step].get("kappa", {}) if (TRAJECTORIES / f"{twin}.pt").is_file() else {}


def load(name: str) -> dict[int, dict[str, Any]]:
    return torch.load(TRAJECTORIES / f"{name}.pt", weights_only=True)["steps"]


def record(names: list[str] | None = None) -> None:
    """Rewrite the golden file of every case, or of the cases ``names`` (a change of numerics that moves only those)."""
    TRAJECTORIES.mkdir(parents=True, exist_ok=True)
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=HERE, capture_output=True, text=True).stdout
    for name in names or CASES:
        golden, _ = run(name)
        twin = name.removesuffix("_float64")
        for step, rec in golden.items():
            if CASES[name][2] == torch.float32:
                rec["kappa"] = conditioning(name, step, rec)
        for step, rec in golden.items():
            if CASES[name][2] == torch.float64:  # its float32 twin's conditioning (same layer, same data)
                rec["kappa"] = twin_kappa(twin, step)
        torch.save({"commit": commit.strip(), "torch": str(torch.__version__), "steps": golden},
                   TRAJECTORIES / f"{name}.pt")
        print(f"{name}: recorded", flush=True)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    mode = p.add_mutually_exclusive_group()
    mode.add_argument("--check", action="store_true", help="replay the golden file's steps (what the test does)")
    mode.add_argument("--bits", metavar="FILE", type=Path, help="write this machine's bit-for-bit record to FILE")
    mode.add_argument("--bits-check", metavar="FILE", type=Path, help="compare with a bit-for-bit record")
    p.add_argument("--cases", nargs="+", choices=sorted(CASES), help="rewrite only these cases' golden files")
    args = p.parse_args(argv)
    torch.set_num_threads(1)
    if args.bits or args.bits_check:
        bits = {name: run(name, record=False)[1] for name in CASES}
        if args.bits:
            args.bits.parent.mkdir(parents=True, exist_ok=True)
            args.bits.write_text(json.dumps({"torch": torch.__version__,
                                             "cpu": torch.backends.cpu.get_cpu_capability(), "cases": bits}) + "\n")
            return 0
        want = json.loads(args.bits_check.read_text())["cases"]
        failures = []
        for name in CASES:
            for step, (g, w) in enumerate(zip(bits[name], want.get(name, []), strict=False)):
                bad = [group for group in ("output", "grads", "state") if g[group] != w[group]]
                if bad:
                    failures.append(f"{name}: step {step}, {bad[0]} differs")
                    break
        print("\n".join(failures) or "every case reproduces the record bit for bit")
        return 1 if failures else 0
    if not args.check:
        record(args.cases)
        return 0
    failures = [msg for name in CASES if (msg := compare(name))]
    print("\n".join(failures) or "every case replays within its tolerance")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
