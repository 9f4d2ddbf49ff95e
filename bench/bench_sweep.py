"""Wall time of one small sweep run one job after another (Hydra's basic launcher) against the same
sweep through ``hydra/launcher=joblib`` (docs/SCALING.md, "Sweeps on a cluster").

    python -m bench.bench_sweep [--jobs 4] [--max-steps 300] [--reps 2] \\
        [--out results/bench_sweep.csv]

The sweep: the medium preset (``experiment=mnist_medium``, full MNIST, DP-PCA, lot 600) over seeds
0..jobs-1, each run cut at ``--max-steps`` lots, on the CPU. Repetitions alternate the launchers
(basic, joblib, joblib, basic, ...) so that a change in the machine's load hits both. No thread
variable is set: the basic launcher's single job takes the usual policy (1 thread on <= 2 cores),
the joblib jobs take their share of the cores (dpsgd/core/runtime.py:thread_policy). One row per
sweep: wall time of the command, the summed ``wall_time_s`` of its runs, the 1-minute load average
before it started. Timings are never asserted anywhere.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pandas as pd

from dpsgd.core.fileio import atomic_write_text
from dpsgd.core.runtime import describe_hardware

ROOT = Path(__file__).resolve().parent.parent


def sweep_once(launcher: str, jobs: int, max_steps: int, where: Path) -> dict:
    env = {
        k: v
        for k, v in os.environ.items()
        if k not in ("OMP_NUM_THREADS", "DPSGD_THREADS", "DPSGD_PARALLEL_JOBS")
    }
    sweep = where / f"{launcher}_{time.time_ns()}"
    cmd = [
        sys.executable,
        "-m",
        "dpsgd.train",
        "-m",
        "experiment=mnist_medium",
        f"seed={','.join(str(s) for s in range(jobs))}",
        f"training.max_steps={max_steps}",
        "device=cpu",
        f"hydra/launcher={launcher}",
        f"hydra.sweep.dir={sweep}",
    ]
    load = os.getloadavg()[0]
    t0 = time.perf_counter()
    r = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True)
    wall = time.perf_counter() - t0
    if r.returncode != 0:
        raise SystemExit(f"sweep failed ({launcher}): {r.stderr[-2000:]}")
    runs = sorted(sweep.rglob("metrics.csv"))
    run_s = sum(float(pd.read_csv(m)["wall_time_s"].iloc[-1]) for m in runs)
    return {
        "launcher": launcher,
        "jobs": len(runs),
        "max_steps": max_steps,
        "wall_s": round(wall, 2),
        "sum_run_wall_s": round(run_s, 2),
        "load_1min_before": round(load, 2),
        "command": " ".join(["python", *cmd[1:-1]]),
    }


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--jobs", type=int, default=4)
    ap.add_argument("--max-steps", type=int, default=300)
    ap.add_argument("--reps", type=int, default=2, help="sweeps per launcher")
    ap.add_argument("--out", type=Path, default=ROOT / "results" / "bench_sweep.csv")
    args = ap.parse_args(argv)
    rows, hw = [], describe_hardware()
    with tempfile.TemporaryDirectory() as tmp:
        for rep in range(args.reps):
            order = ("basic", "joblib") if rep % 2 == 0 else ("joblib", "basic")
            for launcher in order:
                row = {
                    "rep": rep,
                    **sweep_once(launcher, args.jobs, args.max_steps, Path(tmp)),
                    "hardware": hw,
                }
                print(row, flush=True)
                rows.append(row)
    df = pd.DataFrame(rows)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    atomic_write_text(args.out, df.to_csv(index=False))
    med = df.groupby("launcher")["wall_s"].median()
    print(
        f"median wall: basic {med.get('basic', float('nan')):.1f} s, joblib "
        f"{med.get('joblib', float('nan')):.1f} s -> {args.out}"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
