"""Every public accountant function refuses bad q, σ, δ, ε and negative steps, naming the value."""

import math

import pytest

from dpsgd.accountant import Ledger, calibrate, moments, pld, rdp, strong_composition as sc
from dpsgd.accountant.events import Poisson

GOOD = dict(q=0.01, sigma=1.0, steps=10, delta=1e-5, epsilon=1.0)
BAD = {  # the last values of each row are just outside the serviceable ranges (limits)
    "q": [0.0, -0.1, 1.5, math.nan, "0.1", True, 1e-300],
    "sigma": [0.0, -1.0, math.inf, math.nan, 1e-300, 1e308, 0.0099],
    "delta": [0.0, 1.0, -1e-5, 2.0, 1e-320],
    "epsilon": [0.0, -1.0, math.inf, 1e9],
    "steps": [-1, 2.5, math.nan, 99_999_999_999, 1e300],
}


def _led():
    led = Ledger()
    led.record(Poisson(0.01, 1.0), 10)
    return led


# name -> (callable taking the GOOD kwargs, the parameters it takes)
FUNCS = {
    "moments.log_moments": (lambda a: moments.log_moments(a["q"], a["sigma"]), ("q", "sigma")),
    "moments.epsilon": (
        lambda a: moments.epsilon(a["q"], a["sigma"], a["steps"], a["delta"]),
        ("q", "sigma", "steps", "delta"),
    ),
    "moments.delta": (
        lambda a: moments.delta(a["q"], a["sigma"], a["steps"], a["epsilon"]),
        ("q", "sigma", "steps", "epsilon"),
    ),
    "rdp.compute_rdp": (
        lambda a: rdp.compute_rdp(a["q"], a["sigma"], steps=a["steps"]),
        ("q", "sigma", "steps"),
    ),
    "rdp.epsilon": (
        lambda a: rdp.epsilon(a["q"], a["sigma"], a["steps"], a["delta"]),
        ("q", "sigma", "steps", "delta"),
    ),
    "rdp.delta": (
        lambda a: rdp.delta(a["q"], a["sigma"], a["steps"], a["epsilon"]),
        ("q", "sigma", "steps", "epsilon"),
    ),
    "rdp.log_a": (lambda a: rdp.log_a(a["q"], a["sigma"], 2.5), ("q", "sigma")),
    "pld.epsilon": (
        lambda a: pld.epsilon(a["q"], a["sigma"], a["steps"], a["delta"]),
        ("q", "sigma", "steps", "delta"),
    ),
    "pld.delta": (
        lambda a: pld.delta(a["q"], a["sigma"], a["steps"], a["epsilon"]),
        ("q", "sigma", "steps", "epsilon"),
    ),
    "pld.epsilon_for_releases": (
        lambda a: pld.epsilon_for_releases([(a["q"], a["sigma"], a["steps"])], a["delta"]),
        ("q", "sigma", "steps", "delta"),
    ),
    "sc.epsilon": (
        lambda a: sc.epsilon(a["q"], a["sigma"], a["steps"], a["delta"]),
        ("q", "sigma", "steps", "delta"),
    ),
    "calibrate.epsilon": (
        lambda a: calibrate.epsilon(a["q"], a["sigma"], a["steps"], a["delta"]),
        ("q", "sigma", "steps", "delta"),
    ),
    "calibrate.sigma_for_epsilon": (
        lambda a: calibrate.sigma_for_epsilon(a["epsilon"], a["delta"], a["q"], a["steps"]),
        ("epsilon", "delta", "q", "steps"),
    ),
    "calibrate.max_steps": (
        lambda a: calibrate.max_steps(a["epsilon"], a["delta"], a["q"], a["sigma"]),
        ("epsilon", "delta", "q", "sigma"),
    ),
    "Ledger.record": (
        lambda a: Ledger().record(Poisson(a["q"], a["sigma"]), a["steps"]),
        ("q", "sigma", "steps"),
    ),
    "Ledger.epsilon": (lambda a: _led().epsilon(a["delta"]), ("delta",)),
    "Ledger.delta": (lambda a: _led().delta(a["epsilon"]), ("epsilon",)),
    "Ledger.steps_within": (
        lambda a: _led().steps_within(a["epsilon"], a["delta"], Poisson(a["q"], a["sigma"])),
        ("epsilon", "delta", "q", "sigma"),
    ),
}
CASES = [(f, p, v) for f, (_, params) in FUNCS.items() for p in params for v in BAD[p]]


@pytest.mark.parametrize("fname,param,value", CASES, ids=[f"{f}-{p}-{v!r}" for f, p, v in CASES])
def test_bad_value_is_refused_by_name(fname, param, value):
    fn, _ = FUNCS[fname]
    args = dict(GOOD, **{param: value})
    with pytest.raises(ValueError) as exc:
        fn(args)
    msg = str(exc.value)
    assert repr(value) in msg  # names the value ...
    names = {
        "q": "q",
        "sigma": "sigma",
        "delta": "delta",
        "epsilon": "epsilon",
        "steps": ("steps", "count"),
    }[param]
    assert any(
        n in msg for n in ((names,) if isinstance(names, str) else names)
    )  # ... and the parameter


def test_good_values_pass():
    for fn, _ in FUNCS.values():
        fn(GOOD)


def test_bad_choices_named():
    with pytest.raises(ValueError, match="accountant"):
        _led().epsilon(1e-5, accountant="gdp")
    with pytest.raises(ValueError, match="convention"):
        _led().epsilon(1e-5, convention="sum")
    with pytest.raises(ValueError, match="groups"):
        Ledger().record(Poisson(0.01, 1.0, groups=0), 1)
    with pytest.raises(ValueError, match="variant"):
        sc.epsilon(0.01, 1.0, 10, 1e-5, variant="tight")


def test_accounting_does_not_import_torch():
    import subprocess
    import sys

    code = "import sys, dpsgd.accountant, dpsgd.privacy; sys.exit('torch' in sys.modules)"
    assert subprocess.run([sys.executable, "-c", code]).returncode == 0


def test_serviceable_range_constants_and_boundaries():
    from dpsgd.accountant import limits as c

    assert (
        c.SIGMA_MIN,
        c.SIGMA_MAX,
        c.Q_MIN,
        c.STEPS_MAX,
        c.GROUPS_MAX,
        c.DELTA_MIN,
        c.EPSILON_MAX,
    ) == (0.01, 1e6, 1e-12, 10**9, 10**5, 1e-100, 1e4)
    # the boundaries themselves are served
    assert (
        c.check_sigma(c.SIGMA_MIN) == 0.01
        and c.check_sigma(c.SIGMA_MAX) == 1e6
        and c.check_sigma(4) == 4.0
    )
    assert c.check_q(c.Q_MIN) == 1e-12 and c.check_delta(c.DELTA_MIN) == 1e-100
    assert c.check_steps(c.STEPS_MAX) == 10**9 and c.check_groups(c.GROUPS_MAX) == 10**5
    assert c.check_epsilon(c.EPSILON_MAX) == 1e4
    for fn, value, words in [
        (c.check_groups, 10**8, ("groups", "1e+05")),
        (c.check_sigma, 1e-300, ("sigma", "[0.01, 1e+06]")),
        (c.check_steps, 10**11, ("steps", "STEPS_MAX")),
        (c.check_delta, 1e-320, ("delta", "1e-100")),
    ]:
        with pytest.raises(ValueError) as exc:
            fn(value)
        assert all(w in str(exc.value) for w in words), str(exc.value)


def test_extremes_of_the_ranges_answer_without_error():
    # the corners each accountant is documented to serve (numbers only need to be finite, >= 0)
    for q, s, t, d in [
        (1.0, 0.01, 1, 1e-5),
        (0.5, 0.01, 1, 1e-100),
        (1e-12, 1.0, 10**9, 1e-5),
        (1.0, 1e6, 10**9, 1e-5),
    ]:
        for e in (
            moments.epsilon(q, s, t, d)[0],
            rdp.epsilon(q, s, t, d)[0],
            pld.epsilon(q, s, t, d),
        ):
            assert 0.0 <= e < math.inf, (q, s, t, d, e)
