"""One full epoch of the paper's CIFAR-10 training (§5.3), DP and non-private, and what each preset
costs.

    # writes results/bench_cifar_epoch.csv (minutes)
    python -m bench.bench_cifar_epoch
    # a smoke run: 500 images, lots × 1/100
    python -m bench.bench_cifar_epoch --n 500 --out /tmp/x.csv

Abadi et al. 2016, §5.3: `CifarCNN` with its convolutions pretrained on CIFAR-100 (public) and
frozen, DP-SGD on the three dense layers, per-layer clipping C = 3, σ = 6, Poisson lots of expected
size L = 2000 (ε = 2) or 4000 (ε = 4, 8) out of N = 50 000 images, δ = 1e-5. Inputs are random, of
the real shape (3×24×24, uniform [0, 1), 10 classes), held in memory as training holds CIFAR-10; the
training-time augmentation is not part of the timed step. ``--n`` scales the data set and every lot
size by n/N (q unchanged), for smoke runs.

Details: docs/PERFORMANCE.md, "bench/bench_cifar_epoch.py".
"""

from __future__ import annotations

import argparse
import math
import os
import statistics
import sys
import time
from pathlib import Path

import torch

from bench import write_csv
from bench.bench_frozen import N, dp_step, network, nonprivate_step
from dpsgd.accountant import Ledger
from dpsgd.accountant.events import Poisson
from dpsgd.config.schema import TrainingConfig
from dpsgd.core.runtime import describe_hardware
from dpsgd.mechanism.sampling import PoissonSampler
from dpsgd.run.evaluate import evaluate
from experiments.claims import CIFAR10_PRESETS, DELTA

N_TEST = 10_000
COLUMNS = [
    "kind",
    "name",
    "setting",
    "lot",
    "lots",
    "examples",
    "seconds",
    "cpu_s",
    "examples_per_s",
    "ratio_to_nonprivate",
    "groups",
    "target_epsilon",
    "sigma",
    "clip_norm",
    "q",
    "accountant",
    "convention",
    "preset_lots",
    "epochs",
    "epsilon_pld_joint",
    "epoch_s",
    "eval_s",
    "eval_every",
    "projected_h",
    "n",
    "n_test",
    "reps",
    "threads",
    "load_avg_1min_start",
    "load_avg_1min_end",
    "device",
    "hardware",
    "torch",
]
ROOT = Path(__file__).resolve().parents[1]


def preset_settings() -> dict[str, dict]:
    """preset -> {lot_size, sigma, clip_norm, epsilon, epochs, accountant, convention, setting}."""
    out = {}
    for name, p in CIFAR10_PRESETS.items():
        path = ROOT / "conf" / "experiment" / f"{name}.yaml"
        if not path.exists():
            out[name] = {
                **p,
                "accountant": "moments",
                "convention": "per_tensor",
                "eval_every": 1,
                "eval_batch_size": TrainingConfig().eval_batch_size,
                "setting": "paper",
            }
            continue
        from dpsgd.launch.main import compose

        c = compose([f"experiment={name}"])
        pr, t = c.privacy, c.training
        out[name] = {
            "lot_size": pr.lot_size,
            "sigma": pr.sigma if pr.private else 0.0,
            "clip_norm": pr.clip_norm if pr.private else math.inf,
            "epsilon": pr.target_epsilon if pr.private else math.inf,
            "epochs": t.epochs,
            "accountant": c.accountant.name,
            "convention": pr.convention,
            "eval_every": t.eval_every,
            "eval_batch_size": t.eval_batch_size,
            "setting": f"conf/experiment/{name}.yaml",
        }
    return out


def time_epoch(step, X, y, lots) -> tuple[float, float, int]:
    """(wall seconds, CPU seconds, examples) of one pass of ``step`` over the lots of (X, y)."""
    t0, c0, n = time.perf_counter(), time.process_time(), 0
    for idx in lots:
        step(X[idx], y[idx])
        n += len(idx)
    return time.perf_counter() - t0, time.process_time() - c0, n


def preset_rows(settings: dict, epoch_s: dict, eval_s: float, groups: int) -> list[dict]:
    """Lots within each preset's target ε, its epochs and projected hours; ``epoch_s`` maps
    (method, L) to the measured epoch's CPU seconds."""
    rows = []
    for name, p in settings.items():
        L, private = p["lot_size"], p["sigma"] > 0
        q = L / N
        row = {
            "kind": "preset",
            "name": name,
            "setting": p["setting"],
            "lot": L,
            "sigma": p["sigma"],
            "clip_norm": p["clip_norm"],
            "q": f"{q:g}",
            "accountant": p["accountant"] if private else "none",
            "convention": p["convention"] if private else "",
            "eval_every": p["eval_every"],
        }
        if private:
            lots = Ledger().steps_within(
                p["epsilon"],
                DELTA,
                Poisson(q, p["sigma"], groups),
                p["accountant"],
                p["convention"],
            )
            if p.get("epochs"):
                lots = min(lots, math.floor(p["epochs"] / q))
            led = Ledger()
            led.record(Poisson(q, p["sigma"], groups), lots, "sgd")
            row.update(
                groups=groups,
                target_epsilon=p["epsilon"],
                preset_lots=lots,
                epsilon_pld_joint=f"{led.epsilon(DELTA, accountant='pld', convention='joint')[0]:.3f}",
            )
            epochs, per_epoch = lots * q, epoch_s[("dpsgd_ghost_frozen", L)]
        else:
            epochs, per_epoch = float(p["epochs"]), epoch_s[("nonprivate", L)]
            row.update(groups=0, preset_lots=round(epochs / q))
        row.update(
            epochs=f"{epochs:.2f}",
            epoch_s=f"{per_epoch:.2f}",
            eval_s=f"{eval_s:.2f}",
            projected_h=f"{epochs * (per_epoch + eval_s / p['eval_every']) / 3600:.2f}",
        )
        rows.append(row)
    return rows


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument(
        "--n", type=int, default=N, help="training images N (default: CIFAR-10's 50 000)"
    )
    ap.add_argument(
        "--n-test", type=int, default=N_TEST, help="test images evaluated after each epoch"
    )
    ap.add_argument("--reps", type=int, default=1, help="epochs timed per method and lot size")
    ap.add_argument("--out", default=str(ROOT / "results" / "bench_cifar_epoch.csv"))
    args = ap.parse_args(argv)
    if not 1 <= args.n <= N or args.n_test < 0 or args.reps < 1:
        ap.error(
            f"--n={args.n}, --n-test={args.n_test}, --reps={args.reps}: need 1 <= n <= {N}, "
            "n-test >= 0, reps >= 1"
        )
    settings = preset_settings()
    dp_lots = sorted({p["lot_size"] for p in settings.values() if p["sigma"] > 0})
    all_lots = sorted({p["lot_size"] for p in settings.values()})
    lot_of = {L: max(1, round(L * args.n / N)) for L in all_lots}  # a preset's L -> this run's lot
    torch.set_num_threads(1)
    load = os.getloadavg()[0]
    gen = torch.Generator().manual_seed(0)
    X, y = (
        torch.rand(args.n, 3, 24, 24, generator=gen),
        torch.randint(0, 10, (args.n,), generator=gen),
    )
    Xte, yte = (
        torch.rand(args.n_test, 3, 24, 24, generator=gen),
        torch.randint(0, 10, (args.n_test,), generator=gen),
    )
    methods, groups = {}, 0
    for L in all_lots:
        methods["nonprivate", L] = nonprivate_step()
        if L in dp_lots:
            groups, methods["dpsgd_ghost_frozen", L] = dp_step(lot_of[L])
    for (m, L), step in methods.items():  # warm-up, untimed
        step(X[: lot_of[L]], y[: lot_of[L]])
    times = {key: [] for key in methods}
    examples = {}
    for r in range(args.reps):
        for L in all_lots:
            lots = list(PoissonSampler(args.n, lot_of[L], torch.Generator().manual_seed(0)).epoch())
            for m in ("nonprivate", "dpsgd_ghost_frozen"):
                if (m, L) in methods:
                    wall, cpu, examples[m, L] = time_epoch(methods[m, L], X, y, lots)
                    times[m, L].append((wall, cpu))
                    print(
                        f"rep {r + 1}/{args.reps} L={L} {m}: {wall:.1f} s wall, {cpu:.1f} s CPU",
                        file=sys.stderr,
                        flush=True,
                    )
    model, ev = network(True), min(p["eval_batch_size"] for p in settings.values())
    t0, c0 = time.perf_counter(), time.process_time()
    evaluate(model, X, y, ev)
    if args.n_test:
        evaluate(model, Xte, yte, ev)
    eval_wall, eval_cpu = time.perf_counter() - t0, time.process_time() - c0

    rows, epoch_s = [], {}
    for (m, L), t in times.items():
        wall, cpu = statistics.median(w for w, _ in t), statistics.median(c for _, c in t)
        epoch_s[m, L] = cpu
        base = statistics.median(c for _, c in times["nonprivate", L])
        rows.append(
            {
                "kind": "epoch",
                "name": m,
                "lot": lot_of[L],
                "q": f"{lot_of[L] / args.n:g}",
                "lots": PoissonSampler(args.n, lot_of[L]).lots_per_epoch(),
                "examples": examples[m, L],
                "seconds": f"{wall:.2f}",
                "cpu_s": f"{cpu:.2f}",
                "examples_per_s": f"{examples[m, L] / cpu:.0f}",
                "ratio_to_nonprivate": f"{cpu / base:.3f}",
                "groups": groups if m != "nonprivate" else 0,
                "epoch_s": f"{cpu:.2f}",
            }
        )
    rows.append(
        {
            "kind": "eval",
            "name": "evaluate",
            "examples": args.n + args.n_test,
            "seconds": f"{eval_wall:.2f}",
            "cpu_s": f"{eval_cpu:.2f}",
            "examples_per_s": f"{(args.n + args.n_test) / eval_cpu:.0f}",
            "eval_s": f"{eval_cpu:.2f}",
        }
    )
    rows += preset_rows(settings, epoch_s, eval_cpu, groups)
    common = {
        "n": args.n,
        "n_test": args.n_test,
        "reps": args.reps,
        "threads": torch.get_num_threads(),
        "load_avg_1min_start": f"{load:.2f}",
        "load_avg_1min_end": f"{os.getloadavg()[0]:.2f}",
        "device": "cpu",
        "hardware": describe_hardware(),
        "torch": torch.__version__,
    }
    rows = [{**r, **common} for r in rows]
    write_csv(rows, Path(args.out), COLUMNS)
    for r in rows:
        what = (
            f"{r['seconds']} s wall, {r['cpu_s']} s CPU, {r['examples_per_s']} ex/s, "
            f"x{r.get('ratio_to_nonprivate', '')}"
            if r["kind"] != "preset"
            else f"{r['preset_lots']} lots = {r['epochs']} epochs, ε_pld_joint "
            f"{r.get('epsilon_pld_joint', '-')}, projected {r['projected_h']} h ({r['setting']})"
        )
        print(f"{r['kind']:6} {r['name']:20} L={r.get('lot', '')!s:>5}  {what}")
    return rows


if __name__ == "__main__":
    main()
