"""Risk a user can read: the power of a membership-inference attacker at a low false-positive rate.

An (ε, δ)-DP mechanism admits no test of "x was in the training set" with false-positive rate α and
true-positive rate above min(1, δ + e^ε α, 1 − e^{−ε}(1 − δ − α)) (Kairouz, Oh & Viswanath 2015;
the f-DP trade-off of Dong, Roth & Su 2022, Prop. 2.5). A ledger holds a whole curve δ(ε), so the
attacker's best TPR at α is bounded by the lowest of these lines over every (ε(δ), δ) it serves:
the envelope computed here, on a grid of δ, is an upper bound on the true trade-off's TPR (finitely
many supporting lines), tight where the grid is dense. ``gdp_mu`` is the μ of the μ-GDP trade-off
β(α) = Φ(Φ⁻¹(1 − α) − μ) with the same TPR at α = 1 % (a reading aid, not a further claim).
"""

from __future__ import annotations

import math

import numpy as np
from scipy.stats import norm

FPRS = (0.001, 0.01, 0.1)  # the false-positive rates reported
# δ grid of the supporting lines: log-spaced from 1e-9 to 0.5, then up to 0.99 (where ε → 0); a δ
# below 1e-9 moves no TPR at FPR >= 0.1 % (TPR <= δ + e^ε·FPR) and would cost tilted compositions
DELTAS = tuple(np.concatenate([np.logspace(-9, math.log10(0.5), 200), np.linspace(0.52, 0.99, 48)]))


def curve(ledger, accountant: str = "pld", convention: str = "joint"):
    """(ε_i, δ_i): the (ε(δ), δ) pairs of ``ledger`` on the δ grid."""
    eps = ledger.epsilons(DELTAS, accountant, convention)
    return np.asarray(eps, dtype=float), np.asarray(DELTAS, dtype=float)


def tpr_bound(eps: np.ndarray, deltas: np.ndarray, alpha) -> np.ndarray:
    """The highest TPR at FPR ``alpha`` (scalar or array) that every pair (ε_i, δ_i) allows."""
    a = np.atleast_1d(np.asarray(alpha, dtype=float))[:, None]
    e, d = eps[None, :], deltas[None, :]
    with np.errstate(over="ignore"):
        lines = np.minimum(d + np.exp(e) * a, 1.0 - np.exp(-e) * (1.0 - d - a))
    out = np.clip(np.minimum(1.0, lines.min(axis=1)), a[:, 0], 1.0)
    return out if np.ndim(alpha) else float(out[0])


def gdp_mu(alpha: float, tpr: float) -> float | None:
    """μ of the μ-GDP curve through (α, TPR): Φ⁻¹(TPR) − Φ⁻¹(α); None at TPR = 1 (no finite μ:
    nothing a GDP reading adds)."""
    return None if tpr >= 1.0 else float(norm.ppf(tpr) - norm.ppf(alpha))


def risk(ledger, accountant: str = "pld", convention: str = "joint") -> dict:
    """The membership-inference risk of what ``ledger`` released: TPR at each FPR of ``FPRS`` and
    the matching μ-GDP at 1 %. An empty ledger: TPR = FPR (no attacker beats a coin)."""
    if not ledger.entries:
        return {"tpr_at_fpr": {str(a): a for a in FPRS}, "gdp_mu_at_1pct": 0.0,
                "accountant": accountant}  # fmt: skip
    plain = ledger._plain(accountant, "improved")  # also checks that the accountant serves it
    if not plain and accountant != "pld":  # one composition serves every δ: PLD (and plain RDP)
        raise ValueError(
            f"risk: the {accountant} accountant composes these lots anew for each δ of the "
            "curve; use pld"
        )
    if ledger.adjacency != "add_remove":
        raise ValueError(
            "risk: a membership attack is the add/remove question; this ledger is under "
            f"{ledger.adjacency} (its TPR bound would answer a substitution attack)"
        )
    eps, deltas = curve(ledger, accountant, convention)
    tpr = tpr_bound(eps, deltas, np.asarray(FPRS))
    return {
        "tpr_at_fpr": {str(a): float(t) for a, t in zip(FPRS, tpr)},
        "gdp_mu_at_1pct": gdp_mu(0.01, float(tpr[1])),
        "accountant": accountant,
    }


def summary(r: dict) -> str:
    """One short clause: "membership attack TPR ≤ 2.1 % at FPR 0.1 %, ≤ 9.8 % at 1 %"."""
    t = r["tpr_at_fpr"]
    return (
        f"membership attack TPR ≤ {100 * t['0.001']:.1f} % at FPR 0.1 %, "
        f"≤ {100 * t['0.01']:.1f} % at 1 %"
    )
