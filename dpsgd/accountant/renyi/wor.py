"""Rényi DP of the Gaussian mechanism on lots sampled *without replacement* (fixed-size lots).

A lot is a uniformly random subset of exactly L of the N examples (γ = L/N); neighbouring datasets
differ by **replacing one example** (N is public and fixed, so add/remove does not apply). The
base mechanism is a Gaussian with sensitivity 2 and noise σ: ε(α) = 2α/σ² (Mironov 2017, Prop. 7).

Wang, Balle & Kasiviswanathan 2019, "Subsampled Rényi Differential Privacy and Analytical Moments
Accountant" (AISTATS), **Theorem 9** (subsampling without replacement, replace-one adjacency,
integer α >= 2), with the tighter arm of their **Theorem 27** for the Gaussian (forward
differences computed without cancellation by quadrature), and never above the base ε(α); at
γ = 1 this is the Gaussian's ε(α) exactly. Orders are integers, composed additively and converted
with ``rdp.rdp_to_epsilon``. dp_accounting's RdpAccountant implements the same theorem; its ε is
never above ours.

Details (the bound, the forward differences): docs/ACCOUNTING.md,
"dpsgd/accountant/renyi/wor.py".
"""

from __future__ import annotations

import math
from functools import lru_cache

import numpy as np
from scipy import special

from ..limits import check_delta, check_q, check_sigma, check_steps
from .rdp import rdp_to_epsilon_unchecked

#: Integer orders (Theorem 9 is stated for integer α).
ORDERS: tuple = tuple(float(a) for a in range(2, 65)) + (80.0, 96.0, 128.0, 192.0, 256.0)


def _log_comb(n, k):
    return special.gammaln(n + 1) - special.gammaln(k + 1) - special.gammaln(n - k + 1)


def base_rdp(sigma: float, alpha):
    """ε(α) = 2α/σ² of the lot's Gaussian under replace-one (sensitivity 2C, noise σC)."""
    return 2.0 * np.asarray(alpha, dtype=float) / (sigma * sigma)


@lru_cache(maxsize=64)
def _log_even_diffs(sigma: float, kmax: int) -> np.ndarray:
    """log Δ^{2m} for m = 0..kmax/2 (index 2m), Δ^k = E_Z[(e^{c + √(2c) Z} − 1)^k], c = 2/σ²."""
    c = 2.0 / (sigma * sigma)
    r = math.sqrt(2.0 * c)
    z = np.arange(-40.0, kmax * r + 40.0, 0.01)
    u = c + r * z
    with np.errstate(divide="ignore", over="ignore"):
        log_abs = np.where(
            u > 30.0,
            u + np.log1p(-np.exp(-np.clip(u, 30.0, 700.0))),
            np.log(np.abs(np.expm1(np.minimum(u, 30.0)))),
        )
    log_phi = -0.5 * z * z - 0.5 * math.log(2.0 * math.pi) + math.log(0.01)
    out = np.full(kmax + 1, -np.inf)
    for k in range(0, kmax + 1, 2):
        out[k] = float(special.logsumexp(log_phi + k * log_abs)) if k else 0.0
    return out


def _log_sum_terms(gamma: float, sigma: float, alpha: int) -> float:
    """log of the Theorem-9 sum (the argument of the log, including the leading 1), each term j >= 3
    the smaller of Theorem 9's and Theorem 27's."""
    e2 = float(base_rdp(sigma, 2))
    # j = 2: γ² C(α,2) min{4(e^{ε(2)} − 1), 2 e^{ε(2)}}
    log_m2 = min(math.log(4.0) + e2 + math.log(-math.expm1(-e2)), math.log(2.0) + e2)
    logs = [0.0, 2.0 * math.log(gamma) + float(_log_comb(alpha, 2)) + log_m2]
    if alpha >= 3:
        j = np.arange(3, alpha + 1, dtype=float)
        d = _log_even_diffs(sigma, 2 * ((alpha + 1) // 2))
        ji = j.astype(int)
        fd = math.log(4.0) + 0.5 * (d[2 * (ji // 2)] + d[2 * ((ji + 1) // 2)])  # Theorem 27
        t9 = math.log(2.0) + (j - 1.0) * base_rdp(sigma, j)  # Theorem 9
        logs.extend(j * math.log(gamma) + _log_comb(alpha, j) + np.minimum(fd, t9))
    return float(special.logsumexp(logs))


@lru_cache(maxsize=256)
def rdp_curve(gamma: float, sigma: float, orders: tuple = ORDERS) -> np.ndarray:
    """Per-lot RDP ε'(α) of one fixed-size lot (γ = L/N, σ) at integer ``orders`` (Theorem 9, capped
    by the base ε(α))."""
    out = np.empty(len(orders))
    for i, a in enumerate(orders):
        if a != int(a) or a < 2:
            raise ValueError(f"orders must be integers >= 2 (Wang et al. 2019, Thm 9), got {a!r}")
        base = float(base_rdp(sigma, a))
        out[i] = (
            base if gamma >= 1.0 else min(base, _log_sum_terms(gamma, sigma, int(a)) / (a - 1.0))
        )
    out.setflags(write=False)
    return out


def epsilon(gamma: float, sigma: float, steps: int, delta: float, conversion: str = "improved"):
    """(ε, α*) after ``steps`` fixed-size lots (γ = L/N, noise multiplier σ),
    replace-one adjacency."""
    gamma, sigma, steps, delta = (
        check_q(gamma, "gamma"),
        check_sigma(sigma),
        check_steps(steps),
        check_delta(delta),
    )
    if steps == 0:
        return 0.0, None
    return rdp_to_epsilon_unchecked(
        np.array(ORDERS), steps * rdp_curve(gamma, sigma), delta, conversion
    )
