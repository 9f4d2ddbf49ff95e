"""Composition of per-lot discrete PLDs by FFT: Chernoff windows, exponential tilting, δ(ε), ε(δ).

The per-lot pmf is placed on a cyclic grid of M points; T lots are its FFT to the power T and one
inverse FFT. The window is chosen from Chernoff bounds on the composed loss: the mass above it is
added to δ, mass below it aliases upwards (pessimistic), FFT round-off is clipped at zero and its
estimate ``noise`` decides where this untilted composition answers (``pld.py``: ``_serves``). h
starts at 1e-4 and doubles only when the window would need more than 2^18 points, so ε is
monotone in T. For tiny δ the composition is tilted (Esscher transform) at the Chernoff θ
(``_tilted_window``). A grid coarser than MAX_INTERVAL = 1 is refused (ValueError naming pld).
The ε returned satisfies δ(ε) <= δ in floating point too.

Details (the window, the round-off estimate, the coarsening): docs/ACCOUNTING.md,
"dpsgd/accountant/privacy_loss/pld_fft.py".
"""

from __future__ import annotations

import math
from functools import lru_cache

import numpy as np
from scipy import fft as sfft

from .pld_lot import STEP_TAIL, TAIL_FRACTION, _T_GRID, _lot_interval, _step_pmf, _tiny, _z_tail
from .tilt import _log_mgf, near_theta

MAX_POINTS = 1 << 18  # largest FFT grid before h is doubled
WINDOW_TAIL = 1e-15  # Chernoff bound on the composed mass above the FFT window
_TILT_TAIL = 1e-30  # tiny δ: tilted mass outside the window (tightness only)
MAX_INTERVAL = 1.0  # coarser than this: refused (ValueError naming pld)
_EPS = float(np.finfo(float).eps)


@lru_cache(maxsize=48)
def _step_fft(
    q: float, sigma: float, h: float, direction: str, m: int, z_tail: float, k_theta: int = -1
):
    """rfft (log-magnitude, phase) of one lot's pmf on the cyclic grid of m points; tilted by
    θ = _T_GRID[k_theta] (ω_i e^{θε_i − Λ(θ)}) when k_theta >= 0."""
    i_lo, probs, _, lam = _step_pmf(q, sigma, h, direction, z_tail)
    pos = i_lo + np.arange(probs.size)
    w = probs
    if k_theta >= 0:
        with np.errstate(divide="ignore"):
            w = np.exp(np.log(probs) + _T_GRID[k_theta] * (pos * h) - lam[k_theta])
    grid = np.bincount(pos % m, weights=w, minlength=m)
    f = sfft.rfft(grid)
    with np.errstate(divide="ignore"):
        return np.log(np.abs(f)), np.angle(f)


def _lam(releases, h, direction, z_tail):
    return sum(n * _step_pmf(q, s, h, direction, z_tail)[3] for q, s, n in releases)


def _lam_at(releases, h, direction, z_tail):
    """s ↦ Λ(s) of the composed finite parts at any s (the per-lot pmfs' log MGFs, times counts)."""

    def lam_at(s):
        out = 0.0
        for q, sg, n in releases:
            i_lo, probs = _step_pmf(q, sg, h, direction, z_tail)[:2]
            out = out + n * _log_mgf(i_lo, probs, h, s)
        return out

    return lam_at


def _window(releases, h, direction, z_tail=_z_tail(STEP_TAIL)):
    """Chernoff window [a, b] (grid indices) holding all but WINDOW_TAIL of the composed mass."""
    lam = _lam(releases, h, direction, z_tail)
    log_tau = math.log(WINDOW_TAIL)
    pos, neg = _T_GRID > 0, _T_GRID < 0
    b = float(np.min((lam[pos] - log_tau) / _T_GRID[pos]))
    a = float(np.max((lam[neg] - log_tau) / _T_GRID[neg]))
    return math.floor(a / h), max(math.ceil(b / h), 1), lam


def _theta_index(lam, delta=None, eps=None) -> int:
    """Grid index of the Chernoff-optimal tilt θ > 0 for δ (ε query) or for ε (δ query)."""
    ks = np.flatnonzero(_T_GRID > 0)[:-1]  # keep one larger t for the window
    t = _T_GRID[ks]
    vals = (lam[ks] - math.log(delta)) / t if delta is not None else lam[ks] - t * eps
    return int(ks[int(np.argmin(vals))])


def _support_top(releases, h, direction, z_tail) -> int:
    """Largest composed grid index with mass: Σ n·(largest index with mass of each lot's pmf)."""
    top = 0
    for q, s, n in releases:
        i_lo, probs, _, _ = _step_pmf(q, s, h, direction, z_tail)
        top += n * (i_lo + int(np.flatnonzero(probs)[-1]))
    return top


def _tilted_window(lam, k, h, log_eta, sup, lam_at=None):
    """Window [a, b] (grid indices) for the pmf tilted by θ = _T_GRID[k] (pld module doc, tiny δ).

    a: tilted mass below <= _TILT_TAIL. b: tilted mass above <= _TILT_TAIL, and both aliasing
    terms below e^{log_eta}: e^{θ(b − a)}·P(ℓ > b) (Chernoff, s > θ) and e^{−θ(b − a)}; the first
    two are void above ``sup`` (the largest loss with mass), which caps them. ``lam_at(s)``: Λ at
    any s, for Chernoff bounds at s close to θ as well (``tilt.near_theta``): near a phase
    transition of Λ the tilted law has a heavy tail that the coarse t grid bounds only loosely
    (a window thousands of times too wide, and h coarsened to fit it).
    """
    th, lt, log_tau = _T_GRID[k], lam[k], math.log(_TILT_TAIL)
    s, ls = _T_GRID, lam
    if lam_at is not None:
        s, ls = near_theta(th, s, ls, lam_at)
    lo, hi = s < th, s > th
    a = float(np.max((ls[lo] - lt - log_tau) / (s[lo] - th)))
    b1 = float(np.min((ls[hi] - lt - log_tau) / (s[hi] - th)))
    b2 = float(np.min((ls[hi] - th * a - log_eta) / (s[hi] - th)))
    b3 = a - log_eta / th
    return math.floor(a / h), max(
        math.ceil(max(min(max(b1, b2), sup), b3) / h), math.floor(a / h) + 1
    )


def _plan(releases, direction, interval, z_tail=_z_tail(STEP_TAIL), delta=None, eps=None):
    """(h, a, m, lam, k_theta): grid spacing, window start, FFT size, Λ totals, tilt index
    (−1: none)."""
    h = _lot_interval(releases, direction, interval, z_tail)
    ordinary = delta is None and eps is None and h == interval
    while True:
        if delta is None and eps is None:
            a, b, lam = _window(releases, h, direction, z_tail)
            k = -1
        else:
            lam = _lam(releases, h, direction, z_tail)
            k = _theta_index(lam, delta, eps)
            scale = delta if delta is not None else math.exp(min(0.0, lam[k] - _T_GRID[k] * eps))
            sup = _support_top(releases, h, direction, z_tail) * h
            log_eta = math.log(TAIL_FRACTION * max(scale, 1e-300))
            a, b = _tilted_window(lam, k, h, log_eta, sup, _lam_at(releases, h, direction, z_tail))
        if b - a + 1 <= MAX_POINTS:
            m = max(1 << 10, 1 << (b - a).bit_length())
            return h, a, m, lam, k
        # h doubles; off the ordinary path (tilted, or h already coarsened for a tiny σ) it jumps
        # to one doubling short of the estimated fit, to save recomputing the per-lot pmf
        jump = 0 if ordinary else (b - a + 1) // (2 * MAX_POINTS)
        h *= 2.0 ** max(1, jump.bit_length())
        if h > MAX_INTERVAL:
            raise ValueError(
                f"pld: the composed privacy loss spans more than {MAX_POINTS} grid points even at "
                f"spacing h = {MAX_INTERVAL:g} (epsilon in the hundreds of thousands); not served"
            )


def _fft_compose(releases, direction, h, a, m, z_tail, k):
    """Composed pmf (before clipping round-off at 0) on the window [a, a + m) by one FFT power, and
    the log of the composed finite mass (each lot keeps 1 − p_inf)."""
    logmag = np.zeros(m // 2 + 1)
    phase = np.zeros(m // 2 + 1)
    log_fin = 0.0
    for q, s, n in releases:
        lm, ph = _step_fft(q, s, h, direction, m, z_tail, k)
        logmag += n * lm
        phase += n * ph
        log_fin += n * math.log1p(-_step_pmf(q, s, h, direction, z_tail)[2])
    spec = np.zeros(m // 2 + 1, dtype=complex)
    keep = logmag > -745.0  # the rest underflows to 0 anyway
    spec[keep] = np.exp(logmag[keep] + 1j * phase[keep])
    c = sfft.irfft(spec, n=m)
    return np.roll(c, -(a % m)), log_fin  # c[j] ↔ loss (a + j)·h


class _Composed:
    """Composed discrete PLD of one direction on the window [a, a + m) (grid spacing h).

    ``delta`` (ε queries) or ``eps`` (δ queries) given: the tilted path for tiny δ (pld module doc).
    """

    def __init__(
        self, releases, direction, interval, z_tail=_z_tail(STEP_TAIL), delta=None, eps=None
    ):
        lots = sum(n for _, _, n in releases)
        if lots == 1:  # one lot: its pmf is the composition (no FFT, no tilt)
            q, s, _ = releases[0]
            h = _lot_interval(releases, direction, interval, z_tail)
            a, c, p_inf, lam = _step_pmf(q, s, h, direction, z_tail)
            m, k, c, log_fin, self.noise = c.size, -1, c.copy(), math.log1p(-p_inf), 0.0
        else:
            h, a, m, lam, k = _plan(releases, direction, interval, z_tail, delta, eps)
            c, log_fin = _fft_compose(releases, direction, h, a, m, z_tail, k)
            # round-off of F^T: log-magnitudes and phases multiplied by T give each coefficient a
            # relative error ~T·eps; through the inverse FFT (Parseval) ~T·eps·‖c‖₂/√m per bin, at
            # most m bins summed into δ. An estimate (observed: 10^4..10^5 times the largest
            # negative bin), which decides where the untilted composition is served (pld module doc)
            self.noise = float(lots * _EPS * math.sqrt(m) * np.linalg.norm(c))
        np.maximum(c, 0.0, out=c)  # FFT round-off below zero
        top = a + m  # first index above the window
        tp = _T_GRID > 0
        self.tail = (
            0.0 if lots == 1 else float(min(1.0, np.exp(np.min(lam[tp] - _T_GRID[tp] * top * h))))
        )
        if _tiny(z_tail):  # tiny δ: nothing has loss above the support
            sup = _support_top(releases, h, direction, z_tail)
            if top > sup:
                self.tail = 0.0  # no finite mass above the window
            c[max(0, sup + 1 - a) :] = 0.0  # above it: FFT round-off and aliasing only
        self.inf_mass = float(-math.expm1(log_fin))
        self.base = max(a, 0)  # c[i] ↔ loss (base + i)·h, all >= 0
        self.floor = a * h  # answers below this: not served (tilted)
        self.tilted = k >= 0
        c = c[self.base - a :]
        if self.tilted:  # untilt: c = c̃ e^{ΣnΛ(θ) − θℓ}, <= 1
            with np.errstate(divide="ignore"):
                log_c = np.log(c) + lam[k] - _T_GRID[k] * ((self.base + np.arange(c.size)) * h)
            c = np.exp(np.minimum(log_c, 0.0))
        self.c = c
        self.h = h
        # S[i] = Σ_{k>=i} c_k ;  R[i] = Σ_{k>i} c_k e^{(i−k)h}
        self.S = np.cumsum(self.c[::-1])[::-1]
        n = self.c.size
        if (self.base + n) * h < 600.0 and not self.tilted:  # scaled suffix sums (no overflow)
            w = self.c * np.exp(-(np.arange(n) * h))
            suffix = np.cumsum(w[::-1])[::-1]  # Σ_{k>=i} c_k e^{−(k)h}
            self.R = np.append(suffix[1:], 0.0) * np.exp(np.arange(n) * h)
        else:  # stable backward recursion
            u = np.concatenate([[0.0], self.c[::-1][:-1]])
            r = math.exp(-h)
            from scipy import signal  # here only: importing scipy.signal costs ~0.8 s of start-up

            self.R = signal.lfilter([r], [1.0, -r], u)[::-1]
        self.extra = self.tail + self.inf_mass

    def _loss(self, i):
        return (self.base + i) * self.h

    def _delta_above(self, eps: float, k: int) -> float:
        """Σ_{i>=k} c_i (1 − e^{ε−ℓ_i}), valid when ℓ_{k−1} <= ε <= ℓ_k."""
        return self.S[k] - math.exp(eps - self._loss(k)) * (self.c[k] + self.R[k])

    def delta(self, eps: float) -> float:
        """δ(ε) = Σ_{ℓ>ε} c_ℓ (1 − e^{ε−ℓ}) + tail + ∞-mass (an upper bound)."""
        k = max(0, math.floor(eps / self.h) - self.base + 1)  # first index with loss > ε
        if k >= self.c.size:
            return min(1.0, self.extra)
        return float(min(1.0, max(0.0, self._delta_above(eps, k)) + self.extra))

    def epsilon(self, delta: float) -> float:
        target = delta - self.extra
        if target <= 0:
            return math.inf
        if self.delta(0.0) - self.extra <= target:
            return 0.0
        d_grid = np.append(self.S[1:] - self.R[:-1], 0.0)  # δ at ε = ℓ_i (without extra)
        k = int(np.argmax(d_grid <= target))  # first grid loss meeting the target
        # on [ℓ_{k−1}, ℓ_k] (or [0, ℓ_0]): δ(ε) = S[k] − e^{ε−ℓ_k}(c_k + R_k), solve for ε
        lo = max(0.0, self._loss(k - 1)) if k > 0 else 0.0
        hi = self._loss(k)
        num, den = self.S[k] - target, self.c[k] + self.R[k]
        if den <= 0 or num <= 0:
            return hi
        eps = float(min(hi, max(lo, hi + math.log(num / den))))
        # rounded up (pessimistic): the returned ε meets δ(ε) <= δ on this same discrete PLD, not
        # only in exact arithmetic (at worst hi, where δ(ℓ_k) <= δ holds by the choice of k)
        for i in range(8):  # steps of 4·ulp, growing fourfold
            if eps >= hi or self.delta(eps) <= delta:
                return eps
            eps = min(hi, eps + 4.0 * (math.ulp(eps) + math.ulp(hi)) * 4**i)
        return hi
