"""The privacy CLI: python -m dpsgd.privacy (table, --json, --target-epsilon, bad arguments)."""

import json
import subprocess
import sys

import pytest

from dpsgd import privacy


def _run(capsys, *argv):
    rc = privacy.main(list(argv))
    return rc, capsys.readouterr()


def test_table_has_every_accountant(capsys):
    argv = ["--q", "0.01", "--sigma", "4", "--epochs", "100", "--delta", "1e-5"]
    rc, out = _run(capsys, *argv)
    assert rc == 0 and "strong composition" not in out.out  # Figure 2's comparator: --all
    # the first line answers the question, by the tightest valid accountant
    assert out.out.splitlines()[0] == (
        "ε = 0.947 at δ = 1e-05 (PLD, Poisson q = 0.01, 10000 lots, add/remove)"
    )
    rc, out = _run(capsys, *argv, "--all", "--risk")
    assert "risk (PLD, f-DP): a membership attacker's TPR ≤ 0.23 % at FPR 0.1 %" in out.out
    for word in (
        "moments",
        "rdp",
        "pld",
        "strong composition (paper)",
        "NOT a valid bound",
        "lambda=19",
    ):
        assert word in out.out
    assert "1.2586" in out.out and "9.353" in out.out


def test_json_keys_and_values(capsys):
    rc, out = _run(capsys, "--q", "0.01", "--sigma", "4", "--steps", "10000", "--json")
    d = json.loads(out.out)
    assert set(d) == {"moments", "rdp", "pld", "strong_composition"}
    assert all("epsilon" in v for v in d.values())
    # printed to 4 decimals; the order is an integer
    assert (
        d["moments"]["epsilon"] == pytest.approx(1.2586, abs=1e-4) and d["moments"]["order"] == 19
    )
    assert d["pld"]["epsilon"] <= d["rdp"]["epsilon"] <= d["moments"]["epsilon"]
    assert d["strong_composition"]["valid_bound"] is False


def test_target_epsilon_json(capsys):
    rc, out = _run(capsys, "--q", "0.01", "--target-epsilon", "2", "--epochs", "20", "--json")
    d = json.loads(out.out)
    assert set(d) == {"moments", "rdp", "pld", "strong_composition"}
    for v in d.values():
        assert v["sigma"] > 0 and 1.98 <= v["epsilon"] <= 2.0
    assert d["pld"]["sigma"] <= d["rdp"]["sigma"] <= d["moments"]["sigma"]


@pytest.mark.parametrize(
    "argv,name",
    [
        (["--q", "1.5", "--sigma", "4", "--steps", "10"], "q"),
        (["--q", "0.01", "--sigma", "0", "--steps", "10"], "sigma"),
        (["--q", "0.01", "--sigma", "4", "--steps", "10", "--delta", "1"], "delta"),
        (["--q", "0.01", "--sigma", "4", "--steps", "-3"], "steps"),
        (["--q", "0.01", "--target-epsilon", "-1", "--steps", "10"], "target_epsilon"),
        (["--q", "0.01", "--sigma", "4"], "--steps"),
        (["--q", "abc", "--sigma", "4", "--steps", "10"], "--q"),
        (["--q", "0.01", "--steps", "10"], "sigma"),
    ],
)
def test_bad_arguments_one_line_exit_2(capsys, argv, name):
    with pytest.raises(SystemExit) as exc:
        privacy.main(argv)
    assert exc.value.code == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and name in err


def test_module_entry_point():
    r = subprocess.run(
        [sys.executable, "-m", "dpsgd.privacy", "--q", "2", "--sigma", "1", "--steps", "1"],
        capture_output=True,
        text=True,
    )
    assert r.returncode == 2 and r.stderr.count("\n") == 1 and "q" in r.stderr


def _strict(text):
    def no_constant(name):
        raise ValueError(f"non-strict JSON token {name}")

    return json.loads(text, parse_constant=no_constant)


def test_tiny_sigma_prints_the_real_pld_epsilon(capsys):
    # e^ε overflows at this loss; the exact Gaussian ε is 620.62 and must be printed, not 0.0000
    rc, out = _run(capsys, "--q", "1", "--sigma", "0.032", "--steps", "1", "--json")
    d = _strict(out.out)
    # printed to 2 decimals
    assert rc == 0 and d["pld"]["epsilon"] == pytest.approx(620.62, abs=0.01)


def test_each_accountant_answers_or_refuses_alone(capsys):
    # the moments floor log(1/δ)/32 = 0.576 > 0.491 refuses that accountant only, not the whole
    # table
    argv = ["--q", "0.00187", "--steps", "23915", "--delta", "1e-8", "--target-epsilon", "0.491"]
    rc, out = _run(capsys, *argv, "--json")
    d = _strict(out.out)
    assert rc == 0
    assert d["moments"]["epsilon"] is None and "floor" in d["moments"]["refused"]
    assert d["moments"]["refused"].startswith("moments")
    # σ printed to 2 decimals; calibration stops within rtol 0.005 of the target ε
    assert d["rdp"]["sigma"] == pytest.approx(3.18, abs=0.01) and d["pld"][
        "sigma"
    ] == pytest.approx(3.02, abs=0.01)
    rc, out = _run(capsys, *argv)
    line = next(l for l in out.out.splitlines() if l.startswith("moments"))
    assert rc == 0 and "refused" in line and "floor log(1/delta)/32 = 0.5756" in line


def test_json_is_strict_where_a_bound_is_infinite(capsys):
    # strong composition (valid) has no finite bound here; PLD refuses the too-wide grid
    rc, out = _run(capsys, "--q", "0.01", "--sigma", "0.01", "--steps", "1000000000", "--json")
    assert "Infinity" not in out.out and "NaN" not in out.out
    d = _strict(out.out)
    assert rc == 0 and d["rdp"]["epsilon"] > 0
    valid = d["strong_composition"]["valid_variant"]
    assert valid["epsilon"] is None and "no finite bound" in valid["refused"]
    assert d["pld"]["epsilon"] is None and d["pld"]["refused"].startswith("pld")


def test_groups_charged_below_sigma_min_is_refused_per_accountant(capsys):
    rc, out = _run(
        capsys, "--q", "0.5", "--sigma", "1", "--steps", "10", "--groups", "100000", "--json"
    )
    d = _strict(out.out)
    assert rc == 0 and d["moments"]["epsilon"] > 0 and d["rdp"]["epsilon"] > 0
    assert d["pld"]["epsilon"] is None and "sigma/sqrt(groups)" in d["pld"]["refused"]


def test_exit_1_when_no_accountant_answers(capsys, monkeypatch):
    def refuse(*a, **k):
        raise ValueError("refused for the test")

    monkeypatch.setattr(privacy.Ledger, "epsilon", refuse)
    monkeypatch.setattr(privacy.calibrate, "epsilon", refuse)
    rc, out = _run(capsys, "--q", "0.01", "--sigma", "4", "--steps", "10", "--json")
    d = _strict(out.out)
    assert rc == 1 and all(v["epsilon"] is None for v in d.values())


@pytest.mark.parametrize(
    "argv,name",
    [
        (["--q", "0.01", "--sigma", "1e-300", "--steps", "10"], "sigma"),
        (["--q", "0.01", "--sigma", "1e308", "--steps", "10"], "sigma"),
        (["--q", "0.01", "--sigma", "1", "--epochs", "1e300"], "epochs"),
        (["--q", "0.01", "--sigma", "1", "--epochs", "nan"], "epochs"),
        (["--q", "0.01", "--sigma", "1", "--steps", "99999999999"], "steps"),
        (["--q", "1e-300", "--sigma", "1", "--steps", "10"], "q"),
        (["--q", "0.01", "--sigma", "1", "--steps", "10", "--delta", "1e-320"], "delta"),
        (["--q", "0.01", "--sigma", "1", "--steps", "10", "--groups", "100000000"], "groups"),
        (["--q", "0.01", "--target-epsilon", "1e9", "--epochs", "10"], "target_epsilon"),
        (["--q", "0.01", "--sigma", "1", "--target-epsilon", "1", "--steps", "10"], "sigma"),
    ],
)
def test_outside_the_serviceable_ranges_one_line_exit_2(capsys, argv, name):
    with pytest.raises(SystemExit) as exc:
        privacy.main(argv)
    assert exc.value.code == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and name in err
    if "--target-epsilon" in argv and "--sigma" in argv:
        assert "target_epsilon" in err


def test_last_iterate_heuristic_beside_the_accountants(capsys):
    from dpsgd.accountant.last_iterate import last_iterate_epsilon

    argv = ["--q", "0.01", "--sigma", "4", "--steps", "10000", "--last-iterate"]
    rc, out = _run(capsys, *argv, "--json")
    d = _strict(out.out)
    assert rc == 0 and {"moments", "rdp", "pld", "strong_composition"} <= set(d)
    h = d["epsilon_last_iterate_heuristic"]
    # exact: the same function on the same inputs (JSON round-trips a float64 exactly)
    assert h == last_iterate_epsilon(0.01, 4.0, 10000, 1e-5)
    assert h < d["pld"]["epsilon"]  # measured: 0.9309 < 0.9470
    assert (
        d["last_iterate_heuristic"]["valid_bound"] is False
        and "NOT a guarantee" in d["last_iterate_heuristic"]["note"]
    )
    rc, out = _run(capsys, *argv)
    line = next(l for l in out.out.splitlines() if l.startswith("last iterate (heuristic)"))
    assert rc == 0 and "0.9309" in line and "HEURISTIC, NOT a guarantee" in line
    # without the flag nothing changes
    rc, out = _run(capsys, "--q", "0.01", "--sigma", "4", "--steps", "10000", "--json")
    assert "epsilon_last_iterate_heuristic" not in _strict(out.out)


def test_last_iterate_refused_alone_and_needs_sigma(capsys):
    rc, out = _run(
        capsys,
        "--q",
        "0.5",
        "--sigma",
        "1",
        "--steps",
        "10",
        "--groups",
        "100000",
        "--last-iterate",
        "--json",
    )
    d = _strict(out.out)
    assert rc == 0 and d["epsilon_last_iterate_heuristic"] is None
    assert "sigma/sqrt(groups)" in d["last_iterate_heuristic"]["refused"]
    with pytest.raises(SystemExit) as exc:
        privacy.main(["--q", "0.01", "--target-epsilon", "2", "--steps", "100", "--last-iterate"])
    err = capsys.readouterr().err
    assert exc.value.code == 2 and err.count("\n") == 1 and "--last-iterate" in err


def test_sizes_and_a_target_answer_in_one_command(capsys):
    """--N/--L with --target-epsilon: q = L/N; the σ agrees with Opacus' get_noise_multiplier
    (PRV accountant) at this schedule to 0.13 % (0.8558 against 0.8569, measured once)."""
    rc, out = _run(capsys, "--N", "50000", "--L", "256", "--target-epsilon", "3", "--epochs", "30")
    assert rc == 0
    first = out.out.splitlines()[0]
    assert first.startswith("σ = 0.85") and "≤ 3 at δ = 1e-05 (PLD, Poisson q = 0.00512" in first


def test_a_search_that_stops_at_its_limit_is_refused(capsys):
    rc, out = _run(capsys, "--q", "0.01", "--target-epsilon", "0.001", "--epochs", "100", "--json")
    d = json.loads(out.out)
    assert d["rdp"]["epsilon"] is None and "stopped at its limit" in d["rdp"]["refused"]
    assert d["pld"]["sigma"] > 1e4


def test_cross_check_from_the_privacy_cli(capsys):
    pytest.importorskip("dp_accounting")
    rc, out = _run(capsys, "--q", "0.01", "--sigma", "4", "--steps", "1000", "--cross-check")
    assert rc == 0 and "dp_accounting   PLD pessimistic" in out.out
    assert out.out.splitlines()[-1].startswith("verdict: ours ε = ")


# ---------------------------------------------------------------- --risk, --cross-check, brackets
SMALL = ["--q", "0.01", "--sigma", "2", "--steps", "1000"]


def test_risk_is_answered_wherever_it_can_be_computed(capsys):
    """--risk was dropped silently with --json, with --N/--L and with --target-epsilon."""
    rc, out = _run(capsys, *SMALL, "--risk", "--json")
    r = json.loads(out.out)["risk"]
    assert rc == 0 and r["accountant"] == "pld" and 0.01 < r["tpr_at_fpr"]["0.01"] < 0.1
    rc, out = _run(capsys, *SMALL, "--risk")
    assert "at 1 %" in out.out and f"{100 * r['tpr_at_fpr']['0.01']:.2f} % at 1 %" in out.out
    # a target ε: the risk at the σ the first line serves
    rc, out = _run(capsys, "--q", "0.01", "--target-epsilon", "2", "--steps", "1000", "--risk")
    first, last = out.out.splitlines()[0], out.out.splitlines()[-1]
    sigma = first.split()[2]
    assert rc == 0 and last.startswith(f"risk at σ = {sigma} (PLD, f-DP): a membership attacker")
    rc, out = _run(capsys, "--q", "0.01", "--target-epsilon", "2", "--steps", "1000", "--risk",
                   "--json")  # fmt: skip
    d = json.loads(out.out)
    assert d["risk"]["sigma"] == min(d[a]["sigma"] for a in ("moments", "rdp", "pld"))
    # the samplers: each its own, or its one-line refusal (replace-one is not the membership
    # question)
    rc, out = _run(capsys, "--N", "10000", "--L", "100", "--sigma", "2", "--steps", "1000",
                   "--risk", "--json")  # fmt: skip
    d = json.loads(out.out)
    assert d["poisson"]["risk"] == r  # q = L/N: the same schedule
    assert "add/remove question" in d["fixed_size"]["risk"]["refused"]
    assert "tpr_at_fpr" in d["balls_in_bins"]["risk"]
    rc, out = _run(capsys, "--N", "10000", "--L", "100", "--sigma", "2", "--steps", "1000",
                   "--sampler", "shuffle", "--risk")  # fmt: skip
    assert out.out.splitlines()[-1].startswith("risk, shuffle (PLD, f-DP): refused: a membership")


def test_cross_check_takes_sizes_as_its_message_says(capsys):
    rc, out = _run(capsys, "--N", "10000", "--L", "100", "--sigma", "4", "--steps", "300",
                   "--cross-check", "--json", "--risk")  # fmt: skip
    by_sizes = json.loads(out.out)
    rc2, out = _run(capsys, "--q", "0.01", "--sigma", "4", "--steps", "300", "--cross-check",
                    "--json", "--risk")  # fmt: skip
    assert rc == rc2 == 0 and by_sizes["schedule"]["q"] == 0.01
    mine = lambda res: [r for r in res["rows"] if r["library"] == "dpsgd"]  # noqa: E731
    assert mine(by_sizes) == mine(json.loads(out.out))  # exact: the same computation
    assert "tpr_at_fpr" in by_sizes["risk"]
    with pytest.raises(SystemExit) as e:  # another sampler still says which it compares
        privacy.main(["--N", "10000", "--L", "100", "--sigma", "4", "--steps", "300",
                      "--sampler", "fixed_size", "--cross-check"])  # fmt: skip
    assert e.value.code == 2 and "not --sampler fixed_size" in capsys.readouterr().err


def test_a_verdict_is_said_only_over_the_values_shown():
    from dpsgd import crosscheck

    rows = [
        {"library": "dpsgd", "method": "rdp", "values": [(1.2, "upper")], "failure": None},
        {"library": "dp_accounting", "method": "-", "values": None, "failure": "not supported"},
    ]
    v = crosscheck.verdict(rows)
    assert v["above_every_lower"] is None and v["lower_values_shown"] == 0
    line = crosscheck.verdict_line(v)
    assert "no lower or optimistic value is shown" in line and "at or above" not in line


def test_a_pld_that_cannot_answer_is_a_one_line_refusal_never_inf(capsys):
    # fixed-size lots at σ = 1, γ = 0.001, 20 000 lots, δ = 1e-12: neither the tilted nor the
    # untilted composition resolves δ; the PLD returned +inf, and --json ended in a traceback
    rc, out = _run(capsys, "--N", "100000", "--L", "100", "--sigma", "1", "--steps", "20000",
                   "--delta", "1e-12", "--sampler", "fixed_size", "--json")  # fmt: skip
    d = json.loads(out.out)
    assert d["accountant"] == "rdp" and d["by_accountant"] == {"rdp": d["epsilon"]}
    assert d["refused"]["pld"].startswith("pld: ") and "\n" not in d["refused"]["pld"]
    # the bracket's lower end lower-bounds: at or below every valid ε shown
    assert d["epsilon_lower"] <= d["epsilon"]


def test_the_fixed_size_bracket_is_a_lower_end_and_an_upper_end(capsys):
    from dpsgd.accountant.privacy_loss import pair_lower

    rc, out = _run(capsys, "--N", "10000", "--L", "100", "--sigma", "2", "--steps", "1000",
                   "--sampler", "fixed_size", "--json")  # fmt: skip
    d = json.loads(out.out)
    assert d["epsilon_lower"] == pair_lower.epsilon_lower(0.01, 1.0, 1000, 1e-5)  # exact: the same
    assert d["epsilon_lower"] <= min(d["by_accountant"].values())
    assert "rounded down" in d["epsilon_lower_source"]
