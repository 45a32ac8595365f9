"""One rule says "beyond the seed spread" in every report: eval._spread, checked on hand-made seeds, and no report
module keeps a rule of its own."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

from eval import _spread
from eval._spread import beyond_spread, by_seed, describe, verdict
from eval.peers.report import margins

EVAL = Path(__file__).resolve().parent.parent / "eval"


def test_beyond_spread_is_the_one_rule():
    counts = beyond_spread([10.0, 11.0, 12.0], [5.0, 6.0, 7.0])  # margin 5 > 1 + 1, every seed higher
    assert counts["counts"] and counts["margin"] == pytest.approx(5.0) and counts["spread"] == pytest.approx(2.0)
    assert verdict(counts) == "higher" and describe(counts) == "beyond the seed spread"
    within = beyond_spread([10.0, 11.0, 12.0], [9.0, 10.5, 11.0])  # margin 0.83 < 1 + 1
    assert not within["counts"] and "within the spread" in within["reason"] and verdict(within) == "within spread"
    # margin 1.3 beyond the spread 0 + 1.21, but the third seed's pair points the other way
    flips = beyond_spread([10.0, 10.0, 10.0], [8.0, 8.0, 10.1])
    assert flips["margin"] > flips["spread"] and not flips["counts"]
    assert flips["reason"] == "the seeds' paired differences change sign"
    two = beyond_spread([10.0, 11.0], [1.0, 2.0])
    assert not two["counts"] and "fewer than 3 seeds" in two["reason"]
    assert describe(two).startswith("within the seed spread (fewer than 3 seeds")
    lower = beyond_spread([1.0, 2.0, 3.0], [10.0, 11.0, 12.0])
    assert lower["counts"] and verdict(lower) == "lower"


def test_a_deterministic_reference_is_compared_with_every_seed():
    below = beyond_spread([0.40, 0.41, 0.42], [0.5], exact_b=True)  # spread 0.01 + 0, every seed below
    assert below["counts"] and below["spread"] == pytest.approx(0.01) and below["margin"] == pytest.approx(-0.09)
    straddles = beyond_spread([0.40, 0.45, 0.60], [0.5], exact_b=True)
    assert not straddles["counts"]
    with pytest.raises(ValueError, match="one reference value"):
        beyond_spread([1.0, 2.0, 3.0], [1.0, 2.0], exact_b=True)
    with pytest.raises(ValueError, match="got 3 and 0"):
        beyond_spread([1.0, 2.0, 3.0], [])


def test_by_seed_pairs_values_by_seed_not_by_position():
    a = {0: 0.0, 1: 0.5, 2: 1.0}
    b = {1: 6.0, 0: 0.5, 2: 6.5, 3: 100.0}  # seed 3 has no partner and is left out
    judged = by_seed(a, b)
    assert judged["seeds"] == [0, 1, 2]
    # by seed every pair is negative (-0.5, -5.5, -5.5) and |margin| 3.83 just exceeds the spread 0.5 + 3.33
    assert judged["counts"] and judged["margin"] == pytest.approx(-23 / 6)
    mean_b = 13 / 3  # the sample stds by hand: a's is 0.5, b's over seeds 0-2
    std_b = (((0.5 - mean_b) ** 2 + (6.0 - mean_b) ** 2 + (6.5 - mean_b) ** 2) / 2) ** 0.5
    assert judged["spread"] == pytest.approx(0.5 + std_b)
    # paired in the order the values were given, seed 1's 6.0 would meet seed 0's 0.0 and seed 0's 0.5 seed 1's 0.5:
    # a zero difference, so that pairing would not count
    assert not beyond_spread(list(a.values()), [6.0, 0.5, 6.5])["counts"]
    with pytest.raises(ValueError, match="no seed in common"):
        by_seed({0: 1.0}, {1: 1.0})


def test_the_peers_report_uses_the_rule():
    # a case where the rules this replaced disagree: margin 0.03 with stds 0.02 and 0.001 is within paradigm 1's old
    # "twice the larger std" (0.04) but beyond the sum of the stds (0.021), with one sign on every seed
    a, b = [0.51, 0.53, 0.55], [0.499, 0.5, 0.501]
    assert beyond_spread(a, b)["counts"]
    runs = {"x": [{"seed": s, "test": {"psnr_hard": v}} for s, v in zip((0, 1, 2), a, strict=True)],
            "y": [{"seed": s, "test": {"psnr_hard": v}} for s, v in zip((0, 1, 2), b, strict=True)]}
    (line,) = margins(runs, {"x": "X", "y": "Y"}, ours="x")
    assert line.endswith("beyond the seed spread.")
    runs["y"] = [{"seed": s, "test": {"psnr_hard": v}} for s, v in zip((0, 1, 2), (0.515, 0.5, 0.501), strict=True)]
    (line,) = margins(runs, {"x": "X", "y": "Y"}, ours="x")  # margin 0.025 within the spread 0.028
    assert line.endswith(f"within the seed spread ({beyond_spread(a, [0.515, 0.5, 0.501])['reason']}).")


SPREAD_NAMES = ("spread", "std")  # a name holding a seed spread, or one of its stds (s0, s1, ...)


def hand_rules(source: str) -> list[int]:
    """Lines where a margin (a name ``margin*``/``diff*``) is compared with a seed spread by hand."""
    lines = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Compare):
            names = {n.id for n in ast.walk(node) if isinstance(n, ast.Name)}
            spread = any(any(w in n for w in SPREAD_NAMES) or (n[:1] == "s" and n[1:].isdigit()) for n in names)
            if spread and any(n.startswith(("margin", "diff")) for n in names):
                lines.append(node.lineno)
    return lines


def test_no_report_module_keeps_a_rule_of_its_own():
    """A module that judges a margin against the seed spread must take the rule from eval._spread: no function
    outside it compares a margin with a spread by hand, as the four rules this replaced did."""
    # the rules that were replaced, as they were written: each is found
    for old in ("note = 'more than' if margin > spread else 'within'",  # the compare report's
                "verdict = 'exceeds' if abs(diff) > s0 + s else 'is within'",  # the peers report's
                "counts = abs(margin) > 2 * max_std and same_sign"):  # paradigm 1's
        assert hand_rules(old) == [1], old
    offenders = [f"{path.relative_to(EVAL)}:{line}" for path in sorted(EVAL.rglob("*.py"))
                 if path.name != "_spread.py" for line in hand_rules(path.read_text())]
    assert not offenders, f"margin-against-spread comparisons outside eval._spread: {offenders}"
    assert _spread.MIN_SEEDS == 3


def test_a_target_that_holds_by_construction_is_not_reported_as_met():
    from eval.peers.report import targets

    def runs(gap: float) -> dict[str, list]:
        test = {"psnr_hard": 23.0, "psnr": 23.0 + gap, "utilization": 1.0, "perplexity": 500.0}
        return {"ddcl": [{"seed": s, "test": test, "history": [{"identity_residual": 1e-7}]} for s in (0, 1, 2)]}

    (gap_line,) = [line for line in targets(runs(0.0), {"num_codes": 512}) if "Soft→hard" in line]
    assert "**holds by construction**, not a measured result" in gap_line and "met**" not in gap_line
    (gap_line,) = [line for line in targets(runs(0.1), {"num_codes": 512}) if "Soft→hard" in line]
    assert gap_line.endswith("0.100 dB → **met**.")
