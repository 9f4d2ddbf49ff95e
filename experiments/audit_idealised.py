"""Validity and power of the one-run tests of the claim on the idealised game (no training).

    python -m experiments.audit_idealised rates [--games 1000]    # results/audit_idealised.csv
    # results/audit_idealised_bounds.csv
    python -m experiments.audit_idealised bounds [--games 10]
    python -m experiments.audit_idealised order-stats [--games 1000] [--power-games 200] \\
        [--bound-games 10]
                                                 # results/audit_idealised_order_stats{,_bounds}.csv

``rates``: for each setting (q, σ, T, k, m), ``--games`` seeded games of the claimed mechanism
(false violations) and of the mechanism with noise σC/2 and σC/4 (power); per row the rate at which
the family test (``dpsgd.audit.onerun.stats.family``) and the Steinke et al. test of the claimed (ε,
δ) reject the claim, each with its two-sided 95 % Clopper–Pearson interval. ``bounds``: the whole
family bound (ε_lb, σ_ub) beside the family-free bounds (Steinke et al.; Gaussian DP) on the first
games of each setting, correct mechanism. ``order-stats``: the order-statistics test of Xiang et al.
(``dpsgd.audit.onerun.stats.order_stats``) on the very games of ``rates`` (same seeds: noise σC/2 on
the first ``--power-games`` of them; for the claimed mechanism's ``--games`` the family test's
rejections, recorded again, equal those of results/audit_idealised.csv), and its ε_lb on the games
of ``bounds``. Games are simulated by ``dpsgd.audit.onerun.stats.simulate``; seeds are fixed.
"""

from __future__ import annotations

import argparse
import platform
import time

import numpy as np
import pandas as pd
from scipy.stats import beta as beta_dist

from experiments.paths import RESULTS

# (setting, q, σ, T lots, k groups, m canaries): full batch, moderate and small q, per-layer groups
SETTINGS = [
    ("q1_sigma2_T4", 1.0, 2.0, 4, 1, 1000),
    ("q0.1_sigma1_T100", 0.1, 1.0, 100, 1, 2000),
    ("q0.01_sigma0.8_T1000", 0.01, 0.8, 1000, 1, 1000),
    ("q0.05_sigma2_T200_k2", 0.05, 2.0, 200, 2, 5000),
]
NOISE_FACTORS = (1.0, 0.5, 0.25)  # the claimed mechanism, noise σC/2, noise σC/4
BETA, DELTA = 0.05, 1e-5


def clopper_pearson(k: int, n: int, conf: float = 0.95) -> tuple[float, float]:
    """Two-sided Clopper–Pearson interval for a binomial rate (Clopper & Pearson 1934)."""
    a = (1 - conf) / 2
    lo = 0.0 if k == 0 else float(beta_dist.ppf(a, k, n - k + 1))
    hi = 1.0 if k == n else float(beta_dist.ppf(1 - a, k + 1, n - k))
    return lo, hi


def _rate_row(setting: tuple, claim, nu: float, res: list[dict], tests: tuple, t0: float) -> dict:
    """One CSV row: a setting and mechanism, and for each test its rejections among the games
    ``res`` with their rate and Clopper–Pearson interval."""
    name, q, sigma, steps, k, m = setting
    games = len(res)
    row = {
        "setting": name,
        "q": q,
        "sigma": sigma,
        "lots": steps,
        "groups": k,
        "m": m,
        "eps_claimed": round(claim.epsilon(), 4),
        "delta": DELTA,
        "beta": BETA,
        "mechanism": "claimed" if nu == 1 else f"noise sigma*{nu:g}",
        "noise_factor": nu,
        "games": games,
    }
    for test in tests:
        n_rej = sum(r[test] for r in res)
        lo, hi = clopper_pearson(n_rej, games)
        row.update(
            {
                f"{test}_rejections": n_rej,
                f"{test}_rate": n_rej / games,
                f"{test}_ci_lo": round(lo, 4),
                f"{test}_ci_hi": round(hi, 4),
            }
        )
    row["seconds"] = round(time.perf_counter() - t0, 1)
    row["cpu"] = platform.machine()
    return row


def rates(games: int, out=RESULTS / "audit_idealised.csv") -> pd.DataFrame:
    from dpsgd.audit.onerun.stats.family import Claim
    from dpsgd.audit.onerun.stats.simulate import play

    rows = []
    for s_i, (name, q, sigma, steps, k, m) in enumerate(SETTINGS):
        claim = Claim(q, sigma, steps, k, DELTA).validate()
        for f_i, nu in enumerate(NOISE_FACTORS):
            rng = np.random.default_rng([s_i, f_i])
            t = time.perf_counter()
            res = [play(rng, m, claim, BETA, nu) for _ in range(games)]
            row = _rate_row((name, q, sigma, steps, k, m), claim, nu, res, ("family", "steinke"), t)
            rows.append(row)
            print(row, flush=True)
            pd.DataFrame(rows).to_csv(out, index=False)
    return pd.DataFrame(rows)


def bounds(games: int, out=RESULTS / "audit_idealised_bounds.csv") -> pd.DataFrame:
    from dpsgd.audit.onerun.stats.family import Claim
    from dpsgd.audit.onerun.stats.bounds import audit_bound
    from dpsgd.audit.onerun.stats.family import family_test
    from dpsgd.audit.onerun.stats.simulate import game_scores

    rows = []
    for s_i, (name, q, sigma, steps, k, m) in enumerate(SETTINGS):
        claim = Claim(q, sigma, steps, k, DELTA).validate()
        for g in range(games):
            scores, bits = game_scores(np.random.default_rng([100, s_i, g]), m, claim)
            t = time.perf_counter()
            f = family_test(scores, bits, claim, BETA)
            free = audit_bound(scores, bits, DELTA, BETA, gdp=True)
            eps = f["eps_claimed"]
            rows.append(
                {
                    "setting": name,
                    "game": g,
                    "m": m,
                    "eps_claimed": round(eps, 4),
                    "family_eps_lb": round(f["eps_lower_bound"], 4),
                    "family_sigma_ub": f["sigma_upper_bound"],
                    "family_ratio": round(f["eps_lower_bound"] / eps, 4),
                    "steinke_eps_lb": round(free["eps_lower_bound"], 4),
                    "steinke_ratio": round(free["eps_lower_bound"] / eps, 4),
                    "gdp_eps_lb": round(free["gdp_eps_lower_bound"], 4),
                    "gdp_ratio": round(free["gdp_eps_lower_bound"] / eps, 4),
                    "verdict": f["verdict"],
                    "seconds": round(time.perf_counter() - t, 1),
                }
            )
            print(rows[-1], flush=True)
            pd.DataFrame(rows).to_csv(out, index=False)
    return pd.DataFrame(rows)


def order_stats(
    games: int,
    power_games: int,
    bound_games: int,
    out=RESULTS / "audit_idealised_order_stats.csv",
    out_bounds=RESULTS / "audit_idealised_order_stats_bounds.csv",
) -> pd.DataFrame:
    from dpsgd.audit.onerun.stats.family import Claim
    from dpsgd.audit.onerun.stats.order_stats import order_stats_test
    from dpsgd.audit.onerun.stats.simulate import game_scores, play

    rows = []
    for s_i, (name, q, sigma, steps, k, m) in enumerate(SETTINGS):
        claim = Claim(q, sigma, steps, k, DELTA).validate()
        for f_i, nu in enumerate(NOISE_FACTORS[:2]):
            n_games = games if nu == 1 else power_games
            rng = np.random.default_rng([s_i, f_i])  # the games of ``rates``
            t = time.perf_counter()
            res = [play(rng, m, claim, BETA, nu, order_stats=True) for _ in range(n_games)]
            row = _rate_row(
                (name, q, sigma, steps, k, m), claim, nu, res, ("family", "order_stats"), t
            )
            rows.append(row)
            print(row, flush=True)
            pd.DataFrame(rows).to_csv(out, index=False)
    brows = []
    for s_i, (name, q, sigma, steps, k, m) in enumerate(SETTINGS):
        claim = Claim(q, sigma, steps, k, DELTA).validate()
        for g in range(bound_games):
            scores, bits = game_scores(
                np.random.default_rng([100, s_i, g]), m, claim
            )  # the games of ``bounds``
            t = time.perf_counter()
            o = order_stats_test(scores, bits, claim, BETA)
            eps = o["eps_claimed"]
            brows.append(
                {
                    "setting": name,
                    "game": g,
                    "m": m,
                    "eps_claimed": round(eps, 4),
                    "order_stats_eps_lb": round(o["eps_lower_bound"], 4),
                    "order_stats_sigma_ub": o["sigma_upper_bound"],
                    "order_stats_ratio": round(o["eps_lower_bound"] / eps, 4),
                    "verdict": o["verdict"],
                    "seconds": round(time.perf_counter() - t, 1),
                }
            )
            print(brows[-1], flush=True)
            pd.DataFrame(brows).to_csv(out_bounds, index=False)
    return pd.DataFrame(rows)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m experiments.audit_idealised")
    p.add_argument("what", choices=("rates", "bounds", "order-stats"))
    p.add_argument("--games", type=int)
    p.add_argument("--power-games", type=int, default=200)
    p.add_argument("--bound-games", type=int, default=10)
    a = p.parse_args(argv)
    if a.what == "rates":
        rates(a.games or 1000)
    elif a.what == "order-stats":
        order_stats(a.games or 1000, a.power_games, a.bound_games)
    else:
        bounds(a.games or 10)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
