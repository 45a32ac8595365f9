"""The report of :mod:`eval.paradigm1`: per encoder the clustering, supervised and hierarchical tables, the margins
judged against the seed spread, and the verdict on each of the paper's claims."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from eval._provenance import code_commit, portable
from eval._spread import beyond_spread, verdict
from softvq.models.files import write_atomic

HEADS = {"cls": "CLS feature + linear probe", "mean": "mean token + linear probe",
         "ddcl_pooled": "DDCLReadout pooled + linear head",
         "ddcl_slots": "DDCLReadout [pooled, mass, slots] + linear head",
         "ddcl_2level": "2-level DDCLReadout [both levels] + linear head"}
ENCODERS = {"vqvae": "VQ-VAE encoder (frozen), 8x8 latent grid",
            "vit": "ViT trained on CIFAR-10 labels (frozen), patch tokens", "tokens": "token features from --tokens"}


def _ms(s: dict[str, Any], digits: int = 4) -> str:
    return f"{s['mean']:.{digits}f} ± {s['std']:.{digits}f}"


def _judge(a: list[float], b: list[float]) -> dict[str, Any]:
    """The reports' one rule (:func:`eval._spread.beyond_spread`) on paired seeds; a single value of ``b`` is a
    deterministic reference (the logistic-regression bound), compared with every seed of ``a``."""
    j = beyond_spread(a, b, exact_b=len(b) == 1 and len(a) > 1)
    return {**j, "verdict": verdict(j)}


def _verdict(j: dict[str, Any], digits: int = 3) -> str:
    word = {"higher": "**higher**", "lower": "**lower**", "within spread": "within spread"}[j["verdict"]]
    return f"{j['margin']:+.{digits}f} ({word})"


def encoder_intro(name: str, e: dict[str, Any]) -> list[str]:
    f, c = e["encoder"], e["config"]
    lines = [f"## {ENCODERS.get(name, name)}", ""]
    if name == "vit":
        v = f["config"]
        lines.append(f"ViT: {v['depth']} layers, dim {v['dim']}, {v['heads']} heads, patch {v['patch']}, "
                     f"{f['parameters']:,} parameters, trained {v['epochs']} epochs on {f['train_images']:,} training "
                     f"images that the readouts never see ({f['train_seconds'] / 60:.1f} min); its own CLS head: "
                     f"**test accuracy {f['test_acc']:.4f}**, {f['readout_train_acc']:.4f} on the readout's training "
                     f"images.")
    elif name == "vqvae":
        lines.append(f"Checkpoint `{f['checkpoint']}` (sha256 {f['checkpoint_sha256'][:16]}..., {f['quantizer']}): "
                     f"tokens are the latents its quantizer sees. Trained without labels.")
    else:
        lines.append(f"Tokens from `{f.get('file')}`.")
    lines += ["", f"{e['train_examples']:,} training and {e['test_examples']:,} test sequences of T = {e['tokens']} "
              f"tokens, D = {e['dim']}; {e['classes']} classes. All methods see the same standardised tokens "
              f"(one map z' = (z - m) / s from the training tokens, s = {e['scaling']['scale']:.3g}). Seeds "
              f"{list(c['seeds'])}; the encoder is fixed, so the spread is that of the readouts and clusterings. "
              f"{e['seconds'] / 60:.1f} min.", ""]
    return lines


def clustering_table(e: dict[str, Any]) -> list[str]:
    c, classes = e["config"], e["classes"]
    cl = e["clustering"]
    lines = ["### Unsupervised: DDCL readout prototypes as clusters vs k-means (test split)", "",
             f"DDCL: the prototypes of a `DDCLReadout` trained on its own objective only (`{c['cluster_term']}`, Adam, "
             f"{c['cluster_steps']} steps of {c['cluster_batch']}, T annealed {c['cluster_t_start']:g} -> "
             f"{c['cluster_t_end']:g} x the mean squared distance, seeded by {c['cluster_init']}); cluster of an "
             f"example = the prototype with the largest mass sum_t q_tk over its tokens. k-means: `KMeans(K, "
             f"n_init='auto', random_state=seed)` on the same training features; cluster of an example = the cluster "
             f"most of its tokens fall in. 'tokens': both fit on the same {c['cluster_tokens']:,} random training "
             f"tokens; 'pooled': on the mean token of every training example (re-standardised). ACC: Hungarian at "
             f"K = {classes}, the training split's majority map at K = {c['cluster_mult'] * classes}.", "",
             "| features | K | k-means ACC | DDCL ACC | ACC margin | k-means NMI | DDCL NMI | NMI margin | k-means ARI "
             "| DDCL ARI |", "|---|---|---|---|---|---|---|---|---|---|"]
    for k in (classes, c["cluster_mult"] * classes):
        for space in ("pooled", "tokens"):
            km, dd = cl[f"kmeans_{space}_k{k}"], cl[f"ddcl_{space}_k{k}"]
            lines.append(f"| {space} | {k} | {_ms(km['acc'])} | {_ms(dd['acc'])} | "
                         f"{_verdict(_judge(dd['acc']['values'], km['acc']['values']))} | {_ms(km['nmi'])} | "
                         f"{_ms(dd['nmi'])} | {_verdict(_judge(dd['nmi']['values'], km['nmi']['values']))} | "
                         f"{_ms(km['ari'])} | {_ms(dd['ari'])} |")
    residual = max(r["clustering"][m]["max_identity_residual"] for r in e["runs"] for m in r["clustering"]
                   if m.startswith("ddcl"))
    lines += ["", f"Margins: DDCL minus k-means; **higher**/**lower** only when the margin exceeds the sum of the "
              f"two seed stds and has that sign on every seed. Identity residual |L_q - L_OLS - V| / L_q of the DDCL "
              f"clusterings: at most {residual:.1e}.", ""]
    return lines


def supervised_table(e: dict[str, Any]) -> list[str]:
    sup = e["supervised"]
    c = e["config"]
    lines = ["### Supervised: linear heads on frozen tokens (test accuracy after the last epoch)", "",
             f"Adam lr {c['lr']:g}, batch {c['batch_size']}, {c['epochs']} epochs; DDCL readouts K = {c['codes']} "
             f"(level 2: K = {c['codes_level2']}), T = {c['temperature']:g} x the mean squared token distance, "
             f"prototypes initialised from the first batch and trained with the head at lr / eps (eps = "
             f"{c['eps']:g}), their DDCL loss added.", ""]
    lines += ["| head | test accuracy | train accuracy | vs mean token | vs CLS | gap to the LR bound |",
              "|---|---|---|---|---|---|"]
    lr = e.get("logreg")
    for name, s in sup.items():
        vs_mean = "—" if name == "mean" else _verdict(
            _judge(s["test_acc"]["values"], sup["mean"]["test_acc"]["values"]))
        vs_cls = "—" if "cls" not in sup or name == "cls" else _verdict(
            _judge(s["test_acc"]["values"], sup["cls"]["test_acc"]["values"]))
        gap = "—" if lr is None else _verdict(_judge(s["test_acc"]["values"], [lr["test_acc"]]))
        lines.append(f"| {HEADS.get(name, name)} | {_ms(s['test_acc'])} | {s['train_acc']['mean']:.4f} | {vs_mean} | "
                     f"{vs_cls} | {gap} |")
    if lr is not None:
        lines.append(f"| **logistic regression on all {lr['features']:,} token features (bound)** | "
                     f"{lr['test_acc']:.4f} (deterministic) | {lr['train_acc']:.4f} | — | — | — |")
        held = ", ".join(f"C={k}: {v:.4f}" for k, v in lr["held_out_acc"].items())
        lines += ["", f"The bound: `LogisticRegression(C, max_iter={c['logreg_iter']})` (lbfgs), C chosen on a "
                  f"held-out fifth of the training split ({held}) -> C = {lr['C']:g}, refit on all of it "
                  f"({lr.get('iterations', '?')} iterations, {lr['seconds']:.0f} s)."]
    lines += ["", "Margins: differences of test accuracy (fractions), judged as above; the bound column is the head "
              "minus the bound.", ""]
    return lines


def hierarchy_table(e: dict[str, Any]) -> list[str]:
    h = e["hierarchy"]
    per_seed = h["per_seed"]
    two, one = e["supervised"]["ddcl_2level"]["test_acc"], e["supervised"]["ddcl_slots"]["test_acc"]
    j = _judge(two["values"], one["values"])
    meaning = {"higher": "the second level helps", "within spread": "no gain beyond the seed spread",
               "lower": "the second level hurts"}[j["verdict"]]
    lines = ["### Hierarchical: two stacked readout levels (level 2 reads level 1's soft centroids)", "",
             f"min V over every level, batch, epoch and seed: **{h['v_min']:.4g}** (>= 0 asserted); largest identity "
             f"residual {h['identity_residual_max']:.1e}. Second level: test accuracy {_ms(two)} with both levels vs "
             f"{_ms(one)} with level 1 alone: {_verdict(j)}: {meaning}.",
             "", "| epoch | level | V (mean over batches, seeds) | min V | L_q | L_OLS | max identity residual |",
             "|---|---|---|---|---|---|---|"]
    for epoch in range(len(per_seed[0])):
        for level in range(len(per_seed[0][epoch]["levels"])):
            rows = [s[epoch]["levels"][level] for s in per_seed]
            mean = sum(r["v_mean"] for r in rows) / len(rows)
            lines.append(f"| {epoch + 1} | {level + 1} | {mean:.4g} | {min(r['v_min'] for r in rows):.4g} | "
                         f"{sum(r['l_q_mean'] for r in rows) / len(rows):.4g} | "
                         f"{sum(r['l_ols_mean'] for r in rows) / len(rows):.4g} | "
                         f"{max(r['identity_residual_max'] for r in rows):.1e} |")
    return [*lines, ""]


def claims(results: dict[str, Any]) -> list[str]:
    """One line per paper claim per encoder: reproduces / does not, with the numbers."""
    lines = ["## The paper's claims, here", ""]
    for name, e in results["encoders"].items():
        cl, sup, classes, mult = e["clustering"], e["supervised"], e["classes"], e["config"]["cluster_mult"]
        wins, losses, ties = [], [], []
        for k in (classes, mult * classes):
            for space in ("pooled", "tokens"):
                j = _judge(cl[f"ddcl_{space}_k{k}"]["acc"]["values"], cl[f"kmeans_{space}_k{k}"]["acc"]["values"])
                bucket = wins if j["verdict"] == "higher" else losses if j["verdict"] == "lower" else ties
                bucket.append(f"{space} K={k} ({j['margin']:+.3f})")
        lines.append(f"- **{name}: DDCL clustering beats k-means (ACC)** — higher in {len(wins)} of 4 settings"
                     f"{': ' + ', '.join(wins) if wins else ''}; lower in {len(losses)}"
                     f"{': ' + ', '.join(losses) if losses else ''}; within the seed spread in {len(ties)}"
                     f"{': ' + ', '.join(ties) if ties else ''}.")
        if "logreg" in e:
            best = max((h for h in sup if h.startswith("ddcl")), key=lambda h: sup[h]["test_acc"]["mean"])
            acc, bound = sup[best]["test_acc"]["mean"], e["logreg"]["test_acc"]
            pool = "cls" if "cls" in sup else "mean"
            probe = sup[pool]["test_acc"]["mean"]
            tail = (f"the {pool} probe ({probe:.4f}) is itself above the bound, and the DDCL head below both"
                    if bound <= probe else
                    f"{pool} probe {probe:.4f}, i.e. DDCL closes {_closed(probe, acc, bound)} of the {pool}-to-bound "
                    "gap")
            lines.append(f"- **{name}: the DDCL readout approaches the logistic-regression bound** — best DDCL head "
                         f"({HEADS[best]}) {acc:.4f} vs bound {bound:.4f} (gap {bound - acc:+.4f}); {tail}.")
        lines.append(f"- **{name}: V^(l) >= 0 at every level** — min V {e['hierarchy']['v_min']:.4g}, identity "
                     f"residual at most {e['hierarchy']['identity_residual_max']:.1e}: holds (as it must: V is a sum "
                     f"of squares and L_q = L_OLS + V is algebra).")
    return [*lines, ""]


def _closed(pool: float, ddcl: float, bound: float) -> str:
    if bound <= pool:
        return f"none (the bound {bound:.4f} is not above the probe {pool:.4f})"
    if ddcl > bound:
        return "all (it is above the 'bound': logistic regression on every token feature overfits here)"
    return f"{100 * (ddcl - pool) / (bound - pool):.0f}%"


def headline(results: dict[str, Any]) -> list[str]:
    """One compact table over the encoders: clustering ACC at K = C on tokens and pooled features, the supervised
    heads and the bound (also the table in docs/studies.md, "Paradigm 1")."""
    lines = ["| encoder | k-means ACC tokens / pooled | DDCL ACC tokens / pooled | mean probe | CLS probe | DDCL "
             "pooled | DDCL slots | 2-level DDCL | LR bound |", "|---|---|---|---|---|---|---|---|---|"]
    for name, e in results["encoders"].items():
        cl, sup, k = e["clustering"], e["supervised"], e["classes"]
        acc = {m: f"{_ms(cl[f'{m}_tokens_k{k}']['acc'], 3)} / {_ms(cl[f'{m}_pooled_k{k}']['acc'], 3)}"
               for m in ("kmeans", "ddcl")}
        head = {h: _ms(sup[h]["test_acc"], 3) if h in sup else "—" for h in HEADS}
        bound = f"{e['logreg']['test_acc']:.3f}" if "logreg" in e else "—"
        lines.append(f"| {name} | {acc['kmeans']} | {acc['ddcl']} | {head['mean']} | {head['cls']} | "
                     f"{head['ddcl_pooled']} | {head['ddcl_slots']} | {head['ddcl_2level']} | {bound} |")
    return [*lines, ""]


def _measured_as(results: dict[str, Any]) -> list[str]:
    if "measured_as" not in results:
        return []
    runs = ", ".join(f"`{c}`" for c in results["measured_as"])
    return [f"Measured as one process per encoder ({runs}), in parallel, reports merged: each encoder's study seeds "
            f"itself, so the numbers are those of the single command; the total time is the sum of the two.", ""]


def render(results: dict[str, Any]) -> str:
    lines = ["# Paradigm 1: DDCL readout on frozen encoders vs k-means vs a logistic-regression bound", "",
             "Regenerate:", "", f"    {results['command']}", "", f"Code: {results.get('code') or code_commit()}", "",
             f"Total {results['seconds'] / 60:.1f} min on {results['threads']} CPU threads (encoders and tokens "
             f"come from the cache on a second run).", "", *_measured_as(results),
             "Test accuracy (clustering ACC at K = number of classes, Hungarian), mean ± sample std over seeds:", "",
             *headline(results), *claims(results)]
    for name, e in results["encoders"].items():
        lines += [*encoder_intro(name, e), *clustering_table(e), *supervised_table(e), *hierarchy_table(e)]
    return "\n".join(lines)


def write_report(results: dict[str, Any], out: Path) -> None:
    out.mkdir(parents=True, exist_ok=True)
    text = render(results)
    write_atomic(out / "results.json", json.dumps(portable(results), indent=1, default=str))
    write_atomic(out / "report.md", text)
    print(text)
