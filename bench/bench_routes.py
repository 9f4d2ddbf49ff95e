"""What each norm route of the ghost engine costs on this CPU, per layer of today's models.

    python -m bench.bench_routes              # writes results/bench_routes.csv
    python -m bench.bench_routes --quick      # smoke run

For each layer (the convolutions of resnet18-GN at 32×32 and lot 32, the projections of the text
transformer at T = 64 and lot 128, and a few Linear shapes), the layer's rule (``LinearLayer``,
``Conv2dLayer``) runs its norms and its clipped sum on random a and b of the layer's shapes, once per
route forced through ``layers.ROUTE``: ``ghost`` (Gram form, then book-keeping; a convolution keeps
its unfolded input and forms the sum as one GEMM), ``explicit`` (per-example products in chunks,
then book-keeping) and ``kept`` (products kept for the sum). Each
is timed against the layer's plain weight gradient (one GEMM, or ``convolution_backward``) in the
same repetition, interleaved, CPU time of one thread, median over repetitions; the engine's choice
(``layers.norm_route``, ``layers.keep_pays`` at an unlimited budget) is printed beside the fastest.
"""

from __future__ import annotations

import argparse
import os
import statistics
import time
from pathlib import Path

import torch
from torch import nn

from bench import write_csv
from dpsgd.core.runtime import describe_hardware, tune_allocator
from dpsgd.mechanism.clipping import layers
from dpsgd.mechanism.clipping.layers import LinearLayer
from dpsgd.mechanism.clipping.rules.conv import Conv2dLayer

COLUMNS = ["layer", "B", "T", "d", "p", "wgrad_ms", "ghost", "explicit", "kept", "fastest",
           "engine", "loadavg_1min", "hardware"]  # fmt: skip
OUT = Path(__file__).resolve().parents[1] / "results" / "bench_routes.csv"
# route -> (layers.ROUTE, keep): ghost keeps what it may (a convolution's unfolded input, for its
# clipped sum as one GEMM), explicit forms the products for the norms only, kept keeps them
ROUTES = {"ghost": ("ghost", True), "explicit": ("explicit", False), "kept": ("explicit", True)}


def cases(quick: bool):
    """(name, module, a shape, b shape): the layers of the benchmark models (bench_models.py)."""
    B, Bt = (4, 8) if quick else (32, 128)
    T = 8 if quick else 64
    conv = [("resnet conv1 7×7/2", nn.Conv2d(3, 64, 7, 2, 3, bias=False), 32, 16),
            ("resnet layer1 3×3", nn.Conv2d(64, 64, 3, 1, 1, bias=False), 8, 8),
            ("resnet layer2.0 3×3/2", nn.Conv2d(64, 128, 3, 2, 1, bias=False), 8, 4),
            ("resnet layer2 3×3", nn.Conv2d(128, 128, 3, 1, 1, bias=False), 4, 4),
            ("resnet layer3 3×3", nn.Conv2d(256, 256, 3, 1, 1, bias=False), 2, 2),
            ("resnet layer4 3×3", nn.Conv2d(512, 512, 3, 1, 1, bias=False), 1, 1)]  # fmt: skip
    out = []
    for name, m, hw, ho in conv[:3] if quick else conv:
        out.append((name, m, (B, m.in_channels, hw, hw), (B, m.out_channels, ho, ho)))
    lin = [("transformer in_proj", 128, 384), ("transformer out_proj", 128, 128),
           ("transformer linear1", 128, 512), ("transformer linear2", 512, 128)]  # fmt: skip
    for name, d, p in lin[:2] if quick else lin:
        out.append((name, nn.Linear(d, p), (Bt, T, d), (Bt, T, p)))
    return out


def _rule(m):
    names = {"weight": "weight"} | ({"bias": "bias"} if m.bias is not None else {})
    return (Conv2dLayer if isinstance(m, nn.Conv2d) else LinearLayer)(m, names)


def _wgrad(m, a, b):
    if isinstance(m, nn.Conv2d):
        return lambda: torch.ops.aten.convolution_backward(
            b, a, m.weight, None, list(m.stride), list(m.padding), list(m.dilation), False,
            [0, 0], m.groups, [False, True, False])  # fmt: skip
    A, Bm = a.flatten(0, -2), b.flatten(0, -2)
    return lambda: Bm.t() @ A


def measure(name, m, a_shape, b_shape, reps: int, block_s: float) -> dict:
    g = torch.Generator().manual_seed(0)
    a, b = torch.randn(a_shape, generator=g), torch.randn(b_shape, generator=g)
    rule, f = _rule(m), torch.rand(a_shape[0], generator=g)
    ap, bp, k = rule.inputs(a, b, 1)

    def run(route, keep):
        def step():
            layers.ROUTE = route
            try:
                _, state = rule.sq_norms(ap, bp, keep, k)
                rule.clipped_sum(ap, bp, state, {t: f for t in rule.names}, K=k)
            finally:
                layers.ROUTE = None

        return step

    fns = {"wgrad": _wgrad(m, ap, bp)} | {r: run(*v) for r, v in ROUTES.items()}
    counts = {}
    for key, fn in fns.items():
        fn()
        t0 = time.process_time()
        fn()
        counts[key] = max(1, round(block_s / max(1e-6, time.process_time() - t0)))
    times = {key: [] for key in fns}
    for _ in range(reps):
        for key, fn in fns.items():
            t0 = time.process_time()
            for _ in range(counts[key]):
                fn()
            times[key].append((time.process_time() - t0) / counts[key])
    rel = {r: statistics.median(t / w for t, w in zip(times[r], times["wgrad"])) for r in ROUTES}
    if isinstance(m, nn.Conv2d):
        T, d, p = rule._tdp(bp, 1)
    else:
        T, d, p = a_shape[1], a_shape[2], b_shape[2]
    engine = "kept" if layers.keep_pays(T, d, p) else layers.norm_route(T, d, p)
    return {
        "layer": name, "B": a_shape[0], "T": T, "d": d, "p": p,
        "wgrad_ms": round(1e3 * statistics.median(times["wgrad"]), 3),
        **{r: round(v, 2) for r, v in rel.items()},
        "fastest": min(rel, key=rel.get), "engine": engine,
    }  # fmt: skip


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench.bench_routes", description=__doc__)
    ap.add_argument("--reps", type=int, default=7)
    ap.add_argument("--block-s", type=float, default=0.3)
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--out", type=Path, default=OUT)
    a = ap.parse_args(argv)
    if a.quick:
        a.reps, a.block_s = 2, 0.01
    torch.set_num_threads(1)
    tune_allocator()
    rows = []
    for case in cases(a.quick):
        r = measure(*case, a.reps, a.block_s)
        r.update(loadavg_1min=round(os.getloadavg()[0], 2), hardware=describe_hardware())
        rows.append(r)
        print(f"{r['layer']:24s} T={r['T']:<4d} d={r['d']:<5d} p={r['p']:<4d} weight grad "
              f"{r['wgrad_ms']:8.3f} ms  ghost {r['ghost']:5.2f}  explicit {r['explicit']:5.2f}  "
              f"kept {r['kept']:5.2f}  fastest {r['fastest']:8s} engine {r['engine']}")  # fmt: skip
    write_csv(rows, a.out, COLUMNS)
    print(f"wrote {a.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
