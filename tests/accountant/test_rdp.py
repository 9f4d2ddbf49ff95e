"""RDP of the Poisson-subsampled Gaussian (MTZ 2019): dp_accounting 0.6, mpmath, limits,
conversions."""

import math

import mpmath as mp
import numpy as np
import pytest

from dpsgd.accountant import rdp
from tolerances import chain_rel_tol

dpa = pytest.importorskip("dp_accounting")
from dp_accounting.rdp import rdp_privacy_accountant as dpa_rdp  # noqa: E402

DELTA = 1e-5
INT_ORDERS = tuple(float(a) for a in range(2, 65))


def _dpa_epsilon(q, sigma, steps):
    acc = dpa_rdp.RdpAccountant(orders=list(INT_ORDERS))
    acc.compose(dpa.PoissonSampledDpEvent(q, dpa.GaussianDpEvent(sigma)), steps)
    return acc.get_epsilon(DELTA)


def _check_vs_dpa(q, sigma, steps):
    ours = rdp.compute_rdp(q, sigma, INT_ORDERS, steps)
    ref = steps * dpa_rdp._compute_rdp_poisson_subsampled_gaussian(q, sigma, INT_ORDERS)
    # an independent implementation (its own series and ε conversion): 0.5 % still catches any wrong
    # factor of q or σ, which moves the RDP curve by far more
    np.testing.assert_allclose(ours, ref, rtol=5e-3)
    eps, _ = rdp.epsilon(q, sigma, steps, DELTA, orders=INT_ORDERS)
    assert eps == pytest.approx(_dpa_epsilon(q, sigma, steps), rel=5e-3)


@pytest.mark.parametrize("q", [0.001, 0.01, 0.1])
@pytest.mark.parametrize("sigma", [0.7, 1.0, 4.0])
@pytest.mark.parametrize("steps", [1, 100, 10_000])
def test_integer_orders_match_dp_accounting(q, sigma, steps):
    _check_vs_dpa(q, sigma, steps)


def _rdp_mpmath(q, sigma, alpha):
    """R(α) = log E_{μ0}[(μ/μ0)^α]/(α−1) by 50-digit integration."""
    with mp.workdps(50):
        q, s, a = mp.mpf(q), mp.mpf(sigma), mp.mpf(alpha)
        f = lambda z: mp.npdf(z, 0, s) * (1 - q + q * mp.exp((2 * z - 1) / (2 * s * s))) ** a
        pts = sorted(
            {
                -mp.inf,
                -10 * s,
                mp.mpf(0),
                mp.mpf(1) / 2,
                mp.mpf(1),
                a - 10 * s,
                a,
                a + 10 * s,
                mp.inf,
            }
        )
        return float(mp.log(mp.quad(f, pts)) / (a - 1))


@pytest.mark.parametrize(
    "q,sigma,alpha",
    [
        (0.1, 0.7, 1.25),
        (0.1, 0.7, 2.5),
        (0.1, 0.7, 32.5),
        (0.01, 1.0, 4.5),
        (0.01, 4.0, 1.5),
        (0.5, 1.0, 1.75),
        (0.001, 4.0, 10.5),
    ],
)
def test_fractional_orders_match_integration(q, sigma, alpha):
    ours = rdp.compute_rdp(q, sigma, [alpha])[0]
    # rel: the 50-digit integration's own accuracy; abs: round-off of the signed series, whose
    # terms are O(1) (a few float64 roundings absolute)
    assert ours == pytest.approx(_rdp_mpmath(q, sigma, alpha), rel=1e-8, abs=chain_rel_tol(8))


def test_fractional_orders_between_integer_neighbours():
    # R(α) is non-decreasing in α (Mironov 2017, Prop. 9)
    orders = np.linspace(1.1, 12.0, 110)
    r = rdp.compute_rdp(0.1, 0.7, orders)
    assert np.all(np.diff(r) >= -1e-12)


def test_q_one_is_gaussian_mechanism_exactly():
    orders = rdp.DEFAULT_ORDERS
    for sigma in (0.7, 1.0, 4.0):
        np.testing.assert_array_equal(
            rdp.compute_rdp(1.0, sigma, orders), np.array(orders) / (2 * sigma**2)
        )
        np.testing.assert_allclose(
            rdp.compute_rdp(1 - 1e-12, sigma, range(2, 33)),
            np.arange(2, 33) / (2 * sigma**2),
            rtol=1e-6,
        )


def test_conversions():
    orders, curve = rdp.DEFAULT_ORDERS, rdp.compute_rdp(0.01, 4.0, rdp.DEFAULT_ORDERS, 10_000)
    paper, _ = rdp.rdp_to_epsilon(orders, curve, DELTA, "paper")
    improved, _ = rdp.rdp_to_epsilon(orders, curve, DELTA, "improved")
    assert improved < paper
    for conv, eps in (("paper", paper), ("improved", improved)):
        d, _ = rdp.rdp_to_delta(orders, curve, eps, conv)
        # δ(ε(δ)) through the conversion's minimum over orders (a few float64 ops; 1e-6 is loose)
        assert d == pytest.approx(DELTA, rel=1e-6)
    with pytest.raises(ValueError, match="conversion"):
        rdp.rdp_to_epsilon(orders, curve, DELTA, "tight")


def test_per_tensor_vs_joint_numbers_from_brief():
    # σ = 2, q = 0.01, 40 000 lots, k = 2 tensors, δ = 1e-5 (RDP, improved conversion, integer
    # orders)
    per_tensor, _ = rdp.epsilon(0.01, 2.0, 2 * 40_000, DELTA, orders=INT_ORDERS)
    joint, _ = rdp.epsilon(0.01, 2.0 / math.sqrt(2), 40_000, DELTA, orders=INT_ORDERS)
    # values as printed to 2 decimals (half a unit of the last digit)
    assert per_tensor == pytest.approx(7.66, abs=0.005)
    assert joint == pytest.approx(8.36, abs=0.005)


def test_monotone_in_steps_and_sigma():
    eps_t = [rdp.epsilon(0.01, 1.0, t, DELTA)[0] for t in (1, 10, 100, 1000, 10_000)]
    assert all(a < b for a, b in zip(eps_t, eps_t[1:]))
    eps_s = [rdp.epsilon(0.01, s, 1000, DELTA)[0] for s in (0.7, 1, 2, 4, 8)]
    assert all(a > b for a, b in zip(eps_s, eps_s[1:]))


def test_default_orders_reach_below_1_1_and_keep_the_old_ones():
    old = (
        (1.25, 1.5, 1.75, 2.0, 2.25, 2.5, 2.75, 3.0, 3.25, 3.5, 3.75, 4.0, 4.5, 5.0, 5.5)
        + tuple(float(a) for a in range(6, 65))
        + (80.0, 96.0, 128.0, 192.0, 256.0, 512.0)
    )
    assert set(old) <= set(rdp.DEFAULT_ORDERS) and min(rdp.DEFAULT_ORDERS) <= 1.1
    assert list(rdp.DEFAULT_ORDERS) == sorted(rdp.DEFAULT_ORDERS)


@pytest.mark.parametrize(
    "q,sigma,steps,from_1_1",
    [(0.1, 0.5, 10_000, 956.1972884736996), (0.05, 0.7, 100_000, 831.6218490844357)],
)
def test_large_epsilon_uses_small_orders(q, sigma, steps, from_1_1):
    # ε > 100: the optimum is below 1.25, and ε is well below ``from_1_1``, the ε with opacus'
    # orders (from 1.1 up; up to 32 % larger)
    ours, alpha = rdp.epsilon(q, sigma, steps, DELTA)
    assert alpha < 1.25 and ours < 0.95 * from_1_1
    # the new orders against 50-digit integration (dp_accounting 0.6 does not converge there and
    # drops these orders), and against dp_accounting's conversion at the orders it does compute
    for a in (1.02, 1.05, 1.1):
        # rel: the 50-digit integration's quadrature accuracy
        assert rdp.compute_rdp(q, sigma, [a])[0] == pytest.approx(
            _rdp_mpmath(q, sigma, a), rel=1e-8
        )


def test_small_orders_not_worse_than_dp_accounting():
    # dp_accounting 0.6 drops the orders < 1.25 whose series it cannot converge (here all of them:
    # 263.65); ours are checked against integration above, and the result is 232.48
    q, sigma, steps = 0.01, 0.5, 100_000
    ours, alpha = rdp.epsilon(q, sigma, steps, DELTA)
    acc = dpa_rdp.RdpAccountant(orders=list(rdp.DEFAULT_ORDERS))
    acc.compose(dpa.PoissonSampledDpEvent(q, dpa.GaussianDpEvent(sigma)), steps)
    assert alpha < 1.25 and ours <= acc.get_epsilon(DELTA)
    # value as printed to 2 decimals
    assert ours == pytest.approx(232.48, abs=0.01)


@pytest.mark.parametrize(
    "q,sigma,steps,delta",
    [(0.01, 4.0, 10_000, 1e-5), (0.1, 1.0, 100, 1e-5), (0.01, 0.5, 10_000, 1e-10)],
)
def test_ordinary_numbers_do_not_use_the_new_orders(q, sigma, steps, delta):
    old = tuple(a for a in rdp.DEFAULT_ORDERS if a >= 1.25)
    assert rdp.epsilon(q, sigma, steps, delta) == rdp.epsilon(q, sigma, steps, delta, orders=old)


def test_tiny_q_fractional_orders_are_non_negative_upper_bounds():
    # q = 1e-12: log A_α ~ 1e-25 is below the signed series' round-off (it came out negative and
    # rdp_to_epsilon refused the curve); the bound via R(⌈α⌉) is non-negative
    curve = rdp.compute_rdp(1e-12, 1.0, rdp.DEFAULT_ORDERS, 10**9)
    assert (curve >= 0).all()
    eps, _ = rdp.epsilon(1e-12, 1.0, 10**9, 1e-5)
    assert eps == 0.0 or math.isfinite(eps)
    r = rdp.compute_rdp(1e-12, 1.0, [1.5])[0]
    assert 0.0 <= r <= rdp.compute_rdp(1e-12, 1.0, [2.0])[0]
