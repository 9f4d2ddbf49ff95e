"""Rényi DP of the Poisson-subsampled Gaussian mechanism, and RDP → (ε, δ) conversions.

One lot of DP-SGD with sampling rate q and noise multiplier σ is the sampled Gaussian mechanism
(SGM). Mironov, Talwar & Zhang 2019, "Rényi Differential Privacy of the Sampled Gaussian
Mechanism" (arXiv 1908.10530), give its RDP R(α) = log(A_α) / (α − 1); it composes additively
over lots (Mironov 2017, Prop. 1). Integer α: the binomial expansion, summed as A_α − 1 for full
precision; fractional α: the two-sided series; q = 1: α / (2σ²) exactly.

Conversions to (ε, δ)-DP, chosen explicitly:
* ``"paper"``: ε = R(α) + log(1/δ)/(α − 1) (Mironov 2017, Prop. 3; the moments accountant's tail
  bound, Abadi et al. 2016, Theorem 2, with α = λ + 1).
* ``"improved"``: ε = R(α) + log((α−1)/α) − (log δ + log α)/(α − 1)
  (Balle et al. 2020, Thm 21; Canonne, Kamath & Steinke 2020, Prop. 12).

Details (A_α and its series): docs/ACCOUNTING.md, "dpsgd/accountant/renyi/rdp.py".
"""

from __future__ import annotations

import math
from functools import lru_cache

import numpy as np
from scipy import special

from ..limits import (
    check_choice,
    check_delta,
    check_epsilon,
    check_orders,
    check_q,
    check_sigma,
    check_steps,
)

#: Orders used by default: fractional orders where the optimum sits for large ε (down to 1.02:
#: for ε > 100 the optimum is below 1.25, e.g. opacus starts at 1.1), integers 2..64, and a few
#: large orders for very small ε. The orders below 1.25 only win where ε is in the hundreds.
DEFAULT_ORDERS: tuple = (
    (1.02, 1.05, 1.1, 1.15, 1.2)
    + (1.25, 1.5, 1.75, 2.0, 2.25, 2.5, 2.75, 3.0, 3.25, 3.5, 3.75, 4.0, 4.5, 5.0, 5.5)
    + tuple(float(a) for a in range(6, 65))
    + (80.0, 96.0, 128.0, 192.0, 256.0, 512.0)
)

CONVERSIONS = ("improved", "paper")

_FRAC_MAX_TERMS = 1 << 21
_LOG_TOL = 40.0  # stop the fractional series when the next term is e^-40 below the total


def _log_comb(n, k):
    return special.gammaln(n + 1) - special.gammaln(k + 1) - special.gammaln(n - k + 1)


def _log_a_int(q: float, sigma: float, alpha: int) -> float:
    """log A_α for integer α ≥ 2 and 0 < q < 1 (binomial expansion, MTZ 2019 §3.3)."""
    k = np.arange(2, alpha + 1, dtype=float)
    x = (k * k - k) / (2.0 * sigma * sigma)  # > 0 for k ≥ 2
    log_expm1 = x + np.log(-np.expm1(-x))  # log(e^x − 1), stable for all x > 0
    terms = _log_comb(float(alpha), k) + k * math.log(q) + (alpha - k) * math.log1p(-q) + log_expm1
    log_a_minus_1 = special.logsumexp(terms)  # log(A_α − 1), all terms ≥ 0
    return float(np.logaddexp(0.0, log_a_minus_1))  # log(1 + (A_α − 1))


def _frac_terms(q: float, sigma: float, alpha: float, i: np.ndarray):
    """Log-magnitudes and signs of the MTZ 2019 §3.3 series terms s0_i, s1_i (fractional α)."""
    z0 = sigma * sigma * math.log(1.0 / q - 1.0) + 0.5 if q < 1 else -np.inf
    j = alpha - i
    log_c = _log_comb(alpha, i)  # log |C(α, i)|
    sign = special.gammasgn(alpha - i + 1.0)  # sign of C(α, i)
    s2 = 2.0 * sigma * sigma
    ls0 = (
        log_c
        + i * math.log(q)
        + j * math.log1p(-q)
        + (i * i - i) / s2
        + special.log_ndtr((z0 - i) / sigma)
    )
    ls1 = (
        log_c
        + j * math.log(q)
        + i * math.log1p(-q)
        + (j * j - j) / s2
        + special.log_ndtr((j - z0) / sigma)
    )
    return ls0, ls1, sign


def _log_a_frac(q: float, sigma: float, alpha: float) -> float:
    """log A_α for fractional α > 1 and 0 < q < 1 (MTZ 2019 §3.3 series, signed).

    A_α = Σ_i C(α,i) [q^i (1−q)^{α−i} e^{(i²−i)/2σ²} Φ((z0−i)/σ)
                      + q^{α−i} (1−q)^i e^{((α−i)²−(α−i))/2σ²} Φ((α−i−z0)/σ)],
    z0 = σ² log(1/q − 1) + 1/2. For i > α + 1 the terms alternate in sign with decreasing magnitude,
    so the sum is truncated when the next term is below e^-40 of the total; if that has not happened
    after 2^21 terms, the alternating-series remainder bound is added (an upper bound).
    """
    n = 256 + 2 * int(alpha)
    while True:
        i = np.arange(n, dtype=float)
        ls0, ls1, sign = _frac_terms(q, sigma, alpha, i)
        logs = np.concatenate([ls0, ls1])
        signs = np.concatenate([sign, sign])
        m = float(np.max(logs))
        total = float(np.sum(signs * np.exp(logs - m)))
        log_total = m + math.log(total)
        nxt_i = np.array([float(n)])
        n0, n1, _ = _frac_terms(q, sigma, alpha, nxt_i)
        nxt = float(max(n0[0], n1[0]))
        if nxt < log_total - _LOG_TOL:
            return log_total
        if n >= _FRAC_MAX_TERMS:
            # alternating tail: |remainder| <= |s0_n + s1_n| <= 2 max(|s0_n|, |s1_n|)
            return float(np.logaddexp(log_total, nxt + math.log(2.0)))
        n *= 4


def log_a(q: float, sigma: float, alpha: float) -> float:
    """log A_α of the sampled Gaussian mechanism (MTZ 2019); A_α = exp((α−1)·R(α))."""
    q, sigma = check_q(q), check_sigma(sigma)
    alpha = check_orders([alpha], "alpha")[0]
    return log_a_unchecked(q, sigma, alpha)


_FRAC_FLOOR = 1e-12  # below this the signed series is round-off (~1e-16 absolute): use the bound


def log_a_unchecked(q: float, sigma: float, alpha: float) -> float:
    """:func:`log_a` for arguments already valid."""
    if q == 1.0:
        return (alpha - 1.0) * alpha / (2.0 * sigma * sigma)  # Gaussian mechanism, exact
    if float(alpha).is_integer():
        return _log_a_int(q, sigma, int(alpha))
    v = _log_a_frac(q, sigma, float(alpha))
    if v < _FRAC_FLOOR:
        # tiny q/σ: log A_α ~ α(α−1)q²/(2σ²) is below the series' round-off (it can even come out
        # negative); R(α) <= R(⌈α⌉) (R non-decreasing, Mironov 2017 Prop. 9), and the integer
        # order's sum has only non-negative terms, so this is an upper bound with full precision
        up = math.ceil(alpha)
        v = (alpha - 1.0) / (up - 1.0) * _log_a_int(q, sigma, up)
    return v


@lru_cache(maxsize=256)
def rdp_curve(q: float, sigma: float, orders: tuple = DEFAULT_ORDERS) -> np.ndarray:
    """Per-lot RDP ε_α at each order for arguments already valid (a ledger's charged mechanisms),
    cached."""
    if q == 1.0:
        out = np.array(orders, dtype=float) / (2.0 * sigma * sigma)
    else:
        out = np.array([log_a_unchecked(q, sigma, a) / (a - 1.0) for a in orders], dtype=float)
    out.setflags(write=False)
    return out


def compute_rdp(q: float, sigma: float, orders=DEFAULT_ORDERS, steps: int = 1) -> np.ndarray:
    """RDP ε_α of ``steps`` lots of the Poisson-sampled Gaussian at each order α (MTZ 2019).

    Per-(q, σ, orders) curves are cached; composition scales them by ``steps`` (Mironov 2017).
    """
    q, sigma, steps = check_q(q), check_sigma(sigma), check_steps(steps)
    orders = check_orders(orders, minimum=1.0)
    return steps * rdp_curve(q, sigma, tuple(float(a) for a in orders))


def rdp_to_epsilon(orders, rdp, delta: float, conversion: str = "improved"):
    """(ε, α*) from an RDP curve: min over orders of the chosen conversion (see module doc).

    ``"improved"`` also uses ε = 0 when δ ≥ sqrt(1 − e^{−R(α)}) (Bretagnolle–Huber bound on total
    variation via KL ≤ R(α)).
    """
    delta = check_delta(delta)
    check_choice(conversion, "conversion", CONVERSIONS)
    a, r = check_curve(orders, rdp)
    return rdp_to_epsilon_unchecked(a, r, delta, conversion)


def check_curve(orders, rdp_curve) -> tuple[np.ndarray, np.ndarray]:
    """(orders, RDP values) as float arrays: orders >= 1, one value per order,
    each >= 0 and not NaN."""
    a = np.asarray(check_orders(orders, minimum=1.0), dtype=float)
    r = np.asarray(rdp_curve, dtype=float)
    if r.shape != a.shape:
        raise ValueError(f"rdp must have one value per order, got {r.shape} for {a.shape} orders")
    if np.any(np.isnan(r)) or np.any(r < 0):
        raise ValueError(f"rdp must be >= 0 and not NaN, got rdp={r!r}")
    return a, r


def rdp_to_epsilon_unchecked(a: np.ndarray, r: np.ndarray, delta: float, conversion: str):
    """The conversion itself, arguments already validated
    (also the ledger's per-epoch fast path)."""
    log_d = math.log(delta)
    if conversion == "paper":
        eps = r - log_d / (a - 1.0)
    else:
        eps = r + np.log1p(-1.0 / a) - (log_d + np.log(a)) / (a - 1.0)
        eps = np.where(delta * delta + np.expm1(-r) > 0, 0.0, eps)
    i = int(np.argmin(eps))
    return max(0.0, float(eps[i])), float(a[i])


def rdp_to_delta(orders, rdp, epsilon: float, conversion: str = "improved"):
    """(δ, α*) from an RDP curve at a given ε: inverse of :func:`rdp_to_epsilon` per order.

    paper:    δ = exp((α−1)(R(α) − ε))                              (Mironov 2017, Prop. 3)
    improved: δ = exp((α−1)(R(α) − ε)) · (1 − 1/α)^{α−1} / α        (Balle et al. 2020, Thm 21)
    """
    epsilon = check_epsilon(epsilon)
    check_choice(conversion, "conversion", CONVERSIONS)
    a = np.asarray(check_orders(orders, minimum=1.0), dtype=float)
    r = np.asarray(rdp, dtype=float)
    if r.shape != a.shape:
        raise ValueError(f"rdp must have one value per order, got {r.shape} for {a.shape} orders")
    log_d = (a - 1.0) * (r - epsilon)
    if conversion == "improved":
        log_d = log_d + (a - 1.0) * np.log1p(-1.0 / a) - np.log(a)
    i = int(np.argmin(log_d))
    return float(min(1.0, math.exp(min(0.0, log_d[i])))), float(a[i])


def epsilon(
    q: float,
    sigma: float,
    steps: int,
    delta: float,
    orders=DEFAULT_ORDERS,
    conversion: str = "improved",
):
    """(ε, α*) after ``steps`` lots of the Poisson-sampled Gaussian (RDP accountant)."""
    delta = check_delta(delta)
    orders = check_orders(orders, minimum=1.0)
    curve = compute_rdp(q, sigma, orders, steps)
    return rdp_to_epsilon(orders, curve, delta, conversion)


def delta(
    q: float,
    sigma: float,
    steps: int,
    epsilon: float,
    orders=DEFAULT_ORDERS,
    conversion: str = "improved",
):
    """(δ, α*) after ``steps`` lots at a given ε (RDP accountant)."""
    epsilon = check_epsilon(epsilon)
    orders = check_orders(orders, minimum=1.0)
    curve = compute_rdp(q, sigma, orders, steps)
    return rdp_to_delta(orders, curve, epsilon, conversion)
