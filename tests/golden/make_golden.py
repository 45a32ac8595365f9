"""The public layers' numerics, step by step: a golden file that a rewrite of the layers' internals must reproduce bit
for bit, and one state dict per layer that must load and evaluate as it did when it was saved.

Every case trains one public layer (or recipe) for :data:`STEPS` steps on fixed tensors: a linear "encoder" ``W``
maps fixed inputs to tokens, the layer quantizes them, the loss is the squared distance of its output to a fixed
target plus the layer's own loss, and Adam steps ``W`` and the layer's parameters. After every step the file holds a
digest of three groups: what the forward returned (every tensor of the output), the gradients (``W``'s and the
layer's parameters') and the layer's state after the step (its values, whatever the keys are named). One
evaluation-mode forward follows the last step (group ``eval``). A digest is SHA-256 over each tensor's dtype, shape
and bytes, so any change of any bit of any value shows; the test reports the first step and group that differ.

    python tests/golden/make_golden.py            # rewrite tests/golden/layers.json and tests/golden/states/*.pt
    python tests/golden/make_golden.py --check    # compare with the files (what tests/test_golden.py does)

The states in ``states/`` are the final state dicts, each with the output of an evaluation forward on a fixed
batch: an old checkpoint of every kind, loaded into a freshly built layer.
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
GOLDEN = HERE / "layers.json"
STATES = HERE / "states"
STEPS = 50
K, D, D_IN = 16, 8, 6
# HardVQ "EMA 0.99 + restart 1": its usage decayed at the EMA's 0.99, uncapped (as eval.peers.HARD_RESTART)
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


def digest(tensors: Iterator[tuple[str, Tensor]]) -> str:
    h = hashlib.sha256()
    for name, t in tensors:
        t = t.detach().cpu().contiguous()
        h.update(f"{name}|{t.dtype}|{tuple(t.shape)}|".encode())
        h.update(t.reshape(-1).numpy().tobytes())  # the raw bytes: any change of any bit shows
    return h.hexdigest()[:24]


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
    elif isinstance(value, (int, float, bool)):  # float64 / int64 whatever holds it (an extra state's float, a buffer)
        yield prefix, torch.tensor(value, dtype=torch.float64 if isinstance(value, float) else torch.int64)


def state_digest(layer: nn.Module) -> str:
    """The digest of a layer's state whatever its keys are named or ordered (a rewrite may rename a buffer, and
    loading maps the old name): each tensor's digest, sorted, hashed together."""
    each = sorted(digest(iter([("", t)])) for k, v in layer.state_dict().items() for _, t in tensors_of(v, k))
    return hashlib.sha256("".join(each).encode()).hexdigest()[:24]


def _loss(name: str, out: Any, target: Tensor) -> Tensor:
    if name == "readout":
        return (out.pooled - target[:, 0]).square().mean() + out.loss
    if name == "hierarchy":
        return (out.quantized[0] - target).square().mean() + out.loss
    return (out.quantized - target).square().mean() + out.loss


def run(name: str) -> tuple[dict[str, Any], nn.Module, Tensor, Any]:
    """Train case ``name``; returns its record, the layer, the evaluation batch and the evaluation output."""
    build, lead, dtype = CASES[name]
    torch.manual_seed(0)
    layer = build().to(dtype).train()
    gen = torch.Generator().manual_seed(1)
    encoder = nn.Parameter(torch.randn(D_IN, D, generator=gen, dtype=torch.float64).to(dtype))
    xs = torch.randn(STEPS + 1, *lead, D_IN, generator=gen, dtype=torch.float64).to(dtype) * 2 + 0.5
    targets = torch.randn(STEPS, *lead, D, generator=gen, dtype=torch.float64).to(dtype)
    params = [encoder, *(p for p in layer.parameters() if p.requires_grad)]
    optimizer = torch.optim.Adam(params, lr=1e-2)
    steps = []
    for step in range(STEPS):
        z = xs[step] @ encoder
        out = layer(z)
        optimizer.zero_grad(set_to_none=False)
        _loss(name, out, targets[step]).backward()
        grads = [(f"grad{i}", p.grad) for i, p in enumerate(params) if p.grad is not None]
        optimizer.step()
        steps.append({"output": digest(tensors_of(out, "out")), "grads": digest(iter(grads)),
                      "state": state_digest(layer)})
    layer.eval()
    with torch.no_grad():
        batch = xs[STEPS] @ encoder
        out = layer(batch)
    return {"steps": steps, "eval": digest(tensors_of(out, "out"))}, layer, batch, out


def record() -> None:
    STATES.mkdir(parents=True, exist_ok=True)
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=HERE, capture_output=True, text=True).stdout
    golden = {"commit": commit.strip(), "torch": torch.__version__, "cpu": torch.backends.cpu.get_cpu_capability(),
              "steps": STEPS, "cases": {}}
    for name in CASES:
        rec, layer, batch, out = run(name)
        golden["cases"][name] = rec
        torch.save({"state_dict": layer.state_dict(), "batch": batch,
                    "eval_output": dict(tensors_of(out, "out"))}, STATES / f"{name}.pt")
        print(f"{name}: recorded", flush=True)
    GOLDEN.write_text(json.dumps(golden, indent=1) + "\n")


def compare(name: str, golden: dict[str, Any]) -> str | None:
    """``None`` when case ``name`` reproduces ``golden`` bit for bit, else where it first differs."""
    rec, _, _, _ = run(name)
    for step, (got, want) in enumerate(zip(rec["steps"], golden["steps"], strict=True)):
        for group in ("output", "grads", "state"):
            if got[group] != want[group]:
                return f"{name}: step {step}, {group} differs"
    if rec["eval"] != golden["eval"]:
        return f"{name}: the evaluation forward after the last step differs"
    return None


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--check", action="store_true", help="compare with the golden file instead of writing it")
    args = p.parse_args(argv)
    torch.set_num_threads(1)
    if not args.check:
        record()
        return 0
    golden = json.loads(GOLDEN.read_text())["cases"]
    failures = [msg for name in CASES if (msg := compare(name, golden[name]))]
    print("\n".join(failures) or "every case reproduces the golden file")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
