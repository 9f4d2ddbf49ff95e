"""Tight accounting: the privacy loss distribution (PLD) of the Poisson-subsampled Gaussian.

Privacy loss of one lot (q, σ), add-or-remove adjacency (Koskela, Jälkö & Honkela 2020; Zhu, Dong &
Wang 2022), with μ0 = N(0, σ²), μ = (1 − q)·μ0 + q·N(1, σ²):

* remove: P = μ, Q = μ0,  L(z) = log(1 − q + q·exp((2z − 1)/(2σ²))) (increasing in z)
* add:    P = μ0, Q = μ,  L(z) = −log(1 − q + q·exp((2z − 1)/(2σ²))) (decreasing in z)

and δ(ε) = E_P[(1 − e^{ε − L})_+] (hockey-stick divergence); the composed guarantee is the
maximum over the two directions, each composed over all lots.

Discretisation ("connect the dots", Doroshenko, Ghazi, Kamath, Kumar & Manurangsi 2022, PETS):
on the grid ε_i = i·h the per-lot PLD is replaced by the discrete PLD whose privacy profile, as a
function of x = e^ε, linearly interpolates the exact profile at the grid points. The exact profile
is convex in x, so the interpolation dominates it: the discrete PLD is a *pessimistic* (dominating)
pair and every ε reported is an upper bound, with O(h²) error per lot instead of the O(h) of
rounding losses up. The probabilities are computed from exact Gaussian interval masses
(interval (ε_i, ε_{i+1}]: its Q-mass is split between the two end points so that the P-mass is
preserved), all terms non-negative; mass beyond the largest grid loss goes to an "infinite loss"
atom (added to δ) and mass below the smallest is moved up to it (pessimistic).

Composition by FFT: the per-lot pmf is placed on a cyclic grid of M points (index k at k mod M);
its FFT is cached and T lots are F^T followed by one inverse FFT. The window [a, a + M) is chosen
from Chernoff bounds on the composed loss (with the discrete pmf's own moment generating
function, on a grid of t): the mass above the window, τ ≤ 1e-15 by construction, is added to δ;
mass below the window aliases into the window, where it can only be counted with a larger
weight, so aliasing never makes δ smaller. FFT round-off (~1e-16 relative) is clipped at zero and
not otherwise bounded. h starts at 1e-4 and doubles only when the window would need more than
2^18 points (nested grids: a coarser h can only increase ε), so ε is monotone in T (the exact
discrete PLD's δ(ε) cannot fall when a lot is added, since E[e^{−L}] <= 1 for each lot).
"""
from __future__ import annotations

import math
from functools import lru_cache

import numpy as np
from scipy import fft as sfft
from scipy import signal, special

from ._checks import check_delta, check_epsilon, check_q, check_sigma, check_steps

DEFAULT_INTERVAL = 1e-4          # h: spacing of the privacy-loss grid
MAX_POINTS = 1 << 18             # largest FFT grid before h is doubled
STEP_TAIL = 1e-22                # per-lot P-mass left outside the per-lot grid (into the ∞ atom)
WINDOW_TAIL = 1e-15              # Chernoff bound on the composed mass above the FFT window
_Z_TAIL = float(-special.ndtri(STEP_TAIL))
_T_GRID = np.concatenate([-np.logspace(-3, 2.5, 22)[::-1], np.logspace(-3, 2.5, 34)])
DIRECTIONS = ("remove", "add")


def _gauss_mass(a, b, mean, sigma):
    """P(a < Z <= b) for Z ~ N(mean, σ²), accurate in both tails (a <= b elementwise)."""
    x, y = (a - mean) / sigma, (b - mean) / sigma
    upper = special.ndtr(-x) - special.ndtr(-y)
    lower = special.ndtr(y) - special.ndtr(x)
    return np.where(x > 0, upper, lower)


def _z_of_loss(eps, q, sigma):
    """Threshold z(ε) with L_remove(z) > ε ⇔ z > z(ε); −∞ where ε <= log(1 − q)."""
    eps = np.asarray(eps, dtype=float)
    arg = np.expm1(np.minimum(eps, 700.0)) + q          # e^ε − (1 − q)
    with np.errstate(divide="ignore", invalid="ignore"):
        z = sigma * sigma * (np.log(arg) - math.log(q)) + 0.5
    return np.where(arg > 0, z, -np.inf)


def _loss_remove(z, q, sigma):
    return np.logaddexp(math.log1p(-q) if q < 1 else -np.inf, math.log(q) + (2.0 * z - 1.0) / (2.0 * sigma * sigma))


def _mix_mass(a, b, q, sigma):
    return (1.0 - q) * _gauss_mass(a, b, 0.0, sigma) + q * _gauss_mass(a, b, 1.0, sigma)


@lru_cache(maxsize=64)
def _step_pmf(q: float, sigma: float, h: float, direction: str):
    """Connect-the-dots discrete PLD of one lot: (i_lo, probs over ε_i = i·h, p_inf, lambda(t))."""
    if direction == "remove":
        lo = math.log1p(-q) if q < 1 else float(_loss_remove(1.0 - _Z_TAIL * sigma, q, sigma))
        hi = float(_loss_remove(1.0 + _Z_TAIL * sigma, q, sigma))
    else:
        lo = -float(_loss_remove(_Z_TAIL * sigma, q, sigma))
        hi = -math.log1p(-q) if q < 1 else -float(_loss_remove(-_Z_TAIL * sigma, q, sigma))
    i_lo, i_hi = math.floor(lo / h), math.ceil(hi / h)
    i_hi = max(i_hi, i_lo + 1)
    eps = np.arange(i_lo, i_hi + 1) * h                 # grid ε_0..ε_n
    if direction == "remove":
        t = _z_of_loss(eps, q, sigma)                   # L > ε ⇔ z > t (t increasing)
        a, b = t[:-1], t[1:]                            # interval (ε_i, ε_{i+1}] ⇔ z ∈ (t_i, t_{i+1}]
        p_int, q_int = _mix_mass(a, b, q, sigma), _gauss_mass(a, b, 0.0, sigma)
        p_below = float(_mix_mass(-np.inf, t[0], q, sigma))
        p_above = float(_mix_mass(t[-1], np.inf, q, sigma))
        q_above = float(_gauss_mass(t[-1], np.inf, 0.0, sigma))
    else:
        # L_add(z) = −L_remove(z) > ε ⇔ z < t = z(−ε) (t decreasing in ε); for ε >= −log(1−q)
        # no z has L > ε (threshold −∞)
        t = np.where(eps >= (-math.log1p(-q) if q < 1 else np.inf), -np.inf, _z_of_loss(-eps, q, sigma))
        a, b = t[1:], t[:-1]                            # interval (ε_i, ε_{i+1}] ⇔ z ∈ [t_{i+1}, t_i)
        p_int, q_int = _gauss_mass(a, b, 0.0, sigma), _mix_mass(a, b, q, sigma)
        p_below = float(_gauss_mass(t[0], np.inf, 0.0, sigma))
        p_above = float(_gauss_mass(-np.inf, t[-1], 0.0, sigma))
        q_above = float(_mix_mass(-np.inf, t[-1], q, sigma))
    x = np.exp(eps)
    em1 = math.expm1(h)
    B = x[:-1] * q_int                                   # x_i Q(I_i)
    D = np.clip((p_int - B) / em1, 0.0, B)               # share moved to the right end point
    probs = np.zeros(eps.size)
    probs[:-1] += B - D
    probs[1:] += math.exp(h) * D
    probs[0] += p_below
    probs[-1] += x[-1] * q_above
    p_inf = max(0.0, p_above - x[-1] * q_above)
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


@lru_cache(maxsize=48)
def _step_fft(q: float, sigma: float, h: float, direction: str, m: int):
    i_lo, probs, _, _ = _step_pmf(q, sigma, h, direction)
    idx = (i_lo + np.arange(probs.size)) % m
    grid = np.bincount(idx, weights=probs, minlength=m)
    f = sfft.rfft(grid)
    return np.log(np.abs(f)), np.angle(f)


def _window(releases, h, direction):
    """Chernoff window [a, b] (grid indices) holding all but WINDOW_TAIL of the composed mass."""
    lam = sum(n * _step_pmf(q, s, h, direction)[3] for q, s, n in releases)
    log_tau = math.log(WINDOW_TAIL)
    pos, neg = _T_GRID > 0, _T_GRID < 0
    b = float(np.min((lam[pos] - log_tau) / _T_GRID[pos]))
    a = float(np.max((lam[neg] - log_tau) / _T_GRID[neg]))
    return math.floor(a / h), max(math.ceil(b / h), 1), lam


def _plan(releases, direction, interval):
    h = interval
    while True:
        a, b, lam = _window(releases, h, direction)
        if b - a + 1 <= MAX_POINTS:
            m = max(1 << 10, 1 << (b - a).bit_length())
            return h, a, m, lam
        h *= 2.0


class _Composed:
    """Composed discrete PLD of one direction on the window [a, a + m) (grid spacing h)."""

    def __init__(self, releases, direction, interval):
        h, a, m, lam = _plan(releases, direction, interval)
        logmag = np.zeros(m // 2 + 1)
        phase = np.zeros(m // 2 + 1)
        log_fin = 0.0
        for q, s, n in releases:
            lm, ph = _step_fft(q, s, h, direction, m)
            logmag += n * lm
            phase += n * ph
            log_fin += n * math.log1p(-_step_pmf(q, s, h, direction)[2])
        spec = np.zeros(m // 2 + 1, dtype=complex)
        keep = logmag > -745.0                           # the rest underflows to 0 anyway
        spec[keep] = np.exp(logmag[keep] + 1j * phase[keep])
        c = sfft.irfft(spec, n=m)
        c = np.roll(c, -(a % m))                         # c[j] ↔ loss (a + j)·h
        np.maximum(c, 0.0, out=c)                        # FFT round-off below zero
        top = a + m                                      # first index above the window
        tp = _T_GRID > 0
        self.tail = float(min(1.0, np.exp(np.min(lam[tp] - _T_GRID[tp] * top * h))))
        self.inf_mass = float(-math.expm1(log_fin))
        self.base = max(a, 0)                           # c[i] ↔ loss (base + i)·h, all >= 0
        self.c = c[self.base - a:]
        self.h = h
        # S[i] = Σ_{k>=i} c_k ;  R[i] = Σ_{k>i} c_k e^{(i−k)h}
        self.S = np.cumsum(self.c[::-1])[::-1]
        n = self.c.size
        if (self.base + n) * h < 600.0:                  # scaled suffix sums (no overflow)
            w = self.c * np.exp(-(np.arange(n) * h))
            suffix = np.cumsum(w[::-1])[::-1]            # Σ_{k>=i} c_k e^{−(k)h}
            self.R = np.append(suffix[1:], 0.0) * np.exp(np.arange(n) * h)
        else:                                            # stable backward recursion
            u = np.concatenate([[0.0], self.c[::-1][:-1]])
            r = math.exp(-h)
            self.R = signal.lfilter([r], [1.0, -r], u)[::-1]
        self.extra = self.tail + self.inf_mass

    def _loss(self, i):
        return (self.base + i) * self.h

    def _delta_above(self, eps: float, k: int) -> float:
        """Σ_{i>=k} c_i (1 − e^{ε−ℓ_i}), valid when ℓ_{k−1} <= ε <= ℓ_k."""
        return self.S[k] - math.exp(eps - self._loss(k)) * (self.c[k] + self.R[k])

    def delta(self, eps: float) -> float:
        """δ(ε) = Σ_{ℓ>ε} c_ℓ (1 − e^{ε−ℓ}) + tail + ∞-mass (an upper bound)."""
        k = max(0, math.floor(eps / self.h) - self.base + 1)   # first index with loss > ε
        if k >= self.c.size:
            return min(1.0, self.extra)
        return float(min(1.0, max(0.0, self._delta_above(eps, k)) + self.extra))

    def epsilon(self, delta: float) -> float:
        target = delta - self.extra
        if target <= 0:
            return math.inf
        if self.delta(0.0) - self.extra <= target:
            return 0.0
        d_grid = np.append(self.S[1:] - self.R[:-1], 0.0)   # δ at ε = ℓ_i (without extra)
        k = int(np.argmax(d_grid <= target))                 # first grid loss meeting the target
        # on [ℓ_{k−1}, ℓ_k] (or [0, ℓ_0]): δ(ε) = S[k] − e^{ε−ℓ_k}(c_k + R_k), solve for ε
        lo = max(0.0, self._loss(k - 1)) if k > 0 else 0.0
        hi = self._loss(k)
        num, den = self.S[k] - target, self.c[k] + self.R[k]
        if den <= 0 or num <= 0:
            return hi
        return float(min(hi, max(lo, hi + math.log(num / den))))


def _normalise(releases):
    merged: dict = {}
    for q, s, n in releases:
        q, s, n = check_q(q), check_sigma(s), check_steps(n)
        if n:
            merged[(q, s)] = merged.get((q, s), 0) + n
    return tuple((q, s, n) for (q, s), n in sorted(merged.items()))


def compose(releases, interval: float = DEFAULT_INTERVAL):
    """Composed PLDs (remove, add) of heterogeneous releases [(q, σ, count), ...]; None if empty."""
    rel = _normalise(releases)
    if not rel:
        return None
    return tuple(_Composed(rel, d, float(interval)) for d in DIRECTIONS)


def epsilon_for_releases(releases, delta: float, interval: float = DEFAULT_INTERVAL) -> float:
    """ε(δ) of a heterogeneous composition: max over the two adjacency directions (upper bound)."""
    delta = check_delta(delta)
    comp = compose(releases, interval)
    if comp is None:
        return 0.0
    return max(c.epsilon(delta) for c in comp)


def delta_for_releases(releases, epsilon: float, interval: float = DEFAULT_INTERVAL) -> float:
    """δ(ε) of a heterogeneous composition: max over the two adjacency directions (upper bound)."""
    epsilon = check_epsilon(epsilon)
    comp = compose(releases, interval)
    if comp is None:
        return 0.0
    return max(c.delta(epsilon) for c in comp)


def epsilon(q: float, sigma: float, steps: int, delta: float, interval: float = DEFAULT_INTERVAL) -> float:
    """ε(δ) after ``steps`` lots of the Poisson-subsampled Gaussian (PLD, connect-the-dots, FFT)."""
    q, sigma, steps, delta = check_q(q), check_sigma(sigma), check_steps(steps), check_delta(delta)
    return epsilon_for_releases([(q, sigma, steps)], delta, interval)


def delta(q: float, sigma: float, steps: int, epsilon: float, interval: float = DEFAULT_INTERVAL) -> float:
    """δ(ε) after ``steps`` lots of the Poisson-subsampled Gaussian (PLD, connect-the-dots, FFT)."""
    q, sigma, steps, epsilon = check_q(q), check_sigma(sigma), check_steps(steps), check_epsilon(epsilon)
    return delta_for_releases([(q, sigma, steps)], epsilon, interval)
