"""The first temperature's calibration (``softvq.parts.calibration.calibrate_temperature``: safeguarded Newton in log T
over float32 distances, coarse to fine) against an independent reference, the calibration it replaced written out: a
bisection of the same bracket in float64 arithmetic over the same distances (the centred float32 matmul), halved 34
times (to 1.2e-9 in log T).

The tolerance: ``T`` within a relative 1e-6 of the reference (measured: at most 9e-8 here and over 45 cases at K = 16
to 4096 and DDCL's first batches at K = 1024 to 16384, ``python -m eval.bench_calibration``); float32 arithmetic
resolves the mean entropy to about 1e-7 nats. In entropy it is ``|H(T) - H*| <= 1e-6 dH/dlog T``, which the float64
entropy at the returned ``T`` is checked against. (Exact float64 distances move ``T`` by more where the gaps between
near codes are at float32's resolution of the distances, up to 3e-3 in ``T`` at a small target on clustered data here:
the old calibration computed the distances as this one does.)"""

from __future__ import annotations

import math

import pytest
import torch
from helpers import SyncRecorder

from softvq._kernels import squared_distances
from softvq.parts.calibration import calibrate_temperature

RTOL = 1e-6  # the stated tolerance, relative in T


def op_distances(z: torch.Tensor, p: torch.Tensor) -> torch.Tensor:
    """The squared distances the calibration (and the one before it) sees: one float32 matmul of the tokens and codes
    centred on the codes' mean, in float64."""
    c = p.mean(0)
    return squared_distances(z - c, p - c).double()


def exact_distances(z: torch.Tensor, p: torch.Tensor) -> torch.Tensor:
    """``||z_n - p_k||^2`` in float64 from the differences themselves (no matmul expansion: exact far from the origin
    too), a block of rows at a time."""
    z, p = z.double(), p.double()
    return torch.cat([(z[i:i + 64, None] - p[None]).square().sum(-1) for i in range(0, len(z), 64)])


def entropy_and_slope(d: torch.Tensor, t: float) -> tuple[float, float]:
    """Mean H(Q) of q ∝ exp(-d / t) over the rows of the float64 distances ``d``, and its derivative in log T (the
    mean variance of d / t under q), in float64."""
    logq = torch.log_softmax(-d / t, dim=1)
    q, x = logq.exp(), d / t
    return float(-(q * logq).sum(1).mean()), float(((q * x * x).sum(1) - (q * x).sum(1).square()).mean())


def reference_temperature(d: torch.Tensor, target: float, halvings: int = 34) -> float:
    """Bisection of log T in float64 over T in [1e-6, 1e3] times the mean squared distance (the calibration's
    bracket) of the float64 distances ``d``, 34 halvings (to 1.2e-9 in log T) as the calibration before did."""
    lo, hi = math.log(float(d.mean()) * 1e-6), math.log(float(d.mean()) * 1e3)
    d = d - d.amin(1, keepdim=True)
    for _ in range(halvings):
        mid = 0.5 * (lo + hi)
        logq = torch.log_softmax(d * -math.exp(-mid), dim=1)
        if float(-(logq.exp() * logq).sum(1).mean()) > target:
            hi = mid
        else:
            lo = mid
    return math.exp(0.5 * (lo + hi))


def data(kind: str, k: int, n: int, dim: int = 8, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    if kind == "clustered":  # tokens and codes in 6 tight clusters far apart
        centres = torch.randn(6, dim, generator=g) * 4
        z = centres[torch.randint(0, 6, (n,), generator=g)] + 0.1 * torch.randn(n, dim, generator=g)
        p = centres[torch.randint(0, 6, (k,), generator=g)] + 0.1 * torch.randn(k, dim, generator=g)
        return z, p
    z = torch.randn(n, dim, generator=g) * torch.linspace(0.2, 2.0, dim)  # spread, anisotropic
    p = torch.randn(k, dim, generator=g) * torch.linspace(0.2, 2.0, dim)
    if kind == "far":  # the same far from the origin: the distances cancel badly unless centred
        z, p = z + 1e3, p + 1e3
    return z, p


# n >= 512 so that the coarse level (256 tokens) sees a strided subsample; fewer tokens at large K keep the float64
# reference quick
SIZES = {16: 2048, 512: 1024, 4096: 512}


@pytest.mark.parametrize("k, kind", [(k, kind) for k in SIZES for kind in ("spread", "clustered", "far")
                                     if (k, kind) != (4096, "far")])  # far from the origin: at K = 16 and 512
def test_calibration_equals_the_float64_bisection_and_meets_the_target(k, kind):
    z, p = data(kind, k, SIZES[k], seed=k)
    d = op_distances(z, p)
    for target in (0.1, 0.5 * math.log(k), math.log(k) - 0.05):  # small, the default, near uniform
        t = calibrate_temperature(z, p, target)
        assert t.dtype == torch.float64 and t.shape == ()
        ref = reference_temperature(d, target)
        assert float(t) == pytest.approx(ref, rel=RTOL), (target, float(t) / ref - 1)
        h, slope = entropy_and_slope(d, float(t))
        assert abs(h - target) <= RTOL * slope, (target, h - target, slope)
    if kind == "far":  # centred, the float32 distances are those of the data near the origin: exact ones agree
        target = 0.5 * math.log(k)
        t = calibrate_temperature(z, p, target)
        assert float(t) == pytest.approx(reference_temperature(exact_distances(z, p), target), rel=RTOL)


def test_float64_tokens_calibrate_to_float64_precision():
    z, p = data("spread", 64, 600, seed=3)
    z, p = z.double(), p.double()
    t = calibrate_temperature(z, p, 2.0)
    assert float(t) == pytest.approx(reference_temperature(exact_distances(z, p), 2.0, halvings=50), rel=1e-10)


def test_a_root_outside_the_bracket_gives_its_edge_as_the_bisection_did():
    """Every code twice: each token's entropy is at least log 2 at any T, so a target of 0.5 is below H at the
    bracket's lower edge (1e-6 of the mean squared distance), and log K - 1e-9 above H at its upper edge (1e3 of it):
    the calibration stops at the edge, as the bisection did."""
    z, p = data("spread", 40, 600, seed=4)
    p = torch.cat([p, p])
    d = op_distances(z, p)
    for target, edge in ((0.5, 1e-6), (math.log(80) - 1e-9, 1e3)):
        t = float(calibrate_temperature(z, p, target))
        assert t == pytest.approx(reference_temperature(d, target), rel=RTOL)
        assert t == pytest.approx(edge * float(d.mean()), rel=RTOL)


def test_no_host_sync_and_one_opaque_op_under_compile():
    z, p = data("spread", 32, 300, seed=5)
    recorder = SyncRecorder()
    with recorder:
        t = calibrate_temperature(z, p, 1.5)
    assert recorder.calls == []
    compiled = torch.compile(lambda z, p: calibrate_temperature(z, p, 1.5), fullgraph=True, backend="aot_eager")
    assert torch.equal(compiled(z, p), t)
    torch.library.opcheck(calibrate_temperature, (z, p, 1.5))  # the schema and the fake registration


def test_the_benchmark_runs_and_agrees_with_its_bisection(capsys):
    from eval import bench_calibration

    assert bench_calibration.main(["--codes", "16", "--tokens", "512", "--dim", "8", "--later", "1"]) == 0
    out = capsys.readouterr().out
    assert "| 16 |" in out and "T / T_bisection - 1" in out
    worst = float(out.rsplit("largest |T / T_bisection - 1|: ", 1)[1])
    assert worst <= RTOL


@pytest.mark.parametrize("top_k", [3, 17])
def test_top_k_calibration_meets_the_target_on_the_truncated_distribution(top_k):
    """With ``top_k`` the target is the entropy of the distribution truncated to each token's ``top_k`` nearest
    (a top-k layer's): brute force in float64 at the returned ``T``, every token's distances sorted."""
    g = torch.Generator().manual_seed(top_k)
    z, p = torch.randn(300, 6, generator=g), torch.randn(200, 6, generator=g)
    target = 0.6 * math.log(top_k)
    t = float(calibrate_temperature(z, p, target, top_k))
    d = (z.double()[:, None] - p.double()[None]).square().sum(-1).sort(1).values[:, :top_k]
    q = torch.softmax(-d / t, 1)
    entropy = float(-(q * q.log()).sum(1).mean())
    slope = float(((d / t).square() * q).sum(1).mean() - ((d / t) * q).sum(1).square().mean())
    assert abs(entropy - target) <= 1e-5 * max(slope, 1e-3)
    full = float(calibrate_temperature(z, p, target))  # the whole distribution's T differs
    assert abs(full - t) > 1e-3 * t
