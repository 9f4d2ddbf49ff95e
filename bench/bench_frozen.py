"""One DP-SGD step on the paper's CIFAR-10 network with its convolutions frozen vs all trainable.

    python -m bench.bench_frozen                        # writes results/bench_frozen.csv
    python -m bench.bench_frozen --baseline a9d8d60     # also the clipping engine as of that commit

Abadi et al. 2016, §5.3: the convolutions of `CifarCNN` are pretrained on CIFAR-100 (public) and
frozen (requires_grad=False); DP-SGD trains the three dense layers with per-layer clipping,
C = 3, σ = 6, lots of L = 2000 or 4000 out of N = 50 000 training images. Methods, each on its
own copy of the network (same initial weights) and the same in-memory lot (uniform [0, 1)
24×24×3 inputs, 10 classes):

  nonprivate                   frozen convolutions, plain autograd of the mean loss + SGD
  dpsgd_ghost_frozen           frozen convolutions, `dpsgd.mechanism.optim.DPSGD.step` with the
                               ghost engine
  dpsgd_ghost_frozen_baseline  the same, clipping engine loaded from git at --baseline
  dpsgd_ghost_all              every layer trainable (k = 5 groups instead of 3)

Details: docs/PERFORMANCE.md, "bench/bench_frozen.py".
"""

from __future__ import annotations

import argparse
import functools
import importlib.util
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch
import torch.nn.functional as F

from bench import write_csv
from dpsgd.core.runtime import describe_hardware
from dpsgd.mechanism.clipping import PerExampleClipper
from dpsgd.mechanism.noise import GaussianNoise
from dpsgd.mechanism.optim import DPSGD
from dpsgd.mechanism.plan import Plan
from dpsgd.models.networks import CifarCNN

C, SIGMA, LR, N = 3.0, 6.0, 0.05, 50_000  # the paper's CIFAR-10 C and σ; N training images
COLUMNS = [
    "method",
    "frozen",
    "engine",
    "lot",
    "clipping",
    "groups",
    "step_s",
    "step_s_min",
    "step_s_max",
    "ratio_to_nonprivate",
    "ratio_min",
    "ratio_max",
    "lots_per_epoch",
    "epoch_s",
    "reps",
    "threads",
    "load_avg_1min",
    "hardware",
    "torch",
]
ROOT = Path(__file__).resolve().parents[1]


@functools.lru_cache(maxsize=None)
def clipper_at(rev: str):
    """`PerExampleClipper` of dpsgd/mechanism/clipping as committed at `rev`, imported beside the
    current one (as package dpsgd._clipping_<sha>: its relative imports of
    dpsgd.models.networks/runtime resolve)."""
    sha = subprocess.run(
        ["git", "rev-parse", "--verify", f"{rev}^{{commit}}"],
        cwd=ROOT,
        check=True,
        capture_output=True,
        text=True,
    ).stdout.strip()
    files = subprocess.run(
        ["git", "ls-tree", "--name-only", sha, "dpsgd/mechanism/clipping/"],
        cwd=ROOT,
        check=True,
        capture_output=True,
        text=True,
    ).stdout.split()
    pkg = Path(tempfile.mkdtemp(prefix="clipping_"))
    for f in files:
        if f.endswith(".py"):
            src = subprocess.run(
                ["git", "show", f"{sha}:{f}"], cwd=ROOT, check=True, capture_output=True, text=True
            ).stdout
            (pkg / Path(f).name).write_text(src)
    name = f"dpsgd._clipping_{sha[:10]}"
    spec = importlib.util.spec_from_file_location(
        name, pkg / "__init__.py", submodule_search_locations=[str(pkg)]
    )
    mod = importlib.util.module_from_spec(spec)
    sys.modules[name] = mod
    spec.loader.exec_module(mod)
    return mod.PerExampleClipper, sha[:10]


def network(frozen: bool, seed: int = 0) -> CifarCNN:
    torch.manual_seed(seed)
    model = CifarCNN(10)
    if frozen:
        model.features.requires_grad_(False)
    return model


def dp_step(lot: int, frozen: bool = True, clipper_cls=PerExampleClipper):
    """(groups k, step(x, y)): one `DPSGD.step` (per-layer ghost clipping to C, noise σC per group,
    divided by the expected lot size L) on a fresh copy of the network."""
    model = network(frozen)
    clipper = clipper_cls(model, C, "per_layer", mode="ghost")
    opt = DPSGD(model, clipper, GaussianNoise(seed=1), Plan.by_hand(SIGMA, C, lot), lr=LR)
    return len(clipper.groups), opt.step


def nonprivate_step():
    """step(x, y): plain autograd of the mean loss + SGD on a fresh copy, convolutions frozen."""
    model = network(True)
    sgd = torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=LR)

    def step(x, y):
        sgd.zero_grad(set_to_none=True)
        F.cross_entropy(model(x), y).backward()
        sgd.step()

    return step


def make_methods(lot: int, baseline: str | None):
    """name -> (frozen, engine label, groups k, step(x, y))."""
    methods = {
        "nonprivate": (True, "autograd", 0, nonprivate_step()),
        "dpsgd_ghost_frozen": (True, "working tree", *dp_step(lot)),
    }
    if baseline:
        cls, sha = clipper_at(baseline)
        methods["dpsgd_ghost_frozen_baseline"] = (True, sha, *dp_step(lot, True, cls))
    methods["dpsgd_ghost_all"] = (False, "working tree", *dp_step(lot, False))
    return methods


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--lots", default="2000,4000", help="lot sizes L, comma-separated")
    ap.add_argument("--reps", type=int, default=5, help="timed repetitions (after warm-up)")
    ap.add_argument("--warmup", type=int, default=1, help="repetitions dropped first")
    ap.add_argument(
        "--baseline", default=None, help="git revision whose clipping engine to time too"
    )
    ap.add_argument("--out", default=str(ROOT / "results" / "bench_frozen.csv"))
    args = ap.parse_args(argv)
    lots = [int(s) for s in args.lots.split(",")]
    if not lots or min(lots) < 1:
        ap.error(f"--lots={args.lots!r}: lot sizes must be positive integers")
    if args.reps < 1 or args.warmup < 0:
        ap.error(f"--reps={args.reps} must be >= 1 and --warmup={args.warmup} >= 0")
    torch.set_num_threads(1)
    load = os.getloadavg()[0]
    gen = torch.Generator().manual_seed(0)
    data = {
        L: (torch.rand(L, 3, 24, 24, generator=gen), torch.randint(0, 10, (L,), generator=gen))
        for L in lots
    }
    methods = {L: make_methods(L, args.baseline) for L in lots}
    times = {(L, m): [] for L in lots for m in methods[L]}
    for r in range(args.warmup + args.reps):
        for L in lots:
            x, y = data[L]
            for m, (*_, step) in methods[L].items():
                t0 = time.perf_counter()
                step(x, y)
                dt = time.perf_counter() - t0
                if r >= args.warmup:
                    times[L, m].append(dt)
        print(
            f"repetition {r + 1}/{args.warmup + args.reps}"
            + (" (warm-up)" if r < args.warmup else ""),
            file=sys.stderr,
            flush=True,
        )
    rows, hw = [], describe_hardware()
    for L in lots:
        base = times[L, "nonprivate"]
        for m, (frozen, engine, k, _) in methods[L].items():
            t = times[L, m]
            ratios = [a / b for a, b in zip(t, base)]
            med = statistics.median(t)
            rows.append(
                {
                    "method": m,
                    "frozen": "features" if frozen else "none",
                    "engine": engine,
                    "lot": L,
                    "clipping": "per_layer" if k else "",
                    "groups": k,
                    "step_s": f"{med:.4f}",
                    "step_s_min": f"{min(t):.4f}",
                    "step_s_max": f"{max(t):.4f}",
                    "ratio_to_nonprivate": f"{statistics.median(ratios):.3f}",
                    "ratio_min": f"{min(ratios):.3f}",
                    "ratio_max": f"{max(ratios):.3f}",
                    "lots_per_epoch": f"{N / L:g}",
                    "epoch_s": f"{N / L * med:.1f}",
                    "reps": args.reps,
                    "threads": torch.get_num_threads(),
                    "load_avg_1min": f"{load:.2f}",
                    "hardware": hw,
                    "torch": torch.__version__,
                }
            )
    write_csv(rows, Path(args.out), COLUMNS)
    for row in rows:
        print(
            f"L={row['lot']:>5} {row['method']:<28} {row['step_s']:>8} s "
            f"[{row['step_s_min']}, {row['step_s_max']}]  x{row['ratio_to_nonprivate']} "
            f"[{row['ratio_min']}, {row['ratio_max']}]  epoch {row['epoch_s']} s"
        )
    return rows


if __name__ == "__main__":
    main()
