"""Two CPU processes (gloo): every piece of synchronised state equals one process holding both batches.

The reference for each is a single process run on the concatenation of the two ranks' batches (rank 0 first), with
rank 0's random state: that is what N processes with batch B must reproduce of one process with batch N * B.
"""

from __future__ import annotations

import os
from datetime import timedelta
from types import SimpleNamespace

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from helpers import SyncRecorder, free_port
from torch import nn

from softvq import DDCLQuantizer, HardVQ
from softvq.models.callbacks import ReplicaCheck, replica_differences
from softvq.models.vqvae import VQVAE, LatentNorm
from softvq.parts import Restart
from softvq.residual import ResidualDDCL


def _data() -> torch.Tensor:
    return torch.randn(2, 3, 64, 4, generator=torch.Generator().manual_seed(0))  # (rank, step, token, D)


def _images() -> torch.Tensor:
    return torch.randn(2, 2, 5, 3, 4, 4, generator=torch.Generator().manual_seed(1), dtype=torch.float64) * 3 + 1


def _make_ema(threshold: float = 0.3) -> HardVQ:
    torch.manual_seed(1)
    vq = HardVQ(16, 4, ema_decay=0.9, restart=Restart(threshold, decay=0.9, cap=None) if threshold else None)
    with torch.no_grad():
        vq.prototypes.normal_()
        vq.ema.weighted_sum.copy_(vq.prototypes)
    return vq


def _weights() -> torch.Tensor:
    return torch.linspace(-1, 2, 2 * 10 * 3 * 4 * 4, dtype=torch.float64).reshape(2, 10, 3, 4, 4)  # (step, 2 ranks' B)


def _latent_norm_steps(batches: list[torch.Tensor], rows: slice = slice(None)) -> dict[str, torch.Tensor]:
    """Two training steps of a LatentNorm: outputs, input gradients of sum(y * weights[rows]) and running statistics.

    Under DDP the objective is the sum over ranks, as DDP's gradient all-reduce makes it."""
    norm = LatentNorm(3).double()
    out: dict[str, torch.Tensor] = {}
    for step, x in enumerate(batches):
        x = x.clone().requires_grad_(True)
        y = norm(x)
        (y * _weights()[step, rows]).sum().backward()
        out[f"y{step}"], out[f"grad{step}"] = y.detach(), x.grad
    out["mean"], out["var"] = norm.running_mean.clone(), norm.running_var.clone()
    return out


def _recipe_steps(batches: list[torch.Tensor], rows: slice, seed_offset: int = 0,
                  top_k: int | None = None) -> dict[str, torch.Tensor]:
    """Three training steps of a DDCLQuantizer with the default recipe (float64): in-layer standardisation, the
    calibrated and entropy-controlled temperature, EMA prototypes, restarts (a high threshold makes codes restart).
    Under DDP the objective is the sum over ranks, as DDP's gradient all-reduce makes it."""
    torch.manual_seed(5)
    quantizer = DDCLQuantizer(8, 4, restart=Restart(12.0), top_k=top_k).double()
    weights = torch.linspace(-1, 1, 3 * 128 * 4, dtype=torch.float64).reshape(3, 128, 4)
    out: dict[str, torch.Tensor] = {}
    for step, x in enumerate(batches):
        torch.manual_seed(400 + seed_offset)  # rank 0's draw must be the one used
        x = x.double().clone().requires_grad_(True)
        result = quantizer(x)
        (result.quantized * weights[step, rows]).sum().backward()
        out[f"q{step}"], out[f"grad{step}"] = result.quantized.detach(), x.grad
    sd = quantizer.standardizer
    out.update(prototypes=quantizer.prototypes.detach().clone(), mean=sd.running_mean.clone(),
               var=sd.running_var.clone(), applied_mean=sd.applied_mean.clone(), applied_var=sd.applied_var.clone(),
               evaluated=quantizer.eval()(torch.linspace(-2, 2, 40, dtype=torch.float64).reshape(10, 4)).quantized,
               temperature=torch.tensor(quantizer.temperature, dtype=torch.float64),
               restarts=torch.tensor(quantizer.restarts))
    return out


def _residual_steps(batches: list[torch.Tensor], rows: slice) -> dict[str, torch.Tensor]:
    """Three training steps of a ResidualDDCL with quantize dropout (the level count must be drawn alike on every
    rank, or the skipped levels' all-reduces deadlock) and restarts (float64), weighted objective."""
    torch.manual_seed(5)
    model = ResidualDDCL(3, 8, 4, quantize_dropout=True, restart=Restart(12.0)).double()
    weights = torch.linspace(-1, 1, 3 * 128 * 4, dtype=torch.float64).reshape(3, 128, 4)
    out: dict[str, torch.Tensor] = {}
    for step, x in enumerate(batches):
        torch.manual_seed(400)
        x = x.double().clone().requires_grad_(True)
        result = model(x)
        (result.quantized * weights[step, rows]).sum().backward()
        out[f"q{step}"], out[f"grad{step}"], out[f"idx{step}"] = result.quantized.detach(), x.grad, result.indices
    out.update(codebook=model.codebook.detach().clone(), mean=model.standardizer.running_mean.clone())
    return out


def _sync_calls(rank: int) -> tuple[list[str], list[int]]:
    """The host-device synchronisations of DDCL (the recipe) and HardVQ (EMA + restarts) training steps and an
    evaluation in the process group (test_compile's recorder), after the first batch: its data initialisation reads
    the token counts on the host once. Also the restarts made while recording (there must be some)."""
    torch.manual_seed(7)
    layers = [DDCLQuantizer(32, 8, check_finite=False, restart=Restart(4.0, cap=None)).train(),
              HardVQ(32, 8, ema_decay=0.99, restart=Restart(4.0, decay=0.99, cap=None), check_finite=False).train()]
    z = torch.randn(2, 4, 48, 8, generator=torch.Generator().manual_seed(8))[rank] * 3 + 1  # 96 tokens in all

    def step(layer: nn.Module, x: torch.Tensor) -> None:
        x = x.clone().requires_grad_(True)
        out = layer(x)
        (out.quantized.square().mean() + out.loss).backward()

    for layer in layers:
        step(layer, z[0])
    before = [layer.restarts for layer in layers]
    recorder = SyncRecorder()
    with recorder:
        for layer in layers:
            for x in z[1:]:
                step(layer, x)
            layer.eval()(z[0])
    return recorder.calls, [layer.restarts - b for layer, b in zip(layers, before, strict=True)]


def _worker(rank: int, world: int, port: int, results) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world, timeout=timedelta(seconds=60))  # a hang fails
    try:
        data = _data()
        vq, plain = _make_ema(), _make_ema(threshold=0.0)
        for step in range(3):
            torch.manual_seed(100 + rank)  # ranks hold different random states: rank 0's draw must be the one used
            vq(data[rank, step])
            plain(data[rank, step])
        torch.manual_seed(5)
        ddcl = DDCLQuantizer(8, 4, recipe="plain")
        torch.manual_seed(200 + rank)
        ddcl(data[rank, 0])  # data initialisation from both ranks' batches
        torch.manual_seed(5)
        few = DDCLQuantizer(8, 4, recipe="plain")
        torch.manual_seed(300 + rank)
        few(data[rank, 0, :3])  # 6 tokens in all for 8 codes: drawn with replacement and jittered
        norm = _latent_norm_steps([_images()[rank, step] for step in range(2)], slice(5 * rank, 5 * rank + 5))
        recipe = _recipe_steps([data[rank, step] for step in range(3)], slice(64 * rank, 64 * rank + 64), rank)
        recipe.update({f"top_k_{k}": v for k, v in _recipe_steps(
            [data[rank, step] for step in range(3)], slice(64 * rank, 64 * rank + 64), rank, top_k=3).items()})
        residual = _residual_steps([data[rank, step] * 2 + 1 for step in range(3)], slice(64 * rank, 64 * rank + 64))
        same = nn.Linear(3, 2)
        torch.nn.init.constant_(same.weight, 0.5)
        nn.init.zeros_(same.bias)
        equal = replica_differences(same)
        with torch.no_grad():
            if rank == 1:
                same.weight[0, 1] += 1e-7  # one entry, one ulp-sized change
        differ = replica_differences(same)
        trainer = SimpleNamespace(world_size=world, global_step=12, is_global_zero=rank == 0)
        check = ReplicaCheck(every_n_steps=4)
        try:
            check.on_train_batch_end(trainer, SimpleNamespace(quantizer=same), None, None, 0)
            raised = ""
        except RuntimeError as err:  # every rank raises, so none waits on a collective
            raised = str(err)
        with torch.no_grad():
            same.weight.copy_(torch.full_like(same.weight, 0.5))
        check.on_train_batch_end(trainer, SimpleNamespace(quantizer=same), None, None, 0)
        model = VQVAE(num_codes=8, code_dim=4, width=8, res_hidden=4, res_blocks=1)
        images = torch.rand(2, 3, 8, 8)
        if rank == 1:
            images[1, 0, 2, 2] = float("nan")
        try:  # only rank 1's batch is bad: both ranks must stop, before any collective that would wait forever
            model.training_step((images, torch.zeros(2)), 7)
            nan = ""
        except FloatingPointError as err:
            nan = str(err)
        syncs, restarts = _sync_calls(rank)
        results[rank] = {"nan": nan, "syncs": syncs, "sync_restarts": restarts, "raised": raised,
                         "checks": check.checks,
                         "ema": vq.codebook.clone(), "size": vq.ema.mass.clone(), "usage": vq.dead_codes.usage.clone(),
                         "plain": plain.codebook.clone(), "plain_size": plain.ema.mass.clone(),
                         "ddcl": ddcl.prototypes.detach().clone(), "few": few.prototypes.detach().clone(),
                         **{f"norm_{k}": v for k, v in norm.items()}, **{f"recipe_{k}": v for k, v in recipe.items()},
                         **{f"residual_{k}": v for k, v in residual.items()},
                         "equal": equal, "differ": differ}
    finally:
        dist.destroy_process_group()


@pytest.fixture(scope="module")
def two_ranks():
    results = mp.Manager().dict()
    mp.spawn(_worker, args=(2, free_port(), results), nprocs=2, join=True)
    return dict(results)


def test_codebook_state_identical_on_both_ranks(two_ranks):
    for key in ("ema", "size", "usage", "plain", "plain_size", "ddcl", "few"):
        assert torch.equal(two_ranks[0][key], two_ranks[1][key]), key


def test_ema_and_restarts_over_two_ranks_equal_one_process_on_the_whole_batch(two_ranks):
    data = _data()
    single, single_plain = _make_ema(), _make_ema(threshold=0.0)
    for step in range(3):
        torch.manual_seed(100)  # rank 0's random state
        single(torch.cat([data[0, step], data[1, step]]))  # what the two ranks saw together
        single_plain(torch.cat([data[0, step], data[1, step]]))
    torch.testing.assert_close(two_ranks[0]["plain_size"], single_plain.ema.mass)
    torch.testing.assert_close(two_ranks[0]["plain"], single_plain.codebook)
    assert not torch.equal(single.codebook, single_plain.codebook)  # restarts happened and changed the codebook
    torch.testing.assert_close(two_ranks[0]["ema"], single.codebook)
    torch.testing.assert_close(two_ranks[0]["size"], single.ema.mass)


def test_ddcl_data_init_draws_from_both_ranks_as_one_process_would(two_ranks):
    data = _data()
    torch.manual_seed(5)
    single = DDCLQuantizer(8, 4, recipe="plain")
    torch.manual_seed(200)
    both = torch.cat([data[0, 0], data[1, 0]])
    single(both)
    assert torch.equal(two_ranks[0]["ddcl"], single.prototypes.detach())
    from_rank1 = [bool((data[1, 0] == p).all(1).any()) for p in two_ranks[0]["ddcl"]]
    assert any(from_rank1) and not all(from_rank1)  # this draw mixes both ranks' tokens
    torch.manual_seed(5)
    few = DDCLQuantizer(8, 4, recipe="plain")
    torch.manual_seed(300)
    few(torch.cat([data[0, 0, :3], data[1, 0, :3]]))
    torch.testing.assert_close(two_ranks[0]["few"], few.prototypes.detach())
    assert torch.unique(two_ranks[0]["few"], dim=0).shape[0] == 8


def test_latent_norm_uses_the_statistics_of_both_ranks(two_ranks):
    images = _images()
    single = _latent_norm_steps([torch.cat([images[0, step], images[1, step]]) for step in range(2)])
    for key in ("y0", "grad0", "y1", "grad1"):  # each rank's rows of the one-process result
        both = torch.cat([two_ranks[0][f"norm_{key}"], two_ranks[1][f"norm_{key}"]])
        torch.testing.assert_close(both, single[key], rtol=1e-12, atol=1e-12, msg=key)
    for key in ("mean", "var"):  # first step taken whole, then the usual momentum
        torch.testing.assert_close(two_ranks[0][f"norm_{key}"], single[key], rtol=1e-12, atol=1e-12)
        assert torch.equal(two_ranks[0][f"norm_{key}"], two_ranks[1][f"norm_{key}"])
    # and the global statistics differ from either rank's own: the check can tell them apart
    alone = _latent_norm_steps([images[0, step] for step in range(2)], slice(0, 5))
    assert not torch.allclose(alone["y0"], two_ranks[0]["norm_y0"], atol=1e-3)


def test_replica_differences_finds_one_differing_entry_on_every_rank(two_ranks):
    assert two_ranks[0]["equal"] == two_ranks[1]["equal"] == {}
    assert two_ranks[0]["differ"] == two_ranks[1]["differ"] == {"weight": 1}


def test_replica_check_stops_every_rank_naming_the_step_and_tensor(two_ranks):
    for rank in (0, 1):
        assert two_ranks[rank]["raised"] == ("after global step 12 the codebook differs between the 2 processes: "
                                             "weight (1 entries)")
        assert two_ranks[rank]["checks"] == 1  # and passes once the replicas agree again


def test_non_finite_batch_on_one_rank_stops_both(two_ranks):
    for rank in (0, 1):
        assert two_ranks[rank]["nan"] == ("training batch 7 of epoch 1 (global step 0) holds 1 NaN/Inf pixel value(s) "
                                          "out of 768: the data is corrupt")


@pytest.mark.parametrize("top_k", [None, 3])
def test_in_layer_recipe_over_two_ranks_equals_one_process_on_the_whole_batch(two_ranks, top_k):
    """Standardisation statistics, temperature (calibration and control), EMA prototypes, restarts, outputs and input
    gradients of the default DDCLQuantizer (and with top-k assignments) on 2 gloo processes against one process on
    both batches."""
    data = _data()
    single = _recipe_steps([torch.cat([data[0, step], data[1, step]]) for step in range(3)], slice(None), top_k=top_k)
    prefix = "recipe_" if top_k is None else "recipe_top_k_"
    assert int(single["restarts"]) > 0  # the run exercises restarts
    for key in ("prototypes", "mean", "var", "temperature", "restarts"):
        torch.testing.assert_close(two_ranks[0][f"{prefix}{key}"], single[key], rtol=1e-10, atol=1e-12, msg=key)
        assert torch.equal(two_ranks[0][f"{prefix}{key}"], two_ranks[1][f"{prefix}{key}"]), key
    for key in ("q0", "grad0", "q1", "grad1", "q2", "grad2"):
        both = torch.cat([two_ranks[0][f"{prefix}{key}"], two_ranks[1][f"{prefix}{key}"]])
        torch.testing.assert_close(both, single[key], rtol=1e-9, atol=1e-11, msg=key)


def test_residual_ddcl_over_two_ranks_equals_one_process_on_the_whole_batch(two_ranks):
    """ResidualDDCL (shared standardisation, three DDCL levels, quantize dropout, restarts) on 2 gloo processes
    against one process on both batches: codebooks, statistics, outputs, input gradients, indices."""
    data = _data() * 2 + 1
    single = _residual_steps([torch.cat([data[0, step], data[1, step]]) for step in range(3)], slice(None))
    for key in ("codebook", "mean"):
        torch.testing.assert_close(two_ranks[0][f"residual_{key}"], single[key], rtol=1e-10, atol=1e-12, msg=key)
        assert torch.equal(two_ranks[0][f"residual_{key}"], two_ranks[1][f"residual_{key}"]), key
    for step in range(3):
        for key in (f"q{step}", f"grad{step}", f"idx{step}"):
            both = torch.cat([two_ranks[0][f"residual_{key}"], two_ranks[1][f"residual_{key}"]])
            torch.testing.assert_close(both, single[key], rtol=1e-9, atol=1e-11, msg=key)


def test_training_steps_never_synchronise_with_the_host_under_a_process_group(two_ranks):
    """The recorder of test_compile on both gloo ranks: no scalar read or data-sized output in DDCL's or HardVQ's
    training steps (the standardiser's token count, once an int() per step, stays on the device)."""
    for rank in (0, 1):
        assert two_ranks[rank]["syncs"] == []
        assert all(n > 0 for n in two_ranks[rank]["sync_restarts"])  # the restart paths ran inside the recorder
