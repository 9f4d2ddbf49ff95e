"""Benchmark torch's intra-op thread count for the paper's MNIST DP step, idle and under CPU load.

    # full protocol, writes results/bench_threads.csv
    python -m bench.bench_threads
    python -m bench.bench_threads --repeats 2 --steps 5 --out /tmp/t.csv   # smoke run

Question: on a small CPU machine that other processes also use, does torch's default thread count
(one per core) lose to a single thread? (Oversubscription: torch's OpenMP workers spin and wait for
each other, and a busy core delays every parallel region.) And does it still when the OpenMP workers
sleep instead of spinning (OMP_WAIT_POLICY=PASSIVE, which dpsgd sets before torch loads)? Each child
runs the step as training does: with one torch thread the next lot's noise is drawn on the other
core (dpsgd/mechanism/noise.py), with two it is not.

Details: docs/PERFORMANCE.md, "bench/bench_threads.py".
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

from bench import write_csv

COLUMNS = ["threads", "omp_wait_policy", "load", "repeat", "seconds", "steps", "loadavg_1min",
           "machine"]  # fmt: skip
ROOT = Path(__file__).resolve().parents[1]


def child(threads: int, steps: int) -> float:
    """Seconds for ``steps`` DP-SGD steps of the paper's MNIST model with ``threads`` intra-op
    threads."""
    import torch

    from dpsgd.mechanism.clipping import PerExampleClipper
    from dpsgd.models.networks import MLP
    from dpsgd.mechanism.noise import GaussianNoise
    from dpsgd.mechanism.optim import DPSGD
    from dpsgd.mechanism.plan import Plan
    from dpsgd.core.runtime import tune_allocator

    tune_allocator()
    torch.set_num_threads(threads)
    torch.manual_seed(0)
    L, C, sigma = 600, 4.0, 4.0
    model = MLP(60, (1000,), 10, bias=False)
    clipper = PerExampleClipper(model, C, "per_layer", mode="auto")
    dp = DPSGD(model, clipper, GaussianNoise(seed=0), Plan.by_hand(sigma, C, L), lr=0.1)
    x, y = torch.randn(L, 60), torch.randint(0, 10, (L,))
    for _ in range(5):
        dp.step(x, y, physical_batch_size=L)
    t0 = time.perf_counter()
    for _ in range(steps):
        dp.step(x, y, physical_batch_size=L)
    return time.perf_counter() - t0


def _loadavg() -> float:
    return os.getloadavg()[0]


def measure(threads: int, steps: int, policy: str = "passive") -> float:
    env = dict(os.environ, OMP_NUM_THREADS=str(threads), MKL_NUM_THREADS=str(threads))
    env["OMP_WAIT_POLICY"] = policy.upper()  # read by OpenMP when torch loads (dpsgd/__init__.py)
    env.pop("DPSGD_THREADS", None)
    out = subprocess.run(
        [
            sys.executable,
            "-m",
            "bench.bench_threads",
            "--child",
            str(threads),
            "--steps",
            str(steps),
        ],
        env=env,
        cwd=ROOT,
        capture_output=True,
        text=True,
        check=True,
        timeout=1800,
    )
    return float(out.stdout.strip().splitlines()[-1])


def spinners(n: int) -> list[subprocess.Popen]:
    return [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(n)]


def stop(procs: list[subprocess.Popen]) -> None:
    for p in procs:
        p.terminate()
    for p in procs:
        p.wait()


def run(configs, loads, repeats: int, steps: int, settle_s: float) -> list[dict]:
    """``configs``: (threads, OpenMP wait policy) pairs, measured in turn (order alternating)."""
    from dpsgd.core.runtime import describe_hardware

    machine = describe_hardware()
    rows = []
    for r in range(repeats):
        for load in loads:
            procs = spinners(load)
            try:
                time.sleep(settle_s if load else 0.0)
                order = list(configs) if r % 2 == 0 else list(reversed(configs))
                for n, policy in order:
                    la = _loadavg()
                    s = measure(n, steps, policy)
                    rows.append(
                        {
                            "threads": n,
                            "omp_wait_policy": policy,
                            "load": load,
                            "repeat": r,
                            "seconds": round(s, 4),
                            "steps": steps,
                            "loadavg_1min": round(la, 2),
                            "machine": machine,
                        }
                    )
                    print(
                        f"repeat {r} load {load} threads {n} ({policy}): {s:.3f} s ({steps} steps, "
                        f"loadavg {la:.2f})",
                        flush=True,
                    )
            finally:
                stop(procs)
    return rows


def summary(rows: list[dict]) -> list[str]:
    out = []
    for load in sorted({r["load"] for r in rows}):
        for n, policy in sorted({(r["threads"], r["omp_wait_policy"]) for r in rows}):
            s = sorted(r["seconds"] for r in rows if r["load"] == load and r["threads"] == n
                       and r["omp_wait_policy"] == policy)  # fmt: skip
            out.append(
                f"load {load} threads {n} ({policy}): median {statistics.median(s):.3f} s "
                f"(min {s[0]:.3f}, max {s[-1]:.3f}, n={len(s)})"
            )
    return out


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument(
        "--configs",
        default="1:passive,2:passive,2:active",
        help="threads:OpenMP wait policy pairs, comma-separated (passive: dpsgd's default)",
    )
    ap.add_argument("--loads", default="0,1,2", help="numbers of competing CPU-bound processes")
    ap.add_argument("--repeats", type=int, default=9)
    ap.add_argument("--steps", type=int, default=100)
    ap.add_argument(
        "--settle-s", type=float, default=1.0, help="seconds the spinners run before timing"
    )
    ap.add_argument("--out", type=Path, default=ROOT / "results" / "bench_threads.csv")
    ap.add_argument("--child", type=int, default=None, help=argparse.SUPPRESS)
    a = ap.parse_args(argv)
    if a.child is not None:
        print(child(a.child, a.steps))
        return
    configs = [(int(c.split(":")[0]), c.split(":")[1]) for c in a.configs.split(",")]
    loads = [int(x) for x in a.loads.split(",")]
    rows = run(configs, loads, a.repeats, a.steps, a.settle_s)
    write_csv(rows, a.out, COLUMNS)
    print("\n".join(summary(rows)))
    print(f"wrote {a.out}")


if __name__ == "__main__":
    main()
