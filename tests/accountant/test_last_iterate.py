"""The last-iterate heuristic ε (dpsgd/accountant/last_iterate.py; Steinke et al., ICLR 2025)
against dp_accounting 0.6.0's PLD of the same mixture of Gaussians, the one-lot subsampled Gaussian
(T = 1), and the DP-SGD accountant (the heuristic is a weaker adversary: never above the PLD ε)."""

import math

import numpy as np
import pytest
from scipy import stats

from dpsgd.accountant import last_iterate as li
from dpsgd.accountant import pld
from tolerances import (
    EPS64,
    GAUSSIAN_EPSILON_RTOL,
    GAUSSIAN_EPSILON_XTOL,
    pld_epsilon_tol,
    root_tol,
)


def _dp_accounting(q, sigma, steps, delta, h, cut=1e-10):
    """ε(δ) of N(0, Tσ²) vs Σ_j Binom(T, q)(j)·N(j, Tσ²) by dp_accounting's connect-the-dots PLD
    (MixtureGaussianPrivacyLoss, both adjacencies), grid h. Binomial weights below ``cut`` dropped
    and the rest renormalised (a change of <= (T + 1)·cut in every probability, far below δ)."""
    from dp_accounting.pld import privacy_loss_distribution as pldlib

    j = np.arange(steps + 1)
    w = stats.binom.pmf(j, steps, q)
    keep = w > cut
    pl = pldlib.from_mixture_gaussian_mechanism(
        math.sqrt(steps) * sigma,
        list(j[keep].astype(float)),
        list(w[keep] / w[keep].sum()),
        value_discretization_interval=h,
        log_mass_truncation_bound=-30,
    )
    return pl.get_epsilon_for_delta(delta)


def _root_eps_tol(q, sigma, steps):
    """Error of the heuristic ε from its root-find in t: brentq's root_tol(t, T_XTOL·s, 4·eps) times
    dε/dt = L'(t) <= T/s² (the largest mean j over the variance s² = Tσ²),
    |t| <= T + (Z_FAR·s + 1)."""
    s = math.sqrt(steps) * sigma
    t_max = steps + li.Z_FAR * s + 1.0
    return root_tol(t_max, li.T_XTOL * s, 4 * EPS64) * steps / (s * s)


def _agree(q, sigma, steps, delta, h):
    got = li.last_iterate_epsilon(q, sigma, steps, delta)
    ref = _dp_accounting(q, sigma, steps, delta, h)
    # dp_accounting's pessimistic PLD is an upper bound within its grid: 2 steps of h (as
    # pld_epsilon_tol); the brief's 0.5 % holds a fortiori
    assert got - 2 * h <= ref <= got + 2 * h
    assert abs(ref - got) <= 0.005 * got
    return got, ref


def test_mnist_like_matches_dp_accounting():
    # Abadi et al. MNIST-like run: q = 0.01, σ = 4, T = 10 000, δ = 1e-5
    got, _ = _agree(0.01, 4.0, 10000, 1e-5, h=1e-3)
    assert got < pld.epsilon(0.01, 4.0, 10000, 1e-5)  # measured: 0.9309 vs 0.9470


@pytest.mark.slow
def test_few_steps_large_q_matches_dp_accounting():
    _agree(0.1, 2.0, 100, 1e-5, h=1e-3)


@pytest.mark.slow
@pytest.mark.parametrize(
    "q,sigma,steps,delta",
    [
        (0.01, 4.0, 10000, 1e-5),
        (0.01, 1.1, 1000, 1e-5),
        (0.1, 2.0, 100, 1e-5),
        (0.5, 1.0, 10, 1e-6),
    ],
)
def test_matches_dp_accounting_fine_grid(q, sigma, steps, delta):
    _agree(q, sigma, steps, delta, h=1e-4)


@pytest.mark.parametrize(
    "q,sigma,delta", [(0.01, 4.0, 1e-5), (0.1, 1.0, 1e-5), (1.0, 2.0, 1e-6), (0.5, 0.7, 1e-8)]
)
def test_one_step_is_the_subsampled_gaussian(q, sigma, delta):
    # T = 1: the pair is the Poisson-subsampled Gaussian of one lot; pld.epsilon is an upper bound
    # within its grid (pld_epsilon_tol), the heuristic is exact
    got = li.last_iterate_epsilon(q, sigma, 1, delta)
    ref = pld.epsilon(q, sigma, 1, delta)
    assert got - _root_eps_tol(q, sigma, 1) <= ref <= got + pld_epsilon_tol([(q, sigma, 1)])


@pytest.mark.parametrize(
    "q,sigma,steps", [(0.01, 4.0, 10000), (0.01, 1.1, 1000), (0.1, 2.0, 100), (0.5, 1.0, 10)]
)
def test_never_above_the_dpsgd_accountant(q, sigma, steps):
    assert li.last_iterate_epsilon(q, sigma, steps, 1e-5) <= pld.epsilon(q, sigma, steps, 1e-5)


def test_groups_use_the_joint_convention_and_monotone():
    # k separately clipped groups: σ/√k, as compose.charge("joint")
    assert li.last_iterate_epsilon(0.01, 4.0, 1000, 1e-5, groups=4) == li.last_iterate_epsilon(
        0.01, 2.0, 1000, 1e-5
    )  # exact: same σ_eff = 2.0
    e = [li.last_iterate_epsilon(0.01, 2.0, t, 1e-5) for t in (10, 100, 1000, 10000)]
    assert all(a < b for a, b in zip(e, e[1:]))  # more steps: larger ε
    assert li.last_iterate_epsilon(0.01, 3.0, 1000, 1e-5) < li.last_iterate_epsilon(
        0.01, 2.0, 1000, 1e-5
    )
    assert li.last_iterate_epsilon(0.01, 2.0, 0, 1e-5) == 0.0  # exact: nothing released


@pytest.mark.parametrize(
    "args,name",
    [
        ((1.5, 1.0, 10, 1e-5), "q"),
        ((0.1, 0.0, 10, 1e-5), "sigma"),
        ((0.1, 1.0, -1, 1e-5), "steps"),
        ((0.1, 1.0, 10, 1.0), "delta"),
        ((0.1, 1.0, 10, 1e-5, 0), "groups"),
    ],
)
def test_bad_input_names_the_parameter(args, name):
    with pytest.raises(ValueError) as e:
        li.last_iterate_epsilon(*args)
    assert name in str(e.value)


@pytest.mark.parametrize(
    "sigma,steps,delta", [(2.0, 4, 1e-5), (10.0, 10**6, 1e-5), (1.0, 1, 1e-10)]
)
def test_full_batch_is_one_gaussian_mechanism(sigma, steps, delta):
    # q = 1: N(T, Tσ²) vs N(0, Tσ²) is the Gaussian mechanism with noise multiplier σ/√T (Balle &
    # Wang 2018, Thm 8: strong_composition.gaussian_epsilon, brentq xtol = rtol = 1e-14)
    from dpsgd.accountant import strong_composition as sc

    got = li.last_iterate_epsilon(1.0, sigma, steps, delta)
    want = sc.gaussian_epsilon(delta, sigma / math.sqrt(steps))
    tol = root_tol(want, GAUSSIAN_EPSILON_XTOL, GAUSSIAN_EPSILON_RTOL) + _root_eps_tol(
        1.0, sigma, steps
    )
    assert got == pytest.approx(want, abs=tol)
