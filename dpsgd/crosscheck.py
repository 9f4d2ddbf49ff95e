"""One schedule through every installed accountant library, side by side:
``python -m dpsgd.crosscheck --q 0.01 --sigma 4 --epochs 100 [--delta 1e-5] [--json]``
(also ``python -m dpsgd.privacy ... --cross-check``).

Poisson-subsampled Gaussian lots, add/remove adjacency. Rows: ours (moments, RDP, PLD);
dp_accounting (PLD pessimistic and optimistic, RDP); Opacus (RDP, PRV with its error bars, GDP:
a central-limit approximation, not a bound); prv_accountant (lower, estimate, upper). With
``--sampler balls_in_bins``: random allocation over t = 1/q lots per epoch, ours (PLD, RDP) against
PLD_accounting's lower and upper bounds; the other libraries are marked "not supported". A library
that is not installed is named in one line; a numerical failure (an exception, a negative or
non-finite ε, more than ``--timeout`` seconds) is caught and named in its row. The verdict line
says whether our valid ε is at or above every lower or optimistic value shown, and by how much it
exceeds the tightest valid upper bound; it is said over the values shown only (with no lower value
shown, it says so and compares nothing). ``pip install -e .[crosscheck]`` installs the libraries;
why accountants differ: docs/ACCOUNTING.md, "Why accountants disagree".
"""

from __future__ import annotations

import argparse
import json
import math
import signal
import sys
import warnings

from dpsgd.accountant import Ledger, limits
from dpsgd.accountant.calibrate import lots_for_epochs
from dpsgd.accountant.events import Allocation, Poisson

# kind: "upper" (a valid bound), "lower" (an optimistic value: no valid ε is below it),
# "estimate" (neither), "approx" (an approximation that is no bound)
KINDS = ("upper", "lower", "estimate", "approx")


class _Timeout(Exception):
    pass


def _timed(fn, seconds: float):
    """fn() within ``seconds`` (SIGALRM; the main thread), else _Timeout."""

    def alarm(signum, frame):
        raise _Timeout()

    old = signal.signal(signal.SIGALRM, alarm)
    signal.setitimer(signal.ITIMER_REAL, seconds)
    try:
        return fn()
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, old)


def _ours(event, count, delta, accountants=("moments", "rdp", "pld")):
    led = Ledger()
    led.record(event, count, "sgd")
    return [
        ("dpsgd", name, lambda n=name: [(led.epsilon(delta, n)[0], "upper")])
        for name in accountants
    ]


def _dp_accounting(q, sigma, steps, delta):
    import dp_accounting as dpa
    from dp_accounting.rdp import RdpAccountant

    event = dpa.SelfComposedDpEvent(dpa.PoissonSampledDpEvent(q, dpa.GaussianDpEvent(sigma)), steps)

    def pld(pessimistic: bool):
        from dp_accounting.pld.privacy_loss_distribution import from_gaussian_mechanism

        one = from_gaussian_mechanism(
            sigma,
            pessimistic_estimate=pessimistic,
            sampling_prob=q,
            value_discretization_interval=1e-4,
            use_connect_dots=pessimistic,  # the optimistic estimate: privacy buckets
        )
        kind = "upper" if pessimistic else "lower"
        return [(one.self_compose(steps).get_epsilon_for_delta(delta), kind)]

    return [
        ("dp_accounting", "PLD pessimistic", lambda: pld(True)),
        ("dp_accounting", "PLD optimistic", lambda: pld(False)),
        (
            "dp_accounting",
            "RDP",
            lambda: [(RdpAccountant().compose(event).get_epsilon(delta), "upper")],
        ),  # fmt: skip
    ]


def _opacus(q, sigma, steps, delta):
    from opacus.accountants import GaussianAccountant, PRVAccountant, RDPAccountant

    def run(cls, kind, **kw):
        acc = cls()
        acc.history = [(sigma, q, steps)]
        return [(acc.get_epsilon(delta, **kw), kind)]

    return [
        ("opacus", "RDP", lambda: run(RDPAccountant, "upper")),
        (
            "opacus",
            "PRV (upper, eps_error 0.01)",
            lambda: run(PRVAccountant, "upper", eps_error=0.01),
        ),  # fmt: skip
        ("opacus", "GDP (CLT, not a bound)", lambda: run(GaussianAccountant, "approx")),
    ]


def _prv_accountant(q, sigma, steps, delta):
    from prv_accountant import PoissonSubsampledGaussianMechanism, PRVAccountant

    def run():
        acc = PRVAccountant(prvs=[PoissonSubsampledGaussianMechanism(q, sigma)], eps_error=0.01,
                            delta_error=delta / 1000, max_self_compositions=[steps])  # fmt: skip
        lo, est, up = acc.compute_epsilon(delta, [steps])
        return [(lo, "lower"), (est, "estimate"), (up, "upper")]

    return [("prv_accountant", "PRV", run)]


LIBRARIES = {"dp_accounting": _dp_accounting, "opacus": _opacus, "prv_accountant": _prv_accountant}


def _pld_accounting(t, sigma, epochs, delta):
    from PLD_accounting import gaussian_allocation_epsilon_range

    def run():
        up, lo = gaussian_allocation_epsilon_range(
            delta=delta, sigma=sigma, num_steps=t, num_epochs=epochs
        )
        return [(lo, "lower"), (up, "upper")]

    return [("PLD_accounting", "random allocation PLD", run)]


def _allocation_calls(q, sigma, steps, delta):
    """(calls, missing, unsupported) of a random-allocation schedule: t = 1/q lots per epoch."""
    t = max(1, round(1.0 / q))
    epochs = -(-steps // t)
    calls, missing = _ours(Allocation(sigma, t), epochs, delta, ("pld", "rdp")), []
    try:
        calls += _pld_accounting(t, sigma, epochs, delta)
    except ImportError:
        missing.append("PLD_accounting")
    return calls, missing, list(LIBRARIES)


def _poisson_calls(q, sigma, steps, delta):
    calls, missing = _ours(Poisson(q, sigma), steps, delta), []
    for name, build in LIBRARIES.items():
        try:
            calls += build(q, sigma, steps, delta)
        except ImportError:
            missing.append(name)
    return calls, missing, []


def cross_check(q, sigma, steps, delta, timeout: float = 60.0, sampler: str = "poisson") -> dict:
    """{"rows": [{library, method, values: [(ε, kind)] | None, failure}], "missing": [...],
    "verdict": {...}}; ``sampler`` "poisson" or "balls_in_bins" (t = 1/q lots per epoch)."""
    build = _allocation_calls if sampler == "balls_in_bins" else _poisson_calls
    calls, missing, unsupported = build(q, sigma, steps, delta)
    rows = []
    for library, method, fn in calls:
        row = {"library": library, "method": method, "values": None, "failure": None}
        try:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                vals = [(float(v), k) for v, k in _timed(fn, timeout)]
            bad = [v for v, _ in vals if not (math.isfinite(v) and v >= 0)]
            if bad:
                row["failure"] = f"returned ε = {bad[0]} (negative or not finite)"
            else:
                row["values"] = vals
        except _Timeout:
            row["failure"] = f"timed out after {timeout:g} s"
        except Exception as e:  # a library's own numerical failure, named in its row
            row["failure"] = f"{type(e).__name__}: {' '.join(str(e).split())[:120]}"
        rows.append(row)
    for name in unsupported:
        rows.append({"library": name, "method": "-", "values": None,
                     "failure": f"not supported ({sampler} sampling)"})  # fmt: skip
    return {"schedule": {"q": q, "sigma": sigma, "steps": steps, "delta": delta,
                         "sampler": sampler},
            "rows": rows, "missing": missing, "verdict": verdict(rows)}  # fmt: skip


def verdict(rows) -> dict:
    """Ours (the smallest of our valid bounds) against the other libraries' values shown: only
    those (a library that is not installed, failed or does not support the sampler has none), so
    ``above_every_lower`` is None where no lower or optimistic value is shown, and ``ours`` None
    where none of ours answered."""
    mine = [v for r in rows if r["library"] == "dpsgd" and r["values"] for v, _ in r["values"]]
    ours = min(mine) if mine else None
    others = [(r, v, k) for r in rows if r["library"] != "dpsgd" and r["values"]
              for v, k in r["values"]]  # fmt: skip
    lows = [v for _, v, k in others if k == "lower"]
    ups = [v for _, v, k in others if k == "upper"]
    return {
        "ours": ours,
        "lower_values_shown": len(lows),
        "above_every_lower": all(ours >= v for v in lows) if lows and ours is not None else None,
        "highest_lower": max(lows) if lows else None,
        "tightest_upper": min(ups) if ups else None,
        "ours_over_tightest_upper": ours / min(ups) if ups and ours is not None else None,
    }


def lines(res: dict) -> list[str]:
    s, out = res["schedule"], []
    how = ("random allocation, t = " + str(max(1, round(1 / s["q"]))) + " lots per epoch"
           if s.get("sampler") == "balls_in_bins" else f"Poisson q = {s['q']:g}")  # fmt: skip
    out.append(f"cross-check: {how}, σ = {s['sigma']:g}, {s['steps']} lots, "
               f"δ = {s['delta']:g}, add/remove")  # fmt: skip
    out.append(f"{'library':<16}{'method':<30}{'ε':>10}  kind")
    for r in res["rows"]:
        if r["failure"]:
            tag = "n/a" if r["failure"].startswith("not supported") else "failed"
            out.append(f"{r['library']:<16}{r['method']:<30}{tag:>10}  {r['failure']}")
            continue
        for v, k in r["values"]:
            out.append(f"{r['library']:<16}{r['method']:<30}{v:>10.4f}  {k}")
    for name in res["missing"]:
        out.append(f"{name:<16}not installed (pip install -e .[crosscheck])")
    out.append(verdict_line(res["verdict"]))
    return out


def verdict_line(v: dict) -> str:
    """The verdict over the values shown, and only those."""
    if v["ours"] is None:
        return "verdict: none of ours answered; nothing to compare"
    tail = (
        f"; ours / tightest valid upper ({v['tightest_upper']:.4f}) = "
        f"{v['ours_over_tightest_upper']:.4f}"
        if v["tightest_upper"]
        else ""
    )
    if v["above_every_lower"] is None:
        return (
            f"verdict: ours ε = {v['ours']:.4f}; no lower or optimistic value is shown to compare "
            "it with" + tail
        )
    return (
        f"verdict: ours ε = {v['ours']:.4f} is "
        + ("at or above" if v["above_every_lower"] else "BELOW")
        + f" every lower/optimistic value shown ({v['lower_values_shown']}, highest "
        f"{v['highest_lower']:.4f})" + tail
    )


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(
        prog="python -m dpsgd.crosscheck", description=__doc__.split("\n")[0]
    )
    ap.add_argument("--q", type=float, required=True)
    ap.add_argument("--sigma", type=float, required=True)
    n = ap.add_mutually_exclusive_group(required=True)
    n.add_argument("--steps", type=int)
    n.add_argument("--epochs", type=float)
    ap.add_argument("--delta", type=float, default=limits.DELTA_DEFAULT)
    ap.add_argument("--timeout", type=float, default=60.0, help="seconds per library call")
    ap.add_argument("--sampler", choices=("poisson", "balls_in_bins"), default="poisson")
    ap.add_argument("--json", action="store_true")
    a = ap.parse_args(argv)
    try:
        q, sigma = limits.check_q(a.q), limits.check_sigma(a.sigma)
        delta = limits.check_delta(a.delta)
        steps = a.steps if a.steps is not None else lots_for_epochs(a.epochs, 1, q)
        steps = limits.check_steps(steps, "steps")
    except ValueError as e:
        ap.exit(2, f"python -m dpsgd.crosscheck: error: {e}\n")
    res = cross_check(q, sigma, steps, delta, a.timeout, a.sampler)
    print(json.dumps(res, allow_nan=False) if a.json else "\n".join(lines(res)))
    return 1 if res["verdict"]["above_every_lower"] is False else 0


if __name__ == "__main__":
    sys.exit(main())
