"""Each sampler accounted for what it is: fixed-size lots (Wang et al. 2019 Thm 9), truncated
Poisson (Ganesh et al. 2025 PLD), balls-in-bins (one Gaussian per epoch), shuffle's [lower, upper]
bracket (Chua et al. 2024), one neighbouring relation per ledger; the data path of each sampler."""

import math

import numpy as np
import pytest
import torch
from scipy import stats

from dpsgd.accountant import Ledger, pld
from dpsgd.accountant.events import Gaussian, TruncatedPoisson
from dpsgd.accountant.privacy_loss import shuffle_lower, truncated
from dpsgd.accountant.renyi import wor
from dpsgd.mechanism.sampling import make_sampler
from tolerances import EPS64, PLD_GRID_STEPS

dpa = pytest.importorskip("dp_accounting")
from dp_accounting import pld as dpld  # noqa: E402
from dp_accounting import rdp as drdp  # noqa: E402

H = pld.DEFAULT_INTERVAL


@pytest.mark.parametrize(
    "N,L,sigma,T", [(60000, 600, 4.0, 10751), (60000, 6000, 2.0, 500), (1000, 50, 1.0, 300)]
)
def test_fixed_size_rdp_is_never_below_dp_accounting(N, L, sigma, T):
    # dp_accounting: the same theorems (9 and 27), its forward differences in float; ours never
    # below; the Gaussian's multiplier there is relative to the replacement's sensitivity 2C: σ/2
    acc = drdp.RdpAccountant(
        orders=list(wor.ORDERS), neighboring_relation=dpa.NeighboringRelation.REPLACE_ONE
    )
    acc.compose(dpa.SampledWithoutReplacementDpEvent(N, L, dpa.GaussianDpEvent(sigma / 2)), T)
    ours, _ = wor.epsilon(L / N, sigma, T, 1e-5)
    theirs = acc.get_epsilon(1e-5)
    assert ours >= theirs * (1 - 64 * EPS64)  # round-off of a sum of <= 256 log terms
    # where order 2 is optimal the two arms coincide: the same number
    if _ == 2.0:
        assert ours == pytest.approx(theirs, rel=64 * EPS64)


def test_fixed_size_one_lot_per_epoch_is_the_gaussian():
    # γ = 1: every lot is the whole dataset; RDP = 2α/σ² (sensitivity 2C, noise σC), closed form
    curve = wor.rdp_curve(1.0, 3.0)
    assert np.array_equal(curve, 2.0 * np.array(wor.ORDERS) / 9.0)  # exact: the same expression


@pytest.mark.parametrize(
    "N,L,B,sigma,T",
    [(60000, 600, 620, 4.0, 1000), (60000, 600, 660, 4.0, 10751), (10000, 100, 110, 2.0, 100)],
)
def test_truncated_pld_matches_dp_accounting(N, L, B, sigma, T):
    acc = dpld.PLDAccountant(
        dpa.NeighboringRelation.ADD_OR_REMOVE_ONE, value_discretization_interval=H
    )
    acc.compose(dpa.TruncatedSubsampledGaussianDpEvent(N, L / N, B, sigma), T)
    ours = truncated.epsilon(N, L / N, B, sigma, T, 1e-5)
    # both connect-the-dots on the grid h = 1e-4: the same construction, within the grid tolerance
    assert ours == pytest.approx(acc.get_epsilon(1e-5), abs=PLD_GRID_STEPS * H)


def test_truncation_at_or_above_N_is_poisson():
    assert truncated.truncation(60000, 0.01, 60000) == (0.0, 0.0)
    e = truncated.epsilon(60000, 0.01, 60000, 4.0, 1000, 1e-5)
    assert e == pytest.approx(pld.epsilon(0.01, 4.0, 1000, 1e-5), abs=PLD_GRID_STEPS * H)
    # and a cap only ever costs: ε grows as B falls
    assert truncated.epsilon(60000, 0.01, 620, 4.0, 1000, 1e-5) > e


def _cube_epsilon(sigma, T, delta):
    """Chua et al. 2024's single-epoch cube-set lower bound, computed directly (their Thm: the max
    over caps C of P(max y > C) − e^ε Q(max y > C)), inverted by bisection."""
    caps = np.arange(0, 60, 0.001)
    lu = stats.norm.logcdf((caps - 2) / sigma) + (T - 1) * stats.norm.logcdf(caps / sigma)
    ll = stats.norm.logcdf((caps - 1) / sigma) + (T - 1) * stats.norm.logcdf(caps / sigma)
    d = lambda e: np.max(-np.expm1(lu) + np.exp(e) * np.expm1(ll))
    lo, hi = 0.0, 50.0
    for _ in range(60):
        mid = (lo + hi) / 2
        lo, hi = (mid, hi) if d(mid) > delta else (lo, mid)
    return lo


@pytest.mark.parametrize("sigma,T", [(1.0, 100), (4.0, 100)])
def test_shuffle_lower_bound_one_epoch_agrees_with_the_cube_test(sigma, T):
    ours = shuffle_lower.epsilon_lower(sigma, T, 1, 1e-5)
    # our slices refine the cube sets (a finer post-processing of the same statistic): never below
    # the cube bound, but each slice's loss is rounded down by < h (one epoch: one step h), and the
    # cube grid above is 1e-3 in C (loss slope ≤ 1/σ² per unit C)
    cube = _cube_epsilon(sigma, T, 1e-5)
    assert ours >= cube - shuffle_lower.INTERVAL - 1e-3 / sigma**2
    assert (
        ours <= pld.epsilon(1.0, sigma / 2, 1, 1e-5) + PLD_GRID_STEPS * H
    )  # below the upper bound


def test_shuffle_bracket_orders_and_shows_poisson_is_ruled_out_at_small_sigma():
    sigma, T, E = 1.1, 100, 10
    low = shuffle_lower.epsilon_lower(sigma, T, E, 1e-5)
    up = pld.epsilon(1.0, sigma / 2, E, 1e-5)
    pois = pld.epsilon(1 / T, sigma, T * E, 1e-5)
    assert (
        pois < low <= up
    )  # the Poisson number a shuffled run would report is below the lower bound


def test_ledger_refuses_mixed_relations_and_converts_pca():
    led = Ledger()
    led.record(Gaussian(7.0), 1, "pca")
    led.record(Gaussian(2.0, 1.0, 1, "replace_one"), 3, "sgd")
    with pytest.raises(ValueError, match="different neighbouring relations"):
        led.epsilon(1e-5, "rdp")
    conv = Ledger([led.entries[0]]).converted("replace_one")
    assert conv.entries[0].sigma == 3.5 and conv.entries[0].q == 1.0  # exact: σ_p/2
    assert "sensitivity doubled" in conv.entries[0].label
    with pytest.raises(ValueError, match="does not serve"):
        Ledger([dict(q=0.01, sigma=4.0, count=10, event="wor", adjacency="replace_one")]).epsilon(
            1e-5, "moments"
        )
    with pytest.raises(ValueError, match="replace_one needs q = 1"):
        Ledger().record(Gaussian(1.0, 0.5, 1, "replace_one"), 1, "x")


def test_ledger_events_round_trip_and_budget():
    led = Ledger()
    led.record(TruncatedPoisson(0.01, 4.0, 60000, 660), 100, "sgd")
    back = Ledger.from_dict(led.to_dict())
    assert back == led
    e = led.epsilon(1e-5, "pld")[0]
    n = Ledger().steps_within(e, 1e-5, TruncatedPoisson(0.01, 4.0, 60000, 660), "pld")
    assert n >= 100  # 100 lots fit within their own ε; 2n do not
    assert Ledger().steps_within(e, 1e-5, TruncatedPoisson(0.01, 4.0, 60000, 660), "pld") < 200


# -- the data path ---------------------------------------------------------------------------------
# Inclusion frequencies: with n lots and inclusion probability p, an example's count is
# Binomial(n, p); a two-sided test at z = 5 per example, over N examples, has false-alarm rate
# ≤ N·5.7e-7 (≤ 3e-4 here, N = 500).
Z = 5.0


def _counts(s, epochs):
    c = torch.zeros(s.N, dtype=torch.float64)
    sizes = []
    for _ in range(epochs):
        for idx in s.epoch():
            c[idx] += 1
            sizes.append(len(idx))
    return c, np.array(sizes)


@pytest.mark.parametrize(
    "name,kw",
    [("fixed_size", {}), ("truncated_poisson", {"max_lot_size": 55}), ("balls_in_bins", {})],
)
def test_inclusion_frequencies_and_lot_sizes_follow_the_law(name, kw):
    N, L, E = 500, 50, 40
    s = make_sampler(name, N, L, torch.Generator().manual_seed(11), **kw)
    counts, sizes = _counts(s, E)
    n = E * s.lots_per_epoch()
    p = L / N if name != "balls_in_bins" else 1 / s.lots_per_epoch()
    if name == "truncated_poisson":
        # E|lot| = E min(Binomial(N, q), B); each example's rate is that over N (exchangeable)
        k = np.arange(N + 1)
        p = float(np.sum(np.minimum(k, 55) * stats.binom.pmf(k, N, L / N))) / N
        assert sizes.max() <= 55
        idx = next(iter(s.epoch()))
        w_idx, w = s.padded(idx)
        assert len(w_idx) == 55 and float(w.sum()) == len(
            idx
        )  # exact: fixed shape, zero-weight padding
        assert torch.equal(w_idx[: len(idx)], idx)
    if name == "fixed_size":
        assert set(sizes.tolist()) == {L}  # exact lot size
    if name == "balls_in_bins":
        assert sizes.sum() == N * E  # every example once per epoch
        assert torch.equal(counts, torch.full((N,), float(E)))  # exact: once per epoch
        t = s.lots_per_epoch()
        se = math.sqrt(N * (1 / t) * (1 - 1 / t) / len(sizes))  # |lot| ~ Binomial(N, 1/t)
        assert abs(sizes.mean() - N / t) <= Z * se
        return
    sd = math.sqrt(n * p * (1 - p))
    assert np.all(np.abs(counts.numpy() - n * p) <= Z * sd)


@pytest.mark.parametrize(
    "name,kw",
    [("fixed_size", {}), ("truncated_poisson", {"max_lot_size": 33}), ("balls_in_bins", {})],
)
def test_state_round_trip_replays_lots_bit_identically(name, kw):
    a = make_sampler(name, 300, 30, torch.Generator().manual_seed(7), **kw)
    list(a.epoch())
    state = a.state_dict()
    first = [l.clone() for l in a.epoch()]
    b = make_sampler(name, 300, 30, torch.Generator().manual_seed(999), **kw)
    b.load_state_dict(state)
    assert all(torch.equal(x, y) for x, y in zip(first, b.epoch()))


def test_privacy_cli_sampler_mode(capsys):
    import json

    from dpsgd.privacy import main

    assert (
        main(["--N", "6000", "--L", "60", "--B", "66", "--sigma", "4", "--steps", "300", "--json"])
        == 0
    )
    res = json.loads(capsys.readouterr().out)
    assert set(res) == {"poisson", "shuffle", "fixed_size", "truncated_poisson", "balls_in_bins"}
    assert res["shuffle"]["epsilon_lower"] <= res["shuffle"]["epsilon"]
    assert res["truncated_poisson"]["epsilon"] >= res["poisson"]["epsilon"] - PLD_GRID_STEPS * H
    assert (
        res["fixed_size"]["adjacency"] == "replace_one"
        and res["poisson"]["adjacency"] == "add_remove"
    )
    fs = res["fixed_size"]
    assert (
        fs["accountant"] == "pld" and fs["epsilon"] <= fs["by_accountant"]["rdp"]
    )  # the smaller valid one
    assert fs["epsilon_lower"] <= fs["epsilon"] + PLD_GRID_STEPS * H
    assert main(["--N", "6000", "--L", "60", "--sigma", "4", "--steps", "300"]) == 0
    out = capsys.readouterr().out
    assert (
        "balls_in_bins" in out and "fixed_size" in out and "target <=" not in out
    )  # no dev checks
    with pytest.raises(SystemExit) as e:
        main(
            [
                "--sampler",
                "truncated_poisson",
                "--N",
                "6000",
                "--L",
                "60",
                "--sigma",
                "4",
                "--steps",
                "3",
            ]
        )
    assert e.value.code == 2 and "--B" in capsys.readouterr().err
