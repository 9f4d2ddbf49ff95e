"""PLD accountant: dp_accounting 0.6, the exact Gaussian mechanism, ordering, monotonicity."""

import math

import pytest
from scipy import optimize, special

from dpsgd.accountant import moments, pld, rdp

dpa = pytest.importorskip("dp_accounting")
from dp_accounting.pld import PLDAccountant  # noqa: E402

DELTA = 1e-5
GRID = [(q, s, t) for q in (0.001, 0.01, 0.1) for s in (0.7, 1.0, 4.0) for t in (1, 100, 10_000)]
FAST = [(0.01, 4.0, 10_000), (0.1, 4.0, 100), (0.001, 1.0, 100), (0.01, 1.0, 1)]


def _dpa_epsilon(q, sigma, steps):
    acc = PLDAccountant(value_discretization_interval=1e-4)
    acc.compose(dpa.PoissonSampledDpEvent(q, dpa.GaussianDpEvent(sigma)), steps)
    return acc.get_epsilon(DELTA)


# dp_accounting's PLD discretises differently (its own grid rounding, the same interval 1e-4):
# the two upper bounds agree to 0.5 %, far below what a wrong q or σ would move
@pytest.mark.parametrize("q,sigma,steps", FAST)
def test_matches_dp_accounting(q, sigma, steps):
    assert pld.epsilon(q, sigma, steps, DELTA) == pytest.approx(
        _dpa_epsilon(q, sigma, steps), rel=5e-3
    )


@pytest.mark.slow
@pytest.mark.parametrize("q,sigma,steps", [g for g in GRID if g not in FAST])
def test_matches_dp_accounting_grid(q, sigma, steps):
    assert pld.epsilon(q, sigma, steps, DELTA) == pytest.approx(
        _dpa_epsilon(q, sigma, steps), rel=5e-3
    )


def _gaussian_epsilon(mu, delta):
    """Exact ε of a Gaussian mechanism with sensitivity/σ = mu (Balle & Wang 2018, Thm 8)."""
    f = lambda e: (
        special.ndtr(-e / mu + mu / 2) - math.exp(e) * special.ndtr(-e / mu - mu / 2) - delta
    )
    return optimize.brentq(f, 0.0, 100.0, xtol=1e-13)


@pytest.mark.parametrize("sigma,steps", [(1.0, 1), (4.0, 100), (10.0, 1000)])
def test_q_one_is_gaussian_mechanism_upper_bound(sigma, steps):
    exact = _gaussian_epsilon(math.sqrt(steps) / sigma, DELTA)  # T Gaussians = one at σ/√T
    ours = pld.epsilon(1.0, sigma, steps, DELTA)
    assert exact <= ours <= exact + 1e-3


def test_delta_epsilon_inverse_and_upper_bound_in_delta():
    eps = pld.epsilon(0.01, 1.0, 1000, DELTA)
    # δ(ε(δ)) on the same discrete PLD: inverted by interpolation between grid points
    assert pld.delta(0.01, 1.0, 1000, eps) == pytest.approx(DELTA, rel=1e-6)


@pytest.mark.parametrize(
    "q,sigma,steps", [(0.01, 4.0, 10_000), (0.1, 1.0, 100), (0.001, 0.7, 1000), (0.01, 2.0, 70_000)]
)
def test_ordering_pld_rdp_moments(q, sigma, steps):
    e_pld = pld.epsilon(q, sigma, steps, DELTA)
    e_rdp = rdp.epsilon(q, sigma, steps, DELTA)[0]
    e_mom = moments.epsilon(q, sigma, steps, DELTA)[0]
    assert e_pld <= e_rdp <= e_mom


def test_monotone_in_steps_every_epoch():
    # as the training loop sees it: ε after every epoch (100 lots) must never go down,
    # including where the grid coarsens (h doubles) as the window grows
    eps = [pld.epsilon(0.01, 1.0, 100 * e, DELTA) for e in range(1, 301, 7)]
    assert all(b >= a for a, b in zip(eps, eps[1:]))
    hs = {pld.compose([(0.01, 1.0, 100 * e)])[0].h for e in range(1, 301, 7)}
    assert len(hs) >= 2, "the test should cross a change of discretisation interval"


def test_monotone_in_sigma():
    eps = [pld.epsilon(0.01, s, 1000, DELTA) for s in (0.7, 1, 2, 4, 8)]
    assert all(a > b for a, b in zip(eps, eps[1:]))


def test_finer_grid_is_tighter_and_close():
    coarse = pld.epsilon(0.01, 1.0, 1000, DELTA, interval=4e-4)
    fine = pld.epsilon(0.01, 1.0, 1000, DELTA, interval=1e-4)
    assert fine <= coarse <= fine * 1.001


def test_heterogeneous_composition():
    sgd = pld.epsilon_for_releases([(0.01, 4.0, 1000)], DELTA)
    both = pld.epsilon_for_releases([(1.0, 8.0, 1), (0.01, 4.0, 1000)], DELTA)
    assert both > sgd
    # same release split in two records composes to the same thing: bit-identical, since the two
    # records are merged into one release (0.01, 4.0, 1000) before anything is computed
    assert pld.epsilon_for_releases([(0.01, 4.0, 400), (0.01, 4.0, 600)], DELTA) == sgd


def test_zero_steps_is_zero():
    assert pld.epsilon(0.01, 1.0, 0, DELTA) == 0.0
