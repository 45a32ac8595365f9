"""Sample quality of the long runs' VQ-VAEs: ``python -m eval.sample_quality --long-runs DIR``.

The points are the finished runs of :mod:`eval.long_run` (``K<K>/<method>/seed<S>/`` with ``result.json`` and the kept
``checkpoints/last.ckpt``). What is derived from a run lives in ``--work/K<K>/<method>/seed<S>/``, each file written
atomically and read back on a rerun (a long study resumes): ``point.json`` (the checkpoint's SHA-256: :func:`claim`),
``codes/`` (:func:`softvq.models.codes.code_splits`) and per prior its state and record (:func:`load_or_fit`). Every
point's priors share one budget (:func:`prepare`); the protocol is chosen on the validation split alone
(:func:`select`), then the test split is read once (:func:`score`). The report: :mod:`eval.sample_quality.long_report`.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import logging
import math
import statistics
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any, NamedTuple

import torch
from torch import Tensor

from eval import harness
from eval import rate_distortion as rd
from eval._provenance import repo_relative
from eval.sample_quality import classifier as clf
from eval.sample_quality.long_report import by_method, targets
from eval.sample_quality.sampling import draw, fit_conditional_prior, reconstruct
from softvq.data.cifar10 import CIFAR10DataModule, sha256_file
from softvq.models import VQVAE
from softvq.models.checkpoint_io import load_torch_file
from softvq.models.codes import CodeSet, code_splits
from softvq.models.files import RunLock, RunLockedError, write_atomic
from softvq.models.prior import LN2, CodePrior
from softvq.models.transformer import PriorConfig

ONE_HOT, CONDITIONAL = "one_hot", "conditional"
log = logging.getLogger(__name__)


def soft_name(a: float) -> str:
    """The name of the prior trained with ``soft_targets = a``."""
    return f"soft{a:g}"


class Point(NamedTuple):
    """A finished long run, ready to score.

    Attributes:
        record: what the report says of it: name, method, K, seed, run, checkpoint SHA-256, the run's test PSNR,
            training images, prior steps, and each prior's record by name.
        vqvae: its VQ-VAE (the checkpoint's weights), eval mode.
        codes: its held-out splits' hard codes and labels, ``{"val", "test"}`` (the training codes and every soft
            assignment are let go once the priors are fit).
        priors: its priors by name (``one_hot``, ``conditional``, ``soft<A>``), eval mode.
    """

    record: dict[str, Any]
    vqvae: VQVAE
    codes: dict[str, CodeSet]
    priors: dict[str, CodePrior]


def find_runs(runs: Path, num_codes: list[int] | None = None, methods: list[str] | None = None) -> list[Path]:
    """The finished long runs under ``runs`` (``K<K>/<method>/seed<S>/`` with a ``result.json``), sorted; only the
    codebook sizes in ``num_codes`` and methods in ``methods`` when given."""
    found = sorted(p.parent for p in runs.glob("K*/*/seed*/result.json"))
    found = [p for p in found if (num_codes is None or p.parts[-3] in {f"K{k}" for k in num_codes})
             and (methods is None or p.parts[-2] in methods)]
    if not found:
        raise FileNotFoundError(f"no finished long run (K<K>/<method>/seed<S>/result.json) under {runs}"
                                + ("" if num_codes is None else f" at K in {sorted(num_codes)}")
                                + ("" if methods is None else f" of methods {methods}"))
    return found


def final_vqvae(run: Path) -> tuple[dict[str, Any], VQVAE, Path]:
    """A finished long run's record (``result.json``), its VQ-VAE with the final weights of its kept checkpoint (eval
    mode) and that checkpoint's path.

    Raises:
        ValueError: the checkpoint is not the last epoch's.
    """
    result = json.loads((run / "result.json").read_text())
    s = result["settings"]
    checkpoint = run / "checkpoints" / "last.ckpt"
    stored = load_torch_file(checkpoint, "checkpoint")
    if int(stored["epoch"]) + 1 != s["epochs"]:
        raise ValueError(f"{checkpoint} ends epoch {int(stored['epoch']) + 1}, but the run finished {s['epochs']}: not "
                         f"its final weights")
    vqvae = harness.vqvae_of(result["method"], s)
    vqvae.load_state_dict(stored["state_dict"])
    return result, vqvae.eval(), checkpoint


def claim(work: Path, sha256: str, checkpoint: Path) -> None:
    """Bind ``work`` to the checkpoint of hash ``sha256`` (``point.json``), or check that it is bound to it.

    Raises:
        ValueError: ``work`` was derived from another checkpoint (naming both hashes).
    """
    path = work / "point.json"
    if path.is_file():
        held = json.loads(path.read_text())["checkpoint_sha256"]
        if held != sha256:
            raise ValueError(f"{work} holds work derived from a checkpoint with sha256 {held}, but {checkpoint} has "
                             f"sha256 {sha256}: the run was trained again or its checkpoint replaced. Delete {work} to "
                             f"derive it from this checkpoint, or pass another --work")
        return
    work.mkdir(parents=True, exist_ok=True)
    write_atomic(path, json.dumps({"checkpoint": repo_relative(checkpoint), "checkpoint_sha256": sha256}, indent=1))


@torch.no_grad()
def image_bits(prior: CodePrior, codes: Tensor, labels: Tensor | None = None, batch_size: int = 500) -> Tensor:
    """``(N,)`` float64: each code grid's NLL under ``prior`` in bits, summed over its positions (their mean is
    :func:`~softvq.models.prior.evaluate_prior`'s bits per position times ``h * w``); ``labels`` for a conditional
    prior."""
    prior.eval()
    return torch.cat([prior.nll(codes[i:i + batch_size], None if labels is None else labels[i:i + batch_size])
                      .double().sum(1) for i in range(0, len(codes), batch_size)]) / LN2


def mean_interval(values: Tensor, replicates: int = 1000, seed: int = 0, level: float = 0.95) -> dict[str, float]:
    """The mean of per-image ``values (N,)`` and a percentile bootstrap interval of it (the images resampled with
    replacement; one seed, so two calls on the same images resample the same ones), as
    :func:`~eval.sample_quality.classifier.bootstrap_frechet` gives its distance."""
    g = torch.Generator().manual_seed(seed)
    v = values.double()
    means = torch.stack([v[torch.randint(len(v), (len(v),), generator=g)].mean() for _ in range(replicates)])
    tail = (1.0 - level) / 2
    return {"value": float(v.mean()), "low": float(means.quantile(tail)), "high": float(means.quantile(1 - tail)),
            "replicates": replicates, "level": level}


def load_or_fit(work: Path, spec: dict[str, Any], fit: Callable[[], tuple[CodePrior, float]],
                val: CodeSet) -> tuple[CodePrior, dict[str, Any]]:
    """The prior that ``spec`` describes, read from ``work`` where its record is, else ``fit()`` (the prior and its
    training seconds) and written there: its state (``prior-<name>-<key>.pt``), then its record (``.json``).

    Raises:
        ValueError: the state file is not the one its record hashes.
    """
    key = hashlib.sha256(json.dumps(spec, sort_keys=True).encode()).hexdigest()[:12]
    path = work / f"prior-{spec['prior']}-{key}.pt"
    record_path = path.with_suffix(".json")
    if record_path.is_file():
        record = json.loads(record_path.read_text())
        digest = sha256_file(path)
        if digest != record["sha256"]:
            raise ValueError(f"{path} has sha256 {digest}, but its record says {record['sha256']}: the file was "
                             f"changed or replaced; delete both to train it again")
        stored = load_torch_file(path, "prior state")
        prior = CodePrior(PriorConfig(**stored["config"]))
        prior.load_state_dict(stored["state_dict"])
        return prior.eval(), record
    log.info("%s: training prior %s", work, spec["prior"])
    prior, seconds = fit()
    log.info("%s: prior %s trained in %.0f s", work, spec["prior"], seconds)
    state = {"config": prior.config.to_dict(), "state_dict": prior.state_dict()}
    write_atomic(path, lambda f: torch.save(state, f))
    bits = image_bits(prior, val.codes, val.labels if prior.conditional else None)
    record = {**spec, "sha256": sha256_file(path), "fit_seconds": seconds, "val_bits_per_image": float(bits.mean())}
    write_atomic(record_path, json.dumps(record, indent=1))
    return prior, record


def prepare(run: Path, args: argparse.Namespace) -> Point:
    """A finished long run made ready to score: its VQ-VAE from the kept checkpoint, its codes and its priors, each
    read from its work directory when there, else derived and written there.

    The work directory is locked while it is prepared (:class:`~softvq.models.files.RunLock`), so two processes never
    write one point's files.

    Raises:
        ValueError: the run holds out another validation split than ``--val-size``; its checkpoint is not its last
            epoch's; its work directory was derived from another checkpoint (naming both hashes).
        RunLockedError: another live process is preparing the point (naming its pid).
    """
    work = args.work / run.relative_to(args.long_runs).as_posix()
    try:
        lock = RunLock(work).acquire()
    except RunLockedError:
        holder = (work / RunLock.NAME).read_text().strip() or "unknown"
        raise RunLockedError(f"{work} is being prepared by another process (pid {holder}): wait for it to finish "
                             f"(--stage prepare skips such a point)") from None
    try:
        return _prepare(run, work, args)
    finally:
        lock.release()


def _prepare(run: Path, work: Path, args: argparse.Namespace) -> Point:
    result, vqvae, checkpoint = final_vqvae(run)
    method, s = result["method"], result["settings"]
    if s["val_size"] != args.val_size:
        raise ValueError(f"{run} held out {s['val_size']} validation images, --val-size is {args.val_size}: the "
                         f"samples are chosen against the runs' validation split; pass --val-size {s['val_size']}")
    sha = sha256_file(checkpoint)
    name = run.relative_to(args.long_runs).as_posix()
    claim(work, sha, checkpoint)
    data = CIFAR10DataModule(args.data_root, val_size=s["val_size"], train_subset=s["train_subset"], num_workers=0)
    soft_k = args.soft_top_k if args.soft_targets and method.startswith("ddcl") else None
    codes = code_splits(vqvae, sha, data, cache_dir=work / "codes", soft_top_k=soft_k)
    hard, train = {split: c.codes for split, c in codes.items()}, codes["train"]
    settings, num_codes, grid = rd.prior_settings(args), vqvae.num_codes, tuple(train.codes.shape[1:])

    def conditional() -> tuple[CodePrior, float]:
        begin = time.perf_counter()
        return fit_conditional_prior(train.codes, train.labels, settings, num_codes), time.perf_counter() - begin

    fits: dict[str, tuple[int | None, Callable[[], tuple[CodePrior, float]]]] = {
        ONE_HOT: (None, lambda: rd.fit_prior(hard, num_codes, grid, settings))}
    if args.conditional:
        fits[CONDITIONAL] = (None, conditional)
    for a in args.soft_targets if soft_k else ():
        fits[soft_name(a)] = (soft_k, lambda a=a: rd.fit_prior(hard, num_codes, grid, settings, soft=train.soft,
                                                                 soft_targets=a))
    priors, records = {}, {}
    for prior_name, (k, fit) in fits.items():
        spec = {"prior": prior_name, "settings": settings, "checkpoint_sha256": sha, "soft_top_k": k}
        priors[prior_name], records[prior_name] = load_or_fit(work, spec, fit, codes["val"])
    record = {"point": name, "method": method, "num_codes": num_codes, "seed": result["seed"],
              "run": repo_relative(run), "code": result.get("code"), "checkpoint_sha256": sha, "epochs": s["epochs"],
              "psnr_hard": result["test"]["psnr_hard"], "psnr_images": result["test"].get("images"),
              "train_images": len(train.codes),
              "prior_steps": settings["epochs"] * math.ceil(len(train.codes) / settings["batch_size"]),
              "priors": records}
    return Point(record, vqvae, {split: codes[split]._replace(soft=None) for split in ("val", "test")}, priors)


def select(points: list[Point], classifier: clf.SmallResNet, val_f: Tensor, args: argparse.Namespace
           ) -> dict[str, Any]:
    """The protocol, from the validation split alone: the temperature, ``A`` and the guidance weight. Reads the
    points' VQ-VAEs and priors and the priors' validation bits: no test image, no test code."""
    def val_fd(point: Point, name: str, temperature: float, labels: Tensor | None = None,
               guidance: float = 1.0) -> tuple[float, Tensor]:
        samples = draw(point.vqvae, point.priors[name], args.samples, temperature, args.seed, labels, guidance)
        return clf.frechet_distance(val_f, clf.features_of(classifier, samples)), samples

    by_t = {t: [val_fd(p, ONE_HOT, t)[0] for p in points] for t in args.temperatures}
    temperature = min(args.temperatures, key=lambda t: statistics.fmean(by_t[t]))
    protocol: dict[str, Any] = {"temperature": temperature, "top_k": None, "samples": args.samples,
                                "seed": args.seed, "test_seed": args.seed + 1,
                                "validation_fd": {str(t): v for t, v in by_t.items()}, "soft_targets": None,
                                "guidance": None}
    soft = [p for p in points if soft_name(args.soft_targets[0]) in p.priors] if args.soft_targets else []
    if soft:  # A and the soft prior's own temperature: its targets spread its distribution by design
        by_a = {a: {"fd": {t: [val_fd(p, soft_name(a), t)[0] for p in soft] for t in args.temperatures},
                    "bits": [p.record["priors"][soft_name(a)]["val_bits_per_image"] for p in soft]}
                for a in args.soft_targets}
        protocol["soft_targets"], protocol["soft_temperature"] = min(
            ((a, t) for a in args.soft_targets for t in args.temperatures),
            key=lambda at: (statistics.fmean(by_a[at[0]]["fd"][at[1]]), statistics.fmean(by_a[at[0]]["bits"])))
        protocol["validation_soft"] = {str(a): {"fd": {str(t): fd for t, fd in v["fd"].items()}, "bits": v["bits"]}
                                       for a, v in by_a.items()}
    if args.conditional:
        labels = torch.arange(args.samples) % 10
        by_w = {w: [] for w in args.guidance}
        for w in args.guidance:
            for p in points:
                fd, samples = val_fd(p, CONDITIONAL, 1.0, labels, w)
                by_w[w].append({"fd": fd, "accuracy": float((clf.predict(classifier, samples) == labels).double()
                                                            .mean())})
        protocol["guidance"] = min(args.guidance, key=lambda w: statistics.fmean(r["fd"] for r in by_w[w]))
        protocol["validation_guidance"] = {str(w): v for w, v in by_w.items()}
    return protocol


def score(point: Point, classifier: clf.SmallResNet, test: tuple[Tensor, Tensor, Tensor],
          protocol: dict[str, Any], args: argparse.Namespace) -> dict[str, Any]:
    """A point's test figures under ``protocol``: its reconstructions of the test images ``test = (features, images,
    labels)``; per prior the bits per image of every test image's hard codes and its samples' CFD."""
    test_f, test_x, test_y = test
    codes, seed, n = point.codes["test"], protocol["test_seed"], args.samples
    recon = reconstruct(point.vqvae, test_x)
    row = {**point.record, "reconstruction_fd": clf.bootstrap_frechet(test_f, clf.features_of(classifier, recon)),
           "reconstruction_accuracy": float((clf.predict(classifier, recon) == test_y).double().mean())}

    def unconditional(name: str, temperature: float) -> tuple[Tensor, dict[str, Any]]:
        bits = image_bits(point.priors[name], codes.codes)
        samples = draw(point.vqvae, point.priors[name], n, temperature, seed)
        return bits, {"prior": name, "bits_per_image": mean_interval(bits),
                      "samples_fd": clf.bootstrap_frechet(test_f, clf.features_of(classifier, samples))}

    hard_bits, row["one_hot"] = unconditional(ONE_HOT, protocol["temperature"])
    a = protocol["soft_targets"]
    if a is not None and soft_name(a) in point.priors:
        soft_bits, row["soft"] = unconditional(soft_name(a), protocol["soft_temperature"])
        row["soft_minus_one_hot_bits"] = mean_interval(soft_bits - hard_bits)  # paired: the same test images
    if protocol["guidance"] is not None:
        labels, prior = torch.arange(n) % 10, point.priors[CONDITIONAL]
        samples = draw(point.vqvae, prior, n, 1.0, seed, labels, protocol["guidance"])
        row["conditional"] = {
            "samples_accuracy": float((clf.predict(classifier, samples) == labels).double().mean()),
            "samples_fd": clf.bootstrap_frechet(test_f, clf.features_of(classifier, samples)),
            "bits_per_image": mean_interval(image_bits(prior, codes.codes, codes.labels))}
    return row


def selected_runs(args: argparse.Namespace) -> list[Path]:
    """The finished runs that ``--num-codes`` and ``--methods`` select (:func:`find_runs`).

    Raises:
        ValueError: ``--soft-targets`` is given and none of them is a DDCL run.
    """
    runs = find_runs(args.long_runs, args.num_codes, args.methods)
    if args.soft_targets and not any(run.parts[-2].startswith("ddcl") for run in runs):
        raise ValueError(f"--soft-targets trains soft priors for DDCL points, and none of {len(runs)} runs is one")
    return runs


def prepare_all(args: argparse.Namespace) -> dict[str, Any]:
    """``--stage prepare``: every selected finished run's codes and priors derived into ``--work`` (or read back),
    with no classifier and no report; returns the points' records and the points it skipped because another process
    was preparing them. The full study, run later, reads them back and trains nothing that is there. Several of these
    may run side by side, one per core: each takes the points no other one holds."""
    begin = time.perf_counter()
    records, skipped = [], []
    with harness.study_run(args.threads):
        for run in selected_runs(args):
            try:
                records.append(prepare(run, args).record)
            except RunLockedError as err:
                log.info("skipped: %s", err)
                skipped.append(run.relative_to(args.long_runs).as_posix())
    log.info("prepared %d point(s) in %.0f s; %d held by another process", len(records), time.perf_counter() - begin,
             len(skipped))
    return {"stage": "prepare", "work": repo_relative(args.work), "points": records, "skipped": skipped}


def study(args: argparse.Namespace, data: CIFAR10DataModule, classifier: clf.SmallResNet,
          val_f: Tensor) -> dict[str, Any]:
    """Prepare every selected run, choose the protocol on the validation features ``val_f``, then score every point
    on the test split, read here once, after the choices: the summary's study part."""
    runs = selected_runs(args)
    begin = time.perf_counter()
    with harness.study_run(args.threads):
        points = [prepare(run, args) for run in runs]
    prepared = time.perf_counter()
    protocol = select(points, classifier, val_f, args)
    selected = time.perf_counter()
    test_x, test_y = clf.images_of(data.test_set, args.samples)
    test_f = clf.features_of(classifier, test_x)
    rows = [score(p, classifier, (test_f, test_x, test_y), protocol, args) for p in points]
    return {"source": "long_runs", "runs": repo_relative(args.long_runs), "work": repo_relative(args.work),
            "prior": {"settings": rd.prior_settings(args), "soft_targets": args.soft_targets,
                      "soft_top_k": args.soft_top_k if args.soft_targets else None, "conditional": args.conditional},
            "protocol": protocol, "real_test_accuracy": float((clf.predict(classifier, test_x) == test_y).double()
                                                              .mean()),
            "rows": rows, "methods": by_method(rows), "targets": targets(rows),
            "wall_s": {"prepare": prepared - begin, "select": selected - prepared,
                                     "test": time.perf_counter() - selected}}
