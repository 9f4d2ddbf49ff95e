"""Command line of the audit: ``python -m dpsgd.audit --help``.

Every bad value is refused as one line ``error: --<option>=<value>: <why>`` with exit status 2
before any trial runs, checked as training checks its config (``AuditConfig.validate``: finite
numbers in range, integers, names from their lists); argparse's own refusals (an unknown option or
choice, a missing value) are one ``error: argument --<option>: ...`` line, status 2, too. ``--json``
names a new file in an existing, writable folder (checked before any work) and never overwrites an
earlier result; it is strict JSON, an infinite ε written as ``null`` and named under ``infinite``.
One line per mechanism: ε_lb (and the point estimate), the claimed ε of each accountant, the
held-out error counts, the time, and the verdict.
"""

from __future__ import annotations

import argparse
import math
import os
import sys
from dataclasses import asdict
from pathlib import Path

from dpsgd.accountant.limits import DELTA_DEFAULT
from dpsgd.core.checks import typed_number
from dpsgd.core.fileio import write_json

from .play import run_audit
from .settings import CLIPPINGS, MECHANISMS, SETTING_MECHANISMS, SETTINGS, AuditConfig, AuditResult

DEFAULT_ACCOUNTANTS = ",".join(AuditConfig.accountants)


class _Parser(argparse.ArgumentParser):
    def error(self, message):  # one line naming the option, exit status 2
        self.exit(2, f"error: {message}\n")


def _option(field: str) -> str:
    """The command-line option of an ``AuditConfig`` field: clip_norm → --clip-norm."""
    return "--" + field.replace("_", "-")


def _parser() -> argparse.ArgumentParser:
    p = _Parser(
        prog="python -m dpsgd.audit",
        description="Empirical privacy audit of one DP-SGD step: a gradient canary, the "
        "distinguishing game D = ∅ vs D' = {canary} on the real DPSGD/clipper/noise "
        "code, and a 95 % Clopper–Pearson lower bound on ε next to the accountant's ε.",
        epilog="Examples: python -m dpsgd.audit --mechanism all  |  "
        "python -m dpsgd.audit --setting mnist --sigma 4 --trials 20000",
    )
    p.add_argument(
        "--setting",
        choices=sorted(SETTINGS),
        default="tiny",
        help="tiny: vectorised one-feature models (fast); mnist: the paper's "
        "PCA-60 → 1000 → 10 network, per-layer clipping; mnist_other: the same with a "
        "known other example in every lot, scored by the release's size (realised_lot) "
        "(default: tiny)",
    )
    p.add_argument(
        "--mechanism",
        choices=MECHANISMS + ("all",),
        default="all",
        help="mechanism under audit; no_clip and noise_div10 are deliberately broken "
        "(default: all three)",
    )
    p.add_argument(
        "--sigma", type=typed_number, help="claimed noise multiplier σ (tiny: 2, mnist: 4)"
    )
    p.add_argument(
        "--clip-norm", type=typed_number, help="claimed clipping bound C (tiny: 1, mnist: 4)"
    )
    p.add_argument(
        "--clipping", choices=CLIPPINGS, help="clipping groups (tiny: global, mnist: per_layer)"
    )
    p.add_argument(
        "--q", type=typed_number, default=1.0, help="Poisson inclusion probability of the canary"
    )
    p.add_argument(
        "--delta", type=typed_number, default=DELTA_DEFAULT, help=f"δ (default {DELTA_DEFAULT:g})"
    )
    p.add_argument(
        "--trials",
        type=typed_number,
        help="trials per mechanism, half with the canary (tiny: 50000, mnist: 20000)",
    )
    p.add_argument(
        "--select-fraction",
        type=typed_number,
        default=0.5,
        help="fraction of trials used only to choose the threshold (default 0.5)",
    )
    p.add_argument("--alpha", type=typed_number, default=0.05, help="1 − confidence (default 0.05)")
    p.add_argument(
        "--canary-norm",
        type=typed_number,
        default=10.0,
        help="canary gradient norm per group, in units of C (default 10)",
    )
    p.add_argument(
        "--accountants",
        default=DEFAULT_ACCOUNTANTS,
        help=f"comma-separated accountants for the claimed ε (default {DEFAULT_ACCOUNTANTS})",
    )
    p.add_argument(
        "--seed", type=typed_number, default=0, help="seed of trials and noise (default 0)"
    )
    p.add_argument(
        "--secure-rng",
        action="store_true",
        help="draw the noise from OS entropy (not reproducible)",
    )
    p.add_argument("--threads", type=typed_number, default=1, help="torch threads (default 1)")
    p.add_argument("--json", metavar="PATH", help="also write the results as JSON to PATH")
    return p


def format_result(r: AuditResult) -> str:
    """The one-line summary of one audited mechanism."""
    claimed = "  ".join(f"{k}={v:.3f}" for k, v in r.eps_claimed.items())
    verdict = "VIOLATION (ε_lb > claimed ε)" if r.violation else "consistent (ε_lb ≤ claimed ε)"
    return (
        f"{r.config['mechanism']:<12} ε_lb={r.eps_lb:6.3f} (point {r.eps_point:6.3f})  "
        f"claimed: {claimed}  FP={r.false_pos}/{r.n_out} FN={r.false_neg}/{r.n_in}  "
        f"{r.seconds:5.1f}s  {verdict}"
    )


def _configs(args) -> list[AuditConfig]:
    """One checked ``AuditConfig`` per mechanism; ValueError naming the first bad option."""
    d = SETTINGS[args.setting]
    mechanisms = SETTING_MECHANISMS[args.setting] if args.mechanism == "all" else (args.mechanism,)
    base = dict(
        threads=args.threads,
        setting=args.setting,
        sigma=d["sigma"] if args.sigma is None else args.sigma,
        clip_norm=d["clip_norm"] if args.clip_norm is None else args.clip_norm,
        clipping=args.clipping or d["clipping"],
        trials=d["trials"] if args.trials is None else args.trials,
        q=args.q,
        delta=args.delta,
        select_fraction=args.select_fraction,
        alpha=args.alpha,
        canary_norm=args.canary_norm,
        seed=args.seed,
        secure_rng=args.secure_rng,
        accountants=tuple(a.strip() for a in args.accountants.split(",") if a.strip()),
    )
    configs = [AuditConfig(mechanism=m, **base) for m in mechanisms]
    for c in configs:
        c.validate(label=_option)
    return configs


def check_json_path(path: str) -> Path:
    """``--json PATH``: a new file in an existing, writable folder, checked before the audit runs so
    a finished audit's result is never lost; ValueError naming ``--json`` otherwise."""
    out = Path(path)
    folder = out.parent
    if os.path.lexists(out):
        raise ValueError(f"--json={path}: exists; refusing to overwrite an earlier result")
    if not folder.is_dir():
        raise ValueError(f"--json={path}: no such folder {str(folder)!r} (create it first)")
    if not os.access(folder, os.W_OK | os.X_OK):
        raise ValueError(f"--json={path}: folder {str(folder)!r} is not writable")
    return out


def result_json(r: AuditResult) -> dict:
    """One audited mechanism as strict JSON: an infinite ε (no false positives held out) is written
    as null and its field named under ``infinite``."""
    row = dict(asdict(r), violation=r.violation)
    infinite = [k for k in ("eps_lb", "eps_point") if not math.isfinite(row[k])]
    infinite += [f"eps_claimed.{k}" for k, v in row["eps_claimed"].items() if not math.isfinite(v)]
    for k in ("eps_lb", "eps_point"):
        row[k] = row[k] if math.isfinite(row[k]) else None
    row["eps_claimed"] = {k: v if math.isfinite(v) else None for k, v in row["eps_claimed"].items()}
    row["infinite"] = infinite
    return row


def main(argv=None) -> int:
    args = _parser().parse_args(argv)
    results = []
    try:
        configs = _configs(args)
        out = check_json_path(args.json) if args.json else None
        base = configs[0]
        print(
            f"audit: setting={base.setting} σ={base.sigma} C={base.clip_norm} "
            f"clipping={base.clipping} q={base.q} δ={base.delta} trials={base.trials} "
            f"confidence={1 - base.alpha:.0%} seed={base.seed}",
            flush=True,
        )
        for c in configs:
            r = run_audit(c)
            results.append(r)
            print(format_result(r), flush=True)
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    if out is not None:
        rows = [result_json(r) for r in results]
        try:
            write_json(out, rows, exclusive=True)  # never overwrites an earlier result
        except OSError as e:
            from dpsgd.core.fileio import json_text

            print(
                f"error: --json={args.json}: {e.strerror or e}; the results follow on stdout",
                file=sys.stderr,
            )
            print(json_text(rows))
            return 1
    return 0
