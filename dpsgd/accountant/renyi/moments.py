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

from ..limits import check_delta, check_epsilon, check_orders, check_q, check_sigma, check_steps
from .rdp import log_a_unchecked

#: The paper's orders: λ = 1..32.
PAPER_LAMBDAS: tuple = tuple(range(1, 33))


@lru_cache(maxsize=256)
def log_moments_unchecked(q: float, sigma: float, lambdas: tuple) -> np.ndarray:
    """:func:`log_moments` for arguments already valid (a ledger's charged mechanisms), cached."""
    if q == 1.0:  # Gaussian mechanism: α(λ) = λ(λ+1)/(2σ²) exactly
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
        raise ValueError(
            f"total_log_moments must have one value per lambda, got {a.shape} for {lam.shape}"
        )
    return _epsilon_from_log_moments(a, lam, delta)


def _epsilon_from_log_moments(a: np.ndarray, lam: np.ndarray, delta: float):
    """The tail bound itself, arguments already validated
    (also the ledger's per-epoch fast path)."""
    eps = (a + math.log(1.0 / delta)) / lam
    i = int(np.argmin(eps))
    return float(eps[i]), int(lam[i])


def delta_from_log_moments(total_log_moments, epsilon: float, lambdas=PAPER_LAMBDAS):
    """(δ, λ*) = min_λ exp(α(λ) − λε) (Abadi et al. 2016, Theorem 2.2), capped at 1."""
    epsilon = check_epsilon(epsilon)
    lam = np.asarray(check_orders(lambdas, "lambdas", minimum=0.0, integer=True), dtype=float)
    a = np.asarray(total_log_moments, dtype=float)
    if a.shape != lam.shape:
        raise ValueError(
            f"total_log_moments must have one value per lambda, got {a.shape} for {lam.shape}"
        )
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


# ----------------------------------------------------------------------------------------------
# The paper's analytic results, for reference (the accountant above uses the exact moments).


def lemma3_applies(q: float, sigma: float, lam: int) -> bool:
    """Whether Lemma 3 of Abadi et al. 2016 covers (q, σ, λ): σ >= 1, q < 1/(16σ), and λ a positive
    integer with λ <= σ² ln(1/(qσ)).

    The paper's large-noise MNIST setting (σ = 8, q = 0.01) lies outside it (1/(16σ) = 0.0078 < q);
    that does not matter here, since the accountant uses the exact log moments, not the lemma.
    """
    q, sigma = check_q(q), check_sigma(sigma)
    return (
        sigma >= 1.0
        and q < 1.0 / (16.0 * sigma)
        and float(lam).is_integer()
        and lam >= 1
        and lam <= sigma * sigma * math.log(1.0 / (q * sigma))
    )


def lemma3_bound(q: float, sigma: float, lam: int) -> float:
    """Lemma 3 (Abadi et al. 2016), log-moment bound of one lot of the sampled Gaussian mechanism:

        α(λ) <= q² λ (λ + 1) / ((1 − q) σ²) + O(q³ λ³ / σ³),

    returned without the O(q³λ³/σ³) remainder (the lemma does not state its constant); ValueError
    outside the lemma's conditions (:func:`lemma3_applies`). Inside them the exact α(λ) of
    :func:`log_moments` stays below this leading term alone (tested on a grid).
    """
    if not lemma3_applies(q, sigma, lam):
        raise ValueError(
            f"Lemma 3 needs sigma >= 1, q < 1/(16 sigma) and integer 1 <= lambda <= "
            f"sigma^2 ln(1/(q sigma)); got q={q!r}, sigma={sigma!r}, lambda={lam!r}"
        )
    return q * q * lam * (lam + 1) / ((1.0 - q) * sigma * sigma)


def theorem1_scale(q: float, sigma: float, steps: int, delta: float) -> float:
    """Theorem 1 (Abadi et al. 2016): there are constants c1, c2 such that for ε < c1 q² T,
    Algorithm 1 is (ε, δ)-DP when σ >= c2 q √(T log(1/δ)) / ε. Read for ε at a given σ:

        ε = c2 · q √(T log(1/δ)) / σ,

    this returns q √(T log(1/δ)) / σ, the ε of T lots up to the constant c2. The exact accountant's
    ε divided by it stays within a narrow band (1.4–1.8 on the tested grid) wherever ε is above the
    λ <= 32 floor log(1/δ)/32: ε scales like q√T/σ.
    """
    q, sigma, steps, delta = check_q(q), check_sigma(sigma), check_steps(steps), check_delta(delta)
    return q * math.sqrt(steps * math.log(1.0 / delta)) / sigma
