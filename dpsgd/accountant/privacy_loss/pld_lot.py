"""One lot's PLD: the Poisson-subsampled Gaussian, discretised pessimistically.

The loss L(z) of one lot (q, σ) in each direction (remove, add) is defined in
``dpsgd/accountant/privacy_loss/pld.py``; this module discretises it, one lot at a time
(``_step_pmf``); ``pld_fft.py`` composes the lots.

Discretisation ("connect the dots", Doroshenko, Ghazi, Kamath, Kumar & Manurangsi 2022, PETS):
on the grid ε_i = i·h the per-lot PLD is replaced by the discrete PLD whose privacy profile
linearly interpolates the exact one in x = e^ε, a *pessimistic* (dominating) pair with O(h²)
error per lot, from exact Gaussian interval masses (in log space where they would overflow or
underflow). Mass beyond the largest grid loss goes to an "infinite loss" atom (added to δ). The
per-lot pmf also carries its log moment generating function Λ(t) on the grid _T_GRID, for the
Chernoff windows of the composition.

Details (the interval masses, log space, tiny σ and tiny δ): docs/ACCOUNTING.md,
"dpsgd/accountant/privacy_loss/pld_lot.py".
"""

from __future__ import annotations

import math
from functools import lru_cache

import numpy as np
from scipy import special

STEP_POINTS = 1 << 19  # largest per-lot grid before h is doubled (tiny σ)
STEP_TAIL = 1e-22  # per-lot P-mass left outside the per-lot grid (into the ∞ atom)
TAIL_FRACTION = 1e-3  # tiny δ: share of δ allowed to each tail budget
_LOG_EXP_MAX = 700.0  # above this loss, e^ε·Q is formed in log space
_Q_NORMAL = 1e-280  # interval Q-masses below this: e^ε·Q in log space (near subnormal)
_T_GRID = np.concatenate([-np.logspace(-3, 2.5, 22)[::-1], np.logspace(-3, 2.5, 34)])


@lru_cache(maxsize=64)
def _z_tail(step_tail: float) -> float:
    return float(-special.ndtri(step_tail))


def _step_tail(delta: float, lots: int) -> float:
    """Per-lot tail mass of the tilted path: a power of ten <= TAIL_FRACTION·δ / lots and
    below STEP_TAIL (so that the tail also marks the tiny-δ pmfs and compositions:
    :func:`_tiny`)."""
    v = TAIL_FRACTION * delta / max(1, lots)
    return max(1e-300, min(STEP_TAIL / 10.0, 10.0 ** math.floor(math.log10(v))))


def _tiny(z_tail: float) -> bool:
    """Tiny-δ path (exact interval excess, support truncation): marked by its smaller tail."""
    return z_tail != _z_tail(STEP_TAIL)


def _gauss_mass(a, b, mean, sigma):
    """P(a < Z <= b) for Z ~ N(mean, σ²), accurate in both tails (a <= b elementwise)."""
    x, y = (a - mean) / sigma, (b - mean) / sigma
    upper = special.ndtr(-x) - special.ndtr(-y)
    lower = special.ndtr(y) - special.ndtr(x)
    return np.where(x > 0, upper, lower)


def _log_gauss_mass(a, b, mean, sigma):
    """log P(a < Z <= b) for Z ~ N(mean, σ²), no underflow (log-Φ differences)."""
    x, y = (np.asarray(a, float) - mean) / sigma, (np.asarray(b, float) - mean) / sigma
    with np.errstate(divide="ignore", invalid="ignore"):
        ux, uy = special.log_ndtr(-x), special.log_ndtr(-y)  # log Φ(−x) >= log Φ(−y)
        upper = ux + np.log(-np.expm1(uy - ux))
        lx, ly = special.log_ndtr(x), special.log_ndtr(y)
        lower = ly + np.log(-np.expm1(lx - ly))
    out = np.where(x > 0, upper, lower)
    return np.where(np.isnan(out), -np.inf, out)  # empty interval


def _z_of_loss(eps, q, sigma):
    """Threshold z(ε) with L_remove(z) > ε ⇔ z > z(ε); −∞ where ε <= log(1 − q)."""
    eps = np.asarray(eps, dtype=float)
    with np.errstate(divide="ignore", invalid="ignore", over="ignore"):
        if q == 1.0:  # log(e^ε − 0) = ε exactly
            log_arg, ok = eps, np.isfinite(eps)
        elif q >= 0.5:
            # log(e^ε − r), r = 1 − q: log r + log(expm1(ε − log r)), no cancellation when e^ε ≪ 1
            lr = math.log1p(-q)
            d = eps - lr
            log_arg = np.where(
                d > _LOG_EXP_MAX, eps, lr + np.log(np.expm1(np.minimum(d, _LOG_EXP_MAX)))
            )
            ok = d > 0
        else:
            arg = np.expm1(np.minimum(eps, _LOG_EXP_MAX)) + q  # e^ε − (1 − q)
            # for ε > 700, log(e^ε − (1 − q)) = ε to double precision (relative correction < e^−700)
            log_arg = np.where(eps > _LOG_EXP_MAX, eps, np.log(arg))
            ok = arg > 0
        z = sigma * sigma * (log_arg - math.log(q)) + 0.5
    return np.where(ok, z, -np.inf)


def _loss_remove(z, q, sigma):
    return np.logaddexp(
        math.log1p(-q) if q < 1 else -np.inf, math.log(q) + (2.0 * z - 1.0) / (2.0 * sigma * sigma)
    )


def _mix_mass(a, b, q, sigma):
    return (1.0 - q) * _gauss_mass(a, b, 0.0, sigma) + q * _gauss_mass(a, b, 1.0, sigma)


def _log_mix_mass(a, b, q, sigma):
    l0 = _log_gauss_mass(a, b, 0.0, sigma) + (math.log1p(-q) if q < 1 else -np.inf)
    return np.logaddexp(l0, _log_gauss_mass(a, b, 1.0, sigma) + math.log(q))


def _loss_range(q: float, sigma: float, direction: str, z_tail: float):
    """Smallest and largest loss kept on one lot's grid (beyond: P-mass <= the per-lot tail)."""
    if direction == "remove":
        lo = math.log1p(-q) if q < 1 else float(_loss_remove(1.0 - z_tail * sigma, q, sigma))
        hi = float(_loss_remove(1.0 + z_tail * sigma, q, sigma))
    else:
        lo = -float(_loss_remove(z_tail * sigma, q, sigma))
        hi = -math.log1p(-q) if q < 1 else -float(_loss_remove(-z_tail * sigma, q, sigma))
    return lo, hi


@lru_cache(maxsize=64)
def _step_pmf(q: float, sigma: float, h: float, direction: str, z_tail: float = _z_tail(STEP_TAIL)):
    """Connect-the-dots discrete PLD of one lot: (i_lo, probs over ε_i = i·h, p_inf, lambda(t))."""
    lo, hi = _loss_range(q, sigma, direction, z_tail)
    i_lo, i_hi = math.floor(lo / h), math.ceil(hi / h)
    i_hi = max(i_hi, i_lo + 1)
    eps = np.arange(i_lo, i_hi + 1) * h  # grid ε_0..ε_n
    if direction == "remove":
        t = _z_of_loss(eps, q, sigma)  # L > ε ⇔ z > t (t increasing)
        a, b = t[:-1], t[1:]  # interval (ε_i, ε_{i+1}] ⇔ z ∈ (t_i, t_{i+1}]
        p_int, q_int = _mix_mass(a, b, q, sigma), _gauss_mass(a, b, 0.0, sigma)
        p_below = float(_mix_mass(-np.inf, t[0], q, sigma))
        p_above = float(_mix_mass(t[-1], np.inf, q, sigma))
        q_above = float(_gauss_mass(t[-1], np.inf, 0.0, sigma))
        log_q = lambda lo_, hi_: _log_gauss_mass(lo_, hi_, 0.0, sigma)
    else:
        # L_add(z) = −L_remove(z) > ε ⇔ z < t = z(−ε) (t decreasing in ε); for ε >= −log(1−q)
        # no z has L > ε (threshold −∞)
        t = np.where(
            eps >= (-math.log1p(-q) if q < 1 else np.inf), -np.inf, _z_of_loss(-eps, q, sigma)
        )
        a, b = t[1:], t[:-1]  # interval (ε_i, ε_{i+1}] ⇔ z ∈ [t_{i+1}, t_i)
        p_int, q_int = _gauss_mass(a, b, 0.0, sigma), _mix_mass(a, b, q, sigma)
        p_below = float(_gauss_mass(t[0], np.inf, 0.0, sigma))
        p_above = float(_gauss_mass(-np.inf, t[-1], 0.0, sigma))
        q_above = float(_mix_mass(-np.inf, t[-1], q, sigma))
        log_q = lambda lo_, hi_: _log_mix_mass(lo_, hi_, q, sigma)
    em1 = math.expm1(h)
    top = (t[-1], np.inf) if direction == "remove" else (-np.inf, t[-1])
    # Q(I) below _Q_NORMAL (near or in the subnormal range, or underflowed to 0) has lost its
    # relative precision while x_i Q(I) ≈ P(I) may still matter (x_i up to e^700): there, and
    # wherever e^ε overflows, x_i Q(I_i) is formed in log space
    sub = (q_int < _Q_NORMAL) & (p_int > 0)
    if eps[-1] <= _LOG_EXP_MAX:
        x = np.exp(eps)
        B = x[:-1] * q_int  # x_i Q(I_i)
        if sub.any():
            B[sub] = np.exp(eps[:-1][sub] + log_q(a[sub], b[sub]))
        xq_above = x[-1] * q_above if q_above >= _Q_NORMAL else float(np.exp(eps[-1] + log_q(*top)))
    else:  # e^ε overflows: x_i Q(I_i) in log space
        B = np.exp(eps[:-1] + log_q(a, b))
        xq_above = float(np.exp(eps[-1] + log_q(*top)))
    excess = p_int - B  # P(I_i) − x_i Q(I_i)
    if _tiny(z_tail) and eps[-1] <= _LOG_EXP_MAX:
        # tiny δ: the same difference without cancelling (1 − q)·G0 against x_i·G0, which loses
        # it entirely where q/σ is tiny (it is ~q/σ·G0, far below δ only for ordinary δ)
        g0, g1 = _gauss_mass(a, b, 0.0, sigma), _gauss_mass(a, b, 1.0, sigma)
        em = np.expm1(eps[:-1])
        exact = (
            q * (g1 - g0) - em * g0 if direction == "remove" else q * x[:-1] * (g0 - g1) - em * g0
        )
        excess = np.where(sub, excess, exact)  # (g0 imprecise where Q(I) is subnormal)
    D = np.clip(excess / em1, 0.0, B)  # share moved to the right end point
    probs = np.zeros(eps.size)
    probs[:-1] += B - D
    probs[1:] += math.exp(h) * D
    probs[0] += p_below
    probs[-1] += xq_above
    p_inf = max(0.0, p_above - xq_above)
    # log moment generating function Λ(t) = log Σ ω_i e^{t ε_i} of the finite part on a grid of t
    # (for the Chernoff windows); exact, since composition multiplies it by the number of lots
    nz = probs > 0
    lp, e = np.log(probs[nz]), eps[nz]
    lam = np.empty(_T_GRID.size)
    for k, tt in enumerate(_T_GRID):
        v = lp + tt * e
        mx = v.max()
        lam[k] = mx + math.log(np.exp(v - mx).sum())
    probs.setflags(write=False)
    return i_lo, probs, p_inf, lam


def _lot_interval(releases, direction, interval, z_tail):
    """h: ``interval`` doubled until every lot's grid has at most STEP_POINTS points."""
    h = interval
    for q, s, _ in releases:
        lo, hi = _loss_range(q, s, direction, z_tail)
        while (hi - lo) / h > STEP_POINTS:
            h *= 2.0
    return h
