"""What eval.per_second compares and where its records go (shared by the study and its step-cost benchmark)."""

from __future__ import annotations

from eval._provenance import ROOT

OUT = ROOT / "reports" / "per_second"
# The candidates (eval.harness: the truncated layers, over each token's nearest codes or its code's neighbours, the
# annealed one, the amortised Jacobian), the exact layer (the default up to K = 2048; top_k="auto" is ddcl_k16's
# computation up to K = 8192, ddcl_k32's above), and
# the hard VQ baselines; from K = N / 4 on the capped restart is the stronger hard VQ
# (docs/studies.md, "Long training").
CANDIDATES = ("ddcl_k16", "ddcl_k32", "ddcl_k64", "ddcl_n16", "ddcl_n32", "ddcl_c16", "ddcl_anneal", "ddcl_amortised")
BASELINES = ("ddcl_exact", "hard_ema", "hard_ema_cap")
