"""Fixed-size lots (sampling without replacement, replace-one) by their PLD
(dpsgd/accountant/privacy_loss/wor_pld.py).

References: a brute-force PLD of the exact mechanism on tiny datasets (every subset of the lot
enumerated, the output binned, losses rounded down: a lower bound on the true ε, since binning is
post-processing and δ(ε) = E_P[(1 − e^{ε − ΣL})_+] grows with every loss); dp_accounting 0.6.0's RDP
accountant for ``SampledWithoutReplacementDpEvent`` (replace-one) as a ceiling; and the one-lot
identity of the module doc (one lot: ε(δ) of the symmetric pair is the larger of the remove and add
directions of the Poisson pair at rate γ and noise σ/2).
"""

import itertools
import math

import numpy as np
import pytest
from scipy import signal, special

from dpsgd.accountant import Ledger, pld
from dpsgd.accountant.events import FixedSize, Gaussian
from dpsgd.accountant.privacy_loss import truncated, wor_pld
from dpsgd.accountant.renyi import wor
from tolerances import PLD_GRID_STEPS

dpa = pytest.importorskip("dp_accounting")
from dp_accounting import rdp as drdp  # noqa: E402

H = pld.DEFAULT_INTERVAL


def _exact_pair(D, Dp, L, sigma, dy):
    """(P-masses, losses) of the exact mechanism Σ_{j∈S} x_j + N(0, σ²), S a uniform L-subset, on
    bins of width dy (bins where either law underflows are dropped: a lower bound)."""
    subsets = list(itertools.combinations(range(len(D)), L))
    edges = np.arange(-L - 14 * sigma, L + 14 * sigma + dy, dy)

    def masses(X):
        return np.diff(
            sum(special.ndtr((edges - sum(X[j] for j in S)) / sigma) for S in subsets)
            / len(subsets)
        )

    p, q = masses(D), masses(Dp)
    keep = (p > 0) & (q > 0)
    return p[keep], np.log(p[keep]) - np.log(q[keep])


def _lower_epsilon(steps, delta, g):
    """ε(δ) of the composition of ``steps`` [(P-masses, losses)], losses rounded down to multiples
    of g: never above the exact composition's ε."""
    pmf, off = np.array([1.0]), 0
    for p, loss in steps:
        idx = np.floor(loss / g).astype(int)
        pmf = np.maximum(signal.fftconvolve(pmf, np.bincount(idx - idx.min(), weights=p)), 0.0)
        off += int(idx.min())
    loss = (off + np.arange(pmf.size)) * g

    def d(e):
        m = loss > e
        return float(np.sum(pmf[m] * -np.expm1(e - loss[m])))

    lo, hi = 0.0, float(loss.max())
    if d(0.0) <= delta:
        return 0.0
    for _ in range(60):
        mid = 0.5 * (lo + hi)
        lo, hi = (lo, mid) if d(mid) <= delta else (mid, hi)
    return lo


# N = 4, L = 2 (γ = 1/2), σ = 2: "remove-like" (the differing example against three equal others),
# its reverse, the ±1 pair, an arbitrary dataset, and a run that is remove-like first and add-like
# later
R_PAIR = ([1, -1, -1, -1], [-1, -1, -1, -1])
PAIRS = {
    "remove": R_PAIR,
    "add": R_PAIR[::-1],
    "pm1": ([1, 0, 0, 0], [-1, 0, 0, 0]),
    "other": ([0.3, -0.7, 0.9, 0.1], [-0.5, -0.7, 0.9, 0.1]),
}


@pytest.mark.parametrize("T", [1, 3])
def test_never_below_the_brute_force_pld_of_the_exact_mechanism(T):
    N, L, sigma, delta = 4, 2, 2.0, 1e-3
    ex = {k: _exact_pair(*v, L, sigma, dy=0.004) for k, v in PAIRS.items()}
    ours = truncated.fixed_size_epsilon(L / N, sigma, T, delta)
    runs = [[ex[k]] * T for k in PAIRS] + [[ex["remove"]] * (T // 2) + [ex["add"]] * (T - T // 2)]
    for steps in runs:
        # ours is an upper bound, the brute force a lower bound on the same ε: no tolerance
        assert ours >= _lower_epsilon(steps, delta, g=1e-3)


@pytest.mark.slow
def test_never_below_the_brute_force_pld_over_many_lots():
    N, L, sigma, delta, T = 4, 2, 2.0, 1e-3, 20
    ex = {k: _exact_pair(*v, L, sigma, dy=0.004) for k, v in PAIRS.items()}
    ours = truncated.fixed_size_epsilon(L / N, sigma, T, delta)
    for steps in [[ex[k]] * T for k in PAIRS] + [[ex["remove"]] * 10 + [ex["add"]] * 10]:
        assert ours >= _lower_epsilon(steps, delta, g=2e-3)


@pytest.mark.parametrize(
    "gamma,sigma", [(0.5, 2.0), (0.01, 4.0), pytest.param(0.01, 1.1, marks=pytest.mark.slow)]
)
def test_one_lot_is_the_larger_direction_of_the_poisson_pair_at_half_sigma(gamma, sigma):
    # one lot: δ(ε) = max(δ_remove, δ_add) for ε >= 0 (module doc); both sides are connect-the-dots
    # upper bounds on the same grid h, each within 2 grid steps of the exact ε
    ours = truncated.fixed_size_epsilon(gamma, sigma, 1, 1e-5)
    assert ours == pytest.approx(pld.epsilon(gamma, sigma / 2, 1, 1e-5), abs=2 * PLD_GRID_STEPS * H)


def test_pmf_is_a_probability_and_its_q_mass_at_most_one():
    i_lo, probs, p_inf = wor_pld.lot_pmf(0.01, 4.0, H)
    loss = (i_lo + np.arange(probs.size)) * H
    assert probs.min() >= 0 and p_inf >= 0
    assert probs.sum() + p_inf == pytest.approx(
        1.0, abs=probs.size * 1e-15
    )  # n·eps of the sum (P-mass 1)
    assert (
        float(np.sum(probs * np.exp(-loss))) <= 1.0 + probs.size * 1e-15
    )  # Q-mass: the rest at −∞


@pytest.mark.parametrize(
    "N,L,sigma,T",
    [
        (60000, 600, 4.0, 10751),
        pytest.param(60000, 600, 1.1, 1000, marks=pytest.mark.slow),
        pytest.param(1000, 100, 2.0, 300, marks=pytest.mark.slow),
    ],
)
def test_below_dp_accounting_rdp_and_above_each_direction_alone(N, L, sigma, T):
    delta = 1e-5
    ours = truncated.fixed_size_epsilon(L / N, sigma, T, delta)
    acc = drdp.RdpAccountant(neighboring_relation=dpa.NeighboringRelation.REPLACE_ONE)
    acc.compose(dpa.SampledWithoutReplacementDpEvent(N, L, dpa.GaussianDpEvent(sigma / 2)), T)
    assert ours <= acc.get_epsilon(delta)  # the ceiling: RDP of the same mechanism
    assert ours <= wor.epsilon(L / N, sigma, T, delta)[0]  # and our own RDP bound
    # the symmetric pair dominates each direction, so its composition is never below theirs
    assert ours >= pld.epsilon(L / N, sigma / 2, T, delta) - PLD_GRID_STEPS * pld.grid_step(
        [(L / N, sigma / 2, T)], delta
    )


def test_ledger_serves_wor_by_pld_and_rdp():
    led = Ledger()
    led.record(FixedSize(0.01, 4.0), 1000, "sgd")
    led.record(
        Gaussian(2.0, 1.0, 1, "replace_one"), 1, "pca"
    )  # DP-PCA converted: a Gaussian at σ/2
    e_pld = led.epsilon(1e-5, "pld")[0]
    e_rdp = led.epsilon(1e-5, "rdp")[0]
    alone = truncated.fixed_size_epsilon(0.01, 4.0, 1000, 1e-5)
    assert alone <= e_pld < e_rdp
    with pytest.raises(ValueError, match="does not serve wor"):
        led.epsilon(1e-5, "moments")
