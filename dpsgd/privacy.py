"""Privacy CLI: ε of DP-SGD under every accountant, or the σ for a target ε.

    python -m dpsgd.privacy --q 0.01 --sigma 4 --epochs 100 --delta 1e-5
    python -m dpsgd.privacy --q 0.01 --sigma 4 --steps 10000 --delta 1e-5 --json
    python -m dpsgd.privacy --q 0.01 --target-epsilon 2 --epochs 100 --delta 1e-5

The first line answers the question (ε at δ, or the σ for the target ε, by the tightest valid
accountant); then a table (accountant, ε, optimal order, what it is): ``--all`` adds the strong
composition rows, ``--risk`` the membership-inference risk, wherever it can be computed (with
``--json`` as ``risk``; with ``--target-epsilon`` at the σ the first line serves; per sampler with
``--N/--L``; with ``--cross-check``), else its one-line refusal. ``--json`` prints one strict JSON
object keyed by accountant name (moments, rdp, pld, strong_composition), each with at least
``epsilon`` (and ``sigma`` with ``--target-epsilon``). An accountant that cannot answer (outside
what it serves, no finite bound, a target below its floor) gets its own one-line refusal — in the
table, and in JSON as ``{"epsilon": null, "refused": "<reason>"}`` — and the others still answer,
never an infinite ε; the exit status is 0 if at least one accountant answered, 1 if none did. A
sampler's bracket (shuffle, fixed_size) shows a lower end only where a method that lower-bounds
computed it. ``--cross-check`` takes ``--q`` or ``--N/--L`` (Poisson), or ``--sampler balls_in_bins``.

Details: docs/ACCOUNTING.md, "dpsgd/privacy.py".
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import time

from dpsgd.accountant import ACCOUNTANTS, CONVENTIONS, Ledger, calibrate, limits, pld
from dpsgd.accountant.privacy_loss import pair_lower, shuffle_lower, truncated
from dpsgd.accountant.events import Poisson
from dpsgd.accountant.calibrate import CALIBRATABLE
from dpsgd.accountant.last_iterate import last_iterate_epsilon

PROG = "python -m dpsgd.privacy"
ROWS = [  # key, label, order name, note
    ("moments", "moments (paper)", "lambda", "Abadi et al. 2016 Thm 2: lambda = 1..32, tail bound"),
    ("rdp", "rdp", "alpha", "Mironov-Talwar-Zhang 2019, improved RDP->DP conversion"),
    ("pld", "pld (tight)", None, "connect-the-dots PLD, FFT; an upper bound"),
    (
        "strong_composition",
        "strong composition (paper)",
        None,
        "Figure 2 comparator: NOT a valid bound",
    ),
    (
        "strong_composition_valid",
        "strong composition (valid)",
        None,
        "correct amplification, exact Gaussian",
    ),
]
LAST_ITERATE_NOTE = (
    "HEURISTIC, NOT a guarantee: final model only, linear losses (Steinke et al. 2025); "
    "groups at sigma/sqrt(k)"
)
EXTRA = {
    "moments": {"order_name": "lambda"},
    "rdp": {"order_name": "alpha", "conversion": "improved"},
}  # JSON fields


class _Parser(argparse.ArgumentParser):
    def error(self, message):  # one line, exit code 2
        self.exit(2, f"{PROG}: error: {message}\n")


def _parser() -> argparse.ArgumentParser:
    p = _Parser(prog=PROG, description="Privacy (epsilon, delta) of DP-SGD with Poisson sampling.")
    p.add_argument(
        "--q", type=float, help="sampling rate q = L/N, in (0, 1] (Poisson; or give --N and --L)"
    )
    p.add_argument("--N", type=int, help="dataset size N (sampler mode, with --L)")
    p.add_argument("--L", type=int, help="lot size L (sampler mode, with --N)")
    p.add_argument("--B", type=int, help="truncated_poisson: the cap on the lot size")
    p.add_argument(
        "--sampler",
        help="one sampler (poisson, fixed_size, truncated_poisson, balls_in_bins, shuffle)",
    )
    p.add_argument("--sigma", type=float, help="noise multiplier sigma (noise std / C)")
    n = p.add_mutually_exclusive_group(required=True)
    n.add_argument("--epochs", type=float, help="epochs E (lots = E × round(1/q), rounded up)")
    n.add_argument("--steps", type=int, help="number of lots T")
    p.add_argument(
        "--delta",
        type=float,
        default=limits.DELTA_DEFAULT,
        help=f"delta (default {limits.DELTA_DEFAULT:g})",
    )
    p.add_argument("--groups", type=int, default=1, help="tensors clipped separately per lot (k)")
    p.add_argument(
        "--convention",
        choices=list(CONVENTIONS),
        default="joint",
        help="joint: one mechanism at sigma/sqrt(k) (correct); per_tensor: paper's code",
    )
    p.add_argument(
        "--target-epsilon",
        type=float,
        dest="target_epsilon",
        help="calibrate sigma for this epsilon instead of computing epsilon",
    )
    p.add_argument(
        "--last-iterate",
        action="store_true",
        dest="last_iterate",
        help="also print the last-iterate heuristic epsilon (Steinke et al. 2025): a heuristic "
        "for the final model, NOT a privacy guarantee (needs --sigma)",
    )
    p.add_argument(
        "--all",
        action="store_true",
        help="also the strong-composition rows (Figure 2's comparator; one is not a valid bound)",
    )
    p.add_argument(
        "--risk",
        action="store_true",
        help="also the membership-inference risk: TPR at FPR 0.1/1/10 %% (PLD, f-DP envelope)",
    )
    p.add_argument(
        "--cross-check",
        action="store_true",
        dest="cross_check",
        help="the schedule through every installed accountant library, side by side "
        "(at the joint σ/√k; python -m dpsgd.crosscheck)",
    )
    p.add_argument("--json", action="store_true", help="print one JSON object")
    # correlated noise (dpsgd/privacy_correlated.py): its own schedule and charges
    p.add_argument(
        "--noise",
        choices=("independent", "bandmf", "blt"),
        default="independent",
        help="bandmf|blt: correlated noise (DP matrix factorisation), as training charges it",
    )
    p.add_argument(
        "--bands", type=int, help="--noise bandmf: the bands b (cyclic Poisson, b parts)"
    )
    p.add_argument(
        "--blt-buffers", type=int, default=4, dest="blt_buffers", help="--noise blt: buffers d"
    )
    p.add_argument(
        "--momentum", type=float, default=0.0, help="the workload the strategy is optimised for"
    )
    return p


def _steps(args, q) -> int:
    if args.steps is not None:
        return limits.check_steps(args.steps, "steps")
    e = args.epochs
    if not (e > 0 and math.isfinite(e)):
        raise ValueError(f"epochs must be > 0 and finite, got epochs={e!r}")
    lots = e * calibrate.lots_per_epoch(1, q)  # q = L/N: an epoch is N/L = 1/q lots, as trained
    if not lots <= limits.STEPS_MAX:  # also inf (the product overflows)
        raise ValueError(
            f"epochs={e!r} is {lots:.3g} lots at q={q!r}, more than STEPS_MAX = "
            f"{limits.STEPS_MAX:.0e}"
        )
    return calibrate.lots_for_epochs(e, 1, q)


def _attempt(name: str, fn) -> dict:
    """Run one accountant: its answer, or {"epsilon": None, "refused": reason} (never raises on
    a refusal of the accountant itself)."""
    try:
        out = fn()
    except (ValueError, ArithmeticError) as e:
        msg = " ".join(str(e).split()) or type(e).__name__
        return {"epsilon": None, "refused": msg if msg.startswith(name) else f"{name}: {msg}"}
    bad = [k for k in ("epsilon", "sigma") if k in out and not math.isfinite(out[k])]
    if bad:
        return {
            "epsilon": None,
            "refused": f"{name}: no finite bound ({bad[0]} = {out[bad[0]]}) at these parameters",
        }
    return out


def _epsilons(q, sigma, steps, delta, groups, convention) -> dict:
    led = Ledger()
    led.record(Poisson(q, sigma, groups), steps)
    out = {}
    for acc in ACCOUNTANTS:

        def run(acc=acc, extra=EXTRA.get(acc, {})):
            eps, order = led.epsilon(delta, acc, convention)
            return {"epsilon": eps, "order": order, **extra}

        out[acc] = _attempt(acc, run)
    sc = {
        name: _attempt(
            name,
            lambda name=name: {
                "epsilon": calibrate.epsilon(q, sigma, steps, delta, name, groups, convention)
            },
        )
        for name in CALIBRATABLE
        if name not in ACCOUNTANTS
    }
    paper, valid = sc["strong_composition"], sc["strong_composition_valid"]
    out["strong_composition"] = dict(
        paper,
        variant="paper",
        valid_bound=False,
        valid_variant=dict(valid, variant="valid", valid_bound=True),
    )
    return out


def _sigmas(target, q, steps, delta, groups, convention) -> dict:
    out = {}
    for acc in CALIBRATABLE:

        def run(acc=acc):
            s = calibrate.sigma_for_epsilon(target, delta, q, steps, acc, groups, convention)
            eps = calibrate.epsilon(q, s, steps, delta, acc, groups, convention)
            if eps < (1 - CALIBRATION_RTOL) * target:  # no σ brings ε within rtol of the target
                raise ValueError(
                    f"{acc}: the σ search stopped at its limit σ = {s:.4g} (ε = {eps:.3g} there, "
                    f"not within {CALIBRATION_RTOL:.1%} below the target {target:g})"
                )
            return {"sigma": s, "epsilon": eps}

        out[acc] = _attempt(acc, run)
    valid = out.pop("strong_composition_valid")
    out["strong_composition"].update(
        variant="paper",
        valid_bound=False,
        valid_variant=dict(valid, variant="valid", valid_bound=True),
    )
    return out


def _last_iterate(q, sigma, steps, delta, groups) -> dict:
    """{"epsilon": heuristic ε or None, "valid_bound": False, "note", ["refused"]}."""
    r = _attempt(
        "last_iterate", lambda: {"epsilon": last_iterate_epsilon(q, sigma, steps, delta, groups)}
    )
    return dict(r, valid_bound=False, note=LAST_ITERATE_NOTE)


CALIBRATION_RTOL = 0.005  # calibrate.sigma_for_epsilon's default rtol
VALID = ("pld", "rdp", "moments")  # the accountants whose ε is a valid bound, tightest first


def answer(res: dict, q, steps, delta, groups, args) -> str:
    """The first line: the question asked, answered by the tightest valid accountant."""
    what = f"Poisson q = {q:g}, {steps} lots, add/remove" + (
        f", k = {groups}" if groups > 1 else ""
    )
    if groups > 1 and args.convention == "per_tensor":
        what += "; the paper's per-tensor charge: under-states ε, --convention joint is valid"
    served = {a: res[a] for a in VALID if res.get(a, {}).get("epsilon") is not None}
    if not served:
        return f"refused at δ = {delta:g} ({what}): " + "; ".join(
            res[a]["refused"] for a in VALID if a in res
        )
    if args.target_epsilon is not None:
        best = min(served, key=lambda a: served[a]["sigma"])
        r = served[best]
        return (
            f"σ = {r['sigma']:.4g} gives ε = {r['epsilon']:.3f} ≤ {args.target_epsilon:g} at "
            f"δ = {delta:g} ({best.upper()}, {what})"
        )
    best = min(served, key=lambda a: served[a]["epsilon"])
    return f"ε = {served[best]['epsilon']:.3f} at δ = {delta:g} ({best.upper()}, {what})"


def ledger_risk(led: Ledger, convention: str = "joint") -> dict:
    """The membership-inference risk of what ``led`` released (dpsgd/accountant/risk.py, by its
    PLD), or {"refused": one line} where it cannot be computed (a replace-one sampler, a PLD that
    does not serve these lots)."""
    from dpsgd.accountant import risk

    try:
        return risk.risk(led, "pld", convention)
    except (ValueError, ArithmeticError) as e:
        msg = " ".join(str(e).split()) or type(e).__name__
        return {"refused": msg if msg.startswith("risk") else f"risk: {msg}"}


def schedule_risk(q, sigma, steps, groups, convention) -> dict:
    """:func:`ledger_risk` of ``steps`` Poisson lots (q, σ, k groups)."""
    led = Ledger()
    led.record(Poisson(q, sigma, groups), steps)
    return ledger_risk(led, convention)


def risk_text(r: dict, what: str = "") -> str:
    """One line of a :func:`ledger_risk` answer (its refusal, said as one)."""
    head = f"risk{what} (PLD, f-DP)"
    if "refused" in r:
        return f"{head}: refused: {r['refused'].removeprefix('risk: ')}"
    t = r["tpr_at_fpr"]
    return (
        f"{head}: a membership attacker's TPR ≤ {100 * t['0.001']:.2f} % at FPR 0.1 %, "
        f"≤ {100 * t['0.01']:.2f} % at 1 %, ≤ {100 * t['0.1']:.1f} % at 10 %; "
        + ("" if r["gdp_mu_at_1pct"] is None else f"μ-GDP at 1 %: {r['gdp_mu_at_1pct']:.3f}")
    )


def risk_line(q, sigma, steps, groups, convention) -> str:
    """The membership-inference risk of the schedule (dpsgd/accountant/risk.py), one line."""
    return risk_text(schedule_risk(q, sigma, steps, groups, convention))


def _target_risk(res: dict, q, steps, groups, convention) -> dict:
    """With --target-epsilon: the risk at the σ the first line serves (the smallest σ a valid
    accountant calibrated), or its refusal when none did."""
    served = [res[a]["sigma"] for a in VALID if res.get(a, {}).get("sigma") is not None]
    if not served:
        return {"refused": "risk: no valid accountant calibrated a σ"}
    return dict(schedule_risk(q, min(served), steps, groups, convention), sigma=min(served))


def _num(x: float) -> str:
    return f"{x:.4f}" if abs(x) < 1e5 else f"{x:.3e}"


def _outward(x: float, up: bool) -> str:
    """A bracket's end to 4 decimals, rounded away from its inside (the lower end down, the upper
    end up): the printed bracket contains the computed one."""
    from decimal import ROUND_CEILING, ROUND_FLOOR, Decimal

    if abs(x) >= 1e5:
        return _num(x)
    q = Decimal(x).quantize(Decimal("0.0001"), rounding=ROUND_CEILING if up else ROUND_FLOOR)
    return format(q, "f")


def _answered(res) -> int:
    flat = list(res.values()) + [res["strong_composition"]["valid_variant"]]
    return sum(r.get("epsilon") is not None for r in flat)


def _poisson_from_sizes(parser, args) -> bool:
    """--N and --L of Poisson lots with --target-epsilon or --cross-check (without --sampler, or
    with --sampler poisson): answered as --q L/N, every accountant."""
    if args.N is None or args.L is None or args.sampler not in (None, "poisson"):
        return False
    if args.q is not None:
        parser.error(f"give --q or --N and --L, not both: q={args.q!r}, N={args.N}, L={args.L}")
    if not 1 <= args.L <= args.N:
        parser.error(f"L={args.L}: must be in [1, N={args.N}]")
    return args.target_epsilon is not None or (args.cross_check and args.B is None)


def _sampler_mode(parser, args) -> int:
    """--N/--L: every sampler's ε (or one with --sampler), as each is charged in training."""
    from dpsgd.mechanism.sampling import SAMPLERS

    try:
        if args.B is not None and args.sampler not in (None, "truncated_poisson"):
            raise ValueError(
                f"B={args.B}: applies to --sampler truncated_poisson only (sampler={args.sampler} "
                "has no cap on the lot size)"
            )
        if args.N is None or args.L is None:
            raise ValueError("sampler mode needs both --N and --L")
        if not 1 <= args.L <= args.N:
            raise ValueError(f"L={args.L}: must be in [1, N={args.N}]")
        if args.sampler is not None and args.sampler not in SAMPLERS:
            raise ValueError(f"sampler={args.sampler!r}: must be one of {sorted(SAMPLERS)}")
        if args.B is not None and not args.L <= args.B:
            raise ValueError(f"B={args.B}: must be >= L={args.L}")
        if args.sampler == "truncated_poisson" and args.B is None:
            raise ValueError("sampler=truncated_poisson needs --B (the cap on the lot size)")
        if args.sigma is None or args.target_epsilon is not None:
            raise ValueError(
                "the samplers other than Poisson are compared at one σ: give --sigma (a target ε "
                "is answered for Poisson lots: --N, --L, --target-epsilon without --sampler)"
            )
        sigma, delta = limits.check_sigma(args.sigma), limits.check_delta(args.delta)
        steps = _steps(args, args.L / args.N)
        if args.cross_check and args.sampler != "balls_in_bins":
            raise ValueError(
                "--cross-check compares Poisson lots (--q, or --N/--L without --sampler or with "
                f"--sampler poisson) or --sampler balls_in_bins, not --sampler {args.sampler}"
            )
    except ValueError as e:
        parser.error(str(e))
    if args.cross_check:  # random allocation against PLD_accounting (dpsgd/crosscheck.py)
        risk = _sampler_ledger("balls_in_bins", args.N, args.L, sigma, steps) if args.risk else None
        return _cross_checked(args, args.L / args.N, sigma, steps, delta, "balls_in_bins", risk)
    res = (
        sampler_epsilon(args.sampler, args.N, args.L, sigma, steps, delta, args.B, args.risk)
        if args.sampler
        else all_samplers(args.N, args.L, sigma, steps, delta, args.B, args.risk)
    )
    rows = [res] if args.sampler else list(res.values())
    if args.json:
        print(json.dumps(res, allow_nan=False))
    else:
        _sampler_table(args, sigma, steps, delta, rows)
    return 0 if all(r["epsilon"] is not None for r in rows) else 1


def _sampler_table(args, sigma, steps, delta, rows) -> None:
    """The samplers' table: ε, the accountant that served, the adjacency, a note (a bracket, the
    other accountant); with --risk one line per sampler after it."""
    print(f"N={args.N}  L={args.L}  B={args.B}  sigma={sigma:g}  lots={steps}  delta={delta:g}")
    print(f"{'sampler':<19}{'epsilon':>10}{'accountant':>12}{'adjacency':>13}  note")
    for r in rows:
        note = (
            f"{_bracket(r)}; the Poisson number {_val(r['epsilon_if_poisson'])} is not valid for it"
            if "epsilon_if_poisson" in r
            else f"{_bracket(r)}; rdp {_val(r['by_accountant'].get('rdp'))}"
            if "epsilon_lower" in r
            else _allocation_note(r)
            if r["sampler"] == "balls_in_bins" and r["accountant"] is not None
            else "; ".join(r.get("refused", {}).values())
        )
        eps = _val(r["epsilon"])
        print(f"{r['sampler']:<19}{eps:>10}{str(r['accountant']):>12}{r['adjacency']:>13}  {note}")
    for r in rows:
        if "risk" in r:
            print(risk_text(r["risk"], f", {r['sampler']}"))


def _val(x) -> str:
    return "refused" if x is None else _num(x)


def _bracket(r: dict) -> str:
    """``bracket [lower, ε]`` where both ends are shown; else what is, and why the other is not."""
    if r["epsilon_lower"] is None:
        return f"lower end not shown ({r['epsilon_lower_refused']})"
    low = _outward(r["epsilon_lower"], up=False)
    if r["epsilon"] is None:
        return f"lower end {low} (no valid upper end)"
    return f"bracket [{low}, {_outward(r['epsilon'], up=True)}]"


def _cross_checked(args, q, sigma, steps, delta, sampler: str, led: Ledger | None) -> int:
    """``--cross-check``: the schedule through every installed library (dpsgd/crosscheck.py), with
    ``--risk`` the risk of ``led`` (the schedule's own ledger) after it; exit 1 only when ours is
    below a lower value shown."""
    from dpsgd.crosscheck import cross_check, lines

    res = cross_check(q, sigma, steps, delta, sampler=sampler)
    if led is not None:
        res["risk"] = ledger_risk(led)
    if args.json:
        print(json.dumps(res, allow_nan=False))
    else:
        print("\n".join(lines(res)))
        if led is not None:
            print(risk_text(res["risk"]))
    return 1 if res["verdict"]["above_every_lower"] is False else 0


def _sampler_ledger(name: str, N: int, L: int, sigma: float, steps: int, B=None) -> Ledger:
    """The ledger of ``steps`` lots of sampler ``name`` at σ, charged as training charges them."""
    from dpsgd.mechanism.sampling import make_sampler, record_lots

    led = Ledger()
    record_lots(led, make_sampler(name, N, L, None, B if name == "truncated_poisson" else None),
                sigma, steps)  # fmt: skip
    return led


def _allocation_note(r: dict) -> str:
    """Which random-allocation accountant served, and the other's number (or its refusal)."""
    other = "rdp" if r["accountant"] == "pld" else "pld"
    if r["accountant"] == "pld":
        return f"random allocation by PLD; rdp {_num(r['by_accountant']['rdp'])}"
    why = r.get("refused", {}).get("pld", "").split(";")[0].removeprefix("allocation PLD: ")
    return f"random allocation by RDP (both directions exact); {other} " + (
        _num(r["by_accountant"][other]) if other in r["by_accountant"] else f"refused ({why})"
    )


def sampler_epsilon(
    name: str,
    N: int,
    L: int,
    sigma: float,
    steps: int,
    delta: float,
    B: int | None = None,
    risk: bool = False,
) -> dict:
    """{"sampler", "adjacency", "epsilon", "accountant", "by_accountant", ...} for one sampler.

    An accountant that cannot answer (a ValueError, or no finite ε) is named under ``refused``
    with its one line, never an infinite ε; a bracket's lower end (``epsilon_lower``) is computed
    by a method that lower-bounds, or is None with its reason (``epsilon_lower_refused``);
    ``risk``: the membership-inference risk, or its refusal."""
    from dpsgd.mechanism.sampling import make_sampler

    t0 = time.perf_counter()
    s = make_sampler(name, N, L, None, B if name == "truncated_poisson" else None)
    led = _sampler_ledger(name, N, L, sigma, steps, B)
    by, refused = {}, {}
    for acc in s.accountants:
        try:
            eps = led.epsilon(delta, acc)[0]
            if not math.isfinite(eps):
                raise ValueError(f"{acc}: no finite ε at δ = {delta:g} (it cannot resolve δ)")
            by[acc] = eps
        except ValueError as e:
            msg = " ".join(str(e).split())
            refused[acc] = msg if msg.startswith(acc) else f"{acc}: {msg}"
    best = min(by, key=by.get) if by else None
    out = {
        "sampler": name,
        "N": N,
        "L": L,
        "B": getattr(s, "B", None),
        "sigma": sigma,
        "steps": steps,
        "delta": delta,
        "lots_per_epoch": s.lots_per_epoch(),
        "adjacency": s.relation,
        "amplification_by_sampling": s.amplification,
        "epsilon": by.get(best),
        "accountant": best,
        "by_accountant": by,
    }
    if refused:
        out["refused"] = refused
    if name == "shuffle":
        epochs = sum(e.count for e in led.entries)
        out.update(
            _lower(
                lambda: shuffle_lower.epsilon_lower(sigma, s.lots_per_epoch(), epochs, delta),
                "Chua et al. 2024 (arXiv 2403.17673), max-statistic lower bound",
            )
        )
        out["epsilon_if_poisson"] = _finite_or_none(lambda: pld.epsilon(L / N, sigma, steps, delta))
    if name == "fixed_size":
        out.update(
            _lower(
                lambda: pair_lower.epsilon_lower(L / N, sigma / 2.0, steps, delta),
                "one dataset pair with constant gradients: the lot's remove/add pair (rate L/N, "
                "noise sigma/2) self-composed, each loss rounded down (a lower bound; "
                "dpsgd/accountant/privacy_loss/pair_lower.py)",
            )
        )
        out["epsilon_poisson_replace_one"] = _finite_or_none(
            lambda: truncated.replace_one_poisson_epsilon(L / N, sigma, steps, delta)
        )
    if risk:
        out["risk"] = ledger_risk(led)
    out["seconds"] = time.perf_counter() - t0
    return out


def _finite_or_none(fn):
    """fn()'s ε where it is a finite number; None where it refuses or has no finite bound."""
    try:
        v = fn()
    except ValueError:
        return None
    return v if math.isfinite(v) else None


def _lower(fn, source: str) -> dict:
    """A bracket's lower end: {"epsilon_lower", "epsilon_lower_source"}, or None and the reason
    it is not shown (a method that lower-bounds refused)."""
    try:
        v = fn()
        if not math.isfinite(v):
            raise ValueError(f"no finite lower bound ({v})")
    except ValueError as e:
        return {"epsilon_lower": None, "epsilon_lower_refused": " ".join(str(e).split())}
    return {"epsilon_lower": v, "epsilon_lower_source": source}


def all_samplers(N, L, sigma, steps, delta, B=None, risk: bool = False) -> dict:
    """Every sampler's :func:`sampler_epsilon` (truncated_poisson needs B; skipped without it)."""
    from dpsgd.mechanism.sampling import SAMPLERS

    return {
        name: sampler_epsilon(name, N, L, sigma, steps, delta, B, risk)
        for name in SAMPLERS
        if name != "truncated_poisson" or B is not None
    }


def _checked(parser, args) -> tuple:
    """(q, δ, k, lots, target or None, σ or None) of the --q question; one line and exit 2 else."""
    target = sigma = None
    try:
        if args.q is None:
            raise ValueError("--q is required (or --N and --L for the samplers)")
        if args.B is not None:
            raise ValueError(
                f"B={args.B}: applies to --sampler truncated_poisson only (with --N and --L); "
                "--q is the Poisson sampler's, which has no cap on the lot size"
            )
        if args.target_epsilon is not None and args.sigma is not None:
            raise ValueError(
                "give either --sigma (compute epsilon) or --target-epsilon (calibrate sigma), "
                f"not both: sigma={args.sigma!r}, target_epsilon={args.target_epsilon!r}"
            )
        if (args.last_iterate or args.cross_check) and args.target_epsilon is not None:
            raise ValueError(
                "--last-iterate and --cross-check need --sigma (a given run), "
                f"not --target-epsilon={args.target_epsilon!r}"
            )
        q, delta = limits.check_q(args.q), limits.check_delta(args.delta)
        groups = limits.check_groups(args.groups)
        steps = _steps(args, q)
        if args.target_epsilon is not None:
            target = limits.check_epsilon(args.target_epsilon, "target_epsilon")
            if steps < 1:
                raise ValueError(f"steps must be >= 1 to calibrate sigma, got steps={steps}")
        else:
            if args.sigma is None:
                raise ValueError("sigma is required (or give --target-epsilon)")
            sigma = limits.check_sigma(args.sigma)
    except ValueError as e:
        parser.error(str(e))
    return q, delta, groups, steps, target, sigma


def main(argv=None) -> int:
    parser = _parser()
    args = parser.parse_args(argv)
    if args.noise != "independent" or args.bands is not None:  # dpsgd/privacy_correlated.py
        from dpsgd.privacy_correlated import main as correlated_main

        return correlated_main(parser, args)
    if _poisson_from_sizes(parser, args):  # --N/--L of Poisson lots: the --q question, q = L/N
        args.q, args.N, args.L = args.L / args.N, None, None
    if args.N is not None or args.L is not None or args.sampler is not None:
        return _sampler_mode(parser, args)
    q, delta, groups, steps, target, sigma = _checked(parser, args)
    if args.cross_check:  # every installed library on this schedule (dpsgd/crosscheck.py)
        led = None
        if args.risk:
            led = Ledger()
            led.record(Poisson(q, sigma, groups), steps)
        return _cross_checked(args, q, sigma / math.sqrt(groups), steps, delta, "poisson", led)
    if target is not None:
        res = _sigmas(target, q, steps, delta, groups, args.convention)
    else:
        res = _epsilons(q, sigma, steps, delta, groups, args.convention)
    rc = 0 if _answered(res) else 1
    li = _last_iterate(q, sigma, steps, delta, groups) if args.last_iterate else None
    if args.risk:  # at the given σ, or at the σ the first line serves (--target-epsilon)
        res = dict(res, risk=(
            _target_risk(res, q, steps, groups, args.convention) if target is not None
            else schedule_risk(q, sigma, steps, groups, args.convention)
        ))  # fmt: skip
    if args.json:
        if li is not None:
            res = dict(
                res, epsilon_last_iterate_heuristic=li.pop("epsilon"), last_iterate_heuristic=li
            )
        print(json.dumps(res, allow_nan=False))
        return rc
    print(answer(res, q, steps, delta, groups, args))
    _table(res, q, steps, delta, groups, args)
    if args.risk:
        at = f" at σ = {res['risk']['sigma']:.4g}" if "sigma" in res["risk"] else ""
        print(risk_text(res["risk"], at))
    if li is not None:
        val = "refused" if li["epsilon"] is None else _num(li["epsilon"])
        print(
            f"{'last iterate (heuristic)':<28}{val:>10}{'-':>12}  "
            f"{li.get('refused', LAST_ITERATE_NOTE)}"
        )
    return rc


def _table(res, q, steps, delta, groups, args) -> None:
    """The accountants' table (strong composition with --all)."""
    head = (
        f"q={q:g}  lots={steps} (epochs={steps / calibrate.lots_per_epoch(1, q):g})  "
        f"delta={delta:g}  groups={groups} ({args.convention})"
    )
    if args.target_epsilon is not None:
        print(f"sigma for target epsilon={args.target_epsilon:g}:  {head}")
    else:
        print(f"epsilon at sigma={args.sigma:g}:  {head}")
    target_mode = args.target_epsilon is not None
    print(
        f"{'accountant':<28}"
        + (f"{'sigma':>10}" if target_mode else "")
        + f"{'epsilon':>10}{'order':>12}  note"
    )
    flat = dict(res)
    flat["strong_composition_valid"] = res["strong_composition"]["valid_variant"]
    for key, label, oname, note in ROWS:
        if key.startswith("strong_composition") and not args.all:
            continue
        r = flat[key]
        if r.get("epsilon") is None:
            sig = f"{'-':>10}" if target_mode else ""
            print(f"{label:<28}{sig}{'refused':>10}{'-':>12}  {r['refused']}")
            continue
        order = f"{oname}={r['order']:g}" if oname and r.get("order") is not None else "-"
        sig = f"{_num(r['sigma']):>10}" if target_mode else ""
        print(f"{label:<28}{sig}{_num(r['epsilon']):>10}{order:>12}  {note}")


if __name__ == "__main__":
    sys.exit(main())
