"""The strategies of correlated noise (dpsgd/mechanism/correlated/strategy.py): the banded optimiser, the error
it minimises against a dense ‖A C⁻¹‖_F², BLT's per-participation sensitivity Δ_∞ against brute force
and the exact finite min-separation sensitivity, and (when installed) jax_privacy's own functions.

Tolerances: float sums of n terms (``sum_tol``, ``reduction_rtol``); the finite-difference gradient
check uses central differences with step h, whose error is O(h²·f''') + eps·|f|/h (≈ 1e-8 here for
h = 1e-5 and f of order 1), far below what a wrong adjoint gives (of the gradient's own size).
"""

import math

import numpy as np
import pytest
from scipy.linalg import toeplitz

from dpsgd.mechanism.correlated import strategy as S
from dpsgd.mechanism.correlated import toeplitz as T
from tolerances import EPS64, reduction_rtol


def _dense_ratio(s, n):
    """√(‖A·scale·C⁻¹‖_F² / ‖A‖_F²) from the dense matrices."""
    C = np.tril(toeplitz(s.toeplitz(n)))
    a = T.apply_workload(np.eye(1, n)[0], s.momentum)
    A = np.tril(toeplitz(a))
    return math.sqrt(np.sum((A @ (s.scale * np.linalg.inv(C))) ** 2) / np.sum(A**2))


@pytest.mark.parametrize("b,n,mu", [(1, 50, 0.0), (2, 300, 0.0), (6, 300, 0.9), (20, 400, 0.0)])
def test_banded_is_normalised_and_its_error_is_the_dense_one(b, n, mu):
    s = S.banded(b, n, mu)
    c = np.array(s.coef)
    assert len(c) == b and c[0] > 0
    assert abs(c @ c - 1.0) <= 4 * b * EPS64  # ‖c‖ = 1: column norms <= 1, b-term sum round-off
    S.check(s)
    assert S.expected_error_ratio(s) == pytest.approx(_dense_ratio(s, n), rel=reduction_rtol(n**2))


def test_banded_improves_on_its_start_and_more_bands_help():
    """The optimum is no worse than the truncated (1 − x)^(−1/2) it starts from, and the error falls
    with b (a b-banded C is a (b+1)-banded one with a zero)."""
    n = 2000
    ratios = [S.expected_error_ratio(S.banded(b, n)) for b in (1, 2, 4, 8, 16)]
    assert ratios[0] == 1.0 and all(x > y for x, y in zip(ratios, ratios[1:]))
    k = np.arange(8)
    init = np.cumprod(np.where(k == 0, 1.0, (2 * k - 1) / np.maximum(2 * k, 1)))
    start = S.Strategy("bandmf", n, coef=tuple(init / np.linalg.norm(init)), min_sep=8)
    assert S.expected_error_ratio(S.banded(8, n)) <= S.expected_error_ratio(start)


def test_banded_gradient_is_the_finite_difference_one():
    n, mu, h = 500, 0.5, 1e-5
    w = np.arange(n, 0, -1.0)
    e = float(np.dot(w, T.apply_workload(np.eye(1, n)[0], mu) ** 2))
    x = np.array([0.45, 0.3, 0.2, 0.1])
    f, g = S._banded_objective(x, n, mu, w, e)
    fd = [
        (
            S._banded_objective(x + h * d, n, mu, w, e)[0]
            - S._banded_objective(x - h * d, n, mu, w, e)[0]
        )
        / (2 * h)
        for d in np.eye(len(x))
    ]
    np.testing.assert_allclose(g, fd, rtol=0, atol=1e-6)  # central differences: O(h²) + eps/h


def test_strategies_are_cached_by_their_arguments():
    assert S.banded(5, 321) is S.banded(5, 321)
    assert S.blt(2, 321, 10) is S.blt(2, 321, 10)


@pytest.mark.parametrize("d,t,mu", [(1, 10, 0.0), (2, 25, 0.0), (3, 15, 0.9)])
def test_blt_sensitivity_closed_form_against_brute_force(d, t, mu):
    """Δ_∞² = ‖c‖² + 2 Σ_d ρ(d t): the closed form against the sums over 2·10⁵ coefficients (the
    tail beyond is below θ_max^(2·10⁵) relative: zero in float64)."""
    s = S.blt(d, 400, t, mu)
    c = s.toeplitz(200_000)
    assert max(s.theta) ** 200_000 < 1e-300
    brute = c @ c + 2 * sum(c[:-k] @ c[k:] for k in range(t, len(c), t))
    assert s.scale**2 == pytest.approx(brute, rel=reduction_rtol(200_000))


@pytest.mark.parametrize("n,t", [(100, 10), (400, 25), (1000, 7)])
def test_blt_charge_bounds_the_exact_min_separation_sensitivity(n, t):
    """K participations charged at Δ_∞ each: K·Δ_∞² >= the exact sensitivity² of the worst
    pattern (0, t, 2t, ...) of the n × n strategy, which equals the dense ‖C u‖²."""
    s = S.blt(3, n, t)
    c = s.toeplitz(n)
    K = -(-n // t)
    exact = T.sensitivity_squared_minsep(c, t, n)
    u = np.zeros(n)
    u[::t] = 1.0
    dense = np.sum((np.tril(toeplitz(c)) @ u) ** 2)
    assert exact == pytest.approx(dense, rel=reduction_rtol(n * n))
    assert K * s.scale**2 >= exact
    assert np.all(c >= 0) and np.all(np.diff(c) <= 0)  # non-negative, non-increasing: Thm 2 applies


def test_blt_is_stable_and_its_noise_decays():
    s = S.blt(4, 3000, 100)
    assert T.stable(np.array(s.theta), np.array(s.omega))
    r = s.noise_coefficients(3000)
    assert abs(r[-1]) < 1e-6 * abs(r[0])


def test_check_refuses_what_a_charge_does_not_cover():
    with pytest.raises(ValueError, match="‖c‖₂ = 1"):
        S.check(S.Strategy("bandmf", 10, coef=(1.0, 0.5)))
    with pytest.raises(ValueError, match="scale"):
        s = S.blt(2, 100, 10)
        S.check(S.Strategy("blt", 100, theta=s.theta, omega=s.omega, min_sep=10, scale=1.0))
    with pytest.raises(ValueError, match="bands"):
        S.for_run("bandmf", 8, 4, 100, 4, 0.0)  # 8 bands, separation 4
    assert S.Strategy.from_dict(S.banded(3, 77).to_dict()) == S.banded(3, 77)


# -- jax_privacy's own functions, when installed (pip install -e '.[mf-reference]') --------------


@pytest.fixture
def jax_mf():
    pytest.importorskip("jax_privacy")
    import jax

    jax.config.update("jax_enable_x64", True)
    from jax_privacy.matrix_factorization import buffered_toeplitz, toeplitz as jtoeplitz

    return buffered_toeplitz, jtoeplitz


@pytest.mark.parametrize("n,t", [(200, 10), (1000, 100), (600, 15)])
def test_minsep_sensitivity_against_jax_privacy(jax_mf, n, t):
    _, jt = jax_mf
    c = S.blt(2, n, t).toeplitz(n)
    theirs = float(jt.minsep_sensitivity_squared(c, t, None, n))
    assert T.sensitivity_squared_minsep(c, t, n) == pytest.approx(theirs, rel=reduction_rtol(n * n))


def test_blt_inverse_against_jax_privacy(jax_mf):
    """Our noise coefficients (C⁻¹ by the rational form Q/P) against jax_privacy's inverse BLT."""
    bt, _ = jax_mf
    s = S.blt(3, 500, 20)
    inv = bt.BufferedToeplitz.build(buf_decay=s.theta, output_scale=s.omega).inverse()
    theirs = np.array(inv.toeplitz_coefs(500))
    # jax_privacy accepts its eigendecomposition inverse at allclose(atol=1e-7) (its own check)
    np.testing.assert_allclose(s.noise_coefficients(500) / s.scale, theirs, rtol=0, atol=1e-7)
