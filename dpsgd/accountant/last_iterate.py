"""The last-iterate heuristic ε of DP-SGD (Steinke, Nasr, Ganesh, Balle, Choquette-Choo, Jagielski,
Hayes, Thakurta, Smith & Terzis, ICLR 2025, "The Last Iterate Advantage: Empirical Auditing and
Principled Heuristic Analysis of Differentially Private SGD", arXiv 2410.06186).

A HEURISTIC, NOT A GUARANTEE. It is the exact privacy of the *last iterate* of DP-SGD on linear
losses (the canary's clipped gradient the same unit vector every step; only the final model
released). The paper proposes it as a prediction of what attacks on the final model can achieve
for real (non-linear) training; it is not an upper bound on ε for real training (the paper gives
counterexamples), and the accountants (moments, RDP, PLD) remain the privacy claim.

The pair: P = N(0, T·σ²) (canary absent) against Q = Σ_j w_j·N(j, T·σ²), w_j = Binom(T, q)(j)
(present); ε(δ) is the smallest ε with both hockey-stick divergences <= δ. It is computed exactly
(one root-find per direction on half-lines, no grid), with the binomial truncated so that the ε
returned is an upper bound on the heuristic ε.

Details (the pair, the computation, the truncation): docs/ACCOUNTING.md,
"dpsgd/accountant/last_iterate.py".
"""

from __future__ import annotations

import math

import numpy as np
from scipy import optimize, special

from .limits import check_delta, check_groups, check_q, check_sigma, check_steps
from .compose import charge

TAIL_FRACTION = 1e-3  # binomial mass dropped: at most this share of δ
T_XTOL = 1e-13  # root-finding tolerance on t, relative to the noise scale √T·σ
Z_FAR = 40.0  # Φ(−40) ≈ 4e-350: a Gaussian tail beyond this many σ is 0 in float64


def _support(q: float, steps: int, tau: float):
    """(j, log w_j) on [j_lo, j_hi] and the dropped mass (<= tau)."""
    if q == 1.0:
        return np.array([float(steps)]), np.zeros(1), 0.0
    mean, sd = steps * q, math.sqrt(steps * q * (1 - q))
    half = max(8, math.ceil(sd * math.sqrt(2 * math.log(2 / tau)) + 8))  # Hoeffding-like start
    while True:
        lo, hi = max(0, math.floor(mean - half)), min(steps, math.ceil(mean + half))
        dropped = (special.bdtr(lo - 1, steps, q) if lo > 0 else 0.0) + special.bdtrc(hi, steps, q)
        if dropped <= tau or (lo == 0 and hi == steps):
            break
        half *= 2
    j = np.arange(lo, hi + 1, dtype=float)
    logw = (
        special.gammaln(steps + 1)
        - special.gammaln(j + 1)
        - special.gammaln(steps - j + 1)
        + j * math.log(q)
        + (steps - j) * math.log1p(-q)
    )
    return j, logw, float(dropped)


def _loss(t, j, logw, s2):
    """L(t) = log(q_density / p_density)(t) = log Σ_j w_j exp((2jt − j²)/(2s²))."""
    return float(special.logsumexp(logw + (2.0 * j * t - j * j) / (2.0 * s2)))


def _log_q_tail(t, j, logw, s, upper: bool):
    """log Q(z > t) (upper) or log Q(z < t) for Q = Σ w_j N(j, s²) (kept part)."""
    x = (t - j) / s
    return float(special.logsumexp(logw + special.log_ndtr(-x if upper else x)))


def _h_remove(t, j, logw, s, s2):
    """(ε, H_ε(Q‖P)) at the threshold t (L(t) = ε)."""
    eps = _loss(t, j, logw, s2)
    return eps, math.exp(_log_q_tail(t, j, logw, s, True)) - math.exp(
        eps + special.log_ndtr(-t / s)
    )


def _h_add(t, j, logw, s, s2):
    """(ε, H_ε(P‖Q)) at the threshold t (L(t) = −ε)."""
    eps = -_loss(t, j, logw, s2)
    return eps, math.exp(special.log_ndtr(t / s)) - math.exp(
        eps + _log_q_tail(t, j, logw, s, False)
    )


def _solve(h, lo, hi, target, xtol):
    """ε at the t in [lo, hi] where H(t) = target; H(lo) >= target side given by the caller."""
    if (h(lo)[1] - target) * (h(hi)[1] - target) > 0:
        return None
    t = optimize.brentq(lambda x: h(x)[1] - target, lo, hi, xtol=xtol, rtol=4 * np.finfo(float).eps)
    return h(t)[0]


def _direction_eps(h, t0, t_far, target, xtol):
    """ε >= 0 of one direction: 0 if H_0 <= target, else the root of H(t) = target between the
    threshold t0 of ε = 0 and t_far (where H is 0 in float64)."""
    if h(t0)[1] <= target:
        return 0.0
    eps = _solve(h, t0, t_far, target, xtol)
    return math.inf if eps is None else max(0.0, eps)


def last_iterate_epsilon(
    q: float, sigma: float, steps: int, delta: float, groups: int = 1
) -> float:
    """Heuristic ε(δ) of the last iterate of ``steps`` lots of DP-SGD (module doc; Steinke et al.,
    ICLR 2025). A heuristic for the final model, NOT a privacy guarantee."""
    q, sigma, steps = check_q(q), check_sigma(sigma), check_steps(steps)
    delta, groups = check_delta(delta), check_groups(groups)
    if steps == 0:
        return 0.0
    s_eff = check_sigma(charge(q, sigma, groups, "joint")[1], "sigma/sqrt(groups)")
    s2 = steps * s_eff * s_eff
    s = math.sqrt(s2)
    j, logw, dropped = _support(q, steps, TAIL_FRACTION * delta)
    xtol = T_XTOL * s
    # brackets: below lo_t P has no mass (H(P‖Q) = 0) and L < 0 (every exponent 2jt − j² <= 0,
    # j >= 0); above hi_t Q has no mass (H(Q‖P) = 0); hi_t is moved up until L > 0 there
    # (L increases to +∞)
    lo_t = -Z_FAR * s - 1.0
    hi_t = float(j[-1]) + Z_FAR * s + 1.0
    while _loss(hi_t, j, logw, s2) <= 0.0:
        hi_t += hi_t - lo_t
    l_lo = _loss(lo_t, j, logw, s2)
    t0 = (
        lo_t
        if l_lo >= 0.0
        else optimize.brentq(lambda x: _loss(x, j, logw, s2), lo_t, hi_t, xtol=xtol)
    )
    rem = _direction_eps(lambda x: _h_remove(x, j, logw, s, s2), t0, hi_t, delta - dropped, xtol)
    add = _direction_eps(lambda x: _h_add(x, j, logw, s, s2), t0, lo_t, delta, xtol)
    return max(rem, add)
