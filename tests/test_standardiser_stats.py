"""eval.standardiser_stats: the three ways of taking the token standardiser's statistics, against hand computations."""

from __future__ import annotations

import math

import torch

import softvq
from eval import standardiser_stats as ss
from softvq.models import VQVAE
from softvq.parts import TokenStandardizer


def tiny(quantizer: torch.nn.Module) -> VQVAE:
    torch.manual_seed(0)
    model = VQVAE(quantizer=quantizer, code_dim=8, width=16, res_hidden=8, res_blocks=1)
    model.train()
    images = torch.rand(32, 3, 16, 16)
    for step in range(3):  # initialise the codebook and move the running statistics
        model.training_step((images, torch.zeros(32, dtype=torch.long)), step)
    return model.eval()


def test_the_standardiser_on_the_encoders_tokens_is_found():
    single, stack = tiny(softvq.DDCLQuantizer(16, 8)), tiny(softvq.ResidualDDCL(3, 16, 8))
    assert ss.standardisers(single) == [single.quantizer.standardizer]
    assert ss.standardisers(stack) == [stack.quantizer.standardizer]  # the levels' own ones are unused
    per_level = tiny(softvq.ResidualDDCL(3, 16, 8, scale="per_level"))
    assert ss.standardisers(per_level) == [level.standardizer for level in per_level.quantizer.levels]


def test_three_modes_against_hand_computations():
    model = tiny(softvq.ResidualDDCL(2, 16, 8))
    s = model.quantizer.standardizer
    batches = [(torch.rand(8, 3, 16, 16), torch.zeros(8, dtype=torch.long)) for _ in range(3)]
    tokens = torch.cat([model.latents(x).movedim(1, -1).reshape(-1, 8) for x, _ in batches]).double()
    mean, var = ss.precise_statistics(model, batches, s)
    torch.testing.assert_close(mean, tokens.mean(0))
    torch.testing.assert_close(var, tokens.var(0, unbiased=True))

    def by_hand() -> float:  # per-image PSNR of the hard reconstruction, averaged
        with torch.no_grad():
            values = [10 * math.log10(1 / float((model(x[i:i + 1]).reconstruction.clamp(0, 1) - x[i:i + 1])
                                                .square().mean())) for x, _ in batches for i in range(len(x))]
        return sum(values) / len(values)

    assert s.eval_statistics == "applied"  # the default: model(x) in eval mode is the applied mode
    assert abs(ss.val_psnr(model, batches, "applied") - by_hand()) < 1e-3
    s.eval_statistics = "running"
    assert abs(ss.val_psnr(model, batches, "running") - by_hand()) < 1e-3
    running = s.running_mean.clone(), s.running_var.clone()
    one = batches[:1]
    batch_psnr = ss.val_psnr(model, one, "batch")
    assert torch.equal(s.running_mean, running[0]) and torch.equal(s.running_var, running[1])  # nothing moved
    assert not s.training and s.renorm  # ResidualDDCL's batch renormalisation, off for the batch pass only
    x = one[0][0]
    t = model.latents(x).movedim(1, -1).reshape(-1, 8)
    s.running_mean.copy_(t.mean(0))
    s.running_var.copy_(t.var(0, unbiased=False))  # training mode standardises with the biased batch variance
    assert abs(ss.val_psnr(model, one, "running") - batch_psnr) < 1e-4


def test_policies_from_a_recorded_trajectory_reproduce_the_layers_applied_statistics():
    s = TokenStandardizer(4, renorm=True, renorm_clip=(1.1, 0.1), eval_momentum=0.5).double()
    recorder = ss.Trajectory()
    s.register_forward_hook(recorder.hook)
    torch.manual_seed(0)
    for step, n in enumerate((64, 64, 64, 16)):  # a drifting encoder, and an epoch's short last batch
        s(torch.randn(n, 4, dtype=torch.float64) * (1 + 0.2 * step) + 0.5 * step)
    traj = recorder.state()
    assert traj["count"].tolist() == [64, 64, 64, 16]
    rules = ss.policies(traj, momentum=0.5)
    mean, std = rules["applied_step"]  # the layer's own rule, recomputed from what it applied
    torch.testing.assert_close(mean, s.applied_mean, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(std, s.applied_var.sqrt(), rtol=1e-12, atol=1e-12)
    # per token: the 16-token batch weighs 1 - 0.5 ** (16 / 64); without short batches: the first three steps only
    w = 1 - 0.5 ** 0.25
    before = ss._ema(traj["shift"][:3], torch.full((3,), 0.5, dtype=torch.float64))
    torch.testing.assert_close(rules["applied_token"][0], before + w * (traj["shift"][3] - before))
    torch.testing.assert_close(rules["applied_full_batches"][0], before)
