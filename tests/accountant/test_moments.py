"""Moments accountant (Abadi et al. 2016, §3.2): paper numbers, 50-digit integration, limits."""

import math

import mpmath as mp
import numpy as np
import pytest

from dpsgd.accountant import moments, rdp
from tolerances import chain_rel_tol

Q, SIGMA, DELTA = 0.01, 4.0, 1e-5


def _log_e(q, sigma, lam, which):
    """log E1 (which=1) or log E2 (which=2) by 50-digit mpmath integration (paper §3.2)."""
    with mp.workdps(50):
        q, s = mp.mpf(q), mp.mpf(sigma)
        base = lambda z: 1 - q + q * mp.exp((2 * z - 1) / (2 * s * s))  # μ(z)/μ0(z)
        power = lam + 1 if which == 2 else -lam  # E2 = E_μ0[(μ/μ0)^{λ+1}]
        f = lambda z: mp.npdf(z, 0, s) * base(z) ** power
        pts = sorted(
            {
                -mp.inf,
                -20 * s,
                -5 * s,
                mp.mpf(0),
                mp.mpf(1) / 2,
                mp.mpf(1),
                5 * s,
                lam + 1 - 10 * s,
                mp.mpf(lam + 1),
                lam + 1 + 10 * s,
                mp.inf,
            }
        )
        return mp.log(mp.quad(f, pts))


def _check_against_mpmath(q, sigma, lam):
    e1, e2 = _log_e(q, sigma, lam, 1), _log_e(q, sigma, lam, 2)
    ref = max(e1, e2)
    assert e1 <= e2  # MTZ 2019 §3.3: the E2 direction dominates
    ours = moments.log_moments(q, sigma, [lam])[0]
    assert abs(ours - float(ref)) <= 1e-10 * float(ref), (q, sigma, lam, ours, float(ref))


@pytest.mark.parametrize("q,sigma,lam", [(0.1, 0.7, 32), (0.001, 4.0, 1), (0.01, 1.0, 8)])
def test_log_moment_matches_50_digit_integration(q, sigma, lam):
    _check_against_mpmath(q, sigma, lam)


@pytest.mark.slow
@pytest.mark.parametrize("q", [0.001, 0.01, 0.1])
@pytest.mark.parametrize("sigma", [0.7, 1.0, 4.0])
@pytest.mark.parametrize("lam", [1, 2, 8, 32])
def test_log_moment_matches_50_digit_integration_grid(q, sigma, lam):
    _check_against_mpmath(q, sigma, lam)


def test_figure2_moments_paper_numbers():
    # Abadi et al. 2016, Figure 2: q = 0.01, σ = 4, δ = 1e-5; E epochs = E/q lots
    eps100, lam100 = moments.epsilon(Q, SIGMA, 10_000, DELTA)
    assert abs(eps100 - 1.26) <= 0.01 and 1 <= lam100 <= 32
    eps400, _ = moments.epsilon(Q, SIGMA, 40_000, DELTA)
    assert abs(eps400 - 2.55) <= 0.05
    # exact values (the paper prints 1.26 and 2.55)
    # values printed to 5 significant digits (half a unit of the last)
    assert eps100 == pytest.approx(1.25857, abs=1e-4)
    assert eps400 == pytest.approx(2.57587, abs=1e-4)


def test_q_one_is_gaussian_mechanism():
    lams = np.arange(1, 33)
    for sigma in (0.7, 1.0, 4.0):
        a = moments.log_moments(1.0, sigma, tuple(lams))
        np.testing.assert_array_equal(a, lams * (lams + 1) / (2 * sigma**2))
        # continuity: q just below 1 goes through the binomial expansion
        np.testing.assert_allclose(moments.log_moments(1 - 1e-12, sigma, tuple(lams)), a, rtol=1e-6)


def test_moments_equal_rdp_paper_conversion():
    # α(λ) = λ·R(λ+1) and the tail bound equals the paper RDP conversion at α = λ + 1; both sides
    # share log A_α and differ by a few float64 operations (·λ, /(α − 1), the conversion's sums)
    lams = tuple(range(1, 33))
    np.testing.assert_allclose(
        moments.log_moments(Q, SIGMA, lams),
        np.array(lams) * rdp.compute_rdp(Q, SIGMA, [l + 1 for l in lams]),
        rtol=chain_rel_tol(4),
    )
    e_m, lam = moments.epsilon(Q, SIGMA, 10_000, DELTA)
    e_r, alpha = rdp.epsilon(
        Q, SIGMA, 10_000, DELTA, orders=[l + 1 for l in lams], conversion="paper"
    )
    assert e_m == pytest.approx(e_r, rel=chain_rel_tol(8)) and alpha == lam + 1


def test_no_overflow_small_sigma_large_lambda():
    a = moments.log_moments(0.1, 0.3, (32,))[0]
    assert math.isfinite(a) and a > 1000


def test_tail_bound_delta_epsilon_inverse():
    eps, lam = moments.epsilon(Q, SIGMA, 10_000, DELTA)
    d, lam2 = moments.delta(Q, SIGMA, 10_000, eps)
    # δ = exp(α − λε): the round-off of λε and log(1/δ) (a few ops each) becomes relative error in δ
    assert (
        d == pytest.approx(DELTA, rel=chain_rel_tol(4) * (lam * eps + math.log(1 / DELTA)))
        and lam2 == lam
    )


def test_heterogeneous_composition_adds_log_moments():
    pca = moments.log_moments(1.0, 8.0)
    sgd = moments.log_moments(Q, SIGMA)
    eps, _ = moments.epsilon_from_log_moments(pca + 10_000 * sgd, DELTA)
    assert eps > moments.epsilon(Q, SIGMA, 10_000, DELTA)[0]


def test_monotone_in_steps_and_sigma():
    eps_t = [moments.epsilon(Q, SIGMA, t, DELTA)[0] for t in (1, 10, 100, 1000, 10_000, 100_000)]
    assert all(a < b for a, b in zip(eps_t, eps_t[1:]))
    eps_s = [moments.epsilon(Q, s, 10_000, DELTA)[0] for s in (0.7, 1, 2, 4, 8)]
    assert all(a > b for a, b in zip(eps_s, eps_s[1:]))


# --- the paper's analytic results: Lemma 3 and Theorem 1 ------------------------------------------
def _lemma3_grid():
    for sigma in (1.0, 1.5, 2.0, 4.0, 8.0, 16.0):
        for q in (1e-4, 1e-3, 5e-3, 0.01, 0.03, 0.06):
            if q < 1 / (16 * sigma):
                lam_max = int(sigma * sigma * math.log(1 / (q * sigma)))
                for lam in sorted({1, 2, 5, 10, 32, min(lam_max, 200)}):
                    if 1 <= lam <= lam_max:
                        yield q, sigma, lam


def test_exact_log_moments_stay_below_lemma3_inside_its_conditions():
    """Inside Lemma 3's conditions the exact α(λ) is below the leading term q²λ(λ+1)/((1−q)σ²) alone
    (max ratio 0.988 on this grid); the dropped O(q³λ³/σ³) remainder is not needed there."""
    grid = list(_lemma3_grid())
    assert len(grid) > 60
    for q, sigma, lam in grid:
        exact = float(moments.log_moments(q, sigma, (lam,))[0])
        assert exact <= moments.lemma3_bound(q, sigma, lam), (q, sigma, lam)


def test_lemma3_conditions_matter():
    # outside them the leading term is far too small: q = 0.1, σ = 1 (q > 1/16) is off by 38x at
    # λ = 32
    assert not moments.lemma3_applies(0.1, 1.0, 32)
    assert float(moments.log_moments(0.1, 1.0, (32,))[0]) > 10 * 0.1**2 * 32 * 33 / (0.9 * 1.0)
    with pytest.raises(ValueError, match="Lemma 3"):
        moments.lemma3_bound(0.1, 1.0, 32)
    # the paper's large-noise MNIST setting (σ = 8, q = 0.01) is outside the lemma:
    # 1/(16σ) = 0.0078 < q
    assert not moments.lemma3_applies(0.01, 8.0, 1)
    assert moments.lemma3_applies(0.01, 4.0, 10) and not moments.lemma3_applies(0.01, 4.0, 0)


def test_epsilon_scales_like_theorem1():
    """ε / (q √(T log(1/δ)) / σ) stays in a narrow band wherever ε is above the λ <= 32 floor."""
    floor = math.log(1 / DELTA) / 32
    ratios = []
    for q in (0.001, 0.01):
        for sigma in (2.0, 4.0, 8.0):
            for T in (1_000, 10_000, 100_000):
                eps = moments.epsilon(q, sigma, T, DELTA)[0]
                if eps >= 2 * floor:
                    ratios.append(eps / moments.theorem1_scale(q, sigma, T, DELTA))
    assert len(ratios) >= 7
    assert 1.3 <= min(ratios) and max(ratios) <= 2.0, ratios
    # and the scale itself: √T in the steps, 1/σ in the noise, linear in q
    s = moments.theorem1_scale(0.01, 4.0, 10_000, DELTA)
    # a closed form scaled by 2: pytest's default rel 1e-6, far above its few float64 ops
    assert moments.theorem1_scale(0.01, 4.0, 40_000, DELTA) == pytest.approx(2 * s)
    assert moments.theorem1_scale(0.01, 8.0, 10_000, DELTA) == pytest.approx(s / 2)
    assert moments.theorem1_scale(0.02, 4.0, 10_000, DELTA) == pytest.approx(2 * s)
