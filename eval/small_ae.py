"""Small autoencoders: DDCL against hard VQ in MLP autoencoders on Gaussian clusters, the quickstart's family, over a
grid of settings (a study in progress; ``reports/small_ae/``).

    python -m eval.small_ae                                   # the grid, validation split, 3,000 steps a run
    python -m eval.small_ae --settings base K=64 opt=sgd      # some settings of the grid
    python -m eval.small_ae --diagnose --methods ddcl hard_ema  # the quickstart setting, gradient diagnostics
    python -m eval.small_ae --quick                           # seconds: a test-sized run

The model (the quickstart's, with its sizes as options): a point ``x`` of ``in_dim = 16`` dimensions from a mixture
of ``clusters`` Gaussians (centres ``2 * randn``, noise ``noise``) -> MLP encoder (64 hidden, GELU) -> ``tokens``
tokens of dimension ``dim`` -> the bottleneck with ``K`` codes -> MLP decoder -> ``x``; loss ``MSE + out.loss``,
Adam 1e-3 (or SGD 0.05 with momentum 0.9), batches of 256 fresh points. Scored every ``--every`` steps on 4,096
held-out points (the validation split; ``--split test``: another 4,096 drawn from a generator no run trains or
validates on) by the MSE of the points decoded from the hard codes alone. The floor is the cluster noise, ``noise^2``.

The settings vary the quickstart's one option at a time (``SETTINGS``). The methods (``METHODS``): ``ddcl``
(``DDCLQuantizer(K, D)``, its defaults), ``ddcl_rho`` (the defaults with a commitment held at 0.2 of the decoder's
gradient, :mod:`eval.commit_ratio`; ``ddcl_rhoz``, ``ddcl_rhoz05``, ``ddcl_rhoz10``: at 0.2, 0.05, 0.1 of the
gradient the layer passes to its tokens; ``ddcl_rhoz_pc``: 0.2, less the part opposing that gradient),
``hard_ema`` (``HardVQ`` with EMA 0.99 and ``Restart()``, the strongest hard VQ here) and ``hard`` (``HardVQ(K, D)``,
a gradient-trained codebook with commitment 0.25); ``hard_ema_c0``, hard_ema without its commitment, is a probe of
what the commitment does, not a baseline (not among ``HARD``); ``ddcl_st``, ``ddcl_st_nostd``, ``ddcl_nostd`` and
``ddcl_soft_ema`` are probes of DDCL's parts (straight-through's gradient in place of the soft centroid's Jacobian,
without the standardiser, EMA weighted by Q). Each run also reports how the held-out points of each cluster are coded
(:func:`cluster_codes`: distinct code tuples per cluster, the share of points decoded far from their point).

``--diagnose`` logs, on the quickstart setting, what the issue's account asks: the encoder's gradient against the
gradient at the layer's output (straight-through's: the median per-token cosine and the ratio of norms), the
commitment term's share of it, the tokens' distance to their codes relative to their variance (in the layer's own
space: standardised for DDCL), the temperature and H(Q).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any

import torch
from einops import rearrange
from torch import Tensor, nn

import softvq
from eval._provenance import loaded_code
from eval.commit_ratio import RatioCommitDDCL

CODE = loaded_code()  # the code this process imported, whatever the tree holds when its report is written
OUT = Path(__file__).resolve().parent.parent / "reports" / "small_ae"
WITHIN = 1.15  # the study's bar: a method's final MSE within 1.15x of the best hard VQ's


@dataclass(frozen=True)
class Setting:
    """One small autoencoder and its data (the quickstart's values by default)."""

    dim: int = 8
    tokens: int = 4
    codes: int = 128
    clusters: int = 64
    noise: float = 0.1
    opt: str = "adam"
    in_dim: int = 16


SETTINGS: dict[str, Setting] = {
    "base": Setting(), "D=2": Setting(dim=2), "D=32": Setting(dim=32), "T=1": Setting(tokens=1),
    "T=16": Setting(tokens=16), "K=64": Setting(codes=64), "K=1024": Setting(codes=1024),
    "C=16": Setting(clusters=16), "C=256": Setting(clusters=256), "noise=0.3": Setting(noise=0.3),
    "opt=sgd": Setting(opt="sgd"),
}


class StraightThroughDDCL(softvq.DDCLQuantizer):
    """A probe: DDCL's defaults with straight-through's gradient in place of the soft centroid's Jacobian (the output
    is the argmax code, as the defaults'; the encoder gets the output's gradient unchanged, through the standardiser).
    Everything else (standardiser, EMA, restarts, temperature) is the parent's."""

    def _output_codes(self, zf: Tensor, p: Tensor, mu: Tensor, indices: Tensor, loss: Tensor, mean: Tensor | None,
                      std: Tensor | None) -> tuple[Tensor, Tensor]:
        codes = torch.nn.functional.embedding(indices, p.detach())
        return self.standardizer.output(codes + (zf - zf.detach()), mean, std), loss


METHODS: dict[str, Callable[[int, int], nn.Module]] = {
    "ddcl": lambda k, d: softvq.DDCLQuantizer(k, d),
    "ddcl_rho": lambda k, d: RatioCommitDDCL(k, d, rho=0.2),
    "ddcl_rhoz": lambda k, d: RatioCommitDDCL(k, d, rho=0.2, against="tokens"),
    "ddcl_rhoz05": lambda k, d: RatioCommitDDCL(k, d, rho=0.05, against="tokens"),  # the conv VQ-VAE's bearable pull
    "ddcl_rhoz10": lambda k, d: RatioCommitDDCL(k, d, rho=0.1, against="tokens"),
    "ddcl_rhoz_pc": lambda k, d: RatioCommitDDCL(k, d, rho=0.2, against="tokens", surgery=True),
    "hard_ema": lambda k, d: softvq.HardVQ(k, d, ema_decay=0.99, restart=softvq.Restart()),
    "hard": lambda k, d: softvq.HardVQ(k, d),
    # not a baseline: the strongest hard VQ without its commitment, to see what the commitment does
    "hard_ema_c0": lambda k, d: softvq.HardVQ(k, d, ema_decay=0.99, restart=softvq.Restart(), commitment_weight=0.0),
    # probes of DDCL's parts, not candidates: its encoder gradient and its standardiser, one at a time
    "ddcl_st": lambda k, d: StraightThroughDDCL(k, d),
    "ddcl_st_nostd": lambda k, d: StraightThroughDDCL(k, d, standardize=False),
    "ddcl_nostd": lambda k, d: softvq.DDCLQuantizer(k, d, standardize=False),
    "ddcl_soft_ema": lambda k, d: softvq.DDCLQuantizer(k, d, prototype_update="soft_ema"),
}
HARD = ("hard_ema", "hard")


class TokenAutoencoder(nn.Module):
    """``x (B, in_dim)`` -> ``tokens`` tokens of ``dim`` -> quantizer -> decoder -> ``(B, in_dim)``: the model of
    examples/quickstart.py, written again here because an example stays one self-contained file a user can copy
    (examples/ is not a package this study could import)."""

    def __init__(self, quantizer: nn.Module, setting: Setting) -> None:
        super().__init__()
        self.tokens, width = setting.tokens, setting.tokens * setting.dim
        self.encoder = nn.Sequential(nn.Linear(setting.in_dim, 64), nn.GELU(), nn.Linear(64, width))
        self.quantizer = quantizer
        self.decoder = nn.Sequential(nn.Linear(width, 64), nn.GELU(), nn.Linear(64, setting.in_dim))

    def encode(self, x: Tensor) -> Tensor:
        return rearrange(self.encoder(x), "b (t d) -> b t d", t=self.tokens)

    def decode(self, tokens: Tensor) -> Tensor:
        return self.decoder(rearrange(tokens, "b t d -> b (t d)"))


class Clusters:
    """The mixture of ``setting.clusters`` Gaussians of ``seed``; ``draw(n, generator)`` samples points."""

    def __init__(self, setting: Setting, seed: int) -> None:
        self.noise = setting.noise
        gen = torch.Generator().manual_seed(seed)
        self.centers = 2.0 * torch.randn(setting.clusters, setting.in_dim, generator=gen)

    def draw(self, n: int, generator: torch.Generator) -> Tensor:
        which = torch.randint(len(self.centers), (n,), generator=generator)
        return self.centers[which] + self.noise * torch.randn(n, self.centers.shape[1], generator=generator)


def held_out(data: Clusters, split: str, seed: int) -> Tensor:
    """4,096 points no training step draws: the validation split's, or the test split's (another generator)."""
    offset = {"validation": 10_000, "test": 20_000}[split]
    return data.draw(4096, torch.Generator().manual_seed(offset + seed))


@torch.no_grad()
def hard_decode(model: TokenAutoencoder, x: Tensor) -> tuple[Tensor, Tensor]:
    """``x``'s hard codes ``(B, tokens)`` and the points decoded from them alone, in evaluation mode (the model's mode
    is left as it was found)."""
    was = model.training
    model.eval()
    indices = model.quantizer(model.encode(x)).indices
    decoded = model.decode(model.quantizer.decode_indices(indices))
    model.train(was)
    return indices, decoded


def hard_mse(model: TokenAutoencoder, x: Tensor) -> float:
    """The MSE of ``x`` decoded from its hard codes alone, in evaluation mode."""
    return (hard_decode(model, x)[1] - x).square().mean().item()


@torch.no_grad()
def cluster_codes(model: TokenAutoencoder, data: Clusters, x: Tensor) -> dict[str, float]:
    """How the held-out points ``x`` of each cluster are coded, in evaluation mode: ``codes_per_cluster``, the mean
    over clusters of the number of distinct code tuples (one per point's ``tokens`` codes) its points get (1: every
    point of a cluster decodes from the same codes); ``share_far``, the share of points whose hard-code squared error
    (mean over dimensions) is above 5x the noise's variance. A point's cluster is its nearest centre."""
    indices, decoded = hard_decode(model, x)
    indices = indices.reshape(len(x), -1)
    err = (decoded - x).square().mean(-1)
    label = torch.cdist(x, data.centers).argmin(-1)
    # distinct (cluster, tuple) pairs over clusters present: rows of [label, indices] made unique
    pairs = torch.unique(torch.cat([label[:, None], indices], dim=1), dim=0)
    return {"codes_per_cluster": len(pairs) / len(torch.unique(label)),
            "share_far": (err > 5 * data.noise**2).float().mean().item()}


def diagnostics(model: TokenAutoencoder, z: Tensor, out: softvq.QuantizerOutput,
                recon_loss: Tensor) -> dict[str, float]:
    """What reaches the encoder, on one training batch: the encoder's gradient against the gradient at the layer's
    output (what straight-through would pass), the commitment's share, the tokens' distance to their codes in the
    layer's own space relative to the tokens' variance, and DDCL's temperature and H(Q). The commitment's share is read
    from ``out.loss``: ``ddcl_rho``'s pull acts in the backward pass instead, so it reads 0 there (0.2 by
    construction)."""
    q = model.quantizer
    total = recon_loss + out.loss
    g_z, g_out = torch.autograd.grad(total, (z, out.quantized), retain_graph=True)
    dim = z.shape[-1]
    g_z, g_out = g_z.reshape(-1, dim), g_out.reshape(-1, dim)
    row: dict[str, float] = {
        "cos_median": torch.nn.functional.cosine_similarity(g_z, g_out, dim=1).median().item(),
        "norm_ratio": (g_z.norm() / g_out.norm()).item(),
    }
    if out.loss.requires_grad:
        commit = torch.autograd.grad(out.loss, z, retain_graph=True, allow_unused=True)[0]
        if commit is not None:
            row["commitment_share"] = (commit.norm() / (g_z.reshape(commit.shape) - commit).norm()).item()
    with torch.no_grad():
        tokens = z.detach().reshape(-1, dim)
        if getattr(q, "standardize", False):
            tokens = q.standardizer(tokens, update=False)[0]
        codes = q.prototypes.detach()[out.indices.reshape(-1)]
        row["distance_to_code"] = ((tokens - codes).square().sum(-1).mean() / tokens.var(0).sum()).item()
    if isinstance(q, softvq.DDCLQuantizer):
        row["temperature"] = float(q.temperature)
        row["entropy"] = float(out.terms["entropy"])
    return row


def train(method: str, setting: Setting, *, steps: int = 3000, every: int = 250, seed: int = 0,
          split: str = "validation", diagnose: bool = False) -> dict[str, Any]:
    """One run: the hard-code MSE on the held-out split every ``every`` steps (and at the end), with the diagnostics
    of :func:`diagnostics` at the same steps when ``diagnose``."""
    data = Clusters(setting, seed)
    gen = torch.Generator().manual_seed(seed + 1)
    torch.manual_seed(seed)
    model = TokenAutoencoder(METHODS[method](setting.codes, setting.dim), setting)
    if setting.opt == "adam":
        opt: torch.optim.Optimizer = torch.optim.Adam(model.parameters(), lr=1e-3)
    elif setting.opt == "sgd":
        opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    else:
        raise ValueError(f"opt must be 'adam' or 'sgd', got {setting.opt!r}")
    x_held = held_out(data, split, seed)
    curve: list[dict[str, Any]] = []
    start = time.perf_counter()
    for step in range(1, steps + 1):
        x = data.draw(256, gen)
        z = model.encode(x)
        out = model.quantizer(z)
        loss = (model.decode(out.quantized) - x).square().mean()
        log = step % every == 0 or step == steps
        extra = diagnostics(model, z, out, loss) if log and diagnose else {}
        opt.zero_grad(set_to_none=True)
        (loss + out.loss).backward()
        opt.step()
        if log:
            curve.append({"step": step, "mse_hard": hard_mse(model, x_held), **extra})
    seconds = time.perf_counter() - start
    final = curve[-1]["mse_hard"]
    near = next(point["step"] for point in curve if point["mse_hard"] <= WITHIN * final)
    return {"method": method, "setting": asdict(setting), "seed": seed, "split": split, "steps": steps,
            "final_mse_hard": final, "steps_to_within": near, **cluster_codes(model, data, x_held),
            "seconds": seconds, "curve": curve}


def summary(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Per setting: each method's final MSE (the mean over seeds) and its ratio to the best hard VQ's."""
    table = []
    for name in dict.fromkeys(r["name"] for r in rows):
        mine = [r for r in rows if r["name"] == name]
        finals = {m: statistics.fmean(r["final_mse_hard"] for r in mine if r["method"] == m)
                  for m in dict.fromkeys(r["method"] for r in mine)}
        best = min((finals[m] for m in HARD if m in finals), default=None)
        for method, value in finals.items():
            runs = [r for r in mine if r["method"] == method]
            near = statistics.fmean(r["steps_to_within"] for r in runs)
            split = {key: statistics.fmean(r[key] for r in runs) if all(key in r for r in runs) else None
                     for key in ("codes_per_cluster", "share_far")}  # None: records from before they were kept
            table.append({"setting": name, "method": method, "final_mse_hard": value, "steps_to_within": near,
                          "vs_best_hard": None if best is None else value / best, **split})
    return table


def report(rows: list[dict[str, Any]], out: Path, command: str) -> Path:
    """``out/results.json`` (every run and its curve) and ``out/report.md`` (the table of :func:`summary`)."""
    out.mkdir(parents=True, exist_ok=True)
    (out / "results.json").write_text(json.dumps({"command": command, "code": CODE, "runs": rows},
                                                 indent=1) + "\n")
    split = rows[0]["split"] if rows else "validation"
    lines = ["# Small autoencoders: DDCL against hard VQ on Gaussian clusters", "",
             f"Regenerate: `{command}`", "", f"Code: {CODE}", "",
             f"MLP autoencoders of eval/small_ae.py, {rows[0]['steps'] if rows else 0} steps a run; hard-code MSE on "
             f"4,096 held-out points of the {split} split (the floor is the noise's variance)"
             + ("; the test split was not read." if split == "validation" else "."), "",
             "Code tuples per cluster: the distinct codes the held-out points of one cluster get, the mean over "
             "clusters (1: one per cluster); far: the share of points whose squared error is above 5x the noise's "
             "variance.", "",
             f"| setting | method | final hard-code MSE | steps to within {WITHIN}x of its final "
             "| vs the best hard VQ | code tuples per cluster | far |",
             "|---|---|---|---|---|---|---|"]
    for r in summary(rows):
        ratio = "–" if r["vs_best_hard"] is None else f"{r['vs_best_hard']:.2f}x"
        tuples = "–" if r["codes_per_cluster"] is None else f"{r['codes_per_cluster']:.2f}"
        far = "–" if r["share_far"] is None else f"{100 * r['share_far']:.1f}%"
        lines.append(f"| {r['setting']} | {r['method']} | {r['final_mse_hard']:.4f} | {r['steps_to_within']:.0f} | "
                     f"{ratio} | {tuples} | {far} |")
    path = out / "report.md"
    path.write_text("\n".join(lines) + "\n")
    return path


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--settings", nargs="+", choices=list(SETTINGS), default=list(SETTINGS))
    p.add_argument("--methods", nargs="+", choices=list(METHODS), default=["ddcl", "ddcl_rho", *HARD])
    p.add_argument("--seeds", type=int, nargs="+", default=[0])
    p.add_argument("--steps", type=int, default=3000, help="training steps a run (default 3000)")
    p.add_argument("--every", type=int, default=250, help="steps between held-out scores (default 250)")
    p.add_argument("--split", choices=("validation", "test"), default="validation")
    p.add_argument("--threads", type=int, default=1, help="torch threads (default 1)")
    p.add_argument("--diagnose", action="store_true", help="log the gradient diagnostics at every score")
    p.add_argument("--quick", action="store_true", help="a smoke run: 40 steps, K = 16, two settings")
    p.add_argument("--out", type=Path, default=OUT)
    args = p.parse_args(argv)
    if args.steps < 1 or args.every < 1 or args.threads < 1:
        p.error("--steps, --every and --threads must be positive")
    return args


def main(argv: Sequence[str] | None = None) -> list[dict[str, Any]]:
    args = parse_args(argv)
    torch.set_num_threads(args.threads)
    settings = {name: SETTINGS[name] for name in args.settings}
    if args.quick:
        settings = {name: replace(s, codes=16) for name, s in list(settings.items())[:2]}
        args.steps, args.every = 40, 20
    rows = []
    for name, setting in settings.items():
        for seed in args.seeds:
            for method in args.methods:
                row = {"name": name, **train(method, setting, steps=args.steps, every=args.every, seed=seed,
                                             split=args.split, diagnose=args.diagnose)}
                print(f"{name:>10} seed {seed} {method:>9}: hard-code MSE {row['final_mse_hard']:.4f} "
                      f"(within {WITHIN}x from step {row['steps_to_within']}; {row['seconds']:.0f} s)", flush=True)
                rows.append(row)
    command = "python -m eval.small_ae " + " ".join(argv if argv is not None else sys.argv[1:])
    print(f"wrote {report(rows, args.out, command.strip())}")
    return rows


if __name__ == "__main__":
    main()
