"""The forward pass of :class:`softvq.DDCLQuantizer`, as functions of the layer: the space the distances are
taken in (standardising, initialising the prototypes from data, restarting dead codes), the temperature a pass uses,
the terms the autograd function computes, the codes the layer outputs, and the updates after a training step.

:func:`forward_tokens` (the layer's ``_forward_tokens``) is the outline that calls them in order; the mechanisms they
drive are the layer's parts (:mod:`softvq.parts`, :class:`softvq.norm.TokenStandardizer`), and the autograd function
that computes the assignments, the soft centroid and the gradients is ``softvq._soft_centroid``.
"""

from __future__ import annotations

import warnings

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from softvq._checks import flatten_tokens
from softvq._collectives import codes_from_tokens, is_distributed
from softvq._precision import compute_dtype
from softvq._recipe import can_start
from softvq._replay import ForwardRecord, in_backward, replayed_prototypes
from softvq._soft_centroid import Objective, _SoftCentroid
from softvq.parts.restart import code_counts
from softvq.types import QuantizerOutput, empty_output, scatter_top_k


def forward_tokens(layer: nn.Module, z: Tensor) -> QuantizerOutput:
    """:meth:`DDCLQuantizer.forward` on channel-last tokens ``z (..., D)``: the outline, each step a function below
    (the layer's ``_forward_tokens``: called as a method, so a step's warning points where it always did)."""
    flat = flatten_tokens(z, layer.dim, check_finite=layer.check_finite)  # (N, D)
    if flat.shape[0] == 0:
        return empty_output(z, layer.num_codes, layer.prototypes,
                            ("l_q", "l_ols", "v", "identity_residual", "entropy"))
    ctype = compute_dtype(z.dtype)
    # A training forward pass made during backward is a recomputation (activation checkpointing): it replays what
    # the first pass read and changes no state (softvq._replay). Under torch.compile the compiler recomputes
    # inside its own graph, and no Python runs in the backward pass.
    eager = layer.training and not torch.compiler.is_compiling()
    recompute = eager and in_backward()
    replay = layer._records.replay() if recompute else None
    update = layer.training and not recompute
    # a batch that cannot start the codebook (initialise it, calibrate T) is used for its output only
    start = update and not (layer._initialized and layer.temperature_control.ready)
    deferred = start and not can_start(layer, flat)
    with torch.autocast(device_type=z.device.type, enabled=False):
        zf, mean, std = codebook_space(layer, flat.to(ctype), update, update and not deferred)
        p_raw = layer.prototypes.to(ctype)
        if replay is not None:
            p_raw = replayed_prototypes(p_raw, replay)
        p = F.normalize(p_raw, dim=-1) if layer.distance == "cosine" else p_raw
        temperature = pass_temperature(layer, zf, p, replay, keep=update and not deferred)
        record = layer._records.push(p_raw, temperature) if eager and update else None
        mu, q, indices, loss, stats, chosen = _SoftCentroid.apply(zf, p, temperature, objective(layer), record,
                                                                  layer.top_k or 0)
        out, loss = output_codes(layer, zf, p, mu, indices, loss, mean, std)
    if update and not deferred:
        soft = q.detach()
        if chosen.numel() > 0 and layer._update_kind == "soft_ema":  # its M-step reads every code's column
            soft = scatter_top_k(soft, chosen, layer.num_codes)
        after_step(layer, zf.detach(), soft, indices, stats[3])  # stats: l_q, l_ols, v, entropy
    return assemble(z, out, q, indices, loss, stats, chosen)


@torch.no_grad()
def init_from_data(layer: nn.Module, z: Tensor) -> None:
    """:meth:`DDCLQuantizer.init_from_data`: tokens ``z (..., D)`` checked, standardised as the codebook will see them
    (with ``standardize``; :meth:`softvq.norm.TokenStandardizer.standardize`: the evaluation statistics once a training
    batch has set them, else ``z``'s own moments, as the first training batch will be standardised; no statistic
    changes), then :func:`init_from_tokens`. With fewer than ``K`` tokens, tokens are drawn with replacement and
    jittered by 1e-3 of their standard deviation so no two prototypes coincide. Under ``torch.distributed`` the tokens
    are drawn from every process's ``z`` together (:func:`softvq._collectives.codes_from_tokens`): every process gets
    the same prototypes, the ones a single process would draw from the concatenated batches."""
    flat = flatten_tokens(z, layer.dim, check_finite=True)
    if flat.shape[0] == 0 and not is_distributed():
        raise ValueError("init_from_data needs at least one token, got an empty tensor")
    if layer.standardize:
        flat = layer.standardizer.standardize(flat.to(compute_dtype(flat.dtype)))
    init_from_tokens(layer, flat)


@torch.no_grad()
def init_from_tokens(layer: nn.Module, flat: Tensor) -> None:
    """:meth:`DDCLQuantizer.init_from_data` on validated tokens ``(N, D)``, without a synchronisation in one process:
    the prototypes (and their EMA) become ``K`` tokens drawn by :func:`softvq._collectives.codes_from_tokens`."""
    chosen = codes_from_tokens(flat, layer.num_codes, layer.prototypes.dtype)
    if chosen is None:
        raise ValueError("init_from_data needs at least one token, got an empty tensor")
    layer.prototypes.copy_(chosen)
    layer.ema.reset_(chosen)
    layer._initialized = True


def codebook_space(layer: nn.Module, zf: Tensor, update: bool, update_codebook: bool) -> tuple[Tensor, Tensor | None,
                                                                                              Tensor | None]:
    """Tokens ``(N, D)`` in the compute dtype -> the tokens the distances see (standardised; L2-normalised for
    cosine) and the standardiser's ``mean`` and ``std`` (``None`` without ``standardize``). With ``update`` (a
    training step, not a recomputation) moves the standardiser's running statistics; with ``update_codebook``
    (such a step on a batch that can start the codebook) first initialises the prototypes from data and restarts
    dead codes, both on the standardised tokens."""
    mean = std = None
    if layer.standardize:
        zf, mean, std = layer.standardizer(zf, update=update)
    if not layer._initialized:
        if update_codebook:
            init_from_tokens(layer, zf.detach())
        elif not layer.training:
            warnings.warn("DDCLQuantizer(init='data') runs in eval mode before a training batch initialised "
                          "its prototypes: it is using random placeholder prototypes", stacklevel=4)
    if update_codebook and layer.dead_codes.threshold > 0:  # before the forward: no tensor saved for backward moves
        dead = layer.dead_codes.restart_(layer.prototypes.data, zf.detach())
        layer.ema.restart_(dead, layer.prototypes.data, 1.0)  # a restarted code's EMA: one pseudo-token there
    if layer.distance == "cosine":
        zf = F.normalize(zf, dim=-1)
    return zf, mean, std


def pass_temperature(layer: nn.Module, zf: Tensor, p: Tensor, replay: ForwardRecord | None, keep: bool) -> Tensor:
    """The ``T`` (a ``()`` float64 tensor) this pass uses: the one the first pass read, for a recomputation
    (``replay``); else the layer's ``temperature_control``'s (softvq/parts/temperature.py, where ``T`` lives),
    calibrated on ``zf`` over ``p`` while it has none (kept with ``keep``: a training batch that starts the codebook;
    an evaluation before it keeps nothing)."""
    control = layer.temperature_control
    if replay is not None:
        return replay.temperature
    if control.ready:
        return control.temperature_t
    return control.calibrate(zf.detach(), p.detach(), keep=keep)


def objective(layer: nn.Module) -> Objective:
    """The terms the autograd function computes: the codebook term only for gradient-trained prototypes, the
    commitment term unless it is ``"hard"`` (added outside it, by :func:`output_codes`)."""
    soft_commitment = ("l_ols", 0.0) if layer.commitment_term == "hard" else (layer.commitment_term,
                                                                               layer.commitment_weight)
    gradient = layer._gradient  # a Gradient for optimizer-trained prototypes, else None (no codebook term)
    return Objective(gradient.term if gradient else "free_energy", gradient.weight if gradient else 0.0,
                     *soft_commitment)


def output_codes(layer: nn.Module, zf: Tensor, p: Tensor, mu: Tensor, indices: Tensor, loss: Tensor,
                 mean: Tensor | None, std: Tensor | None) -> tuple[Tensor, Tensor]:
    """The ``(N, D)`` output and the loss with the hard commitment term: the soft centroid ``mu``, or with
    ``hard_output`` the argmax prototype with ``mu``'s gradient; on the input's scale or times ``output_scale`` when
    the layer standardises (``mean`` and ``std`` its standardiser's)."""
    out = mu
    if layer.hard_output or layer.commitment_term == "hard":
        codes = F.embedding(indices, p.detach())  # (N, D) the argmax prototypes
        if layer.hard_output:
            # the code in value, bit for bit (mu - sg(mu) is exactly 0), and the soft centroid's Jacobian
            out = codes + (mu - mu.detach())
        if layer.commitment_term == "hard" and layer.commitment_weight > 0:
            loss = loss + layer.commitment_weight * F.mse_loss(zf, codes)
    if std is not None and layer.output_scale == "input":
        out = out * std + mean
    elif std is not None and not isinstance(layer.output_scale, str):
        out = out * layer.output_scale
    return out, loss


def evaluation_codes(layer: nn.Module) -> Tensor:
    """``(K, D)``, the codes as the layer outputs them in evaluation (:attr:`DDCLQuantizer.codebook`): the prototypes
    in the space of the distances (standardised; L2-normalised for cosine), scaled as :func:`output_codes` scales its
    output."""
    p = layer.prototypes.detach()
    p = F.normalize(p, dim=-1) if layer.distance == "cosine" else p
    if layer.standardize and layer.output_scale == "input":
        mean, std = layer.standardizer.evaluation_statistics()
        p = p * std.to(p.dtype) + mean.to(p.dtype)
    elif layer.standardize and not isinstance(layer.output_scale, str):
        p = p * layer.output_scale
    return p


def assemble(z: Tensor, out: Tensor, q: Tensor, indices: Tensor, loss: Tensor, stats: Tensor,
             chosen: Tensor) -> QuantizerOutput:
    """The :class:`~softvq.QuantizerOutput` of tokens ``z (..., D)``: ``out``, ``indices`` and ``q`` reshaped to
    ``z``'s leading dimensions, and the detached terms from ``stats`` (``l_q``, ``l_ols``, ``v``, ``entropy``) with
    the identity's residual. Top-k: ``q`` is ``(N, k)``, the assignments of the prototypes ``chosen``, kept so (the
    caller asks for dense)."""
    lead = z.shape[:-1]
    l_q, l_ols, v, entropy = stats.unbind()
    sparse = chosen.numel() > 0
    residual = (l_q - l_ols - v).abs() / l_q.abs().clamp_min(torch.finfo(stats.dtype).tiny)
    terms = {"l_q": l_q, "l_ols": l_ols, "v": v, "identity_residual": residual, "entropy": entropy}
    return QuantizerOutput(
        quantized=out.to(z.dtype).reshape(z.shape),
        indices=indices.reshape(lead),
        probs=q.reshape(*lead, q.shape[-1]),
        loss=loss,
        terms=terms,
        prob_codes=chosen.reshape(*lead, chosen.shape[-1]) if sparse else None,
    )


@torch.no_grad()
def after_step(layer: nn.Module, z: Tensor, q: Tensor, indices: Tensor, entropy: Tensor) -> None:
    """After a training forward: the usage for dead-code restart, the EMA prototype update and the temperature
    control, each with its statistics summed over processes (every process ends with the same state). No
    host-device synchronisation."""
    if layer.dead_codes.threshold > 0 or layer._update_kind == "ema":
        counts = code_counts(indices, layer.num_codes, layer.dead_codes.usage.dtype)
        if layer.dead_codes.threshold > 0:
            layer.dead_codes.update(counts)
    if layer._update_kind == "ema":
        layer.ema.step_(layer.prototypes, z, indices=indices, counts=counts)
    elif layer._update_kind == "soft_ema":  # the free-energy M-step, tokens weighted by their assignments
        layer.ema.step_(layer.prototypes, z, q=q)
    layer.temperature_control.step(entropy, indices.numel())  # T's rule: softvq/parts/temperature.py
