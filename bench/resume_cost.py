"""What the one resume rule costs (dpsgd/run/guard.py): every lot past the checkpoint that an
earlier attempt reserved or an output shows is charged again, where a proof of identical replays
(the per-lot parameter digests dpsgd had before) could charge a faithful replay's lots once.

    python -m bench.resume_cost [--seeds 200] [--first 1000] [--out results/resume_cost.csv]

Two measurements, one CSV (``kind`` column):

* ``search``: the kill sequences of the property test (tests/run/test_lot_guard.py:play, the same
  seeds), each run in-process on the tiny test run (10 lots an epoch, σ = 4, q = 0.1). Per sequence:
  the lots that ran (repeats counted), the distinct releases among them (a lot's position and the
  exact weights it produced: the least any proof of identical replays could charge), the lots the
  ledger charged, and ε (PLD, δ = 1e-5) of each. ``violation`` is 1 where charged < ran.
* ``schedule``: paper schedules (Poisson, σ and q of the presets), ε after T lots and after T plus
  the lots that k kills cost beyond a perfect replay proof: on average half a checkpoint interval
  each (a kill falls anywhere in the epoch), at most a whole one.
"""

from __future__ import annotations

import argparse
import csv
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
DELTA = 1e-5


def _eps(q: float, sigma: float, lots: int) -> float:
    from dpsgd.accountant import calibrate

    return calibrate.epsilon(q, sigma, lots, DELTA, "pld") if lots else 0.0


def search(seeds, work: Path) -> list[dict]:
    import pytest

    sys.path[:0] = [str(REPO / "tests"), str(REPO / "tests" / "run")]
    from resume_harness import Harness, lots
    from test_lot_guard import check, play

    import contextlib
    import io

    rows = []
    for seed in seeds:
        with (
            pytest.MonkeyPatch.context() as mp,
            contextlib.redirect_stdout(io.StringIO()),
            contextlib.redirect_stderr(io.StringIO()),
        ):
            h = Harness(mp, work / f"run{seed}")
            st = play(h, seed)
            check(
                h, st
            )  # raises on a violation: the search stops there, with the seed in the trace
        if not st:
            continue
        q = next(e["q"] for e in st["ledger"]["entries"] if e["label"] == "sgd")
        sigma = next(e["sigma"] for e in st["ledger"]["entries"] if e["label"] == "sgd")
        charged, ran, distinct = lots(st), h.executed(), h.releases()
        rows.append(
            {
                "kind": "search",
                "case": f"seed {seed}",
                "q": q,
                "sigma": sigma,
                "resumes": len(st["resumes"]),
                "lots_ran": ran,
                "distinct_releases": distinct,
                "lots_charged": charged,
                "eps_charged": round(_eps(q, sigma, charged), 4),
                "eps_distinct": round(_eps(q, sigma, distinct), 4),
                "violation": int(charged < ran),
            }
        )
    return rows


SCHEDULES = [  # (case, q, σ, lots T, lots per checkpoint interval E)
    ("MNIST mnist_medium-like: q=0.01, sigma=4, 100 epochs", 0.01, 4.0, 10_000, 100),
    ("MNIST mnist_small-like: q=0.01, sigma=8, 100 epochs", 0.01, 8.0, 10_000, 100),
    ("CIFAR-10-like: q=0.04, sigma=6, 100 epochs", 0.04, 6.0, 2_500, 25),
    ("tiny test run: q=0.1, sigma=4, 4 epochs", 0.1, 4.0, 40, 10),
]


def schedules() -> list[dict]:
    rows = []
    for case, q, sigma, T, E in SCHEDULES:
        base = _eps(q, sigma, T)
        for kills in (1, 10):
            for what, extra in (("mean", kills * E // 2), ("worst", kills * E)):
                e = _eps(q, sigma, T + extra)
                rows.append(
                    {
                        "kind": "schedule",
                        "case": f"{case}; {kills} kill(s), {what}",
                        "q": q,
                        "sigma": sigma,
                        "resumes": kills,
                        "lots_ran": T,
                        "distinct_releases": T,
                        "lots_charged": T + extra,
                        "eps_charged": round(e, 4),
                        "eps_distinct": round(base, 4),
                        "violation": 0,
                    }
                )
    return rows


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--seeds", type=int, default=200, help="kill sequences searched (≥ 1)")
    ap.add_argument(
        "--first", type=int, default=1000, help="the first seed (the slow test's: 1000)"
    )
    ap.add_argument("--out", default=str(REPO / "results" / "resume_cost.csv"))
    ap.add_argument("--work", default=None, help="folder for the runs (default: a temporary one)")
    a = ap.parse_args(argv)
    if a.seeds < 1:
        ap.error(f"--seeds={a.seeds}: at least 1")
    import tempfile

    with tempfile.TemporaryDirectory() as tmp:
        rows = search(range(a.first, a.first + a.seeds), Path(a.work or tmp)) + schedules()
    with open(a.out, "w", newline="") as f:
        w = csv.DictWriter(f, list(rows[0]), lineterminator="\n")
        w.writeheader()
        w.writerows(rows)
    found = [r for r in rows if r["kind"] == "search"]
    ran = sum(r["lots_ran"] for r in found)
    extra = sum(r["lots_charged"] - r["distinct_releases"] for r in found)
    rel = [r["eps_charged"] / r["eps_distinct"] - 1 for r in found if r["eps_distinct"]]
    print(
        f"{a.seeds} sequences searched (seeds {a.first}..{a.first + a.seeds - 1}), {len(found)} "
        f"resumed, {sum(r['violation'] for r in found)} violations; lots ran {ran}, charged "
        f"beyond the distinct releases {extra}; ε above the distinct releases' ε: median "
        f"{sorted(rel)[len(rel) // 2]:.1%}, max {max(rel):.1%}"
    )
    print(f"wrote {a.out}")


if __name__ == "__main__":
    main()
