"""Privacy CLI: ε of DP-SGD under every accountant, or the σ for a target ε.

    python -m dpsgd.privacy --q 0.01 --sigma 4 --epochs 100 --delta 1e-5
    python -m dpsgd.privacy --q 0.01 --sigma 4 --steps 10000 --delta 1e-5 --json
    python -m dpsgd.privacy --q 0.01 --target-epsilon 2 --epochs 100 --delta 1e-5

Prints a small table (accountant, ε, optimal order, what it is); ``--json`` prints one object keyed
by accountant name (moments, rdp, pld, strong_composition), each with at least ``epsilon`` (and
``sigma`` with ``--target-epsilon``). Bad arguments: a one-line error naming the parameter, exit 2.
"""
from __future__ import annotations

import argparse
import json
import math
import sys

from .accountant import calibrate
from .accountant._checks import check_delta, check_epsilon, check_groups, check_q, check_sigma, check_steps
from .accountant.ledger import Ledger

PROG = "python -m dpsgd.privacy"
ROWS = [  # key, label, order name, note
    ("moments", "moments (paper)", "lambda", "Abadi et al. 2016 Thm 2: lambda = 1..32, tail bound"),
    ("rdp", "rdp", "alpha", "Mironov-Talwar-Zhang 2019, improved RDP->DP conversion"),
    ("pld", "pld (tight)", None, "connect-the-dots PLD, FFT; an upper bound"),
    ("strong_composition", "strong composition (paper)", None, "Figure 2 comparator: NOT a valid bound"),
    ("strong_composition_valid", "strong composition (valid)", None, "correct amplification, exact Gaussian"),
]


class _Parser(argparse.ArgumentParser):
    def error(self, message):  # one line, exit code 2
        self.exit(2, f"{PROG}: error: {message}\n")


def _parser() -> argparse.ArgumentParser:
    p = _Parser(prog=PROG, description="Privacy (epsilon, delta) of DP-SGD with Poisson sampling.")
    p.add_argument("--q", type=float, required=True, help="sampling rate q = L/N, in (0, 1]")
    p.add_argument("--sigma", type=float, help="noise multiplier sigma (noise std / C)")
    n = p.add_mutually_exclusive_group(required=True)
    n.add_argument("--epochs", type=float, help="epochs E (lots = ceil(E / q))")
    n.add_argument("--steps", type=int, help="number of lots T")
    p.add_argument("--delta", type=float, default=1e-5, help="delta (default 1e-5)")
    p.add_argument("--groups", type=int, default=1, help="tensors clipped separately per lot (k)")
    p.add_argument("--convention", choices=["joint", "per_tensor"], default="joint",
                   help="joint: one mechanism at sigma/sqrt(k) (correct); per_tensor: paper's code")
    p.add_argument("--target-epsilon", type=float, dest="target_epsilon",
                   help="calibrate sigma for this epsilon instead of computing epsilon")
    p.add_argument("--json", action="store_true", help="print one JSON object")
    return p


def _steps(args) -> int:
    if args.steps is not None:
        return check_steps(args.steps, "steps")
    if not (args.epochs > 0 and math.isfinite(args.epochs)):
        raise ValueError(f"epochs must be > 0, got epochs={args.epochs!r}")
    return int(math.ceil(args.epochs / args.q - 1e-9))


def _epsilons(q, sigma, steps, delta, groups, convention) -> dict:
    led = Ledger()
    led.record(q, sigma, steps, groups)
    out = {}
    for acc in ("moments", "rdp", "pld"):
        eps, order = led.epsilon(delta, acc, convention)
        out[acc] = {"epsilon": eps, "order": order}
        if acc == "moments":
            out[acc]["order_name"] = "lambda"
        elif acc == "rdp":
            out[acc].update(order_name="alpha", conversion="improved")
    paper = calibrate.epsilon(q, sigma, steps, delta, "strong_composition", groups, convention)
    valid = calibrate.epsilon(q, sigma, steps, delta, "strong_composition_valid", groups, convention)
    out["strong_composition"] = {"epsilon": paper, "variant": "paper", "valid_bound": False,
                                 "valid_variant": {"epsilon": valid, "variant": "valid", "valid_bound": True}}
    return out


def _sigmas(target, q, steps, delta, groups, convention) -> dict:
    out = {}
    for acc in ("moments", "rdp", "pld", "strong_composition", "strong_composition_valid"):
        s = calibrate.sigma_for_epsilon(target, delta, q, steps, acc, groups, convention)
        out[acc] = {"sigma": s, "epsilon": calibrate.epsilon(q, s, steps, delta, acc, groups, convention)}
    valid = out.pop("strong_composition_valid")
    out["strong_composition"].update(variant="paper", valid_bound=False,
                                     valid_variant=dict(valid, variant="valid", valid_bound=True))
    return out


def main(argv=None) -> int:
    parser = _parser()
    args = parser.parse_args(argv)
    try:
        q, delta = check_q(args.q), check_delta(args.delta)
        groups = check_groups(args.groups)
        steps = _steps(args)
        if args.target_epsilon is not None:
            target = check_epsilon(args.target_epsilon, "target_epsilon")
            if steps < 1:
                raise ValueError(f"steps must be >= 1 to calibrate sigma, got steps={steps}")
            res = _sigmas(target, q, steps, delta, groups, args.convention)
        else:
            if args.sigma is None:
                raise ValueError("sigma is required (or give --target-epsilon)")
            sigma = check_sigma(args.sigma)
            res = _epsilons(q, sigma, steps, delta, groups, args.convention)
    except ValueError as e:
        parser.error(str(e))
    if args.json:
        print(json.dumps(res))
        return 0
    head = f"q={q:g}  lots={steps} (epochs={steps * q:g})  delta={delta:g}  groups={groups} ({args.convention})"
    if args.target_epsilon is not None:
        print(f"sigma for target epsilon={args.target_epsilon:g}:  {head}")
    else:
        print(f"epsilon at sigma={args.sigma:g}:  {head}")
    target_mode = args.target_epsilon is not None
    print(f"{'accountant':<28}" + (f"{'sigma':>10}" if target_mode else "") + f"{'epsilon':>10}{'order':>12}  note")
    flat = dict(res)
    flat["strong_composition_valid"] = res["strong_composition"]["valid_variant"]
    for key, label, oname, note in ROWS:
        r = flat[key]
        order = f"{oname}={r['order']:g}" if oname and r.get("order") is not None else "-"
        sig = f"{r['sigma']:>10.4f}" if target_mode else ""
        print(f"{label:<28}{sig}{r['epsilon']:>10.4f}{order:>12}  {note}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
