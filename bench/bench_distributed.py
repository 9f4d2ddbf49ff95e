"""Benchmark data-parallel DP-SGD (dpsgd/run/distributed.py): 1 vs P processes, and the all-reduce's
share.

    # lots 600 and 6000, 1 and 2 processes (gloo, CPU)
    python -m bench.bench_distributed
    python -m bench.bench_distributed --quick          # smoke run
    python -m bench.bench_distributed --lots 600 --processes 1,2,4 --out /tmp/d.csv

The paper's MNIST model: real MNIST training images projected by (non-private) PCA to 60 dimensions,
one hidden layer of 1000 ReLU units without biases, per-layer clipping (k = 2), ghost engine,
C = 4, σ = 4. Each timed step is the training loop's: a Poisson lot (q = L/N, N = 60 000) drawn by
every rank's identical sampler, this rank's share of it, ``DPSGD.step`` with the
``distributed.Aggregator`` (one all-reduce of the flat clipped sums, noise once, update).

Details: docs/PERFORMANCE.md, "bench/bench_distributed.py".
"""

from __future__ import annotations

import argparse
import os
import statistics
import tempfile
import time
from pathlib import Path

import torch

from bench import write_csv

COLUMNS = [
    "lot",
    "processes",
    "mode",
    "backend",
    "step_ms",
    "examples_per_s",
    "speedup_vs_plain",
    "allreduce_ms",
    "allreduce_share",
    "allreduce_bare_ms",
    "allreduce_bytes",
    "reps",
    "steps_per_rep",
    "threads_per_process",
    "load_avg_1min",
    "hardware",
]
SIGMA, C, LR = 4.0, 4.0, 0.05


def _data(subset=None):
    from dpsgd.data.readers import load_dataset
    from dpsgd.mechanism.pca import fit_projection, project

    Xtr, ytr, _, _ = load_dataset("mnist", os.environ.get("DPSGD_DATA_ROOT"), subset)
    V = fit_projection("pca", Xtr, 60, 0.0, torch.Generator().manual_seed(0))
    return project(Xtr, V).contiguous(), ytr


def _measure(
    rank: int,
    P: int,
    lot: int,
    steps: int,
    reps: int,
    init_file: str | None,
    out: str | None,
    subset: int | None = None,
):
    """Run on each rank (or alone when ``init_file`` is None); rank 0 writes its timings to
    ``out``."""
    from dpsgd.run import distributed
    from dpsgd.mechanism.clipping import PerExampleClipper
    from dpsgd.models.networks import MLP
    from dpsgd.mechanism.noise import GaussianNoise
    from dpsgd.mechanism.optim import DPSGD
    from dpsgd.mechanism.plan import Plan
    from dpsgd.mechanism.sampling import PoissonSampler

    torch.set_num_threads(1)
    d = distributed.Dist()
    if init_file is not None:
        d = distributed.init(
            distributed.Dist(rank, P, rank, "?"), init_method=f"file://{init_file}", cuda=False
        )
    try:
        X, y = _data(subset)
        torch.manual_seed(0)
        model = MLP(60, (1000,), 10, bias=False)
        clipper = PerExampleClipper(model, C, clipping="per_layer", mode="ghost")
        dp = DPSGD(model, clipper, GaussianNoise(seed=1), Plan.by_hand(SIGMA, C, lot), lr=LR)
        if d.active:
            dp.comm = distributed.Aggregator(
                d, False, list(clipper.clipped_sum(X[:1], y[:1]).grads)
            )
        sampler = PoissonSampler(len(X), lot, torch.Generator().manual_seed(2))

        def lots():
            while True:
                yield from sampler.epoch()

        it = lots()
        times, shares = [], []
        for r in range(reps + 1):
            if d.active:
                torch.distributed.barrier()
                a0 = dp.comm.seconds
            t0 = time.perf_counter()
            for _ in range(steps):
                idx = d.share(next(it))
                dp.step(X[idx], y[idx])
            dt = (time.perf_counter() - t0) / steps
            if r > 0:  # the first block warms up
                times.append(dt)
                shares.append((dp.comm.seconds - a0) / steps if d.active else 0.0)
        bare = []
        if d.active:
            flat = torch.zeros(dp.comm.bytes // 4)
            for _ in range(20):
                torch.distributed.barrier()
                t0 = time.perf_counter()
                torch.distributed.all_reduce(flat)
                bare.append(time.perf_counter() - t0)
        if rank == 0 and out is not None:
            import json

            Path(out).write_text(
                json.dumps(
                    {
                        "times": times,
                        "allreduce": shares,
                        "bare": bare,
                        "bytes": dp.comm.bytes if d.active else 0,
                    }
                )
            )
    finally:
        if d.active:
            distributed.shutdown()


def run_config(lot: int, P: int, steps: int, reps: int, subset: int | None = None) -> dict:
    """One (lot, processes) configuration in fresh processes; rank 0's timings."""
    import json

    import torch.multiprocessing as mp

    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "out.json")
        if P == 0:  # plain: one process, no process group (in a fresh process, like the ranks)
            ctx = mp.get_context("fork")
            p = ctx.Process(target=_measure, args=(0, 1, lot, steps, reps, None, out, subset))
            p.start()
            p.join()
            if p.exitcode != 0:
                raise RuntimeError(f"plain run failed (exit {p.exitcode})")
        else:
            mp.start_processes(
                _measure,
                args=(P, lot, steps, reps, os.path.join(tmp, "pg"), out, subset),
                nprocs=P,
                join=True,
                start_method="fork",
            )
        return json.loads(Path(out).read_text())


def main(argv=None) -> None:
    from dpsgd.core.runtime import describe_hardware, tune_allocator

    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--lots", default="600,6000")
    ap.add_argument(
        "--processes",
        default="1,2",
        help="process counts for torch.distributed (plain is always run)",
    )
    ap.add_argument(
        "--steps",
        type=int,
        default=None,
        help="lots per repetition (default: 30 at lot 600, 5 at 6000)",
    )
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--quick", action="store_true")
    ap.add_argument(
        "--subset", type=int, default=None, help="first n training examples (tests; q = L/n)"
    )
    ap.add_argument("--out", default="results/bench_distributed.csv")
    a = ap.parse_args(argv)
    tune_allocator()
    torch.set_num_threads(1)
    rows = []
    for lot in [int(v) for v in a.lots.split(",")]:
        steps = a.steps or (2 if a.quick else max(3, 18000 // lot))
        reps = 1 if a.quick else a.reps
        plain_ms = None
        for P in [0] + [int(v) for v in a.processes.split(",")]:
            load = os.getloadavg()[0]
            res = run_config(lot, P, steps, reps, a.subset)
            step = statistics.median(res["times"])
            ar = statistics.median(res["allreduce"]) if P else 0.0
            plain_ms = step * 1e3 if P == 0 else plain_ms
            rows.append(
                {
                    "lot": lot,
                    "processes": max(P, 1),
                    "mode": "torch.distributed" if P else "plain",
                    "backend": "gloo" if P else "none",
                    "step_ms": round(step * 1e3, 3),
                    "examples_per_s": round(lot / step, 1),
                    "speedup_vs_plain": round(plain_ms / (step * 1e3), 3),
                    "allreduce_ms": round(ar * 1e3, 3) if P else "",
                    "allreduce_share": round(ar / step, 4) if P else "",
                    "allreduce_bare_ms": round(statistics.median(res["bare"]) * 1e3, 3)
                    if P
                    else "",
                    "allreduce_bytes": res["bytes"] if P else "",
                    "reps": reps,
                    "steps_per_rep": steps,
                    "threads_per_process": 1,
                    "load_avg_1min": round(load, 2),
                    "hardware": describe_hardware(),
                }
            )
            print(rows[-1], flush=True)
    write_csv(rows, Path(a.out), COLUMNS)
    print(f"wrote {a.out}")


if __name__ == "__main__":
    main()
