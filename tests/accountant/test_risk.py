"""Membership-inference risk from a ledger (dpsgd/accountant/risk.py): the TPR bound at low FPR
against the μ-GDP closed form of the Gaussian mechanism (q = 1), and against the same envelope over
dp_accounting's PLD for Poisson lots."""

import math

import numpy as np
import pytest
from scipy.stats import norm

from dpsgd.accountant import Ledger, risk
from dpsgd.accountant.events import Gaussian, Poisson

dpa = pytest.importorskip("dp_accounting")

# The envelope uses finitely many supporting lines, one per δ of the grid (200 log-spaced points
# over 8.7 decades: neighbouring δ differ by a factor 1.11), so it lies above the true curve by
# the gap between neighbouring tangents: at most 4.6e-4 over these cases and α; plus the PLD grid
# (h = 1e-4 in the loss, ε up by ~h: TPR by a factor e^h, < 1e-4 here). 1e-3 bounds both.
GRID_GAP = 1e-3


@pytest.mark.parametrize("sigma, T", [(1.0, 1), (2.0, 4), (3.0, 50), (0.5, 10)])
def test_the_gaussian_mechanism_meets_its_gdp_curve_from_above(sigma, T):
    ledger = Ledger()
    ledger.record(Gaussian(sigma, 1.0, 1), T, "sgd")
    mu = math.sqrt(T) / sigma  # T Gaussians at σ: (√T/σ)-GDP exactly (Dong, Roth & Su, Cor. 3.3)
    r = risk.risk(ledger)
    for a in risk.FPRS:
        exact = norm.cdf(norm.ppf(a) + mu)
        assert exact <= r["tpr_at_fpr"][str(a)] <= exact + GRID_GAP
    if mu < 4:  # beyond, TPR at 1 % is 1 to within the grid gap: Φ⁻¹ of it says nothing
        assert r["gdp_mu_at_1pct"] == pytest.approx(mu, abs=0.01)  # GRID_GAP at 1 %, through Φ⁻¹


def test_poisson_lots_agree_with_dp_accountings_pld():
    from dp_accounting.pld import PLDAccountant

    q, sigma, T = 0.01, 4.0, 2000
    ledger = Ledger()
    ledger.record(Poisson(q, sigma), T, "sgd")
    acc = PLDAccountant(value_discretization_interval=1e-4)
    acc.compose(dpa.PoissonSampledDpEvent(q, dpa.GaussianDpEvent(sigma)), T)
    deltas = np.asarray(risk.DELTAS)
    theirs = np.asarray([acc.get_epsilon(d) for d in deltas])
    ours, _ = risk.curve(ledger)
    for a in risk.FPRS:
        want = risk.tpr_bound(theirs, deltas, a)
        # two PLD discretisations of the same loss agree to 0.5 % in ε (tests/accountant/test_pld);
        # through e^ε α that is 0.5 % of ε·TPR, far below 1e-3 at these ε
        assert risk.tpr_bound(ours, deltas, a) == pytest.approx(want, abs=GRID_GAP)


def test_more_noise_less_risk_and_nothing_released_is_a_coin():
    rs = []
    for sigma in (1.0, 2.0, 8.0):
        ledger = Ledger()
        ledger.record(Poisson(0.01, sigma), 1000, "sgd")
        rs.append(risk.risk(ledger)["tpr_at_fpr"]["0.01"])
    assert rs[0] > rs[1] > rs[2] >= 0.01
    empty = risk.risk(Ledger())
    assert empty["tpr_at_fpr"] == {"0.001": 0.001, "0.01": 0.01, "0.1": 0.1}
    assert "TPR ≤ 0.1 % at FPR 0.1 %" in risk.summary(empty)


def test_replace_one_ledgers_are_refused_in_one_line():
    from dpsgd.accountant.events import FixedSize

    ledger = Ledger()
    ledger.record(FixedSize(0.01, 2.0), 100, "sgd")
    with pytest.raises(ValueError, match=r"^risk: a membership attack is the add/remove question"):
        risk.risk(ledger)


def test_random_allocation_risk_from_its_pld():
    from dpsgd.accountant.events import Allocation

    ledger = Ledger()
    ledger.record(Allocation(1.5, 1000), 5, "sgd")
    deltas = [1e-5, 1e-3]
    # one composition for every δ gives each δ's own composition's ε
    assert ledger.epsilons(deltas, "pld") == [ledger.epsilon(d, "pld")[0] for d in deltas]  # exact
    r = risk.risk(ledger)
    for a in risk.FPRS:
        # the envelope is below every single supporting line, and no attack does worse than chance
        single = min(risk.tpr_bound(np.array([ledger.epsilon(d, "pld")[0]]), np.array([d]), a)
                     for d in deltas)  # fmt: skip
        assert a <= r["tpr_at_fpr"][str(a)] <= single
    with pytest.raises(ValueError, match="use pld"):
        risk.risk(ledger, "rdp")
