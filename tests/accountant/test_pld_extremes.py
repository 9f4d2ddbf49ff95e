"""PLD at tiny σ (losses above 700) and tiny δ: never below the exact ε, and still tight.

Independent references: the exact privacy profile of one lot of the Poisson-subsampled Gaussian,
δ(ε) = max over the two directions of P(L > ε) − e^ε Q(L > ε) with the threshold z(ε) in closed
form, evaluated with 60-digit mpmath (no discretisation, no FFT); and the exact Gaussian mechanism
at q = 1 (Balle & Wang 2018, Thm 8; T lots = one Gaussian at σ/√T). Our ε is checked from both
sides through δ, which is monotone: δ_exact(ε_ours) <= δ (never optimistic) and
δ_exact(ε_ours − tol) > δ (tight to tol).
"""

import math

import mpmath as mp
import pytest
from scipy import optimize

from dpsgd.accountant import pld, rdp
from dpsgd.accountant import strong_composition as sc
from tolerances import EPS64, pld_epsilon_tol, pld_grid_step


def _exact_delta(eps, q, sigma):
    """δ(ε) of one lot (q, σ), add-or-remove adjacency, exact to 60 digits (module doc of pld)."""
    with mp.workdps(60):
        q, s, e = mp.mpf(q), mp.mpf(sigma), mp.mpf(eps)
        # remove: P = (1−q)N(0,σ²) + qN(1,σ²), Q = N(0,σ²); L > ε ⇔ z > t
        t = s * s * (mp.log(mp.exp(e) - 1 + q) - mp.log(q)) + mp.mpf(1) / 2
        rem = (1 - q) * mp.ncdf(-t / s) + q * mp.ncdf((1 - t) / s) - mp.exp(e) * mp.ncdf(-t / s)
        add = mp.mpf(0)
        if q < 1 and e < -mp.log(1 - q):  # add: P = N(0,σ²), Q = the mixture; L > ε ⇔ z < t
            t = s * s * (mp.log(mp.exp(-e) - 1 + q) - mp.log(q)) + mp.mpf(1) / 2
            add = mp.ncdf(t / s) - mp.exp(e) * ((1 - q) * mp.ncdf(t / s) + q * mp.ncdf((t - 1) / s))
        return max(rem, add)


# σ ∈ {0.02, 0.03, 0.05} (single-lot losses 1250, 555, 200, up to ~1700) × δ ∈ {1e-14, 1e-20},
# and small-loss corners (tiny q or large σ) at tiny δ
GRID = [(q, s, d) for q, s in ((0.01, 0.02), (0.5, 0.03), (1.0, 0.05)) for d in (1e-14, 1e-20)] + [
    (1e-6, 1.0, 1e-14),
    (0.01, 4.0, 1e-14),
    (0.001, 2.0, 1e-30),
    (0.1, 1.0, 1e-50),
]


@pytest.mark.parametrize("q,sigma,delta", GRID)
def test_tiny_sigma_tiny_delta_never_below_exact(q, sigma, delta):
    ours = pld.epsilon(q, sigma, 1, delta)
    assert math.isfinite(ours)
    assert _exact_delta(ours, q, sigma) <= delta  # an upper bound on ε
    # tight: within 1e-3 relative, or two grid steps h where ε itself is that small
    assert _exact_delta(ours - max(1e-3 * ours, 2 * pld.DEFAULT_INTERVAL), q, sigma) > delta
    if sigma < 0.1:
        assert _exact_delta(ours * (1 - 1e-6), q, sigma) > delta  # within 1e-6 at large ε


def test_tiny_loss_tiny_delta_is_not_zero():
    # one lot at q = 1e-12, σ = 1e6 has δ(0) = q·TV(N(1, σ²), N(0, σ²)) ≈ 4e-19 > 1e-100, so ε > 0;
    # P(I) − e^ε Q(I) (~1e-19) must not be lost in (1 − q)·Q(I) − Q(I) round-off
    eps = pld.epsilon(1e-12, 1e6, 1, 1e-100)
    assert 0.0 < eps <= 2 * pld.DEFAULT_INTERVAL


def _gaussian_epsilon(sigma, delta):
    f = lambda e: sc.gaussian_delta(e, sigma) - delta
    hi = 1.0
    while f(hi) > 0:
        hi *= 2.0
    return optimize.brentq(f, 0.0, hi, xtol=1e-12, rtol=4 * EPS64)  # as tight as brentq allows


@pytest.mark.parametrize(
    "sigma,steps,delta,tol",
    [
        (0.032, 1, 1e-5, 1e-5),  # e^ε overflows at these losses; exact 620.62
        (0.02, 1, 1e-5, 1e-5),  # a per-lot grid beyond e^700: log-space masses
        (4.0, 100, 1e-20, 1e-4),  # composition (FFT, tilted) at tiny δ
    ],
)
def test_q_one_tiny_sigma_and_delta_against_exact_gaussian(sigma, steps, delta, tol):
    exact = _gaussian_epsilon(sigma / math.sqrt(steps), delta)
    ours = pld.epsilon(1.0, sigma, steps, delta)
    assert exact <= ours <= exact * (1 + tol)


def test_small_sigma_subsampled_composition_not_optimistic():
    # dp_accounting's PLD says 1737.3. ε cannot fall below one lot's exact ε (a composition that
    # loses the large losses to overflow or truncation would report ~0.1).
    ours = pld.epsilon(0.01, 0.03, 10, 1e-5)
    one = pld.epsilon(0.01, 0.03, 1, 1e-5)
    assert _exact_delta(one, 0.01, 0.03) <= 1e-5
    assert one <= ours <= rdp.epsilon(0.01, 0.03, 10, 1e-5)[0]
    # dp_accounting's value to 5 digits; the two discretisations differ by 0.05 % here
    assert ours == pytest.approx(1737.3, rel=2e-3)


def test_tiny_delta_is_tight_and_consistent():
    # with tails and FFT round-off of ~1e-15 added to δ, δ = 1e-14 would give 4.167; RDP gives
    # 1.946 / 2.373 and dp_accounting's PLD (tails 1e-15) 1.891 at 1e-14
    e14 = pld.epsilon(0.01, 4.0, 10_000, 1e-14)
    e20 = pld.epsilon(0.01, 4.0, 10_000, 1e-20)
    assert 1.85 < e14 < 1.891 and e14 < rdp.epsilon(0.01, 4.0, 10_000, 1e-14)[0]
    assert e14 < e20 < rdp.epsilon(0.01, 4.0, 10_000, 1e-20)[0]
    for d, e in ((1e-14, e14), (1e-20, e20)):  # the δ query (tilted at θ for ε) inverts it
        # tiny δ: the tilted composition's tails are budgeted at TAIL_FRACTION = 1e-3 of δ
        assert pld.delta(0.01, 4.0, 10_000, e) == pytest.approx(d, rel=1e-3)
    assert math.isfinite(pld.epsilon(0.01, 4.0, 10_000, 1e-100))


# ε on this machine, and on another CPU (AMD EPYC, AVX2, no AVX-512) where the last bits of
# exp/log/FFT differ; both are valid upper bounds and must both pass. At δ = 1e-10 the untilted
# FFT's round-off (~6e-13 after 1000 lots) exceeds the 1e-3 share of δ, so the tilted composition
# answers (165.68272; untilted, as on the other CPU: 165.68442 here, 165.68629 there)
ORDINARY = [
    ((0.01, 4.0, 10_000, 1e-5), 0.9469993042704778, 0.9469993067888189),
    ((0.1, 1.0, 100, 1e-5), 7.046602876973897, None),
    ((0.001, 0.7, 1000, 1e-5), 0.6089572519518623, None),
    ((0.1, 0.5, 1000, 1e-10), 165.6827162026351, None),
]


@pytest.mark.parametrize("args,want,other_cpu", ORDINARY)
def test_ordinary_parameters_unchanged(args, want, other_cpu):
    tol = pld_epsilon_tol([args[:3]], delta=args[3])  # the accountant's own grid at δ: 2 steps h
    assert pld.epsilon(*args) == pytest.approx(want, abs=tol)
    if other_cpu is not None:  # the tolerance admits the other CPU's answer
        assert other_cpu == pytest.approx(want, abs=tol)


def test_grid_step_tolerance_is_meaningful():
    # the tolerance is a grid step of the accountant, far below any change of the mechanism:
    # one lot more or 1 % more noise moves ε by many steps
    rel = [(0.01, 4.0, 10_000)]
    assert (
        pld_grid_step(rel) == pld.DEFAULT_INTERVAL
        and pld_grid_step([(0.1, 0.5, 1000)]) == 16 * pld.DEFAULT_INTERVAL
    )
    e = pld.epsilon(0.01, 4.0, 10_000, 1e-5)
    assert pld.epsilon(0.01, 4.04, 10_000, 1e-5) < e - 10 * pld_epsilon_tol(rel)


def test_grid_too_coarse_is_refused_by_name():
    with pytest.raises(ValueError, match="pld"):
        pld.epsilon(0.01, 0.01, 10**9, 1e-5)
