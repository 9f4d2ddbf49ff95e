"""Speed-only process settings: the allocator tuning applies on Linux/glibc and is idempotent; the
thread policy honours explicit settings, refuses bad ones naming them, and otherwise picks 1 thread
on <= 2 cores (results/bench_threads.csv) or leaves the busy cores of a larger machine."""

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
