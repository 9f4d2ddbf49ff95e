"""One-run privacy audit: the ε lower bound of Steinke, Nasr & Jagielski (NeurIPS 2023, "Privacy
Auditing with One (1) Training Run", arXiv 2305.08846).

The game (their Algorithm 1): m canaries, each included with probability 1/2; one training run; a
score per canary. The auditor guesses "in" for the k₊ highest scores, "out" for the k₋ lowest and
abstains on the rest (ties broken by canary index, fixed before the bits). The test (their
Theorem 3.1 with δ > 0: Cor. 5.4 and App. D) gives a p-value p(ε, δ) for "the run is (ε, δ)-DP",
and ε_lb = inf{ε >= 0 : p(ε, δ) > β} is a 1 − β lower bound, found by bisection.

Gaussian DP (Mahloujifar, Melis & Chaudhuri 2024, "Auditing f-Differential Privacy in One Run",
arXiv 2410.22235): :func:`gdp_lower_bound` tests "the run is μ-GDP" with their f-DP recursion
(``fdp_rejected``), as in the authors' released code; μ_lb by bisection, its ε at δ by
``strong_composition.gaussian_epsilon``. :func:`audit_bound` evaluates the grid of (k₊, k₋) of
:func:`default_grid` (a function of m only), each at β/|grid| (Bonferroni).

Details: docs/AUDIT_MATH.md, "dpsgd/audit/onerun/stats/bounds.py".
"""

from __future__ import annotations

import math

import numpy as np
from scipy import special

from dpsgd.accountant import strong_composition
from dpsgd.core.errors import ConfigError

XTOL = 1e-10  # bisection stops when hi − lo <= XTOL (absolute, in ε)
EPS_MAX = 700.0  # p_ε = expit(ε) is 1 to double precision long before this
GRID_FRACTIONS = (0.005, 0.01, 0.02, 0.05, 0.1, 0.2, 0.5)  # k/m of the default grid


def _count(name: str, v, lo: int = 0) -> int:
    if isinstance(v, bool) or not isinstance(v, (int, np.integer)) or int(v) < lo:
        raise ConfigError(f"{name}={v!r}: must be an integer >= {lo}")
    return int(v)


def _unit(name: str, v, lo_open: bool, hi_open: bool) -> float:
    ok = isinstance(v, (int, float, np.floating)) and not isinstance(v, bool) and math.isfinite(v)
    if ok:
        v = float(v)
        ok = (v > 0 if lo_open else v >= 0) and (v < 1 if hi_open else v <= 1)
    if not ok:
        rng = ("(" if lo_open else "[") + "0, 1" + (")" if hi_open else "]")
        raise ConfigError(f"{name}={v!r}: must be a number in {rng}")
    return v


def _check(r, v, m, delta, beta):
    r, v, m = _count("r", r), _count("v", v), _count("m", m, lo=1)
    if not v <= r <= m:
        raise ConfigError(f"need 0 <= v <= r <= m, got v={v}, r={r}, m={m}")
    return r, v, m, _unit("delta", delta, False, True), _unit("beta", beta, True, True)


def p_value(r: int, v: int, m: int, epsilon: float, delta: float) -> float:
    """p(ε, δ) of the module doc (Steinke et al. 2023, Cor. 5.4 / App. D): an upper bound on the
    probability of >= v correct out of r guesses among m canaries under (ε, δ)-DP."""
    r, v, m, delta, _ = _check(r, v, m, delta, 0.5)
    ok = isinstance(epsilon, (int, float, np.floating)) and not isinstance(epsilon, bool)
    if not (ok and math.isfinite(epsilon) and epsilon >= 0):
        raise ConfigError(f"epsilon={epsilon!r}: must be a finite number >= 0")
    return _p_value(r, v, m, float(epsilon), delta)


def _p_value(r: int, v: int, m: int, eps: float, delta: float) -> float:
    if v == 0:
        return 1.0
    p = special.expit(eps)
    tail = float(special.bdtrc(v - 1, r, p))  # P[Bin(r, p) >= v]
    if delta == 0.0:
        return min(1.0, tail)
    i = np.arange(1, v + 1)
    below = special.bdtr(v - 1, r, p)  # P[Bin <= v − 1]
    lower = np.where(v - i - 1 >= 0, special.bdtr(np.maximum(v - i - 1, 0), r, p), 0.0)
    alpha = float(np.max((below - lower) / i))  # max_i P[v − i <= Bin < v] / i
    return min(1.0, tail + 2.0 * m * delta * max(alpha, 0.0))


def steinke_bound(r: int, v: int, m: int, delta: float, beta: float) -> float:
    """ε_lb = inf{ε >= 0 : p(ε, δ) > β} (module doc) for one pre-declared guess count: with
    probability >= 1 − β the run is not (ε, δ)-DP for any ε < ε_lb. 0.0 when even ε = 0 is not
    rejected. Bisection to XTOL, returning the rejected end (a lower bound to within XTOL)."""
    r, v, m, delta, beta = _check(r, v, m, delta, beta)
    if _p_value(r, v, m, 0.0, delta) > beta:
        return 0.0
    lo, hi = 0.0, 1.0
    while _p_value(r, v, m, hi, delta) <= beta:  # App. D: step the upper end by 1
        lo, hi = hi, hi + 1.0
        if hi > EPS_MAX:
            return lo
    while hi - lo > XTOL:
        mid = 0.5 * (lo + hi)
        if _p_value(r, v, m, mid, delta) <= beta:
            lo = mid
        else:
            hi = mid
    return lo


def default_grid(m: int) -> list[tuple[int, int]]:
    """The pre-declared guess counts (k₊, k₋) for m canaries, a function of m only: for each
    k = max(1, round(f·m)), f in GRID_FRACTIONS, one-sided (k, 0) and two-sided
    (k, k) where 2k <= m."""
    m = _count("m", m, lo=1)
    ks = sorted({max(1, round(f * m)) for f in GRID_FRACTIONS if max(1, round(f * m)) <= m})
    return [(k, 0) for k in ks] + [(k, k) for k in ks if 2 * k <= m]


def check_scores(scores, bits) -> tuple[np.ndarray, np.ndarray]:
    """(scores, bits) as arrays: a non-empty 1-D array of finite numbers and 0/1 of its shape;
    ConfigError (one line) otherwise."""
    s = np.asarray(scores, dtype=float)
    b = np.asarray(bits)
    if s.ndim != 1 or s.size == 0 or not np.all(np.isfinite(s)):
        raise ConfigError(
            f"scores: must be a non-empty 1-D array of finite numbers, got shape {s.shape}"
        )
    if b.shape != s.shape or not np.all((b == 0) | (b == 1)):
        raise ConfigError(
            f"bits: must be 0/1 of the same shape as scores {s.shape}, got shape {b.shape}"
        )
    return s, b


def _inputs(scores, bits, delta, beta, guesses):
    s, b = check_scores(scores, bits)
    m = s.size
    grid = (
        default_grid(m)
        if guesses is None
        else [(_count("guesses k_plus", kp), _count("guesses k_minus", km)) for kp, km in guesses]
    )
    if not grid:
        raise ConfigError("guesses: the grid of (k_plus, k_minus) is empty")
    for kp, km in grid:
        if kp < 0 or km < 0 or kp + km < 1 or kp + km > m:
            raise ConfigError(
                f"guesses: (k_plus, k_minus) = ({kp}, {km}) needs k_plus, k_minus >= 0 "
                f"and 1 <= k_plus + k_minus <= m = {m}"
            )
    return (
        s,
        b.astype(int),
        m,
        _unit("delta", delta, False, True),
        _unit("beta", beta, True, True),
        grid,
    )


def guess_counts(scores: np.ndarray, bits: np.ndarray, grid) -> list[dict]:
    """For each (k₊, k₋) of ``grid``: guess "in" for the k₊ highest scores and "out" for the k₋
    lowest (ties: lower index first in the order of decreasing score);
    {k_plus, k_minus, guesses, correct}."""
    m = len(scores)
    order = np.lexsort((np.arange(m), -np.asarray(scores)))  # decreasing score, then index
    ranked = np.asarray(bits, dtype=int)[order]
    top = np.concatenate([[0], np.cumsum(ranked)])  # top[k]: "in" bits among the k highest
    bottom_out = np.concatenate([[0], np.cumsum(1 - ranked[::-1])])  # "out" bits among the k lowest
    return [
        {"k_plus": kp, "k_minus": km, "guesses": kp + km, "correct": int(top[kp] + bottom_out[km])}
        for kp, km in grid
    ]


def audit_bound(
    scores, bits, delta: float, beta: float = 0.05, guesses=None, gdp: bool = False
) -> dict:
    """The one-run ε lower bound at confidence 1 − β over a pre-declared grid of guess counts.

    ``scores[i]``: canary i's score (higher = more likely in); ``bits[i]``: 1 if it was included.
    Pass every one of the m randomised canaries, abstained-on ones too: m enters the δ term.
    ``guesses``: [(k₊, k₋), ...], fixed before the run (default :func:`default_grid` (m)). Each grid
    point guesses "in" for the k₊ highest and "out" for the k₋ lowest scores (ties: lower index
    first in the order of decreasing score), abstains on the rest, and is tested at β/|grid|
    (Bonferroni), so the reported maximum holds with probability >= 1 − β. Deterministic.

    Returns {"eps_lower_bound", "k_plus", "k_minus", "guesses" (r), "correct" (v), "m", "delta",
    "beta", "beta_per_point", "correction": "bonferroni", "grid": [{k_plus, k_minus, guesses,
    correct, eps_lower_bound}, ...]}; the best point's fields are those of the first grid point with
    the largest bound.

    ``gdp=True`` adds the Gaussian-DP bound (:func:`gdp_lower_bound`) on the same grid, also at
    β/|grid| per point: "gdp_mu_lower_bound" (the largest μ_lb), its "gdp_k_plus", "gdp_k_minus",
    and "gdp_eps_lower_bound" (its ε at δ; None when δ = 0), plus "mu_lower_bound" in each row. The
    (ε, δ) claim and the GDP claim each hold at 1 − β (both together at 1 − 2β).
    """
    s, b, m, delta, beta, grid = _inputs(scores, bits, delta, beta, guesses)
    per = beta / len(grid)
    rows = guess_counts(s, b, grid)
    for row in rows:
        row["eps_lower_bound"] = steinke_bound(row["guesses"], row["correct"], m, delta, per)
    best = max(rows, key=lambda row: row["eps_lower_bound"])
    extra = _gdp_fields(rows, m, delta, per) if gdp else {}
    return {
        **extra,
        "eps_lower_bound": best["eps_lower_bound"],
        "k_plus": best["k_plus"],
        "k_minus": best["k_minus"],
        "guesses": best["guesses"],
        "correct": best["correct"],
        "m": m,
        "delta": delta,
        "beta": beta,
        "beta_per_point": per,
        "correction": "bonferroni",
        "grid": rows,
    }


def _gdp_fields(rows, m, delta, per) -> dict:
    for row in rows:
        row["mu_lower_bound"] = gdp_lower_bound(row["guesses"], row["correct"], m, per)[
            "mu_lower_bound"
        ]
    best = max(rows, key=lambda row: row["mu_lower_bound"])
    mu = best["mu_lower_bound"]
    eps = (
        None
        if delta == 0
        else (strong_composition.gaussian_epsilon(delta, 1.0 / mu) if mu > 0 else 0.0)
    )
    return {
        "gdp_mu_lower_bound": mu,
        "gdp_k_plus": best["k_plus"],
        "gdp_k_minus": best["k_minus"],
        "gdp_eps_lower_bound": eps,
    }


MU_MAX = 50.0  # μ-GDP with μ >= this: ε in the thousands; the bisection's upper end


def fdp_rejected(fbar, r: int, v: int, m: int, beta: float) -> bool:
    """Mahloujifar et al. 2024 recursion (module doc) for any symmetric trade-off curve f: True when
    "the run is f-DP with respect to each canary" is rejected at level β by v correct out of r
    guesses among m canaries. ``fbar(x)`` = f(1 − x), increasing in x (for μ-GDP: Φ(Φ⁻¹(x) − μ)); a
    lower bound on it gives a test that rejects less often, so stays valid."""
    if r == 0:
        return False
    tau = beta * r / m
    h, rr = tau * (r - v) / r, tau * v / r
    for i in range(v - 1, -1, -1):
        h_new = max(h, fbar(rr) if rr < 1.0 else 1.0)
        rr = rr + i / (r - i) * (h_new - h)
        h = h_new
        if rr + h > r / m:  # r_i and h_i only grow as i falls: rejected already
            return True
    return rr + h > r / m


def _gdp_rejected(mu: float, r: int, v: int, m: int, beta: float) -> bool:
    """The recursion for μ-GDP, f̄(x) = Φ(Φ⁻¹(x) − μ): True when μ-GDP is rejected at level β."""
    return fdp_rejected(lambda x: float(special.ndtr(special.ndtri(x) - mu)), r, v, m, beta)


def gdp_lower_bound(r: int, v: int, m: int, beta: float, delta: float | None = None) -> dict:
    """One-run lower bound on the GDP parameter μ at confidence 1 − β (Mahloujifar, Melis &
    Chaudhuri 2024; module doc) for r guesses, v correct, m canaries: {"mu_lower_bound", and with
    ``delta`` "eps_lower_bound" = the ε of μ_lb-GDP at δ}. μ_lb = 0 when μ → 0 is not rejected."""
    r, v, m, _, beta = _check(r, v, m, 0.0, beta)
    out: dict = {"mu_lower_bound": 0.0}
    if r > 0 and _gdp_rejected(1e-12, r, v, m, beta):
        lo, hi = 1e-12, MU_MAX
        if _gdp_rejected(hi, r, v, m, beta):
            lo = hi
        while hi - lo > XTOL * max(1.0, hi):
            mid = 0.5 * (lo + hi)
            lo, hi = (mid, hi) if _gdp_rejected(mid, r, v, m, beta) else (lo, mid)
        out["mu_lower_bound"] = lo
    if delta is not None:
        delta = _unit("delta", delta, True, True)
        mu = out["mu_lower_bound"]
        out["eps_lower_bound"] = (
            strong_composition.gaussian_epsilon(delta, 1.0 / mu) if mu > 0 else 0.0
        )
    return out
