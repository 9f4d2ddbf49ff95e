"""python -m dpsgd.crosscheck: every installed library on one schedule, failures named per row,
and a verdict that holds ours against every lower value."""

from __future__ import annotations

import time

import pytest

from dpsgd import crosscheck

pytest.importorskip("dp_accounting")
SCHEDULE = (0.01, 4.0, 1000, 1e-5)


def test_ours_and_dp_accounting_side_by_side():
    res = crosscheck.cross_check(*SCHEDULE)
    methods = {(r["library"], r["method"]) for r in res["rows"] if r["values"]}
    assert {("dpsgd", "pld"), ("dp_accounting", "PLD pessimistic"), ("dp_accounting", "RDP")} <= (
        methods
    )
    v = res["verdict"]
    assert v["above_every_lower"]
    # two PLD discretisations of the same loss agree to 0.5 % (tests/accountant/test_pld.py)
    assert v["ours_over_tightest_upper"] == pytest.approx(1.0, abs=5e-3)
    rdp = {r["library"]: r["values"][0][0] for r in res["rows"] if r["method"].lower() == "rdp"}
    assert rdp["dpsgd"] == pytest.approx(rdp["dp_accounting"], rel=1e-3)  # the same RDP orders


def test_a_failing_library_is_named_in_its_row(monkeypatch):
    def broken(q, sigma, steps, delta):
        return [
            ("broken", "raises", lambda: 1 / 0),
            ("broken", "negative", lambda: [(-0.5, "upper")]),
            ("broken", "slow", lambda: time.sleep(5) or [(1.0, "upper")]),
        ]

    def absent(q, sigma, steps, delta):
        raise ImportError("no such library")

    monkeypatch.setattr(crosscheck, "LIBRARIES", {"broken": broken, "absent": absent})
    res = crosscheck.cross_check(*SCHEDULE, timeout=0.5)
    failures = {r["method"]: r["failure"] for r in res["rows"] if r["library"] == "broken"}
    assert failures["raises"].startswith("ZeroDivisionError")
    assert "negative or not finite" in failures["negative"]
    assert failures["slow"] == "timed out after 0.5 s"
    assert res["missing"] == ["absent"]
    assert any("absent" in ln and "not installed" in ln for ln in crosscheck.lines(res))


def test_random_allocation_against_pld_accounting(monkeypatch):
    # PLD_accounting is not a dependency: its function is stood in for by one that returns the
    # library's own numbers for this schedule (tests/accountant/test_allocation_pld.py: REFERENCE)
    import sys
    import types

    fake = types.ModuleType("PLD_accounting")
    fake.gaussian_allocation_epsilon_range = lambda **kw: (0.17460142869014308, 0.1678581194528456)
    monkeypatch.setitem(sys.modules, "PLD_accounting", fake)
    res = crosscheck.cross_check(0.001, 1.5, 5000, 1e-5, sampler="balls_in_bins")
    rows = {(r["library"], r["method"]): r for r in res["rows"]}
    assert rows[("dpsgd", "pld")]["values"][0][0] < rows[("dpsgd", "rdp")]["values"][0][0]
    assert rows[("PLD_accounting", "random allocation PLD")]["values"] == [
        (0.1678581194528456, "lower"),
        (0.17460142869014308, "upper"),
    ]
    assert rows[("opacus", "-")]["failure"] == "not supported (balls_in_bins sampling)"
    v = res["verdict"]
    assert v["above_every_lower"] and v["ours_over_tightest_upper"] <= 1.01
    text = "\n".join(crosscheck.lines(res))
    assert "random allocation, t = 1000 lots per epoch" in text and "n/a" in text
