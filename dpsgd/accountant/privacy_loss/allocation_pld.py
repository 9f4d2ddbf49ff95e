"""Random allocation (balls-in-bins) of the Gaussian mechanism: one epoch's PLD, both directions.

One epoch = t lots; every example joins exactly one of them, uniformly at random. For one example
the epoch is the dominating pair P = (1/t) Σ_j N(e_j, σ² I_t) (with it) against Q = N(0, σ² I_t)
(without it) (Feldman & Shenfeld 2025, arXiv 2502.08202, Thm. 3.1; tight PLD bounds for it:
Feldman & Shenfeld 2026, arXiv 2602.17284). With Y_j = exp(Z_j/σ − 1/(2σ²)), Z_j ~ N(0, 1), the
loss is ℓ = log(S/t), S = Σ_j Y_j, and under P one term is Y' = exp(Z/σ + 1/(2σ²)) instead:

* remove: ℓ = log(S'/t) under P, S' = Y' + Σ_{j<t} Y_j; each term rounded *up* to the grid g·ℕ;
* add: ℓ = −log(S/t) under Q, S = Σ_{j<=t} Y_j; each term rounded *down* to g·ℕ.

Both roundings move every loss up (a coupling: the composed δ(ε) can only grow). The sum is one FFT
power on a Chernoff window (the mass beyond it is added to δ, the mass on its other side aliases
the safe way); each atom of S is then split between its two neighbouring loss-grid points keeping
its P- and Q-mass ("connect the dots", Doroshenko et al. 2022: a dominating pair). Epochs compose
with the run's other releases in ``truncated.epsilon_for_releases`` (release ("allocation", t, σ)).

Details (the error of g, the windows, the check against PLD_accounting): docs/ACCOUNTING.md,
"dpsgd/accountant/privacy_loss/allocation_pld.py".
"""

from __future__ import annotations

import math
from functools import lru_cache

import numpy as np
from scipy import fft as sfft
from scipy import special

from ..limits import check_sigma

TERM_TAIL = 1e-15  # P-mass of one term beyond its grid (remove: into the ∞ atom; add: moved down)
SUM_TAIL = 1e-15  # Chernoff bound on the mass of S beyond its FFT window (into the ∞ atom)
ADD_FLOOR = -6.0  # add: a term >= t·e^6 is rounded down to t·e^6 (the epoch's ℓ stays <= −6)
SUM_POINTS = 1 << 23  # FFT window of S: g is chosen so that the window fits
# the finest grid used, 2^4·1e-6: each epoch's loss moves by at most ≈ 1.6e-5 (E[Y] = 1), a window of
# S wider than needed costs time only
G_FINE = 4
# a coarser grid could move each term by more than 5 % of its mean (E[Y] = 1): refused, RDP serves
# (small σ: the terms' lognormal tails need a window too wide for a finer grid)
G_MAX = 0.05
_THETA = np.concatenate([-np.logspace(-3, 3, 40)[::-1], np.logspace(-3, 3, 40)])


def _top(a: float, shift: float, t: int, up: bool) -> float:
    """The top of a term's grid: its 1 − TERM_TAIL quantile; rounding down (add), at most t·e^{−
    ADD_FLOOR}: a term that large keeps S >= that, ℓ = −log(S/t) <= ADD_FLOOR < 0 (moving ℓ up
    only)."""
    top = math.exp(shift + a * float(-special.ndtri(TERM_TAIL)))
    return top if up else min(top, t * math.exp(-ADD_FLOOR))


def _term(a: float, shift: float, g: float, up: bool, t: int):
    """(k_lo, pmf over Y = k·g, mass beyond the top) of Y = exp(aZ + shift), rounded up (``up``)
    or down to the grid g·ℕ (the top: :func:`_top`)."""
    lo = math.exp(shift - a * float(-special.ndtri(TERM_TAIL)))
    hi = _top(a, shift, t, up)
    k_lo, k_hi = (math.floor(lo / g), math.ceil(hi / g)) if up else (0, math.floor(hi / g))
    edges = np.arange(k_lo, k_hi + 1) * g  # ceil: (k−1)g < Y <= kg → k; floor: kg <= Y < (k+1)g
    with np.errstate(divide="ignore"):
        x = (np.log(edges) - shift) / a
    below, above = special.ndtr(x), special.ndtr(-x)  # P(Y <= edge), P(Y > edge)
    # the mass between neighbouring edges from the side whose tail is small (no cancellation)
    between = np.where(x[1:] <= 0, below[1:] - below[:-1], above[:-1] - above[1:])
    if up:  # Y <= k_lo·g goes to k_lo (up); mass above k_hi·g: beyond
        return k_lo, np.concatenate([below[:1], between]), float(above[-1])
    # Y >= k_hi·g is moved down to k_hi: nothing beyond
    return 0, np.concatenate([between, above[-1:]]), 0.0


def _log_mgf(k_lo: int, pmf: np.ndarray, g: float, block: int = 64) -> np.ndarray:
    """An upper bound on log E[e^{θY}] at each θ of _THETA (a Chernoff bound stays valid): the
    masses of each block of ``block`` grid points summed at the block's top (θ > 0) or bottom."""
    n = -(-pmf.size // block)
    mass = np.bincount(np.arange(pmf.size) // block, weights=pmf, minlength=n)
    nz = mass > 0
    bottom = (k_lo + np.flatnonzero(nz) * block) * g
    lp = np.log(mass[nz])
    v = np.where(_THETA[:, None] > 0, bottom[None, :] + (block - 1) * g, bottom[None, :])
    return special.logsumexp(lp[None, :] + _THETA[:, None] * v, axis=1)


def _signed(terms, sign: int):
    """(k_lo, pmf, count) of sign·Y for each (k_lo, pmf, beyond, count) term."""
    if sign > 0:
        return [(k, p, n) for k, p, _, n in terms]
    return [(-(k + p.size - 1), p[::-1], n) for k, p, _, n in terms]


def _window(signed, g: float):
    """Chernoff window [a, b] (grid indices) holding all but SUM_TAIL of the sum, and Λ(θ)."""
    lam = sum(n * _log_mgf(k, p, g) for k, p, n in signed)
    pos, neg, log_tau = _THETA > 0, _THETA < 0, math.log(SUM_TAIL)
    a = math.floor(float(np.max((lam[neg] - log_tau) / _THETA[neg])) / g)
    b = math.ceil(float(np.min((lam[pos] - log_tau) / _THETA[pos])) / g)
    return a, b, lam


def _sum(signed, g: float, window):
    """Distribution of Σ (count copies of each signed term) on the grid g over its ``window``
    (``_window``): (k_lo, pmf, Chernoff bound on the mass beyond the window's top, which wrapped
    below it). Mass below the window wraps upwards (the safe way)."""
    a, b, lam = window
    m = max(1 << 10, 1 << (b - a).bit_length())
    spec = np.ones(m // 2 + 1, dtype=complex)
    for k, p, n in signed:
        spec *= sfft.rfft(np.bincount((k + np.arange(p.size)) % m, weights=p, minlength=m)) ** n
    c = np.maximum(np.roll(sfft.irfft(spec, n=m), -(a % m)), 0.0)
    pos = _THETA > 0
    above = float(min(1.0, np.exp(np.min(lam[pos] - _THETA[pos] * (a + m) * g))))
    return a, c, above


def _terms(t: int, sigma: float, g: float, direction: str):
    """The signed terms of S (remove: Y' once and Y t − 1 times, rounded up; add: −Y t times,
    Y rounded down) and the mass beyond their tops (remove: into the ∞ atom)."""
    a = 1.0 / sigma
    if direction == "remove":
        y1, y = _term(a, a * a / 2.0, g, True, t), _term(a, -a * a / 2.0, g, True, t)
        beyond = -math.expm1(math.log1p(-y1[2]) + (t - 1) * math.log1p(-y[2]))
        return _signed([(*y1, 1)] + ([(*y, t - 1)] if t > 1 else []), 1), beyond
    return _signed([(*_term(a, -a * a / 2.0, g, False, t), t)], -1), 0.0


def _fitted(t: int, sigma: float, direction: str):
    """(g, signed terms, mass beyond their tops, window of S): the grid g of Y is the smallest
    2^k·1e-6, k >= G_FINE, whose window of S fits SUM_POINTS (its width read off a coarse grid
    first, so that no term is built oversized); the terms and window are those at g."""
    a = 1.0 / sigma
    top = _top(a, a * a / 2.0, t, direction == "remove")
    coarse = 1e-6 * 2.0 ** max(0, math.ceil(math.log2(top / 1e-6 / (1 << 14))))
    lo, hi, _ = _window(_terms(t, sigma, coarse, direction)[0], coarse)
    width = (hi - lo + 1) * coarse * 1.25  # the finer grid's window: a little wider at most
    g = 1e-6 * 2.0 ** max(G_FINE, math.ceil(math.log2(width / SUM_POINTS / 1e-6)))
    while True:
        signed, beyond = _terms(t, sigma, g, direction)
        window = _window(signed, g)
        if window[1] - window[0] + 1 <= SUM_POINTS:
            return g, signed, beyond, window
        g *= 2.0


@lru_cache(maxsize=64)
def _grid_for(t: int, sigma: float, direction: str) -> float:
    """The grid g of Y at (t, σ) (``_fitted``): the rounding each term carries."""
    return _fitted(t, sigma, direction)[0]


def _dots(loss: np.ndarray, mass: np.ndarray, h: float):
    """Connect the dots: each atom (ℓ, p) split between ε_i = ⌊ℓ/h⌋h and ε_{i+1}, keeping its
    P-mass p and its Q-mass p·e^{−ℓ} (a dominating pair). Returns (i_lo, pmf)."""
    i = np.floor(loss / h).astype(np.int64)
    lo = i * h
    # share of the upper point: (e^{−ℓ} − e^{−ε_i}) / (e^{−ε_{i+1}} − e^{−ε_i}), in [0, 1]
    up = np.clip(-np.expm1(lo - loss) / -np.expm1(-h), 0.0, 1.0)
    i_lo = int(i.min())
    pmf = np.bincount(i - i_lo, weights=mass * (1.0 - up), minlength=int(i.max() - i_lo) + 2)
    pmf += np.bincount(i - i_lo + 1, weights=mass * up, minlength=pmf.size)
    return i_lo, pmf


@lru_cache(maxsize=32)
def epoch_pmf(t: int, sigma: float, h: float, direction: str):
    """(i_lo, pmf over ε_i = i·h, p_inf) of one epoch of random allocation over t lots at σ,
    ``direction`` "remove" or "add" (module doc)."""
    sigma = check_sigma(sigma)
    if int(t) != t or t < 1:
        raise ValueError(f"allocation needs t >= 1 lots per epoch, got t={t!r}")
    g, signed, beyond, window = _fitted(int(t), sigma, direction)
    if g > G_MAX:
        raise ValueError(
            f"allocation PLD: sigma={sigma:g} too small for its grid (g={g:.3g} > {G_MAX}); "
            "the rdp accountant serves it"
        )
    k_lo, c, above = _sum(signed, g, window)
    beyond += above
    s = (k_lo + np.arange(c.size)) * g * (1 if direction == "remove" else -1)
    keep = (c > 0) & (s > 0)  # S = 0 (add, every term rounded to 0): ℓ = ∞
    p_inf = beyond + float(c[~keep & (c > 0)].sum())
    sign = 1.0 if direction == "remove" else -1.0
    loss = sign * (np.log(s[keep]) - math.log(t))
    i_lo, pmf = _dots(loss, c[keep], h)
    pmf.setflags(write=False)
    return i_lo, pmf, min(1.0, p_inf)
