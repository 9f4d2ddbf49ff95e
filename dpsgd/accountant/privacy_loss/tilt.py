"""ε(δ) of composed discrete PLDs from their pmfs, untilted or exponentially tilted for small δ.

``_epsilon`` solves δ(ε) = Σ_{ℓ>ε} c(1 − e^{ε−ℓ}) + extra <= δ on a composed pmf. Where the FFT's
round-off (about lots·eps·√m·‖c‖₂, as in ``pld_fft.py``) is not below TAIL_FRACTION·δ, the untilted
composition cannot resolve δ; ``epsilon_tilted`` then composes the Esscher transforms
ω_i e^{θε_i − Λ₁(θ)} of the per-lot pmfs at the Chernoff θ for δ (the round-off is then relative
to δ itself), places the window by Chernoff bounds of the tilted law, and untilts:
c(ℓ) = c_θ(ℓ)·e^{Λ(θ) − θℓ}. Every bound it drops is added to δ: the untilted mass above the window
(Chernoff), the ∞ atoms, and the round-off carried to the losses above the answer. The mass below
the window is lost in the untilt, so an answer below the window is refused (None; the caller keeps
the untilted answer with its round-off added). Used by ``truncated.epsilons_for_releases`` for
fixed-size, truncated-Poisson and random-allocation ledgers (``pld.py`` does the same for Poisson).
"""

from __future__ import annotations

import math

import numpy as np
from scipy import fft as sfft

from .pld_lot import TAIL_FRACTION, _T_GRID

_EPS = float(np.finfo(float).eps)


def _log_mgf(i_lo, probs, h, t):
    """log Σ ω_i e^{t ε_i} at each t (one pass per t: no len(t) × len(probs) matrix)."""
    nz = probs > 0
    lp, e = np.log(probs[nz]), (i_lo + np.flatnonzero(nz)) * h
    out = np.empty(len(t))
    for k, tt in enumerate(t):
        v = lp + tt * e
        mx = v.max()
        out[k] = mx + math.log(np.exp(v - mx).sum())
    return out


NEAR = 2.0 ** -np.arange(1, 13)  # s = θ(1 ± 2^-j): Chernoff bounds close to the tilt θ


def near_theta(th: float, s, ls, lam_at):
    """The t grid ``s`` with its Λ values ``ls``, extended by s = θ(1 ± 2^-j), j = 1..12, with
    Λ there from ``lam_at``. Every Chernoff bound e^{Λ(s) − Λ(θ) − (s − θ)x} on the tilted law is
    valid at any s; those close to θ are the tight ones where Λ turns steeply upwards just past θ
    (the subsampled Gaussian's log MGF near order 2σ²log(1/q): the tilted law's tail is heavy)."""
    extra = np.concatenate([th * (1.0 - NEAR), th * (1.0 + NEAR)])
    return np.concatenate([s, extra]), np.concatenate([ls, np.asarray(lam_at(extra), float)])


def _epsilon(loss, c, extra, delta):
    """Smallest ε >= 0 with δ(ε) = Σ_{ℓ>ε} c(1 − e^{ε−ℓ}) + extra <= δ (:func:`_epsilons`)."""
    return _epsilons(loss, c, extra, [delta])[0]


def _epsilons(loss, c, extra, deltas) -> list:
    """:func:`_epsilon` at each δ of ``deltas``, the sums formed once. On (ℓ_{k−1}, ℓ_k],
    δ(ε) = S_k − e^{ε−ℓ_0}·V_k with S_k = Σ_{j>=k} c_j and V_k = Σ_{j>=k} c_j e^{−(ℓ_j − ℓ_0)}."""
    S = np.cumsum(c[::-1])[::-1]
    with np.errstate(under="ignore", over="ignore"):
        V = np.cumsum((c * np.exp(-(loss - loss[0])))[::-1])[::-1]
        d_at = np.append(S[1:] - np.exp(loss[:-1] - loss[0]) * V[1:], 0.0)  # δ(ℓ_k)
    k0 = int(np.searchsorted(loss, 0.0))  # first ℓ >= 0
    out = []
    for delta in deltas:
        target = delta - extra
        if target <= 0:
            out.append(math.inf)
            continue
        if k0 >= loss.size or S[k0] - math.exp(-loss[0]) * V[k0] <= target:  # δ(0)
            out.append(0.0)
            continue
        ok = np.flatnonzero(d_at[k0:] <= target)
        if ok.size == 0:
            out.append(math.inf)
            continue
        k = k0 + int(ok[0])
        lo = max(0.0, float(loss[k - 1])) if k > 0 else 0.0
        num, den = S[k] - target, V[k]
        if num <= 0 or den <= 0:
            out.append(float(loss[k]))
        else:
            out.append(float(min(loss[k], max(lo, loss[0] + math.log(num / den)))))
    return out


def round_off(lots: int, c: np.ndarray) -> float:
    """Estimate of the FFT round-off of a composition of ``lots`` pmfs giving ``c``."""
    return float(lots * _EPS * math.sqrt(c.size) * np.linalg.norm(c))


def epsilon_tilted(pmfs, h: float, delta: float, max_points: int) -> float | None:
    """ε(δ) of the composition of ``pmfs`` [((i_lo, probs, p_inf), count), ...] on grid h, tilted
    at the Chernoff θ for δ (module doc); None where the window needs more than ``max_points``
    points or the answer falls below it."""
    t = _T_GRID
    lam = sum(n * _log_mgf(i, w, h, t) for (i, w, _), n in pmfs)  # Λ(t) of the finite parts
    ks = np.flatnonzero(t > 0)[:-1]  # one larger t kept for the window
    k = int(ks[int(np.argmin((lam[ks] - math.log(delta)) / t[ks]))])
    th, lt = float(t[k]), float(lam[k])
    log_tau = math.log(TAIL_FRACTION * delta)
    s, ls = near_theta(th, t, lam, lambda x: sum(n * _log_mgf(i, w, h, x) for (i, w, _), n in pmfs))
    lo, hi = s < th, s > th
    a = math.floor(float(np.max((ls[lo] - lt - log_tau) / (s[lo] - th))) / h)
    # above b: tilted mass that wraps below, untilted to at most e^{log_tau} (Chernoff, s > θ)
    b = math.ceil(float(np.min((ls[hi] - th * a * h - log_tau) / (s[hi] - th))) / h)
    if b - a + 1 > max_points:
        return None
    m = max(1 << 10, 1 << (b - a).bit_length())
    spec = np.ones(m // 2 + 1, dtype=complex)
    log_fin, lots = 0.0, 0
    for (i_lo, w, p_inf), n in pmfs:
        pos = i_lo + np.arange(w.size)
        lw = np.log(w, out=np.full(w.size, -np.inf), where=w > 0)
        tilted = np.exp(lw + th * pos * h - _log_mgf(i_lo, w, h, [th])[0])
        spec *= sfft.rfft(np.bincount(pos % m, weights=tilted, minlength=m)) ** n
        log_fin, lots = log_fin + n * math.log1p(-p_inf), lots + n
    ct = np.maximum(np.roll(sfft.irfft(spec, n=m), -(a % m)), 0.0)
    loss = (a + np.arange(m)) * h
    with np.errstate(divide="ignore", over="ignore"):
        c = np.exp(np.minimum(np.log(ct) + lt - th * loss, 0.0))
    pos = t > 0
    above = float(min(1.0, np.exp(np.min(lam[pos] - t[pos] * (a + m) * h))))  # untilted, Chernoff
    extra = above - math.expm1(log_fin)
    eps = _epsilon(loss, c, extra, delta)
    if not math.isfinite(eps) or eps < loss[0]:
        return None
    noise = round_off(lots, ct) * math.exp(min(0.0, lt - th * eps))  # carried to ℓ > ε
    eps2 = _epsilon(loss, c, extra + noise, delta)
    return eps2 if math.isfinite(eps2) else None
