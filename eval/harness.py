"""The training harness every study trains through: the bottlenecks by name (:func:`build`, vector-quantize-pytorch's
behind :class:`PeerAdapter`), the project's VQ-VAE trained and tested on CIFAR-10 (:func:`fit_run`, its settings
:func:`settings_of` from the flags of :func:`add_vqvae_arguments`), and what a study starts with (:func:`study_run`).

Methods (``LABELS``; each configured as its own documentation recommends):
    ddcl        ``softvq.DDCLQuantizer(K, D)``, the layer's defaults (recipe="auto"; from K = 2049 on truncated,
                ``top_k="auto"``: the computation of ddcl_k16 up to K = 8192, of ddcl_k32 above)
    ddcl_exact  ``softvq.DDCLQuantizer(K, D, top_k=None)``, the exact layer: the default up to K = 2048, and at every K
                before ``top_k="auto"`` (the studies' ``ddcl`` rows at K >= 4096 measured before it are this)
    ddcl_h25, ddcl_wide, ddcl_top128, ddcl_top256  the exact layer with another entropy target, or truncated to 128 /
                256 codes with the exact layer's target ``log K / 2`` (as they were measured)
    ddcl_k16, ddcl_k32, ddcl_k64  truncated to each token's k nearest prototypes with an entropy target that k can
                hold, ``log(k) - 0.5`` nats (:func:`truncated_target`): the per-second candidates of eval.per_second
                (ddcl_k64, the widest, 3.66 nats: whether a wider target keeps the exact layer's lead in long runs)
    ddcl_amortised  hard VQ's search with an amortised Jacobian: each code's Boltzmann distribution over its 16
                nearest codes, target log(16) - 0.5 nats, the width of ddcl_k16 (eval/amortised.py, a prototype)
    ddcl_n16, ddcl_n32  the truncation of ddcl_k16 / ddcl_k32 with another set: the k codes nearest to each token's
                nearest code (a table refreshed round robin; eval/neighbour.py, a prototype): one argmax pass, no
                selection over K; ddcl_c16: the token's 16 nearest among the 64 codes nearest its code
    ddcl_anneal  the same truncation cooled over the run (:class:`Anneal`): k = 128, 64, 32 in thirds of the steps,
                each with its target ``log(k) - 0.5``: wide early, narrow late (the paper's annealing, Theorems 2-3)
    ddcl_rho    the layer's defaults with a commitment of each token to its code whose gradient is held at 0.2 of the
                decoder's, as HardVQ's is (eval/commit_ratio.py, a prototype of the small-autoencoder study)
    ddcl_rhoz   the same, held at 0.2 of the gradient the layer passes to its tokens (the soft centroid's Jacobian
                applied to the decoder's gradient), which straight-through's ratio compares with
    ddcl_rhoz05, ddcl_rhoz10  the same at 0.05 and 0.1
    ddcl_rhoz_pc  ddcl_rhoz with, per token, the part of the pull that opposes the tokens' gradient dropped (PCGrad)
    ddcl_st     a probe: the defaults with straight-through's gradient in place of the soft centroid's Jacobian
    ddcl_nostd  a probe: the defaults without the standardiser
    hard_ema    ``softvq.HardVQ(K, D, ema_decay=0.99, restart=softvq.Restart(1.0, decay=0.99, cap=None))``
    hard_ema_cap  the same with the restart threshold capped at a quarter of the mean tokens per code per batch
                (``Restart(1.0, decay=0.99, cap=0.25)``, the cap of ``softvq.Restart``'s defaults): the cap binds
                from K = N / 4 (2,048 codes at 8,192 tokens a batch), and from K = N on, where the mean code wins
                under one token a batch, the uncapped threshold restarts most codes every step
    vqp_vq      vector-quantize-pytorch ``VectorQuantize(kmeans_init=True, dead_code_threshold_ratio=0.1,
                rotation_trick=True)`` (:data:`VQP_RECIPE`), the recipe its README gives against dead codes
    vqp_fsq     vector-quantize-pytorch ``FSQ`` at the FSQ paper's levels for K (:func:`fsq_levels`) with its
                input/output projection
    vqp_simvq   vector-quantize-pytorch ``SimVQ``, its defaults (rotation trick, frozen codebook + learned projection)
    vqp_simvq_paper  ``SimVQ`` as its authors' code configures it (youngsheen/SimVQ, ``taming/modules/vqvae/
                quantize.py``): the projection ``nn.Linear(D, D)`` with a bias, straight-through gradient (no rotation
                trick), codebook term 1 and commitment 0.25
"""

from __future__ import annotations

import argparse
import contextlib
import json
import logging
import math
import time
import warnings
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any

import lightning as L
import numpy as np
import torch
import torch.nn.functional as F
from torch import Tensor, nn

import softvq
from eval._hard import HARD_RESTART, HARD_RESTART_CAPPED, VQP_RECIPE
from eval._provenance import loaded_code
from eval.amortised import AmortisedDDCL
from eval.commit_ratio import RatioCommitDDCL
from eval.neighbour import neighbour_layer
from softvq.data.cifar10 import CIFAR10DataModule
from softvq.models import VQVAE
from softvq.models.callbacks import HistoryWriter
from softvq.parts.temperature import auto_target_entropy
from softvq.types import QuantizerOutput

loaded_code()  # pinned at import: what this process runs (eval._provenance.loaded_code)

LABELS = {
    "ddcl": "softvq DDCL, defaults",
    "ddcl_exact": "softvq DDCL, top_k=None (the exact layer)",
    "ddcl_h25": "softvq DDCL, former defaults (target entropy min(2.5, log K / 2) nats)",
    "ddcl_wide": "softvq DDCL, target entropy min(log K / 2, log(D + 1)) nats",
    "ddcl_top128": "softvq DDCL, top_k=128 (each token's 128 nearest prototypes), target log K / 2",
    "ddcl_top256": "softvq DDCL, top_k=256 (each token's 256 nearest prototypes), target log K / 2",
    "ddcl_k16": "softvq DDCL, top_k=16, target entropy log(16) - 0.5 nats",
    "ddcl_k32": "softvq DDCL, top_k=32, target entropy log(32) - 0.5 nats",
    "ddcl_k64": "softvq DDCL, top_k=64, target entropy log(64) - 0.5 nats",
    "ddcl_amortised": "DDCL with an amortised Jacobian (each code's distribution over its 16 nearest codes)",
    "ddcl_anneal": "softvq DDCL, top_k 128 -> 64 -> 32 by thirds of the run, target entropy log(k) - 0.5 nats",
    "ddcl_n16": "DDCL truncated to the 16 codes nearest each token's code, target log(16) - 0.5 nats",
    "ddcl_n32": "DDCL truncated to the 32 codes nearest each token's code, target log(32) - 0.5 nats",
    "ddcl_c16": "DDCL truncated to the token's 16 nearest among the 64 codes nearest its code, target log(16) - 0.5",
    "ddcl_rho": "softvq DDCL, defaults, with a commitment held at 0.2 of the decoder's gradient (eval/commit_ratio.py)",
    "ddcl_rhoz": "softvq DDCL, defaults, with a commitment held at 0.2 of the tokens' gradient (eval/commit_ratio.py)",
    "ddcl_rhoz05": "softvq DDCL, defaults, with a commitment held at 0.05 of the tokens' gradient (commit_ratio.py)",
    "ddcl_rhoz10": "softvq DDCL, defaults, with a commitment held at 0.1 of the tokens' gradient (commit_ratio.py)",
    "ddcl_rhoz_pc": "softvq DDCL, defaults, ddcl_rhoz's pull less its part opposing the tokens' gradient",
    "ddcl_st": "softvq DDCL, defaults, straight-through's gradient in place of the soft centroid's (a probe)",
    "ddcl_nostd": "softvq DDCL, defaults without the standardiser (a probe)",
    "hard_ema": "softvq HardVQ, EMA 0.99 + restart 1",
    "hard_ema_cap": "softvq HardVQ, EMA 0.99 + restart 1 capped at N / (4K)",
    "vqp_vq": "vqp VectorQuantize (kmeans init, dead-code ratio 0.1, rotation trick)",
    "vqp_fsq": "vqp FSQ [8,8,8]",
    "vqp_simvq": "vqp SimVQ, defaults",
    "vqp_simvq_paper": "vqp SimVQ as its authors configure it (biased projection, straight-through)",
}
METHODS = tuple(LABELS)
TOP_K = {"ddcl_top128": 128, "ddcl_top256": 256}  # DDCL's top-k truncations
TRUNCATED = {"ddcl_k16": 16, "ddcl_k32": 32, "ddcl_k64": 64}  # top-k with a target k can hold (truncated_target)
# the same width over the neighbours of the token's code: (r, candidates R)
NEIGHBOURS = {"ddcl_n16": (16, None), "ddcl_n32": (32, None), "ddcl_c16": (16, 64)}
ANNEAL_K = (128, 64, 32)  # ddcl_anneal's k over the thirds of a run


def truncated_target(k: int, num_codes: int) -> float | None:
    """The entropy target of a layer truncated to ``k`` of ``num_codes`` prototypes, the recipe's own
    (:func:`softvq.parts.temperature.auto_target_entropy`, what ``target_entropy="auto"`` gives beside ``top_k=k``):
    ``log(k) - 0.5`` nats, a target the ``k`` can hold, and no more than the exact layer's ``log(K) / 2``."""
    return auto_target_entropy(num_codes, k)


def truncated_layer(num_codes: int, dim: int, k: int, extra: dict[str, Any] | None = None) -> softvq.DDCLQuantizer:
    """``DDCLQuantizer`` truncated to each token's ``k`` nearest prototypes (at most ``K / 4``) with
    :func:`truncated_target`: ``ddcl_k16``, ``ddcl_k32`` and each phase of ``ddcl_anneal``; ``extra`` overrides."""
    k = min(k, max(1, num_codes // 4))
    return softvq.DDCLQuantizer(num_codes, dim, **{"top_k": k, "target_entropy": truncated_target(k, num_codes),
                                                   **(extra or {})})


class Anneal(L.Callback):
    """``ddcl_anneal``'s schedule: before every training step, the layer's ``top_k`` and entropy target for the part
    of the run done (``trainer.global_step`` of ``trainer.estimated_stepping_batches``): :data:`ANNEAL_K` in equal
    thirds, each k with :func:`truncated_target`. The temperature control follows the target from the T it has."""

    def on_train_batch_start(self, trainer: L.Trainer, pl_module: L.LightningModule, batch: Any,
                             batch_idx: int) -> None:
        layer = pl_module.quantizer
        k = anneal_k(trainer.global_step, int(trainer.estimated_stepping_batches), layer.num_codes)
        if layer.top_k != k:
            layer.top_k = k
            layer.target_entropy = truncated_target(k, layer.num_codes)


def anneal_k(step: int, total: int, num_codes: int) -> int:
    """``ddcl_anneal``'s k at optimizer step ``step`` of ``total``: :data:`ANNEAL_K` by thirds, at most ``K / 4``."""
    phase = min(len(ANNEAL_K) - 1, step * len(ANNEAL_K) // max(total, 1))
    return min(ANNEAL_K[phase], max(1, num_codes // 4))


def method_callbacks(method: str) -> list[L.Callback]:
    """The Lightning callbacks a method trains with (its schedule; none for most)."""
    return [Anneal()] if method == "ddcl_anneal" else []


def _vqp() -> Any:
    try:
        import vector_quantize_pytorch
    except ImportError as err:
        raise SystemExit("vector-quantize-pytorch is not installed: pip install -e '.[bench]'") from err
    return vector_quantize_pytorch


class PeerAdapter(nn.Module):
    """A vector-quantize-pytorch quantizer behind softvq's interface: channel-last tokens ``(..., D)`` in, a
    :class:`~softvq.QuantizerOutput` out (``probs`` one-hot), ``decode_indices``, ``codebook`` and ``restarts``.

    It only reshapes and renames; the wrapped module computes everything (its own loss, straight-through or rotation
    gradient, EMA and dead-code replacement).
    """

    def __init__(self, module: nn.Module, kind: str, num_codes: int, dim: int) -> None:
        super().__init__()
        self.module, self.kind, self.num_codes, self.dim = module, kind, num_codes, dim
        self._restarts = 0
        codebook = getattr(module, "_codebook", None)
        if kind == "vq" and codebook is not None and hasattr(codebook, "replace"):
            replace = codebook.replace

            def counting_replace(batch_samples: Tensor, batch_mask: Tensor, *args: Any, **kwargs: Any) -> Any:
                self._restarts += int(batch_mask.sum())  # codes the library moves onto batch samples
                return replace(batch_samples, batch_mask, *args, **kwargs)

            codebook.replace = counting_replace

    @property
    def restarts(self) -> int:
        """Dead codes the wrapped module replaced so far (0 for methods without replacement)."""
        return self._restarts

    def forward(self, z: Tensor) -> QuantizerOutput:
        lead = z.shape[:-1]
        flat = z.reshape(z.shape[0], -1, self.dim)  # (B, N, D): the libraries' sequence layout
        if self.kind == "fsq":
            quantized, indices = self.module(flat)
            loss = flat.new_zeros(())
        else:
            quantized, indices, loss = self.module(flat)
            loss = loss.sum()
        indices = indices.reshape(lead).long()
        probs = F.one_hot(indices, self.num_codes).float()
        return QuantizerOutput(quantized.reshape(z.shape), indices, probs, loss, {})

    @torch.no_grad()
    def decode_indices(self, indices: Tensor) -> Tensor:
        flat = indices.reshape(indices.shape[0], -1)
        if self.kind == "vq":
            codes = self.module.get_output_from_indices(flat)
        else:
            codes = self.module.indices_to_codes(flat)
        return codes.reshape(*indices.shape, self.dim)

    @property
    def codebook(self) -> Tensor:
        """``(K, D)``, the codes in the space the decoder sees."""
        return self.decode_indices(torch.arange(self.num_codes, device=self._device())[None]).reshape(-1, self.dim)

    def _device(self) -> torch.device:
        tensors = [*self.module.parameters(), *self.module.buffers()]
        return tensors[0].device if tensors else torch.device("cpu")


def build(method: str, num_codes: int, dim: int, overrides: dict[str, Any] | None = None) -> nn.Module:
    """The bottleneck ``method`` for ``num_codes`` codes of dimension ``dim``; ``overrides`` replace options of its
    recommended configuration (a probe of one option, e.g. ``{"dead_code_threshold_ratio": 0.0}``: VectorQuantize
    without its dead-code replacement)."""
    extra = dict(overrides or {})
    if method == "ddcl":
        return softvq.DDCLQuantizer(num_codes, dim, **extra)
    # the exact layer and its variants, as measured before top_k="auto": top_k and the target pinned
    exact = {"top_k": None}
    if method == "ddcl_exact":
        return softvq.DDCLQuantizer(num_codes, dim, **{**exact, **extra})
    if method == "ddcl_h25":  # the studies' DDCL rows measured before the entropy target became log K / 2
        return softvq.DDCLQuantizer(num_codes, dim, **{**exact, "target_entropy": former_entropy_target(num_codes),
                                                       **extra})
    if method == "ddcl_wide":
        # the exact layer's log K / 2 held below log(D + 1), where exp(H) ~ D + 1 prototypes share a token; the same
        # layer as the exact one up to K = (D + 1)^2 (docs/design.md, "Training to the end")
        return softvq.DDCLQuantizer(num_codes, dim, **{**exact, "target_entropy": wide_entropy_target(num_codes, dim),
                                                       **extra})
    if method in TOP_K:  # truncated to each token's k nearest, with the exact layer's target log K / 2 (unreachable)
        return softvq.DDCLQuantizer(num_codes, dim, **{"top_k": TOP_K[method], "target_entropy": 0.5 * math.log(
            num_codes) if num_codes > 1 else None, **extra})
    if method in TRUNCATED or method == "ddcl_anneal":  # truncated, with a target k can hold (Anneal moves both)
        return truncated_layer(num_codes, dim, TRUNCATED.get(method, ANNEAL_K[0]), extra)
    if method in NEIGHBOURS:  # a prototype of eval.per_second, beside the library
        return neighbour_layer(num_codes, dim, *NEIGHBOURS[method], extra)
    if method == "ddcl_nostd":  # a probe of the small-autoencoder study: the defaults without the standardiser
        return softvq.DDCLQuantizer(num_codes, dim, **{"standardize": False, **extra})
    if method == "ddcl_st":  # a probe of the small-autoencoder study: straight-through's gradient, DDCL's other parts
        from eval.small_ae import StraightThroughDDCL  # imported here: the study's module is not the harness's

        return StraightThroughDDCL(num_codes, dim, **extra)
    if method in ("ddcl_rho", "ddcl_rhoz", "ddcl_rhoz05", "ddcl_rhoz10", "ddcl_rhoz_pc"):  # the small-AE study's
        against = "output" if method == "ddcl_rho" else "tokens"
        rho = {"ddcl_rhoz05": 0.05, "ddcl_rhoz10": 0.1}.get(method, 0.2)
        return RatioCommitDDCL(num_codes, dim, **{"rho": rho, "against": against,
                                                  "surgery": method == "ddcl_rhoz_pc", **extra})
    if method == "ddcl_amortised":  # a prototype of eval.per_second, beside the library
        return AmortisedDDCL(num_codes, dim, **{"neighbours": 16, **extra})
    if method in ("hard_ema", "hard_ema_cap"):
        restart = HARD_RESTART if method == "hard_ema" else HARD_RESTART_CAPPED
        return softvq.HardVQ(num_codes, dim, **{"ema_decay": 0.99, "restart": restart, **extra})
    vqp = _vqp()
    if method == "vqp_vq":
        options = {**VQP_RECIPE, **extra}
        return PeerAdapter(vqp.VectorQuantize(dim=dim, codebook_size=num_codes, **options), "vq", num_codes, dim)
    if method == "vqp_fsq":
        levels = fsq_levels(num_codes)
        return PeerAdapter(vqp.FSQ(levels=levels, dim=dim, **extra), "fsq", int(np.prod(levels)), dim)
    if method == "vqp_simvq_paper":
        options = {"codebook_transform": nn.Linear(dim, dim), "rotation_trick": False,
                   "input_to_quantize_commit_loss_weight": 0.25, "commitment_weight": 1.0, **extra}
        return PeerAdapter(vqp.SimVQ(dim=dim, codebook_size=num_codes, **options), "simvq", num_codes, dim)
    if method == "vqp_simvq":
        return PeerAdapter(vqp.SimVQ(dim=dim, codebook_size=num_codes, **extra), "simvq", num_codes, dim)
    raise ValueError(f"unknown method {method!r}; choose from {METHODS}")


def former_entropy_target(num_codes: int) -> float | None:
    """``min(2.5, log K / 2)`` nats, ``None`` for one code: ``ddcl_h25``'s, the layer's entropy target before it
    became ``log K / 2`` (about 12 prototypes per token from K = 149 on; docs/design.md, "Training to the end")."""
    return min(2.5, 0.5 * math.log(num_codes)) if num_codes > 1 else None


def wide_entropy_target(num_codes: int, dim: int) -> float:
    """``min(log K / 2, log(D + 1))`` nats: the entropy target of ``ddcl_wide`` (4.159 at K = 4096, D = 64)."""
    if num_codes < 2 or dim < 1:
        raise ValueError(f"the wide entropy target needs num_codes >= 2 and dim >= 1, got {num_codes} and {dim}")
    return min(0.5 * math.log(num_codes), math.log(dim + 1))


def fsq_levels(num_codes: int) -> list[int]:
    """FSQ levels whose product is ``num_codes``, from the FSQ paper's recommended sets where it has one."""
    # 4096 and 16384 have no exact set: [7, 5, 5, 5, 5] (4,375 codes) and [8, 8, 8, 6, 5] (15,360) are the paper's
    # nearest.
    table = {64: [4, 4, 4], 256: [8, 8, 4], 512: [8, 8, 8], 1024: [8, 5, 5, 5], 4096: [7, 5, 5, 5, 5],
             16384: [8, 8, 8, 6, 5]}
    if num_codes not in table:
        raise ValueError(f"FSQ needs a codebook size with known levels {sorted(table)}, got {num_codes}")
    return table[num_codes]


class Throughput(L.Callback):
    """Training images per second of each epoch (``per_epoch``) and this process's CPU seconds in it (``cpu_per_epoch``:
    unlike wall time, a pause (SIGSTOP) or a shared core does not count): the training loop alone (data loading
    included, validation not)."""

    def __init__(self) -> None:
        self.per_epoch: list[float] = []
        self.cpu_per_epoch: list[float] = []
        self._start = self._cpu_start = 0.0
        self._images = 0
        self._open = False

    def on_train_epoch_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self._start, self._cpu_start, self._images, self._open = time.perf_counter(), time.process_time(), 0, True

    def on_train_batch_end(self, trainer: L.Trainer, pl_module: L.LightningModule, outputs: Any, batch: Any,
                           batch_idx: int) -> None:
        self._images += batch[0].shape[0]

    def _close(self) -> None:
        if self._open:
            self.per_epoch.append(self._images / max(time.perf_counter() - self._start, 1e-9))
            self.cpu_per_epoch.append(time.process_time() - self._cpu_start)
            self._open = False

    def on_validation_epoch_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        if not trainer.sanity_checking:
            self._close()

    def on_train_epoch_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self._close()


def settings_of(args: argparse.Namespace) -> dict[str, Any]:
    """What a run's result depends on (besides method and seed); a stored run with other settings is retrained."""
    return {"epochs": args.epochs, "train_subset": args.train_subset, "val_size": args.val_size,
            "threads": args.threads,
            "batch_size": args.batch_size, "num_codes": args.num_codes, "code_dim": args.code_dim,
            "width": args.width, "res_blocks": args.res_blocks, "res_hidden": args.res_hidden, "lr": args.lr,
            "test_limit": args.test_limit, "data": str(args.data_root),
            # a study judged on validation (``split="validation"``) never reads the test split; the key is absent for
            # the test split, so the records of runs made before it existed still match
            **({"split": args.split} if getattr(args, "split", "test") != "test" else {})}


def fit_run(method: str, seed: int, args: argparse.Namespace, out: Path,
            quantizer: Callable[[], nn.Module] | None = None, *, test: bool = True, echo: bool = False,
            callbacks: Sequence[L.Callback] = ()) -> tuple[VQVAE, CIFAR10DataModule, dict[str, Any]]:
    """Train one VQ-VAE (bottleneck built by ``quantizer()``, by default ``build(method, ...)``) in ``out`` and test it:
    the trained model, its data module and the run's record (settings, per-epoch history with each epoch's
    training images/s and CPU seconds, test figures, wall time). ``test=False`` never reads the test split (the
    record's ``test`` is ``None``: a study that tunes on validation); ``echo`` prints each epoch's line;
    ``callbacks`` join the trainer's. The study of rate against distortion (``eval/rate_distortion/``) trains
    through this too, so both train exactly the same model: the bottleneck is built here, after seeding, because
    a layer that draws its codebook at construction (HardVQ's uniform initialisation) would otherwise start from
    whatever the caller's random state was (the two studies' HardVQ runs differed for that reason, while data-
    initialised codebooks agreed)."""
    if isinstance(quantizer, nn.Module):
        raise TypeError("fit_run takes a function that builds the bottleneck (called after seeding), not a module")
    out.mkdir(parents=True, exist_ok=True)
    (out / "history.jsonl").unlink(missing_ok=True)
    L.seed_everything(seed, workers=True, verbose=False)
    data = CIFAR10DataModule(args.data_root, batch_size=args.batch_size, val_size=args.val_size,
                             train_subset=args.train_subset, num_workers=args.num_workers, seed=seed)
    quantizer = build(method, args.num_codes, args.code_dim) if quantizer is None else quantizer()
    # The same encoder and decoder weights for every method: the bottlenecks draw different amounts of randomness.
    L.seed_everything(seed, workers=True, verbose=False)
    model = VQVAE(quantizer=quantizer, code_dim=args.code_dim, width=args.width, res_blocks=args.res_blocks,
                  res_hidden=args.res_hidden, lr=args.lr)
    L.seed_everything(seed, workers=True, verbose=False)
    speed = Throughput()
    trainer = L.Trainer(max_epochs=args.epochs, accelerator="cpu", logger=False, enable_checkpointing=False,
                        enable_progress_bar=not args.no_progress_bar, enable_model_summary=False,
                        num_sanity_val_steps=0,
                        callbacks=[HistoryWriter(out / "history.jsonl", echo=echo), speed, *callbacks],
                        limit_test_batches=(args.test_limit // args.batch_size) or 1 if args.test_limit else 1.0)
    start = time.perf_counter()
    trainer.fit(model, datamodule=data)
    scores = None
    if test:
        trainer.test(model, datamodule=data, verbose=False)
        scores = {k.removeprefix("test_"): v for k, v in model.test_summary.items()}
        scores["num_codes"] = model.num_codes
    history = [json.loads(line) for line in (out / "history.jsonl").read_text().splitlines() if line.strip()]
    for row, speed_row, cpu in zip(history, speed.per_epoch, speed.cpu_per_epoch, strict=False):
        row["train_images_per_s"] = speed_row
        row["train_cpu_s"] = cpu  # the training loop's CPU seconds in this process (data-loader workers excluded)
    result = {"method": method, "seed": seed, "settings": settings_of(args), "history": history, "test": scores,
              "wall_s": time.perf_counter() - start, "code": loaded_code()}  # the code this process loaded (+: edited)
    return model, data, result


def vqvae_of(method: str, settings: dict[str, Any], seed: int | None = None) -> VQVAE:
    """A fresh VQ-VAE with bottleneck ``method`` in a run's ``settings`` (:func:`settings_of`: K, D, width, residual
    blocks, learning rate); ``seed``: seeded before the encoder and decoder are drawn, as :func:`fit_run` does."""
    quantizer = build(method, settings["num_codes"], settings["code_dim"])
    if seed is not None:
        L.seed_everything(seed, workers=True, verbose=False)
    return VQVAE(quantizer=quantizer, code_dim=settings["code_dim"], width=settings["width"],
                 res_blocks=settings["res_blocks"], res_hidden=settings["res_hidden"], lr=settings["lr"])


def add_vqvae_arguments(p: argparse.ArgumentParser) -> None:
    """The VQ-VAE and run flags of :func:`settings_of` (but ``--num-codes``), which every study that trains through
    :func:`fit_run` shares: the peers' setting by default."""
    p.add_argument("--epochs", type=int, default=5)
    p.add_argument("--train-subset", type=int, default=10_000)
    p.add_argument("--val-size", type=int, default=5000)
    p.add_argument("--batch-size", type=int, default=128)
    p.add_argument("--code-dim", type=int, default=64)
    p.add_argument("--width", type=int, default=128)
    p.add_argument("--res-blocks", type=int, default=2)
    p.add_argument("--res-hidden", type=int, default=32)
    p.add_argument("--lr", type=float, default=3e-4)
    p.add_argument("--test-limit", type=int, default=0, help="score on this many test images (0: all 10,000)")
    p.add_argument("--num-workers", type=int, default=1)
    p.add_argument("--threads", type=int, default=None,
                   help="torch threads per run (default: torch's); 1 lets another job use the second core")


@contextlib.contextmanager
def study_run(threads: int | None = None) -> Iterator[None]:
    """What every study that trains through :func:`fit_run` starts with: INFO logging, ``threads`` torch threads
    (``None``: torch's), and Lightning's warnings that say nothing about a study (in-memory data with few loader
    workers, loops without validation, a pytree deprecation) silenced while it trains."""
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    if threads:
        torch.set_num_threads(threads)
    with warnings.catch_warnings():
        for message in (".*does not have many workers.*", ".*isinstance\\(treespec, LeafSpec\\)` is deprecated",
                        ".*no `val_dataloader`"):
            warnings.filterwarnings("ignore", message=message)
        yield
