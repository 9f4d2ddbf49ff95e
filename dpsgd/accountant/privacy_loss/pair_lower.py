"""A *lower* bound on ε of lots of the Poisson-subsampled Gaussian pair: every loss rounded down.

The fixed-size sampler's bracket (``dpsgd.privacy.sampler_epsilon``) shows, below its ε, the ε of
one dataset pair with constant gradients: the remove/add pair of a lot at rate γ = L/N and noise
σ/2, self-composed. Its lower end must be a number no valid ε of the run can fall below, so it is
computed here by a method that *lower*-bounds that pair's ε; ``pld.py``'s pessimistic
discretisation bounds it from above, and at tiny δ, coarsened, its value was above the run's own
valid ε.

Each lot is first post-processed: its output z is reported only as the loss interval
I_i = {z : L(z) ∈ (ε_i, ε_{i+1}]} of the grid ε_i = i·h it falls in (and the interval above the
grid's top). That quantised pair (P(I_i), Q(I_i)) is dominated by the lot's own pair
(post-processing), and so is its composition; its loss ℓ_i = log P(I_i)/Q(I_i) lies in
(ε_i, ε_{i+1}]. Each ℓ_i is then rounded *down* to ε_i, losing e_i = ℓ_i − ε_i ∈ [0, h] (the top
interval's loss, rounded to the grid's top, is credited nothing), and the rounded lots compose by
FFT (``truncated.compose_pmfs``): nothing above the window is counted, and the mass aliased into it
from below (a Chernoff bound) and the FFT's round-off estimate (``tilt.round_off``) are
subtracted. The rounding is then given back where it is certain: the e of the T lots are
independent, each in [0, h], with mean μ and variance v under P (known exactly), so
Σe >= s = Tμ − x except with probability η = TAIL_FRACTION·δ, where x = hλ/3 + √((hλ/3)² + 2Tvλ),
λ = ln(1/η) (Bernstein's inequality, |e − μ| <= h). With δ_r the rounded composition's
δ(ε) and (·)_+ <= 1, δ_true(ε) >= δ_r(ε − s) − η − aliased − round-off, so for every ε below
ε_low = s + min{ε : δ_r(ε) <= δ + η + aliased + round-off} the true δ(ε) exceeds δ: the pair's true
ε is at least ε_low, in each direction; the larger of the two directions (the two orders of the
same pair of datasets) is returned. Where δ is below the round-off the bound is loose (it is still
a lower bound), never wrong.

Details: docs/ACCOUNTING.md, "dpsgd/accountant/privacy_loss/pair_lower.py".
"""

from __future__ import annotations

import math

import numpy as np
from scipy import fft as sfft

from ..limits import check_delta, check_q, check_sigma, check_steps
from .pld_fft import MAX_INTERVAL
from .pld_lot import (
    _T_GRID,
    STEP_TAIL,
    TAIL_FRACTION,
    _log_gauss_mass,
    _log_mix_mass,
    _loss_range,
    _z_of_loss,
    _z_tail,
)
from .tilt import _log_mgf, near_theta, round_off

INTERVAL = 1e-4  # h: each lot's loss is rounded down by < h


def lot_pmf(q: float, sigma: float, h: float, direction: str):
    """(i_lo, probs, μ, v): one lot quantised to its loss intervals and rounded down to the grid h,
    and the mean μ and variance v under P of the loss the rounding took off (module doc)."""
    lo, hi = _loss_range(q, sigma, direction, _z_tail(STEP_TAIL))
    i_lo, i_hi = math.floor(lo / h), max(math.ceil(hi / h), math.floor(lo / h) + 1)
    eps = np.arange(i_lo, i_hi + 1) * h
    if direction == "remove":  # L > ε ⇔ z > t(ε); P = (1 − q)N(0, σ²) + qN(1, σ²), Q = N(0, σ²)
        t = _z_of_loss(eps, q, sigma)
        a, b, top = t[:-1], t[1:], (t[-1], np.inf)
        log_p = lambda x, y: _log_mix_mass(x, y, q, sigma)  # noqa: E731
        log_q = lambda x, y: _log_gauss_mass(x, y, 0.0, sigma)  # noqa: E731
    else:  # L = −L_remove(z) > ε ⇔ z < t(ε); P = N(0, σ²), Q the mixture; L <= −log(1 − q)
        sup = -math.log1p(-q) if q < 1 else np.inf
        t = np.where(eps >= sup, -np.inf, _z_of_loss(-eps, q, sigma))
        a, b, top = t[1:], t[:-1], (-np.inf, t[-1])
        log_p = lambda x, y: _log_gauss_mass(x, y, 0.0, sigma)  # noqa: E731
        log_q = lambda x, y: _log_mix_mass(x, y, q, sigma)  # noqa: E731
    lp, lq = log_p(a, b), log_q(a, b)
    p_int = np.exp(lp)
    with np.errstate(invalid="ignore"):
        lost = np.where(p_int > 0, np.clip(lp - lq - eps[:-1], 0.0, h), 0.0)  # e_i ∈ [0, h]
    probs = np.append(p_int, float(np.exp(log_p(*top))))  # I_i at ε_i; the top interval at ε_n
    mu = float(np.dot(p_int, lost))
    return i_lo, probs, mu, max(0.0, float(np.dot(p_int, lost * lost)) - mu * mu)


def epsilon_lower(
    q: float, sigma: float, steps: int, delta: float, interval: float = INTERVAL
) -> float:
    """A lower bound on ε(δ) of ``steps`` lots of the Poisson-subsampled Gaussian pair (q, σ),
    add/remove: the pair's true ε, and so any valid ε of a mechanism it is a pair of, is at least
    this (module doc)."""
    q, sigma = check_q(q), check_sigma(sigma)
    steps, delta = check_steps(steps), check_delta(delta)
    if steps < 1:
        return 0.0
    eta = TAIL_FRACTION * delta  # Bernstein's allowance: Σe below s with at most this P-mass
    return max(_direction(q, sigma, steps, delta, eta, d, float(interval)) for d in DIRECTIONS)


DIRECTIONS = ("remove", "add")


def _direction(q, sigma, steps, delta, eta, direction, h) -> float:
    """The lower bound of one direction: the rounded composition's δ_r (untilted, or tilted where
    the FFT's round-off is not below TAIL_FRACTION·δ), inverted from below on its grid, shifted by
    the rounding given back (module doc)."""
    from .truncated import compose_pmfs  # truncated imports the accountant's PLD modules

    while True:
        i_lo, probs, mu, var = lot_pmf(q, sigma, h, direction)
        comp = compose_pmfs([((i_lo, probs, 0.0), steps)], h)
        if comp is not None:
            break
        h *= 2.0  # a coarser grid rounds down further: still a lower bound
        if h > MAX_INTERVAL:
            raise ValueError(
                "pair_lower: the composed privacy loss spans too many grid points; not served"
            )
    loss, c, _, below, _ = comp
    noise = round_off(steps, c)
    # Bernstein (1924): P(Σe <= Tμ − x) <= exp(−x² / (2(T·v + h·x/3))), each |e − μ| <= h
    lg = math.log(1.0 / eta)
    shift = steps * mu - (h * lg / 3.0 + math.sqrt((h * lg / 3.0) ** 2 + 2.0 * steps * var * lg))
    best = 0.0
    for s, target in ((0.0, delta), (shift, delta + eta)) if shift > 0 else ((0.0, delta),):
        found = _below(loss, c, below + noise, target)  # the untilted composition
        if noise > TAIL_FRACTION * delta:  # its round-off matters: tilted too (both bound it)
            tilted = _tilted(i_lo, probs, steps, h, target)
            found = tilted if found is None or (tilted is not None and tilted > found) else found
        if found is not None:
            best = max(best, s + found)
    return best


def _below(loss, c, minus, target):
    """The largest grid loss ℓ_k at which the composition's δ, less ``minus`` (a number, or one per
    grid point: what the window and the FFT may have added there), still exceeds ``target``: δ(ε)
    of the true composition is non-increasing, so it exceeds ``target`` at every ε <= ℓ_k. None
    where it exceeds it nowhere on the grid."""
    from scipy import signal

    h = float(loss[1] - loss[0])
    S = np.append(np.cumsum(c[::-1])[::-1][1:], 0.0)  # Σ_{j>k} c_j
    # R_k = Σ_{j>k} c_j e^{ℓ_k − ℓ_j}, by the stable backward recursion R_k = e^{−h}(c_{k+1} + R_{k+1})
    u = np.append(c[1:], 0.0)[::-1]
    R = signal.lfilter([math.exp(-h)], [1.0, -math.exp(-h)], u)[::-1]
    ok = np.flatnonzero(S - R - minus > target)
    return float(loss[ok[-1]]) if ok.size else None


def _tilted(i_lo, probs, steps, h, target):
    """:func:`_below` on the composition tilted at the Chernoff θ for ``target`` (the round-off
    then relative to δ; ``tilt.py``), untilted after the FFT. Subtracted: the mass aliased from
    above the window (e^{Λ(s) − (s − θ)b − θa}, Chernoff, s > θ), from below it (e^{−θ(b − a)}),
    and the round-off, untilted (noise·e^{Λ(θ) − θℓ} at ℓ). None where the window does not fit."""
    from .truncated import MAX_POINTS

    t = _T_GRID
    lam = steps * _log_mgf(i_lo, probs, h, t)
    ks = np.flatnonzero(t > 0)[:-1]
    k = int(ks[int(np.argmin((lam[ks] - math.log(target)) / t[ks]))])
    th, lt = float(t[k]), float(lam[k])
    log_tau = math.log(TAIL_FRACTION * target)
    s, ls = near_theta(th, t, lam, lambda x: steps * _log_mgf(i_lo, probs, h, x))
    lo, hi = s < th, s > th
    a = math.floor(float(np.max((ls[lo] - lt - log_tau) / (s[lo] - th))) / h)
    b = math.ceil(float(np.min((ls[hi] - th * a * h - log_tau) / (s[hi] - th))) / h)
    b = max(b, a + math.ceil(-log_tau / (th * h)))  # e^{−θ(b − a)} <= TAIL_FRACTION·δ
    if b - a + 1 > MAX_POINTS:
        return None
    m = max(1 << 10, 1 << (b - a).bit_length())
    pos = i_lo + np.arange(probs.size)
    lw = np.log(probs, out=np.full(probs.size, -np.inf), where=probs > 0)
    tilted = np.exp(lw + th * pos * h - _log_mgf(i_lo, probs, h, [th])[0])
    spec = sfft.rfft(np.bincount(pos % m, weights=tilted, minlength=m)) ** steps
    ct = np.roll(sfft.irfft(spec, n=m), -(a % m))
    loss = (a + np.arange(m)) * h
    noise = round_off(steps, ct)
    with np.errstate(divide="ignore", over="ignore", invalid="ignore"):
        c = np.exp(np.minimum(np.log(np.maximum(ct, 0.0)) + lt - th * loss, 0.0))
        untilt = np.exp(np.minimum(lt - th * loss, 700.0))
    top = (a + m) * h
    above = float(np.exp(np.min(ls[hi] - (s[hi] - th) * top - th * a * h)))
    aliased = above + math.exp(-th * m * h)
    return _below(loss, c, aliased + noise * untilt, target)
