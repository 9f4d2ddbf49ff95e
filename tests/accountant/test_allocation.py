"""Random allocation (balls-in-bins) RDP bound (dpsgd/accountant/renyi/allocation.py) against the
authors' code.

Reference: github.com/moshenfeld/random_allocation at commit 5a1958a (v1.0.4) (Feldman &
Shenfeld 2025, "Privacy amplification by random allocation", arXiv 2502.08202), file
``random_allocation/random_allocation_scheme/direct.py``: ``allocation_RDP_remove(alpha, sigma,
num_steps)`` (exact remove-direction RDP by integer partitions) and
``allocation_epsilon_direct_add`` (one epoch, num_selected = 1). The numbers below were produced by
running that code in /tmp, outside this repo (numba's @jit replaced by the identity; numpy/scipy of
this venv; AMD EPYC, 2 cores). Their code is not part of this repository; only its outputs are
pinned here.
"""

import math

import numpy as np
import pytest
from scipy import special

import torch

from dpsgd.accountant import Ledger, pld, rdp
from dpsgd.accountant.renyi import allocation, wor
from dpsgd.accountant.events import Allocation
from dpsgd.mechanism.sampling import make_sampler
from dpsgd.privacy import sampler_epsilon
from test_sampler_references import BNB_LOWER
from tolerances import PLD_GRID_STEPS, chain_rel_tol, sum_tol

DELTA = 1e-5
# (α, σ, t) -> their allocation_RDP_remove
THEIR_REMOVE = [
    (2, 4.0, 100, 0.0006447367017941019),
    (8, 4.0, 100, 0.0025791594434687276),
    (20, 4.0, 100, 0.006448972334378834),
    (16, 2.0, 10, 0.23741214342240133),
    (12, 1.0, 1000, 0.010413843108519349),
    (5, 4.0, 1, 0.15625),
]
# (σ, t, δ) -> their allocation_epsilon_direct_add, one epoch (exact Gaussian ε found by a search to
# epsilon_tolerance = 1e-3, their default, plus (1 − 1/t)/(2σ²))
THEIR_ADD = [(4.0, 100, 1e-5, 0.10687715608490572), (1.0, 1000, 1e-6, 0.6164266774933262)]
THEIR_EPS_TOL = 1e-3


def _remove_tol(alpha, sigma, t):
    """Round-off of log E_Q[(P/Q)^α] (a sum of 4 terms, one from ~2α·log2(t) positive log-space
    ops), tripled: the two implementations' round-off, and ours charges its own upward (a margin
    of the same size), divided by α − 1."""
    coef = alpha * alpha / (2 * sigma * sigma) + alpha * math.log(t)  # size of log [z^α] f^t
    terms = [special.gammaln(alpha + 1.0), coef, alpha * math.log(t), alpha / (2 * sigma * sigma)]
    n_ops = 2 * alpha * (math.ceil(math.log2(t)) + 1)
    return 3 * (sum_tol(terms) + chain_rel_tol(n_ops) * coef) / (alpha - 1)


@pytest.mark.parametrize("alpha,sigma,t,theirs", THEIR_REMOVE)
def test_remove_rdp_matches_the_authors_code(alpha, sigma, t, theirs):
    assert allocation.rdp_remove(alpha, sigma, t) == pytest.approx(
        theirs, rel=0, abs=_remove_tol(alpha, sigma, t)
    )


@pytest.mark.parametrize("sigma,t,delta,theirs", THEIR_ADD)
def test_add_bound_is_not_below_the_authors_add_epsilon(sigma, t, delta, theirs):
    # ours: the same Gaussian + (1 − 1/t)/(2σ²) bound, but through RDP (never below the exact
    # profile)
    a = np.array(allocation.ORDERS)
    ours = rdp.rdp_to_epsilon(a, [allocation.rdp_add_amgm(x, sigma, t) for x in a], delta)[0]
    assert ours >= theirs - THEIR_EPS_TOL
    assert ours <= 1.5 * theirs  # and not grossly looser (RDP vs exact Gaussian conversion)


@pytest.mark.parametrize("sigma", [0.8, 2.0, 4.0])
def test_one_lot_per_epoch_is_the_plain_gaussian(sigma):
    for a in (2, 7, 33):
        g = a / (2 * sigma * sigma)
        assert allocation.rdp_remove(a, sigma, 1) == pytest.approx(
            g, rel=_remove_tol(a, sigma, 1) / g
        )
        assert allocation.rdp_add(a, sigma, 1) == pytest.approx(g, rel=chain_rel_tol(8))
        assert allocation.rdp_add_amgm(a, sigma, 1) == pytest.approx(g, rel=chain_rel_tol(8))


# -- the add direction: exact (Laplace-transform quadrature), against a t-dimensional quadrature ---
def _direct_neg_moment(k, sigma, t, d):
    """log E[M^{−k}], M = (1/t) Σ e^{Z_i/σ}, by the t-dimensional trapezoidal rule on [−12, 12]^t
    (step d) in log space: an independent reference (no Gamma identity, no Fubini)."""
    z = np.arange(-12.0, 12.0 + d / 2, d)
    grids = np.meshgrid(*([z] * t), indexing="ij", sparse=True)
    log_m = special.logsumexp(np.broadcast_arrays(*[g / sigma for g in grids]), axis=0) - math.log(
        t
    )
    log_w = sum(-0.5 * g * g for g in grids) + t * (math.log(d) - 0.5 * math.log(2 * math.pi))
    return float(special.logsumexp(-k * log_m + log_w))


@pytest.mark.parametrize(
    "alpha,sigma,t", [(2, 4.0, 2), (17, 4.0, 2), (5, 1.1, 2), (9, 2.0, 3), (3, 0.8, 3)]
)
def test_add_direction_matches_a_t_dimensional_quadrature(alpha, sigma, t):
    k = alpha - 1.0
    d = 0.05 if t == 2 else 0.2
    ref, ref_coarse = _direct_neg_moment(k, sigma, t, d), _direct_neg_moment(k, sigma, t, 2 * d)
    value, margin = allocation.log_neg_moment(k, sigma, t)
    # both trapezoidal rules converge geometrically; the reference's own error is bounded by its
    # change when the step is doubled (times 10), ours by its stated margin
    ref_err = 10 * abs(ref - ref_coarse) + sum_tol([ref, k * 12 / sigma, t * 12 * 12])
    assert value == pytest.approx(ref, rel=0, abs=margin + ref_err)
    exact = 1 / (2 * sigma * sigma) + ref / k
    charged = allocation.rdp_add(alpha, sigma, t)
    assert charged >= exact - ref_err / k  # valid: never below the exact divergence
    assert charged <= allocation.rdp_add_amgm(alpha, sigma, t)  # and never above the AM–GM bound


def test_add_direction_is_tighter_than_am_gm_and_falls_back_where_unresolved():
    # exact < AM–GM for t >= 2 (AM–GM is strict unless all x_i are equal); σ below SIGMA_EXACT:
    # AM–GM
    for t in (2, 10, 100):
        assert allocation.rdp_add(5, 4.0, t) < allocation.rdp_add_amgm(5, 4.0, t)
    assert allocation.log_neg_moment(4.0, 0.2, 10) is None
    assert allocation.rdp_add(5, 0.2, 10) == allocation.rdp_add_amgm(
        5, 0.2, 10
    )  # exact: the same function
    # an order whose integrand the grid does not resolve keeps AM–GM (t = 1, σ = 2, α = 256: peak at
    # s ~ e^{64})
    assert allocation.log_neg_moment(255.0, 2.0, 1) is None


@pytest.mark.parametrize("sigma,lots,poisson_limit", [(4.0, 10751, 1.10), (1.1, 1000, 1.10)])
def test_paper_and_frontier_settings_within_ten_percent_of_poisson(sigma, lots, poisson_limit):
    # N = 60000, L = 600 (t = 100): the target of the random-allocation accounting; Poisson by PLD
    eps = allocation.epsilon(sigma, 100, allocation.epochs_for(lots, 100), DELTA)[0]
    poisson = pld.epsilon(0.01, sigma, lots, DELTA)
    assert eps <= poisson_limit * poisson


@pytest.mark.parametrize("N,L,sigma,lots,lower", BNB_LOWER)
def test_between_the_lower_bound_and_the_unamplified_charge(N, L, sigma, lots, lower):
    t = N // L
    ours = allocation.epsilon(sigma, t, allocation.epochs_for(lots, t), DELTA)[0]
    unamplified = pld.epsilon(
        1.0, sigma, allocation.epochs_for(lots, t), DELTA
    )  # one Gaussian per epoch
    assert lower <= ours <= unamplified + PLD_GRID_STEPS * pld.DEFAULT_INTERVAL
    # the sampler's ledger charge is the tighter of this bound and the PLD (allocation_pld.py)
    charged = sampler_epsilon("balls_in_bins", N, L, sigma, lots, DELTA)
    assert lower <= charged["by_accountant"]["rdp"] <= ours  # RDP at the ledger's orders
    assert lower <= charged["epsilon"] <= ours  # PLD where it serves (σ >= ~0.8), else this RDP


def test_paper_schedule_number():
    # N = 60000, L = 600 (t = 100), σ = 4, 10751 lots -> 108 epochs charged; the unamplified charge
    # was 13.87, the AM–GM add bound 4.397; Poisson (PLD) is 0.985
    eps, order = allocation.epsilon(4.0, 100, allocation.epochs_for(10751, 100), DELTA)
    assert 0.2789311567559651 <= eps < 4.39685738574069 and order == 17.0


@pytest.mark.parametrize("t", [100, 1000, 10000])
def test_many_bins_remove_direction_approaches_poisson(t):
    # 10000 lots at σ = 1; Poisson at q = 1/t (RDP, same orders). Observed: the remove direction is
    # below Poisson and the gap shrinks with t: 2.3% at t = 100, 0.41% at t = 1000, 0.015% at 10000
    # (the AM–GM add bound did not approach Poisson: it keeps (1 − 1/t)/(2σ²) per epoch; the exact
    # one does).
    lots, a = 10000, np.array(allocation.ORDERS)
    rm = rdp.rdp_to_epsilon(
        a, (lots // t) * np.array([allocation.rdp_remove(x, 1.0, t) for x in a]), DELTA
    )[0]
    poisson = rdp.rdp_to_epsilon(a, rdp.compute_rdp(1.0 / t, 1.0, a, lots), DELTA)[0]
    assert rm <= poisson and rm >= {100: 0.97, 1000: 0.99, 10000: 0.999}[t] * poisson
    full = allocation.epsilon(1.0, t, lots // t, DELTA)[0]
    assert full >= rm


# -- wired in: the balls_in_bins sampler charges one "allocation" event per epoch (RDP only) -------
def test_sampler_charges_one_allocation_epoch_at_its_first_lot():
    s = make_sampler("balls_in_bins", 6000, 60, torch.Generator().manual_seed(0))
    t = s.lots_per_epoch()
    assert s.release(2.0, 0) == Allocation(2.0, t)
    assert all(s.release(2.0, j) is None for j in range(1, t))
    assert s.charges(2.0, 2 * t + 1) == {s.release(2.0, 0): 3}  # a partial epoch: one more charge
    assert (
        s.lots_within(2, 0) == 2 * t and s.lots_within(0, 5) == t - 5
    )  # integer: unchanged semantics
    assert s.accountants == ("pld", "rdp") and s.amplification is True


def test_ledger_round_trip_and_refusals():
    led = Ledger()
    led.record(Allocation(1.5, 100, 2), 3, "sgd")
    back = Ledger.from_dict(led.to_dict())
    assert back == led and back.entries[0].t == 100
    # joint convention, k = 2 groups: the allocation curve at σ/√2, 3 epochs
    want = rdp.rdp_to_epsilon(
        np.array(wor.ORDERS), 3 * allocation.rdp_curve(1.5 / math.sqrt(2), 100, wor.ORDERS), DELTA
    )
    assert back.epsilon(DELTA, "rdp") == want  # exact: the same arithmetic on the same curve
    with pytest.raises(ValueError, match="accountant='moments' does not serve allocation lots"):
        led.epsilon(DELTA, "moments")
    with pytest.raises(ValueError, match="needs t >= 1"):
        Ledger().record(Allocation(1.5, 0), 1, "sgd")
    # an allocation epoch under replace_one is unrepresentable: Allocation's adjacency is fixed
    # (add_remove), and Ledger.record takes typed events only (the flat form that could name another
    # relation is gone)
    with pytest.raises(ValueError, match="a privacy event"):
        Ledger().record(1.0, 1.5)
    with pytest.raises(ValueError, match="no conversion"):
        led.converted("replace_one")


def test_budget_search_counts_epochs():
    led = Ledger()
    n = led.steps_within(2.0, DELTA, Allocation(1.5, 100), "rdp")
    eps = lambda k: allocation.epsilon(1.5, 100, k, DELTA)[0] if k else 0.0
    assert n >= 1
    led.record(Allocation(1.5, 100), n, "sgd")
    assert (
        led.epsilon(DELTA, "rdp")[0]
        <= 2.0
        < Ledger([{**led.to_dict()["entries"][0], "count": n + 1}]).epsilon(DELTA, "rdp")[0]
    )
    assert eps(n) >= led.epsilon(DELTA, "rdp")[0]  # the ledger's orders are a superset


def test_calibrate_sigma_for_balls_in_bins():
    from dpsgd.config.schema import validate
    from dpsgd.launch.main import compose

    c = validate(
        compose(
            [
                "experiment=mnist_scatter_linear",
                "privacy.sampling=balls_in_bins",
                "accountant.name=rdp",
                "privacy.calibrate_sigma=true",
                "privacy.target_epsilon=2",
                "training.epochs=5",
                "device=cpu",
            ]
        )
    )
    s = make_sampler("balls_in_bins", c.N, c.privacy.lot_size)
    eps = sampler_epsilon(
        "balls_in_bins",
        c.N,
        c.privacy.lot_size,
        c.privacy.sigma,
        5 * s.lots_per_epoch(),
        c.privacy.delta,
    )["by_accountant"]["rdp"]
    assert (1 - 0.005) * 2.0 <= eps <= 2.0  # calibrate's rtol: within 0.5 % below the target


@pytest.mark.parametrize("sigma", [0.5, 1.0, 4.0, 16.0])
@pytest.mark.parametrize("t", [1, 2, 100, 10_000])
def test_remove_rdp_at_order_2_is_never_below_its_closed_form(sigma, t):
    """α = 2: R_remove = log((e^{1/σ²} + t − 1)/t), computed in 50 digits; the round-off margin
    keeps ours at or above it (exact in exact arithmetic: zero allowed below)."""
    import mpmath

    with mpmath.workdps(50):
        exact = mpmath.log((mpmath.exp(1 / mpmath.mpf(sigma) ** 2) + t - 1) / t)
    assert allocation.rdp_remove(2, sigma, t) >= float(exact)
