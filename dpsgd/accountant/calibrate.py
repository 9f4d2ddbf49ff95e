"""Calibration: the noise multiplier σ for a target (ε, δ), and the number of lots within a budget.

Both are monotone searches over an accountant (ε grows with the number of lots and falls with σ),
built so that they never overshoot the target: the σ returned always has ε(σ) <= target, and the
number of lots n returned always has ε(n) <= target < ε(n + 1) (the training budget stop).
"""

from __future__ import annotations

import math

import numpy as np

from . import compose
from .renyi import moments as _moments
from . import strong_composition as _sc
from .limits import (
    SIGMA_MAX,
    SIGMA_MIN,
    STEPS_MAX,
    check_choice,
    check_delta,
    check_epsilon,
    check_groups,
    check_q,
    check_sigma,
    check_steps,
)
from .compose import ACCOUNTANTS, CONVENTIONS
from .renyi.rdp import CONVERSIONS, DEFAULT_ORDERS

CALIBRATABLE = ACCOUNTANTS + ("strong_composition", "strong_composition_valid")


def epsilon(
    q: float,
    sigma: float,
    steps: int,
    delta: float,
    accountant: str = "rdp",
    groups: int = 1,
    convention: str = "joint",
) -> float:
    """ε after ``steps`` Poisson lots.

    Args:
        q: the sampling rate L/N. sigma: the noise multiplier σ. steps: the lots T.
        delta: δ. accountant: any of :data:`CALIBRATABLE`. groups: k clipped groups per lot.
        convention: ``joint`` or ``per_tensor``.

    Returns:
        ε (float).
    """
    q, sigma, steps, delta = check_q(q), check_sigma(sigma), check_steps(steps), check_delta(delta)
    groups = check_groups(groups)
    check_choice(accountant, "accountant", CALIBRATABLE)
    check_choice(convention, "convention", CONVENTIONS)
    q, s_eff, per_lot = compose.charge(q, sigma, groups, convention)
    if accountant.startswith("strong_composition"):
        s_eff = check_sigma(s_eff, "sigma/sqrt(groups)")
        n = check_steps(steps * per_lot, "steps*groups")
        variant = "valid" if accountant.endswith("_valid") else "paper"
        return _sc.epsilon(q, s_eff, n, delta, variant)
    return compose.epsilon([(q, s_eff, steps * per_lot)] if steps else [], delta, accountant)[0]


def sigma_for_epsilon(
    target_epsilon: float,
    delta: float,
    q: float,
    steps: int,
    accountant: str = "rdp",
    groups: int = 1,
    convention: str = "joint",
    rtol: float = 0.005,
) -> float:
    """Smallest σ (to within ``rtol`` in ε) with ε(σ) <= target_epsilon after ``steps`` lots.

    Bisection on log σ keeping ε(σ_hi) <= target; stops when ε(σ_hi) >= (1 − rtol)·target (so the
    calibrated ε is within rtol of the target from below) or the bracket is below 1e-12 relative.
    σ is searched in [SIGMA_MIN, SIGMA_MAX]; a target outside what that range can give is refused
    with a ValueError naming the accountant (for the moments accountant: its floor
    log(1/δ)/max λ, which no σ can go below, since every log moment α(λ) >= 0).
    """
    target = check_epsilon(target_epsilon, "target_epsilon")
    delta, q, steps = check_delta(delta), check_q(q), check_steps(steps)
    check_choice(accountant, "accountant", CALIBRATABLE)
    if steps < 1:
        raise ValueError(f"steps must be >= 1 to calibrate sigma, got steps={steps!r}")
    if not 0.0 < rtol < 1.0:
        raise ValueError(f"rtol must be in (0, 1), got rtol={rtol!r}")
    if accountant == "moments":
        lam_max = max(_moments.PAPER_LAMBDAS)
        floor = math.log(1.0 / delta) / lam_max  # Abadi et al. 2016, Thm 2.2 with α(λ) >= 0
        if target < floor:
            raise ValueError(
                f"moments: target_epsilon={target_epsilon!r} is below the moments accountant's "
                f"floor log(1/delta)/{lam_max} = {floor:.4g} (lambda <= {lam_max}); no sigma "
                "reaches it"
            )
    return smallest_sigma(
        lambda s: epsilon(q, s, steps, delta, accountant, groups, convention),
        target,
        rtol,
        accountant,
    )


def smallest_sigma(eps, target: float, rtol: float = 0.005, name: str = "epsilon") -> float:
    """The one σ search: the smallest σ (to within ``rtol`` in ε) with ``eps(σ)`` <= target, for any
    ε(σ) that does not increase with σ (a ledger's ε after a run's charges at noise σ).

    Brackets by doubling and halving from [0.5, 1] inside [SIGMA_MIN, SIGMA_MAX], then bisects on
    log σ keeping ε(σ_hi) <= target; stops when ε(σ_hi) >= (1 − rtol)·target (the calibrated ε is
    within rtol of the target from below) or the bracket is below 1e-12 relative. ValueError, naming
    ``name``, when no σ in range reaches the target or every σ does."""
    lo, hi = 0.5, 1.0
    while eps(hi) > target:
        if hi >= SIGMA_MAX:
            raise ValueError(
                f"{name}: target_epsilon={target!r} is not reachable with "
                f"sigma <= {SIGMA_MAX:g} (SIGMA_MAX)"
            )
        lo, hi = hi, min(hi * 2.0, SIGMA_MAX)
    while eps(lo) <= target:
        if lo <= SIGMA_MIN:
            raise ValueError(
                f"{name}: target_epsilon={target!r} is met at every sigma >= "
                f"{SIGMA_MIN:g} (SIGMA_MIN); too large to calibrate"
            )
        lo, hi = max(lo / 2.0, SIGMA_MIN), lo
    e_hi = eps(hi)
    while e_hi < (1.0 - rtol) * target and (hi - lo) > 1e-12 * hi:
        mid = math.sqrt(lo * hi)
        e_mid = eps(mid)
        if e_mid <= target:
            hi, e_hi = mid, e_mid
        else:
            lo = mid
    return hi


def steps_within(
    entries,
    target_epsilon: float,
    delta: float,
    q: float,
    sigma: float,
    groups: int = 1,
    accountant: str = "moments",
    convention: str = "joint",
    conversion: str = "improved",
) -> int:
    """Largest n >= 0 such that ε after ``entries`` (a ledger's records) and n more lots (q, σ,
    groups) is <= target.

    Moments / RDP: ε(n) = min_order (A + n·a + c)/…, solved per order in closed form and then
    checked exactly. PLD: safeguarded regula falsi on n, bracketed from the RDP answer
    (PLD ε <= RDP ε), doubling upwards. The answer is capped where the total number of lots
    would pass STEPS_MAX (more than that is not served by the accountants).
    """
    target = check_epsilon(target_epsilon, "target_epsilon")
    delta = check_delta(delta)
    q, sigma, groups = check_q(q), check_sigma(sigma), check_groups(groups)
    check_choice(accountant, "accountant", ACCOUNTANTS)
    check_choice(convention, "convention", CONVENTIONS)
    check_choice(conversion, "conversion", CONVERSIONS)
    base = compose.mechanisms(entries, convention)
    new = compose.charge(q, sigma, groups, convention)  # (q, σ_eff, mechanisms per lot)

    cap = max(0, (STEPS_MAX - sum(n for _, _, n in base)) // new[2])

    def eps_at(n, acc=accountant):
        m = base + ([(new[0], new[1], n * new[2])] if n else [])
        return compose.epsilon(m, delta, acc, conversion)[0]

    if eps_at(0) > target:
        return 0
    if accountant == "pld":
        rdp_lo = min(steps_within(entries, target, delta, q, sigma, groups, "rdp", convention), cap)
        return _pld_steps(eps_at, target, rdp_lo, cap)
    return _affine_steps(eps_at, target, delta, accountant, conversion, base, new, cap)


def _pld_steps(eps_at, target: float, lo: int, cap: int) -> int:
    """PLD: the largest n <= cap with ε(n) <= target, by safeguarded regula falsi on the integers,
    bracketed upwards from ``lo`` (the RDP answer: PLD ε <= RDP ε) by doubling."""
    e_lo = eps_at(lo)
    if e_lo > target:  # PLD above RDP (round-off, or a coarse grid at huge T)
        lo, e_lo = 0, eps_at(0)
    if lo >= cap:
        return cap
    step = max(1, lo // 2)
    hi = min(lo + step, cap)
    e_hi = eps_at(hi)
    while e_hi <= target:
        if hi >= cap:
            return cap
        lo, e_lo, step = hi, e_hi, step * 2
        hi = min(lo + step, cap)
        e_hi = eps_at(hi)
    # Illinois (regula falsi) on the integers, f = ε − target: f(lo) <= 0 < f(hi)
    f_lo, f_hi, last = e_lo - target, e_hi - target, 0
    while hi - lo > 1:
        mid = lo + int(round(-f_lo / (f_hi - f_lo) * (hi - lo))) if f_hi > f_lo else (lo + hi) // 2
        mid = min(max(mid, lo + 1), hi - 1)
        f_mid = eps_at(mid) - target
        if f_mid <= 0:
            lo, f_lo = mid, f_mid
            if last == 1:
                f_hi /= 2.0
            last = 1
        else:
            hi, f_hi = mid, f_mid
            if last == -1:
                f_lo /= 2.0
            last = -1
    return lo


def _affine_steps(
    eps_at, target: float, delta: float, accountant: str, conversion: str, base, new, cap: int
) -> int:
    """Moments / RDP: per order the bound is affine in n, so n is solved in closed form per order
    (moments: Abadi et al. 2016, Thm 2; RDP: Mironov 2017, Prop. 3, or the improved conversion of
    rdp.py), then checked against eps_at."""
    per = compose.curve(accountant, new[0], new[1]) * new[2]
    tot = compose.total(accountant, base) if base else np.zeros_like(per)
    if accountant == "moments":
        lam = np.asarray(_moments.PAPER_LAMBDAS, dtype=float)
        slack = lam * target - math.log(1.0 / delta) - tot  # need n·per <= slack
    else:
        a = np.asarray(DEFAULT_ORDERS, dtype=float)
        if conversion == "paper":
            c = -math.log(delta) / (a - 1.0)
        else:
            c = np.log1p(-1.0 / a) - (math.log(delta) + np.log(a)) / (a - 1.0)
        slack = target - c - tot
    with np.errstate(divide="ignore", invalid="ignore"):
        n_est = np.where(per > 0, np.floor(slack / per), np.where(slack >= 0, np.inf, -1))
    n = int(min(float(np.max(n_est)), cap))
    n = max(n, 0)
    while n > 0 and eps_at(n) > target:  # guard against rounding at the boundary
        n -= 1
    while n < cap and eps_at(n + 1) <= target:  # (e.g. the RDP ε = 0 special case)
        n += 1
    return n


def max_steps(
    target_epsilon: float,
    delta: float,
    q: float,
    sigma: float,
    accountant: str = "rdp",
    groups: int = 1,
    convention: str = "joint",
    ledger=None,
) -> int:
    """Largest number of further lots (q, σ, groups) keeping ε <= target
    (after ``ledger``, if any)."""
    return steps_within(
        ledger.entries if ledger is not None else (),
        target_epsilon,
        delta,
        q,
        sigma,
        groups,
        accountant,
        convention,
    )


def max_epochs(
    target_epsilon: float,
    delta: float,
    q: float,
    sigma: float,
    accountant: str = "rdp",
    groups: int = 1,
    convention: str = "joint",
    ledger=None,
) -> int:
    """Largest whole number of epochs (``lots_per_epoch(1, q)`` lots each) keeping ε <= target."""
    q = check_q(q)
    n = max_steps(target_epsilon, delta, q, sigma, accountant, groups, convention, ledger)
    return n // lots_per_epoch(1, q)


def lots_per_epoch(N: float, L: float = 1.0) -> int:
    """Lots in one epoch of Poisson-sampled lots of expected size L from N examples: N/L (= 1/q),
    rounded to the nearest whole lot, at least one. The epoch the training loop runs
    (sampling.PoissonSampler); with only q known, ``lots_per_epoch(1, q)``."""
    return max(1, round(N / L))


def lots_for_epochs(epochs: float, N: float, L: float = 1.0) -> int:
    """Lots T in ``epochs`` epochs: epochs × ``lots_per_epoch(N, L)``, a fraction of an epoch
    rounded up to whole lots."""
    per = lots_per_epoch(N, L)
    if float(epochs).is_integer():
        return int(epochs) * per
    return int(math.ceil(epochs * per - 1e-9))
