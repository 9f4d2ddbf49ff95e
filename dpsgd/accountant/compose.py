"""Composition of a training run's releases under one accountant, and the convention that says what
a lot with k separately clipped tensors is charged as.

A release is ``count`` lots of the Poisson-subsampled Gaussian mechanism with sampling rate q and
noise multiplier σ, each lot clipping ``groups = k`` tensors separately to C and adding N(0, σ²C²)
to each:

* ``"joint"`` (correct, default): the k noisy tensors of one lot are one Gaussian mechanism whose
  sensitivity is √k·C (each block has norm <= C), i.e. noise multiplier σ/√k, charged once per lot.
* ``"per_tensor"`` (the paper's original code): k mechanisms at σ per lot. This under-states ε (σ 2,
  q 0.01, 40 000 lots, k = 2, δ 1e-5: moments accountant ε 8.41 instead of 9.11, RDP 7.66 instead of
  8.33; ``python -m dpsgd.privacy --q 0.01 --sigma 2 --steps 40000 --groups 2 --convention
  per_tensor`` against ``--convention joint``) and is offered only to reproduce the paper's numbers.

The charged mechanisms [(q, σ_eff, n)] then compose: log moments add (Abadi et al. 2016, Thm 2.1)
and the tail bound gives ε (Thm 2.2); RDP curves add (Mironov 2017, Prop. 1) and convert to (ε, δ)
(Balle et al. 2020); PLDs convolve (FFT). Per-(q, σ) curves are cached in the accountant modules, so
a query costs a weighted sum plus a minimum (moments, RDP) or one FFT power per direction (PLD).
"""

from __future__ import annotations

import math

from .privacy_loss import pld
from .renyi import moments, rdp
from .limits import check_choice, check_sigma, check_steps

ACCOUNTANTS = ("moments", "rdp", "pld")
CONVENTIONS = ("joint", "per_tensor")


def charge(q: float, sigma: float, groups: int, convention: str) -> tuple[float, float, int]:
    """(q, σ_eff, mechanisms per lot) that one lot with ``groups`` clipped tensors is charged as."""
    if convention == "joint":
        return q, (sigma / math.sqrt(groups) if groups > 1 else sigma), 1
    check_choice(convention, "convention", CONVENTIONS)
    return q, sigma, groups


def mechanisms(entries, convention: str = "joint") -> list[tuple[float, float, int]]:
    """[(q, σ_eff, n)] charged for ``entries`` (objects with q, sigma, count, groups), merged by
    (q, σ_eff)."""
    check_choice(convention, "convention", CONVENTIONS)
    out: dict = {}
    for e in entries:
        q, s, per_lot = charge(e.q, e.sigma, e.groups, convention)
        if e.count:
            out[(q, s)] = out.get((q, s), 0) + e.count * per_lot
    return [(q, s, n) for (q, s), n in out.items()]


def curve(accountant: str, q: float, sigma: float):
    """One mechanism's per-lot curve: log moments α(λ), λ = 1..32 (moments) or RDP ε_α (rdp)."""
    if accountant == "moments":
        return moments.log_moments_unchecked(q, sigma, moments.PAPER_LAMBDAS)
    return rdp.rdp_curve(q, sigma, rdp.DEFAULT_ORDERS)


def total(accountant: str, mechs):
    """Σ n · curve(q, σ_eff) over the charged mechanisms (moments or RDP)."""
    out = 0.0
    for q, s, n in mechs:
        out = out + n * curve(accountant, q, s)
    return out


def _pld_servable(mechs) -> None:
    """The charged mechanisms within the PLD's ranges, named as charged (σ/√k, count·k)."""
    for _, s, n in mechs:
        check_sigma(s, "sigma/sqrt(groups)")
        check_steps(n, "count*groups")


def epsilon(mechs, delta: float, accountant: str, conversion: str = "improved"):
    """(ε, order) of the composed mechanisms at δ: order = λ* (moments), α* (rdp), None (pld);
    (0.0, None) when there is nothing to compose."""
    if not mechs:
        return 0.0, None
    if accountant == "pld":
        _pld_servable(mechs)
        return pld.epsilon_for_releases(mechs, delta), None
    if accountant == "moments":
        return moments.epsilon_from_log_moments(total(accountant, mechs), delta)
    return rdp.rdp_to_epsilon(rdp.DEFAULT_ORDERS, total(accountant, mechs), delta, conversion)


def epsilons(mechs, deltas, accountant: str, conversion: str = "improved") -> list[float]:
    """ε at each δ of ``deltas`` (the PLD is composed once for all of them)."""
    if accountant == "pld" and mechs:
        _pld_servable(mechs)
        return pld.epsilons_for_releases(mechs, deltas)
    return [epsilon(mechs, d, accountant, conversion)[0] for d in deltas]


def delta(mechs, epsilon: float, accountant: str, conversion: str = "improved"):
    """(δ, order) of the composed mechanisms at ε; (0.0, None) when there is nothing to compose."""
    if not mechs:
        return 0.0, None
    if accountant == "pld":
        _pld_servable(mechs)
        return pld.delta_for_releases(mechs, epsilon), None
    if accountant == "moments":
        return moments.delta_from_log_moments(total(accountant, mechs), epsilon)
    return rdp.rdp_to_delta(rdp.DEFAULT_ORDERS, total(accountant, mechs), epsilon, conversion)
