"""eval/small_ae.py at test size: the held-out score against a brute-force decode, the diagnostics against
straight-through's identity, the summary's ratios against the best hard VQ, and a quick run's files."""

from __future__ import annotations

import json

import pytest
import torch

import softvq
from eval import small_ae
from eval.small_ae import Clusters, Setting, TokenAutoencoder


def test_hard_mse_is_the_nearest_codes_decoded() -> None:
    setting = Setting(dim=4, tokens=2, codes=8, clusters=5)
    torch.manual_seed(0)
    model = TokenAutoencoder(softvq.HardVQ(8, 4), setting)
    x = Clusters(setting, 0).draw(64, torch.Generator().manual_seed(1))
    z = model.encode(x).detach()
    codes = model.quantizer.prototypes.detach()
    nearest = torch.cdist(z.reshape(-1, 4).double(), codes.double()).argmin(-1)  # brute force, float64
    expected = (model.decode(codes[nearest].reshape(z.shape)) - x).square().mean().item()
    assert small_ae.hard_mse(model, x) == pytest.approx(expected, rel=1e-6)
    assert model.training  # the score leaves the mode as it found it


def test_splits_are_apart() -> None:
    data = Clusters(Setting(), 0)
    val, test = small_ae.held_out(data, "validation", 0), small_ae.held_out(data, "test", 0)
    assert not torch.equal(val, test)
    assert torch.equal(val, small_ae.held_out(data, "validation", 0))  # fixed, read alike by every method


def test_diagnostics_of_straight_through_are_the_identity() -> None:
    """Without a commitment, HardVQ passes the output's gradient to its tokens unchanged: cosine 1, norm ratio 1."""
    setting = Setting(dim=4, tokens=2, codes=8, clusters=5)
    torch.manual_seed(0)
    model = TokenAutoencoder(softvq.HardVQ(8, 4, commitment_weight=0.0), setting)
    x = Clusters(setting, 0).draw(32, torch.Generator().manual_seed(1))
    z = model.encode(x)
    out = model.quantizer(z)
    loss = (model.decode(out.quantized) - x).square().mean()
    row = small_ae.diagnostics(model, z, out, loss)
    assert row["cos_median"] == pytest.approx(1.0, abs=1e-6)
    assert row["norm_ratio"] == pytest.approx(1.0, abs=1e-6)
    assert row.get("commitment_share", 0.0) == 0.0 and "temperature" not in row


def test_summary_ratios() -> None:
    def run(method: str, mse: float, seed: int) -> dict:
        return {"name": "s", "method": method, "final_mse_hard": mse, "steps_to_within": 100, "seed": seed}

    rows = [run("ddcl", 0.03, 0), run("ddcl", 0.05, 1), run("hard_ema", 0.02, 0), run("hard_ema", 0.02, 1),
            run("hard", 0.01, 0), run("hard", 0.03, 1)]
    table = {r["method"]: r for r in small_ae.summary(rows)}
    assert table["ddcl"]["final_mse_hard"] == pytest.approx(0.04)
    assert table["ddcl"]["vs_best_hard"] == pytest.approx(0.04 / 0.02)  # best hard: the lower mean (0.02 = 0.02)
    assert table["hard_ema"]["vs_best_hard"] == pytest.approx(1.0)


def test_quick_run_writes_its_report(tmp_path) -> None:
    rows = small_ae.main(["--quick", "--methods", "ddcl", "hard_ema", "--out", str(tmp_path)])
    assert {r["method"] for r in rows} == {"ddcl", "hard_ema"} and len(rows) == 4
    saved = json.loads((tmp_path / "results.json").read_text())
    assert len(saved["runs"]) == 4 and saved["runs"][0]["curve"][-1]["step"] == 40
    report = (tmp_path / "report.md").read_text()
    assert "| base | hard_ema |" in report and "1.00x" in report and "test split was not read" in report


def test_bad_arguments() -> None:
    with pytest.raises(SystemExit):
        small_ae.parse_args(["--steps", "0"])
    with pytest.raises(ValueError, match="opt"):
        small_ae.train("hard", Setting(opt="lbfgs"), steps=1)


def test_cluster_codes_against_a_loop() -> None:
    """Distinct code tuples per cluster and the far share, against a Python loop over the points."""
    setting = Setting(dim=4, tokens=2, codes=8, clusters=5)
    torch.manual_seed(0)
    model = TokenAutoencoder(softvq.HardVQ(8, 4), setting)
    data = Clusters(setting, 0)
    x = data.draw(200, torch.Generator().manual_seed(1))
    got = small_ae.cluster_codes(model, data, x)
    with torch.no_grad():
        idx = model.quantizer(model.encode(x)).indices
        err = (model.decode(model.quantizer.prototypes[idx]) - x).square().mean(-1)
    tuples: dict[int, set] = {}
    for point, codes in zip(x, idx.tolist(), strict=True):
        nearest = min(range(len(data.centers)), key=lambda c: float((point - data.centers[c]).square().sum()))
        tuples.setdefault(nearest, set()).add(tuple(codes))
    assert got["codes_per_cluster"] == pytest.approx(sum(map(len, tuples.values())) / len(tuples))
    assert got["share_far"] == pytest.approx(float((err > 5 * 0.1**2).float().mean()))
    assert got["codes_per_cluster"] >= 1.0


def test_straight_through_probe_passes_the_output_gradient() -> None:
    """ddcl_st: the parent's output bit for bit, and (without the standardiser) the output's gradient unchanged."""
    torch.manual_seed(0)
    plain = softvq.DDCLQuantizer(16, 4, standardize=False).double()
    probe = small_ae.StraightThroughDDCL(16, 4, standardize=False).double()
    plain(torch.randn(64, 4, dtype=torch.float64))
    probe.load_state_dict(plain.state_dict())
    z = torch.randn(32, 4, dtype=torch.float64, requires_grad=True)
    weight = torch.randn(32, 4, dtype=torch.float64)
    out = probe(z)
    with torch.no_grad():
        assert torch.equal(out.quantized, plain.eval()(z).quantized)  # same codes (EMA moved after the probe's pass)
    (out.quantized * weight).sum().backward()
    torch.testing.assert_close(z.grad, weight, rtol=0, atol=0)
