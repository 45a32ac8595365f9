"""Synthetic orbital-debris catalogue: tabular orbits in four regimes (LEO, MEO, GEO, HEO), LEO the densest.

The paper's scientific-data study (arXiv 2604.03850) clusters synthetic orbital debris by regime. This module
draws such a catalogue from two-body orbital mechanics, so that every row is a physically consistent Keplerian
orbit and every label follows from the orbit alone (:func:`classify_regime`).

Physics (two-body, Earth point mass; J2 only where it fixes an inclination):

- ``a = R + (h_p + h_a) / 2`` and ``e = (h_a - h_p) / (2 a)`` from perigee/apogee altitudes ``h_p, h_a``, with
  the WGS-84 equatorial radius ``R = 6378.137 km``.
- Period ``P = 2 pi sqrt(a^3 / mu)`` with ``mu = 398600.4418 km^3/s^2`` (Kepler's third law); a geostationary
  orbit has ``P`` = one sidereal day, 86164.1 s, hence ``a_GEO = 42164 km``.
- Sun-synchronous LEO orbits take the inclination at which J2 precesses the node by 360 deg per year:
  ``cos i = -(a / 12352 km)^(7/2)`` for a circular orbit (Vallado, *Fundamentals of Astrodynamics*, §9.6).
- Molniya and Tundra orbits sit at the critical inclination ``cos^2 i = 1/5`` (63.43 deg), where J2 does not
  rotate the line of apsides.

Regime definitions follow the orbit classes of ESA's annual *Space Environment Report*, merged into four:

=====  =========================================================================================
LEO    perigee and apogee altitude below 2000 km
MEO    perigee and apogee altitude in [2000, 35586) km, eccentricity below 0.25 (near-circular)
GEO    perigee and apogee altitude in [35586, 35986] km (35786 +- 200 km), inclination below 15 deg
HEO    eccentricity of at least 0.25 (GTO, Molniya and Tundra orbits)
=====  =========================================================================================

The 15 deg bound is the range over which an uncontrolled geostationary object's inclination oscillates (a
53-year cycle driven by the Sun and Moon). Inside each regime the orbits come from named families (debris
shells from known breakups and constellations, navigation constellations, transfer orbits); their centres
are public orbital parameters, their spreads are illustrative.

Object sizes follow a power law ``N(> d) ~ d^-1.6`` (the exponent of the NASA Standard Breakup Model for
explosion fragments), cut at a detection threshold that grows with distance: ground radars track ~10 cm
objects in LEO, optical surveys ~1 m objects at GEO altitude.

Class proportions: LEO holds the large majority of catalogued objects, which ESA's report shows year after
year; GEO and the transfer/highly eccentric orbits are the next groups and the navigation belt in MEO the
smallest. The default shares below keep that order; they are illustrative, not fitted to a catalogue.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import NamedTuple

import torch
from torch import Tensor

from softvq._checks import check_float, check_positive_int

EARTH_RADIUS_KM = 6378.137  # WGS-84 equatorial radius
MU_EARTH_KM3_S2 = 398600.4418  # Earth's gravitational parameter GM
SIDEREAL_DAY_S = 86164.1  # one rotation of the Earth relative to the stars
SSO_REFERENCE_KM = 12352.0  # a at which a circular sun-synchronous orbit would be polar-retrograde (cos i = -1)
CRITICAL_INCLINATION_DEG = math.degrees(math.acos(math.sqrt(0.2)))  # 63.43 deg, J2 apsidal rotation vanishes

LEO_MAX_ALT_KM = 2000.0
GEO_ALT_KM = 35786.0  # altitude of the geostationary orbit (a_GEO - R)
GEO_BAND_KM = 200.0  # half-width of ESA's GEO altitude band
GEO_MAX_INC_DEG = 15.0
HEO_MIN_ECC = 0.25

REGIMES = ("LEO", "MEO", "GEO", "HEO")
FEATURES = (
    "perigee_alt_km",
    "apogee_alt_km",
    "semi_major_axis_km",
    "eccentricity",
    "inclination_deg",
    "period_min",
    "log10_size_m",
)


def orbital_period(semi_major_axis_km: Tensor) -> Tensor:
    """Kepler's third law: the period in seconds of an orbit with semi-major axis ``a`` (km), any shape."""
    return 2.0 * math.pi * torch.sqrt(semi_major_axis_km**3 / MU_EARTH_KM3_S2)


def semi_major_axis_from_period(period_s: float) -> float:
    """Inverse of :func:`orbital_period`: ``a = (mu (P / 2 pi)^2)^(1/3)`` in km (42164.2 km for a sidereal day)."""
    return (MU_EARTH_KM3_S2 * (period_s / (2.0 * math.pi)) ** 2) ** (1.0 / 3.0)


def classify_regime(perigee_alt_km: Tensor, apogee_alt_km: Tensor, inclination_deg: Tensor) -> Tensor:
    """The regime of each orbit under the definitions in the module docstring.

    Args:
        perigee_alt_km: ``(N,)`` perigee altitudes.
        apogee_alt_km: ``(N,)`` apogee altitudes (``>= perigee``).
        inclination_deg: ``(N,)`` inclinations.

    Returns:
        ``(N,)`` int64 index into :data:`REGIMES`, or ``-1`` for an orbit none of the four classes covers
        (e.g. an eccentric MEO orbit with ``e`` between 0.1 and 0.25 whose apogee reaches GEO altitude).
    """
    a = EARTH_RADIUS_KM + (perigee_alt_km + apogee_alt_km) / 2
    e = (apogee_alt_km - perigee_alt_km) / (2 * a)
    leo = apogee_alt_km < LEO_MAX_ALT_KM
    meo = (perigee_alt_km >= LEO_MAX_ALT_KM) & (apogee_alt_km < GEO_ALT_KM - GEO_BAND_KM) & (e < HEO_MIN_ECC)
    geo = ((perigee_alt_km >= GEO_ALT_KM - GEO_BAND_KM) & (apogee_alt_km <= GEO_ALT_KM + GEO_BAND_KM)
           & (inclination_deg < GEO_MAX_INC_DEG))
    heo = e >= HEO_MIN_ECC
    out = torch.full(perigee_alt_km.shape, -1, dtype=torch.long)
    for label, mask in enumerate((leo, meo, geo, heo)):
        out[mask & (out < 0)] = label
    return out


@dataclass(frozen=True)
class DebrisConfig:
    """Settings of :func:`make_orbital_debris`.

    Args:
        proportions: the share of (LEO, MEO, GEO, HEO) objects; non-negative, summing to 1.
        size_exponent: ``alpha`` of the size power law ``N(> d) ~ d^-alpha``.
        detection_threshold_m: the smallest catalogued object per regime (LEO, MEO, GEO, HEO), in metres.
        max_size_m: the largest object (an intact upper stage), in metres.
    """

    proportions: tuple[float, float, float, float] = (0.70, 0.06, 0.12, 0.12)  # LEO dominant (see module doc)
    size_exponent: float = 1.6  # NASA Standard Breakup Model, explosion fragments
    detection_threshold_m: tuple[float, float, float, float] = (0.1, 0.5, 1.0, 0.3)  # radar in LEO, optics at GEO
    max_size_m: float = 20.0  # about a large upper stage

    def __post_init__(self) -> None:
        props = tuple(self.proportions)
        if len(props) != len(REGIMES):
            raise ValueError(f"proportions must have {len(REGIMES)} entries {REGIMES}, got {props!r}")
        for name, p in zip(REGIMES, props, strict=True):
            check_float(f"proportions[{name}]", p, allow_zero=True)
        if not math.isclose(sum(props), 1.0, abs_tol=1e-6):
            raise ValueError(f"proportions must sum to 1, got {props!r} (sum {sum(props):.6g})")
        check_float("size_exponent", self.size_exponent)
        thresholds = tuple(self.detection_threshold_m)
        if len(thresholds) != len(REGIMES):
            raise ValueError(f"detection_threshold_m must have {len(REGIMES)} entries, got {thresholds!r}")
        for name, t in zip(REGIMES, thresholds, strict=True):
            check_float(f"detection_threshold_m[{name}]", t)
        check_float("max_size_m", self.max_size_m)
        if max(thresholds) >= self.max_size_m:
            raise ValueError(f"max_size_m must exceed every detection threshold {thresholds!r}, "
                             f"got {self.max_size_m!r}")


class OrbitalDebris(NamedTuple):
    """A synthetic debris catalogue.

    Attributes:
        features: ``(N, F)`` float64, columns named by ``feature_names`` (physical units, not standardised).
        labels: ``(N,)`` int64 regime index into ``regime_names``.
        feature_names: the ``F`` column names, :data:`FEATURES`.
        regime_names: :data:`REGIMES`.
    """

    features: Tensor
    labels: Tensor
    feature_names: tuple[str, ...]
    regime_names: tuple[str, ...]


# Families inside each regime: (weight, perigee altitude km (mean, sd), inclination deg (mean, sd)).
# An inclination mean of None marks a sun-synchronous family (inclination from J2, see module doc).
_LEO_FAMILIES = (
    (0.20, (550.0, 40.0), (53.0, 0.5)),  # Starlink-like shell
    (0.05, (420.0, 40.0), (51.6, 0.5)),  # ISS altitude and inclination
    (0.30, (750.0, 110.0), (None, 0.2)),  # sun-synchronous band, incl. the Fengyun-1C cloud (~850 km)
    (0.15, (780.0, 40.0), (86.4, 0.3)),  # Iridium 33 / Cosmos 2251 collision, Iridium side
    (0.10, (800.0, 60.0), (74.0, 0.3)),  # ... Cosmos side
    (0.10, (950.0, 80.0), (82.9, 0.4)),  # Soviet-era Cosmos / Tsiklon upper stages
    (0.05, (1414.0, 30.0), (52.0, 0.3)),  # Globalstar shell
    (0.05, (600.0, 250.0), (28.5, 1.0)),  # low-inclination launches from Cape Canaveral
)
# Navigation constellations: (weight, altitude km (mean, sd), inclination deg (mean, sd)).
_MEO_FAMILIES = (
    (0.35, (20180.0, 150.0), (55.0, 1.0)),  # GPS, a = 26560 km (half a sidereal day)
    (0.25, (19130.0, 150.0), (64.8, 0.5)),  # GLONASS
    (0.15, (23222.0, 150.0), (56.0, 0.5)),  # Galileo
    (0.15, (21528.0, 150.0), (55.0, 0.5)),  # BeiDou MEO
    (0.10, (8062.0, 100.0), (0.05, 0.05)),  # O3b equatorial ring
)
_MOLNIYA_A_KM = semi_major_axis_from_period(SIDEREAL_DAY_S / 2)  # 26562 km
_TUNDRA_A_KM = semi_major_axis_from_period(SIDEREAL_DAY_S)  # 42164 km, like GEO but eccentric and inclined


def _normal(n: int, mean: float, std: float, g: torch.Generator) -> Tensor:
    return mean + std * torch.randn(n, generator=g, dtype=torch.float64)


def _uniform(n: int, low: float, high: float, g: torch.Generator) -> Tensor:
    return low + (high - low) * torch.rand(n, generator=g, dtype=torch.float64)


def _choice(n: int, weights: list[float], g: torch.Generator) -> Tensor:
    return torch.multinomial(torch.tensor(weights, dtype=torch.float64), n, replacement=True, generator=g)


def _family_draw(n: int, families: tuple, g: torch.Generator) -> tuple[Tensor, Tensor, Tensor]:
    """Family index, altitude and inclination of ``n`` objects drawn from ``families``."""
    fam = _choice(n, [f[0] for f in families], g)
    alt = torch.empty(n, dtype=torch.float64)
    inc = torch.empty(n, dtype=torch.float64)
    for k, (_, (alt_mean, alt_sd), (inc_mean, inc_sd)) in enumerate(families):
        idx = (fam == k).nonzero().squeeze(1)
        alt[idx] = _normal(len(idx), alt_mean, alt_sd, g)
        inc[idx] = _normal(len(idx), 0.0 if inc_mean is None else inc_mean, inc_sd, g)
        if inc_mean is None:  # sun-synchronous: cos i = -(a / 12352 km)^(7/2) at this altitude
            a = EARTH_RADIUS_KM + alt[idx]
            inc[idx] += torch.rad2deg(torch.acos(-((a / SSO_REFERENCE_KM) ** 3.5)))
    return fam, alt, inc.abs()


def _leo(n: int, g: torch.Generator) -> tuple[Tensor, Tensor, Tensor]:
    """Near-circular low orbits: fragments carry small delta-v, so ``e`` is exponential with mean 0.004."""
    _, h_p, inc = _family_draw(n, _LEO_FAMILIES, g)
    h_p = h_p.clamp(160.0, LEO_MAX_ALT_KM - 100.0)  # below ~160 km an object re-enters within days
    e = torch.empty(n, dtype=torch.float64).exponential_(1.0 / 0.004, generator=g)
    # Largest e that keeps the apogee in LEO: h_a = a (1 + e) - R with a = (R + h_p) / (1 - e).
    r_p, r_max = EARTH_RADIUS_KM + h_p, EARTH_RADIUS_KM + LEO_MAX_ALT_KM
    e = torch.minimum(e, 0.999 * (r_max - r_p) / (r_max + r_p))
    a = r_p / (1 - e)
    return h_p, a * (1 + e) - EARTH_RADIUS_KM, inc


def _meo(n: int, g: torch.Generator) -> tuple[Tensor, Tensor, Tensor]:
    """Navigation belts and the O3b ring: circular to ``e`` ~ 0.005, disposal orbits spread the altitude."""
    _, alt, inc = _family_draw(n, _MEO_FAMILIES, g)
    a = EARTH_RADIUS_KM + alt
    e = torch.empty(n, dtype=torch.float64).exponential_(1.0 / 0.005, generator=g).clamp(max=0.05)
    return a * (1 - e) - EARTH_RADIUS_KM, a * (1 + e) - EARTH_RADIUS_KM, inc


def _geo(n: int, g: torch.Generator) -> tuple[Tensor, Tensor, Tensor]:
    """Geostationary belt: ``a`` within ~100 km of 42164 km, both apsides inside the +-200 km band.

    Station-kept objects stay below 0.1 deg; uncontrolled ones (60%) spread over 0-15 deg.
    """
    a = EARTH_RADIUS_KM + GEO_ALT_KM + _normal(n, 0.0, 50.0, g).clamp(-150.0, 150.0)
    # |h - 35786| <= 200 at both apsides: a e <= 200 - |a - a_GEO|.
    e_max = (GEO_BAND_KM - (a - EARTH_RADIUS_KM - GEO_ALT_KM).abs()) / a
    e = torch.empty(n, dtype=torch.float64).exponential_(1.0 / 0.0005, generator=g)
    e = torch.minimum(e, 0.999 * e_max)
    controlled = torch.rand(n, generator=g) < 0.4
    inc = torch.where(controlled, _uniform(n, 0.0, 0.1, g), _uniform(n, 0.0, GEO_MAX_INC_DEG - 0.01, g))
    return a * (1 - e) - EARTH_RADIUS_KM, a * (1 + e) - EARTH_RADIUS_KM, inc


def _heo(n: int, g: torch.Generator) -> tuple[Tensor, Tensor, Tensor]:
    """Transfer and highly eccentric orbits: GTO (60%), Molniya (30%), Tundra (10%), all with ``e >= 0.25``.

    GTO: perigee 200-700 km, apogee 35786 +- 300 km, the launch site's latitude as inclination (Kourou 6 deg,
    Cape Canaveral 27-28.5, Xichang 27-28, Baikonur 47-51). Molniya: half a sidereal day, ``e`` ~ 0.72.
    Tundra: one sidereal day, ``e`` ~ 0.27. Both at the critical inclination.
    """
    kind = _choice(n, [0.6, 0.3, 0.1], g)
    h_p = torch.empty(n, dtype=torch.float64)
    h_a = torch.empty(n, dtype=torch.float64)
    inc = torch.empty(n, dtype=torch.float64)
    gto = (kind == 0).nonzero().squeeze(1)
    h_p[gto] = _uniform(len(gto), 200.0, 700.0, g)
    h_a[gto] = _normal(len(gto), GEO_ALT_KM, 300.0, g)
    site = torch.tensor([6.0, 28.0, 27.0, 49.0], dtype=torch.float64)[_choice(len(gto), [0.35, 0.3, 0.25, 0.1], g)]
    inc[gto] = site + _normal(len(gto), 0.0, 1.0, g).abs()
    for k, a0, e_mean, e_sd in ((1, _MOLNIYA_A_KM, 0.72, 0.01), (2, _TUNDRA_A_KM, 0.27, 0.01)):
        idx = (kind == k).nonzero().squeeze(1)
        a = a0 + _normal(len(idx), 0.0, 50.0, g)
        # e >= 0.255 keeps the orbit in HEO, a perigee above 200 km keeps it out of the atmosphere.
        e = torch.minimum(_normal(len(idx), e_mean, e_sd, g).clamp(min=HEO_MIN_ECC + 0.005),
                          1 - (EARTH_RADIUS_KM + 200.0) / a)
        h_p[idx] = a * (1 - e) - EARTH_RADIUS_KM
        h_a[idx] = a * (1 + e) - EARTH_RADIUS_KM
        inc[idx] = _normal(len(idx), CRITICAL_INCLINATION_DEG, 0.5, g)
    return h_p, h_a, inc


def make_orbital_debris(n: int, config: DebrisConfig | None = None, seed: int = 0) -> OrbitalDebris:
    """Draw a synthetic catalogue of ``n`` debris objects.

    The regime counts are the rounded shares of ``config.proportions`` (largest remainders), so they are
    exact and the same for every seed; the rows are shuffled.

    Args:
        n: number of objects (``>= 1``).
        config: regime shares and the size model; :class:`DebrisConfig` defaults if None.
        seed: seed of the ``torch.Generator`` that draws everything (same seed, same catalogue).

    Returns:
        :class:`OrbitalDebris` with ``features (n, 7)`` float64 in the units of :data:`FEATURES`, ``labels (n,)``.

    Raises:
        ValueError: on ``n < 1`` or a non-integer ``seed``.
    """
    n = check_positive_int("n", n)
    if isinstance(seed, bool) or not isinstance(seed, int):
        raise ValueError(f"seed must be an integer, got {seed!r}")
    config = DebrisConfig() if config is None else config
    g = torch.Generator().manual_seed(seed)

    # Largest-remainder rounding of the shares: counts sum to n exactly.
    shares = [p * n for p in config.proportions]
    counts = [math.floor(s) for s in shares]
    for k in sorted(range(len(shares)), key=lambda k: counts[k] - shares[k])[: n - sum(counts)]:
        counts[k] += 1

    parts, labels = [], []
    for label, (count, draw) in enumerate(zip(counts, (_leo, _meo, _geo, _heo), strict=True)):
        if count == 0:
            continue
        h_p, h_a, inc = draw(count, g)
        # Size: Pareto with exponent alpha above the regime's detection threshold, capped at max_size_m.
        d_min = config.detection_threshold_m[label]
        size = d_min * torch.rand(count, generator=g, dtype=torch.float64).pow(-1.0 / config.size_exponent)
        parts.append(torch.stack([h_p, h_a, inc, size.clamp(max=config.max_size_m).log10()], dim=1))
        labels.append(torch.full((count,), label, dtype=torch.long))
    raw = torch.cat(parts)
    order = torch.randperm(n, generator=g)
    raw, label_t = raw[order], torch.cat(labels)[order]

    h_p, h_a, inc, log_size = raw.unbind(1)
    a = EARTH_RADIUS_KM + (h_p + h_a) / 2
    e = (h_a - h_p) / (2 * a)
    period_min = orbital_period(a) / 60.0
    features = torch.stack([h_p, h_a, a, e, inc, period_min, log_size], dim=1)
    return OrbitalDebris(features=features, labels=label_t, feature_names=FEATURES, regime_names=REGIMES)
