"""Strong composition comparator (Abadi et al. 2016, Figure 2): paper and valid variants."""

import math

import pytest
from scipy import special

from dpsgd.accountant import pld, strong_composition as sc
from tolerances import (
    GAUSSIAN_EPSILON_RTOL,
    GAUSSIAN_EPSILON_XTOL,
    chain_rel_tol,
    propagated_tol,
    root_tol,
)

Q, SIGMA, DELTA = 0.01, 4.0, 1e-5


def test_figure2_paper_variant():
    assert abs(sc.epsilon(Q, SIGMA, 10_000, DELTA, "paper") - 9.34) <= 0.05


def test_paper_epsilon0_at_figure_point():
    # the paper's point: the optimum splits δ so that ε0 ≈ 1.46 (where linear amplification is
    # invalid)
    eps, frac = sc.epsilon_and_split(Q, SIGMA, 10_000, DELTA, "paper")
    delta0 = (1 - frac) * DELTA / (10_000 * Q)
    # the paper's 1.46, read off its text
    assert sc.gaussian_epsilon(delta0, SIGMA, "classical") == pytest.approx(1.46, abs=0.03)


def test_valid_variant_is_larger_and_above_tight():
    paper = sc.epsilon(Q, SIGMA, 10_000, DELTA, "paper")
    classical = sc.epsilon(Q, SIGMA, 10_000, DELTA, "valid", gaussian="classical")
    valid = sc.epsilon(Q, SIGMA, 10_000, DELTA, "valid")
    assert classical == pytest.approx(
        26.39, abs=0.05
    )  # "about 26" with the classical Gaussian mechanism
    assert paper < valid < classical
    assert valid >= pld.epsilon(Q, SIGMA, 10_000, DELTA)


def test_exact_gaussian_inverse():
    e0 = sc.gaussian_epsilon(1e-6, 2.0)
    # e0 is a brentq root (gaussian_epsilon's xtol, rtol), carried through δ(ε); δ itself is
    # Φ(a) − e^ε Φ(b), two terms <= Φ(a) of a few float64 ops each (ndtr, exp, log_ndtr)
    dx = root_tol(e0, GAUSSIAN_EPSILON_XTOL, GAUSSIAN_EPSILON_RTOL)
    tol = propagated_tol(lambda e: sc.gaussian_delta(e, 2.0), e0, dx) + chain_rel_tol(
        8
    ) * 2 * special.ndtr(0.25 - 2 * e0)
    assert sc.gaussian_delta(e0, 2.0) == pytest.approx(1e-6, abs=tol)
    assert e0 < sc.gaussian_epsilon(1e-6, 2.0, "classical")


def test_monotone_in_steps():
    eps = [
        sc.epsilon(Q, SIGMA, t, DELTA, v) for v in ("paper", "valid") for t in (100, 1000, 10_000)
    ]
    assert eps[0] < eps[1] < eps[2] and eps[3] < eps[4] < eps[5]
    assert sc.epsilon(Q, SIGMA, 0, DELTA) == 0.0


def test_figure2_forms_labelled():
    # the theorem's form (default, pinned by the CLI) and the T·ε'² form that matches the
    # figure's 9.34 values printed to 5 significant digits
    assert sc.epsilon(Q, SIGMA, 10_000, DELTA, "paper") == pytest.approx(9.3532, abs=1e-4)
    assert sc.epsilon(Q, SIGMA, 10_000, DELTA, "paper", form="square") == pytest.approx(
        9.3376, abs=1e-4
    )
    with pytest.raises(ValueError, match="form"):
        sc.epsilon(Q, SIGMA, 10_000, DELTA, form="cube")


@pytest.mark.parametrize("variant", ["paper", "valid"])
@pytest.mark.parametrize(
    "q,sigma,steps", [(0.01, 0.03, 10), (1.0, 0.01, 1), (0.5, 0.01, 1), (1e-12, 0.01, 1)]
)
def test_tiny_sigma_never_overflows(variant, q, sigma, steps):
    # (0.01, 0.03, 10) raised OverflowError; (1e-12, ...) a math domain error (per-lot δ0 > 1)
    eps = sc.epsilon(q, sigma, steps, 1e-5, variant)
    assert eps >= 0.0 and not math.isnan(eps)
    if variant == "valid" and q == 1.0:
        assert eps == math.inf  # no finite bound: e^{ε'} overflows
