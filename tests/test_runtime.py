"""Speed-only process settings: the allocator tuning applies on Linux/glibc and is idempotent; the
thread policy honours explicit settings, refuses bad ones naming them, and otherwise picks 1 thread
on <= 2 cores (results/bench_threads.csv) or leaves the busy cores of a larger machine."""
import sys

import pytest

from dpsgd.config import ConfigError
from dpsgd.runtime import configure_threads, describe_runtime, thread_policy, tune_allocator


def test_tune_allocator_applies_and_is_idempotent(monkeypatch):
    first = tune_allocator()
    assert tune_allocator() == first
    if sys.platform.startswith("linux"):
        assert first is True
    monkeypatch.setenv("DPSGD_TUNE_MALLOC", "0")
    assert tune_allocator() is False



def test_thread_policy_respects_explicit_settings_first():
    assert thread_policy({"DPSGD_THREADS": "3", "OMP_NUM_THREADS": "2"}, 8, 8, 0.0) == (3, "DPSGD_THREADS=3")
    assert thread_policy({"OMP_NUM_THREADS": "4"}, 2, 2, 5.0) == (4, "OMP_NUM_THREADS=4")
    assert thread_policy({"OMP_NUM_THREADS": "6,2"}, 8, 8, 0.0)[0] == 6       # nested list: outer level
    assert thread_policy({"OMP_NUM_THREADS": " "}, 2, 2, 0.0)[0] == 1         # blank = unset


@pytest.mark.parametrize("env, name", [({"DPSGD_THREADS": "0"}, "DPSGD_THREADS"),
                                       ({"DPSGD_THREADS": "two"}, "DPSGD_THREADS"),
                                       ({"OMP_NUM_THREADS": "-1"}, "OMP_NUM_THREADS")])
def test_thread_policy_refuses_bad_values_naming_the_variable(env, name):
    with pytest.raises(ConfigError, match=f"^{name}=.*positive integer") as e:
        thread_policy(env, 8, 8, 0.0)
    assert "\n" not in str(e.value)


def test_thread_policy_auto_one_thread_on_two_cores_else_leaves_busy_cores():
    assert thread_policy({}, 2, 2, 0.0)[0] == 1          # even when idle: measured, see bench_threads
    assert thread_policy({}, 1, 1, None)[0] == 1
    assert thread_policy({}, 16, 8, 0.0)[0] == 8          # never more than the physical cores
    assert thread_policy({}, 16, 16, 3.2)[0] == 12        # ⌈3.2⌉ cores already busy
    assert thread_policy({}, 4, 4, 4.0)[0] == 1           # fully loaded: at least one
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
