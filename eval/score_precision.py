"""What lower-precision scores do to a trained DDCL layer's codes, before the library offers them.

    python -m eval.score_precision --run ../runs/topk_default/K16384/ddcl/seed0 \
        --data-root ../shared/data/cifar10-jpeg.tar.gz --images 2000 --out reports/score_precision \
        --conclusion-file reports/score_precision/conclusion.txt

(``--render``: rewrite report.md from --out's results.json only.)

On the first ``--images`` images of the **validation** split (``eval.peers``' split: ``CIFAR10DataModule`` with the
run's ``val_size`` and ``train_subset``; the test split is never read), each token's nearest code is computed as the
layer computes it in float32 (the layer's own ``quantizer(z).indices`` in eval mode are the reference; the score
``s = addmm(-|p|^2 / T, z_c, (2 / T) P_c^T)`` of ``softvq/_soft_centroid.py``'s ``score_operands`` /
``logit_scores`` is reproduced here, its argmax the nearest code) and again with the score matmul in lower precision:

- ``bfloat16`` / ``float16``: the three operands of the ``addmm`` cast to the type, the ``addmm`` in that type (on a
  CPU the BLAS accumulates in float32 and rounds the result to the type), the argmax in float32 of that result;
- ``bfloat16 in, float32 out`` / ``float16 in, float32 out``: the operands rounded to the type, then a float32
  ``addmm`` of the rounded values (the products of two bf16 / fp16 numbers are exact in float32): what a GEMM with
  low-precision inputs and a float32 accumulator and output gives, up to the order of the sums;
- ``tf32 (emulated)``: the float32 ``z_c`` and weight with their mantissas cut to TF32's 10 bits
  (``x.view(int32) & ~0x1FFF``, i.e. rounding toward zero; hardware converts by rounding to nearest), then a float32
  ``addmm`` (products of 11-bit mantissas are exact in float32). An emulation: no TF32 unit runs here.

Per precision: the fraction of tokens whose code changes against float32; among the changed tokens the increase of the
squared distance to the chosen code over the float32 nearest one, relative to the latter (float64 distances: how near
the ties were); the hard-index PSNR (``VQVAE.decode_indices``, clamped to [0, 1], mean of per-image PSNR, as the
harness's ``val_psnr_hard``) with float32 codes and with the precision's codes on the same images, and the difference.
Also the time of the score ``addmm`` alone at N = 8192, D = 64, K = 16384 in float32 and bfloat16 on this CPU, one
thread, median of 5 after a warm-up (float16: one call; torch has no fast float16 CPU matmul).
Writes ``results.json`` and ``report.md`` under ``--out``.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import platform
import statistics
import subprocess
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from torch import Tensor

ROOT = Path(__file__).resolve().parents[1]

# (z_c, weight, bias) -> float32 scores (N, K)
Scores = Callable[[Tensor, Tensor, Tensor], Tensor]


def tf32_truncate(x: Tensor) -> Tensor:
    """float32 ``x`` with the low 13 mantissa bits cleared (TF32's 10-bit mantissa, rounding toward zero): an
    emulation of a TF32 input on a machine without one."""
    if x.dtype != torch.float32:
        raise ValueError(f"tf32_truncate takes float32, got {x.dtype}")
    return (x.contiguous().view(torch.int32) & ~0x1FFF).view(torch.float32)


def _in_type(dtype: torch.dtype) -> Scores:
    def scores(zc: Tensor, weight: Tensor, bias: Tensor) -> Tensor:
        return torch.addmm(bias.to(dtype), zc.to(dtype), weight.to(dtype)).float()
    return scores


def _rounded_inputs(dtype: torch.dtype) -> Scores:
    def scores(zc: Tensor, weight: Tensor, bias: Tensor) -> Tensor:
        return torch.addmm(bias, zc.to(dtype).float(), weight.to(dtype).float())
    return scores


def _tf32(zc: Tensor, weight: Tensor, bias: Tensor) -> Tensor:
    return torch.addmm(bias, tf32_truncate(zc), tf32_truncate(weight))


PRECISIONS: dict[str, Scores] = {
    "float32": _in_type(torch.float32),
    "bfloat16": _in_type(torch.bfloat16),
    "bfloat16 in, float32 out": _rounded_inputs(torch.bfloat16),
    "float16": _in_type(torch.float16),
    "float16 in, float32 out": _rounded_inputs(torch.float16),
    "tf32 (emulated)": _tf32,
}


def score_operands(zf: Tensor, prototypes: Tensor, temperature: Tensor | float) -> tuple[Tensor, Tensor, Tensor]:
    """The layer's operands of the score matmul (``softvq._soft_centroid``): both sides centred on the prototypes'
    mean, ``weight = (2 / T) P_c^T``, ``bias = -|p_c|^2 / T``; returns ``(z_c, weight, bias)``."""
    from softvq._soft_centroid import score_operands as layer_operands

    t = torch.as_tensor(temperature).to(zf.dtype)
    center = prototypes.mean(0)
    pc = prototypes - center
    weight, bias = layer_operands(pc, pc.square().sum(1), t)
    return zf - center, weight, bias


def nearest(zc: Tensor, weight: Tensor, bias: Tensor, scores: Scores, rows: int = 1024) -> Tensor:
    """Each token's nearest code: the first index of each row's largest score (float32), ``rows`` tokens at a time."""
    from softvq._kernels import max_rows

    out = torch.empty(zc.shape[0], dtype=torch.long)
    for start in range(0, zc.shape[0], rows):
        s = scores(zc[start:start + rows], weight, bias)
        out[start:start + s.shape[0]] = max_rows(s.float())[1]
    return out


def distance_increase(z: Tensor, prototypes: Tensor, reference: Tensor, found: Tensor) -> dict[str, Any]:
    """Tokens whose code ``found`` differs from ``reference``: their count and fraction, and the relative increase of
    the float64 squared distance to the found code over that to the reference code (mean, median, max)."""
    z64, p64 = z.double(), prototypes.double()
    changed = (found != reference).nonzero().squeeze(1)
    out: dict[str, Any] = {"tokens": int(z.shape[0]), "changed": int(changed.numel()),
                           "fraction_changed": changed.numel() / max(1, z.shape[0]),
                           "rel_increase_mean": None, "rel_increase_median": None, "rel_increase_max": None,
                           "abs_increase_mean": None, "closer": 0}
    if changed.numel():
        zc = z64[changed]
        d_ref = (zc - p64[reference[changed]]).square().sum(1)
        d_new = (zc - p64[found[changed]]).square().sum(1)
        rel = (d_new - d_ref) / d_ref.clamp_min(torch.finfo(torch.float64).tiny)
        out.update(rel_increase_mean=float(rel.mean()), rel_increase_median=float(rel.median()),
                   rel_increase_max=float(rel.max()), abs_increase_mean=float((d_new - d_ref).mean()),
                   closer=int((d_new < d_ref).sum()))
    return out


def psnr_per_image(reconstruction: Tensor, x: Tensor) -> Tensor:
    """Per-image PSNR in dB of ``reconstruction`` clamped to [0, 1] against ``x`` (data range 1), as the harness's
    ``PeakSignalNoiseRatio(data_range=1.0, dim=(1, 2, 3))``."""
    from torchmetrics.functional.image import peak_signal_noise_ratio

    return peak_signal_noise_ratio(reconstruction.clamp(0.0, 1.0).double(), x.double(), data_range=1.0,
                                   reduction="none", dim=(1, 2, 3))


def time_matmul(dtype: torch.dtype, n: int = 8192, dim: int = 64, k: int = 16384, repeats: int = 5,
                warmup: bool = True) -> list[float]:
    """Seconds of the score ``addmm`` ``(K,) + (N, D) @ (D, K)`` in ``dtype`` into a preallocated output, one warm-up
    call (unless ``warmup`` is false), then ``repeats`` timed calls."""
    g = torch.Generator().manual_seed(0)
    zc = torch.randn(n, dim, generator=g).to(dtype)
    weight = torch.randn(dim, k, generator=g).to(dtype)
    bias = torch.randn(k, generator=g).to(dtype)
    out = torch.empty(n, k, dtype=dtype)
    if warmup:
        torch.addmm(bias, zc, weight, out=out)
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        torch.addmm(bias, zc, weight, out=out)
        times.append(time.perf_counter() - start)
    return times


def cpu_info() -> dict[str, Any]:
    try:
        text = subprocess.run(["lscpu"], capture_output=True, text=True, check=True).stdout
    except (OSError, subprocess.CalledProcessError):
        text = ""
    model = next((line.split(":", 1)[1].strip() for line in text.splitlines() if line.startswith("Model name")),
                 platform.processor())
    flags = next((line.split(":", 1)[1].split() for line in text.splitlines() if line.startswith("Flags")), [])
    return {"model": model, "avx512_bf16": "avx512_bf16" in flags, "amx": any(f.startswith("amx") for f in flags),
            "avx512_fp16": "avx512_fp16" in flags, "mkldnn_bf16": bool(torch.backends.mkldnn.is_available())}


def code_state() -> dict[str, Any]:
    from eval._provenance import git

    return {"commit": git("rev-parse", "--short", "HEAD"), "dirty": bool(git("status", "--porcelain"))}


def load(run: Path) -> tuple[Any, dict[str, Any], str]:
    from eval import peers

    record = json.loads((run / "result.json").read_text())
    return peers.load_trained(record, run / "vqvae.pt"), record["settings"], record["method"]


def measure(run: Path, data_root: Path, images: int, batch: int = 250) -> dict[str, Any]:
    from eval import peers

    vqvae, settings, method = load(run)
    x = peers.validation_images(data_root, settings, images)  # the test split is not read
    layer = vqvae.quantizer
    latents, layer_idx = [], []
    for start in range(0, x.shape[0], batch):
        lat = vqvae.latents(x[start:start + batch]).movedim(1, -1)  # (B, h, w, D)
        layer_idx.append(layer(lat).indices.reshape(-1))
        latents.append(lat)
    grid = latents[0].shape[1:3]
    z = torch.cat(latents).reshape(-1, layer.dim)
    reference = torch.cat(layer_idx)  # the layer's own float32 codes in eval mode
    zf = layer.standardizer.standardize(z.float())
    prototypes = layer.prototypes.detach().float()
    temperature = layer.temperature_control.temperature_t
    zc, weight, bias = score_operands(zf, prototypes, temperature)

    def psnr(indices: Tensor) -> Tensor:
        grids = indices.reshape(-1, *grid)
        return torch.cat([psnr_per_image(vqvae.decode_indices(grids[i:i + batch]), x[i:i + batch])
                          for i in range(0, x.shape[0], batch)])

    base = psnr(reference)
    nearest_d = (zf.double() - prototypes.double()[reference]).square().sum(1)  # for scale
    rows: dict[str, Any] = {}
    for name, scores in PRECISIONS.items():
        start = time.perf_counter()
        found = nearest(zc, weight, bias, scores)
        seconds = time.perf_counter() - start
        row = distance_increase(zf, prototypes, reference, found)
        per_image = psnr(found) if row["changed"] else base
        delta = per_image - base
        row.update(psnr_hard=float(per_image.mean()), psnr_hard_float32=float(base.mean()),
                   psnr_delta_db=float(delta.mean()), psnr_delta_worst_image_db=float(delta.min()),
                   images_changed=int((found.reshape(x.shape[0], -1) != reference.reshape(x.shape[0], -1))
                                      .any(1).sum()),
                   sweep_s=seconds)
        rows[name] = row
        print(f"{name:26s} changed {row['fraction_changed']:.4%}  dPSNR {row['psnr_delta_db']:+.4f} dB  "
              f"({seconds:.1f} s)", flush=True)
    # float64 scores: how far the layer's own float32 codes sit from exact ones
    exact = nearest(*(t.double() for t in (zc, weight, bias)), lambda a, b, c: torch.addmm(c, a, b))
    f64 = distance_increase(zf, prototypes, exact, reference)
    record = json.loads((run / "result.json").read_text())
    return {"method": method, "settings": settings, "run_code": record.get("code"),
            "tokens": int(z.shape[0]), "images": int(x.shape[0]),
            "temperature": float(temperature), "tokens_per_image": int(grid[0] * grid[1]),
            "psnr_hard_float32": float(base.mean()), "nearest_d_mean": float(nearest_d.mean()),
            "nearest_d_median": float(nearest_d.median()),
            "float32_vs_float64": f64, "precisions": rows}


def fmt(v: Any, spec: str) -> str:
    return "–" if v is None or (isinstance(v, float) and math.isnan(v)) else format(v, spec)


def write_report(result: dict[str, Any], out: Path, command: str) -> None:
    m, t, c = result["measure"], result["timing"], result["cpu"]
    trained = m.get("run_code") or {}
    trained_at = (f"run trained at {trained['commit']}{'+' if trained.get('dirty') else ''}; "
                  if trained.get("commit") else "")
    measured = f"{result['code']['commit']}{'+' if result['code']['dirty'] else ''}"
    lines = [
        "# Score precision: what bf16 / fp16 / TF32 scores do to a trained DDCL layer's codes",
        "",
        f"Regenerate: `{command}`",
        "",
        f"Code: {trained_at}measured and written at {measured} (+: a dirty tree).",
        "",
        f"Run `{result['run']}` ({m['method']}, K = {m['settings']['num_codes']}, D = {m['settings']['code_dim']}, "
        f"T = {m['temperature']:.4f}); the first {m['images']} images of the **validation** split "
        f"({m['tokens']} tokens, {m['tokens_per_image']} per image). One trained run, one seed: no spread. "
        f"Code {result['code']['commit']}{' (dirty tree)' if result['code']['dirty'] else ''}, "
        f"torch {result['torch']}, {c['model']}, one thread.",
        "",
        "Reference: the layer's own codes in eval mode (`quantizer(z).indices`, float32). The score is the layer's "
        "`addmm(-|p_c|^2/T, z_c, (2/T) P_c^T)` (`softvq/_soft_centroid.py`), its argmax the nearest code. "
        "*In type*: operands cast and the `addmm` done in the type (CPU BLAS accumulates in float32, rounds the "
        "result to the type). *In, float32 out*: operands rounded to the type, float32 products and sums and result. "
        "*tf32 (emulated)*: mantissas cut to 10 bits (`& ~0x1FFF`, toward zero), float32 `addmm`; no TF32 hardware "
        "ran. Relative increase: (d(chosen) - d(float32 nearest)) / d(float32 nearest), float64 squared distances, "
        "over the changed tokens. PSNR: hard-index decode, clamped, mean of per-image PSNR.",
        "",
        f"Squared distance of a token to its float32 code, for scale: mean {m['nearest_d_mean']:.3f}, median "
        f"{m['nearest_d_median']:.3f} (standardised space). The float32 row compares this script's reproduction of "
        "the score with the layer's own indices.",
        "",
        "| scores | codes changed | images with a change | rel. increase of d, mean | median | max "
        "| abs. increase of d, mean | PSNR hard (dB) | Δ PSNR (dB) | worst image Δ (dB) |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for name, r in m["precisions"].items():
        lines.append(f"| {name} | {r['fraction_changed']:.3%} ({r['changed']}) | {r['images_changed']} "
                     f"| {fmt(r['rel_increase_mean'], '.2e')} | {fmt(r['rel_increase_median'], '.2e')} "
                     f"| {fmt(r['rel_increase_max'], '.2e')} | {fmt(r['abs_increase_mean'], '.3f')} "
                     f"| {r['psnr_hard']:.4f} | {r['psnr_delta_db']:+.4f} "
                     f"| {r['psnr_delta_worst_image_db']:+.4f} |")
    f64 = m["float32_vs_float64"]
    lines += [
        "",
        f"For scale, the layer's float32 codes against float64 scores: {f64['fraction_changed']:.3%} of tokens "
        f"differ ({f64['changed']}), relative increase mean {fmt(f64['rel_increase_mean'], '.2e')}, "
        f"max {fmt(f64['rel_increase_max'], '.2e')}.",
        "",
        f"Score `addmm` alone, N = {t['n']}, D = {t['dim']}, K = {t['k']}, one thread, median of {t['repeats']} "
        "after one warm-up (float16: one call, no warm-up: it has no fast CPU path) "
        f"(CPU: {c['model']}; avx512_bf16: {'yes' if c['avx512_bf16'] else 'no'}, AMX: {'yes' if c['amx'] else 'no'}, "
        f"avx512_fp16: {'yes' if c['avx512_fp16'] else 'no'}; the machine is shared with other jobs):",
        "",
        "| dtype | median (ms) | all (ms) | vs float32 |",
        "|---|---:|---:|---:|",
    ]
    base = t["median_s"]["float32"]
    for name, med in t["median_s"].items():
        lines.append(f"| {name} | {1e3 * med:.1f} | {', '.join(f'{1e3 * v:.0f}' for v in t['all_s'][name])} "
                     f"| {med / base:.2f}x |")
    lines += ["", "## Conclusion", "", result["conclusion"], ""]
    (out / "report.md").write_text("\n".join(lines))


def conclude(m: dict[str, Any], t: dict[str, Any]) -> str:
    p = m["precisions"]
    bf, bf_in, tf = p["bfloat16"], p["bfloat16 in, float32 out"], p["tf32 (emulated)"]
    speed = t["median_s"]["float32"] / t["median_s"]["bfloat16"]
    return (
        f"On this trained K = {m['settings']['num_codes']} layer, bf16 scores computed in bf16 change "
        f"{bf['fraction_changed']:.2%} of the codes and move hard PSNR by {bf['psnr_delta_db']:+.3f} dB; with bf16 "
        f"inputs and a float32 result {bf_in['fraction_changed']:.2%} and {bf_in['psnr_delta_db']:+.3f} dB; "
        f"TF32 (emulated) {tf['fraction_changed']:.2%} and {tf['psnr_delta_db']:+.3f} dB; float16 "
        f"{p['float16']['fraction_changed']:.2%} / {p['float16']['psnr_delta_db']:+.3f} dB. The changed codes' squared "
        f"distance is on average {fmt(bf['rel_increase_mean'], '.1e')} relative above the float32 nearest's under "
        f"bf16 (at most {fmt(bf['rel_increase_max'], '.1e')}), {fmt(bf_in['rel_increase_mean'], '.1e')} with a "
        f"float32 result, {fmt(tf['rel_increase_mean'], '.1e')} under TF32. On this CPU the bf16 matmul ran "
        f"{speed:.2f}x the float32 speed (median of {t['repeats']}; float16 "
        f"{t['median_s']['float32'] / t['median_s']['float16']:.3f}x). "
    )


def save(result: dict[str, Any], out: Path) -> None:
    """``results.json`` and ``report.md``, every absolute path made relative to the repository
    (``eval._provenance.portable``: a record names no machine)."""
    from eval._provenance import portable

    result = portable(result)
    (out / "results.json").write_text(json.dumps(result, indent=2) + "\n")
    write_report(result, out, result["command"])


def command_of(run: Path, data_root: Path | str, images: int, out: Path, conclusion: Path | None) -> str:
    return (f"python -m eval.score_precision --run {run} --data-root {data_root} --images {images} --out {out}"
            + (f" --conclusion-file {conclusion}" if conclusion else ""))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--run", type=Path, help="a run directory with result.json and vqvae.pt")
    parser.add_argument("--render", action="store_true",
                        help="only rewrite report.md (and the conclusion) from --out's results.json, measuring nothing")
    parser.add_argument("--data-root", type=Path, default=Path("/work/shared/data/cifar10-jpeg.tar.gz"))
    parser.add_argument("--images", type=int, default=2000, help="the first N validation images (default 2000)")
    parser.add_argument("--out", type=Path, default=Path("reports/score_precision"))
    parser.add_argument("--repeats", type=int, default=5, help="timed calls of each matmul (median reported)")
    parser.add_argument("--conclusion-file", type=Path, default=None,
                        help="a file whose text is appended to the automatic conclusion in report.md")
    args = parser.parse_args(argv)
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    torch.set_num_threads(1)
    args.out.mkdir(parents=True, exist_ok=True)
    extra = args.conclusion_file.read_text().strip() if args.conclusion_file else ""
    if args.render:
        result = json.loads((args.out / "results.json").read_text())
        record = ROOT / result["run"] / "result.json"  # relative paths are the repository's
        if "run_code" not in result["measure"] and record.is_file():
            result["measure"]["run_code"] = json.loads(record.read_text()).get("code")
        result["command"] = command_of(Path(result["run"]), result["data_root"] if "data_root" in result
                                       else args.data_root, result["images"], args.out, args.conclusion_file)
        result["conclusion"] = conclude(result["measure"], result["timing"]) + ("\n\n" + extra if extra else "")
        save(result, args.out)
        return 0
    if args.run is None:
        parser.error("--run is required (unless --render)")

    m = measure(args.run, args.data_root, args.images)
    timing: dict[str, Any] = {"n": 8192, "dim": 64, "k": 16384, "repeats": args.repeats, "all_s": {}, "median_s": {}}
    # float16: one call, no warm-up (torch's CPU addmm has no fast float16 path here: ~38 s a call in a trial)
    for name, dtype, repeats in (("float32", torch.float32, args.repeats), ("bfloat16", torch.bfloat16, args.repeats),
                                 ("float16", torch.float16, 1)):
        times = time_matmul(dtype, repeats=repeats, warmup=repeats > 1)
        timing["all_s"][name], timing["median_s"][name] = times, statistics.median(times)
        print(f"addmm {name}: median {1e3 * statistics.median(times):.1f} ms", flush=True)
    command = command_of(args.run, args.data_root, args.images, args.out, args.conclusion_file)
    result = {"run": str(args.run), "data_root": str(args.data_root), "images": m["images"], "code": code_state(),
              "torch": torch.__version__,
              "cpu": cpu_info(), "threads": torch.get_num_threads(), "command": command, "split": "validation",
              "measure": m, "timing": timing}
    result["conclusion"] = conclude(m, timing) + ("\n\n" + extra if extra else "")
    save(result, args.out)
    print(f"wrote {args.out / 'results.json'} and {args.out / 'report.md'}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
