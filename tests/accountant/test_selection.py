"""Private selection (dpsgd/accountant/selection.py) against Papernot & Steinke 2022's closed forms,
an independent mpmath implementation of their Theorems 2 and 6, and dp_accounting 0.6.0."""

from __future__ import annotations

import math

import mpmath as mp
import numpy as np
import pytest
from dp_accounting.rdp import rdp_privacy_accountant as dpa

from dpsgd.accountant import rdp, selection as S
from tolerances import EPS64, chain_rel_tol, root_tol

ORDERS = np.array(rdp.DEFAULT_ORDERS)
CURVE = 240 * rdp.rdp_curve(0.08192, 4.5, rdp.DEFAULT_ORDERS)  # 20 epochs of mnist_scatter_linear
TNB = S.KDistribution("truncated_negative_binomial", eta=0.0, gamma=0.2)
LAWS = [
    S.KDistribution("poisson", mu=2.0),
    S.KDistribution("poisson", mu=1.0),
    TNB,
    S.KDistribution("truncated_negative_binomial", eta=1.0, gamma=0.25),
    S.KDistribution("truncated_negative_binomial", eta=0.5, gamma=0.3),
]
RTOL = chain_rel_tol(64)  # a few dozen exp/log/min operations per value, no cancellation


def test_k_equal_one_is_the_base_run_exactly():
    one = S.KDistribution("fixed", k=1)
    assert np.array_equal(S.selection_rdp(ORDERS, CURVE, one), CURVE)  # exact: 1·ε(λ)
    assert S.selection_epsilon(ORDERS, CURVE, one, 1e-5) == rdp.rdp_to_epsilon(
        ORDERS, CURVE, 1e-5
    )  # exact
    assert np.array_equal(
        S.selection_rdp(ORDERS, CURVE, S.KDistribution("fixed", k=3)), 3 * CURVE
    )  # exact


def _suffix_min(a, v):
    v = np.array(v, dtype=float)
    o = np.argsort(a)
    v[o] = np.minimum.accumulate(v[o][::-1])[::-1]
    return v


def _mp_theorem(law: S.KDistribution, orders, curve) -> list:
    """Papernot & Steinke Thm 2 / Thm 6 in mpmath (50 digits), E[K] from Definition 1's pmf
    summed."""
    mp.mp.dps = 50
    a = [mp.mpf(float(x)) for x in orders]
    r = [mp.mpf(float(x)) for x in curve]
    if law.name == "poisson":
        mu = mp.mpf(law.mu)
        out = []
        for lam, eps in zip(a, r):
            eh = mp.log(1 + 1 / (lam - 1))
            dh = min(
                mp.exp((b - 1) * (e - eh)) * (1 - 1 / b) ** (b - 1) / b for b, e in zip(a, r)
            )  # Balle et al. Thm 21
            out.append(eps + mu * min(dh, 1) + mp.log(mu) / (lam - 1))
        return out
    eta, g = mp.mpf(law.eta), mp.mpf(law.gamma)
    pmf = lambda k: (
        (1 - g) ** k * mp.binomial(k + eta - 1, k) / (g**-eta - 1 if eta else mp.log(1 / g))
    )
    if eta == 0:
        pmf = lambda k: (1 - g) ** k / (k * mp.log(1 / g))
    mean = mp.nsum(lambda k: k * pmf(k), [1, mp.inf])
    c = min((1 + eta) * ((1 - 1 / lh) * eh + mp.log(1 / g) / lh) for lh, eh in zip(a, r))
    return [eps + c + mp.log(mean) / (lam - 1) for lam, eps in zip(a, r)]


@pytest.mark.parametrize("law", LAWS, ids=lambda d: f"{d.name}-{d.mu or d.eta}")
def test_theorems_match_an_independent_mpmath_implementation(law):
    ref = _suffix_min(ORDERS, [float(x) for x in _mp_theorem(law, ORDERS, CURVE)])
    np.testing.assert_allclose(S.selection_rdp(ORDERS, CURVE, law), ref, rtol=RTOL)


@pytest.mark.parametrize("law", LAWS, ids=lambda d: f"{d.name}-{d.mu or d.eta}")
def test_theorems_match_dp_accounting(law):
    """dp_accounting's repeat-and-select (it skips the monotonicity step for Poisson: applied here).
    Its γ is found from E[K] by bisection to 1e-9 relative, on the conservative side, which moves
    the (1+η)·log(1/γ)/λ̂ term by at most (1+η)·1e-9/min λ̂ (η = 1: γ = 1/mean, no bisection)."""
    shape = math.inf if law.name == "poisson" else law.eta
    theirs = _suffix_min(
        ORDERS, dpa._compute_rdp_repeat_and_select(list(ORDERS), list(CURVE), law.mean, shape)
    )
    bisection = (
        0.0 if law.name == "poisson" or law.eta == 1 else 2 * (1 + law.eta) * 1e-9 / ORDERS.min()
    )
    np.testing.assert_allclose(
        S.selection_rdp(ORDERS, CURVE, law), theirs, rtol=RTOL, atol=bisection
    )


@pytest.mark.parametrize("eta", [0.0, 0.5, 1.0, 2.0])
def test_pure_dp_corollary_and_liu_talwar(eta):
    """Papernot & Steinke, Corollary 3: a pure ε-DP base with K ~ D_{η,γ} gives a ((2 + η)ε)-DP
    selection; η = 1 (geometric) is Liu & Talwar 2019's 3ε. Worked value: ε = 1, η = 1 -> 3 (their
    number); ours at λ = λ̂ = 1e10 is 3 up to the O(1/λ) terms
    (1+η)(ε + log(1/γ))/λ + log E[K]/(λ−1)."""
    eps, lam, g = 1.0, 1e10, 0.1
    law = S.KDistribution("truncated_negative_binomial", eta=eta, gamma=g)
    ours = S.selection_rdp([lam], [eps], law)[0]
    o_lam = (1 + eta) * (eps + math.log(1 / g)) / lam + math.log(law.mean) / (lam - 1)
    assert ours == pytest.approx((2 + eta) * eps, abs=o_lam + RTOL * (2 + eta))


@pytest.mark.parametrize(
    "rho,gamma,eta", [(0.01, 0.01, 0), (1, 0.1, 0.5), (0.05, 0.2, 1), (0.5, 0.1, 5)]
)
def test_gaussian_corollary(rho, gamma, eta):
    """Papernot & Steinke, Corollary 4: base ρ-zCDP (ε(λ) = ρλ), K ~ D_{η,γ}, ρ <= log(1/γ):
    ε'(λ) = ρ(λ−1) + log E[K]/(λ−1) + 2(1+η)√(ρ log(1/γ)) − ηρ for λ >= 1 + √(log E[K]/ρ), and the
    value at that λ below it; the orders hold both optima λ̂* = √(log(1/γ)/ρ) and λ*."""
    law = S.KDistribution("truncated_negative_binomial", eta=float(eta), gamma=gamma)
    m = law.mean
    lam_star = 1 + math.sqrt(math.log(m) / rho)
    orders = np.array(
        sorted([1.1, 2, math.sqrt(math.log(1 / gamma) / rho), lam_star, 3, 5, 10, 100, 1000])
    )
    ours = S.selection_rdp(orders, rho * orders, law)
    c = 2 * (1 + eta) * math.sqrt(rho * math.log(1 / gamma)) - eta * rho
    for lam, v in zip(orders, ours):
        lam = max(lam, lam_star)
        assert v == pytest.approx(rho * (lam - 1) + math.log(m) / (lam - 1) + c, rel=RTOL)


@pytest.mark.parametrize(
    "law",
    [
        TNB,
        S.KDistribution("truncated_negative_binomial", eta=1.5, gamma=0.3),
        S.KDistribution("poisson", mu=2.5),
    ],
    ids=lambda d: d.name,
)
def test_k_draws_follow_the_law(law):
    """Mean of 40 000 draws within 5 standard errors of E[K] (false alarm 6e-7; the variance from
    the pmf)."""
    k = np.arange(1, 400)
    if law.name == "poisson":
        var = law.mu
    else:
        pmf = np.array(
            [
                float(p)
                for p in (
                    mp.mpf(1 - law.gamma) ** int(i)
                    * (mp.binomial(int(i) + law.eta - 1, int(i)) if law.eta else mp.mpf(1) / int(i))
                    for i in k
                )
            ]
        )
        pmf /= pmf.sum()
        assert float(pmf @ k) == pytest.approx(law.mean, rel=chain_rel_tol(len(k)))
        var = float(pmf @ k**2) - law.mean**2
    rng = np.random.default_rng(0)
    draws = np.array([law.sample(rng) for _ in range(40000)])
    assert abs(draws.mean() - law.mean) <= 5 * math.sqrt(var / len(draws))
    assert law.name == "poisson" or draws.min() >= 1


def test_inverse_meets_the_target_within_xtol():
    xtol, target = 1e-4, 1.2
    curve_of = lambda x: x * CURVE
    x = S.solve_base(target, 1e-5, TNB, curve_of, 1e-3, 10.0, xtol)
    total = lambda y: S.selection_epsilon(ORDERS, curve_of(y), TNB, 1e-5)[0]
    assert total(x) <= target
    assert total(x + root_tol(x, xtol)) > target


def test_plan_sigmas_spends_the_target():
    cands = [(0.08192, 120, 1), (0.08192, 480, 1)]
    eps_b, sig, curve, (eps, _) = S.plan_sigmas(cands, 1.2, 1e-5, TNB, 1e-2, score_sigma=20.0)
    assert eps <= 1.2
    assert sig[1] > sig[0]  # more lots, more noise for the same base ε
    assert np.all(curve >= S.candidate_curve(0.08192, sig[1], 480) + S.score_rdp(20.0))


@pytest.mark.parametrize(
    "kw,name",
    [
        (dict(name="fixed", k=0), "k"),
        (dict(name="poisson", mu=0.5), "mu"),
        (dict(name="truncated_negative_binomial", eta=-1.0, gamma=0.5), "eta"),
        (dict(name="truncated_negative_binomial", eta=1.0, gamma=1.0), "gamma"),
        (dict(name="binomial"), "distribution"),
    ],
)
def test_bad_law_names_its_parameter(kw, name):
    with pytest.raises(ValueError, match=name):
        S.KDistribution(**kw)


def test_eps64_scale():  # the tolerances above are far above float64 round-off of values ~1
    assert RTOL > 10 * EPS64
