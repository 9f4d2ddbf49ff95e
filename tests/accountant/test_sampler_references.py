"""The shuffle lower bound and the balls-in-bins charge of the batch samplers against the authors'
code.

Reference: google-research/google-research, folder ``dpsgd_batch_sampler_accounting`` (Chua, Ghazi,
Kamath, Kumar, Manurangsi, Sinha & Zhang: "How Private are DP-SGD Implementations?", ICML 2024,
arXiv 2403.17673; "Balls-and-Bins Sampling for DP-SGD", arXiv 2412.16802), file ``dpsgd_bounds.py``
at commit 4c4299485319ed72ef782020c81784be5468924e, class ``ShuffleAccountant``, method
``get_epsilons`` with ``pessimistic_estimate=False`` (its lower bound), and ``balls_and_bins.py``
(same commit), ``BnBAccountant.get_deltas_lower_bound`` = ``ShuffleAccountant(mean_upper=1.0,
mean_lower=0.0)``. The numbers below were produced by running that code (transcribed to /tmp,
outside this repo; dp_accounting 0.6.0, scipy, AMD EPYC 2 cores) at δ = 1e-5; their folder publishes
no numeric table (README, example.py and docstrings give none), so these are *their code's* outputs,
not a paper table. Their code is not part of this repository; only its outputs are pinned here.
"""

import pytest

from dpsgd.accountant import pld
from dpsgd.accountant.privacy_loss import shuffle_lower
from dpsgd.privacy import sampler_epsilon
from tolerances import PLD_GRID_STEPS

DELTA = 1e-5

# (σ, lots per epoch T, epochs E, discretization h) -> their ShuffleAccountant.get_epsilons
# (multi-epoch: sliced max-statistic PLD, losses rounded down to h, composed by dp_accounting's
# self_compose)
SHUFFLE_MULTI = [
    (
        4.0,
        100,
        108,
        1e-3,
        0.4717007816902098,
    ),  # the paper MNIST schedule: N=60000, L=600, 10751 lots
    (4.0, 100, 108, 1e-4, 0.5203156788884863),
    (1.1, 100, 10, 1e-3, 6.992346021196771),  # frontier: σ = 1.1, 1000 lots
    (1.1, 100, 10, 1e-4, 6.99686460497587),
    (0.8, 100, 10, 1e-3, 17.556163631895707),
]
# one epoch: their get_epsilons_single_epoch (the best single cube set {max_t y_t > C}, C on a 0.01
# grid); (0.35, 1000) is their example.py setting (sigma = 0.35, 1000 steps per epoch, 1 epoch)
SHUFFLE_ONE = [(0.35, 1000, 0.001, 15.657828226685524), (2.0, 100, 1e-4, 0.48371121287345886)]
CUBE_GRID = 0.01  # their grid of caps C in get_deltas_single_epoch


@pytest.mark.parametrize("sigma,T,E,h,theirs", SHUFFLE_MULTI)
def test_shuffle_lower_matches_the_authors_code(sigma, T, E, h, theirs):
    ours = shuffle_lower.epsilon_lower(sigma, T, E, DELTA, h)
    # the same construction (slices of width h·σ², losses floored to h, truncation 1e-40/(2E)); they
    # may differ only where float round-off moves a slice's floor(loss/h) by one step: the grid
    # tolerance (observed: |ours − theirs| < 3e-10)
    assert ours == pytest.approx(theirs, abs=PLD_GRID_STEPS * h)


@pytest.mark.parametrize("sigma,T,h,theirs", SHUFFLE_ONE)
def test_shuffle_lower_one_epoch_is_not_below_the_authors_cube_bound(sigma, T, h, theirs):
    ours = shuffle_lower.epsilon_lower(sigma, T, 1, DELTA, h)
    # our slices refine their cube sets (never below, up to the loss rounding < h and their cap
    # grid, a step of which moves the loss by at most CUBE_GRID/σ²), and never above the upper bound
    assert ours >= theirs - h - CUBE_GRID / sigma**2
    assert ours <= pld.epsilon(1.0, sigma / 2, 1, DELTA) + PLD_GRID_STEPS * pld.DEFAULT_INTERVAL


# balls-in-bins: their lower bound (add/remove, P = (1/T) Σ_t N(e_t, σ²I) vs Q = N(0, σ²I), cube
# sets), (N, L, σ, lots) -> their get_epsilons at h = 1e-4 (E = 1: the single-epoch cube path)
BNB_LOWER = [
    (
        60000,
        600,
        4.0,
        10751,
        0.2789311567559651,
    ),  # T = 100, E = 108 (at h = 1e-3: 0.23054706388627205)
    (
        60000,
        600,
        1.1,
        1000,
        0.8981671051750765,
    ),  # T = 100, E = 10 (at h = 1e-3: 0.8936834862602415)
    (60000, 60, 0.35, 1000, 8.750231266021729),  # T = 1000, E = 1: their example.py setting
    (60000, 600, 2.0, 100, 0.061411187052726746),  # T = 100, E = 1
]


@pytest.mark.parametrize("N,L,sigma,lots,theirs", BNB_LOWER)
def test_balls_in_bins_charge_is_not_below_the_authors_lower_bound(N, L, sigma, lots, theirs):
    r = sampler_epsilon("balls_in_bins", N, L, sigma, lots, DELTA)
    # our charge (random allocation: the PLD of allocation_pld.py, or the RDP of renyi/allocation.py
    # where σ is too small for the PLD's grid; both upper bounds) bounds the true ε from above; their
    # construction is a lower bound on it: ours must not fall below
    assert r["adjacency"] == "add_remove" and r["amplification_by_sampling"] is True
    assert r["accountant"] in ("pld", "rdp") and r["epsilon"] >= theirs
    # and the amplified charge is below the unamplified one (one Gaussian at σ per epoch)
    assert (
        r["epsilon"]
        <= pld.epsilon(1.0, sigma, -(-lots // (N // L)), DELTA)
        + PLD_GRID_STEPS * pld.DEFAULT_INTERVAL
    )
