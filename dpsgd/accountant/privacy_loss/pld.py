"""Tight accounting: the privacy loss distribution (PLD) of the Poisson-subsampled Gaussian.

Privacy loss of one lot (q, σ), add-or-remove adjacency (Koskela, Jälkö & Honkela 2020; Zhu, Dong &
Wang 2022), with μ0 = N(0, σ²), μ = (1 − q)·μ0 + q·N(1, σ²): remove P = μ, Q = μ0; add P = μ0,
Q = μ; L(z) = ±log(1 − q + q·exp((2z − 1)/(2σ²))) and δ(ε) = E_P[(1 − e^{ε − L})_+]. The composed
guarantee is the maximum over the two directions, each composed over all lots.

The discrete PLD of one lot (connect the dots) is ``pld_lot.py``; the composition of many lots by
FFT is ``pld_fft.py``. This module composes releases [(q, σ, count), ...] both ways and answers
ε(δ) and δ(ε), choosing between the untilted composition and, for tiny δ (below TILT_BELOW = 1e-12,
or where the FFT round-off would set ε), the exponentially tilted one with δ-scaled tails. Both
return upper bounds; the ε returned satisfies δ(ε) <= δ in floating point too.

Details (the tiny-δ rules, where the tilt cannot reach): docs/ACCOUNTING.md,
"dpsgd/accountant/privacy_loss/pld.py".
"""

from __future__ import annotations

import math

import numpy as np

from ..limits import check_delta, check_epsilon, check_q, check_sigma, check_steps
from .pld_fft import _Composed, _lam
from .pld_lot import STEP_TAIL, TAIL_FRACTION, _T_GRID, _lot_interval, _step_tail, _z_tail

DEFAULT_INTERVAL = 1e-4  # h: spacing of the privacy-loss grid
TILT_BELOW = 1e-12  # δ below this: δ-scaled tails and the tilted FFT (module doc)
DIRECTIONS = ("remove", "add")


def _normalise(releases):
    merged: dict = {}
    for q, s, n in releases:
        q, s, n = check_q(q), check_sigma(s), check_steps(n)
        if n:
            merged[(q, s)] = merged.get((q, s), 0) + n
    return tuple((q, s, n) for (q, s), n in sorted(merged.items()))


def compose(releases, interval: float = DEFAULT_INTERVAL):
    """Composed PLDs (remove, add) of heterogeneous releases [(q, σ, count), ...]; None if empty.

    The untilted composition (δ >= TILT_BELOW); :func:`epsilon_for_releases` and
    :func:`delta_for_releases` switch to the tilted one for tiny δ.
    """
    rel = _normalise(releases)
    if not rel:
        return None
    return tuple(_Composed(rel, d, float(interval)) for d in DIRECTIONS)


def _serves(comp, delta: float) -> bool:
    """The untilted composition answers at δ: δ >= TILT_BELOW and its FFT round-off estimate is
    within the TAIL_FRACTION share of δ (long compositions: T·eps grows with the lots)."""
    return delta >= TILT_BELOW and comp.noise <= TAIL_FRACTION * delta


def _epsilon_tiny(rel, direction, interval, delta):
    """ε(δ) of one direction where the untilted composition does not serve δ: δ-scaled tails,
    tilted at the Chernoff θ for δ."""
    z_tail = _z_tail(_step_tail(delta, sum(n for _, _, n in rel)))
    comp = _Composed(rel, direction, interval, z_tail, delta=delta)
    eps = comp.epsilon(delta)
    if eps < comp.floor:  # answer below the tilted window: not resolved there;
        comp = _Composed(rel, direction, interval, z_tail)  # untilted, its round-off added to δ
        comp.extra += comp.noise
        eps = comp.epsilon(delta)
    return eps, comp


def _epsilon_one(rel, direction, interval, delta, comp=None):
    """(ε(δ), the composition that answered) of one direction: the untilted composition ``comp``
    where it serves δ, else the tilted one; where the tilted one had to take a coarser grid than
    the untilted one, the smaller of it and the untilted answer with its round-off added to δ
    (both upper bounds: ε does not jump where the tilted path takes over, ``_with_round_off``)."""
    if delta >= TILT_BELOW:
        comp = comp if comp is not None else _Composed(rel, direction, interval)
        if _serves(comp, delta):
            return comp.epsilon(delta), comp
    eps, tilted = _epsilon_tiny(rel, direction, interval, delta)
    if delta >= TILT_BELOW and tilted.h > comp.h:
        flat = _with_round_off(comp, delta)
        if flat < eps:
            return flat, comp
    return eps, tilted


def _with_round_off(comp, delta: float) -> float:
    """ε(δ) of the untilted composition ``comp`` with its FFT round-off estimate added to δ: an
    upper bound wherever δ exceeds the round-off (∞ below it)."""
    return comp.epsilon(delta - comp.noise)  # ∞ where nothing of δ is left


def _delta_tiny(rel, direction, interval, eps, untilted):
    """δ(ε) of one direction where the untilted composition does not serve its own answer
    ``untilted`` (a _Composed): tilted at θ for ε."""
    lots = sum(n for _, _, n in rel)
    h = _lot_interval(rel, direction, interval, _z_tail(STEP_TAIL))
    lam = _lam(rel, h, direction, _z_tail(STEP_TAIL))
    tp = _T_GRID > 0
    est = math.exp(min(0.0, float(np.min(lam[tp] - _T_GRID[tp] * eps))))  # Chernoff bound on δ(ε)
    comp = _Composed(rel, direction, interval, _z_tail(_step_tail(max(est, 1e-300), lots)), eps=eps)
    flat = min(1.0, untilted.delta(eps) + untilted.noise)  # round-off added: an upper bound
    if eps < comp.floor:
        return flat
    return min(flat, comp.delta(eps))  # both are upper bounds


def epsilon_for_releases(releases, delta: float, interval: float = DEFAULT_INTERVAL) -> float:
    """ε(δ) of a heterogeneous composition: max over the two adjacency directions (upper bound)."""
    delta = check_delta(delta)
    rel = _normalise(releases)
    if not rel:
        return 0.0
    return max(_epsilon_one(rel, d, float(interval), delta)[0] for d in DIRECTIONS)


def grid_step(releases, delta: float, interval: float = DEFAULT_INTERVAL) -> float:
    """The privacy-loss grid spacing h behind ε(δ) (the coarser of the two directions): h starts
    at ``interval`` and doubles where a lot's or the composed loss needs too many points."""
    delta = check_delta(delta)
    rel = _normalise(releases)
    if not rel:
        return float(interval)
    return max(_epsilon_one(rel, d, float(interval), delta)[1].h for d in DIRECTIONS)


def epsilons_for_releases(releases, deltas, interval: float = DEFAULT_INTERVAL) -> list[float]:
    """ε(δ) for each δ of ``deltas``, composing the untilted PLDs once for all δ >= TILT_BELOW."""
    deltas = [check_delta(d) for d in deltas]
    rel = _normalise(releases)
    if not rel:
        return [0.0] * len(deltas)
    interval = float(interval)
    comp = (
        [_Composed(rel, d, interval) for d in DIRECTIONS]
        if any(d >= TILT_BELOW for d in deltas)
        else [None] * 2
    )
    return [
        max(_epsilon_one(rel, d, interval, x, c)[0] for d, c in zip(DIRECTIONS, comp))
        for x in deltas
    ]


def delta_for_releases(releases, epsilon: float, interval: float = DEFAULT_INTERVAL) -> float:
    """δ(ε) of a heterogeneous composition: max over the two adjacency directions (upper bound)."""
    epsilon = check_epsilon(epsilon)
    rel = _normalise(releases)
    if not rel:
        return 0.0
    out = 0.0
    for d in DIRECTIONS:
        comp = _Composed(rel, d, float(interval))
        v = comp.delta(epsilon)
        if not _serves(comp, v):
            v = _delta_tiny(rel, d, float(interval), epsilon, comp)
        out = max(out, v)
    return out


def epsilon(
    q: float, sigma: float, steps: int, delta: float, interval: float = DEFAULT_INTERVAL
) -> float:
    """ε(δ) after ``steps`` lots of the Poisson-subsampled Gaussian (PLD, connect-the-dots, FFT)."""
    q, sigma, steps, delta = check_q(q), check_sigma(sigma), check_steps(steps), check_delta(delta)
    return epsilon_for_releases([(q, sigma, steps)], delta, interval)


def delta(
    q: float, sigma: float, steps: int, epsilon: float, interval: float = DEFAULT_INTERVAL
) -> float:
    """δ(ε) after ``steps`` lots of the Poisson-subsampled Gaussian (PLD, connect-the-dots, FFT)."""
    q, sigma, steps, epsilon = (
        check_q(q),
        check_sigma(sigma),
        check_steps(steps),
        check_epsilon(epsilon),
    )
    return delta_for_releases([(q, sigma, steps)], epsilon, interval)
