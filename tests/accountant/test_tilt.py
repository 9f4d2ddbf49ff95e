"""The tilted composition of discrete PLDs for small δ (dpsgd/accountant/privacy_loss/tilt.py), as
the truncated/fixed-size/allocation path uses it, against pld.py's own tilted Poisson composition
(an independent implementation) and the fixed-size floor."""

import pytest

from dpsgd.accountant import pld
from dpsgd.accountant.privacy_loss import truncated
from dpsgd.privacy import sampler_epsilon
from tolerances import pld_epsilon_tol


@pytest.mark.parametrize("q,sigma,lots", [(0.001, 2.0, 100_000), (0.01, 1.0, 10_000)])
@pytest.mark.parametrize("delta", [1e-11, 1e-12])
def test_poisson_through_the_tilted_path_is_pld_pys(q, sigma, lots, delta):
    ours = truncated.epsilon_for_releases([(("poisson", q, sigma), lots)], delta)
    # two PLD compositions of the same per-lot pmfs on grids of spacing <= h: PLD_GRID_STEPS steps
    assert ours == pytest.approx(
        pld.epsilon(q, sigma, lots, delta), abs=pld_epsilon_tol([(q, sigma, lots)], delta=delta)
    )


def test_the_fixed_size_corner_is_closed():
    # γ = 0.001, 1e5 lots, δ = 1e-12: the untilted FFT's round-off had set ε (2.90 at σ = 4, 2.6×
    # the constant-gradient floor); tilted it is within 1.2× of that floor (the pair's PLD, an upper
    # bound on the floor, whose lower bound is the bracket's lower end), and monotone in δ
    r = sampler_epsilon("fixed_size", 1_000_000, 1000, 4.0, 100_000, 1e-12)
    floor = pld.epsilon(0.001, 2.0, 100_000, 1e-12)
    assert r["accountant"] == "pld"
    assert r["epsilon_lower"] <= floor <= r["epsilon"] <= 1.2 * floor
    rel = [(("wor", 0.001, 4.0), 100_000)]
    eps = truncated.epsilons_for_releases(rel, [1e-10, 1e-11, 1e-12])
    assert eps == sorted(eps) and eps[-1] == r["epsilon"]  # exact: the same composition


def test_the_untilted_answer_stands_where_its_round_off_is_small():
    rel = [(("wor", 0.01, 2.0), 1000)]
    h = pld.DEFAULT_INTERVAL
    loss, c, extra = truncated._compose(truncated._checked(rel), h, "remove")
    direct = truncated._epsilon(loss, c, extra, 1e-5)
    assert truncated.epsilon_for_releases(rel, 1e-5) == direct  # exact: the same arithmetic
