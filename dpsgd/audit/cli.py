"""Command line of the audit: ``python -m dpsgd.audit --help``.

Every bad value is refused as one line ``error: <parameter>=...`` with exit status 2 before any trial
runs (argparse refuses unknown choices itself, also with status 2); ``--json`` never overwrites an
earlier result. One line per mechanism: ε_lb (and the point estimate), the claimed ε of each
accountant, the held-out error counts, the time, and the verdict.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
from dataclasses import asdict

from .game import run_audit
from .settings import CLIPPINGS, MECHANISMS, SETTINGS, AuditConfig, AuditResult

DEFAULT_ACCOUNTANTS = ",".join(AuditConfig.accountants)


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m dpsgd.audit",
        description="Empirical privacy audit of one DP-SGD step: a gradient canary, the "
                    "distinguishing game D = ∅ vs D' = {canary} on the real DPSGD/clipper/noise "
                    "code, and a 95 % Clopper–Pearson lower bound on ε next to the accountant's ε.",
        epilog="Examples: python -m dpsgd.audit --mechanism all  |  "
               "python -m dpsgd.audit --setting mnist --sigma 4 --trials 20000")
    p.add_argument("--setting", choices=sorted(SETTINGS), default="tiny",
                   help="tiny: vectorised one-feature models (fast); mnist: the paper's "
                        "PCA-60 → 1000 → 10 network, per-layer clipping (default: tiny)")
    p.add_argument("--mechanism", choices=MECHANISMS + ("all",), default="all",
                   help="mechanism under audit; no_clip and noise_div10 are deliberately broken "
                        "(default: all three)")
    p.add_argument("--sigma", type=float, help="claimed noise multiplier σ (tiny: 2, mnist: 4)")
    p.add_argument("--clip-norm", type=float, help="claimed clipping bound C (tiny: 1, mnist: 4)")
    p.add_argument("--clipping", choices=CLIPPINGS,
                   help="clipping groups (tiny: global, mnist: per_layer)")
    p.add_argument("--q", type=float, default=1.0, help="Poisson inclusion probability of the canary")
    p.add_argument("--delta", type=float, default=1e-5, help="δ (default 1e-5)")
    p.add_argument("--trials", type=int, help="trials per mechanism, half with the canary "
                                              "(tiny: 50000, mnist: 20000)")
    p.add_argument("--select-fraction", type=float, default=0.5,
                   help="fraction of trials used only to choose the threshold (default 0.5)")
    p.add_argument("--alpha", type=float, default=0.05, help="1 − confidence (default 0.05)")
    p.add_argument("--canary-norm", type=float, default=10.0,
                   help="canary gradient norm per group, in units of C (default 10)")
    p.add_argument("--accountants", default=DEFAULT_ACCOUNTANTS,
                   help="comma-separated accountants for the claimed ε "
                        f"(default {DEFAULT_ACCOUNTANTS})")
    p.add_argument("--seed", type=int, default=0, help="seed of trials and noise (default 0)")
    p.add_argument("--secure-rng", action="store_true",
                   help="draw the noise from OS entropy (not reproducible)")
    p.add_argument("--threads", type=int, default=1, help="torch threads (default 1)")
    p.add_argument("--json", metavar="PATH", help="also write the results as JSON to PATH")
    return p


def format_result(r: AuditResult) -> str:
    """The one-line summary of one audited mechanism."""
    claimed = "  ".join(f"{k}={v:.3f}" for k, v in r.eps_claimed.items())
    verdict = "VIOLATION (ε_lb > claimed ε)" if r.violation else "consistent (ε_lb ≤ claimed ε)"
    return (f"{r.config['mechanism']:<12} ε_lb={r.eps_lb:6.3f} (point {r.eps_point:6.3f})  "
            f"claimed: {claimed}  FP={r.false_pos}/{r.n_out} FN={r.false_neg}/{r.n_in}  "
            f"{r.seconds:5.1f}s  {verdict}")


def main(argv=None) -> int:
    args = _parser().parse_args(argv)
    d = SETTINGS[args.setting]
    mechanisms = MECHANISMS if args.mechanism == "all" else (args.mechanism,)
    results = []
    try:
        base = dict(threads=args.threads, setting=args.setting,
                    sigma=d["sigma"] if args.sigma is None else args.sigma,
                    clip_norm=d["clip_norm"] if args.clip_norm is None else args.clip_norm,
                    clipping=args.clipping or d["clipping"],
                    trials=d["trials"] if args.trials is None else args.trials,
                    q=args.q, delta=args.delta, select_fraction=args.select_fraction,
                    alpha=args.alpha, canary_norm=args.canary_norm, seed=args.seed,
                    secure_rng=args.secure_rng,
                    accountants=tuple(a for a in args.accountants.split(",") if a))
        configs = [AuditConfig(mechanism=m, **base) for m in mechanisms]
        for c in configs:
            c.validate()
        if args.json and os.path.exists(args.json):
            raise ValueError(f"--json {args.json!r} exists: refusing to overwrite an earlier result")
        print(f"audit: setting={base['setting']} σ={base['sigma']} C={base['clip_norm']} "
              f"clipping={base['clipping']} q={base['q']} δ={base['delta']} trials={base['trials']} "
              f"confidence={1 - base['alpha']:.0%} seed={base['seed']}", flush=True)
        for c in configs:
            r = run_audit(c)
            results.append(r)
            print(format_result(r), flush=True)
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    if args.json:
        with open(args.json, "x") as f:               # never overwrite an earlier result
            json.dump([dict(asdict(r), violation=r.violation) for r in results], f, indent=2)
    return 0

