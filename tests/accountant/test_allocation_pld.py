"""Random allocation by PLD (dpsgd/accountant/privacy_loss/allocation_pld.py) against PLD_accounting
2.0 (Feldman & Shenfeld 2026, arXiv 2602.17284: tight upper and lower PLD bounds for the same pair),
the Gaussian closed form (t = 1) and the pmf's own invariants.

REFERENCE was produced by `python -m experiments.allocation_pld --reference` in a venv with
pld-accounting 2.0 and numba 0.68.1 (their ``gaussian_allocation_epsilon_range``, default accuracy;
Poisson: dp_accounting 0.6.0's PLD at q = 1/t over t·E lots, value_discretization_interval 1e-4).
The library is not a dependency of this repository; only its outputs are pinned here (and in
results/allocation_pld.csv).
"""

import math

import numpy as np
import pytest

from dpsgd.accountant import Ledger, pld
from dpsgd.accountant.events import Allocation
from dpsgd.accountant.privacy_loss import allocation_pld, truncated
from dpsgd.accountant.strong_composition import gaussian_epsilon
from dpsgd.privacy import sampler_epsilon
from tolerances import EPS64, PLD_GRID_STEPS

# (t lots per epoch, σ, epochs E, δ) -> PLD_accounting's [lower, upper], Poisson (dp_accounting PLD)
REFERENCE = [
    (100, 4.0, 108, 1e-5, 0.9629797508847174, 1.0056125232937403, 0.9876756107467981),
    (100, 3.0, 30, 1e-6, 0.7637215303889119, 0.7968246493054465, 0.7899589842545053),
    (100, 1.1, 10, 1e-5, 1.3894965804369368, 1.4526897701368169, 1.5153702481094293),
    (10, 2.0, 50, 1e-5, 5.2950899786615295, 5.390211280418838, 5.5554699547216435),
    (235, 1.1, 60, 1e-5, 2.2956380958137417, 2.3774572171651953, 2.378106550960127),
    (20, 0.8, 3, 1e-5, 3.9259466082933927, 3.990560697786627, 4.741865900992343),
    (50, 6.0, 200, 1e-8, 1.7288435888351525, 1.8053467854260616, 1.7749113041116202),
    (1000, 1.5, 5, 1e-5, 0.1678581194528456, 0.17460142869014308, 0.1741830894845073),
]
FAST = {(235, 1.1, 60, 1e-5), (1000, 1.5, 5, 1e-5)}  # the rest: up to ~5 s each (make test-all)
# the acceptance band above their upper bound: tightness, not validity (ours is an upper bound by
# construction; their lower bound is the validity check)
UPPER_SLACK = 1.01


def _ours(t, sigma, epochs, delta):
    return truncated.epsilon_for_releases([(("allocation", t, sigma), epochs)], delta)


@pytest.mark.parametrize(
    "t,sigma,epochs,delta,lower,upper,poisson",
    [r if r[:4] in FAST else pytest.param(*r, marks=pytest.mark.slow) for r in REFERENCE],
)
def test_between_their_lower_bound_and_one_percent_above_their_upper(
    t, sigma, epochs, delta, lower, upper, poisson
):
    ours = _ours(t, sigma, epochs, delta)
    assert lower <= ours <= UPPER_SLACK * upper
    if upper < poisson:  # where random allocation is cheaper than Poisson, ours is too
        assert ours < poisson


@pytest.mark.parametrize(
    "sigma,epochs",
    [
        (1.5, 4),
        pytest.param(2.0, 1, marks=pytest.mark.slow),
        pytest.param(1.0, 10, marks=pytest.mark.slow),
    ],
)
def test_one_lot_per_epoch_is_the_gaussian_closed_form(sigma, epochs):
    # t = 1: every epoch is one Gaussian mechanism; E of them compose to one at σ/√E (exact)
    exact = gaussian_epsilon(1e-5, sigma / math.sqrt(epochs))
    ours = _ours(1, sigma, epochs, 1e-5)
    # rounding the term Y' = S up by at most g moves each epoch's loss up by at most
    # log(1 + g/S) <= g/y_lo (y_lo: the term's lowest grid value, its TERM_TAIL quantile); rounding S
    # down (add) by at most g, likewise; the loss grid's bracket: PLD_GRID_STEPS steps h
    a = 1.0 / sigma
    y_lo = math.exp(
        -(a * a) / 2.0 - a * float(-allocation_pld.special.ndtri(allocation_pld.TERM_TAIL))
    )
    g = max(allocation_pld._grid_for(1, sigma, d) for d in ("remove", "add"))
    slack = epochs * g / y_lo + PLD_GRID_STEPS * pld.DEFAULT_INTERVAL
    assert exact - PLD_GRID_STEPS * pld.DEFAULT_INTERVAL <= ours <= exact + slack


@pytest.mark.parametrize("direction", ["remove", "add"])
def test_the_epoch_pmf_is_a_dominating_discrete_pair(direction):
    i_lo, probs, p_inf = allocation_pld.epoch_pmf(235, 1.1, pld.DEFAULT_INTERVAL, direction)
    loss = (i_lo + np.arange(probs.size)) * pld.DEFAULT_INTERVAL
    # P-mass: the FFT of the sum (m <= 2·SUM_POINTS bins, each off by <= EPS64 of the total mass)
    # clipped at zero, then split exactly between grid points
    tol = 2 * allocation_pld.SUM_POINTS * EPS64
    assert abs(probs.sum() + p_inf - 1.0) <= tol
    assert (probs >= 0).all() and 0.0 <= p_inf <= 1e-9
    # Q-mass of the discrete pair: at most 1 (the rest of Q sits where P has no mass)
    assert float(np.sum(probs * np.exp(-loss))) <= 1.0 + tol


def test_the_ledger_serves_allocation_by_pld_and_it_is_tighter_than_rdp():
    led = Ledger()
    led.record(Allocation(1.5, 1000), 5, "five epochs of 1000 lots")
    by_pld, by_rdp = led.epsilon(1e-5, "pld")[0], led.epsilon(1e-5, "rdp")[0]
    assert by_pld == _ours(1000, 1.5, 5, 1e-5)  # exact: the same composition
    assert by_pld < by_rdp
    r = sampler_epsilon("balls_in_bins", 60000, 60, 1.5, 4001, 1e-5)
    assert r["accountant"] == "pld" and r["epsilon"] == by_pld  # 4001 lots: 5 epochs charged


def test_bad_lots_per_epoch_refused_in_one_line():
    with pytest.raises(ValueError, match="t >= 1"):
        truncated.epsilon_for_releases([(("allocation", 0, 1.0), 3)], 1e-5)
