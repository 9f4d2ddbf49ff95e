"""``make gpu-check``: a CUDA machine, even an offline node, from a bare checkout to GPU results
within 8 minutes.

    python3 -m bench.gpu_check                        # on the GPU machine (make gpu-check)
    # also copy the outputs there (make gpu-check GPU_OUT=...)
    python3 -m bench.gpu_check --out-dir /tmp/out
    # the CPU rehearsal, tiny settings (make gpu-check DEVICE=cpu)
    .venv/bin/python -m bench.gpu_check --device cpu

Details: docs/PERFORMANCE.md, "bench/gpu_check.py".
"""

from __future__ import annotations

import argparse
import collections
import csv
import json
import math
import os
import re
import shutil
import signal
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field
from datetime import datetime, timezone
from pathlib import Path
from typing import Callable

REPO = Path(__file__).resolve().parents[1]
GUARD = Path(__file__).resolve().parent / "gpu_check_site"
TOTAL_S = 480.0
SETUP_S = 120.0  # at most, for each part of the setup (install, data, versions)
# top-level import names that only the private target folder may provide: the wheelhouse's, and
# packages this machine's venv may hold that the GPU image lacks and that are not carried
NOT_CARRIED = ("submitit", "hydra_plugins")
CHECK_COLUMNS = ["step", "name", "status", "seconds", "budget_s", "note", "device", "torch"]
BENCH_EXTRA = ["device_name", "torch", "cuda"]


# ----------------------------------------------------------------------------- plan and budget
@dataclass
class Outcome:
    status: str  # passed | failed | cannot (the device cannot do it; not a failure)
    note: str = ""


@dataclass
class Step:
    key: str
    name: str
    budget_s: float
    run: Callable[[float], Outcome] = field(repr=False, default=None)


class Clock:
    """Seconds since the check started, against its total budget."""

    def __init__(self, total_s: float, now: Callable[[], float] = time.monotonic):
        self.total_s, self._now, self._t0 = total_s, now, now()

    def elapsed(self) -> float:
        return self._now() - self._t0

    def left(self) -> float:
        return self.total_s - self.elapsed()


def run_plan(steps: list[Step], clock: Clock, say: Callable[[str], None]) -> list[dict]:
    """Run each step whose budget fits in what is left of the total, in order; one row per step."""
    rows = []
    for s in steps:
        left = clock.left()
        if s.budget_s > left:
            say(
                f"({s.key}) {s.name}: skipped, its budget of {s.budget_s:.0f} s is over the "
                f"{max(left, 0):.0f} s left of {clock.total_s:.0f} s"
            )
            rows.append(
                dict(
                    step=s.key,
                    name=s.name,
                    status="skipped",
                    seconds=0.0,
                    budget_s=s.budget_s,
                    note=f"over budget: {max(left, 0):.0f} s left",
                )
            )
            continue
        say(f"({s.key}) {s.name}: budget {s.budget_s:.0f} s")
        t0 = clock.elapsed()
        try:
            out = s.run(s.budget_s)
        except Exception as e:  # a bug in the step itself: it failed, the rest runs
            out = Outcome("failed", f"{type(e).__name__}: {e}")
        dt = clock.elapsed() - t0
        say(
            f"({s.key}) {s.name}: {out.status} in {dt:.1f} s"
            + (f": {out.note}" if out.note else "")
        )
        rows.append(
            dict(
                step=s.key,
                name=s.name,
                status=out.status,
                seconds=round(dt, 1),
                budget_s=s.budget_s,
                note=out.note,
            )
        )
    return rows


def verdict(rows: list[dict]) -> tuple[int, str]:
    """Exit status and the closing line."""
    failed = [f"({r['step']}) {r['name']}" for r in rows if r["status"] == "failed"]
    if failed:
        return 1, "gpu-check: FAILED: " + ", ".join(failed)
    skipped = [f"({r['step']})" for r in rows if r["status"] == "skipped"]
    return 0, "gpu-check: passed" + (
        f" (skipped over budget: {' '.join(skipped)})" if skipped else ""
    )


# ----------------------------------------------------------------------------- processes
class Log:
    """Every line to the console and to the log file, driver lines with the elapsed time."""

    def __init__(self, path: Path, clock: Clock):
        path.parent.mkdir(parents=True, exist_ok=True)
        self.path, self.clock, self.f = path, clock, open(path, "w", buffering=1)
        self.lock = threading.Lock()

    def __call__(self, line: str) -> None:
        self.raw(f"[{self.clock.elapsed():6.1f} s] {line}")

    def raw(self, line: str) -> None:
        with self.lock:
            print(line, flush=True)
            self.f.write(line + "\n")


def stream(
    cmd: list[str], env: dict, timeout: float, log: Log, cwd: Path = REPO
) -> tuple[int | None, list[str]]:
    """Run ``cmd``, its output line by line into the log; (exit status or None when stopped at
    ``timeout``, its last 200 lines). The whole process group is stopped at the timeout."""
    log.raw("    $ " + " ".join("<script>" if "\n" in c else c for c in cmd))
    p = subprocess.Popen(
        cmd,
        cwd=cwd,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        errors="replace",
        start_new_session=True,
    )
    tail: collections.deque = collections.deque(maxlen=200)

    def pump():
        for line in p.stdout:
            tail.append(line.rstrip("\n"))
            log.raw("    " + line.rstrip("\n"))

    t = threading.Thread(target=pump, daemon=True)
    t.start()
    try:
        rc = p.wait(timeout=max(timeout, 1.0))
    except subprocess.TimeoutExpired:
        os.killpg(p.pid, signal.SIGKILL)
        p.wait()
        rc = None
    t.join(10)
    return rc, list(tail)


def child_env(site: Path, hide: list[str], device: str) -> dict:
    """The environment of every process the check starts: the target folder first, the guards, no
    pip index or configuration, unbuffered output."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("PIP_")}
    path = [str(site), str(GUARD), str(REPO)] + (
        [env["PYTHONPATH"]] if env.get("PYTHONPATH") else []
    )
    env.update(
        PYTHONPATH=os.pathsep.join(path),
        PYTHONUNBUFFERED="1",
        PIP_CONFIG_FILE=os.devnull,
        PIP_NO_INDEX="1",
        PIP_DISABLE_PIP_VERSION_CHECK="1",
        HF_HUB_OFFLINE="1",
        DPSGD_GPU_CHECK_SITE=str(site),
        DPSGD_GPU_CHECK_HIDE=",".join(hide),
    )
    if device == "cpu":
        env.setdefault("OMP_NUM_THREADS", "1")  # the rehearsal runs on shared small machines
    return env


def _last(lines: list[str], pattern: str = r"\S") -> str:
    return next((ln.strip() for ln in reversed(lines) if re.search(pattern, ln)), "")


# ----------------------------------------------------------------------------- setup
def hidden_names() -> list[str]:
    from bench.wheelhouse import WHEELS

    return sorted({n for names, _ in WHEELS.values() for n in names} | set(NOT_CARRIED))


def install(py: str, wheels: Path, site: Path, env: dict, log: Log, timeout: float) -> None:
    """``wheels``' pins, offline, into the fresh folder ``site``; then each carried package must be
    imported from there."""
    from bench.wheelhouse import WHEELS

    req = wheels / "requirements.txt"
    if not req.is_file():
        raise SetupError(
            f"{req} is missing: run make wheelhouse (with network) and carry .whl/ here"
        )
    if site.exists() and any(site.iterdir()):
        raise SetupError(f"--target {site} is not empty: the install needs a fresh folder")
    rc, tail = stream(
        [
            py,
            "-m",
            "pip",
            "install",
            "-q",
            "--no-index",
            "--no-deps",
            "--no-cache-dir",
            "--find-links",
            str(wheels),
            "--target",
            str(site),
            "-r",
            str(req),
        ],
        env,
        timeout,
        log,
    )
    if rc != 0:
        raise SetupError(f"offline install from {wheels} failed: {_last(tail)}")
    probe = (
        "import importlib, importlib.metadata as m, json, sys\n"
        f"names = {[n for names, _ in WHEELS.values() for n in names]!r}\n"
        "files = {n: getattr(importlib.import_module(n), '__file__', None) or "
        "list(importlib.import_module(n).__path__)[0] for n in names}\n"
        f"print(json.dumps({{'files': files, 'versions': {{d: m.version(d) for d in "
        f"{list(WHEELS)!r}}}}}))"
    )
    rc, tail = stream([py, "-c", probe], env, timeout, log)
    if rc != 0:
        raise SetupError(f"a carried package does not import: {_last(tail)}")
    got = json.loads(_last(tail, r"^\{"))
    outside = [
        n for n, f in got["files"].items() if not Path(f).resolve().is_relative_to(site.resolve())
    ]
    if outside:
        raise SetupError(f"imported from outside {site}: {', '.join(outside)}")
    log(
        f"installed offline into {site}: "
        + ", ".join(f"{d} {v}" for d, v in got["versions"].items())
    )


VERSIONS = r"""
import json, platform, shutil, subprocess, sys
import torch
from dpsgd.core.runtime import describe_hardware
dev = sys.argv[1]
info = {"python": platform.python_version(), "torch": torch.__version__, "cuda": torch.version.cuda,
        "cudnn": torch.backends.cudnn.version(), "cpu": describe_hardware()}
if dev == "cuda":
    if not torch.cuda.is_available():
        print(json.dumps(dict(info, error="torch.cuda.is_available() is False: no usable CUDA device"))); sys.exit(0)
    p = torch.cuda.get_device_properties(0)
    info.update(device_name=p.name, capability=f"{p.major}.{p.minor}", memory_gib=round(p.total_memory / 2**30, 1),
                devices=torch.cuda.device_count())
    try:
        v = torch.cuda.nccl.version()
        info["nccl"] = ".".join(map(str, v)) if isinstance(v, tuple) else str(v)
    except Exception as e:          # a build without NCCL: step (d) will say so
        info["nccl"] = f"unavailable ({type(e).__name__})"
    if shutil.which("nvidia-smi"):
        q = subprocess.run(["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"],
                           capture_output=True, text=True)
        info["driver"] = q.stdout.strip().splitlines()[0] if q.returncode == 0 and q.stdout.strip() else "?"
else:
    info["device_name"] = describe_hardware()
print(json.dumps(info))
"""


class SetupError(Exception):
    pass


def setup(ctx: "Ctx", wheels: Path, site: Path, clock: Clock) -> dict:
    """Each part stops at SETUP_S or at the end of the total budget, whichever comes first."""
    install(ctx.py, wheels, site, ctx.env, ctx.log, min(SETUP_S, clock.left()))
    if "DPSGD_DATA_SOURCE" not in ctx.env and (wheels / "data").is_dir():
        ctx.env["DPSGD_DATA_SOURCE"] = str(wheels / "data")
    rc, tail = stream(
        [ctx.py, "-m", "dpsgd.data", "mnist", "--no-download"],
        ctx.env,
        min(SETUP_S, clock.left()),
        ctx.log,
    )
    if rc != 0:
        raise SetupError(f"MNIST: {_last(tail)}")
    rc, tail = stream(
        [ctx.py, "-c", VERSIONS, ctx.device], ctx.env, min(SETUP_S, clock.left()), ctx.log
    )
    if rc != 0:
        raise SetupError(f"torch does not start: {_last(tail)}")
    info = json.loads(_last(tail, r"^\{"))  # a warning may follow it
    if "error" in info:
        raise SetupError(f"--device cuda: {info['error']} (the CPU rehearsal is --device cpu)")
    ctx.log("device: " + ", ".join(f"{k} {v}" for k, v in info.items()))
    return info


# ----------------------------------------------------------------------------- the steps
@dataclass
class Ctx:
    py: str
    device: str
    env: dict
    log: Log
    work: Path
    results: Path
    info: dict = field(default_factory=dict)
    outputs: list = field(default_factory=list)  # files worth copying to --out-dir


def step_tests(ctx: Ctx, budget: float) -> Outcome:
    rc, tail = stream(
        [ctx.py, "-m", "pytest", "tests/e2e/test_cuda.py", "-q", "-p", "no:cacheprovider"],
        ctx.env,
        budget,
        ctx.log,
    )
    summary = _last(tail, r"\d+ (passed|failed|skipped|error)")
    if rc is None:
        return Outcome("failed", f"stopped at its budget of {budget:.0f} s")
    if rc != 0:
        return Outcome("failed", summary or _last(tail))
    if ctx.device == "cuda" and "passed" not in summary:
        return Outcome("failed", f"nothing ran on the device: {summary}")
    return Outcome(
        "passed", summary + (" (no CUDA: the CPU rehearsal)" if ctx.device == "cpu" else "")
    )


# device -> lots (in order), models, bench_step options, seconds each lot is expected to take
BENCH = {
    "cuda": dict(
        lots=(600, 4096),
        models="mnist_pca60_mlp1000,cifar_cnn,cifar_cnn_frozen,scatter_linear",
        opts=["--reps", "5", "--warmup", "1", "--block-s", "0.2"],
        lot_s=70.0,
    ),
    "cpu": dict(
        lots=(16,),
        models="mnist_pca60_mlp1000,cifar_cnn,cifar_cnn_frozen,scatter_linear",
        opts=["--reps", "1", "--warmup", "0", "--block-s", "0", "--no-mem"],
        lot_s=40.0,
    ),
}


def step_bench(ctx: Ctx, budget: float) -> Outcome:
    """One bench_step process per lot, each only if its expected time fits in what is left of the
    step's budget; the rows of every lot in one CSV. A lot stopped at the budget keeps the models it
    finished (bench_step rewrites its CSV after each) and is noted, not failed; a method missing
    everywhere fails."""
    from bench.bench_step import COLUMNS, METHODS

    b, t0, rows, notes, failed = BENCH[ctx.device], time.monotonic(), [], [], False
    for lot in b["lots"]:
        left = budget - (time.monotonic() - t0)
        if b["lot_s"] > left:
            ctx.log(
                f"(b) lot {lot}: skipped, expected {b['lot_s']:.0f} s, {left:.0f} s left of the "
                "step's budget"
            )
            notes.append(f"lot {lot} skipped")
            continue
        out = ctx.work / f"bench_lot{lot}.csv"
        rc, tail = stream(
            [
                ctx.py,
                "-m",
                "bench.bench_step",
                "--processes",
                "1",
                "--device",
                ctx.device,
                "--models",
                b["models"],
                "--methods",
                ",".join(METHODS),
                "--lot",
                str(lot),
                "--cnn-lot",
                str(lot),
                *b["opts"],
                "--out",
                str(out),
            ],
            ctx.env,
            left,
            ctx.log,
        )
        got = list(csv.DictReader(out.open())) if out.is_file() else []
        rows += got
        if rc is None:  # over the step's budget: what it finished is kept, not a failure
            notes.append(f"lot {lot}: stopped at the step's budget")
        elif rc != 0:
            failed = True
            notes.append(f"lot {lot}: {_last(tail)}")
        incomplete = {m for m in METHODS if not any(r["method"] == m for r in got)}
        if rc == 0 and incomplete:
            failed = True
            notes.append(f"lot {lot}: no row for {', '.join(sorted(incomplete))}")
        notes.append(f"lot {lot}: {len(got)} rows")
    extra = dict(
        device_name=ctx.info.get("device_name", ""),
        torch=ctx.info.get("torch", ""),
        cuda=ctx.info.get("cuda") or "",
    )
    path = ctx.results / f"bench_{ctx.device}_step.csv"
    if rows:
        from bench import write_csv

        write_csv([dict(r, **extra) for r in rows], path, COLUMNS + BENCH_EXTRA)
        ctx.outputs.append(path)
        notes.append(f"wrote {path.name}")
    return Outcome("failed" if failed or not rows else "passed", "; ".join(notes))


TRAIN_TINY = [
    "dataset.subset=1200",
    "privacy.lot_size=60",
    "model.hidden=[16]",
    "model.pca_dims=10",
    "training.epochs=2",
    "training.eval_batch_size=2000",
]


def step_mnist(ctx: Ctx, budget: float) -> Outcome:
    run = ctx.work / "mnist_medium"
    args = ["experiment=mnist_medium", f"device={ctx.device}", f"hydra.run.dir={run}"]
    args += TRAIN_TINY if ctx.device == "cpu" else []
    t0 = time.monotonic()
    rc, tail = stream([ctx.py, "-m", "dpsgd.train", *args], ctx.env, budget, ctx.log)
    wall = time.monotonic() - t0
    if rc is None:
        return Outcome("failed", f"stopped at its budget of {budget:.0f} s")
    if rc != 0:
        return Outcome("failed", _last(tail))
    rows = list(csv.DictReader((run / "metrics.csv").open()))
    last = rows[-1]
    for name in ("metrics.csv", "privacy.json"):
        copy = ctx.work / f"mnist_medium_{name}"
        shutil.copyfile(run / name, copy)
        ctx.outputs.append(copy)
    return Outcome(
        "passed",
        f"wall {wall:.1f} s (training {float(last['wall_time_s']):.1f} s), {last['steps']} lots, "
        f"test accuracy {float(last['test_accuracy']):.4f}, epsilon {float(last['epsilon']):.3f} "
        f"(PLD joint {float(last['epsilon_pld_joint']):.3f})"
        + (" (tiny settings)" if ctx.device == "cpu" else ""),
    )


DIST_ARGS = [
    "dataset.subset=1200",
    "privacy.lot_size=60",
    "model.hidden=[50]",
    "training.epochs=2",
    "privacy.sigma=2",
    "seed=5",
    "training.eval_batch_size=2000",
]
# NCCL's refusal of two ranks on one GPU: the reason the step cannot run there, not a failure
NCCL_CANNOT = r"Duplicate GPU detected|ncclInvalidUsage|invalid usage"


def step_torchrun(ctx: Ctx, budget: float) -> Outcome:
    t0 = time.monotonic()
    args = DIST_ARGS + [f"device={ctx.device}"]
    one, two = ctx.work / "dist_one", ctx.work / "dist_two"
    env = dict(ctx.env, NCCL_DEBUG=ctx.env.get("NCCL_DEBUG", "WARN"))  # NCCL says why it refuses
    rc, tail = stream(
        [ctx.py, "-m", "dpsgd.train", *args, f"hydra.run.dir={one}"], ctx.env, budget, ctx.log
    )
    if rc != 0:
        return Outcome(
            "failed", "1 process: " + ("stopped at the budget" if rc is None else _last(tail))
        )
    left = budget - (time.monotonic() - t0)
    rc, tail = stream(
        [
            ctx.py,
            "-m",
            "torch.distributed.run",
            "--standalone",
            "--nproc_per_node=2",
            "-m",
            "dpsgd.train",
            *args,
            f"hydra.run.dir={two}",
        ],
        env,
        left,
        ctx.log,
    )
    if rc is None:
        return Outcome("failed", "2 processes: stopped at the budget")
    if rc != 0:
        why = _last(tail, NCCL_CANNOT)
        if ctx.device == "cuda" and why:
            return Outcome("cannot", f"NCCL refuses 2 processes on one GPU: {why[:300]}")
        return Outcome("failed", "2 processes: " + _last(tail))
    left = budget - (time.monotonic() - t0)
    rc, tail = stream(
        [ctx.py, "-m", "bench.gpu_check", "--compare", str(one), str(two)], ctx.env, left, ctx.log
    )
    return Outcome("passed" if rc == 0 else "failed", _last(tail))


def compare_runs(one: Path, two: Path) -> tuple[bool, str]:
    """A 2-process run against the 1-process run of the same config: what
    tests/run/test_distributed.py checks on the CPU, here on the device. Returns (equal, one
    line)."""
    import torch

    from dpsgd.run.checkpoint import load_checkpoint

    a, b = load_checkpoint(one), load_checkpoint(two)
    pa, pb = (json.loads((r / "privacy.json").read_text()) for r in (one, two))
    exact = {  # exact: the same seeded generators, the same integer counts, the same accounting
        "lots (sampler state)": torch.equal(a["sampler"]["generator"], b["sampler"]["generator"]),
        "noise draws (generator state)": torch.equal(a["noise"]["state"], b["noise"]["state"]),
        "ledger": a["ledger"] == b["ledger"] and a["steps"] == b["steps"] > 0,
        "epsilon": pa["epsilon_by_accountant"] == pb["epsilon_by_accountant"],
        "2 processes recorded": pb["distributed"]["world_size"] == 2,
    }
    # float32: the all-reduce adds the two shares' clipped sums in another order than one process
    # (tests/run/test_distributed.py: atol 1e-6 on the CPU); cuBLAS also picks kernels by batch
    # shape, so on CUDA each rank's half-lot is reduced in yet another order: 1e-5 there
    atol = 1e-6 if pb["distributed"]["backend"] == "gloo" else 1e-5
    diff = max(
        float((a["model"][k].double() - b["model"][k].double()).abs().max()) for k in a["model"]
    )
    bad = [k for k, ok in exact.items() if not ok] + (
        [f"parameters (max |diff| {diff:.2e} > {atol:g})"] if diff > atol else []
    )
    backend = pb["distributed"]["backend"]
    if bad:
        return False, f"2 processes ({backend}) differ from 1 process in: {', '.join(bad)}"
    return True, (
        f"2 processes ({backend}) = 1 process: same lots, noise, ledger, epsilon; "
        f"parameters within {diff:.1e} (atol {atol:g}), {a['steps']} lots"
    )


def plan(ctx: Ctx) -> list[Step]:
    """The steps in order, most valuable first, with their budgets (seconds)."""
    budgets = {"cuda": (100, 150, 90, 80), "cpu": (60, 90, 90, 150)}[ctx.device]
    steps = [
        ("a", "tests/e2e/test_cuda.py", step_tests),
        ("b", "step benchmark", step_bench),
        ("c", "experiment=mnist_medium", step_mnist),
        ("d", "torchrun, 2 processes vs 1", step_torchrun),
    ]
    return [
        Step(k, n, float(b), (lambda f: lambda t: f(ctx, t))(f))
        for (k, n, f), b in zip(steps, budgets)
    ]


# ----------------------------------------------------------------------------- main
class _Parser(argparse.ArgumentParser):
    def error(self, message):  # one line naming the option, exit 2
        self.exit(2, f"error: {message}\n")


def main(argv=None) -> int:
    ap = _Parser(prog="python -m bench.gpu_check", description=__doc__.split("\n\n")[0])
    ap.add_argument(
        "--device",
        choices=["cuda", "cpu"],
        default="cuda",
        help="cpu: the rehearsal, tiny settings",
    )
    ap.add_argument(
        "--wheels",
        default=str(REPO / ".whl"),
        help="the wheelhouse (make wheelhouse; default .whl/)",
    )
    ap.add_argument(
        "--target",
        default=None,
        help="fresh folder for the offline install (default: in the work folder)",
    )
    ap.add_argument(
        "--work", default=None, help="work folder (default outputs/gpu_check/<UTC time>)"
    )
    ap.add_argument(
        "--results",
        default=None,
        help="where the CSVs and the log go (default results/ on CUDA, the work folder on the CPU)",
    )
    ap.add_argument(
        "--out-dir",
        default=None,
        help="copy the log, CSVs and mnist_medium's files there too (GPU_OUT)",
    )
    ap.add_argument(
        "--total-s", type=float, default=TOTAL_S, help="the whole check's budget in seconds"
    )
    ap.add_argument("--compare", nargs=2, metavar="RUN", help=argparse.SUPPRESS)
    a = ap.parse_args(argv)
    if a.compare:
        ok, line = compare_runs(Path(a.compare[0]), Path(a.compare[1]))
        print(line)
        return 0 if ok else 1
    if not (math.isfinite(a.total_s) and a.total_s > 0):
        ap.error(f"--total-s={a.total_s}: a positive number of seconds")
    clock = Clock(a.total_s)
    stamp = datetime.now(timezone.utc).strftime("%Y-%m-%dT%H%M%S")
    work = Path(a.work or REPO / "outputs" / "gpu_check" / f"{stamp}_{a.device}").resolve()
    results = Path(a.results or (REPO / "results" if a.device == "cuda" else work)).resolve()
    site = Path(a.target).resolve() if a.target else work / "site"
    try:
        for folder, opt in ((work, "--work"), (results, "--results")):
            folder.mkdir(parents=True, exist_ok=True)
            probe = folder / f".gpu_check_write_test_{os.getpid()}"
            probe.write_bytes(b"")
            probe.unlink()
    except OSError as e:
        print(f"error: {opt}={folder}: not a writable folder ({e.strerror or e})", file=sys.stderr)
        return 2
    log = Log(results / "gpu_check.log", clock)
    ctx = Ctx(
        sys.executable, a.device, child_env(site, hidden_names(), a.device), log, work, results
    )
    log(
        f"gpu-check on {a.device}, {a.total_s:.0f} s in all; python {sys.executable}; work folder "
        f"{work}"
    )
    try:
        ctx.info = setup(ctx, Path(a.wheels).resolve(), site, clock)
    except SetupError as e:
        log(f"gpu-check: FAILED: setup: {e}")
        return 1
    rows = run_plan(plan(ctx), clock, log)
    for r in rows:
        r.update(device=ctx.info.get("device_name", a.device), torch=ctx.info.get("torch", ""))
    from bench import write_csv

    check = results / f"bench_{a.device}_check.csv"
    write_csv(rows, check, CHECK_COLUMNS)
    status, line = verdict(rows)
    log(f"{line}; {clock.elapsed():.1f} s of {a.total_s:.0f} s; wrote {check} and {log.path}")
    if a.out_dir:
        out = Path(a.out_dir)
        out.mkdir(parents=True, exist_ok=True)
        for f in [log.path, check, *ctx.outputs]:
            shutil.copyfile(f, out / f.name)
        log.raw(f"copied {2 + len(ctx.outputs)} files to {out}")
    return status


if __name__ == "__main__":
    sys.exit(main())
