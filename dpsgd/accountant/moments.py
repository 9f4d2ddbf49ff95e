"""The moments accountant of Abadi et al. 2016 (§3.2, Theorem 2), exactly as in the paper.

For one lot of the Gaussian mechanism with Poisson sampling rate q and noise multiplier σ the
log moment of order λ is (paper §3.2 and its ``gaussian_moments.py``)

    α(λ) = log max(E1, E2),
    E1 = E_{z~μ0}[(μ0(z)/μ(z))^λ],   E2 = E_{z~μ}[(μ(z)/μ0(z))^λ],
    μ0 = N(0, σ²),  μ = (1 − q)·μ0 + q·N(1, σ²).

E2 = A_{λ+1} of Mironov, Talwar & Zhang 2019 and has the closed binomial form
E2 = Σ_{k=0}^{λ+1} C(λ+1, k)(1−q)^{λ+1−k} q^k exp((k² − k)/(2σ²)), evaluated in log space
(:func:`dpsgd.accountant.rdp.log_a`). E1 = B_{λ+1} ≤ A_{λ+1} = E2 for every integer λ ≥ 1
(MTZ 2019, §3.3), so α(λ) = log E2; the test suite checks both E1 and E2 against a 50-digit mpmath
integration. In RDP terms α(λ) = λ·R(λ + 1).

Composition (Theorem 2.1): log moments add over lots, including heterogeneous lots.
Tail bound (Theorem 2.2): δ = min_λ exp(α(λ) − λε), equivalently ε(δ) = min_λ (α(λ) + log(1/δ))/λ,
over the paper's λ = 1..32 (configurable); the minimising λ* is reported.
"""
from __future__ import annotations

import math
from functools import lru_cache

import numpy as np

from ._checks import check_delta, check_epsilon, check_orders, check_q, check_sigma, check_steps
from .rdp import log_a_unchecked

#: The paper's orders: λ = 1..32.
PAPER_LAMBDAS: tuple = tuple(range(1, 33))


@lru_cache(maxsize=256)
def log_moments_unchecked(q: float, sigma: float, lambdas: tuple) -> np.ndarray:
    """:func:`log_moments` for arguments already valid (a ledger's charged mechanisms), cached."""
    if q == 1.0:   # Gaussian mechanism: α(λ) = λ(λ+1)/(2σ²) exactly
        out = np.array([lam * (lam + 1) / (2.0 * sigma * sigma) for lam in lambdas], dtype=float)
    else:
        out = np.array([log_a_unchecked(q, sigma, lam + 1) for lam in lambdas], dtype=float)
    out.setflags(write=False)
    return out


def log_moments(q: float, sigma: float, lambdas=PAPER_LAMBDAS) -> np.ndarray:
    """Per-lot log moments α(λ) of the sampled Gaussian mechanism (Abadi et al. 2016, §3.2).

    Integer λ >= 1 only (the paper's closed form); cached per (q, σ, λs).
    """
    q, sigma = check_q(q), check_sigma(sigma)
    lambdas = check_orders(lambdas, "lambdas", minimum=0.0, integer=True)
    return log_moments_unchecked(q, sigma, lambdas)


def epsilon_from_log_moments(total_log_moments, delta: float, lambdas=PAPER_LAMBDAS):
    """(ε, λ*) = min_λ (α(λ) + log(1/δ)) / λ (Abadi et al. 2016, Theorem 2.2)."""
    delta = check_delta(delta)
    lam = np.asarray(check_orders(lambdas, "lambdas", minimum=0.0, integer=True), dtype=float)
    a = np.asarray(total_log_moments, dtype=float)
    if a.shape != lam.shape:
        raise ValueError(f"total_log_moments must have one value per lambda, got {a.shape} for {lam.shape}")
    return _epsilon_from_log_moments(a, lam, delta)


def _epsilon_from_log_moments(a: np.ndarray, lam: np.ndarray, delta: float):
    """The tail bound itself, arguments already validated (also the ledger's per-epoch fast path)."""
    eps = (a + math.log(1.0 / delta)) / lam
    i = int(np.argmin(eps))
    return float(eps[i]), int(lam[i])


def delta_from_log_moments(total_log_moments, epsilon: float, lambdas=PAPER_LAMBDAS):
    """(δ, λ*) = min_λ exp(α(λ) − λε) (Abadi et al. 2016, Theorem 2.2), capped at 1."""
    epsilon = check_epsilon(epsilon)
    lam = np.asarray(check_orders(lambdas, "lambdas", minimum=0.0, integer=True), dtype=float)
    a = np.asarray(total_log_moments, dtype=float)
    if a.shape != lam.shape:
        raise ValueError(f"total_log_moments must have one value per lambda, got {a.shape} for {lam.shape}")
    log_d = a - lam * epsilon
    i = int(np.argmin(log_d))
    return float(math.exp(min(0.0, log_d[i]))), int(lam[i])


def epsilon(q: float, sigma: float, steps: int, delta: float, lambdas=PAPER_LAMBDAS):
    """(ε, λ*) after ``steps`` lots at (q, σ): the paper's moments accountant."""
    steps, delta = check_steps(steps), check_delta(delta)
    return epsilon_from_log_moments(steps * log_moments(q, sigma, lambdas), delta, lambdas)


def delta(q: float, sigma: float, steps: int, epsilon: float, lambdas=PAPER_LAMBDAS):
    """(δ, λ*) after ``steps`` lots at (q, σ) for a given ε: the paper's moments accountant."""
    steps, epsilon = check_steps(steps), check_epsilon(epsilon)
    return delta_from_log_moments(steps * log_moments(q, sigma, lambdas), epsilon, lambdas)
