"""Benchmark one training step: non-private SGD vs DP-SGD (vmap, ghost) vs Opacus (hooks, ghost).

    python -m bench.bench_step            # full protocol, writes results/bench.csv
    python -m bench.bench_step --quick    # smoke run (few repetitions, small CNN lot)
    python -m bench.bench_step --processes 1 --models mnist_pca60_mlp1000 \\
        --methods nonprivate,dpsgd_ghost

Details: docs/PERFORMANCE.md, "bench/bench_step.py".
"""

from __future__ import annotations

import argparse
import copy
import csv
import gc
import math
import os
import statistics
import subprocess
import sys
import time
import warnings
from pathlib import Path

import torch
import torch.nn.functional as F

from bench import write_csv
from dpsgd.core.runtime import set_tf32, tune_allocator
from dpsgd.mechanism.clipping import PerExampleClipper
from dpsgd.data.features import scatter_channels
from dpsgd.models.networks import MLP, CifarCNN, Linear, TanhCNN

COLUMNS = [
    "method",
    "model",
    "device",
    "lot",
    "examples_per_s",
    "ratio_to_nonprivate",
    "ratio_min",
    "ratio_max",
    "peak_mem_mb",
    "step_ms",
    "processes",
    "reps",
    "steps_per_rep",
    "threads",
    "tf32",
]
METHODS = ["nonprivate", "dpsgd_vmap", "dpsgd_ghost", "opacus_hooks", "opacus_ghost"]
C, SIGMA, LR = 1.0, 1.0, 0.05


def models(quick: bool, lot: int | None, cnn_lot: int | None):
    mlp_lot = lot or 600
    cnn = cnn_lot or (64 if quick else 600)
    return [
        ("mnist_pca60_mlp1000", lambda: MLP(60, (1000,), 10, bias=False), (60,), mlp_lot),
        ("mnist_raw784_mlp1000", lambda: MLP(784, (1000,), 10, bias=False), (784,), mlp_lot),
        ("cifar_cnn", lambda: CifarCNN(10), (3, 24, 24), cnn),
        ("mnist_tanh_cnn", lambda: TanhCNN(), (784,), cnn),  # Tramèr & Boneh's lot: 512
        # the paper's §5.3 setting: convolutions pretrained on CIFAR-100 and frozen, dense layers
        # trained
        ("cifar_cnn_frozen", lambda: _frozen_convs(CifarCNN(10)), (3, 24, 24), cnn),
        # Tramèr & Boneh's ScatterNet + linear on MNIST: 81 × 7 × 7 scattering coefficients
        (
            "scatter_linear",
            lambda: Linear(scatter_channels() * 7 * 7, 10),
            (scatter_channels() * 7 * 7,),
            mlp_lot,
        ),
    ]


def _frozen_convs(model):
    model.features.requires_grad_(False)
    return model


# ----------------------------------------------------------------------------- step builders
def make_nonprivate(model, lot):
    opt = torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=LR)

    def step(x, y):
        opt.zero_grad(set_to_none=True)
        F.cross_entropy(model(x), y).backward()
        opt.step()

    return step


def make_dpsgd(model, lot, mode):
    from dpsgd.mechanism.noise import GaussianNoise
    from dpsgd.mechanism.optim import DPSGD
    from dpsgd.mechanism.plan import Plan

    clipper = PerExampleClipper(model, C, "global", mode=mode)
    noise = GaussianNoise(seed=0, device=next(model.parameters()).device)
    dp = DPSGD(model, clipper, noise, Plan.by_hand(SIGMA, C, lot), lr=LR)

    def step(x, y):
        dp.step(x, y, physical_batch_size=lot)

    return step


def make_opacus(model, lot, mode):
    from opacus import PrivacyEngine
    from torch.utils.data import DataLoader, TensorDataset

    dev = next(model.parameters()).device
    opt = torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=LR)
    dummy = DataLoader(
        TensorDataset(torch.zeros(lot, 1), torch.zeros(lot, dtype=torch.long)), batch_size=lot
    )
    criterion = torch.nn.CrossEntropyLoss()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        engine = PrivacyEngine(accountant="rdp")
        kw = dict(
            module=model,
            optimizer=opt,
            data_loader=dummy,
            noise_multiplier=SIGMA,
            max_grad_norm=C,
            poisson_sampling=False,
            grad_sample_mode=mode,
        )
        if mode == "ghost":
            pmodel, popt, pcrit, _ = engine.make_private(criterion=criterion, **kw)
        else:
            pmodel, popt, _ = engine.make_private(**kw)
            pcrit = criterion
    pmodel.to(dev)

    def step(x, y):
        popt.zero_grad(set_to_none=True)
        loss = pcrit(pmodel(x), y)
        loss.backward()
        popt.step()

    return step


def build(method, model, lot):
    if method == "nonprivate":
        return make_nonprivate(model, lot)
    if method.startswith("dpsgd_"):
        return make_dpsgd(model, lot, method.split("_", 1)[1])
    if method.startswith("opacus_"):
        return make_opacus(model, lot, method.split("_", 1)[1])
    raise KeyError(method)


# ----------------------------------------------------------------------------- measurement
def sync(dev):
    if dev.type == "cuda":
        torch.cuda.synchronize(dev)


def timed(step, x, y, dev, n: int = 1):
    """Seconds per step over n consecutive steps (one synchronisation at each end)."""
    sync(dev)
    t0 = time.perf_counter()
    for _ in range(n):
        step(x, y)
    sync(dev)
    return (time.perf_counter() - t0) / n


def drop_step_state(model):
    """Free what a previous step left on the parameters (.grad, Opacus' grad_sample), so that every
    method's step is measured from the same state and its own gradient buffers are counted."""
    for p in model.parameters():
        for attr in ("grad", "grad_sample", "summed_grad"):
            if getattr(p, attr, None) is not None:
                setattr(p, attr, None)
    gc.collect()


def peak_mem_mb(step, x, y, dev, model):
    """CUDA: peak allocated during one step above what was allocated before it."""
    drop_step_state(model)
    sync(dev)
    base = torch.cuda.memory_allocated(dev)
    torch.cuda.reset_peak_memory_stats(dev)
    step(x, y)
    sync(dev)
    return (torch.cuda.max_memory_allocated(dev) - base) / 2**20


def cpu_peak_mem_mb(model_name, method, lot, quick):
    """CPU: peak RSS of one step above the RSS before it, in a fresh child process.

    glibc's malloc keeps freed memory for reuse, so RSS deltas inside a warm process say little;
    the child sets MALLOC_MMAP_THRESHOLD_=64 KiB so that every tensor larger than that is mapped
    on allocation and returned on free, and the peak (VmHWM) follows live tensor memory.
    """
    env = dict(os.environ, MALLOC_MMAP_THRESHOLD_="65536", MALLOC_TRIM_THRESHOLD_="65536")
    cmd = [
        sys.executable,
        "-m",
        "bench.bench_step",
        "--mem-child",
        f"{model_name}:{method}:{lot}",
        "--threads",
        str(torch.get_num_threads()),
    ] + (["--quick"] if quick else [])
    try:
        out = subprocess.run(
            cmd,
            env=env,
            capture_output=True,
            text=True,
            timeout=1800,
            cwd=Path(__file__).resolve().parents[1],
        )
        return float(out.stdout.strip().splitlines()[-1])
    except Exception:
        return float("nan")


def _status_kb(key):
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(key + ":"):
            return int(line.split()[1])
    raise KeyError(key)


def mem_child(spec, quick):
    name, method, lot = spec.split(":")
    lot = int(lot)
    factory, shape = next((f, s) for n, f, s, _ in models(quick, None, None) if n == name)
    torch.manual_seed(0)
    model = factory()
    x, y = torch.randn((lot,) + shape), torch.randint(0, 10, (lot,))
    step = build(method, model, lot)
    step(x[:1], y[:1])  # initialise libraries and caches
    drop_step_state(model)
    Path("/proc/self/clear_refs").write_text("5")  # VmHWM := current RSS
    base = _status_kb("VmRSS")
    step(x, y)
    print((_status_kb("VmHWM") - base) / 1024)


def run_model(
    name, factory, in_shape, lot, dev, methods, reps, warmup, log, quick, block_s, measure_mem=True
):
    torch.manual_seed(0)
    base = factory().to(dev)
    x = torch.randn((lot,) + in_shape, device=dev)
    y = torch.randint(0, 10, (lot,), device=dev)
    steps, nets = {}, {}
    for m in methods:
        try:
            nets[m] = copy.deepcopy(base)
            steps[m] = build(m, nets[m], lot)
        except Exception as e:  # e.g. Opacus missing or incompatible
            log(f"  {m}: unavailable ({type(e).__name__}: {e})")
    # steps per repetition: consecutive steps as a training loop runs them, enough for block_s
    per_rep = {}
    for m, step in list(steps.items()):
        try:
            step(x, y)  # first call: library set-up, ghost's check
            per_rep[m] = max(1, math.ceil(block_s / max(timed(step, x, y, dev), 1e-9)))
        except Exception as e:
            log(f"  {m}: failed ({type(e).__name__}: {e})")
            del steps[m]
    times = {m: [] for m in steps}
    for r in range(warmup + reps):
        for m, step in list(steps.items()):
            try:
                t = timed(step, x, y, dev, per_rep[m])
            except Exception as e:
                log(f"  {m}: failed ({type(e).__name__}: {e})")
                del steps[m], times[m]
                continue
            if r >= warmup:
                times[m].append(t)
        log(
            f"  rep {r + 1}/{warmup + reps}: "
            + ", ".join(
                f"{m} {1e3 * times[m][-1]:.2f} ms" for m in times if times[m] and r >= warmup
            )
        )
    if not measure_mem:
        mem = {m: float("nan") for m in steps}
    elif dev.type == "cuda":
        mem = {m: peak_mem_mb(step, x, y, dev, nets[m]) for m, step in steps.items()}
    else:
        log("  peak memory (child processes) ...")
        mem = {m: cpu_peak_mem_mb(name, m, lot, quick) for m in steps}
    med = {m: statistics.median(t) for m, t in times.items() if t}
    ref = times.get("nonprivate")
    rows = []
    for m in med:
        # paired: the median over repetitions of (this method's block ÷ the non-private block
        # of the same repetition), so drifts in machine speed between repetitions cancel
        ratio = statistics.median(t / r for t, r in zip(times[m], ref)) if ref else float("nan")
        rows.append(
            dict(
                method=m,
                model=name,
                device=dev.type,
                lot=lot,
                examples_per_s=round(lot / med[m], 1),
                ratio_to_nonprivate=round(ratio, 3),
                peak_mem_mb=round(mem[m], 1),
                step_ms=round(1e3 * med[m], 2),
                reps=len(times[m]),
                steps_per_rep=per_rep[m],
                threads=torch.get_num_threads(),
            )
        )
    return rows


def print_table(rows, out=sys.stdout):
    cols = [
        "model",
        "method",
        "device",
        "lot",
        "step_ms",
        "examples_per_s",
        "ratio_to_nonprivate",
        "peak_mem_mb",
    ]
    width = {c: max(len(c), *(len(str(r[c])) for r in rows)) for c in cols}
    print("  ".join(c.ljust(width[c]) for c in cols), file=out)
    for r in rows:
        print("  ".join(str(r[c]).ljust(width[c]) for c in cols), file=out)


class _Parser(argparse.ArgumentParser):
    def error(
        self, message
    ):  # one line naming the option, exit 2 (argparse would print the usage too)
        self.exit(2, f"{self.prog}: error: {message}\n")


def main(argv=None):
    ap = _Parser(prog="python -m bench.bench_step", description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true", help="3 reps, 1 warm-up, CNN lot 64")
    ap.add_argument("--reps", type=int, default=None, help="timed repetitions (default 9; quick 3)")
    ap.add_argument("--warmup", type=int, default=None, help="dropped repetitions (default 1)")
    ap.add_argument(
        "--block-s",
        type=float,
        default=0.5,
        help="seconds of consecutive steps per repetition (steps per repetition fixed per "
        "method from one timed step; 0 = single steps)",
    )
    ap.add_argument(
        "--threads",
        type=int,
        default=1,
        help="torch CPU threads (default 1: the machine is shared; 0 = torch default)",
    )
    ap.add_argument("--device", default="auto", help="cpu, cuda or auto (cuda when available)")
    ap.add_argument("--lot", type=int, default=None, help="lot for the MLPs (default 600)")
    ap.add_argument(
        "--lots",
        default=None,
        help="comma list of MLP lots to scan (e.g. up to the largest that fits on a GPU); "
        "a lot that runs out of memory is reported and ends the scan",
    )
    ap.add_argument(
        "--cnn-lot", type=int, default=None, help="lot for the CNN (default 600; quick 64)"
    )
    ap.add_argument("--models", default="all", help="comma list of model names, or all")
    ap.add_argument("--methods", default=",".join(METHODS), help="comma list of methods")
    ap.add_argument(
        "--tf32",
        choices=["off", "on", "default"],
        default="off",
        help="CUDA TF32 math for every method: off (as training's default tf32=false), on, "
        "or PyTorch's default (cuDNN convolutions TF32, matmuls IEEE)",
    )
    ap.add_argument(
        "--allocator",
        choices=["tuned", "default"],
        default="tuned",
        help="tuned: glibc keeps freed buffers (as dpsgd.train does), for every method; "
        "default: glibc's defaults (page faults on every large per-step buffer)",
    )
    ap.add_argument(
        "--processes",
        type=int,
        default=3,
        help="repeat the whole measurement in this many fresh processes, one after the "
        "other, and report medians with the ratio's range: a process's memory "
        "layout alone moved the MNIST ratio by up to ±0.07 here",
    )
    ap.add_argument("--out", default="results/bench.csv", help="CSV path (replaced atomically)")
    ap.add_argument("--no-mem", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--mem-child", default=None, help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.mem_child:
        torch.set_num_threads(max(1, args.threads))
        warnings.filterwarnings("ignore")
        return mem_child(args.mem_child, args.quick)
    reps = args.reps if args.reps is not None else (3 if args.quick else 9)
    warmup = args.warmup if args.warmup is not None else 1
    if reps < 1 or warmup < 0 or not args.block_s >= 0 or args.processes < 1:
        ap.error("--reps and --processes must be >= 1, --warmup >= 0 and --block-s >= 0")
    for opt, v in (("--lot", args.lot), ("--cnn-lot", args.cnn_lot)):
        if v is not None and v < 1:
            ap.error(f"{opt}={v}: a lot of at least 1 example")
    if args.lots is not None:
        try:
            lots = [int(x) for x in args.lots.split(",")]
        except ValueError:
            lots = []
        if not lots or min(lots) < 1:
            ap.error(
                f"--lots={args.lots}: a comma list of lot sizes, each at least 1 (e.g. 600,4096)"
            )
    methods = [m for m in args.methods.split(",") if m]
    bad = set(methods) - set(METHODS)
    if bad:
        ap.error(f"--methods: unknown {sorted(bad)}; choose from {METHODS}")
    chosen = models(args.quick, args.lot, args.cnn_lot)
    if args.models != "all":
        keep = set(args.models.split(","))
        unknown = keep - {n for n, *_ in chosen}
        if unknown:
            ap.error(f"--models: unknown {sorted(unknown)}; choose from {[n for n, *_ in chosen]}")
        chosen = [c for c in chosen if c[0] in keep]
    if args.processes > 1:  # checked above, so a child fails only for its own reasons
        return run_processes(args)
    if args.threads > 0:
        torch.set_num_threads(args.threads)
    tuned = tune_allocator() if args.allocator == "tuned" else False
    if args.tf32 != "default":
        set_tf32(args.tf32 == "on")
    dev = torch.device(
        "cuda"
        if args.device == "auto" and torch.cuda.is_available()
        else ("cpu" if args.device == "auto" else args.device)
    )
    warnings.filterwarnings("ignore", module="opacus")
    warnings.filterwarnings("ignore", message="Full backward hook")  # Opacus ghost, harmless

    def log(msg):
        print(msg, file=sys.stderr, flush=True)

    if args.lots:
        chosen = [c for c in chosen if "cnn" not in c[0]] if args.models == "all" else chosen
        scan = []
        for name, factory, shape, _ in chosen:
            for lot in (int(v) for v in args.lots.split(",")):
                scan.append((name, factory, shape, lot))
        chosen = scan
    log(
        f"torch {torch.__version__}, device {dev}, threads {torch.get_num_threads()}, reps {reps} "
        f"after {warmup} warm-up, blocks of {args.block_s} s, allocator tuned: {tuned}, tf32 "
        f"{args.tf32}"
    )
    rows, oom = [], set()
    for name, factory, shape, lot in chosen:
        if name in oom:
            continue
        log(f"{name} (lot {lot})")
        try:
            got = run_model(
                name,
                factory,
                shape,
                lot,
                dev,
                methods,
                reps,
                warmup,
                log,
                args.quick,
                args.block_s,
                measure_mem=not args.no_mem,
            )
            rows += got
            write_csv(
                _finished(rows, args.tf32, dev), Path(args.out), COLUMNS
            )  # what a timeout would lose
            if args.lots and not any(r["method"] != "nonprivate" for r in got):
                oom.add(name)  # no DP method ran at this lot: end the scan
        except torch.OutOfMemoryError as e:
            log(f"  out of memory at lot {lot}: {str(e).splitlines()[0]}")
            oom.add(name)
            torch.cuda.empty_cache()
    write_rows(_finished(rows, args.tf32, dev), Path(args.out))
    log(f"wrote {args.out}")


def _finished(rows, tf32, dev):
    """The rows of one process with the columns its aggregation over processes would fill."""
    for r in rows:
        r["tf32"] = tf32 if dev.type == "cuda" else "n/a"
        r.update(
            processes=1, ratio_min=r["ratio_to_nonprivate"], ratio_max=r["ratio_to_nonprivate"]
        )
    return rows


def write_rows(rows, out: Path):
    write_csv(rows, out, COLUMNS)
    print_table(rows)


def run_processes(args):
    """The whole protocol in args.processes fresh processes, one after the other; per (model, lot,
    method): median step time, median and range of the in-process ratio to non-private SGD.
    Peak memory comes from the first process (it is deterministic)."""
    import tempfile

    opts = {
        "--reps": args.reps,
        "--warmup": args.warmup,
        "--block-s": args.block_s,
        "--threads": args.threads,
        "--device": args.device,
        "--lot": args.lot,
        "--lots": args.lots,
        "--cnn-lot": args.cnn_lot,
        "--models": args.models,
        "--methods": args.methods,
        "--tf32": args.tf32,
        "--allocator": args.allocator,
    }
    base = [sys.executable, "-m", "bench.bench_step", "--processes", "1"]
    base += ["--quick"] if args.quick else []
    base += [str(v) for opt, val in opts.items() if val is not None for v in (opt, val)]
    runs = []
    with tempfile.TemporaryDirectory() as tmp:
        for i in range(args.processes):
            print(f"== process {i + 1}/{args.processes}", file=sys.stderr, flush=True)
            path = Path(tmp) / f"p{i}.csv"
            child = subprocess.run(
                base + ["--out", str(path)] + (["--no-mem"] if i else []),
                cwd=Path(__file__).resolve().parents[1],
            )
            if child.returncode:  # it printed its own error: that line, and its exit code
                raise SystemExit(child.returncode)
            with path.open() as f:
                runs.append(list(csv.DictReader(f)))
    rows = []
    for r0 in runs[0]:
        key = (r0["model"], r0["lot"], r0["method"])
        same = [r for run in runs for r in run if (r["model"], r["lot"], r["method"]) == key]
        ms = statistics.median(float(r["step_ms"]) for r in same)
        ratios = [float(r["ratio_to_nonprivate"]) for r in same]
        rows.append(
            dict(
                r0,
                step_ms=round(ms, 3),
                examples_per_s=round(int(r0["lot"]) / ms * 1e3, 1),
                ratio_to_nonprivate=round(statistics.median(ratios), 3),
                ratio_min=min(ratios),
                ratio_max=max(ratios),
                processes=len(same),
                steps_per_rep=int(statistics.median(int(r["steps_per_rep"]) for r in same)),
            )
        )
    write_rows(rows, Path(args.out))
    print(f"wrote {args.out}", file=sys.stderr)


if __name__ == "__main__":
    main()
