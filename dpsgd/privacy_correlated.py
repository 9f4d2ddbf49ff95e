"""``python -m dpsgd.privacy --noise bandmf|blt``: ε (or σ for a target ε) of a correlated-noise
schedule, as training charges it, and what its strategy does to the noise.

    python -m dpsgd.privacy --q 0.01 --sigma 8.7 --steps 17204 --noise bandmf --bands 5
    python -m dpsgd.privacy --N 60000 --L 600 --target-epsilon 2 --epochs 172 --noise bandmf --bands 4
    python -m dpsgd.privacy --q 0.01 --target-epsilon 2 --epochs 172 --noise blt

BandMF runs under cyclic Poisson sampling over b parts (rate q' = b·q in the lot's part, expected
lot L = qN), charged ⌈n/b⌉ Poisson-subsampled Gaussians at (q', σ) (Choquette-Choo et al. 2023,
Thm 4); BLT under b-min-separation (round(1/q) parts, each visited once per epoch), charged one
Gaussian at σ per epoch, not amplified (mechanism/cyclic.py, events.Cyclic). The same ledger and
accountants as training answer; a target ε is met by the σ search training's calibration uses
(``calibrate.sigma_for_epsilon`` over the charges). Beside it: the strategy optimised for the n lots
(mechanism/correlated/strategy.py), its noise per step, and, for a target ε, its expected workload error
against DP-SGD's (Poisson, independent noise) at the same ε. Called by ``dpsgd/privacy.py:main``.
"""

from __future__ import annotations

import json
import math

from dpsgd.accountant import Ledger, calibrate, limits
from dpsgd.accountant.events import Cyclic
from dpsgd.accountant.ledger import EVENTS
from dpsgd.mechanism.correlated import strategy as strategies

SERVED = EVENTS["cyclic"]  # the accountants of a Cyclic charge, tightest first


def schedule(args) -> dict:
    """The checked schedule of the arguments: q (DP-SGD's L/N), the cycle, q' of one charge, the
    charges of n lots, σ or the target; ValueError (one line) else."""
    if args.sampler is not None or args.B is not None:
        raise ValueError(
            f"--noise {args.noise}: runs its own cyclic participation (cyclic_poisson for bandmf, "
            "cyclic for blt); --sampler and --B do not apply"
        )
    if args.cross_check or args.last_iterate:
        raise ValueError("--cross-check and --last-iterate serve --noise independent only")
    if (args.bands is not None) != (args.noise == "bandmf"):
        raise ValueError(
            "--bands b is BandMF's (and needed by it): --noise bandmf --bands b"
            if args.noise == "bandmf"
            else f"--bands={args.bands}: applies to --noise bandmf only"
        )
    N = None
    if args.N is not None or args.L is not None:
        if args.q is not None or args.N is None or args.L is None or not 1 <= args.L <= args.N:
            raise ValueError("give --q, or --N and --L with 1 <= L <= N")
        N, q = args.N, args.L / args.N
    elif args.q is None:
        raise ValueError("--q is required (or --N and --L)")
    else:
        q = args.q
    q, delta = limits.check_q(q), limits.check_delta(args.delta)
    groups = limits.check_groups(args.groups)
    if (args.sigma is None) == (args.target_epsilon is None):
        raise ValueError(
            "give either --sigma (compute epsilon) or --target-epsilon (calibrate sigma)"
        )
    if args.noise == "bandmf":
        b = int(args.bands)
        if not 1 <= b <= strategies.BANDS_MAX or b * q > 1:
            raise ValueError(
                f"bands={b}: must be in [1, {strategies.BANDS_MAX}] with b·q <= 1 (q = {q:g}: "
                "cyclic Poisson samples each part at rate b·q)"
            )
        cycle, q_charge = b, b * q if N is None else b * args.L / N
    else:
        cycle, q_charge = calibrate.lots_per_epoch(1, q), 1.0
    lots = _lots(args, q, cycle)
    return {
        "q": q,
        "q_charge": q_charge,
        "cycle": cycle,
        "lots": lots,
        "charges": -(-lots // cycle),
        "delta": delta,
        "groups": groups,
        "sigma": None if args.sigma is None else limits.check_sigma(args.sigma),
        "target": None
        if args.target_epsilon is None
        else limits.check_epsilon(args.target_epsilon, "target_epsilon"),
    }


def _lots(args, q: float, cycle: int) -> int:
    """n: --steps, or --epochs × the lots per epoch training runs (whole cycles for BandMF)."""
    if args.steps is not None:
        return limits.check_steps(args.steps, "steps")
    e = args.epochs
    if not (e > 0 and math.isfinite(e)):
        raise ValueError(f"epochs must be > 0 and finite, got epochs={e!r}")
    per = cycle * max(1, round(1 / (q * cycle))) if args.noise == "bandmf" else cycle
    return limits.check_steps(math.ceil(e * per), "steps")


def answer(args) -> dict:
    """ε (or σ) under every accountant that serves the charges, the strategy, and (target) DP-SGD
    at the same ε for comparison."""
    s = schedule(args)
    out = {"noise": args.noise, "bands": args.bands, **s}
    by = {}
    for acc in SERVED:
        try:
            sigma = s["sigma"]
            if s["target"] is not None:
                sigma = calibrate.sigma_for_epsilon(
                    s["target"],
                    s["delta"],
                    s["q_charge"],
                    s["charges"],
                    acc,
                    s["groups"],
                    args.convention,
                )
            led = Ledger()
            led.record(Cyclic(s["q_charge"], sigma, s["cycle"], s["groups"]), s["charges"])
            eps, order = led.epsilon(s["delta"], acc, args.convention)
            by[acc] = {"epsilon": eps, "sigma": sigma, "order": order}
        except (ValueError, ArithmeticError) as e:
            by[acc] = {"epsilon": None, "refused": " ".join(str(e).split())}
    out["by_accountant"] = by
    ok = [a for a in SERVED if by[a]["epsilon"] is not None]
    best = (
        (
            min(ok, key=lambda a: by[a]["sigma"])
            if s["target"]
            else min(ok, key=lambda a: by[a]["epsilon"])
        )
        if ok
        else None
    )
    out["accountant"] = best
    st = strategies.for_run(
        args.noise, args.bands, args.blt_buffers, s["lots"], s["cycle"], args.momentum
    )
    out["strategy"] = st.to_dict()
    out["noise_multiplier_per_step"] = strategies.noise_multiplier_per_step(st)
    out["expected_error_ratio"] = strategies.expected_error_ratio(st)
    if best is not None and s["target"] is not None:
        ref = calibrate.sigma_for_epsilon(
            s["target"], s["delta"], s["q"], s["lots"], best, s["groups"], args.convention
        )
        out["dpsgd_sigma"] = ref
        out["expected_error_vs_dpsgd"] = by[best]["sigma"] * out["expected_error_ratio"] / ref
    return out


def lines(res: dict) -> list[str]:
    """The text answer: the first line answers, then one row per accountant, then the strategy."""
    what = (
        f"BandMF b = {res['bands']}, cyclic Poisson over {res['cycle']} parts, q' = "
        f"{res['q_charge']:g}"
        if res["noise"] == "bandmf"
        else f"BLT, b-min-separation: {res['cycle']} parts, one per lot, not amplified"
    ) + f", {res['lots']} lots = {res['charges']} charges, add/remove"
    best, d = res["accountant"], res["delta"]
    if best is None:
        out = [
            f"refused at δ = {d:g} ({what}): "
            + "; ".join(r["refused"] for r in res["by_accountant"].values())
        ]
    elif res["target"] is not None:
        r = res["by_accountant"][best]
        out = [
            f"σ = {r['sigma']:.4g} gives ε = {r['epsilon']:.3f} ≤ {res['target']:g} at δ = "
            f"{d:g} ({best.upper()}, {what})"
        ]
    else:
        out = [
            f"ε = {res['by_accountant'][best]['epsilon']:.3f} at δ = {d:g} ({best.upper()}, {what})"
        ]
    out.append(f"{'accountant':<12}{'sigma':>10}{'epsilon':>10}  note")
    for acc, r in res["by_accountant"].items():
        if r["epsilon"] is None:
            out.append(f"{acc:<12}{'-':>10}{'refused':>10}  {r['refused']}")
        else:
            out.append(f"{acc:<12}{r['sigma']:>10.4f}{r['epsilon']:>10.4f}")
    st = res["strategy"]
    kind = (
        f"banded Toeplitz, b = {len(st['coef'])}"
        if st["kind"] == "bandmf"
        else f"BLT, {len(st['theta'])} buffer(s), Δ_∞ = {st['scale']:.4g}"
    )
    out.append(
        f"strategy: {kind}, optimised for {st['horizon']} lots: noise std per step "
        f"{res['noise_multiplier_per_step']:.4g}·σC, expected workload error "
        f"×{res['expected_error_ratio']:.4f} of independent noise at the same σ"
    )
    if "expected_error_vs_dpsgd" in res:
        out.append(
            f"vs DP-SGD at the same ε (Poisson q = {res['q']:g}, {res['lots']} lots, σ = "
            f"{res['dpsgd_sigma']:.4g}): expected workload error ×"
            f"{res['expected_error_vs_dpsgd']:.4f}"
        )
    return out


def main(parser, args) -> int:
    """The --noise bandmf|blt question: one line and exit 2 for bad input, else the answer."""
    try:
        res = answer(args)
    except ValueError as e:
        parser.error(" ".join(str(e).split()))
    if args.json:
        print(json.dumps(res, allow_nan=False))
    else:
        print("\n".join(lines(res)))
        if args.risk and res["accountant"] is not None and res["target"] is None:
            from dpsgd.accountant import risk

            led = Ledger()
            led.record(
                Cyclic(res["q_charge"], res["sigma"], res["cycle"], res["groups"]), res["charges"]
            )
            t = risk.risk(led, "pld", args.convention)["tpr_at_fpr"]
            print(
                f"risk (PLD, f-DP): TPR ≤ {100 * t['0.001']:.2f} % at FPR 0.1 %, ≤ "
                f"{100 * t['0.01']:.2f} % at 1 %, ≤ {100 * t['0.1']:.1f} % at 10 %"
            )
    return 0 if res["accountant"] is not None else 1
