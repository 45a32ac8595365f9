"""A short check of the codebooks and the trainer on one CUDA GPU (about 3 minutes; exits 1 on a failed check).

    python -m eval.gpu_check                       # synthetic CIFAR-sized images, no data needed
    python -m eval.gpu_check --data-root DATA      # the epoch on real CIFAR-10 (softvq-train's --data.data_root)

1. DDCLQuantizer (its defaults and the plain layer) and HardVQ (EMA + restart): forward and backward on the GPU equal
   the CPU's on the same state and batch (outputs, input gradients, the updated codebook).
2. Under bf16 autocast the codebooks still compute in float32 and return float32 assignments, with finite gradients.
3. No host-device synchronisation in the training steps after the first: ``torch.cuda.set_sync_debug_mode("error")``
   raises on any (with the finite check off, as a tuned loop runs it).
4. ``torch.compile(fullgraph=True)`` of both codebooks: no graph break, the same outputs as eager, and the step times.
5. One epoch of the default VQ-VAE (DDCL and hard VQ) with Lightning on one GPU, bf16-mixed: images per second.

Prints one line per check and a summary table. Needs nothing beyond ``pip install -e .[train]``.
"""

from __future__ import annotations

import argparse
import copy
import statistics
import sys
import time

import torch

from eval._hard import HARD_RESTART, HARD_RESTART_FLAGS
from eval.harness import truncated_layer
from softvq import DDCLQuantizer, HardVQ

FAILED: list[str] = []


def check(name: str, ok: bool, detail: str = "") -> None:
    print(f"[{'ok' if ok else 'FAIL'}] {name}{': ' + detail if detail else ''}", flush=True)
    if not ok:
        FAILED.append(name)


def layers(num_codes: int = 512) -> dict[str, torch.nn.Module]:
    """The checked layers; ``ddcl_top_k`` with k at the accuracy bound measured on a CPU, K / 4 up to 512 codes and
    K / 8 above (docs/scaling.md, "Top-k assignments"), and ``ddcl_k16``, the per-second candidate."""
    k = num_codes // 4 if num_codes <= 512 else num_codes // 8
    return {"ddcl": DDCLQuantizer(num_codes, 64, check_finite=False),
            "ddcl_top_k": DDCLQuantizer(num_codes, 64, top_k=k, check_finite=False),
            # the per-second candidate of eval.per_second: its two-stage selection (softvq._kernels.top_k_rows)
            "ddcl_k16": truncated_layer(num_codes, 64, 16, {"check_finite": False}),
            "ddcl_plain": DDCLQuantizer(num_codes, 64, recipe="plain", check_finite=False),
            "hard": HardVQ(num_codes, 64, ema_decay=0.99, restart=HARD_RESTART, check_finite=False)}


def large_codebooks(z: torch.Tensor, sizes: list[int]) -> dict[int, dict[str, float]]:
    """Eager fwd+bwd ms of the exact layer, top-k and HardVQ at larger K (where top-k is meant to pay)."""
    ms: dict[int, dict[str, float]] = {}
    z = z.cuda()
    for k in sizes:
        built = {name: layer.cuda().train() for name, layer in layers(k).items() if name != "ddcl_plain"}
        for layer in built.values():
            step(layer, z, 0)  # initialisation and the first temperature
        ms[k] = {name: timed(layer, z) for name, layer in built.items()}
    return ms


def step(layer: torch.nn.Module, z: torch.Tensor, seed: int) -> tuple[torch.Tensor, ...]:
    torch.manual_seed(seed)
    x = z.clone().requires_grad_(True)
    out = layer(x)
    (out.quantized.square().mean() + out.loss).backward()
    return out.quantized.detach(), out.indices, x.grad


def close(a: torch.Tensor, b: torch.Tensor, rtol: float) -> tuple[bool, float]:
    a, b = a.double().cpu(), b.double().cpu()
    err = float((a - b).abs().max() / b.abs().max().clamp_min(1e-30))
    return err <= rtol, err


def cuda_equals_cpu(z: torch.Tensor) -> None:
    for name, cpu_layer in layers().items():
        cpu_layer.train()
        step(cpu_layer, z, 0)  # data initialisation and calibration on the CPU: the devices draw differently
        gpu_layer = copy.deepcopy(cpu_layer).cuda()
        for i in range(1, 3):
            qc, ic, gc = step(cpu_layer, z, i)
            qg, ig, gg = step(gpu_layer, z.cuda(), i)
        agree = float((ic == ig.cpu()).float().mean())
        ok_q, err_q = close(qg, qc, 1e-3)
        ok_g, err_g = close(gg, gc, 1e-2)
        check(f"{name}: CUDA forward/backward equals CPU", agree > 0.999 and ok_q and ok_g,
              f"indices agree {agree:.4f}, output rel err {err_q:.1e}, grad rel err {err_g:.1e}")


def bf16_autocast(z: torch.Tensor) -> None:
    for name, layer in layers().items():
        layer = layer.cuda().train()
        x = z.cuda().bfloat16().requires_grad_(True)
        with torch.autocast("cuda", dtype=torch.bfloat16):
            out = layer(x)
            loss = out.quantized.float().square().mean() + out.loss
        loss.backward()
        check(f"{name}: bf16 autocast", out.probs.dtype == torch.float32 and out.quantized.dtype == torch.bfloat16
              and bool(torch.isfinite(x.grad).all()), f"probs {out.probs.dtype}, quantized {out.quantized.dtype}")


def no_sync(z: torch.Tensor) -> None:
    for name, layer in layers().items():
        layer = layer.cuda().train()
        step(layer, z.cuda(), 0)  # the first batch
        torch.cuda.synchronize()
        try:
            torch.cuda.set_sync_debug_mode("error")
            for i in range(3):
                step(layer, z.cuda(), i + 1)
            ok, detail = True, "3 steps"
        except RuntimeError as err:
            ok, detail = False, str(err).splitlines()[0]
        finally:
            torch.cuda.set_sync_debug_mode(0)
        check(f"{name}: training steps without a host-device sync", ok, detail)


def timed(layer: torch.nn.Module, z: torch.Tensor, reps: int = 20) -> float:
    times = []
    for i in range(reps):
        torch.cuda.synchronize()
        start = time.perf_counter()
        step(layer, z, i)
        torch.cuda.synchronize()
        times.append(time.perf_counter() - start)
    return statistics.median(times) * 1e3


def compiled(z: torch.Tensor) -> dict[str, tuple[float, float]]:
    ms = {}
    z = z.cuda()
    for name, eager in layers().items():
        eager = eager.cuda().train()
        step(eager, z, 9)  # the first batch eagerly: compiled code draws its random numbers differently
        comp = copy.deepcopy(eager)
        comp.compile(fullgraph=True)
        try:
            for i in range(3):
                qe, ie, _ = step(eager, z, 10 + i)
                qc, ic, _ = step(comp, z, 10 + i)
            ok, err = close(qc, qe, 1e-3)
            check(f"{name}: torch.compile(fullgraph=True)", ok and bool((ic == ie).float().mean() > 0.999),
                  f"output rel err {err:.1e}")
            ms[name] = (timed(eager, z), timed(comp, z))
        except Exception as err:  # a graph break under fullgraph=True raises here
            check(f"{name}: torch.compile(fullgraph=True)", False, f"{type(err).__name__}: {err}")
    return ms


def train_epoch(args: argparse.Namespace) -> dict[str, float]:
    """images/s of one epoch of the default VQ-VAE per quantizer, on one GPU with bf16-mixed."""
    import lightning as L
    from torch.utils.data import DataLoader, TensorDataset

    from softvq.cli import config
    from softvq.models import VQVAE

    rates = {}
    for quantizer in ("ddcl", "hard"):
        cfg = config.parse(["--quantizer", quantizer, "--hard.ema_decay", "0.99", *HARD_RESTART_FLAGS])
        model = VQVAE(**config.model_kwargs(cfg, quantizer))
        if args.data_root:
            from softvq.data import CIFAR10DataModule

            cfg = config.parse(["--data.data_root", args.data_root, "--data.train_subset", str(args.images),
                                "--data.val_size", "1000"])
            data: object = CIFAR10DataModule(**config.data_kwargs(cfg))
            fit_kwargs = {"datamodule": data}
        else:
            images = torch.rand(args.images, 3, 32, 32)
            loader = DataLoader(TensorDataset(images, torch.zeros(args.images, dtype=torch.long)),
                                batch_size=cfg.data.batch_size, shuffle=True)
            fit_kwargs = {"train_dataloaders": loader}
        for _epoch in range(2):  # the first epoch warms up (cuDNN autotuning, allocator)
            trainer = L.Trainer(accelerator="gpu", devices=1, precision="bf16-mixed", max_epochs=1, logger=False,
                                enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                                num_sanity_val_steps=0, limit_val_batches=0)
            start = time.perf_counter()
            trainer.fit(model, **fit_kwargs)
            torch.cuda.synchronize()
            seconds = time.perf_counter() - start
        rates[quantizer] = args.images / seconds
        check(f"{quantizer}: one bf16-mixed epoch on one GPU", True, f"{rates[quantizer]:.0f} images/s")
    return rates


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--data-root", help="CIFAR-10 for the epoch (default: in-memory random images)")
    parser.add_argument("--images", type=int, default=20000, help="training images in the epoch (default 20000)")
    parser.add_argument("--tokens", type=int, default=32768, help="tokens per codebook step (default 32768)")
    parser.add_argument("--large-codes", type=int, nargs="*", default=[4096, 16384],
                        help="codebook sizes of the exact / top-k / HardVQ timing (default 4096 16384)")
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        print("no CUDA device: nothing to check", file=sys.stderr)
        return 2
    print(f"torch {torch.__version__}, {torch.cuda.get_device_name()}", flush=True)
    torch.manual_seed(0)
    z = torch.randn(args.tokens, 64)
    cuda_equals_cpu(z[:8192])
    bf16_autocast(z)
    no_sync(z)
    ms = compiled(z)
    large = large_codebooks(z, args.large_codes)
    rates = train_epoch(args)
    print(f"\n| codebook (N={args.tokens}, K=512, D=64) | eager ms | compiled ms |\n|---|---|---|")
    for name, (e, c) in ms.items():
        print(f"| {name} | {e:.2f} | {c:.2f} |")
    if "ddcl" in ms and "hard" in ms:
        print(f"\nDDCL / HardVQ fwd+bwd: eager {ms['ddcl'][0] / ms['hard'][0]:.2f}x, "
              f"compiled {ms['ddcl'][1] / ms['hard'][1]:.2f}x")
    for k, row in large.items():
        print(f"K={k}: " + ", ".join(f"{name} {v:.2f} ms" for name, v in row.items())
              + f"; top-k / exact {row['ddcl_top_k'] / row['ddcl']:.2f}x, "
              f"exact / hard {row['ddcl'] / row['hard']:.2f}x")
    if len(rates) == 2:
        print(f"VQ-VAE epoch images/s: DDCL {rates['ddcl']:.0f}, hard {rates['hard']:.0f} "
              f"({rates['ddcl'] / rates['hard']:.3f}x)")
    print("FAILED: " + ", ".join(FAILED) if FAILED else "all checks passed")
    return 1 if FAILED else 0


if __name__ == "__main__":
    sys.exit(main())
