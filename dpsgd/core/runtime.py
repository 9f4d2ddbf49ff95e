"""Process-level settings: CPU allocator tuning and the intra-op thread count (speed only), GPU TF32
math (speed vs precision).

glibc returns freed blocks above ``M_MMAP_THRESHOLD`` / at the top of the heap above
``M_TRIM_THRESHOLD`` to the operating system. A DP-SGD step allocates and frees the same
megabyte-sized activation and gradient buffers every lot, so by default every step pays fresh page
faults for them (visible as high system time). Keeping freed memory in the heap removes that churn:
steps of the paper's MNIST model ran about 20 % faster on a 2-core AMD EPYC (docs/PERFORMANCE.md)
(0.90 s vs 1.14 s for 100 lots, one thread). Opt out with ``DPSGD_TUNE_MALLOC=0``.

Details: docs/PERFORMANCE.md, "dpsgd/core/runtime.py".
"""

from __future__ import annotations

import ctypes
import math
import os
import sys
from contextlib import contextmanager

from dpsgd.core.errors import ConfigError

_M_TRIM_THRESHOLD, _M_TOP_PAD, _M_MMAP_THRESHOLD = -1, -2, -3


def tune_allocator() -> bool:
    """Ask glibc to keep freed memory (Linux/glibc only; a no-op elsewhere). Returns True if
    applied."""
    if os.environ.get("DPSGD_TUNE_MALLOC", "1") == "0" or not sys.platform.startswith("linux"):
        return False
    try:
        libc = ctypes.CDLL("libc.so.6")
        mallopt = libc.mallopt
    except (OSError, AttributeError):
        return False
    ok = mallopt(_M_MMAP_THRESHOLD, 1 << 30)
    ok &= mallopt(_M_TRIM_THRESHOLD, 1 << 30)
    ok &= mallopt(_M_TOP_PAD, 64 << 20)
    return bool(ok)


def _positive_int(name: str, raw: str) -> int:
    try:
        n = int(raw.strip())
    except ValueError:
        n = 0
    if n < 1:
        raise ConfigError(f"{name}={raw!r}: must be a positive integer (threads)")
    return n


def physical_cores() -> int | None:
    """Distinct (physical id, core id) pairs in /proc/cpuinfo; None where that is not available."""
    try:
        cores, phys = set(), "0"
        for line in open("/proc/cpuinfo"):
            key, _, val = line.partition(":")
            key, val = key.strip(), val.strip()
            if key == "physical id":
                phys = val
            elif key == "core id":
                cores.add((phys, val))
        return len(cores) or None
    except OSError:
        return None


QUIET_LOAD = 0.5  # a 1-minute load average below this: a 2-core machine is quiet
QUIET_BUSY = 0.25  # other processes' CPU use (cores) over BUSY_WINDOW_S below this: quiet now
BUSY_WINDOW_S = 0.3


def cpu_busy(window_s: float = BUSY_WINDOW_S) -> float | None:
    """Cores' worth of CPU time spent on the CPUs this process may use, over the next ``window_s``
    seconds while this thread sleeps: the other processes' use now. From /proc/stat's lines of
    those CPUs (the first line's totals where the affinity is unknown): busy jiffies (user, nice,
    system, irq, softirq) over all jiffies (idle, iowait and steal too), times the CPUs counted.
    None where /proc/stat cannot be read (not Linux)."""
    import time

    try:
        mine = {f"cpu{c}" for c in os.sched_getaffinity(0)}
    except (AttributeError, OSError):
        mine = None

    def snap():
        with open("/proc/stat") as f:
            lines = [ln.split() for ln in f.read().splitlines() if ln.startswith("cpu")]
        rows = [r for r in lines[1:] if r[0] in mine] if mine else []
        rows = rows or lines[:1]  # the affinity's CPUs, else the machine's totals
        n = len(rows) if rows[0][0] != "cpu" else max(1, len(lines) - 1)
        return [sum(int(r[k]) for r in rows) for k in range(1, 9)], n

    try:
        (t0, cpus), _ = snap(), time.sleep(window_s)
        t1, _ = snap()
    except (OSError, ValueError, IndexError):
        return None
    d = [b - a for a, b in zip(t0, t1)]
    busy, all_ = d[0] + d[1] + d[2] + d[5] + d[6], sum(d)
    return busy / all_ * cpus if all_ > 0 else None


def thread_policy(
    env: dict,
    usable: int,
    physical: int | None,
    loadavg: float | None,
    passive: bool = False,
    others_now=None,
) -> tuple[int, str]:
    """(intra-op threads, why) from the environment and the machine; pure, so it is testable.

    1. ``DPSGD_THREADS`` if set (dpsgd's own knob).
    2. ``DPSGD_PARALLEL_JOBS`` = P > 1 (exported by the launching process of a joblib or
       submitit_local sweep, dpsgd/launch/launchers.py): this job's share of the cores,
       max(1, min(physical, usable) // P), so that P jobs × threads never exceed the cores. It comes
       before ``OMP_NUM_THREADS``, which a joblib worker inherits from joblib itself (the launching
       process exports P only when the user had set neither thread variable).
    3. ``OMP_NUM_THREADS`` if set (its first value: the user already chose). 1–3 must be positive
       integers.
    4. <= 2 usable cores (``usable`` = CPUs this process may run on): all of them (2) when the
       machine is quiet and OpenMP's threads wait passively (``passive``: dpsgd set
       OMP_WAIT_POLICY=PASSIVE before torch loaded, see dpsgd/__init__.py); else 1 — measured in
       results/bench_threads.csv: one competing process made two spinning threads several times
       slower than one. Quiet: the other processes use under ``QUIET_BUSY`` cores now
       (``others_now()``, called only here: ``cpu_busy``, a short sample of /proc/stat), else,
       where that cannot be measured (no ``others_now``, or it returns None), a 1-minute load
       average below ``QUIET_LOAD``.
       The sample comes first because the load average remembers the last minute: the install or
       data check that ``make mnist`` runs first left it near 1 on an idle machine.
    5. more cores: min(physical cores, usable, max(1, usable − ⌈1-minute load average⌉)), leaving
       the cores other processes already keep busy.
    """
    raw = env.get("DPSGD_THREADS")
    if raw is not None and raw.strip() != "":
        return _positive_int("DPSGD_THREADS", raw), f"DPSGD_THREADS={raw.strip()}"
    usable = max(1, int(usable))
    raw = env.get("DPSGD_PARALLEL_JOBS")
    if raw is not None and raw.strip() != "" and _positive_int("DPSGD_PARALLEL_JOBS", raw) > 1:
        jobs, cores = _positive_int("DPSGD_PARALLEL_JOBS", raw), min(physical or usable, usable)
        n = max(1, cores // jobs)
        return n, f"auto: {cores} core(s) / DPSGD_PARALLEL_JOBS={jobs} parallel jobs -> {n}"
    raw = env.get("OMP_NUM_THREADS")
    if raw is not None and raw.strip() != "":
        return _positive_int("OMP_NUM_THREADS", raw.split(",")[0]), f"OMP_NUM_THREADS={raw.strip()}"
    if usable <= 2:
        cores = min(physical or usable, usable)
        if cores == 2 and passive:
            now = others_now() if others_now is not None else None
            if now is not None and now == now:
                quiet, how = now < QUIET_BUSY, f"others use {now:.2f} cores now"
                limit = QUIET_BUSY
            else:
                quiet = loadavg is not None and loadavg == loadavg and loadavg < QUIET_LOAD
                how, limit = f"load {loadavg if loadavg is not None else math.nan:.2f}", QUIET_LOAD
            if quiet:
                return 2, (
                    f"auto: 2 usable cores, quiet ({how} < {limit}), OpenMP waits passively -> "
                    "2 threads"
                )
            return 1, f"auto: 2 usable cores, busy ({how} >= {limit}) -> 1 thread"
        return 1, f"auto: {usable} usable core(s) <= 2 -> 1 thread (oversubscription under load)"
    busy = 0 if loadavg is None or loadavg != loadavg else max(0, math.ceil(loadavg - 1e-9))
    n = max(1, min(physical or usable, usable, usable - busy))
    return n, (
        f"auto: min(physical {physical or usable}, usable {usable}, usable - load {busy}) -> {n}"
    )


def configure_threads(env: dict | None = None) -> dict:
    """Apply ``thread_policy`` to torch (``torch.set_num_threads``); returns {"threads", "policy"}
    for ``describe_runtime``. A bad DPSGD_THREADS / OMP_NUM_THREADS raises ConfigError naming it."""
    import torch

    env = os.environ if env is None else env
    try:
        usable = len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        usable = os.cpu_count() or 1
    try:
        load = os.getloadavg()[0]
    except (AttributeError, OSError):
        load = None
    import dpsgd

    n, why = thread_policy(env, usable, physical_cores(), load, dpsgd.PASSIVE_WAIT, cpu_busy)
    torch.set_num_threads(n)
    limit_blas_threads(n)
    return {"threads": n, "policy": why}


def limit_blas_threads(n: int) -> None:
    """numpy's and scipy's own BLAS pools (OpenBLAS, MKL, …: not torch's) to ``n`` threads, as
    torch. scipy's LAPACK runs the DP-PCA eigendecomposition on a pool of spinning workers outside
    torch.set_num_threads and OMP_WAIT_POLICY; beside a busy process it ran tens of times slower
    (docs/PERFORMANCE.md, "Threads"). A no-op without threadpoolctl (speed only)."""
    try:
        from threadpoolctl import threadpool_limits
    except ImportError:
        return
    threadpool_limits(limits=int(n), user_api="blas")


def set_tf32(enabled) -> tuple[bool, bool] | None:
    """TF32 tensor-core math for float32 matmuls and cuDNN convolutions on Ampere+ GPUs.

    PyTorch enables it for cuDNN convolutions by default. Its 10-bit mantissa puts ~1e-3 relative
    error into per-example norms and clipped sums, so each clipped gradient's norm is C only to that
    precision; dpsgd turns it off unless the config asks for it (``tf32=true``). No effect on CPU.
    ``enabled`` is a bool or a (matmul, cudnn) pair; returns the previous pair, or None when the
    process chose precisions through the newer ``fp32_precision`` API (then nothing is changed).
    """
    import torch

    matmul, cudnn = (enabled, enabled) if isinstance(enabled, bool) else enabled
    try:
        before = torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32
        torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32 = (
            bool(matmul),
            bool(cudnn),
        )
    except RuntimeError:
        return None
    return before


@contextmanager
def ieee_float32(active: bool = True):
    """TF32 off inside the block (when active), restored after it."""
    before = set_tf32(False) if active else None
    try:
        yield
    finally:
        if before is not None:
            set_tf32(before)


def describe_hardware(device=None) -> str:
    """'NVIDIA H100 80GB HBM3' for a CUDA device, else the CPU model and core count."""
    import platform

    if device is not None and str(device).startswith("cuda"):
        import torch

        return torch.cuda.get_device_name(device)
    cpu = platform.processor() or platform.machine()
    try:
        for line in open("/proc/cpuinfo"):
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    return f"{cpu}, {os.cpu_count()} cores"


def describe_runtime(device, tf32: bool = False, threads: dict | None = None) -> dict:
    """Where a run ran, recorded in its privacy statement (results are attributed from it);
    ``threads`` is what ``configure_threads`` returned (its policy is recorded beside the count)."""
    import torch

    return {
        "device": str(device),
        "hardware": describe_hardware(device),
        "torch": torch.__version__,
        "threads": torch.get_num_threads(),
        "threads_policy": (threads or {}).get("policy"),
        "tf32": bool(tf32) and str(device).startswith("cuda"),
    }
