"""Orbital-debris study: Hungarian ACC on hand-made labelings, the generator's orbital mechanics against
independent formulas, the DDCL identity on the catalogue, and the eval command end to end."""

from __future__ import annotations

import importlib
import itertools
import json
import math

import numpy as np
import pytest
import torch

from eval.clustering import cluster_owners, clustering_accuracy, contingency_matrix
from eval.debris.data import FEATURES, REGIMES, DebrisConfig, classify_regime, make_orbital_debris
from softvq import DDCLQuantizer

R_EARTH, MU = 6378.137, 398600.4418  # km, km^3/s^2, written out again here on purpose
SIDEREAL_DAY = 86164.1  # s
J2 = 1.08262668e-3  # Earth's oblateness coefficient (not used by the generator)
COL = {name: i for i, name in enumerate(FEATURES)}


def eval_debris():
    """The study, eval/debris/, imported when a test needs it (an ordinary import: its dataclasses resolve)."""
    return importlib.import_module("eval.debris")


@pytest.fixture(scope="module")
def catalogue():
    return make_orbital_debris(20000, seed=3)


def column(data, name, regime=None):
    x = data.features[:, COL[name]]
    return x if regime is None else x[data.labels == REGIMES.index(regime)]


# ---- Hungarian ACC ---------------------------------------------------------------------------------------
def brute_force_acc(y, p):
    """Best one-to-one relabeling by trying every injective map from clusters to classes."""
    clusters, classes = sorted(set(p)), sorted(set(y))
    best = 0
    for image in itertools.permutations(classes + [None] * len(clusters), len(clusters)):
        mapping = dict(zip(clusters, image, strict=True))
        best = max(best, sum(mapping[a] == b for a, b in zip(p, y, strict=True)))
    return best / len(y)


def test_acc_is_one_for_a_permutation_of_the_labels():
    y = torch.tensor([0, 0, 1, 1, 1, 2, 3, 3])
    perm = torch.tensor([2, 3, 0, 1])
    assert clustering_accuracy(y, perm[y]) == 1.0
    assert clustering_accuracy(y.numpy(), perm[y].numpy()) == 1.0
    assert clustering_accuracy(y.tolist(), (perm[y] + 5).tolist()) == 1.0  # unused cluster ids do not matter


def test_acc_hand_computed_partial_case():
    # clusters -> classes: cluster 1 holds {0, 0}; cluster 0 holds {0, 1, 1}; cluster 2 holds {1, 2, 2}.
    # Best map 1->0, 0->1, 2->2 puts 2 + 2 + 2 = 6 of 8 points on the diagonal.
    y = [0, 0, 0, 1, 1, 1, 2, 2]
    p = [1, 1, 0, 0, 0, 2, 2, 2]
    assert clustering_accuracy(y, p) == pytest.approx(6 / 8)
    assert contingency_matrix(y, p).tolist() == [[1, 2, 0], [2, 0, 0], [0, 1, 2]]
    assert cluster_owners(y, p).tolist() == [1, 0, 2]
    # More clusters than classes: only two singletons can be matched.
    assert clustering_accuracy([0, 0, 1, 1], [0, 1, 2, 3]) == pytest.approx(0.5)
    # All points in one cluster: the largest class.
    assert clustering_accuracy([0, 0, 0, 1], [0, 0, 0, 0]) == pytest.approx(0.75)


def test_acc_matches_brute_force_on_random_labelings():
    rng = np.random.default_rng(0)
    for _ in range(25):
        n, classes, clusters = rng.integers(1, 12), rng.integers(1, 4), rng.integers(1, 5)
        y, p = rng.integers(0, classes, n).tolist(), rng.integers(0, clusters, n).tolist()
        assert clustering_accuracy(y, p) == pytest.approx(brute_force_acc(y, p))


def test_cluster_owners_marks_empty_clusters():
    assert cluster_owners([0, 1, 1], [0, 2, 2], num_clusters=4).tolist() == [0, -1, 1, -1]
    with pytest.raises(ValueError, match="num_clusters"):
        cluster_owners([0, 1], [0, 3], num_clusters=2)


@pytest.mark.parametrize(
    ("y", "p", "match"),
    [([0, 1], [0], "same length"), ([], [], "empty"), ([0, -1], [0, 1], "non-negative"),
     ([0.0, 1.0], [0, 1], "integers"), ([[0, 1]], [[0, 1]], "1-D")],
)
def test_acc_rejects_bad_labels(y, p, match):
    with pytest.raises(ValueError, match=match):
        clustering_accuracy(y, p)


# ---- generator physics -----------------------------------------------------------------------------------
def test_geometry_is_keplerian(catalogue):
    h_p, h_a, a, e = (column(catalogue, n) for n in ("perigee_alt_km", "apogee_alt_km", "semi_major_axis_km",
                                                       "eccentricity"))
    torch.testing.assert_close(R_EARTH + h_p, a * (1 - e), rtol=1e-12, atol=1e-8)  # perigee radius
    torch.testing.assert_close(R_EARTH + h_a, a * (1 + e), rtol=1e-12, atol=1e-8)  # apogee radius
    period_s = 2 * math.pi * torch.sqrt(a**3 / MU)
    torch.testing.assert_close(column(catalogue, "period_min"), period_s / 60, rtol=1e-12, atol=0)
    assert bool((h_p > 150).all()) and bool((h_a >= h_p).all()) and bool((e >= 0).all())
    assert bool(torch.isfinite(catalogue.features).all())
    assert catalogue.feature_names == FEATURES and catalogue.regime_names == REGIMES


def test_geo_period_is_one_sidereal_day(catalogue):
    period_s = column(catalogue, "period_min", "GEO") * 60
    assert bool(((period_s / SIDEREAL_DAY - 1).abs() < 0.01).all())
    assert abs(period_s.median().item() / SIDEREAL_DAY - 1) < 1e-3
    assert bool((column(catalogue, "eccentricity", "GEO") < 0.01).all())
    assert bool((column(catalogue, "inclination_deg", "GEO") < 15).all())


def test_leo_meo_heo_satisfy_their_definitions(catalogue):
    assert bool((column(catalogue, "apogee_alt_km", "LEO") < 2000).all())
    assert bool((column(catalogue, "perigee_alt_km", "MEO") >= 2000).all())
    assert bool((column(catalogue, "apogee_alt_km", "MEO") < 35586).all())
    assert bool((column(catalogue, "eccentricity", "MEO") < 0.25).all())
    assert bool((column(catalogue, "eccentricity", "HEO") >= 0.25).all())
    # Navigation belt: GPS objects have a period of half a sidereal day.
    half_day = (column(catalogue, "period_min", "MEO") * 60 / (SIDEREAL_DAY / 2) - 1).abs() < 0.01
    assert half_day.float().mean() > 0.2
    # The labels are what the regime definitions say about each orbit.
    f = catalogue.features
    labels = classify_regime(f[:, COL["perigee_alt_km"]], f[:, COL["apogee_alt_km"]], f[:, COL["inclination_deg"]])
    assert torch.equal(labels, catalogue.labels)


def test_sun_synchronous_leo_precesses_once_a_year(catalogue):
    """LEO objects above 95 deg are the sun-synchronous family: J2 turns their node 360 deg per tropical year."""
    inc = column(catalogue, "inclination_deg", "LEO")
    sso = inc > 95
    assert sso.sum() > 1000
    a = column(catalogue, "semi_major_axis_km", "LEO")[sso]
    e = column(catalogue, "eccentricity", "LEO")[sso]
    n = torch.sqrt(MU / a**3)  # rad/s
    node_rate = -1.5 * n * J2 * (R_EARTH / (a * (1 - e**2))) ** 2 * torch.cos(torch.deg2rad(inc[sso]))
    ratio = node_rate * 86400 * 365.2422 / (2 * math.pi)
    assert abs(ratio.median().item() - 1) < 0.02
    assert bool(((ratio - 1).abs() < 0.2).all())


def test_proportions_leo_dominant_and_exact():
    data = make_orbital_debris(1003, seed=0)
    counts = torch.bincount(data.labels, minlength=4).tolist()
    assert sum(counts) == 1003
    assert counts == [702, 60, 120, 121] or counts == [702, 60, 121, 120]  # largest remainders of 0.7/.06/.12/.12
    assert counts[0] == max(counts) and counts[0] / 1003 > 0.5
    custom = make_orbital_debris(100, DebrisConfig(proportions=(0.5, 0.0, 0.25, 0.25)), seed=1)
    assert torch.bincount(custom.labels, minlength=4).tolist() == [50, 0, 25, 25]
    assert make_orbital_debris(1).labels.tolist() == [0]


def test_seeded_reproducibility():
    a, b, c = make_orbital_debris(500, seed=7), make_orbital_debris(500, seed=7), make_orbital_debris(500, seed=8)
    assert torch.equal(a.features, b.features) and torch.equal(a.labels, b.labels)
    assert not torch.equal(a.features, c.features)


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [({"n": 0}, "n must be a positive integer"), ({"n": 2.5}, "n must"), ({"n": 10, "seed": "x"}, "seed")],
)
def test_generator_rejects_bad_arguments(kwargs, match):
    with pytest.raises(ValueError, match=match):
        make_orbital_debris(**kwargs)


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [({"proportions": (0.5, 0.2, 0.2, 0.2)}, "sum to 1"),
     ({"proportions": (1.2, -0.2, 0.0, 0.0)}, r"proportions\[MEO\]"),
     ({"proportions": (0.5, 0.5)}, "4 entries"), ({"size_exponent": 0.0}, "size_exponent"),
     ({"detection_threshold_m": (0.1, 0.5, 30.0, 0.3)}, "max_size_m"),
     ({"detection_threshold_m": (0.1, 0.5, -1.0, 0.3)}, r"detection_threshold_m\[GEO\]")],
)
def test_config_rejects_bad_values(kwargs, match):
    with pytest.raises(ValueError, match=match):
        DebrisConfig(**kwargs)


# ---- DDCL on the catalogue -------------------------------------------------------------------------------
def test_ddcl_identity_on_standardised_catalogue_float64():
    data = make_orbital_debris(3000, seed=0)
    x = (data.features - data.features.mean(0)) / data.features.std(0)
    torch.manual_seed(0)
    quantizer = DDCLQuantizer(4, x.shape[1], temperature=1.0, recipe="plain").double()
    quantizer.init_from_data(x)
    out = quantizer(x)
    # Independent reference: the definitions with the explicit (N, K, D) difference tensor.
    p = quantizer.prototypes.detach()
    d = (x[:, None, :] - p[None]).square().sum(-1)
    q = torch.softmax(-d / 1.0, dim=1)
    mu = q @ p
    l_q = (q * d).sum(1).mean()
    l_ols = (x - mu).square().sum(1).mean()
    v = (q * (p[None] - mu[:, None]).square().sum(-1)).sum(1).mean()
    assert abs(l_q - l_ols - v) / l_q < 1e-10
    for name, ref in (("l_q", l_q), ("l_ols", l_ols), ("v", v)):
        torch.testing.assert_close(out.terms[name], ref, rtol=1e-10, atol=0)
    assert out.terms["identity_residual"].item() < 1e-10


def test_ddcl_training_keeps_the_identity_and_uses_every_prototype():
    debris = eval_debris()
    data = make_orbital_debris(1000, seed=1)
    x = (data.features - data.features.mean(0)) / data.features.std(0)
    fit = debris.fit_ddcl_direct(x, 4, seed=0, cfg=debris.DirectConfig(steps=50))
    assert fit.max_identity_residual < 1e-10
    assert len(np.unique(fit.labels)) == 4
    # Clusters are nearest prototypes (argmax q = argmin d), checked against an exact distance computation.
    dist = ((x.numpy()[:, None, :] - fit.centres[None]) ** 2).sum(-1)
    assert np.array_equal(fit.labels, dist.argmin(1))


# ---- the eval command ------------------------------------------------------------------------------------
def test_eval_quick_writes_report_and_figure(tmp_path):
    from sklearn.cluster import KMeans

    out = tmp_path / "debris"
    summary = eval_debris().main(["--quick", "--out", str(out)])
    report = (out / "report.md").read_text()
    assert "K = 4" in report and "python -m eval.debris --quick" in report and "## Verdict" in report
    png = (out / "prototypes.png").read_bytes()
    assert png[:8] == b"\x89PNG\r\n\x1a\n" and 10_000 < len(png) < 300_000
    results = json.loads((out / "results.json").read_text())["results"]["4"]
    assert set(results) == {"k-means", "DDCL (direct)", "DDCL (encoder)"} and summary["args"]["seeds"] == 2
    for rows in results.values():
        for r in rows:
            assert 0 <= r["acc"] <= 1 and -1 <= r["ari"] <= 1 and 0 <= r["nmi"] <= 1
            assert sum(r["per_regime"]) <= 4
    # The reported k-means ACC of seed 0 is what an independent recomputation gives.
    data = make_orbital_debris(1000, seed=0)
    x = ((data.features - data.features.mean(0)) / data.features.std(0)).numpy()
    labels = KMeans(4, random_state=0).fit(x).labels_
    assert results["k-means"][0]["acc"] == pytest.approx(brute_force_acc(data.labels.tolist(), labels.tolist()))


def test_eval_rejects_bad_flags():
    main = eval_debris().main
    with pytest.raises(SystemExit):
        main(["--seeds", "0"])
    with pytest.raises(SystemExit):
        main(["--no-such-flag"])
