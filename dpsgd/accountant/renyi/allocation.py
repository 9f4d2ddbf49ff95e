"""Random allocation (balls-in-bins) of the Gaussian mechanism: its RDP per epoch, both directions.

One epoch = t lots; each example is placed in exactly one lot, chosen uniformly at random
(Feldman & Shenfeld 2025, "Privacy amplification by random allocation", arXiv 2502.08202; Chua et
al. 2025's balls-and-bins sampling). For one example the epoch is the pair
P = (1/t) Σ_i N(e_i, σ² I_t) (with the example) against Q = N(0, σ² I_t) (without it).

* Remove direction: exact at integer α (their Sec. 6, "direct" RDP), by repeated squaring of a
  truncated power series in log space (every coefficient positive: no cancellation).
* Add direction: exact up to a stated quadrature margin, by one-dimensional integrals (a
  Gamma-function identity); every order charges min(exact + margin, AM–GM), both upper bounds
  (the AM–GM bound is :func:`rdp_add_amgm`).

Add/remove adjacency: R(α) = max(R_remove(α), R_add(α)) per epoch; E epochs compose by adding RDP;
a partial last epoch is charged as a full one. (ε, δ) by
:func:`dpsgd.accountant.rdp.rdp_to_epsilon`.

Details (the formulas, the quadrature and its margin): docs/ACCOUNTING.md,
"dpsgd/accountant/renyi/allocation.py".
"""

from __future__ import annotations

import math
from functools import lru_cache

import numpy as np
from scipy import special

from ..limits import check_delta, check_sigma, check_steps
from .rdp import rdp_to_epsilon

#: Integer orders (the remove-direction formula is exact at integer α only).
ORDERS: tuple = tuple(float(a) for a in range(2, 65)) + (80.0, 96.0, 128.0)


def _log_mul(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """Log coefficients of (A·B) truncated to degree len(a) − 1; a, b are log coefficients."""
    n = len(a)
    k = np.arange(n)
    idx = k[:, None] - k[None, :]  # [deg, k] -> deg − k
    terms = np.where(idx >= 0, a[None, :] + b[np.clip(idx, 0, None)], -np.inf)
    return special.logsumexp(terms, axis=1)


def _log_coef_power(log_f: np.ndarray, t: int) -> float:
    """log [z^α] f(z)^t, α = len(log_f) − 1, by repeated squaring (all coefficients positive)."""
    result = np.full(len(log_f), -np.inf)
    result[0] = 0.0  # the polynomial 1
    base = log_f
    while t:
        if t & 1:
            result = _log_mul(result, base)
        t >>= 1
        if t:
            base = _log_mul(base, base)
    return float(result[-1])


def rdp_remove(alpha: int, sigma: float, t: int) -> float:
    """Exact R_remove(α) of one epoch of t lots (module doc; Feldman & Shenfeld 2025, Sec. 6)."""
    if int(alpha) != alpha or alpha < 2:
        raise ValueError(f"alpha must be an integer >= 2, got {alpha!r}")
    alpha, sigma, t = int(alpha), check_sigma(sigma), check_steps(t)
    j = np.arange(alpha + 1, dtype=float)
    log_f = j * j / (2.0 * sigma * sigma) - special.gammaln(j + 1.0)
    terms = (
        special.gammaln(alpha + 1.0),
        _log_coef_power(log_f, t),
        -alpha * math.log(t),
        -alpha / (2.0 * sigma * sigma),
    )
    # round-off, charged upward so the value is never below the exact one (3.1e-12 below the closed
    # form at α = 2, σ = 4, t = 100 without it): the sum of 4 terms (n·eps·Σ|x|, Higham 2002 §4.2)
    # and the coefficient's ~2α·log2(t) positive log-space operations (n·eps relative each)
    eps = np.finfo(float).eps
    coef = abs(terms[1]) + abs(terms[2])
    n_ops = 2 * alpha * (math.ceil(math.log2(t)) + 1)
    margin = len(terms) * eps * sum(abs(x) for x in terms) + n_ops * eps * coef
    return max(0.0, (sum(terms) + margin) / (alpha - 1))


def rdp_add_amgm(alpha: float, sigma: float, t: int) -> float:
    """Upper bound on R_add(α) by AM–GM: α/(2tσ²) + (1 − 1/t)/(2σ²) (module doc)."""
    sigma, t = check_sigma(sigma), check_steps(t)
    return alpha / (2.0 * t * sigma * sigma) + (1.0 - 1.0 / t) / (2.0 * sigma * sigma)


#: Below this σ the add direction keeps the AM–GM bound (the quadrature's grids are sized for
#: σ >= it).
SIGMA_EXACT = 0.3
_Z_HALF = 12.0  # inner integral: z* ± 12 (curvature >= 1: the rest is below e^{−72})
_V_LO, _V_SPAN, _DV = -40.0, 40.0, 0.02  # outer integral: v = log s on [−40, log t + 40], step 0.02
_DECAYED = -60.0  # the outer integrand at the grid's end must be below e^{−60} × its maximum


def _log_phi(u: np.ndarray, sigma: float) -> np.ndarray:
    """log φ(u) = log E[exp(−u e^{Z/σ})], Z ~ N(0, 1), for an array u > 0 (module doc)."""
    w = np.real(special.lambertw(u / (sigma * sigma)))
    z_star = -sigma * w  # maximum of −u e^{z/σ} − z²/2
    d = min(
        0.05, sigma / 6.0, 0.3 / math.sqrt(float(w.max()) + 1.0)
    )  # a third of the narrowest scale
    xi = np.arange(-_Z_HALF, _Z_HALF + d / 2, d)
    out = np.empty(u.size)
    for a in range(0, u.size, 1024):
        z = z_star[a : a + 1024, None] + xi[None, :]
        out[a : a + 1024] = special.logsumexp(
            -u[a : a + 1024, None] * np.exp(z / sigma) - 0.5 * z * z, axis=1
        )
    return out + math.log(d) - 0.5 * math.log(2.0 * math.pi)


@lru_cache(maxsize=64)
def _outer(sigma: float, t: int):
    """(v grid, t·log φ(e^v/t)) of the outer integral, one per (σ, t) for every order."""
    v = np.arange(_V_LO, math.log(t) + _V_SPAN, _DV)
    return v, t * _log_phi(np.exp(v) / t, sigma)


def log_neg_moment(k: float, sigma: float, t: int):
    """(log E[M^{−k}], margin) with M = (1/t) Σ_i e^{Z_i/σ} (module doc), or None where the
    quadrature does not resolve it (σ < SIGMA_EXACT, or the integrand not decayed at the grid's
    end)."""
    sigma, t = check_sigma(sigma), check_steps(t)
    if sigma < SIGMA_EXACT or not k > 0:
        return None
    v, tl = _outer(sigma, t)
    g = k * v + tl
    if g[-1] - g.max() > _DECAYED or g[-1] >= g[-2]:
        return None
    fine = special.logsumexp(g) + math.log(_DV)
    coarse = special.logsumexp(g[::2]) + math.log(2.0 * _DV)
    left = k * _V_LO - math.log(k)  # ∫_{−∞}^{−40} e^{kv} φ^t dv <= e^{−40k}/k
    value = float(np.logaddexp(fine, left)) - float(special.gammaln(k))
    return value, 10.0 * abs(fine - coarse) + (t + 1) * 1e-12


def rdp_add(alpha: float, sigma: float, t: int) -> float:
    """R_add(α) of one epoch of t lots: min(exact + quadrature margin, AM–GM) (module doc)."""
    sigma, t = check_sigma(sigma), check_steps(t)
    amgm = rdp_add_amgm(alpha, sigma, t)
    k = float(alpha) - 1.0
    res = log_neg_moment(k, sigma, t)
    if res is None:
        return amgm
    value, margin = res
    return min(amgm, max(0.0, 1.0 / (2.0 * sigma * sigma) + (value + margin) / k))


@lru_cache(maxsize=256)
def rdp_curve(sigma: float, t: int, orders: tuple = ORDERS) -> np.ndarray:
    """Per-epoch add/remove RDP max(R_remove, R_add) at each integer order (remembered per
    (σ, t, orders): the ledger's budget searches ask for the same curve many times)."""
    out = np.array([max(rdp_remove(a, sigma, t), rdp_add(a, sigma, t)) for a in orders])
    out.setflags(write=False)
    return out


def epochs_for(lots: int, t: int) -> int:
    """Epochs charged for ``lots`` lots of t per epoch:
    a partial last epoch counts as a full one."""
    return -(-check_steps(lots) // check_steps(t))


def epsilon(sigma: float, t: int, epochs: int, delta: float, orders: tuple = ORDERS):
    """(ε, α*) after ``epochs`` epochs of t lots each, add/remove adjacency."""
    delta, epochs = check_delta(delta), check_steps(epochs)
    return rdp_to_epsilon(orders, epochs * rdp_curve(sigma, t, orders), delta)
