"""The per-second study (eval/per_second): its candidate layers as stated (the truncated targets, the annealing
schedule, the amortised Jacobian against a brute-force float64 reference), and a test-sized run of the study and of
its step-cost benchmark, and the report's summary over seeds."""

from __future__ import annotations

import json
import math
import statistics

import lightning as L
import pytest
import torch

from eval import harness
from eval.amortised import AmortisedDDCL
from eval.per_second import main as study_main
from eval.per_second import report as per_second_report
from eval.per_second import step_cost


@pytest.mark.parametrize("method, k", [("ddcl_k16", 16), ("ddcl_k32", 32), ("ddcl_k64", 64), ("ddcl_anneal", 128)])
def test_truncated_candidates_hold_a_target_their_k_can_hold(method, k):
    layer = harness.build(method, 4096, 8)
    assert layer.top_k == k
    assert layer.target_entropy == pytest.approx(min(math.log(k) - 0.5, 0.5 * math.log(4096)))
    assert layer.target_entropy < math.log(layer.top_k)  # the truncated entropy can reach it
    small = harness.build(method, 64, 8)  # k at most K / 4, its target at most log(K) / 2
    assert small.top_k == 16 and small.target_entropy <= 0.5 * math.log(64)


def test_the_anneal_schedule_narrows_by_thirds():
    ks = [harness.anneal_k(step, 300, 4096) for step in (0, 99, 100, 199, 200, 299, 400)]
    assert ks == [128, 128, 64, 64, 32, 32, 32]
    assert harness.anneal_k(0, 300, 256) == 64  # at most K / 4


def test_the_amortised_jacobian_is_each_codes_covariance_in_float64():
    """The encoder's gradient is (2/T) C_c g with C_c = Cov_{q_c}(P), q_c the Boltzmann distribution of the code's own
    position over its r nearest codes, written out here from the definition in float64; the output is the code."""
    torch.manual_seed(0)
    # gradient-trained prototypes: no optimizer here, so they stay where the first batch put them
    layer = AmortisedDDCL(40, 3, neighbours=5, standardize=False, prototype_update="gradient").double().train()
    z = torch.randn(200, 3, dtype=torch.float64)
    layer(z)  # starts the codebook (prototypes from data, T calibrated, neighbour lists)
    x = z.clone().requires_grad_(True)
    g = torch.randn(200, 3, dtype=torch.float64)
    p = layer.prototypes.detach().clone()  # the prototypes this step reads (its EMA moves them after)
    t = layer.temperature
    out = layer(x)
    (out.quantized * g).sum().backward()
    d_codes = (p[:, None] - p[None]).square().sum(-1)  # (K, K)
    nearest = d_codes.topk(5, dim=1, largest=False).indices
    assert torch.equal(layer.neighbour_index.sort(1).values, nearest.sort(1).values)
    c = (x.detach()[:, None] - p[None]).square().sum(-1).argmin(1)
    assert torch.equal(out.indices, c)
    torch.testing.assert_close(out.quantized, p[c], rtol=0, atol=0)  # the code, bit for bit
    expected = torch.empty_like(g)
    for n in range(200):
        nb = p[nearest[c[n]]]
        q = torch.softmax(-(nb - p[c[n]]).square().sum(-1) / t, 0)
        dev = nb - q @ nb
        expected[n] = (2.0 / t) * (dev.t() @ (q[:, None] * dev)) @ g[n]
    torch.testing.assert_close(x.grad, expected, rtol=1e-10, atol=1e-12)
    assert float(out.terms["identity_residual"]) < 1e-12  # L_q = L_OLS + V for the stated q, from definitions


def test_a_test_sized_study_run_and_step_cost(tmp_path, tiny_cifar):
    data = str(tiny_cifar["archive"])
    tiny = ["--epochs", "1", "--width", "8", "--res-blocks", "1", "--res-hidden", "4", "--train-subset", "64",
            "--val-size", "16", "--batch-size", "16", "--no-progress-bar"]
    records = study_main([*tiny, "--data-root", data, "--num-codes", "32", "--methods", "ddcl_anneal",
                          "ddcl_amortised", "--runs", str(tmp_path / "runs"), "--out", str(tmp_path / "out")])
    assert [r["method"] for r in records] == ["ddcl_anneal", "ddcl_amortised"]
    saved = json.loads((tmp_path / "out" / "runs" / "K32_ddcl_anneal_seed0.json").read_text())
    assert saved["settings"]["split"] == "validation" and saved["test"] is None  # the test split is never read
    assert saved["steps_per_epoch"] == [4]
    from eval._provenance import loaded_code

    assert saved["code"] == loaded_code()  # the code this process imported, not the tree after the run
    again = study_main([*tiny, "--data-root", data, "--num-codes", "32", "--methods", "ddcl_anneal",
                        "--runs", str(tmp_path / "runs"), "--out", str(tmp_path / "out")])
    assert again[0]["wall_s"] == saved["wall_s"]  # a finished run is read, not trained again
    result = step_cost.main(["--num-codes", "32", "--methods", "ddcl_anneal", "hard_ema", "--width", "8",
                             "--res-blocks", "1", "--res-hidden", "4", "--batch-size", "4", "--steps", "1",
                             "--rounds", "1", "--warmup", "0", "--json", str(tmp_path / "cost.json")])
    assert set(result["steps"]["32"]) == {"ddcl_anneal@8", "hard_ema"}  # the anneal at each of its k (K / 4 here)


def test_the_report_summarises_seeds_at_the_fastest_hard_vqs_seconds():
    def run(method, seed, first, last):
        history = [{"step": 10, "val_psnr_hard": first, "val_utilization": 0.99, "val_perplexity": 30.0},
                   {"step": 20, "val_psnr_hard": last, "val_utilization": 1.0, "val_perplexity": 31.0}]
        return {"method": method, "seed": seed, "num_codes": 32, "history": history, "code": "abc"}

    runs = [run("hard_ema", s, 20.0 + s, 22.0 + s) for s in range(3)]
    runs += [run("ddcl_n16", s, 21.0 + 0.1 * s, 23.0 + 0.5 * s) for s in range(3)]
    cost = {"steps": {"32": {"hard_ema": [1.0, 1.0, 1.0], "ddcl_n16": [2.0, 2.0]}}}
    text, _ = per_second_report.tables(runs, cost)
    summary = text.split("Over seeds, K = 32")[1]
    # hard VQ's 20 steps take 20 s; ddcl_n16's first epoch ends there (10 steps of 2 s): its PSNR at the budget
    final = [23.0, 23.5, 24.0]
    at_budget = [21.0, 21.1, 21.2]
    hard_at_budget = [22.0, 23.0, 24.0]
    row = next(line for line in summary.splitlines() if line.startswith("| ddcl_n16"))
    assert f"{statistics.fmean(final):.2f} ± {statistics.stdev(final):.2f}" in row
    assert f"{statistics.fmean(at_budget):.2f} ± {statistics.stdev(at_budget):.2f}" in row
    margin = statistics.fmean(at_budget) - statistics.fmean(hard_at_budget)
    # -1.90 dB against a spread of 0.10 + 1.00, every seed's paired difference negative: it counts
    assert f"{margin:+.2f} dB, beyond the seed spread" in row
    assert "| 0, 1, 2 |" in row
    single, _ = per_second_report.tables([r for r in runs if r["seed"] == 0], cost)
    assert "Over seeds" not in single  # one seed each: no summary


class _SeedAtFirstBatch(L.Callback):
    """Seeds the global random state just before the first training step (Lightning's data loader draws from it
    before that, which time_step_interleaved, with no loader, does not)."""

    def __init__(self, seed: int) -> None:
        self.seed = seed

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        if batch_idx == 0:
            torch.manual_seed(self.seed)


def test_step_interleaved_timing_trains_every_model_as_lightning_would(tmp_path):
    """--interleave steps takes the models' own training steps in turn: a model stepped so ends with the parameters of
    the same model fitted by Lightning on the same batches from the same random state (so what is timed is its
    training step), and every method gets rounds x steps timings."""
    argv = ["--num-codes", "32", "--methods", "ddcl_k16", "hard_ema", "--width", "8", "--res-blocks", "1",
            "--res-hidden", "4", "--batch-size", "4", "--steps", "2", "--rounds", "2", "--warmup", "1"]
    args = step_cost.parse_args([*argv, "--json", str(tmp_path / "cost.json")])
    args.accelerator = "cpu"
    g = torch.Generator().manual_seed(args.seed)
    batches = torch.rand(4, 4, 3, 32, 32, generator=g)  # the batches time_step_interleaved draws, in its order
    images = torch.cat([batches[step % 4] for step in range(5)])
    loader = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(images, torch.zeros(len(images))),
                                         batch_size=4)
    for name in ("ddcl_k16", "hard_ema"):  # one at a time: their restarts draw from the global random state
        timed = step_cost.build_model(name, 32, args)
        torch.manual_seed(123)
        times = step_cost.time_step_interleaved(args, {name: timed})
        assert len(times[name]) == 4 and all(t > 0 for t in times[name])
        fitted = step_cost.build_model(name, 32, args)
        L.Trainer(max_steps=5, limit_val_batches=0, logger=False, enable_checkpointing=False, enable_progress_bar=False,
                  enable_model_summary=False, accelerator="cpu", callbacks=[_SeedAtFirstBatch(123)]).fit(fitted, loader)
        tensors = 0
        for (key, a), b in zip(timed.state_dict().items(), fitted.state_dict().values(), strict=True):
            if torch.is_tensor(a):
                torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6, msg=f"{name}: {key}")
                tensors += 1
            else:  # a layer's extra state (its settings)
                assert a == b, key
        assert tensors > 10
    result = step_cost.main([*argv, "--json", str(tmp_path / "cost.json")])
    assert {name: len(t) for name, t in result["steps"]["32"].items()} == {"ddcl_k16": 4, "hard_ema": 4}
    assert result["interleave"] == "steps" and result["measured"]["32"]["interleave"] == "steps"


def test_records_name_the_code_the_process_loaded_not_the_tree_at_their_end(monkeypatch):
    """A long-lived study process runs the code it imported; commits made while it trains (its own records', or
    anyone's) must not be named as the code of its later runs."""
    from eval import _provenance

    heads = iter(["aaaaaaa", "bbbbbbb+", "ccccccc"])
    monkeypatch.setattr(_provenance, "code_commit", lambda: next(heads))
    monkeypatch.setattr(_provenance, "_LOADED", [])
    assert _provenance.loaded_code() == "aaaaaaa"  # the first ask pins it
    assert _provenance.loaded_code() == "aaaaaaa"  # later asks, after the tree moved, read the same
    assert next(heads) == "bbbbbbb+"  # and no second git call was made
