"""The family test of the claim (dpsgd/audit/family.py), `python -m dpsgd.audit bound` (bound.py)
and the idealised game (simulate.py), against independent references: the Gaussian trade-off curve
in closed form (Dong, Roth & Su 2022), the one-step subsampled Gaussian's trade-off curve in closed
form, the μ-GDP one-run bound (onerun.gdp_lower_bound, closed-form f̄), and binomial limits on
simulated games."""

import json
import math
from pathlib import Path

import numpy as np
import pytest
from scipy import special, stats

from dpsgd.audit.onerun import bound_file as bound
from dpsgd.audit.onerun.stats import bounds as onerun, family, simulate
from tolerances import EPS64

FIXTURE = (
    Path(__file__).resolve().parents[1] / "fixtures" / "audit_bound_gauss.csv"
)  # score 2·S + N(0, 1): 2-GDP


def _gauss_fbar(x, mu):
    """f̄(x) = f(1 − x) of μ-GDP: Φ(Φ⁻¹(x) − μ) (Dong, Roth & Su 2022, §2)."""
    return special.ndtr(special.ndtri(x) - mu)


# Envelope of (ε, δ(ε)) lines EPS_STEP apart: the curve is missed by at most the second-order term
# of a tangent moved by EPS_STEP/2, sup|∂²_ε line|·(EPS_STEP/2)²/2 with |∂²_ε line| <= 4 on [0, 1]
# (line = e^{−ε}(x − δ(ε)); δ, δ′, δ″ <= 1 in absolute value times e^{ε}); plus the PLD's δ error on
# its grid h = PLD_INTERVAL, at most h·|δ′| <= h. An error bound, not a fit.
ENVELOPE_GAP = 4 * (family.EPS_STEP / 2) ** 2 / 2 + family.PLD_INTERVAL
# The same, relative to f̄ where f̄ >= 1e-6: the tangent's second-order term relative to the line,
# (EPS_STEP/2)²/2 · |∂²_ε log line|, with |∂²_ε log line| <= 20 for μ <= 2; and the PLD grid's error
# in δ, h·|δ′|, where at the line's best ε (∂_ε line = 0 ⇒ |δ′| = x − δ) is h relative to the line.
REL_GAP = (family.EPS_STEP / 2) ** 2 / 2 * 20 + family.PLD_INTERVAL
# The table's x step: a floor step X_STEP in log x moves Φ⁻¹(x) by X_STEP·x/φ(Φ⁻¹(x)) <= 1.25·X_STEP
# (x <= 1/2, Mills ratio); a relative error ρ in f̄ = Φ(a − μ) moves μ by ρ·Φ/φ <= 1.25·ρ there.
MILLS = 1.25


@pytest.mark.parametrize("sigma", [0.5, 1.0, 2.0])
def test_curve_lies_below_the_gaussian_trade_off_and_near_it(sigma):
    tr = family.TradeOff(1.0, sigma, 1)  # q = 1, one lot: the Gaussian mechanism, μ = 1/σ
    exact = _gauss_fbar(tr.x, 1.0 / sigma)
    # below: each (ε, δ(ε)) line is a valid guarantee (δ an upper bound); slack = round-off of δ's
    # sums
    assert np.all(tr.fbar_table <= exact + 1e3 * EPS64)
    assert np.max(exact - tr.fbar_table) <= ENVELOPE_GAP
    seen = exact >= 1e-6
    assert np.max((exact - tr.fbar_table)[seen] / exact[seen]) <= REL_GAP


def test_curve_lies_below_the_subsampled_gaussian_trade_off():
    """One lot at q: f_q(α) = (1 − q)(1 − α) + q·G_μ(α) (remove) and its inverse (add); the
    symmetric curve C_q(f) = min(f_q, f_q⁻¹)** is below min(f_q, f_q⁻¹) (Dong, Roth & Su 2022, §4),
    and so must be the table."""
    q, sigma = 0.2, 0.8
    mu = 1.0 / sigma
    tr = family.TradeOff(q, sigma, 1)
    t = np.linspace(-12, 14, 200001)  # NP thresholds on z
    alpha = special.ndtr(-t)  # P[z > t] under N(0, 1)
    beta = (1 - q) * special.ndtr(t) + q * special.ndtr(t - mu)
    a = 1.0 - tr.x  # table at α = 1 − x
    f_rm = np.interp(a, alpha[::-1], beta[::-1])  # f_q(α); chords of a convex curve lie above it
    f_add = np.interp(a, beta, alpha)  # f_q⁻¹(α)
    keep = (a > alpha.min()) & (a < alpha.max())
    assert np.all(tr.fbar_table[keep] <= np.minimum(f_rm, f_add)[keep] + 1e3 * EPS64)


def test_curve_rises_with_sigma():
    """More noise is post-processing: f_{σ′} rises with σ′, which the σ′ search relies on."""
    lo, hi = family.TradeOff(0.1, 1.0, 50), family.TradeOff(0.1, 1.25, 50)
    assert np.all(lo.fbar_table <= hi.fbar_table + 1e3 * EPS64)


def test_family_bound_is_the_gdp_bound_at_q1():
    """q = 1, T = 1: the family is μ-GDP, μ = 1/σ′, so σ_ub must be 1/μ_lb of the GDP bound."""
    scores, bits = bound.read_scores(str(FIXTURE), None)
    mu_lb = onerun.audit_bound(scores, bits, 1e-5, 0.05, gdp=True)["gdp_mu_lower_bound"]
    r = family.family_test(scores, bits, family.Claim(1.0, 0.5, 1, 1, 1e-5).validate(), 0.05)
    assert (
        r["verdict"] == "consistent" and not r["claim_rejected"]
    )  # the scores are exactly 2-GDP = σ 0.5
    # one-sided: the table is below the curve, so it rejects less (σ_ub >= 1/μ_lb up to the
    # bisection); above by at most the table's errors in μ (MILLS·(X_STEP + REL_GAP), relative to
    # μ ~ 1) and the bisection
    want = 1.0 / mu_lb
    slack = MILLS * (family.X_STEP + REL_GAP)
    assert (
        want * (1 - family.SIGMA_RTOL)
        <= r["sigma_upper_bound"]
        <= want * (1 + family.SIGMA_RTOL + slack)
    )


def test_cli_bound_on_the_fixture(capsys):
    """The fixture's scores are 2-GDP; a claim of σ = 1.5 (μ = 2/3) must be a violation, and every
    family-free method equals onerun's own computation on the same file."""
    rc = bound.main(
        [
            "--scores",
            str(FIXTURE),
            "--q",
            "1",
            "--sigma",
            "1.5",
            "--steps",
            "1",
            "--delta",
            "1e-5",
            "--json",
        ]
    )
    assert rc == 0
    out = json.loads(capsys.readouterr().out)
    assert out["verdict"] == "violation" and out["family"]["claim_rejected"]
    assert out["m"] == 1000 and set(out) >= {"family", "steinke", "gdp", "eps_claimed"}
    free = onerun.audit_bound(*bound.read_scores(str(FIXTURE), None), 1e-5, 0.05, gdp=True)
    assert out["steinke"]["eps_lb"] == free["eps_lower_bound"]  # exact: the same computation
    assert out["gdp"]["eps_lb"] == free["gdp_eps_lower_bound"]  # exact: the same computation
    # docs/AUDIT_MATH.md §2 prints these for the same draw: 4.281 and 2.927 (half a unit of the last
    # digit)
    assert out["gdp"]["eps_lb"] == pytest.approx(4.281, abs=5e-4)
    assert out["steinke"]["eps_lb"] == pytest.approx(2.927, abs=5e-4)
    # the family's ε_lb is the Gaussian ε at σ_ub, below the GDP bound's (its curve is lower)
    assert 0 < out["family"]["eps_lb"] <= out["gdp"]["eps_lb"]
    assert out["eps_claimed"] < out["family"]["eps_lb"]


def test_cli_table_names_every_method(capsys):
    rc = bound.main(
        [
            "--scores",
            str(FIXTURE),
            "--N",
            "1000",
            "--L",
            "1000",
            "--sigma",
            "0.5",
            "--steps",
            "1",
            "--delta",
            "1e-5",
        ]
    )
    text = capsys.readouterr().out
    assert rc == 0
    for word in ("family", "steinke", "gdp", "assumes", "CONSISTENT"):
        assert word in text


@pytest.mark.parametrize(
    "args,names",
    [
        (["--sigma", "abc"], "--sigma"),
        (["--sigma", "0"], "--sigma"),
        (["--steps", "1.5"], "--steps"),
        (["--steps", "0"], "--steps"),
        (["--groups", "0"], "--groups"),
        (["--delta", "1"], "--delta"),
        (["--beta", "0.9"], "--beta"),
        (["--q", "2"], "--q"),
        (["--q", "0.5", "--N", "100", "--L", "10"], "--q"),
        (["--N", "100"], "--L"),
        (["--sampler", "shuffle"], "--sampler"),
        (["--scores", "/nonexistent/x.csv"], "--scores"),
        (["--game", "white-box"], "--game"),
    ],
)
def test_bad_input_is_one_line_naming_the_option(args, names, capsys):
    base = {"--scores": str(FIXTURE), "--q": "1", "--sigma": "1", "--steps": "1", "--delta": "1e-5"}
    for k, v in zip(args[::2], args[1::2]):
        base[k] = v
    if "--N" in base:
        base.pop("--q") if "--q" not in args else None
    argv = [x for kv in base.items() for x in kv]
    assert bound.main(argv) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and err.startswith("error: ") and names in err


def test_bad_score_files(tmp_path, capsys):
    for name, text, what in [
        ("nocol.csv", "included,value\n1,0.5\n", "'score'"),
        ("bits.csv", "included,score\n2,0.5\n", "included='2'"),
        ("nan.csv", "included,score\n1,nan\n", "NaN"),
        ("text.csv", "included,score\n1,abc\n", "not a number"),
        # a header-only file, every canary in, a one-row file
        ("header.csv", "included,score\n", "no rows (a header only)"),
        ("allin.csv", "included,score\n" + "1,0.5\n" * 300, "all 300 canaries have included=1"),
        ("one.csv", "included,score\n0,0.5\n", "all 1 canaries have included=0"),
    ]:
        f = tmp_path / name
        f.write_text(text)
        assert (
            bound.main(
                ["--scores", str(f), "--q", "1", "--sigma", "1", "--steps", "1", "--delta", "1e-5"]
            )
            == 2
        )
        err = capsys.readouterr().err.strip()
        assert len(err.splitlines()) == 1 and "--scores" in err and what in err


# The idealised game (simulate.py) at q = 1, σ = 2, one lot, m = 2000 canaries: claimed
# ε(1e-5) = 1.99.
SMALL = family.Claim(1.0, 2.0, 1, 1, 1e-5)
BETA = 0.05


def test_false_violations_of_the_claimed_mechanism_are_rare():
    """The test's false-violation rate is <= β; 200 games may exceed β·200 = 10 by chance, but
    P[Bin(200, β) > cap] < 1e-6 (the false-alarm rate of this check)."""
    claim = SMALL.validate()
    rng = np.random.default_rng(7)
    games = 200
    rejected = sum(simulate.play(rng, 2000, claim, BETA)["family"] for _ in range(games))
    assert rejected <= stats.binom.isf(1e-6, games, BETA)


def test_noise_halved_is_caught_in_most_games():
    """Noise σC/2 (μ doubled): a test with no power rejects in a fraction <= β of the games, and
    P[Bin(50, β) >= 20] < 1e-10, so >= 20 of 50 shows the power. (Measured:
    results/audit_idealised.csv.)"""
    claim = SMALL.validate()
    rng = np.random.default_rng(8)
    rejected = sum(
        simulate.play(rng, 2000, claim, BETA, noise_factor=0.5)["family"] for _ in range(50)
    )
    assert stats.binom.sf(19, 50, BETA) < 1e-10
    assert rejected >= 20


def test_simulated_scores_are_the_claimed_llr():
    """q = 1: the score is Σ_t (μ′z′ − μ′²/2) exactly (log(0 + e^x) = x), z′ = z/ŝ and μ′ = μ/ŝ."""
    claim = family.Claim(1.0, 1.0, 3, 1, 1e-5).validate()
    scores, bits = simulate.game_scores(np.random.default_rng(3), 400, claim)
    assert scores.shape == (400,) and set(np.unique(bits)) <= {0, 1}
    # included canaries' scores are higher on average by about T·μ² = 3 (μ = 1)
    gap = scores[bits == 1].mean() - scores[bits == 0].mean()
    sd = math.sqrt(2 * 3 * 1.0 / 200)  # sd of the difference of two means of ~200 draws, var Tμ²
    assert abs(gap - 3.0) <= 5 * sd + 0.2  # 5 sd, plus the MAD noise estimate's effect (<= 7 %)


def test_audit_scores_csv_rows_of_one_game(tmp_path):
    """audit run's audit_scores.csv (columns game, canary, included, score): --game picks the
    rows."""
    f = tmp_path / "audit_scores.csv"
    f.write_text(
        "game,canary,included,score\nwhite-box,0,1,2.5\nwhite-box,1,0,-1.0\nblack-box,0,0,7.0\n"
        "black-box,1,1,3.0\n"
    )
    scores, bits = bound.read_scores(str(f), None)  # default: white-box
    assert scores.tolist() == [2.5, -1.0] and bits.tolist() == [
        1,
        0,
    ]  # exact: values copied from the file
    scores, bits = bound.read_scores(str(f), "black-box")
    assert scores.tolist() == [7.0, 3.0] and bits.tolist() == [
        0,
        1,
    ]  # exact: values copied from the file


def test_score_moments_under_the_claim():
    """q = 1: ℓ(z) = μz − μ²/2 exactly, so the sum over T lots has mean ∓Tμ²/2 and variance Tμ²."""
    m = simulate.llr_moments(family.Claim(1.0, 2.0, 3, 1, 1e-5).validate())  # μ = 1/2, T = 3
    # quadrature to epsrel 1e-10 over ±40 sd (tails below 1e-300), central moments: 100 times its
    # rtol
    assert m["out"] == pytest.approx((-0.375, 0.75), rel=1e-8)
    assert m["in"] == pytest.approx((0.375, 0.75), rel=1e-8)
    # subsampled: the in-canary mean exceeds the out-canary mean by T·KL-like terms, both
    # variances > 0
    m = simulate.llr_moments(family.Claim(0.05, 2.0, 200, 2, 1e-5).validate())
    assert m["in"][0] > 0 > m["out"][0] and m["out"][1] > 0 and m["in"][1] > 0
    # E_out[e^ℓ] = 1 per lot (a likelihood ratio), so by Jensen E_out[ℓ] < 0 and
    # E_in[ℓ] = KL(in‖out) > 0


def test_a_small_score_file_is_bounded_with_a_warning(tmp_path, capsys):
    """Ten canaries, both kinds: the bounds are computed, and stderr says that CONSISTENT means
    little."""
    f = tmp_path / "ten.csv"
    f.write_text("included,score\n" + "".join(f"{i % 2},{0.1 * i}\n" for i in range(10)))
    assert (
        bound.main(
            ["--scores", str(f), "--q", "1", "--sigma", "1", "--steps", "1", "--delta", "1e-5"]
        )
        == 0
    )
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and err.startswith("warning: only m=10 canaries")


def test_the_console_leads_with_the_verdict_then_one_line_per_test():
    from dpsgd.audit.onerun.report import console_lines

    game = {"game": "white-box: x", "eps_lower_bound": 0.1, "correct": 3, "guesses": 4}
    report = {"variant": "correct", "eps_claimed": 1.0, "delta": 1e-5, "games": [game],
              "verdict": "consistent", "eps_last_iterate_heuristic": 0.8,
              "noise_test": {"noise_ratio": 0.5, "noise_ratio_upper": 0.9, "exact": True,
                             "verdict": "violation"}}  # fmt: skip
    lines = console_lines(report, "a/audit.json")
    assert lines[0] == (
        "audit [correct]: VIOLATION of the claim ε = 1.000 at δ = 1e-05 (1 of 2 tests reject it)"
    )
    assert lines[1].startswith("  CONSISTENT: family-free lower bound")
    assert lines[2].startswith("  VIOLATION: noise along the canaries") and len(lines) == 5
