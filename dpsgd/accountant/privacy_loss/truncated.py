"""PLD of the truncated Poisson-subsampled Gaussian: Poisson lots capped at B examples.

Sampler (``mechanism/sampling.py:TruncatedPoissonSampler``): each of the N examples joins the lot
independently with probability q = L/N; if more than B joined, a uniformly random B of them are
kept; the lot is padded to exactly B rows of weight 0 and the noisy sum is divided by the expected
L. Adjacency: add/remove one example (as the Poisson sampler).

Dominating pair (Ganesh, Kamath, Manurangsi et al. 2025, arXiv 2508.15089, as implemented by
dp_accounting 0.6.0): the lot's PLD is the mixture (1 − p_t)·ω_Poisson + p_t·ω_replace of the
Poisson-subsampled Gaussian (no truncation) and the replace-one subsampled Gaussian at rate q_t and
noise σ/2 (truncation), each discretised by connect-the-dots. Lots compose by FFT with the run's
other releases, as in ``pld.py``; this module serves δ >= pld.TILT_BELOW (1e-12) only. With
B >= N the lot is the Poisson one exactly.

Details (p_t, q_t and the two parts): docs/ACCOUNTING.md,
"dpsgd/accountant/privacy_loss/truncated.py".
"""

from __future__ import annotations

import math
from functools import lru_cache

import numpy as np
from scipy import fft as sfft
from scipy import special

from . import allocation_pld, pld, wor_pld
from .tilt import _epsilon, _epsilons, _log_mgf, epsilon_tilted, round_off
from .pld_fft import MAX_INTERVAL, WINDOW_TAIL
from .pld_lot import STEP_TAIL, TAIL_FRACTION, _T_GRID, _step_pmf, _z_tail
from ..limits import check_delta, check_q, check_sigma, check_steps

MAX_POINTS = 1 << 21  # largest FFT window before h is doubled
_BISECT = 80  # bisection steps for the loss thresholds (x to ~1e-24 relative)


def truncation(N: int, q: float, B: int) -> tuple[float, float]:
    """(p_t, q_t): probability of truncation given that x was drawn, and x's keep-rate given it."""
    from scipy import stats  # here only: importing scipy.stats costs ~0.5 s of start-up

    p_t = float(stats.binom.sf(B - 1, N - 1, q))
    if p_t == 0.0:
        return 0.0, 0.0
    q_t = float(stats.binom.sf(B, N, q)) * B / p_t / N
    return p_t, min(1.0, q_t)


def _replace_loss(x, qt, s):
    """L(x) = log P(x)/Q(x) of the replace-one pair (decreasing in x)."""
    lq = math.log1p(-qt) if qt < 1 else -np.inf
    up = np.logaddexp(lq, math.log(qt) + (-2.0 * x - 1.0) / (2.0 * s * s))
    lo = np.logaddexp(lq, math.log(qt) + (2.0 * x - 1.0) / (2.0 * s * s))
    return up - lo


def _mass(a, b, mean_w, s):
    """Mass on [a, b) of Σ w·N(m, s²) for mean_w = ((m, w), ...)."""
    return sum(
        w * (special.ndtr((b - m) / s) - special.ndtr((a - m) / s)) for m, w in mean_w if w > 0
    )


@lru_cache(maxsize=32)
def _replace_pmf(qt: float, sigma: float, h: float):
    """Connect-the-dots discrete PLD of the replace-one pair: (i_lo, probs, p_inf)."""
    s = sigma / 2.0
    z = _z_tail(STEP_TAIL)
    xlo, xhi = -1.0 - z * s, 1.0 + z * s
    lo, hi = float(_replace_loss(xhi, qt, s)), float(_replace_loss(xlo, qt, s))
    i_lo, i_hi = math.floor(lo / h), max(math.ceil(hi / h), math.floor(lo / h) + 1)
    eps = np.arange(i_lo, i_hi + 1) * h
    a, b = np.full(eps.size, xlo), np.full(eps.size, xhi)  # threshold t_i: L(x) > ε_i ⇔ x < t_i
    for _ in range(_BISECT):
        mid = 0.5 * (a + b)
        big = _replace_loss(mid, qt, s) > eps
        a, b = np.where(big, mid, a), np.where(big, b, mid)
    t = 0.5 * (a + b)
    P, Q = ((-1.0, qt), (0.0, 1.0 - qt)), ((1.0, qt), (0.0, 1.0 - qt))
    p_int, q_int = _mass(t[1:], t[:-1], P, s), _mass(t[1:], t[:-1], Q, s)  # (ε_i, ε_{i+1}]
    x = np.exp(eps)
    B = x[:-1] * q_int
    D = np.clip((p_int - B) / math.expm1(h), 0.0, B)
    probs = np.zeros(eps.size)
    probs[:-1] += B - D
    probs[1:] += math.exp(h) * D
    probs[0] += _mass(t[0], np.inf, P, s)  # losses <= ε_0, moved up to ε_0
    p_above, q_above = _mass(-np.inf, t[-1], P, s), _mass(-np.inf, t[-1], Q, s)
    probs[-1] += x[-1] * q_above
    return i_lo, probs, max(0.0, p_above - x[-1] * q_above)


def _lot_pmf(release, h: float, direction: str):
    """(i_lo, probs, p_inf) of one lot: ("poisson", q, σ), ("truncated", N, q, B, σ), ("wor", γ,
    σ) (a fixed-size lot under replace-one: ``wor_pld.py``, the same pair in both directions) or
    one epoch of random allocation ("allocation", t, σ) (``allocation_pld.py``)."""
    if release[0] == "poisson":
        i_lo, probs, p_inf, _ = _step_pmf(release[1], release[2], h, direction)
        return i_lo, probs, p_inf
    if release[0] == "wor":
        return wor_pld.lot_pmf(release[1], release[2], h)
    if release[0] == "allocation":  # one epoch of random allocation over t lots
        return allocation_pld.epoch_pmf(release[1], release[2], h, direction)
    _, N, q, B, sigma = release
    p_t, q_t = truncation(N, q, B)
    i1, w1, inf1 = _step_pmf(q, sigma, h, direction)[:3]
    if p_t == 0.0:
        return i1, w1, inf1
    i2, w2, inf2 = _replace_pmf(q_t, sigma, h)
    i_lo = min(i1, i2)
    probs = np.zeros(max(i1 + w1.size, i2 + w2.size) - i_lo)
    probs[i1 - i_lo : i1 - i_lo + w1.size] += (1.0 - p_t) * w1
    probs[i2 - i_lo : i2 - i_lo + w2.size] += p_t * w2
    return i_lo, probs, (1.0 - p_t) * inf1 + p_t * inf2


def _compose(releases, h: float, direction: str):
    """Composed discrete PLD of ``releases`` in one direction: (ℓ, c, extra δ: tail + ∞), or None
    when the window needs more than MAX_POINTS points at this h."""
    out = compose_pmfs([(_lot_pmf(r, h, direction), n) for r, n in releases], h)
    if out is None:
        return None
    loss, c, tail_above, _, inf_mass = out
    return loss, c, tail_above + inf_mass


def compose_pmfs(lots, h: float):
    """FFT composition of discrete PLDs [((i_lo, probs, p_inf), count), ...] on grid h, on a cyclic
    window [a, b] placed by Chernoff bounds (pld_lot._T_GRID): returns (ℓ, c, mass above the window
    (bound, <= WINDOW_TAIL), mass below it (bound; it aliased upwards), ∞ mass), or None when the
    window needs more than MAX_POINTS points."""
    t = _T_GRID
    lam = sum(n * _log_mgf(i, w, h, t) for (i, w, _), n in lots)
    log_tau = math.log(WINDOW_TAIL)
    pos, neg = t > 0, t < 0
    a = math.floor(float(np.max((lam[neg] - log_tau) / t[neg])) / h)
    b = math.ceil(float(np.min((lam[pos] - log_tau) / t[pos])) / h)
    if b - a + 1 > MAX_POINTS:
        return None
    m = max(1 << 10, 1 << (b - a).bit_length())
    spec = np.ones(m // 2 + 1, dtype=complex)
    log_fin = 0.0
    for (i_lo, w, p_inf), n in lots:
        grid = np.bincount((i_lo + np.arange(w.size)) % m, weights=w, minlength=m)
        spec *= sfft.rfft(grid) ** n
        log_fin += n * math.log1p(-p_inf)
    c = np.maximum(np.roll(sfft.irfft(spec, n=m), -(a % m)), 0.0)
    above = float(min(1.0, np.exp(np.min(lam[pos] - t[pos] * (a + m) * h))))
    below = float(min(1.0, np.exp(np.min(lam[neg] - t[neg] * a * h))))
    return (a + np.arange(m)) * h, c, above, below, -math.expm1(log_fin)


def _checked(releases) -> list:
    rel = []
    for r, n in releases:
        n = check_steps(n, "count")
        if r[0] in ("poisson", "wor"):
            r = (r[0], check_q(r[1]), check_sigma(r[2]))
        elif r[0] == "allocation":
            if int(r[1]) != r[1] or int(r[1]) < 1:
                raise ValueError(
                    f"an allocation release needs t >= 1 lots per epoch, got t={r[1]!r}"
                )
            r = ("allocation", int(r[1]), check_sigma(r[2]))
        else:
            N, B = int(r[1]), int(r[3])
            if N < 1 or B < 1:
                raise ValueError(f"truncated release needs N >= 1 and B >= 1, got N={N}, B={B}")
            r = ("truncated", N, check_q(r[2]), B, check_sigma(r[4]))
        if n:
            rel.append((r, n))
    return rel


def epsilons_for_releases(releases, deltas, interval: float = pld.DEFAULT_INTERVAL) -> list:
    """ε(δ) at each δ of ``deltas`` of ``releases`` [(("poisson", q, σ) | ("truncated", N, q, B,
    σ) | ("wor", γ, σ) | ("allocation", t, σ): one epoch, count), ...], one composition per
    direction for all of them: max over the remove and add directions; an upper bound
    (pessimistic discretisation, tails into δ)."""
    deltas = [check_delta(d) for d in deltas]
    if any(d < pld.TILT_BELOW for d in deltas):
        raise ValueError(
            f"delta={min(deltas)!r}: the truncated-Poisson PLD serves delta >= {pld.TILT_BELOW:g}"
        )
    rel = _checked(releases)
    out = [0.0] * len(deltas)
    if not rel:
        return out
    # fixed-size lots (one symmetric pair) and Gaussians (q = 1) lose the same both ways:
    # one direction
    symmetric = all(r[0] == "wor" or (r[0] == "poisson" and r[1] == 1.0) for r, _ in rel)
    lots = sum(n for _, n in rel)
    for direction in pld.DIRECTIONS[:1] if symmetric else pld.DIRECTIONS:
        h = float(interval)
        while (comp := _compose(rel, h, direction)) is None:
            h *= 2.0
            if h > MAX_INTERVAL:
                raise ValueError(
                    "truncated: the composed privacy loss spans too many grid points; not served"
                )
        noise = round_off(lots, comp[1])
        plain = [d for d in deltas if noise <= TAIL_FRACTION * d]  # the untilted answer serves
        eps = dict(zip(plain, _epsilons(*comp, plain)))
        for i, d in enumerate(deltas):
            out[i] = max(
                out[i], eps[d] if d in eps else _epsilon_at(rel, h, direction, comp, noise, d)
            )
    return out


def _epsilon_at(rel, h, direction, comp, noise, delta) -> float:
    """ε(δ) from the untilted composition ``comp`` where its round-off ``noise`` is below
    TAIL_FRACTION·δ; else tilted (``tilt.py``), or untilted with the round-off added to δ."""
    loss, c, extra = comp
    if noise <= TAIL_FRACTION * delta:
        return _epsilon(loss, c, extra, delta)
    pmfs = [(_lot_pmf(r, h, direction), n) for r, n in rel]
    eps = epsilon_tilted(pmfs, h, delta, MAX_POINTS)
    return eps if eps is not None else _epsilon(loss, c, extra + noise, delta)


def epsilon_for_releases(releases, delta: float, interval: float = pld.DEFAULT_INTERVAL) -> float:
    """ε(δ) of ``releases`` (:func:`epsilons_for_releases` at one δ)."""
    return epsilons_for_releases(releases, [delta], interval)[0]


def epsilon(
    N: int,
    q: float,
    B: int,
    sigma: float,
    steps: int,
    delta: float,
    interval: float = pld.DEFAULT_INTERVAL,
) -> float:
    """ε(δ) after ``steps`` lots of the truncated Poisson-subsampled Gaussian
    (N, q = L/N, cap B, σ)."""
    return epsilon_for_releases([(("truncated", N, q, B, sigma), steps)], delta, interval)


def replace_one_poisson_epsilon(
    q: float, sigma: float, steps: int, delta: float, interval: float = pld.DEFAULT_INTERVAL
) -> float:
    """ε(δ) of ``steps`` Poisson lots (q, σ) under replace-one as dp_accounting 0.6.0's PLD accounts
    them (``from_gaussian_mechanism(..., neighboring_relation=REPLACE_ONE)``: the pair q·N(∓1, σ²) +
    (1 − q)·N(0, σ²), self-composed) — a reference for the replace-one samplers,
    not a charge here."""
    q, sigma, steps, delta = (
        check_q(q),
        check_sigma(2.0 * sigma),
        check_steps(steps),
        check_delta(delta),
    )
    h = float(interval)
    while (
        comp := compose_pmfs([(_replace_pmf(q, sigma, h), steps)], h)
    ) is None:  # noise σ/2·2 = σ
        h *= 2.0
        if h > MAX_INTERVAL:
            raise ValueError(
                "truncated: the composed privacy loss spans too many grid points; not served"
            )
    loss, c, above, _, inf_mass = comp
    return _epsilon(loss, c, above + inf_mass, delta)


def fixed_size_epsilon(
    gamma: float, sigma: float, steps: int, delta: float, interval: float = pld.DEFAULT_INTERVAL
) -> float:
    """ε(δ) after ``steps`` fixed-size lots (γ = L/N, σ), replace-one adjacency: the symmetric
    dominating pair of ``wor_pld.py``, composed by FFT."""
    gamma, sigma, steps = check_q(gamma, "gamma"), check_sigma(sigma), check_steps(steps)
    return epsilon_for_releases([(("wor", gamma, sigma), steps)], delta, interval)
