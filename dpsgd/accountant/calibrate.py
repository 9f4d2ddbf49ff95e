"""Calibration: the noise multiplier σ for a target (ε, δ), and the number of lots within a budget.

Both are monotone searches over an accountant (ε grows with the number of lots and falls with σ),
built so that they never overshoot the target: the σ returned always has ε(σ) <= target.
"""
from __future__ import annotations

import math

from . import moments as _moments
from . import strong_composition as _sc
from ._checks import (SIGMA_MAX, SIGMA_MIN, check_choice, check_delta, check_epsilon, check_groups, check_q,
                      check_sigma, check_steps)
from .ledger import ACCOUNTANTS, CONVENTIONS, Ledger

CALIBRATABLE = ACCOUNTANTS + ("strong_composition", "strong_composition_valid")


def epsilon(q: float, sigma: float, steps: int, delta: float, accountant: str = "rdp", groups: int = 1,
            convention: str = "joint") -> float:
    """ε after ``steps`` lots (q, σ, groups) under ``accountant`` (any of :data:`CALIBRATABLE`)."""
    q, sigma, steps, delta = check_q(q), check_sigma(sigma), check_steps(steps), check_delta(delta)
    groups = check_groups(groups)
    check_choice(accountant, "accountant", CALIBRATABLE)
    check_choice(convention, "convention", CONVENTIONS)
    if accountant.startswith("strong_composition"):
        s_eff, n = (sigma / math.sqrt(groups), steps) if convention == "joint" else (sigma, steps * groups)
        s_eff = check_sigma(s_eff, "sigma/sqrt(groups)")
        n = check_steps(n, "steps*groups")
        variant = "valid" if accountant.endswith("_valid") else "paper"
        return _sc.epsilon(q, s_eff, n, delta, variant)
    led = Ledger()
    led.record(q, sigma, steps, groups)
    return led.epsilon(delta, accountant, convention)[0]


def sigma_for_epsilon(target_epsilon: float, delta: float, q: float, steps: int, accountant: str = "rdp",
                      groups: int = 1, convention: str = "joint", rtol: float = 0.005) -> float:
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
        floor = math.log(1.0 / delta) / lam_max          # Abadi et al. 2016, Thm 2.2 with α(λ) >= 0
        if target < floor:
            raise ValueError(f"moments: target_epsilon={target_epsilon!r} is below the moments accountant's floor "
                             f"log(1/delta)/{lam_max} = {floor:.4g} (lambda <= {lam_max}); no sigma reaches it")
    eps = lambda s: epsilon(q, s, steps, delta, accountant, groups, convention)
    lo, hi = 0.5, 1.0
    while eps(hi) > target:
        if hi >= SIGMA_MAX:
            raise ValueError(f"{accountant}: target_epsilon={target_epsilon!r} is not reachable with "
                             f"sigma <= {SIGMA_MAX:g} (SIGMA_MAX)")
        lo, hi = hi, min(hi * 2.0, SIGMA_MAX)
    while eps(lo) <= target:
        if lo <= SIGMA_MIN:
            raise ValueError(f"{accountant}: target_epsilon={target_epsilon!r} is met at every sigma >= "
                             f"{SIGMA_MIN:g} (SIGMA_MIN); too large to calibrate")
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


def max_steps(target_epsilon: float, delta: float, q: float, sigma: float, accountant: str = "rdp",
              groups: int = 1, convention: str = "joint", ledger: Ledger | None = None) -> int:
    """Largest number of further lots (q, σ, groups) keeping ε <= target (after ``ledger``, if any)."""
    led = ledger if ledger is not None else Ledger()
    return led.steps_within(target_epsilon, delta, q, sigma, groups, accountant, convention)


def max_epochs(target_epsilon: float, delta: float, q: float, sigma: float, accountant: str = "rdp",
               groups: int = 1, convention: str = "joint", ledger: Ledger | None = None) -> int:
    """Largest whole number of epochs (1/q lots each) keeping ε <= target."""
    q = check_q(q)
    n = max_steps(target_epsilon, delta, q, sigma, accountant, groups, convention, ledger)
    return int(math.floor(n * q + 1e-9))
