"""Where the time of a whole run goes, from cProfile: the pieces of ``python -m dpsgd.train`` as
rows of a CSV.

    python -m cProfile -o run.prof -m dpsgd.train experiment=mnist_medium hydra.run.dir=/tmp/run
    python -m bench.profile_run run.prof --label after [--load "0.4 0.9"] \\
        [--out results/profile_run.csv]

Each row is one piece (cumulative seconds of the function under the profiler, and its calls):
start-up (importing ``dpsgd.train``, the command line, ``setup`` with the data and DP-PCA), the lots
(``DPSGD.step``, the sampler, gathering the lot, the ledger's ``record``, the lot's digest, the
reservation) and each epoch's evaluation, accounting, checkpoint and ``privacy.json``. The profiler
adds its own cost to every Python call (the lots' small pieces most), so the rows are for where
the time goes and for before/after under the same profiler, not for the run's wall time. ``--out``
appends to an existing CSV (one label per profiled run).
"""

from __future__ import annotations

import argparse
import csv
import pstats
import re
from pathlib import Path

from bench import write_csv
from dpsgd.core.runtime import describe_hardware

ROOT = Path(__file__).resolve().parents[1]
COLUMNS = ["label", "piece", "seconds", "calls", "loadavg", "machine"]
PIECES = [  # (piece, the function's "file:line(name)" as a pattern)
    ("whole process", r"<string>:1\(<module>\)"),
    ("after importing dpsgd.train", r"dpsgd/train\.py:\d+\(main\)"),
    ("train()", r"dpsgd/train\.py:\d+\(train\)"),
    ("setup", r"dpsgd/run/opening\.py:\d+\(setup\)"),
    ("load_data", r"dpsgd/run/parts\.py:\d+\(load_data\)"),
    ("dp_pca", r"dpsgd/mechanism/pca\.py:\d+\(dp_pca\)"),
    ("epochs (algorithm1)", r"dpsgd/train\.py:\d+\(algorithm1\)"),
    ("lots (run_epoch)", r"dpsgd/train\.py:\d+\(run_epoch\)"),
    ("DPSGD.step", r"dpsgd/mechanism/optim\.py:\d+\(step\)"),
    ("sampler", r"dpsgd/mechanism/sampling\.py:\d+\(epoch\)"),
    ("Parts.lot", r"dpsgd/run/parts\.py:\d+\(lot\)"),
    ("Ledger.record", r"dpsgd/accountant/ledger\.py:\d+\(record\)"),
    ("digest", r"dpsgd/run/replay\.py:\d+\(digest\)"),
    ("Run.reserve", r"dpsgd/run/state\.py:\d+\(reserve\)"),
    ("evaluate", r"dpsgd/train\.py:\d+\(evaluate\)"),
    ("accounting (epsilons)", r"dpsgd/run/report\.py:\d+\(epsilons\)"),
    ("checkpoint", r"dpsgd/run/state\.py:\d+\(checkpoint\)"),
    ("write_json", r"dpsgd/core/fileio\.py:\d+\(write_json\)"),
]


def pieces(prof: Path) -> list[tuple[str, float, int]]:
    """(piece, cumulative seconds, calls) of each of PIECES in the profile ``prof``."""
    stats = pstats.Stats(str(prof)).stats
    out = []
    for piece, pattern in PIECES:
        rx = re.compile(pattern)
        hits = [
            (ct, nc)
            for (f, line, name), (cc, nc, tt, ct, callers) in stats.items()
            if rx.search(f"{f}:{line}({name})")
        ]
        out.append((piece, round(sum(h[0] for h in hits), 3), sum(h[1] for h in hits)))
    return out


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("prof", type=Path)
    ap.add_argument("--label", required=True, help="which code and run, e.g. 'before (eedf304)'")
    ap.add_argument("--load", default="", help="the 1-minute load average at the start and the end")
    ap.add_argument("--out", type=Path, default=ROOT / "results" / "profile_run.csv")
    a = ap.parse_args(argv)
    machine = describe_hardware()
    rows = []
    if a.out.exists():
        with open(a.out, newline="") as f:
            rows = [r for r in csv.DictReader(f) if r["label"] != a.label]
    rows += [
        {
            "label": a.label,
            "piece": p,
            "seconds": s,
            "calls": n,
            "loadavg": a.load,
            "machine": machine,
        }
        for p, s, n in pieces(a.prof)
    ]
    write_csv(rows, a.out, COLUMNS)
    for p, s, n in pieces(a.prof):
        print(f"{p:32s} {s:9.2f} s  {n:7d} calls")
    print(f"wrote {a.out}")


if __name__ == "__main__":
    main()
