"""An exact test of the noise along the canaries' directions
(docs/AUDIT_MATH.md §6, "The noise, tested").

Under the null-space placement with the claimed normalisation an *excluded* canary's coordinate in
lot t is z_{t,i} = ⟨N_t, u_i⟩ / (σC): the noise alone, nothing from the data or the other canaries.
If the run adds isotropic Gaussian noise of std σ₀C (the claim's family, σ₀ free), the n = (excluded
canaries) × (lots) values are i.i.d. N(0, (σ₀/σ)²), so

    Q = Σ_{excluded i} Σ_t z_{t,i}²  ~  (σ₀/σ)² · χ²_n        (exactly, for every m and T).

H₀: σ₀ ≥ σ (at least the claimed noise) is rejected when Q < χ²_n quantile at β; its p-value
P[χ²_n ≤ Q] is largest at σ₀ = σ, so the test has level β for every σ₀ ≥ σ. σ₀/σ ≤ √(Q / χ²_{n,β})
with probability ≥ 1 − β. This tests the *noise* the claim specifies (σC), not ε: a run with less
noise and a smaller sensitivity could be as private as claimed and still be flagged here. With Dirac
canaries the data's gradients add to z (Q grows), so the test is only conservative there, not exact.
"""

from __future__ import annotations

import math

import numpy as np
from scipy import stats

NOISE_ASSUMES = (
    "the noise along each canary's direction is Gaussian, i.i.d. over lots and canaries (isotropic "
    "noise, Poisson lots); tests the claimed noise σC, not ε"
)


def noise_test(sumsq, bits, lots: int, beta: float, exact: bool) -> dict | None:
    """The test of the module doc on each canary's Σ_t z² (``sumsq``) and its bit;
    None without data."""
    sumsq, bits = np.asarray(sumsq, dtype=float), np.asarray(bits, dtype=bool)
    n = int((~bits).sum()) * int(lots)
    if n == 0:
        return None
    q = float(sumsq[~bits].sum())
    p = float(stats.chi2.cdf(q, n))
    return {
        "assumes": NOISE_ASSUMES,
        "label": "exact (null-space placement, claimed normalisation)"
        if exact
        else "conservative only (the data's gradients reach the canaries)",
        "exact": exact,
        "n": n,
        "noise_ratio": math.sqrt(q / n),
        "noise_ratio_upper": math.sqrt(q / stats.chi2.ppf(beta, n)),
        "p_value": p,
        "beta": beta,
        "verdict": "violation" if p < beta else "consistent",
    }
