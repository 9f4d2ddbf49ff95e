"""Benchmark the DP step on a user's CNN through the public object (``dpsgd.PrivateTrainer``)
against non-private SGD and Opacus, at equal threads, as ratios from one run.

    python -m bench.bench_api               # writes results/bench_api.csv
    python -m bench.bench_api --quick       # smoke run

The model is a user's CNN (Conv2d, GroupNorm, ReLU, max-pool ×2, Linear) on 3×32×32 inputs, one lot
of L examples in memory, global clipping, C = 1, σ = 1. A PrivateTrainer step is one lot through
``trainer.lots.run`` (the DP step and its ledger charge, as ``fit`` runs it); non-private is
forward, mean cross-entropy, backward, SGD; Opacus (when installed: ``make bench`` installs 1.6.0)
runs through ``PrivacyEngine.make_private`` with grad_sample_mode "hooks" and "ghost". Repetitions
are interleaved (one block of steps of every method, then the next), the first dropped, and each
ratio is the median over repetitions of the method's block time over the non-private block of the
same repetition, so drifts in machine load cancel.
"""

from __future__ import annotations

import argparse
import importlib.util
import statistics
import time
import warnings
from pathlib import Path

import torch
from torch import nn

from bench import write_csv
from bench.bench_step import make_opacus
from dpsgd.core.runtime import describe_hardware
from dpsgd.workbench.trainer import PrivateTrainer

COLUMNS = ["method", "model", "lot", "threads", "step_ms", "ratio_to_nonprivate", "ratio_min",
           "ratio_max", "reps", "steps_per_rep", "torch", "opacus", "hardware"]  # fmt: skip
OUT = Path(__file__).resolve().parents[1] / "results" / "bench_api.csv"


def _example_cnn():
    """The user's CNN of examples/cnn_on_tensors.py (Conv2d, GroupNorm, ReLU, max-pool ×2,
    Linear): the benchmark measures the model the example trains."""
    path = Path(__file__).resolve().parents[1] / "examples" / "cnn_on_tensors.py"
    spec = importlib.util.spec_from_file_location("cnn_on_tensors", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.SmallCNN


UserCNN = _example_cnn()


def _nonprivate(x, y):
    torch.manual_seed(0)
    model = UserCNN()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)

    def step():
        opt.zero_grad(set_to_none=True)
        nn.functional.cross_entropy(model(x), y).backward()
        opt.step()

    return step


def _trainer(x, y):
    torch.manual_seed(0)
    t = PrivateTrainer(UserCNN(), (x, y), lot_size=len(x), clip_norm=1.0, sigma=1.0, seed=0,
                       clipping="global", threads=False)  # fmt: skip
    return lambda: t.lots.run(0, x, y)


def _opacus(mode):
    def build(x, y):
        torch.manual_seed(0)
        step = make_opacus(UserCNN(), len(x), mode)
        return lambda: step(x, y)

    return build


def methods() -> dict:
    out = {"nonprivate": _nonprivate, "private_trainer": _trainer}
    try:
        import opacus  # noqa: F401
    except ImportError:
        print("opacus not installed (make bench installs 1.6.0): its rows are left out")
        return out
    return out | {"opacus_hooks": _opacus("hooks"), "opacus_ghost": _opacus("ghost")}


def measure(lot: int, reps: int, block_s: float) -> list[dict]:
    g = torch.Generator().manual_seed(0)
    x, y = torch.randn(lot, 3, 32, 32, generator=g), torch.randint(0, 10, (lot,), generator=g)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        steps = {name: make(x, y) for name, make in methods().items()}
        counts = {}
        for name, step in steps.items():  # warm-up, and the block size from one timed step
            step()
            t0 = time.perf_counter()
            step()
            counts[name] = max(1, round(block_s / max(1e-6, time.perf_counter() - t0)))
        times = {name: [] for name in steps}
        for _ in range(reps + 1):
            for name, step in steps.items():
                t0 = time.perf_counter()
                for _ in range(counts[name]):
                    step()
                times[name].append((time.perf_counter() - t0) / counts[name])
    return _rows(times, counts, lot)


def _rows(times: dict, counts: dict, lot: int) -> list[dict]:
    base = times["nonprivate"][1:]  # the first repetition dropped
    try:
        import opacus

        opacus_version = opacus.__version__
    except ImportError:
        opacus_version = "n/a"
    rows = []
    for name, ts in times.items():
        ratios = [t / b for t, b in zip(ts[1:], base)]
        rows.append({
            "method": name, "model": "user_cnn_gn_3x32x32", "lot": lot,
            "threads": torch.get_num_threads(),
            "step_ms": round(1e3 * statistics.median(ts[1:]), 2),
            "ratio_to_nonprivate": round(statistics.median(ratios), 3),
            "ratio_min": round(min(ratios), 3), "ratio_max": round(max(ratios), 3),
            "reps": len(ratios), "steps_per_rep": counts[name], "torch": torch.__version__,
            "opacus": opacus_version, "hardware": describe_hardware(),
        })  # fmt: skip
    return rows


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--lot", type=int, default=256)
    ap.add_argument("--reps", type=int, default=9)
    ap.add_argument("--block-s", type=float, default=1.0)
    ap.add_argument("--threads", type=int, default=1, help="torch threads, every method alike")
    ap.add_argument("--quick", action="store_true", help="lot 32, 2 repetitions, short blocks")
    ap.add_argument("--out", type=Path, default=OUT)
    a = ap.parse_args(argv)
    if a.quick:
        a.lot, a.reps, a.block_s = 32, 2, 0.05
    torch.set_num_threads(a.threads)
    rows = measure(a.lot, a.reps, a.block_s)
    for r in rows:
        print(f"{r['method']:16s} {r['step_ms']:8.2f} ms  × {r['ratio_to_nonprivate']:.3f} "
              f"[{r['ratio_min']:.3f}, {r['ratio_max']:.3f}] non-private")  # fmt: skip
    if not a.quick:
        write_csv(rows, a.out, COLUMNS)
        print(f"wrote {a.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
