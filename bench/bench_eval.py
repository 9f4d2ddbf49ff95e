"""Evaluation of the MNIST network with and without row chunks
(``dpsgd/run/evaluate.py:EVAL_ROWS``).

    python -m bench.bench_eval [--reps 9] [--out results/bench_eval.csv]

One epoch's evaluation as a run makes it (``evaluate`` on 60 000 training rows and 10 000 test rows,
``training.eval_batch_size`` = 10 000, one thread) of the paper's network (PCA-60 → 1000 ReLU → 10,
no biases, its initialisation) on Gaussian inputs of the projected data's scale, for each row chunk:
one forward pass per batch (the code before the chunks) and 256, 1024 (the default) and 4096 rows.
The settings alternate within each repetition, so background load hits them alike; medians over
``--reps``. Every setting must return the very same (loss, accuracy) as one pass per batch, or the
benchmark stops (the chunks may not move a metric).
"""

from __future__ import annotations

import argparse
import os
import statistics
import time
from pathlib import Path

import torch

from bench import write_csv
from dpsgd.run import evaluate as ev
from dpsgd.core.runtime import describe_hardware
from dpsgd.models.networks import MLP

ROOT = Path(__file__).resolve().parents[1]
COLUMNS = ["rows_per_pass", "seconds_per_epoch", "reps", "same_metrics", "loadavg_1min", "machine"]
WHOLE = 10**9  # larger than any batch: one forward pass per batch


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--reps", type=int, default=9)
    ap.add_argument("--out", type=Path, default=ROOT / "results" / "bench_eval.csv")
    a = ap.parse_args(argv)
    torch.set_num_threads(1)
    torch.manual_seed(0)
    model = MLP(60, (1000,), 10, bias=False)
    Xtr, ytr = torch.randn(60_000, 60) * 3, torch.randint(0, 10, (60_000,))
    Xte, yte = torch.randn(10_000, 60) * 3, torch.randint(0, 10, (10_000,))
    settings = [WHOLE, 256, 1024, 4096]
    times = {r: [] for r in settings}
    ref = None
    load = os.getloadavg()[0]
    try:
        for _ in range(a.reps):
            for rows in settings:
                ev.EVAL_ROWS = rows
                t = time.perf_counter()
                got = (ev.evaluate(model, Xtr, ytr, 10_000), ev.evaluate(model, Xte, yte, 10_000))
                times[rows].append(time.perf_counter() - t)
                ref = got if ref is None else ref
                if got != ref:
                    raise SystemExit(
                        f"EVAL_ROWS={rows}: the metrics differ from one pass per batch"
                    )
    finally:
        ev.EVAL_ROWS = 1024
    machine = describe_hardware()
    rows = [
        {
            "rows_per_pass": "whole batch" if r == WHOLE else r,
            "seconds_per_epoch": round(statistics.median(ts), 4),
            "reps": a.reps,
            "same_metrics": True,
            "loadavg_1min": round(load, 2),
            "machine": machine,
        }
        for r, ts in times.items()
    ]
    write_csv(rows, a.out, COLUMNS)
    for r in rows:
        print(f"{r['rows_per_pass']!s:>12}  {r['seconds_per_epoch']:.4f} s per epoch")
    print(f"wrote {a.out}")


if __name__ == "__main__":
    main()
