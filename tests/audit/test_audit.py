"""Empirical privacy audit, the one-step game (dpsgd/audit/game): the lower bound must respect a
correct mechanism's ε and expose deliberately broken ones. Fixed seeds make every number here
deterministic.

Tiny setting: σ = 2, C = 1, q = 1, δ = 1e-5, one step; exact ε of this Gaussian mechanism = 1.993
(Balle & Wang 2018). Broken mechanisms shift the canary's score by 5 noise std (canary norm 10 C
unclipped; or noise σC/10), which a threshold test detects far beyond ε = 2.
"""

import json
import math
import subprocess
import sys
from contextlib import nullcontext

import numpy as np
import pytest
from scipy import stats

from dpsgd.accountant.strong_composition import gaussian_epsilon
from dpsgd.audit.game import cli
from dpsgd.audit.game import stats as game_stats
from dpsgd.audit.game.claim import claimed_epsilon
from dpsgd.audit.game.play import run_audit
from dpsgd.audit.game.settings import SETTING_MECHANISMS, AuditConfig
from tolerances import chain_rel_tol

TRIALS = 20_000


@pytest.fixture(scope="module")
def results():
    return {
        m: run_audit(AuditConfig(mechanism=m, trials=TRIALS, seed=0))
        for m in SETTING_MECHANISMS["tiny"]
    }


def test_claimed_epsilon_matches_closed_form(results):
    r = results["correct"]
    exact = r.eps_claimed["exact"]
    # printed to 4 decimals; brentq root of the Gaussian mechanism
    assert exact == pytest.approx(1.9931, abs=1e-3)
    # every accountant is an upper bound on the exact ε of one Gaussian mechanism; PLD is tight
    for acc in ("pld", "rdp", "moments"):
        assert r.eps_claimed[acc] >= exact - 1e-6, acc
    # PLD is tight: within its discretisation and tails, far below 0.05
    assert r.eps_claimed["pld"] == pytest.approx(exact, abs=0.05)


def test_correct_mechanism_lower_bound_below_claimed_epsilon(results):
    r = results["correct"]
    assert not r.violation
    assert r.eps_lb <= min(r.eps_claimed.values())
    # and the audit has power: it certifies a good part of the true ε, not a vacuous 0
    assert r.eps_lb > 0.25 * r.eps_claimed["exact"]
    assert r.n_in + r.n_out == TRIALS // 2


@pytest.mark.parametrize("mechanism", ["no_clip", "noise_div10"])
def test_broken_mechanism_exceeds_claimed_epsilon(results, mechanism):
    r = results[mechanism]
    assert r.violation
    assert r.eps_lb > max(r.eps_claimed.values()) + 1.0


def test_mnist_shape_with_per_layer_clipping():
    """The paper's MNIST net (60 → 1000 → 10, per-layer C = 4, σ = 4): two clipping groups, noise
    multiplier σ/√2 jointly; noise ÷ 10 is detected, the correct mechanism is not accused."""
    base = dict(
        setting="mnist", sigma=4.0, clip_norm=4.0, clipping="per_layer", trials=1200, seed=1
    )
    broken = run_audit(AuditConfig(mechanism="noise_div10", **base))
    assert broken.groups == 2
    assert broken.eps_claimed["exact"] == pytest.approx(gaussian_epsilon(1e-5, 4 / math.sqrt(2)))
    assert broken.violation and broken.eps_lb > max(broken.eps_claimed.values())
    correct = run_audit(AuditConfig(mechanism="correct", **base))
    assert correct.eps_lb <= min(correct.eps_claimed.values())


# --- the statistics on synthetic scores, against closed forms -------------------------------------
def test_clopper_pearson_closed_forms():
    # k = 0: upper bound solves (1 − p)^n = 1 − conf, p = −expm1(log(1 − conf)/n) (no cancellation;
    # a few float64 ops on either side)
    n, conf = 1000, 0.975
    assert game_stats.cp_upper(0, n, conf) == pytest.approx(
        -math.expm1(math.log(1 - conf) / n), rel=chain_rel_tol(8)
    )
    # k = n: the bound is 1; otherwise it lies above the observed rate
    assert game_stats.cp_upper(n, n, conf) == 1.0
    assert game_stats.cp_upper(37, n, conf) > 0.037
    # exact binomial tail at the bound equals 1 − conf
    p = float(game_stats.cp_upper(37, n, conf))
    # p is Boost's beta quantile (an iterative inversion): 1e-6 relative in the tail it inverts
    assert stats.binom.cdf(37, n, p) == pytest.approx(1 - conf, rel=1e-6)


def test_claimed_exact_epsilon_closed_form():
    """The audit's exact ε for k groups at σ is the Gaussian mechanism with μ = √k/σ: Balle & Wang
    2018, Thm 8, δ(ε) = Φ(μ/2 − ε/μ) − e^ε Φ(−μ/2 − ε/μ), checked here with scipy's normal CDF."""
    for sigma, groups in ((4.0, 1), (2.0, 1), (1.0, 1), (0.5, 1), (4.0, 2), (2.0, 4)):
        mu = math.sqrt(groups) / sigma
        eps = claimed_epsilon(AuditConfig(sigma=sigma, q=1.0, accountants=()), groups)["exact"]
        d = stats.norm.cdf(mu / 2 - eps / mu) - math.exp(eps) * stats.norm.cdf(-mu / 2 - eps / mu)
        # ε is a brentq root: its error carried through δ'(ε)
        assert d == pytest.approx(1e-5, rel=1e-6)
    one = claimed_epsilon(AuditConfig(sigma=1.0, q=1.0, accountants=()), 1)
    # printed to 4 decimals
    assert one == {"exact": pytest.approx(4.3772, abs=1e-3)}
    # q < 1 has no closed form here: only the accountants speak
    assert claimed_epsilon(AuditConfig(q=0.5, accountants=("pld",)), 1).keys() == {"pld"}


def test_perfect_separation_bound():
    rng = np.random.default_rng(0)
    scores = np.concatenate([rng.normal(0, 1, 2000), rng.normal(100, 1, 2000)])
    present = np.repeat([False, True], 2000)
    r = game_stats.clopper_pearson_bound(
        scores, present, delta=1e-5, alpha=0.05, select_fraction=0.5
    )
    assert r["false_pos"] == 0 and r["false_neg"] == 0
    fpr_hi = -math.expm1(math.log(0.025) / r["n_out"])  # Clopper–Pearson at k = 0, closed form
    fnr_hi = -math.expm1(math.log(0.025) / r["n_in"])
    # the rates' relative round-off (a few float64 ops each) is absolute error in the log
    assert r["eps_lb"] == pytest.approx(
        math.log((1 - 1e-5 - fnr_hi) / fpr_hi), abs=chain_rel_tol(16)
    )


def test_an_evaluation_part_without_one_kind_of_trial_is_named():
    """Trials split so that no evaluated trial lacks the canary: one ValueError naming
    select_fraction, not a division by zero."""
    present = np.array([False] * 3 + [True] * 17)
    scores = np.arange(20.0)
    with pytest.raises(
        ValueError, match=r"^select_fraction=0.5: the 10 evaluation trials hold no trial without "
    ):
        for seed in range(
            200
        ):  # some permutation leaves the 3 trials without it all in the selection
            game_stats.clopper_pearson_bound(
                scores, present, delta=1e-5, select_fraction=0.5, seed=seed
            )


def test_lower_bound_is_statistically_honest():
    """Coverage: over 300 independent audits of a Gaussian mechanism with μ = 1 the bound exceeds
    the true ε of the test it certifies (computed from the Gaussian CDFs at the chosen threshold)
    in at most ~α of them — the threshold is chosen on separate trials."""
    mu, delta, n, exceed = 1.0, 1e-5, 2000, 0
    exact = gaussian_epsilon(delta, 1 / mu)
    for seed in range(300):
        rng = np.random.default_rng(1000 + seed)
        present = rng.random(n) < 0.5
        scores = rng.normal(0, 1, n) + mu * present
        r = game_stats.clopper_pearson_bound(scores, present, delta, alpha=0.05, seed=seed)
        t = r["threshold"]
        if r["direction"] == "in>t":
            fpr, fnr = stats.norm.sf(t), stats.norm.cdf(t - mu)
        else:
            fpr, fnr = stats.norm.cdf(t - mu), stats.norm.sf(t)
        true_eps = float(game_stats.eps_from_rates(fpr, fnr, delta))
        exceed += r["eps_lb"] > true_eps
        assert r["eps_lb"] <= exact
    assert exceed <= 0.05 * 300


# --- CLI -----------------------------------------------------------------------------------------
def _refuse(constant):
    raise ValueError(f"not strict JSON: {constant}")


def test_cli_help_and_run(tmp_path):
    h = subprocess.run(
        [sys.executable, "-m", "dpsgd.audit", "--help"], capture_output=True, text=True
    )
    assert h.returncode == 0 and all(f"\n  {c} " in h.stdout for c in ("run", "bound", "step"))
    h = subprocess.run(
        [sys.executable, "-m", "dpsgd.audit", "step", "--help"], capture_output=True, text=True
    )
    assert h.returncode == 0 and "Clopper" in h.stdout and "--mechanism" in h.stdout
    out = tmp_path / "audit.json"
    assert cli.main(["--mechanism", "noise_div10", "--trials", "4000", "--json", str(out)]) == 0
    (row,) = json.loads(out.read_text(), parse_constant=_refuse)  # strict JSON: no NaN, no Infinity
    assert row["violation"] and row["config"]["mechanism"] == "noise_div10"
    assert all(row[k] is None for k in row["infinite"]) and row["eps_lb"] is not None
    # never overwrites an earlier result, and refuses before any work
    before = out.read_bytes()
    assert cli.main(["--mechanism", "correct", "--trials", "100", "--json", str(out)]) == 2
    assert out.read_bytes() == before


@pytest.mark.parametrize(
    "args, key",
    [
        (["--sigma", "-1"], "--sigma"),
        (["--sigma", "nan"], "--sigma"),
        (["--sigma", "inf"], "--sigma"),
        (["--sigma", "four"], "--sigma"),
        (["--q", "1.5"], "--q"),
        (["--q", "0"], "--q"),
        (["--delta", "1"], "--delta"),
        (["--delta", "nan"], "--delta"),
        (["--clip-norm", "0"], "--clip-norm"),
        (["--clip-norm", "inf"], "--clip-norm"),
        (["--clip-norm", "-4"], "--clip-norm"),
        (["--trials", "5"], "--trials"),
        (["--trials", "100.5"], "--trials"),
        (["--trials", "1e12"], "--trials"),
        (["--select-fraction", "1"], "--select-fraction"),
        (["--select-fraction", "1e-9"], "--select-fraction=1e-09: selects 0 of the 50000 trials"),
        (
            ["--select-fraction", "0.99999"],
            "--select-fraction=0.99999: selects 50000 of the 50000 trials",
        ),
        (
            ["--select-fraction", "0.95", "--trials", "20"],
            "--select-fraction=0.95: selects 19 of the 20 trials",
        ),
        (["--alpha", "0"], "--alpha"),
        (["--alpha", "inf"], "--alpha"),
        (["--canary-norm", "0.5"], "--canary-norm"),
        (["--canary-norm", "inf"], "--canary-norm"),
        (["--seed", "-1"], "--seed"),
        (["--seed", "0.5"], "--seed"),
        (["--threads", "0"], "--threads"),
        (["--accountants", "pld,foo"], "--accountants"),
        (
            ["--accountants", ",", "--q", "0.5"],
            "--accountants",
        ),  # no claimed ε: every verdict "consistent"
        (["--setting", "cifar"], "--setting"),  # argparse's refusals: one line too
        (["--mechanism", "broken"], "--mechanism"),
        (["--sigma"], "--sigma"),
        (["--json", "/nonexistent-folder/audit.json"], "--json"),
    ],
)
def test_cli_refuses_bad_input(args, key, capsys):
    """Every option is checked as training checks its config: one line naming it, status 2, no
    work."""
    with (
        pytest.raises(SystemExit)
        if key in ("--setting", "--mechanism") or args == ["--sigma"]
        else nullcontext() as e
    ):
        assert cli.main(args) == 2
    if e is not None:
        assert e.value.code == 2
    captured = capsys.readouterr()
    err = captured.err.strip()
    assert err.startswith("error: ") and key in err and "\n" not in err, err
    assert captured.out == ""  # refused before any work: not even the header line


def test_cli_json_write_failure_keeps_the_result(tmp_path, monkeypatch, capsys):
    """A --json folder that disappears during the audit: the result goes to stdout, status 1."""
    import errno

    def fail(path, obj, exclusive=False):
        raise OSError(errno.ENOENT, "No such file or directory")

    monkeypatch.setattr(cli, "write_json", fail)
    assert (
        cli.main(["--mechanism", "correct", "--trials", "200", "--json", str(tmp_path / "a.json")])
        == 1
    )
    captured = capsys.readouterr()
    assert captured.err.startswith("error: --json=") and captured.err.count("\n") == 1
    (row,) = json.loads(captured.out[captured.out.index("\n[") + 1 :], parse_constant=_refuse)
    assert row["config"]["mechanism"] == "correct" and row["config"]["trials"] == 200


@pytest.mark.parametrize("mechanism, caught", [("correct", False), ("realised_lot", True)])
def test_realised_lot_division_is_caught_by_the_one_step_game(mechanism, caught):
    """Dividing by |L_t| halves the noise when the canary joins a known other example: the
    multi-trial game sees it (a one-run audit cannot: docs/AUDIT.md); the correct mechanism stays
    consistent."""
    r = run_audit(
        AuditConfig(
            setting="mnist_other",
            mechanism=mechanism,
            sigma=4.0,
            clip_norm=4.0,
            clipping="per_layer",
            trials=1000,
            seed=2,
        )
    )
    assert r.violation == caught
    if caught:
        assert r.eps_lb > min(r.eps_claimed.values()) + 1


def test_both_audits_play_the_one_list_of_broken_variants():
    """The one-step game's mechanisms are variants of dpsgd/audit/variants.py, broken by its one
    implementation (the one-run audit's too)."""
    from dpsgd.audit import variants
    from dpsgd.audit.game import play
    from dpsgd.audit.onerun import instrument

    assert set(SETTING_MECHANISMS["mnist_other"]) <= set(variants.VARIANTS)
    assert play.break_mechanism is variants.break_mechanism is instrument.break_mechanism


def test_the_package_docstring_names_every_module():
    from pathlib import Path

    import dpsgd.audit as pkg

    root = Path(pkg.__file__).parent
    names = {
        ".".join(p.relative_to(root).with_suffix("").parts)
        for p in root.rglob("*.py")
        if p.stem not in ("__init__", "__main__")
    }
    missing = sorted(n for n in names if f"``{n}``" not in pkg.__doc__)
    assert missing == []
