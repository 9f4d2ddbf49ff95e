"""audit.json and audit_scores.csv of a one-run audit: claim, heuristic, games, verdict.

The claim is the audited run's own valid ε (privacy.json ``epsilon_valid``), for the dataset with
the canaries in it; for lots that are not Poisson (``shuffle``), the ε a Poisson analysis would
(wrongly) claim is reported beside it with its own verdict. Each game's lower bound is computed at
β/g (g games, Bonferroni); ``eps_lower_bound`` is the largest, and ``verdict`` compares it with the
claim (family-free, Steinke et al.). Each game also reports the Gaussian-DP one-run bound
(``gdp_mu_lower_bound``, ``gdp_eps_lower_bound``): shown, not used for the verdict.

The white-box game is also tested against the claim's family (``family.py``: the ``family`` block,
``eps_claimed_lots``, ``verdict_family``), and beside it the order-statistics bound
(``order_stats``, ``order_stats.py``), a labelled heuristic unless
``audit.placement=null_space`` and ``audit.normalise=claimed`` on Poisson lots make the canaries
independent (docs/AUDIT_MATH.md §6; ``independence``). ``interference``: the excluded canaries'
score variance against the claimed channel's prediction.

Details (each block of audit.json): docs/AUDIT.md, "dpsgd/audit/onerun/report.py".
"""

from __future__ import annotations

import csv
import io
import json
from dataclasses import asdict
from pathlib import Path

import numpy as np

from dpsgd.accountant import Ledger
from dpsgd.accountant.events import Poisson
from dpsgd.core.fileio import atomic_write_text, write_json
from dpsgd.mechanism.pca import charge_pca

from .stats.family import Claim, family_test, tradeoff
from .stats.order_stats import order_stats_test, rejects as order_stats_rejects
from .stats.bounds import audit_bound, check_scores, default_grid, fdp_rejected, guess_counts
from .bound_file import score_check
from .stats.noise_check import noise_test

AUDIT, SCORES = "audit.json", "audit_scores.csv"


def _summary(scores: np.ndarray, bits: np.ndarray) -> dict:
    def stats(s):
        return {
            "n": int(len(s)),
            "mean": float(np.mean(s)) if len(s) else None,
            "sd": float(np.std(s)) if len(s) > 1 else None,
        }

    return {"in": stats(scores[bits]), "out": stats(scores[~bits])}


def _game(name: str, scores, bits, delta: float, beta: float, how: str) -> dict:
    scores, bits = np.asarray(scores, dtype=float), np.asarray(bits, dtype=bool)
    scores = np.where(np.isfinite(scores), scores, np.sign(scores) * np.finfo(float).max)
    b = audit_bound(scores, bits, delta, beta, gdp=True)
    return {
        "game": name,
        "scored_by": how,
        "m": int(len(bits)),
        "included": int(bits.sum()),
        "beta": beta,
        "confidence": 1 - beta,
        **b,
        "scores": _summary(scores, bits),
    }


FAMILY_ASSUMES = (
    "the run is at most as leaky as its lots' claimed mechanism (Poisson-subsampled Gaussian at "
    "q = L/N, the run's lots, k groups, joint convention) at some noise multiplier σ′: a test of "
    "the claim, not a bound for every mechanism"
)


ORDER_STATS_ASSUMES = (
    "as the family test, and independent canaries, each observed through its own copy of the "
    "per-canary channel (Xiang et al. 2025, Thm 2)"
)
INDEPENDENCE_PROVED = "independent canaries: proved (null-space placement, claimed normalisation)"
INDEPENDENCE_HEURISTIC = (
    "heuristic for a real run (canaries share it); exact for the idealised game"
)


def independence_proved(options, sampling: str) -> bool:
    """The conditions of docs/AUDIT_MATH.md §6: every canary on its own class-sum direction of the
    softmax output layer (no Dirac coordinate), z in units of the claimed σC, Poisson lots."""
    return (
        getattr(options, "placement", "dirac") == "null_space"
        and getattr(options, "normalise", "measured") == "claimed"
        and sampling == "poisson"
    )


def family_block(
    scores,
    bits,
    config: dict,
    final: dict,
    beta: float,
    proved: bool = False,
    groups_used: int | None = None,
) -> dict | None:
    """The family test of the white-box game against the run's lots (module doc); None when the lots
    are not Poisson (the family knows the Poisson-subsampled Gaussian only) or no lot ran."""
    s = final["sampling"]
    if s["name"] != "poisson" or not final["steps"]:
        return None
    claim = Claim(
        s["L"] / s["N"], config["privacy"]["sigma"], final["steps"], final["k"], final["delta"]
    ).validate()
    scores = np.asarray(scores, dtype=float)
    scores = np.where(np.isfinite(scores), scores, np.sign(scores) * np.finfo(float).max)
    f = family_test(scores, np.asarray(bits, dtype=int), claim, beta)
    osb = order_stats_test(scores, np.asarray(bits, dtype=int), claim, beta)
    own = Claim(
        claim.q, claim.sigma, claim.steps, groups_used or claim.groups, claim.delta
    ).validate()
    sc = score_check(scores, bits, own)
    channel = None if own.groups == claim.groups else channel_block(scores, bits, own, beta, proved)
    return {
        "assumes": FAMILY_ASSUMES,
        "claim": {
            "q": claim.q,
            "sigma": claim.sigma,
            "steps": claim.steps,
            "groups": claim.groups,
            "delta": claim.delta,
        },
        "eps_claimed_lots": f["eps_claimed"],
        "sigma_upper_bound": f["sigma_upper_bound"],
        "eps_lower_bound": f["eps_lower_bound"],
        "at_search_floor": f["at_search_floor"],
        "claim_rejected": f["claim_rejected"],
        "beta": beta,
        "confidence": 1 - beta,
        "verdict_family": f["verdict"],
        "order_stats": {
            "assumes": ORDER_STATS_ASSUMES
            if not proved
            else f"as the family test; {INDEPENDENCE_PROVED} (docs/AUDIT_MATH.md §6)",
            "sigma_upper_bound": osb["sigma_upper_bound"],
            "eps_lower_bound": osb["eps_lower_bound"],
            "at_search_floor": osb["at_search_floor"],
            "claim_rejected": osb["claim_rejected"],
            "grid": osb["grid"],
            "label": INDEPENDENCE_PROVED if proved else INDEPENDENCE_HEURISTIC,
            "independence": "proved" if proved else "heuristic",
        },
        "interference": {
            "channel_groups": own.groups,
            "out_var": sc["out"]["var"],
            "out_var_h0": sc["out"]["var_h0"],
            "out_var_ratio": sc["var_ratio_out"],
            "note": "excluded canaries' score variance / the claimed channel's (k_used groups); "
            "> 1: the other examples' gradients reach the canaries",
        },
        **({} if channel is None else {"channel": channel}),
    }


def channel_block(scores, bits, own: Claim, beta: float, proved: bool) -> dict:
    """The canaries' own channel tested at the run's σ,
    when they use k_used < k of the claim's groups.

    Under the mechanism the ledger charges (each group clipped at C, noise σC, Poisson q), a canary
    with entries in k_used groups sees exactly the claim with k_used groups at σ (docs/AUDIT_MATH.md
    §6), which is less leaky than the k-group claim; H₀: "the canaries' channel is at most as leaky
    as that". A rejection means the run is not the mechanism it charges for (e.g. a group clipped
    looser than C), though the canaries alone may not exceed the whole claim's ε. Same scores, same
    β as the family block; the order-statistics test counts only where independence is proved."""
    s, b = check_scores(scores, bits)
    rows = guess_counts(s, b.astype(int), default_grid(s.size))
    per = beta / len(rows)
    f = tradeoff(own.q, own.sigma_eff(own.sigma), own.steps)
    fam = any(fdp_rejected(f, r["guesses"], r["correct"], s.size, per) for r in rows)
    osr = bool(order_stats_rejects(s, b, own, beta))
    return {
        "assumes": "the mechanism as charged, per group: the claim with the canaries' k_used "
        "groups at the run's σ",
        "groups": own.groups,
        "eps_channel": own.epsilon(),
        "family_rejected": bool(fam),
        "order_stats_rejected": osr,
        "order_stats_counts": proved,
        "verdict_channel": "violation" if fam or (proved and osr) else "consistent",
    }


def poisson_claim(config: dict, final: dict) -> float:
    """The ε a Poisson analysis would claim for this run's schedule (q = L/N, σ, the run's lots, k)
    with its DP-PCA release, all under add/remove adjacency; PLD, joint convention."""
    s, p, m = final["sampling"], config["privacy"], config["model"]
    led = Ledger()
    if m.get("projection") == "pca":
        charge_pca(led, p["sigma_p"], p["pca_fraction"])
    led.record(Poisson(s["L"] / s["N"], p["sigma"], final["k"]), final["steps"], "as-if-poisson")
    return float(led.epsilon(final["delta"], accountant="pld", convention="joint")[0])


GAMES = {
    "white-box": (
        "white-box: gradient canaries, every iterate",
        "{score} of the released noisy sums on each canary's coordinates (observe.py)",
    ),
    "black-box": (
        "black-box: input canaries, final model",
        "logit margin of the canary's (wrong) label under the released model",
    ),
}


def scores_and_bits(inst) -> dict:
    """{game: (scores, bits)} of the audited run, numpy; computed once per instrument."""
    if getattr(inst, "scored", None) is None:
        o, out = inst.options, {}
        if o.gradient_canaries:
            out["white-box"] = (
                inst.observer.scores(o.score).numpy(),
                inst.draw.gradient_in.numpy(),
            )
        if o.input_canaries:
            out["black-box"] = (inst.input_scores().numpy(), inst.draw.input_in.numpy())
        inst.scored = out
    return inst.scored


def audit_report(
    config: dict,
    options,
    label: dict,
    scored: dict,
    groups_used: int,
    final: dict,
    seconds: float,
    placed: dict | None = None,
    sumsq=None,
) -> dict:
    """The audit.json of an audited run: ``scored`` {game: (scores, bits)}, ``final`` its
    privacy.json, ``config`` its resolved configuration (a dict),
    ``options`` its ``AuditOptions``."""
    from dpsgd.accountant.last_iterate import last_iterate_epsilon

    o, delta = options, final["delta"]
    beta = o.beta / len(scored)
    games = [
        _game(GAMES[kind][0], scores, bits, delta, beta, GAMES[kind][1].format(score=o.score))
        for kind, (scores, bits) in scored.items()
    ]
    s, sigma = final["sampling"], config["privacy"]["sigma"]
    claimed = final["epsilon_valid"]
    lb = max(g["eps_lower_bound"] for g in games)
    out = {
        "kind": "one-run privacy audit (Steinke, Nasr & Jagielski 2023)",
        "audit_run": label,
        "variant": o.variant,
        "options": asdict(o),
        "eps_claimed": claimed,
        "delta": delta,
        "claim": final["statement"],
        "eps_lower_bound": lb,
        "confidence": 1 - o.beta,
        "verdict": "violation" if claimed is not None and lb > claimed else "consistent",
        "games": games,
        "eps_last_iterate_heuristic": last_iterate_epsilon(
            s["L"] / s["N"], sigma, final["steps"], delta, groups=final["k"]
        ),
        "heuristic_note": "Steinke et al. 2025 (The Last Iterate Advantage): ε of an adversary who "
        "sees only the final model of a linear-loss run, at q = L/N; a heuristic, not a guarantee",
        "run": _run_block(final, sigma, o, groups_used, placed),
        "seconds": round(seconds, 1),
        "config": config,
    }
    _add_tests(out, scored, config, final, o, beta, groups_used, sumsq, lb)
    return out


def _run_block(final: dict, sigma: float, o, groups_used: int, placed: dict | None) -> dict:
    """The "run" block of audit.json: the audited run's schedule, σ and canary placement."""
    s = final["sampling"]
    return {
        "steps": final["steps"],
        "epochs": final["epochs"],
        "sampling": s["name"],
        "N": s["N"],
        "L": s["L"],
        "q": s["q"],
        "sigma": sigma,
        "groups": final["k"],
        "status": final["status"],
        "canary_groups_used": groups_used,
        "canary_placement": placed
        or {
            "placement": getattr(o, "placement", "dirac"),
            "normalise": getattr(o, "normalise", "measured"),
        },
    }


def _add_tests(out: dict, scored, config, final, o, beta, groups_used, sumsq, lb) -> None:
    """The family verdict, the noise test and the as-if-Poisson verdict, where they apply."""
    s = final["sampling"]
    if "white-box" in scored:
        fam = family_block(
            *scored["white-box"],
            config,
            final,
            beta,
            independence_proved(o, s["name"]),
            groups_used,
        )
        if fam is not None:
            out["family"] = fam
            out["verdict_family"] = fam["verdict_family"]
    if sumsq is not None and "white-box" in scored:
        nt = noise_test(
            sumsq, scored["white-box"][1], final["steps"], beta, independence_proved(o, s["name"])
        )
        if nt is not None:
            out["noise_test"] = nt
    if s["name"] != "poisson":
        eps_p = poisson_claim(config, final)
        out["eps_claimed_as_if_poisson"] = eps_p
        out["verdict_as_if_poisson"] = "violation" if lb > eps_p else "consistent"


def read_scores(run_dir: Path) -> dict:
    """{game: (scores, bits)} from an audit's audit_scores.csv."""
    out: dict = {}
    with open(run_dir / SCORES, newline="") as f:
        for row in csv.DictReader(f):
            out.setdefault(row["game"], ([], []))
            out[row["game"]][0].append(float(row["score"]))
            out[row["game"]][1].append(row["included"] == "1")
    return {k: (np.array(v[0]), np.array(v[1], dtype=bool)) for k, v in out.items()}


def read_sumsq(run_dir: Path):
    """The white-box canaries' Σ_t z² from audit_scores.csv (column ``sumsq``), or None
    (older audits)."""
    with open(run_dir / SCORES, newline="") as f:
        rows = [r for r in csv.DictReader(f) if r["game"] == "white-box"]
    if not rows or not rows[0].get("sumsq"):
        return None
    return np.array([float(r["sumsq"]) for r in rows])


def rescore(run_dir: Path, beta: float | None = None) -> dict:
    """audit.json recomputed from the files of a finished audit (audit_scores.csv, privacy.json and
    the old audit.json's options): a re-analysis without rerunning;
    ``beta`` replaces the confidence."""
    from .instrument import AuditOptions

    old = json.loads((run_dir / AUDIT).read_text())
    options = AuditOptions(**old["options"])
    if beta is not None:
        options.beta = beta
    options.validate()
    final = json.loads((run_dir / "privacy.json").read_text())
    return audit_report(
        old["config"],
        options,
        old["audit_run"],
        read_scores(run_dir),
        old["run"]["canary_groups_used"],
        final,
        old["seconds"],
        old["run"].get("canary_placement"),
        read_sumsq(run_dir),
    )


def write_report(run_dir: Path, scored: dict, report: dict, sumsq=None) -> None:
    """audit.json, audit_scores.csv (every canary's bit and score; ``sumsq``: the white-box
    canaries' Σ_t z²) and one console line."""
    buf = io.StringIO()
    w = csv.writer(buf, lineterminator="\n")
    w.writerow(["game", "canary", "included", "score"] + (["sumsq"] if sumsq is not None else []))
    for kind, (scores, bits) in scored.items():
        for i, (b, sc) in enumerate(zip(bits.tolist(), scores.tolist())):
            # Σ_t z² belongs to the white-box (gradient) canaries only: their count may differ from
            # the input canaries' (audit.gradient_canaries, audit.input_canaries)
            extra = (
                [] if sumsq is None else [repr(float(sumsq[i]))] if kind == "white-box" else [""]
            )
            w.writerow([kind, i, int(b), repr(sc)] + extra)
    atomic_write_text(
        run_dir / SCORES, buf.getvalue()
    )  # the scores first: the evidence, whatever follows
    write_json(run_dir / AUDIT, report)
    print("\n".join(console_lines(report, run_dir / AUDIT)), flush=True)


def console_lines(report: dict, path) -> list[str]:
    """What an audit prints: the verdict first, then one line per test saying what it tests."""
    claimed, tests = report["eps_claimed"], []
    games = ", ".join(
        f"{g['game'].split(':')[0]} ε_lb = {g['eps_lower_bound']:.3f} ({g['correct']}/"
        f"{g['guesses']} correct)"
        for g in report["games"]
    )
    tests.append(("family-free lower bound (Steinke, Nasr & Jagielski 2023; valid whatever the "
                  f"mechanism): {games}", report["verdict"]))  # fmt: skip
    fam = report.get("family")
    if fam is not None:
        tests.append((
            "family test (valid if the mechanism is the claimed subsampled Gaussian): ε_lb = "
            f"{fam['eps_lower_bound']:.3f} against the lots' {fam['eps_claimed_lots']:.3f}",
            fam["verdict_family"],
        ))  # fmt: skip
        ratio = fam["interference"]["out_var_ratio"]
        tests.append((
            f"order statistics ({fam['order_stats']['independence']}): ε_lb = "
            f"{fam['order_stats']['eps_lower_bound']:.3f}; excluded canaries' score variance / "
            f"claim's: {float('nan') if ratio is None else ratio:.3f}",
            None,
        ))  # fmt: skip
        if "channel" in fam:
            ch = fam["channel"]
            tests.append((
                f"the canaries' own channel ({ch['groups']} of {fam['claim']['groups']} groups): "
                f"ε = {ch['eps_channel']:.3f}",
                ch["verdict_channel"],
            ))  # fmt: skip
    nt = report.get("noise_test")
    if nt is not None:
        tests.append((
            f"noise along the canaries / claimed σC: {nt['noise_ratio']:.3f} (at most "
            f"{nt['noise_ratio_upper']:.3f} allowed, {'exact' if nt['exact'] else 'conservative'} "
            "test)",
            nt["verdict"],
        ))  # fmt: skip
    failed = [t for t, v in tests if v == "violation"]
    verdict = "VIOLATION" if failed else "CONSISTENT"
    claim = "no claim" if claimed is None else f"the claim ε = {claimed:.3f}"
    delta = report.get("delta")
    head = (
        f"audit [{report['variant']}]: {verdict} {'of' if failed else 'with'} {claim}"
        + ("" if delta is None else f" at δ = {delta:g}")
        + (f" ({len(failed)} of {sum(v is not None for _, v in tests)} tests reject it)"
           if failed else f" (all {sum(v is not None for _, v in tests)} tests pass)")
    )  # fmt: skip
    lines = [head]
    lines += [f"  {'' if v is None else v.upper() + ': '}{t}" for t, v in tests]
    lines.append(f"  heuristic, not a test: last-iterate ε = "
                 f"{report['eps_last_iterate_heuristic']:.3f} (Steinke et al. 2025)")  # fmt: skip
    lines.append(f"  {path}")
    return lines
