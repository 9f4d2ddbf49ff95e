"""The floor under ``make mnist``: what its matrix products alone take on this machine.

    python -m bench.bench_floor            # writes results/bench_floor.csv and prints the floor

``make mnist`` trains the mnist_medium preset (paper §5.2: PCA to d = 60, one layer of h = 1000 ReLU
units, 10 classes, no biases, lots of L = 600 from N = 60 000) for 10 751 lots and evaluates after
each of its 108 epochs (``results/summary.csv``, its ``steps`` and ``epochs``). Whatever the
implementation, a lot needs five GEMMs, of the same shapes for a DP step and a plain one: the two
forward products, the output layer's input gradient, and the two weight sums (clipped ones, or the
plain weight gradients; [h, d] in the orientation the engine takes, the faster one in
``bench/bench_gemm.py``); an evaluation needs the two forward products over the 60 000 training and
10 000 test rows, ``EVAL_ROWS`` at a time (``dpsgd/run/evaluate.py``). ``lot_elementwise`` is the
rest a lot cannot skip: the ReLU and its mask on the way back, the Poisson draw over N and the noise
for the h·d + 10·h weights.

Each part is timed alone, on its own operands in the order a lot uses them, at 1 and 2 torch
threads, in interleaved rounds (round r of every part and thread count, then round r + 1), median of
the rounds after one warm-up; the tuned allocator as a run has it. The floor is lots × (lot parts) +
evaluations × (evaluation part): ``make mnist`` cannot run faster on this machine without doing less
arithmetic, and start-up (imports, data, DP-PCA), Python, autograd and the accountant come on top.
Details: docs/PERFORMANCE.md, "The floor under make mnist".
"""

from __future__ import annotations

import argparse
import os
import statistics
import time
from pathlib import Path

import torch
import torch.nn.functional as F

from bench import write_csv
from dpsgd.core.runtime import describe_hardware, tune_allocator
from dpsgd.mechanism.clipping.layers import transposed_weight_sum
from dpsgd.run.evaluate import EVAL_ROWS

COLUMNS = [
    "part",
    "threads",
    "ms",
    "count",
    "seconds",
    "rounds",
    "loadavg_1min",
    "torch",
    "machine",
]
PARTS = ["lot_gemms", "lot_elementwise", "eval_gemms"]


def preset_shapes() -> dict:
    """d, h and L from the mnist_medium preset as composed (one source of the shapes)."""
    from dpsgd.launch.cli import compose

    c = compose(["experiment=mnist_medium"])
    (h,) = c.model.hidden
    return {"d": int(c.model.pca_dims), "h": int(h), "L": int(c.privacy.lot_size)}


def parts(d: int, h: int, L: int, N: int, N_test: int, classes: int = 10) -> dict:
    """name -> a callable doing that part once (module doc)."""
    g = torch.Generator().manual_seed(0)
    x = torch.randn(L, d, generator=g)
    w1 = torch.randn(h, d, generator=g) / d**0.5
    w2 = torch.randn(classes, h, generator=g) / h**0.5
    z = torch.randn(L, h, generator=g)
    r = z.relu()
    b2 = torch.randn(L, classes, generator=g)
    b1 = torch.randn(L, h, generator=g)
    rows = torch.randn(N + N_test, d, generator=g)
    noise = torch.empty(h * d + classes * h)

    def weight_sum(b, a):  # [p, d] = bᵀ a, the orientation the engine takes on the CPU
        p, dd = b.shape[1], a.shape[1]
        return (a.t() @ b).t().contiguous() if transposed_weight_sum(p, dd) else b.t() @ a

    def lot_gemms():
        F.linear(x, w1)  # forward, layer 1
        F.linear(r, w2)  # forward, layer 2
        b2 @ w2  # output layer's input gradient
        weight_sum(b1, x)  # the two weight sums
        weight_sum(b2, r)

    def lot_elementwise():
        z.relu()
        torch.ops.aten.threshold_backward(b1, r, 0)
        torch.lt(torch.rand(N, generator=g), L / N)  # the Poisson lot
        noise.normal_(generator=g)

    def eval_gemms():
        for s in range(0, len(rows), EVAL_ROWS):
            F.linear(F.linear(rows[s : s + EVAL_ROWS], w1), w2)

    return {"lot_gemms": lot_gemms, "lot_elementwise": lot_elementwise, "eval_gemms": eval_gemms}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument(
        "--lots", type=int, default=10_751, help="lots of the run (default: make mnist's)"
    )
    ap.add_argument("--evals", type=int, default=108, help="evaluations (default: make mnist's)")
    ap.add_argument("--rounds", type=int, default=7, help="timed rounds after one warm-up")
    ap.add_argument("--calls", type=int, default=50, help="lot parts per timing (evaluation: 1)")
    ap.add_argument("--threads", default="1,2", help="comma list of torch thread counts")
    ap.add_argument("--rows", type=int, default=60_000, help="training rows N (test: N / 6)")
    ap.add_argument("--out", default="results/bench_floor.csv")
    args = ap.parse_args(argv)
    for name in ("lots", "evals", "rounds", "calls", "rows"):
        if getattr(args, name) < 1:
            ap.error(f"--{name} must be >= 1")
    try:
        threads = [int(t) for t in args.threads.split(",")]
    except ValueError:
        ap.error(f"--threads={args.threads!r}: a comma list of positive integers")
    if not threads or min(threads) < 1:
        ap.error(f"--threads={args.threads!r}: a comma list of positive integers")
    tune_allocator()
    shapes = preset_shapes()
    fns = parts(**shapes, N=args.rows, N_test=args.rows // 6)
    calls = {"lot_gemms": args.calls, "lot_elementwise": args.calls, "eval_gemms": 1}
    times = {(p, t): [] for p in PARTS for t in threads}
    for r in range(args.rounds + 1):
        for t in threads:
            torch.set_num_threads(t)
            for p in PARTS:
                t0 = time.perf_counter()
                for _ in range(calls[p]):
                    fns[p]()
                if r:
                    times[p, t].append((time.perf_counter() - t0) / calls[p])
    count = {"lot_gemms": args.lots, "lot_elementwise": args.lots, "eval_gemms": args.evals}
    load, machine = round(os.getloadavg()[0], 2), describe_hardware()
    rows = []
    for t in threads:
        for p in PARTS:
            ms = 1e3 * statistics.median(times[p, t])
            rows.append({"part": p, "threads": t, "ms": round(ms, 3), "count": count[p],
                         "seconds": round(ms * count[p] / 1e3, 2), "rounds": args.rounds,
                         "loadavg_1min": load, "torch": torch.__version__,
                         "machine": machine})  # fmt: skip
        total = sum(r["seconds"] for r in rows if r["threads"] == t)
        gemms = sum(r["seconds"] for r in rows if r["threads"] == t and "gemms" in r["part"])
        rows.append({"part": "floor", "threads": t, "ms": "", "count": "",
                     "seconds": round(total, 2), "rounds": args.rounds, "loadavg_1min": load,
                     "torch": torch.__version__, "machine": machine})  # fmt: skip
        print(f"{t} thread(s): GEMMs {gemms:.1f} s + elementwise "
              f"{total - gemms:.1f} s = floor {total:.1f} s ({machine}, load {load})")  # fmt: skip
    write_csv(rows, Path(args.out), COLUMNS)
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
