"""A DDCL layer with an amortised Jacobian: hard VQ's forward pass, and the soft centroid's Jacobian of each code's own
distribution in the backward pass (the per-second candidate ``ddcl_amortised`` of eval.per_second; a prototype, not
yet the library's).

The layer (docs/design.md's notation). Training forward: tokens standardised as :class:`softvq.DDCLQuantizer` does
(its standardiser, initialisation from data, dead-code restart, EMA prototypes and entropy control are the parent's),
each token's nearest code ``c_n`` in row blocks (:func:`softvq._kernels.nearest_codes`, HardVQ's search: one
``N x K x D`` matmul and one pass), and the stated distribution of token ``n`` is its code's,

    q_n = q_{c_n},   q_c = softmax_j(-||p_c - p_j||^2 / T) over the ``r`` codes j nearest to p_c (c among them),

the Boltzmann distribution of a token sitting on its code, truncated to the code's ``r`` nearest codes. So the
encoder's gradient is ``(2/T) C_{c_n} g`` with ``C_c = Cov_{q_c}(P)``: the exact Jacobian of the soft centroid at the
code, applied to the token's gradient, at ``O(N r D)`` (each token's ``r`` neighbours gathered). The output is the code
itself (bit for bit), with that gradient. ``L_q = L_OLS + V`` holds exactly for these ``q_n`` (any distribution
satisfies it); the reported terms are computed from their definitions on a strided subsample of at most 1,024
tokens, and H(Q), which the entropy control holds at ``log(r) - 0.5`` nats, is the mean entropy of the ``q_{c_n}``
over all tokens.

The neighbour lists ``(K, r)`` and their squared distances are refreshed for ``K / 32`` codes per training step (round
robin: all of them every 32 steps; all at the first step and after a load), at ``K / 32 x K x D`` multiply-adds per
step, a 32nd of the search's; the weights ``q_c`` are recomputed every step at the current ``T`` from those
distances, and ``mu_c``, ``V_c`` from the current prototypes (``O(K r D)``).
Evaluation is the parent's (the nearest code; terms of the top-``r`` truncated distribution).
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor

import softvq
from eval.neighbour import RefreshCursor
from softvq._checks import flatten_tokens
from softvq._kernels import nearest_codes, nearest_k_codes
from softvq._precision import compute_dtype
from softvq.types import QuantizerOutput, empty_output

_TERMS = ("l_q", "l_ols", "v", "identity_residual", "entropy")


class _CodeJacobian(torch.autograd.Function):
    """Zeros in value; in the backward pass ``(2/T) C_{c_n} g_n`` with ``C_c = sum_j q_cj (p_j - mu_c)(p_j - mu_c)^T``
    over the code's neighbours, token chunk by token chunk (no ``(N, r, D)`` tensor beyond a chunk)."""

    @staticmethod
    def forward(ctx: Any, z: Tensor, indices: Tensor, neighbours: Tensor, weights: Tensor, centroids: Tensor,
                prototypes: Tensor, temperature: Tensor) -> Tensor:  # type: ignore[override]
        ctx.save_for_backward(indices, neighbours, weights, centroids, prototypes, temperature)
        return torch.zeros_like(z)

    @staticmethod
    def backward(ctx: Any, g: Tensor) -> tuple[Tensor | None, ...]:  # type: ignore[override]
        indices, neighbours, weights, centroids, prototypes, t = ctx.saved_tensors
        n, r = indices.shape[0], neighbours.shape[1]
        rows = max(64, (1 << 20) // max(r * prototypes.shape[1], 1))
        out = torch.empty_like(g)
        for a in range(0, n, rows):
            c = indices[a:a + rows]
            dev = F.embedding(neighbours[c], prototypes) - centroids[c][:, None, :]  # (n, r, D)
            proj = torch.bmm(dev, g[a:a + rows, :, None]).squeeze(2) * weights[c]  # (n, r) q_j (p_j - mu) . g
            out[a:a + rows] = torch.bmm(proj[:, None, :], dev).squeeze(1)
        return out.mul_(2.0 / t), None, None, None, None, None, None


class AmortisedDDCL(softvq.DDCLQuantizer):
    """:class:`softvq.DDCLQuantizer` whose training step is hard VQ's search plus an amortised Jacobian (module
    docstring). ``neighbours``: ``r``, the codes each code's distribution spans (and ``top_k`` of calibration and
    evaluation); the entropy target defaults to ``log(r) - 0.5`` nats. Other options: the parent's."""

    def __init__(self, num_codes: int, dim: int, neighbours: int = 16, **options: Any) -> None:
        r = min(neighbours, num_codes)
        options.setdefault("target_entropy", min(torch.tensor(float(r)).log().item() - 0.5,
                                                 0.5 * torch.tensor(float(num_codes)).log().item()))
        super().__init__(num_codes, dim, top_k=r, **options)
        self.neighbours = r
        self.register_buffer("neighbour_index", torch.zeros(num_codes, r, dtype=torch.long), persistent=False)
        # each list's squared distances when it was refreshed: q_c at the current T reads them (module docstring)
        self.register_buffer("neighbour_distance", torch.zeros(num_codes, r), persistent=False)
        self._lists = RefreshCursor()

    def _load_from_state_dict(self, *args: Any, **kwargs: Any) -> None:
        super()._load_from_state_dict(*args, **kwargs)
        self._lists.reset()

    @torch.no_grad()
    def _refresh(self, p: Tensor) -> None:
        """The ``r`` nearest codes of some codes (all of them the first time): ``K / 32`` per step, round robin."""
        k = p.shape[0]
        codes = self._lists.next(k, max(1, k // 32), p.device)
        distances, self.neighbour_index[codes] = nearest_k_codes(p[codes], p, self.neighbours)
        self.neighbour_distance[codes] = distances.to(self.neighbour_distance.dtype)

    def _code_distributions(self, p: Tensor, t: Tensor) -> tuple[Tensor, Tensor, Tensor, Tensor]:
        """Every code's ``q_c (K, r)`` (at ``T``, from its list's distances when it was refreshed), centroid ``mu_c
        (K, D)``, ``V_c (K,)`` and entropy ``H_c (K,)`` (the last three of the current prototypes ``p``), in
        ``O(K r D)`` with no ``(K, r, D)`` tensor."""
        logits = self.neighbour_distance.to(p.dtype) / -t.to(p.dtype)
        q = torch.softmax(logits, 1)
        mu = F.embedding_bag(self.neighbour_index, p, per_sample_weights=q, mode="sum")
        v = (q * p.square().sum(1)[self.neighbour_index]).sum(1) - mu.square().sum(1)
        entropy = -(q * torch.log_softmax(logits, 1)).sum(1)
        return q, mu, v, entropy

    def _forward_tokens(self, z: Tensor) -> QuantizerOutput:
        if not self.training or torch.compiler.is_compiling():
            return super()._forward_tokens(z)
        flat = flatten_tokens(z, self.dim, check_finite=self._check_finite)
        if flat.shape[0] == 0:
            return empty_output(z, self.num_codes, self.prototypes, _TERMS)
        if not self._initialized and not self._can_start(flat):
            return super()._forward_tokens(z)  # a batch that cannot start the codebook: the parent's handling
        with torch.autocast(device_type=z.device.type, enabled=False):
            ctype = compute_dtype(z.dtype)  # float32, float64 for float64 input
            zf, mean, std = self._codebook_space(flat.to(ctype), True, True)
            p = self.prototypes.detach().to(ctype)
            if self._distance == "cosine":
                p = F.normalize(p, dim=-1)
            if not self.temperature_control.ready:  # T at which the codes' own distributions meet the target
                self.temperature_control.calibrate(p[:: max(1, p.shape[0] // 4096)], p, keep=True,
                                                   top_k=self.neighbours)
            t = self._pass_temperature(zf, p, None, keep=True)
            self._refresh(p)
            center = p.mean(0)
            pc = p - center
            zc = zf - center
            indices = nearest_codes(zc.detach(), pc)
            q_codes, mu_codes, v_codes, h_codes = self._code_distributions(pc, t)
            codes = F.embedding(indices, p)
            out = codes + _CodeJacobian.apply(zc, indices, self.neighbour_index, q_codes, mu_codes, pc,
                                              t.to(zc.dtype))
            stats = self._subsample_terms(zc.detach(), indices, pc, q_codes, mu_codes, v_codes, h_codes)
            out = self.standardizer.output(out, mean, std)
        probs = q_codes[indices]
        self._after_step(zf.detach(), probs, indices, stats[3])
        chosen = self.neighbour_index[indices]
        return self._assemble(z, out, probs, indices, zf.new_zeros(()), stats, chosen)

    def _subsample_terms(self, zc: Tensor, indices: Tensor, pc: Tensor, q: Tensor, mu: Tensor, v: Tensor,
                         h: Tensor) -> Tensor:
        """``[l_q, l_ols, v, H]``: the terms of the stated ``q_n`` from their definitions on a strided subsample of at
        most 1,024 tokens (``L_q = sum_j q_j ||z - p_j||^2`` with the neighbours gathered), H over all tokens."""
        sub = slice(None, None, max(1, zc.shape[0] // 1024))
        zs, cs = zc[sub], indices[sub]
        d = (F.embedding(self.neighbour_index[cs], pc) - zs[:, None, :]).square().sum(2)  # (m, r)
        l_q = (q[cs] * d).sum(1).mean()
        l_ols = (zs - mu[cs]).square().sum(1).mean()
        return torch.stack([l_q, l_ols, v[cs].mean(), h[indices].mean()]).double().to(zc.dtype)
