"""Speed-only process settings: the allocator tuning applies on Linux/glibc and is idempotent; the
thread policy honours explicit settings, refuses bad ones naming them, and otherwise picks 2 threads
on 2 cores only when the other processes leave them idle now (results/bench_threads.csv), or leaves
the busy cores of a larger machine."""

import io
import sys

import pytest

from dpsgd.config.schema import ConfigError
from dpsgd.core.runtime import configure_threads, describe_runtime, thread_policy, tune_allocator


def test_tune_allocator_applies_and_is_idempotent(monkeypatch):
    first = tune_allocator()
    assert tune_allocator() == first
    if sys.platform.startswith("linux"):
        assert first is True
    monkeypatch.setenv("DPSGD_TUNE_MALLOC", "0")
    assert tune_allocator() is False


def test_thread_policy_respects_explicit_settings_first():
    assert thread_policy({"DPSGD_THREADS": "3", "OMP_NUM_THREADS": "2"}, 8, 8, 0.0) == (
        3,
        "DPSGD_THREADS=3",
    )
    assert thread_policy({"OMP_NUM_THREADS": "4"}, 2, 2, 5.0) == (4, "OMP_NUM_THREADS=4")
    assert thread_policy({"OMP_NUM_THREADS": "6,2"}, 8, 8, 0.0)[0] == 6  # nested list: outer level
    assert thread_policy({"OMP_NUM_THREADS": " "}, 2, 2, 0.0)[0] == 1  # blank = unset


def test_thread_policy_parallel_jobs_share_the_cores():
    """P jobs of a joblib / submitit_local sweep (DPSGD_PARALLEL_JOBS, exported by the launching
    process) take min(physical, usable) // P threads each: P × threads never exceeds the cores."""
    share = {"DPSGD_PARALLEL_JOBS": "4"}
    assert thread_policy(share, 16, 16, 9.0)[0] == 4  # the siblings are the load: not subtracted
    assert thread_policy(share, 16, 8, 0.0)[0] == 2  # physical cores
    assert thread_policy(share, 2, 2, 0.0)[0] == 1  # never below one
    assert (
        thread_policy({**share, "OMP_NUM_THREADS": "1"}, 16, 16, 0.0)[0] == 4
    )  # joblib's own OMP: ignored
    assert (
        thread_policy({**share, "DPSGD_THREADS": "3"}, 16, 16, 0.0)[0] == 3
    )  # dpsgd's own knob wins
    assert "DPSGD_PARALLEL_JOBS=4" in thread_policy(share, 16, 16, 0.0)[1]
    for p in (48, 16):
        for usable in (1, 2, 3, 8, 16, 64):
            n, _ = thread_policy({"DPSGD_PARALLEL_JOBS": str(p)}, usable, None, None)
            assert n >= 1 and (n * p <= usable or n == 1)
    assert (
        thread_policy({"DPSGD_PARALLEL_JOBS": "1"}, 16, 16, 0.0)[0] == 16
    )  # one job: the usual policy


@pytest.mark.parametrize(
    "env, name",
    [
        ({"DPSGD_THREADS": "0"}, "DPSGD_THREADS"),
        ({"DPSGD_THREADS": "two"}, "DPSGD_THREADS"),
        ({"DPSGD_PARALLEL_JOBS": "0"}, "DPSGD_PARALLEL_JOBS"),
        ({"OMP_NUM_THREADS": "-1"}, "OMP_NUM_THREADS"),
    ],
)
def test_thread_policy_refuses_bad_values_naming_the_variable(env, name):
    with pytest.raises(ConfigError, match=f"^{name}=.*positive integer") as e:
        thread_policy(env, 8, 8, 0.0)
    assert "\n" not in str(e.value)


def test_thread_policy_auto_two_cores_only_quiet_and_passive_else_leaves_busy_cores():
    # two cores: both only when quiet and OpenMP sleeps instead of spinning (bench_threads)
    assert thread_policy({}, 2, 2, 0.0, passive=True) == (
        2, "auto: 2 usable cores, quiet (load 0.00 < 0.5), OpenMP waits passively -> 2 threads"
    )  # fmt: skip
    assert thread_policy({}, 2, 2, 0.0)[0] == 1  # OpenMP may spin
    assert thread_policy({}, 2, 2, 0.5, passive=True)[0] == 1  # not quiet
    assert thread_policy({}, 2, 2, None, passive=True)[0] == 1  # load unknown
    assert thread_policy({}, 2, 1, 0.0, passive=True)[0] == 1  # one physical core
    assert thread_policy({}, 1, 1, None)[0] == 1
    assert thread_policy({}, 16, 8, 0.0)[0] == 8  # never more than the physical cores
    assert thread_policy({}, 16, 16, 3.2)[0] == 12  # ⌈3.2⌉ cores already busy
    assert thread_policy({}, 4, 4, 4.0)[0] == 1  # fully loaded: at least one
    assert thread_policy({}, 4, 4, 50.0)[0] == 1
    assert thread_policy({}, 4, None, float("nan"))[0] == 4


def test_thread_policy_two_cores_measures_the_others_now_before_the_load_average():
    """The load average remembers the last minute (an install just before: near 1 on an idle
    machine); the others' CPU use now decides where it can be measured, else the load average."""
    pol = lambda load, now: thread_policy({}, 2, 2, load, passive=True, others_now=lambda: now)
    assert pol(1.3, 0.05) == (
        2,
        "auto: 2 usable cores, quiet (others use 0.05 cores now < 0.25), OpenMP waits passively "
        "-> 2 threads",
    )
    assert pol(0.0, 0.9) == (
        1,
        "auto: 2 usable cores, busy (others use 0.90 cores now >= 0.25) -> 1 thread",
    )
    assert pol(0.0, 0.25)[0] == 1  # the threshold itself is busy
    assert pol(0.2, None)[0] == 2 and pol(0.7, None)[0] == 1  # not measurable: the load average
    assert pol(0.2, float("nan"))[0] == 2

    def never():
        raise AssertionError("sampled although it cannot change the choice")

    assert thread_policy({"DPSGD_THREADS": "2"}, 2, 2, 0.0, True, never)[0] == 2
    assert thread_policy({}, 2, 2, 0.0, False, never)[0] == 1  # OpenMP may spin: 1 anyway
    assert thread_policy({}, 2, 1, 0.0, True, never)[0] == 1  # one physical core
    assert thread_policy({}, 8, 8, 0.0, True, never)[0] == 8  # more cores: the load average


def test_cpu_busy_reads_proc_stat_of_this_process_cpus_while_sleeping(monkeypatch):
    import os

    import dpsgd.core.runtime as rt

    before = (
        "cpu  100 0 50 1000 0 0 0 0 0 0\ncpu0 50 0 25 500 0 0 0 0 0 0\n"
        "cpu1 50 0 25 500 0 0 0 0 0 0\nintr 1 2 3\n"
    )
    after = (  # cpu0: 40 busy jiffies of 100; cpu1: none of 100
        "cpu  130 0 60 1160 0 0 0 0 0 0\ncpu0 80 0 35 560 0 0 0 0 0 0\n"
        "cpu1 50 0 25 600 0 0 0 0 0 0\nintr 1 2 3\n"
    )

    def busy(affinity):
        snaps = iter([before, after])
        monkeypatch.setattr("builtins.open", lambda *a, **k: io.StringIO(next(snaps)))
        monkeypatch.setattr(os, "sched_getaffinity", affinity)
        return rt.cpu_busy()

    monkeypatch.setattr("time.sleep", lambda s: None)
    # the same float operations as cpu_busy: equal bits
    assert busy(lambda pid: {0, 1}) == 40 / 200 * 2  # both CPUs: 0.4 cores
    assert busy(lambda pid: {1}) == 0.0  # only cpu1 is ours, and it was idle
    assert busy(lambda pid: {0}) == 40 / 100 * 1

    def unknown(pid):
        raise OSError("no affinity")

    assert busy(unknown) == 40 / 200 * 2  # the machine's totals over its 2 CPUs

    def unreadable(*a, **k):
        raise OSError("no /proc")

    monkeypatch.setattr("builtins.open", unreadable)
    assert rt.cpu_busy() is None


def test_configure_threads_applies_and_is_recorded(monkeypatch):
    import torch

    before = torch.get_num_threads()
    monkeypatch.setattr("os.sched_getaffinity", lambda pid: {0, 1}, raising=False)
    try:
        got = configure_threads({})
        assert got["threads"] == torch.get_num_threads() == 1 and got["policy"].startswith("auto")
        rt = describe_runtime("cpu", False, got)
        assert rt["threads"] == 1 and rt["threads_policy"] == got["policy"]
        assert configure_threads({"DPSGD_THREADS": "2"})["threads"] == torch.get_num_threads() == 2
    finally:
        torch.set_num_threads(before)


def test_configure_threads_limits_numpy_and_scipy_blas():
    """scipy's OpenBLAS pool follows the same count as torch (its spinning workers made DP-PCA's
    eigendecomposition tens of times slower beside a busy process)."""
    import torch
    from threadpoolctl import threadpool_info, threadpool_limits

    import scipy.linalg  # noqa: F401 (loads scipy's BLAS, so that its pool is seen)

    before = torch.get_num_threads()
    with threadpool_limits(limits=None):  # restores every pool's count on exit
        try:
            configure_threads({"DPSGD_THREADS": "1"})
            blas = [i for i in threadpool_info() if i["user_api"] == "blas"]
            assert blas and all(i["num_threads"] == 1 for i in blas)
        finally:
            torch.set_num_threads(before)
