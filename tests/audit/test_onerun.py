"""The one-run audit bound (dpsgd/audit/onerun/stats/bounds.py; Steinke, Nasr & Jagielski 2023)
against independent references: the δ = 0 binomial tail summed in mpmath, the paper's worked values,
monotonicity, and a Monte Carlo of an exactly ε-DP randomized-response canary game."""

import math

import mpmath
import numpy as np
import pytest
from scipy import stats

from dpsgd.accountant import strong_composition
from dpsgd.audit.onerun.stats import bounds as onerun
from dpsgd.core.errors import ConfigError
from tolerances import EPS64, root_tol, sum_tol


def _mp_eps_lb(r, v, beta):
    """δ = 0: the ε where P[Bin(r, e^ε/(1+e^ε)) >= v] = β, by direct summation in mpmath (50
    digits)."""
    mpmath.mp.dps = 50

    def tail(eps):
        p = 1 / (1 + mpmath.exp(-eps))
        return (
            mpmath.fsum(mpmath.binomial(r, k) * p**k * (1 - p) ** (r - k) for k in range(v, r + 1))
            - beta
        )

    return float(mpmath.findroot(tail, (mpmath.mpf(0.01), mpmath.mpf(20)), solver="anderson"))


@pytest.mark.parametrize("r,v", [(100, 75), (50, 50), (400, 240), (20, 17)])
def test_delta_zero_is_the_binomial_tail(r, v):
    got = onerun.steinke_bound(r, v, m=10 * r, delta=0.0, beta=0.05)
    want = _mp_eps_lb(r, v, 0.05)
    # bisection returns the rejected end, within XTOL below the crossing
    assert want - root_tol(want, onerun.XTOL) <= got <= want + root_tol(want, 0.0)
    # and the p-value itself is the binomial tail (scipy's regularised incomplete beta vs mpmath)
    p = 1 / (1 + math.exp(-1.3))
    mp = float(
        mpmath.fsum(
            mpmath.binomial(r, k) * mpmath.mpf(p) ** k * (1 - mpmath.mpf(p)) ** (r - k)
            for k in range(v, r + 1)
        )
    )
    assert onerun.p_value(r, v, 10 * r, 1.3, 0.0) == pytest.approx(
        mp, rel=1e3 * r * EPS64
    )  # bdtrc: O(r) ops


def test_delta_term_matches_a_direct_sum():
    # Cor. 5.4 / App. D: p = P[B >= v] + 2mδ·max_i P[v−i <= B < v]/i, B ~ Bin(r, expit(ε)); here
    # summed in mpmath
    r, v, m, eps, delta = 100, 75, 1000, 0.6, 1e-4
    mpmath.mp.dps = 40
    p = 1 / (1 + mpmath.exp(-eps))
    pmf = [mpmath.binomial(r, k) * p**k * (1 - p) ** (r - k) for k in range(r + 1)]
    alpha = max(mpmath.fsum(pmf[v - i : v]) / i for i in range(1, v + 1))
    want = float(mpmath.fsum(pmf[v:]) + 2 * m * delta * alpha)
    assert onerun.p_value(r, v, m, eps, delta) == pytest.approx(want, rel=1e3 * r * EPS64)


@pytest.mark.parametrize(
    "args,published",
    [
        # Steinke et al. 2023 (arXiv 2305.08846v1), App. D worked example: m=1000, r=100, v=75,
        # δ=1e-4, β=0.05 -> 0.673
        ((100, 75, 1000, 1e-4, 0.05), 0.673),
        # §7 (Fig. 11 setting): m=1e5, r=1510, v=1439, δ=1e-5, β=0.05 -> 2.675 (printed truncated)
        ((1510, 1439, 100000, 1e-5, 0.05), 2.675),
    ],
)
def test_paper_worked_values(args, published):
    # printed to 3 decimals (rounded or truncated): within one unit of the last digit
    assert onerun.steinke_bound(*args) == pytest.approx(published, abs=1e-3)


def test_monotone():
    base = onerun.steinke_bound(200, 150, 2000, 1e-5, 0.05)
    assert onerun.steinke_bound(200, 160, 2000, 1e-5, 0.05) > base  # more correct
    assert onerun.steinke_bound(400, 300, 2000, 1e-5, 0.05) > base  # same accuracy, more guesses
    assert onerun.steinke_bound(200, 150, 2000, 1e-5, 0.01) < base  # more confidence
    assert onerun.steinke_bound(200, 150, 2000, 1e-3, 0.05) < base  # larger δ
    assert onerun.steinke_bound(200, 150, 2000, 0.0, 0.05) > base  # δ = 0
    assert onerun.steinke_bound(200, 100, 2000, 1e-5, 0.05) == 0.0  # integer: chance level
    # p(ε, δ) rises with ε (what the bisection assumes), up to the round-off of its two-term sum
    for r, v, m, d in [(100, 75, 1000, 1e-4), (1510, 1439, 100000, 1e-5), (200, 120, 10000, 1e-3)]:
        p = np.array([onerun.p_value(r, v, m, e, d) for e in np.linspace(0, 8, 801)])
        assert np.all(np.diff(p) >= -sum_tol([1.0, 1.0]))


def _rr_game(rng, m, eps):
    """Randomized response per canary: exactly ε-DP w.r.t. each canary (score = the noisy bit)."""
    bits = rng.integers(0, 2, m)
    keep = rng.random(m) < 1 / (1 + math.exp(-eps))
    return np.where(keep, bits, 1 - bits).astype(float), bits


def test_monte_carlo_coverage_randomized_response():
    # ε-DP randomized response is the worst case of the δ = 0 bound: each fixed (r) test rejects the
    # true ε with probability <= β/|grid|, the grid max with <= β. 300 games at β = 0.2:
    # exceedances ~ Bin(300, <= 0.2); a correct bound exceeds the cap c below with
    # probability <= 1e-6 (the test's false-alarm rate), while a bound that ignored the grid (β per
    # point, 14 points) would exceed ε far more often (checked below on the same games).
    rng = np.random.default_rng(0)
    eps, m, beta, n = 1.0, 400, 0.2, 300
    cap = int(stats.binom.isf(1e-6, n, beta))
    over = over_uncorrected = 0
    for _ in range(n):
        scores, bits = _rr_game(rng, m, eps)
        res = onerun.audit_bound(scores, bits, delta=0.0, beta=beta)
        over += res["eps_lower_bound"] > eps
        over_uncorrected += (
            max(onerun.steinke_bound(g["guesses"], g["correct"], m, 0.0, beta) for g in res["grid"])
            > eps
        )
        assert res["eps_lower_bound"] <= max(g["eps_lower_bound"] for g in res["grid"])
    assert over <= cap  # measured: 18 of 300 (cap 95)
    # the same maximum without the correction is not a 1 − β bound here (measured: 145 of 300)
    assert over_uncorrected > n * beta


def test_single_point_rejection_rate_is_at_most_beta_and_tight():
    # ε-DP randomized response on all m canaries, every one guessed: V ~ Bin(m, expit(ε)) exactly.
    # The probability that the bound exceeds ε is P[V >= v*], v* the least v whose bound exceeds ε:
    # <= β by the theorem, and close to β (the δ = 0 bound is tight for randomized response)
    eps, m, beta = 1.0, 400, 0.2
    v_star = next(v for v in range(m + 1) if onerun.steinke_bound(m, v, m, 0.0, beta) > eps)
    rate = stats.binom.sf(v_star - 1, m, 1 / (1 + math.exp(-eps)))
    assert 0.5 * beta < rate <= beta  # measured: 0.18


def test_audit_bound_counts_and_grid():
    # 10 canaries, scores sorted by hand: top-2 "in" (bits 1, 1), bottom-3 "out" (bits 0, 0, 1)
    scores = np.array([9, 8, 7, 6, 5, 4, 3, 2, 1, 0], dtype=float)
    bits = np.array([1, 1, 0, 1, 0, 1, 0, 1, 0, 0])
    res = onerun.audit_bound(scores, bits, delta=1e-5, beta=0.05, guesses=[(2, 0), (2, 3), (0, 3)])
    rows = {(g["k_plus"], g["k_minus"]): (g["guesses"], g["correct"]) for g in res["grid"]}
    assert rows == {(2, 0): (2, 2), (2, 3): (5, 4), (0, 3): (3, 2)}
    assert (
        res["beta_per_point"] == pytest.approx(0.05 / 3, rel=4 * EPS64)
        and res["correction"] == "bonferroni"
    )
    # deterministic: the same inputs give the same answer
    assert onerun.audit_bound(scores, bits, 1e-5, 0.05, [(2, 0), (2, 3), (0, 3)]) == res
    # ties broken by index, never by the bits: all scores equal -> the first k are "in"
    flat = onerun.audit_bound(np.zeros(10), bits, 1e-5, 0.05, [(3, 0)])
    assert flat["correct"] == int(bits[:3].sum())
    assert onerun.default_grid(1000)[:3] == [(5, 0), (10, 0), (20, 0)] and (
        500,
        500,
    ) in onerun.default_grid(1000)


def test_strong_signal_gives_a_positive_bound():
    rng = np.random.default_rng(1)
    bits = rng.integers(0, 2, 1000)
    scores = bits * 3.0 + rng.normal(size=1000)  # well separated
    res = onerun.audit_bound(scores, bits, delta=1e-5)
    assert res["eps_lower_bound"] > 1.0 and res["correct"] <= res["guesses"]


@pytest.mark.parametrize(
    "call,name",
    [
        (lambda: onerun.steinke_bound(10, 11, 100, 1e-5, 0.05), "v <= r"),
        (lambda: onerun.steinke_bound(10, 5, 100, 1.0, 0.05), "delta"),
        (lambda: onerun.steinke_bound(10, 5, 100, 1e-5, 0.0), "beta"),
        (lambda: onerun.steinke_bound(10.5, 5, 100, 1e-5, 0.05), "r="),
        (lambda: onerun.audit_bound([1.0, 2.0], [1, 2], 1e-5), "bits"),
        (lambda: onerun.audit_bound([1.0, float("nan")], [1, 0], 1e-5), "scores"),
        (lambda: onerun.audit_bound([1.0, 2.0], [1, 0], 1e-5, guesses=[(2, 1)]), "guesses"),
    ],
)
def test_bad_input_one_line(call, name):
    with pytest.raises(ConfigError) as e:
        call()
    assert name in str(e.value) and "\n" not in str(e.value)


# --- Gaussian DP (Mahloujifar, Melis & Chaudhuri 2024) --------------------------------------------


def _port_rejected(mu, r, v, m, beta):
    """The authors' released recursion (Meta PrivacyGuard FDPAnalysisNode.audit_rh_with_cap, k = 2),
    re-typed with scipy.stats.norm: True when μ-GDP is rejected."""
    tau = beta * r / m
    h, rr = [0.0] * (v + 1), [0.0] * (v + 1)
    h[v], rr[v] = tau * (r - v) / r, tau * v / r
    for i in range(v - 1, -1, -1):
        h[i] = max(h[i + 1], stats.norm.cdf(stats.norm.ppf(min(rr[i + 1], 1.0)) - mu))
        rr[i] = rr[i + 1] + i / (r - i) * (h[i] - h[i + 1])
    return not rr[0] + h[0] <= r / m


@pytest.mark.parametrize("r,v,m", [(100, 75, 1000), (200, 160, 1000), (60, 45, 10000)])
def test_gdp_matches_the_authors_recursion_and_is_monotone(r, v, m):
    mus = np.linspace(0.05, 3.0, 60)
    port = [_port_rejected(mu, r, v, m, 0.05) for mu in mus]
    assert port == sorted(port, reverse=True)  # rejected for small μ only
    mu_lb = onerun.gdp_lower_bound(r, v, m, 0.05)["mu_lower_bound"]
    # the bisection's μ_lb lies between the port's last rejected and first accepted grid point
    last = mus[np.flatnonzero(port)[-1]] if any(port) else 0.0
    first = mus[port.index(False)]
    assert last - root_tol(last, onerun.XTOL) <= mu_lb <= first


def test_gdp_monte_carlo_coverage():
    # score = μ·S_i + N(0, 1): exactly μ-GDP w.r.t. each canary. A fixed guess count (k₊ = k₋ = 100)
    # at β = 0.1, 200 games: a correct bound exceeds μ at most ~Bin(200, 0.1) times; the cap has
    # false-alarm rate 1e-6 (measured: 0 of 200 — the bound is conservative here)
    rng = np.random.default_rng(3)
    mu, m, k, beta, n = 1.0, 1000, 100, 0.1, 200
    cap = int(stats.binom.isf(1e-6, n, beta))
    over = 0
    for _ in range(n):
        bits = rng.integers(0, 2, m)
        res = onerun.audit_bound(
            mu * bits + rng.normal(size=m), bits, 0.0, beta, [(k, k)], gdp=True
        )
        over += res["gdp_mu_lower_bound"] > mu
    assert over <= cap


def test_gdp_is_tighter_than_the_eps_delta_bound_on_gaussian_scores():
    # Mahloujifar et al.'s point: on a Gaussian mechanism the f-DP analysis certifies more
    rng = np.random.default_rng(1)
    bits = rng.integers(0, 2, 1000)
    res = onerun.audit_bound(2.0 * bits + rng.normal(size=1000), bits, 1e-5, gdp=True)
    assert res["gdp_eps_lower_bound"] > res["eps_lower_bound"] > 0  # measured: 4.28 > 2.93
    true_eps = strong_composition.gaussian_epsilon(1e-5, 1 / 2.0)
    assert res["gdp_eps_lower_bound"] < true_eps and res["gdp_mu_lower_bound"] < 2.0


def test_the_score_file_holds_every_canary_when_the_games_differ_in_size(tmp_path, capsys):
    """200 gradient canaries beside 1000 input canaries (any gradient count below the input count):
    every canary's row is written, Σz² only on the gradient canaries', and the scores before
    audit.json."""
    import csv
    import json
    import torch
    from dpsgd.audit.onerun.report import SCORES, write_report

    g = torch.Generator().manual_seed(0)
    scored = {
        "white-box": (torch.randn(200, generator=g), torch.randint(0, 2, (200,), generator=g)),
        "black-box": (torch.randn(1000, generator=g), torch.randint(0, 2, (1000,), generator=g)),
    }
    report = {
        "games": [],
        "eps_claimed": 1.0,
        "eps_last_iterate_heuristic": 1.0,
        "verdict": "consistent",
        "variant": "correct",
    }
    write_report(tmp_path, scored, report, sumsq=torch.rand(200, generator=g))
    rows = list(csv.DictReader(open(tmp_path / SCORES)))
    assert [sum(r["game"] == k for r in rows) for k in ("white-box", "black-box")] == [200, 1000]
    assert all(r["sumsq"] for r in rows[:200]) and not any(r["sumsq"] for r in rows[200:])
    assert json.loads((tmp_path / "audit.json").read_text())["verdict"] == "consistent"
