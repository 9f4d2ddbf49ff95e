"""``python -m dpsgd.audit bound``: the one-run bounds of a score file against a claim.

A pure function of the file and the claim, so scores from any code base (or a simulated game) can
be audited:

    python -m dpsgd.audit bound --scores F.csv --q Q --sigma S --steps T [--groups k]
        [--sampler poisson --N N --L L] --delta D [--beta B] [--game G] [--json]

F.csv has the columns ``included`` (0/1) and ``score`` (higher = more likely in), one row per
randomised canary; a ``game`` column selects the rows of ``--game`` (default ``white-box``).
Methods, each at confidence 1 − β on its own: ``family`` (the verdict: the claim's family as H₀,
``family.py``), ``steinke`` ((ε, δ), ``bounds.audit_bound``), ``gdp`` (μ-GDP, Mahloujifar, Melis
& Chaudhuri 2024) and ``order_stats`` (Xiang et al. 2025, assumes independent canaries: a labelled
heuristic for a real run, not used for the verdict). A bad value ends the command before any work
with one line naming the option and exit status 2.

Details (the score, each method's assumptions): docs/AUDIT.md, "dpsgd/audit/onerun/bound_file.py".
"""

from __future__ import annotations

import argparse
import csv
import json
import sys
from pathlib import Path

import numpy as np

from dpsgd.core.checks import num, typed_number
from dpsgd.core.errors import ConfigError

from .stats.family import Claim, family_test
from .stats.order_stats import order_stats_test
from .stats.bounds import audit_bound
from .stats.simulate import llr_moments

SAMPLERS = ("poisson",)
ASSUMES = {
    "family": "the run is at most as leaky as the claimed mechanism (Poisson-subsampled Gaussian "
    "at q, T lots, k groups) at some noise multiplier σ′ — a test of the claim, not a bound for "
    "every mechanism",
    "steinke": "(ε, δ)-DP with respect to each canary (Steinke, Nasr & Jagielski 2023)",
    "gdp": "μ-GDP with respect to each canary (Mahloujifar, Melis & Chaudhuri 2024); DP-SGD with "
    "subsampling is not exactly GDP, so this is shown, not used for the verdict",
    "order_stats": "the claim's family (as family) AND independent canaries, each observed through "
    "its own copy of the per-canary channel (Xiang et al. 2025, Thm 2): exact for the idealised "
    "game; for a real run, whose canaries share lots and noise-scale estimate, a heuristic — "
    "shown, not used for the verdict",
}


class _Parser(argparse.ArgumentParser):
    def error(self, message):  # one line naming the option, exit status 2
        self.exit(2, f"error: {message}\n")


def _parser() -> argparse.ArgumentParser:
    p = _Parser(
        prog="python -m dpsgd.audit bound",
        description="One-run lower bounds on ε from a score file (columns included, score) against "
        "a claimed DP-SGD mechanism; the verdict is the family test of the claim.",
    )
    p.add_argument("--scores", required=True, help="CSV with columns included (0/1) and score")
    p.add_argument(
        "--q", type=typed_number, help="Poisson sampling rate of the claim (or --N and --L)"
    )
    p.add_argument("--sigma", type=typed_number, required=True, help="claimed noise multiplier σ")
    p.add_argument("--steps", type=typed_number, required=True, help="number of lots T")
    p.add_argument(
        "--groups",
        type=typed_number,
        default=1,
        help="clipping groups k (joint convention; default 1)",
    )
    p.add_argument(
        "--sampler", default="poisson", help="the claimed sampler (only poisson is served)"
    )
    p.add_argument("--N", type=typed_number, help="dataset size: q = L/N")
    p.add_argument("--L", type=typed_number, help="expected lot size: q = L/N")
    p.add_argument("--delta", type=typed_number, required=True, help="δ at which ε is reported")
    p.add_argument("--beta", type=typed_number, default=0.05, help="1 − confidence (default 0.05)")
    p.add_argument(
        "--game",
        default=None,
        help="rows of this game when the file has a game column (default white-box)",
    )
    p.add_argument("--json", action="store_true", help="print one JSON object instead of the table")
    return p


def _claim(a) -> Claim:
    if a.sampler not in SAMPLERS:
        raise ConfigError(
            f"--sampler={a.sampler}: the family test serves {', '.join(SAMPLERS)} lots only"
        )
    q = a.q
    if a.N is not None or a.L is not None:
        if a.N is None or a.L is None:
            raise ConfigError(f"--{'N' if a.N is None else 'L'}: --N and --L go together (q = L/N)")
        n = num("--N", a.N, integer=True, lo=1)
        lots = num("--L", a.L, integer=True, lo=1, hi=n)
        if q is not None and abs(num("--q", q) - lots / n) > 1e-12 * lots / n:
            raise ConfigError(f"--q={q}: disagrees with --L/--N = {lots}/{n}")
        q = lots / n
    if q is None:
        raise ConfigError("--q: required (or --N and --L)")
    return Claim(q, a.sigma, a.steps, a.groups, a.delta).validate(label=lambda name: f"--{name}")


def read_scores(path: str, game: str | None) -> tuple[np.ndarray, np.ndarray]:
    """(scores, bits) from a score file; ConfigError naming ``--scores`` (or ``--game``)."""
    f = Path(path)
    if not f.is_file():
        raise ConfigError(f"--scores={path}: no such file")
    try:
        with open(f, newline="") as fh:
            reader = csv.DictReader(fh)
            rows, cols = list(reader), set(reader.fieldnames or ())
    except (OSError, UnicodeDecodeError, csv.Error) as e:
        raise ConfigError(f"--scores={path}: unreadable ({e})") from None
    for col in ("included", "score"):
        if col not in cols:
            raise ConfigError(f"--scores={path}: no column {col!r} (need included and score)")
    if not rows:
        raise ConfigError(f"--scores={path}: no rows (a header only): one row per canary is needed")
    if "game" in cols:
        want = game or "white-box"
        rows = [r for r in rows if r["game"] == want]
        if not rows:
            raise ConfigError(f"--game={want}: no rows of this game in {path}")
    elif game is not None:
        raise ConfigError(f"--game={game}: {path} has no game column")
    bits, scores = [], []
    for i, r in enumerate(rows, start=2):
        if r["included"] not in ("0", "1"):
            raise ConfigError(
                f"--scores={path}: line {i}: included={r['included']!r}, must be 0 or 1"
            )
        try:
            s = float(r["score"])
        except (TypeError, ValueError):
            raise ConfigError(
                f"--scores={path}: line {i}: score={r['score']!r} is not a number"
            ) from None
        if s != s:
            raise ConfigError(f"--scores={path}: line {i}: score is NaN")
        bits.append(int(r["included"]))
        scores.append(s)
    n_in = sum(bits)
    if n_in in (0, len(bits)):
        raise ConfigError(
            f"--scores={path}: all {len(bits)} canaries have included={bits[0]}: a one-run audit "
            "guesses which canaries were included, so it needs both (each included at random)"
        )
    s = np.array(scores)
    s = np.where(np.isfinite(s), s, np.sign(s) * np.finfo(float).max)  # ±inf: ranked first / last
    return s, np.array(bits)


FEW = 100  # canaries below which a one-run audit has almost no power: its CONSISTENT says little


def few_warning(m: int) -> str | None:
    """A warning line when ``m`` canaries are too few for the verdict to mean much."""
    if m >= FEW:
        return None
    return (
        f"warning: only m={m} canaries: a one-run audit this small can hardly reject any claim "
        f"(its lower bounds stay near 0), so CONSISTENT says little; audits use ≥ {FEW}, typically "
        "1000"
    )


def bound(scores, bits, claim: Claim, beta: float = 0.05) -> dict:
    """Every method's ε_lb on one score file against ``claim`` (module doc);
    the verdict is the family test's."""
    fam = family_test(scores, bits, claim, beta)
    free = audit_bound(scores, bits, claim.delta, beta, gdp=True)
    eps = fam["eps_claimed"]
    out = {
        "m": int(len(bits)),
        "included": int(np.sum(bits)),
        "claim": {
            "q": claim.q,
            "sigma": claim.sigma,
            "steps": claim.steps,
            "groups": claim.groups,
            "sampler": "poisson",
            "convention": "joint",
            "delta": claim.delta,
        },
        "eps_claimed": eps,
        "beta": beta,
        "confidence": 1 - beta,
        "verdict": fam["verdict"],
        "verdict_by": "family",
        "family": {
            "eps_lb": fam["eps_lower_bound"],
            "sigma_upper_bound": fam["sigma_upper_bound"],
            "claim_rejected": fam["claim_rejected"],
            "at_search_floor": fam["at_search_floor"],
            "verdict": fam["verdict"],
            "assumes": ASSUMES["family"],
        },
        "steinke": {
            "eps_lb": free["eps_lower_bound"],
            "k_plus": free["k_plus"],
            "k_minus": free["k_minus"],
            "guesses": free["guesses"],
            "correct": free["correct"],
            "verdict": "violation" if free["eps_lower_bound"] > eps else "consistent",
            "assumes": ASSUMES["steinke"],
        },
        "gdp": {
            "eps_lb": free["gdp_eps_lower_bound"],
            "mu_lb": free["gdp_mu_lower_bound"],
            "verdict": "violation" if free["gdp_eps_lower_bound"] > eps else "consistent",
            "assumes": ASSUMES["gdp"],
        },
    }
    osb = order_stats_test(scores, bits, claim, beta)
    out["order_stats"] = {
        "eps_lb": osb["eps_lower_bound"],
        "sigma_upper_bound": osb["sigma_upper_bound"],
        "claim_rejected": osb["claim_rejected"],
        "at_search_floor": osb["at_search_floor"],
        "verdict": osb["verdict"],
        "grid": osb["grid"],
        "assumes": ASSUMES["order_stats"],
    }
    out["scores"] = score_check(scores, bits, claim)
    return out


def score_check(scores, bits, claim: Claim) -> dict:
    """The interference diagnostic: the excluded (and included) canaries' score mean and variance
    against what the claimed mechanism predicts for the LLR score of ``audit run``
    (``simulate.llr_moments``, no other examples on the canaries' coordinates). ``var_ratio_out`` >
    1: the scores spread more than the claimed noise alone makes them (the other examples'
    gradients, drift); it costs power, never validity — the tests above hold for any score.
    Meaningless for scores of another definition."""
    s, b = np.asarray(scores, dtype=float), np.asarray(bits).astype(bool)
    h0 = llr_moments(claim)
    out = {
        "definition": "LLR of the claimed subsampled Gaussian, summed over lots (audit.score=llr)"
    }
    for name, sel in (("out", ~b), ("in", b)):
        mean, var = h0[name]
        out[name] = {
            "n": int(sel.sum()),
            "mean": float(s[sel].mean()) if sel.any() else None,
            "var": float(s[sel].var()) if sel.sum() > 1 else None,
            "mean_h0": mean,
            "var_h0": var,
        }
    v = out["out"]["var"]
    out["var_ratio_out"] = (
        None if v is None or out["out"]["var_h0"] <= 0 else v / out["out"]["var_h0"]
    )
    return out


def format_bound(r: dict) -> str:
    c = r["claim"]
    lines = [
        f"claim: Poisson q={c['q']:.6g}, σ={c['sigma']:g}, T={c['steps']} lots, k={c['groups']} "
        f"(joint), δ={c['delta']:g} → ε_claimed={r['eps_claimed']:.4f}; m={r['m']} canaries "
        f"({r['included']} in), confidence {r['confidence']:.0%}"
    ]
    f = r["family"]
    sub = (
        "none rejected" if f["sigma_upper_bound"] is None else f"σ′ ≤ {f['sigma_upper_bound']:.4g}"
    )
    lines.append(
        f"family   ε_lb={f['eps_lb']:.4f} ({sub}; claim "
        f"{'REJECTED' if f['claim_rejected'] else 'not rejected'})  assumes: {f['assumes']}"
    )
    s = r["steinke"]
    lines.append(
        f"steinke  ε_lb={s['eps_lb']:.4f} ({s['correct']}/{s['guesses']} correct)  assumes: "
        f"{s['assumes']}"
    )
    g = r["gdp"]
    lines.append(
        f"gdp      ε_lb={g['eps_lb']:.4f} (μ_lb={g['mu_lb']:.4f})  assumes: {g['assumes']}"
    )
    o = r["order_stats"]
    sub = (
        "none rejected" if o["sigma_upper_bound"] is None else f"σ′ ≤ {o['sigma_upper_bound']:.4g}"
    )
    lines.append(
        f"order_stats ε_lb={o['eps_lb']:.4f} ({sub}; claim "
        f"{'rejected' if o['claim_rejected'] else 'not rejected'})  assumes: {o['assumes']}"
    )
    sc = r["scores"]
    if sc["var_ratio_out"] is not None:
        lines.append(
            f"excluded canaries' score variance {sc['out']['var']:.4g} against "
            f"{sc['out']['var_h0']:.4g} predicted by the claim for the LLR score (ratio "
            f"{sc['var_ratio_out']:.3f}; > 1: interference)"
        )
    lines.append(f"verdict (family test of the claim): {r['verdict'].upper()}")
    return "\n".join(lines)


def main(argv=None) -> int:
    a = _parser().parse_args(argv)
    try:
        claim = _claim(a)
        beta = num("--beta", a.beta, lo=0, lo_open=True, hi=0.5)
        scores, bits = read_scores(a.scores, a.game)
    except (ConfigError, ValueError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    r = bound(scores, bits, claim, beta)
    r["scores_file"] = a.scores
    warn = few_warning(len(bits))
    if warn:
        r["warning"] = warn
        print(warn, file=sys.stderr)
    if a.json:
        print(json.dumps(r, allow_nan=False))
    else:
        print(f"audit bound: {a.scores}")
        print(format_bound(r))
    return 0
