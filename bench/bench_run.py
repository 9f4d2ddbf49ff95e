"""Benchmark a whole training run, not just its step: where the time of ``python -m dpsgd.train``
goes.

    # mnist_medium, 5 epochs, DP and non-private, 3 repeats
    python -m bench.bench_run
    python -m bench.bench_run --epochs 2 --repeats 1 --out /tmp/r.csv     # smoke run

Details: docs/PERFORMANCE.md, "bench/bench_run.py".
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from bench import write_csv

ROOT = Path(__file__).resolve().parents[1]
PHASES = [
    "total",
    "startup",
    "imports",
    "lots",
    "steps",
    "per_lot_outside_step",
    "evaluation",
    "accounting",
    "writes",
]
COLUMNS = [
    "experiment",
    "epochs",
    "private",
    "repeat",
    "phase",
    "seconds",
    "lots",
    "loadavg_1min",
    "machine",
]


def child(args: list[str], out: str, t_process: float) -> None:
    """Run ``python -m dpsgd.train args`` in this process with the pieces timed; write them to
    ``out``."""
    t0 = time.perf_counter()
    from dpsgd import train
    from dpsgd.launch.main import train_main
    from dpsgd.core import fileio
    from dpsgd.mechanism.optim import DPSGD
    from dpsgd.run import checkpoint, report, state

    t = {p: 0.0 for p in PHASES}
    t["imports"] = time.perf_counter() - t0
    first, count = [], [0]

    def timed(owner, name, phase, on_call=None):
        real = getattr(owner, name)

        def wrapper(*a, **k):
            if on_call:
                on_call()
            s = time.perf_counter()
            try:
                return real(*a, **k)
            finally:
                t[phase] += time.perf_counter() - s

        setattr(owner, name, wrapper)

    def first_lot():
        count[0] += 1
        if not first:
            first.append(time.perf_counter())

    timed(DPSGD, "step", "steps", first_lot)
    timed(train, "run_epoch", "lots")
    timed(train, "evaluate", "evaluation")
    timed(train, "epsilons", "accounting")
    timed(report, "epsilons", "accounting")
    for owner in (train, fileio):
        timed(owner, "write_json", "writes")
    timed(state, "save_checkpoint", "writes")
    timed(checkpoint.MetricsWriter, "append", "writes")
    try:
        train_main(args)
    except SystemExit as e:
        if e.code:
            raise
    end = time.perf_counter()
    t["total"] = time.time() - t_process
    t["startup"] = (first[0] - end) + t["total"] if first else t["total"]
    t["per_lot_outside_step"] = t["lots"] - t["steps"]
    Path(out).write_text(json.dumps({"seconds": t, "lots": count[0]}))


def measure(experiment: str, epochs: int, private: bool, workdir: Path) -> dict:
    """One child: the timed run of ``experiment`` for ``epochs`` epochs in a fresh run folder."""
    run = Path(tempfile.mkdtemp(prefix="run", dir=workdir))
    out = run.with_suffix(".json")
    args = [
        f"experiment={experiment}",
        f"training.epochs={epochs}",
        "privacy.target_epsilon=null",
        f"privacy.private={str(private).lower()}",
        f"hydra.run.dir={run / 'r'}",
    ]
    code = (
        "import sys, time; t = time.time(); sys.argv = ['bench_run'];"
        f"from bench.bench_run import child; child({args!r}, {str(out)!r}, t)"
    )
    subprocess.run(
        [sys.executable, "-c", code],
        cwd=ROOT,
        check=True,
        stdout=subprocess.DEVNULL,
        env={**os.environ, "PYTHONPATH": str(ROOT)},
    )
    return json.loads(out.read_text())


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(
        prog="python -m bench.bench_run", description=__doc__.splitlines()[0]
    )
    ap.add_argument("--experiment", default="mnist_medium")
    ap.add_argument("--epochs", type=int, default=5)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--out", type=Path, default=ROOT / "results" / "bench_run.csv")
    a = ap.parse_args(argv)
    if a.epochs < 1 or a.repeats < 1:
        ap.error(f"--epochs={a.epochs}, --repeats={a.repeats}: each must be >= 1")
    from dpsgd.core.runtime import describe_hardware

    machine, rows = describe_hardware(), []
    with tempfile.TemporaryDirectory() as work:
        for r in range(a.repeats):
            for private in (True, False) if r % 2 == 0 else (False, True):
                load = os.getloadavg()[0]
                res = measure(a.experiment, a.epochs, private, Path(work))
                rows += [
                    {
                        "experiment": a.experiment,
                        "epochs": a.epochs,
                        "private": private,
                        "repeat": r,
                        "phase": p,
                        "seconds": round(res["seconds"][p], 4),
                        "lots": res["lots"],
                        "loadavg_1min": round(load, 2),
                        "machine": machine,
                    }
                    for p in PHASES
                ]
                print(
                    f"repeat {r} {'DP' if private else 'non-private'}: total "
                    f"{res['seconds']['total']:.2f} s, startup {res['seconds']['startup']:.2f} s, "
                    f"steps {res['seconds']['steps']:.2f} s (load {load:.1f})",
                    flush=True,
                )
    write_csv(rows, a.out, COLUMNS)
    med = {
        (p, pr): statistics.median(
            x["seconds"] for x in rows if x["phase"] == p and x["private"] == pr
        )
        for p in PHASES
        for pr in (True, False)
    }
    print(f"{'phase':<22}{'DP':>10}{'non-private':>13}{'ratio':>8}")
    for p in PHASES:
        dp, npv = med[(p, True)], med[(p, False)]
        print(f"{p:<22}{dp:>10.3f}{npv:>13.3f}{dp / npv if npv > 0 else float('nan'):>8.2f}")
    print(f"wrote {a.out} ({machine})")


if __name__ == "__main__":
    main()
