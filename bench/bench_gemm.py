"""Which way round to form a Linear layer's clipped weight-gradient sum on CPU.

    python -m bench.bench_gemm            # writes results/bench_gemm.csv and prints a table

The ghost engine's book-keeping sum for a Linear layer on 2-D input is one product
G = (c ⊙ b)ᵀ a, G of shape [p, d] (p outputs, d inputs, B examples). The same numbers come out of
(aᵀ (c ⊙ b))ᵀ: a [d, p] product and a transposed copy. CPU BLAS speed depends on the output's shape,
so the engine takes the transposed route when the layer widens its input p ≥ WIDE_OUTPUT·d times
(``dpsgd.mechanism.clipping.layers.transposed_weight_sum``). This script times both routes for the
weight shapes of the bench's models and a few others, interleaved (round r of every shape and route,
then round r + 1, ...), 1 torch thread, tuned allocator, as bench_step; median of the rounds after
one warm-up round.
"""

from __future__ import annotations

import argparse
import statistics
import time
from pathlib import Path

import torch

from bench import write_csv
from dpsgd.core.runtime import tune_allocator
from dpsgd.mechanism.clipping.layers import transposed_weight_sum

# (p, d): MNIST paper net, raw-784 MLP, CIFAR net's FC layers, and narrower/wider variants
SHAPES = [
    (1000, 60),
    (10, 1000),
    (1000, 784),
    (384, 2304),
    (384, 384),
    (10, 384),
    (256, 64),
    (64, 256),
    (512, 32),
    (2000, 100),
]
COLUMNS = ["p", "d", "batch", "direct_ms", "transposed_ms", "faster", "engine_uses", "threads"]


def routes(p: int, d: int, batch: int):
    a, b = torch.randn(batch, d), torch.randn(batch, p)
    return {"direct": lambda: b.t() @ a, "transposed": lambda: (a.t() @ b).t().contiguous()}


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--batch", type=int, default=600, help="examples per product (default 600)")
    ap.add_argument("--rounds", type=int, default=11, help="timed rounds after one warm-up")
    ap.add_argument("--calls", type=int, default=10, help="consecutive calls per timing")
    ap.add_argument("--out", default="results/bench_gemm.csv")
    args = ap.parse_args(argv)
    for name in ("batch", "rounds", "calls"):
        if getattr(args, name) < 1:
            ap.error(f"--{name} must be >= 1")
    torch.set_num_threads(1)
    tune_allocator()
    fns = {(p, d, r): f for p, d in SHAPES for r, f in routes(p, d, args.batch).items()}
    times = {k: [] for k in fns}
    for rnd in range(args.rounds + 1):
        for k, f in fns.items():
            t = time.perf_counter()
            for _ in range(args.calls):
                f()
            if rnd:
                times[k].append((time.perf_counter() - t) / args.calls)
    rows = []
    for p, d in SHAPES:
        direct = statistics.median(times[p, d, "direct"]) * 1e3
        trans = statistics.median(times[p, d, "transposed"]) * 1e3
        rows.append(
            dict(
                p=p,
                d=d,
                batch=args.batch,
                direct_ms=round(direct, 3),
                transposed_ms=round(trans, 3),
                faster="transposed" if trans < direct else "direct",
                engine_uses="transposed" if transposed_weight_sum(p, d) else "direct",
                threads=torch.get_num_threads(),
            )
        )
    out = Path(args.out)
    write_csv(rows, out, COLUMNS)
    print(f"{'p x d':>12} {'direct ms':>10} {'transp. ms':>11} {'faster':>11} {'engine':>11}")
    for r in rows:
        print(
            f"{r['p']:>6} x {r['d']:<4} {r['direct_ms']:>10.3f} {r['transposed_ms']:>11.3f} "
            f"{r['faster']:>11} {r['engine_uses']:>11}"
        )
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
