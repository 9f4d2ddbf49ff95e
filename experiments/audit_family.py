"""The family test of the claim on the committed one-run audits (no training): every run under
results/runs/audit/ rescored from its own audit_scores.csv (white-box game) against the claim for its
lots, beside the family-free bounds of the same scores.

    python -m experiments.audit_family          # results/audit_family.csv

Each row is ``dpsgd.audit.bound.bound`` on the run's white-box scores with the run's q = L/N, σ, lots,
k groups and δ (audit.json ``run``), at β = audit.beta / (games in the run), the confidence of each game
in ``audit run``. ``eps_claimed_lots`` is the claim for the lots alone (gradient canaries never see the
DP-PCA release); ``eps_claimed`` the run's whole valid ε. Runs whose lots are not Poisson are skipped
(the family is the Poisson-subsampled Gaussian).
"""
from __future__ import annotations

import json
import time

import pandas as pd

from experiments.paths import RESULTS

RUNS = RESULTS / "runs" / "audit"


def measure(out=RESULTS / "audit_family.csv") -> pd.DataFrame:
    from dpsgd.audit.bound import bound, read_scores
    from dpsgd.audit.family import Claim
    rows = []
    for run in sorted(p for p in RUNS.iterdir() if (p / "audit_scores.csv").is_file()):
        a = json.loads((run / "audit.json").read_text())
        r = a["run"]
        if r["sampling"] != "poisson":
            continue
        beta = a["options"]["beta"] / len(a["games"])
        claim = Claim(r["L"] / r["N"], r["sigma"], r["steps"], r["groups"], a["delta"]).validate()
        scores, bits = read_scores(str(run / "audit_scores.csv"), "white-box")
        t = time.perf_counter()
        b = bound(scores, bits, claim, beta)
        lots = b["eps_claimed"]
        rows.append({"audit": run.name, "variant": a["variant"], "sigma": r["sigma"], "lots": r["steps"],
                     "groups": r["groups"], "q": round(claim.q, 6), "m": b["m"], "delta": a["delta"], "beta": beta,
                     "eps_claimed": round(a["eps_claimed"], 4), "eps_claimed_lots": round(lots, 4),
                     "family_eps_lb": round(b["family"]["eps_lb"], 4),
                     "family_sigma_ub": None if b["family"]["sigma_upper_bound"] is None
                     else round(b["family"]["sigma_upper_bound"], 4),
                     "family_ratio_lots": round(b["family"]["eps_lb"] / lots, 3),
                     "verdict_family": b["verdict"],
                     "steinke_eps_lb": round(b["steinke"]["eps_lb"], 4),
                     "steinke_ratio_lots": round(b["steinke"]["eps_lb"] / lots, 3),
                     "gdp_eps_lb": round(b["gdp"]["eps_lb"], 4),
                     "gdp_ratio_lots": round(b["gdp"]["eps_lb"] / lots, 3),
                     "verdict_steinke_vs_whole_claim": a["verdict"],
                     "seconds": round(time.perf_counter() - t, 1)})
        print(rows[-1], flush=True)
        pd.DataFrame(rows).to_csv(out, index=False)
    return pd.DataFrame(rows)


if __name__ == "__main__":
    measure()
