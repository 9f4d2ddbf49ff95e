"""The family test of the claim on the committed one-run audits (no training): every run under
results/runs/audit/ rescored from its own audit_scores.csv (white-box game) against the claim for
its lots, beside the family-free bounds of the same scores.

    python -m experiments.audit_family                 # results/audit_family.csv
    # results/audit_family_seeds.csv (trains, minutes)
    python -m experiments.audit_family seeds [--n 20]

Each row is ``dpsgd.audit.onerun.bound_file.bound`` on the run's white-box scores with the run's q =
L/N, σ, lots, k groups and δ (audit.json ``run``), at β = audit.beta / (games in the run), the
confidence of each game in ``audit run``. ``eps_claimed_lots`` is the claim for the lots alone
(gradient canaries never see the DP-PCA release); ``eps_claimed`` the run's whole valid ε. Runs
whose lots are not Poisson are skipped (the family is the Poisson-subsampled Gaussian).

``seeds``: the real trainer, seeded: ``--n`` audits of the correct mechanism on a small
configuration (300 real MNIST images, 2000 gradient canaries, L = 300, 48 lots, σ = 3, k = 2: the
configuration of tests/audit/test_audit_run.py), audit.seed = training seed = 0..n−1, each with its
family test and the family-free bound; then the same seeds with noise_per_rank (R = 4, noise σC/2).
A correct run may be flagged with probability ≤ β = 0.05 per audit.
"""

from __future__ import annotations

import json
import time

import pandas as pd

from experiments.paths import RESULTS

RUNS = RESULTS / "runs" / "audit"


def measure(out=RESULTS / "audit_family.csv") -> pd.DataFrame:
    from dpsgd.audit.onerun.bound_file import bound, read_scores
    from dpsgd.audit.onerun.stats.family import Claim

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
        rows.append(
            {
                "audit": run.name,
                "variant": a["variant"],
                "sigma": r["sigma"],
                "lots": r["steps"],
                "groups": r["groups"],
                "q": round(claim.q, 6),
                "m": b["m"],
                "delta": a["delta"],
                "beta": beta,
                "eps_claimed": round(a["eps_claimed"], 4),
                "eps_claimed_lots": round(lots, 4),
                "family_eps_lb": round(b["family"]["eps_lb"], 4),
                "family_sigma_ub": None
                if b["family"]["sigma_upper_bound"] is None
                else round(b["family"]["sigma_upper_bound"], 4),
                "family_ratio_lots": round(b["family"]["eps_lb"] / lots, 3),
                "verdict_family": b["verdict"],
                "steinke_eps_lb": round(b["steinke"]["eps_lb"], 4),
                "steinke_ratio_lots": round(b["steinke"]["eps_lb"] / lots, 3),
                "gdp_eps_lb": round(b["gdp"]["eps_lb"], 4),
                "gdp_ratio_lots": round(b["gdp"]["eps_lb"] / lots, 3),
                "verdict_steinke_vs_whole_claim": a["verdict"],
                "out_score_var": round(b["scores"]["out"]["var"], 5),
                "out_score_var_h0": round(b["scores"]["out"]["var_h0"], 5),
                "out_var_ratio": round(b["scores"]["var_ratio_out"], 4),
                "seconds": round(time.perf_counter() - t, 1),
            }
        )
        print(rows[-1], flush=True)
        pd.DataFrame(rows).to_csv(out, index=False)
    return pd.DataFrame(rows)


TINY = [
    "dataset.subset=300",
    "privacy.lot_size=300",
    "model.hidden=[200]",
    "model.pca_dims=10",
    "training.epochs=6",
    "device=cpu",
    "privacy.sigma=3",
    "privacy.sigma_p=20",
    "training.eval_batch_size=1000",
]


def seeds(n: int, out=RESULTS / "audit_family_seeds.csv") -> pd.DataFrame:
    import os
    from dataclasses import asdict

    from dpsgd.audit.onerun.instrument import AuditOptions
    from dpsgd.audit.onerun.run import ENV, audit_train
    from dpsgd.config.schema import validate
    from dpsgd.launch.cli import compose
    from experiments.paths import ROOT

    rows = []
    for variant in ("correct", "noise_per_rank"):
        for seed in range(n):
            o = AuditOptions(
                gradient_canaries=2000, input_canaries=0, variant=variant, ranks=4, seed=seed
            ).validate()
            os.environ[ENV] = json.dumps(asdict(o))
            overrides = TINY + [f"seed={seed}"]
            run_dir = ROOT / "outputs" / "audit_family_seeds" / f"{variant}_seed{seed}"
            t = time.perf_counter()
            audit_train(validate(compose(overrides)), run_dir, overrides)
            a = json.loads((run_dir / "audit.json").read_text())
            f = a["family"]
            rows.append(
                {
                    "variant": variant,
                    "seed": seed,
                    "sigma": a["run"]["sigma"],
                    "lots": a["run"]["steps"],
                    "groups": a["run"]["groups"],
                    "q": round(a["run"]["q"], 6),
                    "m": 2000,
                    "beta": f["beta"],
                    "eps_claimed": round(a["eps_claimed"], 4),
                    "eps_claimed_lots": round(f["eps_claimed_lots"], 4),
                    "family_eps_lb": round(f["eps_lower_bound"], 4),
                    "family_sigma_ub": f["sigma_upper_bound"],
                    "verdict_family": f["verdict_family"],
                    "steinke_eps_lb": round(a["eps_lower_bound"], 4),
                    "verdict": a["verdict"],
                    "seconds": round(time.perf_counter() - t, 1),
                }
            )
            print(rows[-1], flush=True)
            pd.DataFrame(rows).to_csv(out, index=False)
    return pd.DataFrame(rows)


if __name__ == "__main__":
    import sys

    if sys.argv[1:2] == ["seeds"]:
        seeds(int(sys.argv[3]) if sys.argv[2:3] == ["--n"] else 20)
    else:
        measure()
