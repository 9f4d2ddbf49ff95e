"""Random allocation by PLD against PLD_accounting's bounds and Poisson, at eight schedules.

    # results/allocation_pld.csv; the reference columns need pld-accounting (and numba for speed):
    #   pip install pld-accounting==2.0 numba   (not a dependency of this repository)
    python -m experiments.allocation_pld
    python -m experiments.allocation_pld --ours-only   # keep the committed reference columns

Each row: one schedule (t lots per epoch, σ, E epochs, δ); ``epsilon`` is ours
(``dpsgd/accountant/privacy_loss/allocation_pld.py``, composed by ``truncated.epsilon_for_releases``);
``their_lower``/``their_upper`` are Feldman & Shenfeld's bounds (PLD_accounting 2.0,
``gaussian_allocation_epsilon_range``, default accuracy); ``poisson`` is dp_accounting 0.6.0's PLD
of Poisson sampling at q = 1/t over t·E lots (interval 1e-4). ``within`` is the acceptance check:
their_lower <= epsilon <= 1.01 × their_upper.
"""

from __future__ import annotations

import argparse
import csv
import platform
import time
from pathlib import Path

RESULTS = Path(__file__).resolve().parent.parent / "results"
OUT = RESULTS / "allocation_pld.csv"
# (t, σ, epochs, δ): the paper's MNIST schedule (t = 100, σ = 4, 108 epochs), the two other
# schedules the comparison started from, and five more across t, σ and δ
SCHEDULES = [
    (100, 4.0, 108, 1e-5),
    (100, 3.0, 30, 1e-6),
    (100, 1.1, 10, 1e-5),
    (10, 2.0, 50, 1e-5),
    (235, 1.1, 60, 1e-5),
    (20, 0.8, 3, 1e-5),
    (50, 6.0, 200, 1e-8),
    (1000, 1.5, 5, 1e-5),
]
REFERENCE = ("their_lower", "their_upper", "their_seconds", "poisson")
COLUMNS = ("t", "sigma", "epochs", "delta", "epsilon", "seconds") + REFERENCE
COLUMNS += ("ratio_to_upper", "within", "cpu")


def ours(t: int, sigma: float, epochs: int, delta: float) -> tuple[float, float]:
    from dpsgd.accountant.privacy_loss import allocation_pld, truncated

    allocation_pld.epoch_pmf.cache_clear()
    t0 = time.perf_counter()
    eps = truncated.epsilon_for_releases([(("allocation", t, sigma), epochs)], delta)
    return eps, time.perf_counter() - t0


def theirs(t: int, sigma: float, epochs: int, delta: float) -> dict:
    from dp_accounting import dp_event
    from dp_accounting.pld import pld_privacy_accountant
    from PLD_accounting import gaussian_allocation_epsilon_range

    acc = pld_privacy_accountant.PLDAccountant(value_discretization_interval=1e-4)
    acc.compose(
        dp_event.PoissonSampledDpEvent(1.0 / t, dp_event.GaussianDpEvent(sigma)), t * epochs
    )
    t0 = time.perf_counter()
    up, lo = gaussian_allocation_epsilon_range(
        delta=delta, sigma=sigma, num_steps=t, num_epochs=epochs
    )
    return {
        "their_lower": lo,
        "their_upper": up,
        "their_seconds": round(time.perf_counter() - t0, 1),
        "poisson": acc.get_epsilon(delta),
    }


def _committed() -> dict:
    if not OUT.exists():
        return {}
    with OUT.open() as f:
        return {
            (int(r["t"]), float(r["sigma"]), int(r["epochs"]), float(r["delta"])): r
            for r in csv.DictReader(f)
        }


def measure(ours_only: bool = False) -> list[dict]:
    old, rows = _committed(), []
    for key in SCHEDULES:
        if ours_only:
            if key not in old:
                raise SystemExit(f"--ours-only: no committed reference for {key} in {OUT}")
            ref = {k: float(old[key][k]) for k in REFERENCE}
        else:
            ref = theirs(*key)
        eps, sec = ours(*key)
        row = dict(zip(("t", "sigma", "epochs", "delta"), key), epsilon=eps, seconds=round(sec, 2))
        row |= ref
        row["ratio_to_upper"] = round(eps / ref["their_upper"], 4)
        row["within"] = ref["their_lower"] <= eps <= 1.01 * ref["their_upper"]
        row["cpu"] = platform.processor() or platform.machine()
        rows.append(row)
        print(", ".join(f"{k}={row[k]}" for k in COLUMNS), flush=True)
    with OUT.open("w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=COLUMNS)
        w.writeheader()
        w.writerows(rows)
    return rows


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--ours-only", action="store_true", help="keep the committed reference columns")
    rows = measure(ap.parse_args(argv).ours_only)
    return 0 if all(r["within"] for r in rows) else 1


if __name__ == "__main__":
    raise SystemExit(main())
