"""The three places dpsgd reads Hydra's private code, each pinned to the Hydra it was written
against.

A Hydra upgrade (``make lock``, then ``make test-all``) that moves or changes one of them fails
here, with a message naming the dpsgd function to update, instead of as a wrong folder check or a
lost error line in a sweep. Why each is private and not a public API:
docs/ARCHITECTURE.md#the-hydra-harness-what-is-kept-and-why.

* dpsgd/launch/sweeps.py:basic_sweeper_jobs: ``BasicSweeper.split_arguments``, a sweep's jobs before
  it runs;
* dpsgd/launch/launchers.py:launcher_kind: the ``_target_`` of Hydra's own launcher;
* dpsgd/launch/jobfailures.py:job_failed: ``JobReturn._return_value``, a failed job's exception,
  read quietly.
"""

from __future__ import annotations

import importlib
import inspect

import pytest

from dpsgd.launch.cli import compose
from dpsgd.launch.jobfailures import JobFailed, job_failed
from dpsgd.launch.launchers import launcher_kind
from dpsgd.launch.sweeps import BASIC_SWEEPER, basic_sweeper_jobs

UPGRADE = (
    "a Hydra upgrade changed {what}; update {where} "
    "(docs/ARCHITECTURE.md#the-hydra-harness-what-is-kept-and-why)"
)


def _class(path: str, where: str):
    module, _, name = path.rpartition(".")
    try:
        return getattr(importlib.import_module(module), name)
    except (ImportError, AttributeError) as e:
        pytest.fail(UPGRADE.format(what=f"where {path} lives ({e})", where=where))


def _parsed(overrides: list[str]):
    from hydra.core.override_parser.overrides_parser import OverridesParser

    return OverridesParser.create().parse_overrides(overrides)


# -------------------------------------------------------------------------------- the basic sweeper
def test_the_default_sweeper_is_the_basic_sweeper_dpsgd_names():
    where = "dpsgd/launch/sweeps.py:BASIC_SWEEPER"
    cls = _class(BASIC_SWEEPER, where)
    assert f"{cls.__module__}.{cls.__qualname__}" == BASIC_SWEEPER, UPGRADE.format(
        what="BasicSweeper's name", where=where
    )
    target = compose([], hydra_config=True).hydra.sweeper._target_
    assert target == BASIC_SWEEPER, UPGRADE.format(
        what=f"the default sweeper's _target_ (now {target})", where=where
    )


def test_split_arguments_takes_the_overrides_and_a_batch_size():
    where = "dpsgd/launch/sweeps.py:basic_sweeper_jobs"
    split = getattr(_class(BASIC_SWEEPER, where), "split_arguments", None)
    assert split is not None, UPGRADE.format(
        what="BasicSweeper.split_arguments (gone)", where=where
    )
    params = list(inspect.signature(split).parameters)
    assert params == ["overrides", "max_batch_size"], UPGRADE.format(
        what=f"BasicSweeper.split_arguments's signature (now {params})", where=where
    )


def test_basic_sweeper_jobs_expands_a_known_sweep_in_hydras_order():
    """The product of every key's values, keys in first-seen order, the last values of a key winning
    (a command-line override replaces the sweep file's params); range() expanded, plain values
    kept."""
    jobs = basic_sweeper_jobs(_parsed(["a=1,2", "b=x", "c=range(0,2)", "a=5,6", "+d=y"]))
    assert jobs == [
        ["a=5", "b=x", "c=0", "+d=y"],
        ["a=5", "b=x", "c=1", "+d=y"],
        ["a=6", "b=x", "c=0", "+d=y"],
        ["a=6", "b=x", "c=1", "+d=y"],
    ], UPGRADE.format(
        what=f"how the basic sweeper expands a sweep (now {jobs})",
        where="dpsgd/launch/sweeps.py:basic_sweeper_jobs",
    )
    assert basic_sweeper_jobs(_parsed(["seed=0"])) == [["seed=0"]]


def test_basic_sweeper_jobs_refuses_a_sweep_the_basic_sweeper_cannot_run():
    with pytest.raises(Exception, match="does not support sweep type"):
        basic_sweeper_jobs(_parsed(["a=interval(0,1)"]))


# ------------------------------------------------------------------------------- the basic launcher
def test_the_default_launcher_is_the_basic_launcher_dpsgd_names():
    where = "dpsgd/launch/launchers.py:launcher_kind"
    target = compose([], hydra_config=True).hydra.launcher._target_
    assert launcher_kind(target) == "basic", UPGRADE.format(
        what=f"the default launcher's _target_ (now {target})", where=where
    )
    cls = _class(target, where)
    assert f"{cls.__module__}.{cls.__qualname__}" == target, UPGRADE.format(
        what="BasicLauncher's name", where=where
    )
    assert (
        launcher_kind("hydra_plugins.hydra_joblib_launcher.joblib_launcher.JoblibLauncher")
        == "joblib"
    )
    assert launcher_kind("my.Launcher") == "other"


# ---------------------------------------------------------------------------- a failed job's return
def test_job_failed_reads_the_exception_hydra_stores_for_a_failed_job():
    from hydra.core.utils import JobReturn, JobStatus

    where = "dpsgd/launch/jobfailures.py:job_failed"
    failed = JobFailed("error: sweep job 1 (mr/1): privacy.sigma=-1.0: must be >= 0", 2)
    run = JobReturn(status=JobStatus.FAILED)
    run.return_value = failed  # Hydra's public setter, as run_job stores a failure
    try:
        assert job_failed(run) is failed, UPGRADE.format(
            what="where JobReturn keeps a failed job's exception", where=where
        )
    except AttributeError as e:
        pytest.fail(UPGRADE.format(what=f"JobReturn's fields ({e})", where=where))
    other = JobReturn(status=JobStatus.FAILED)
    other.return_value = ValueError("not dpsgd's")
    done = JobReturn(status=JobStatus.COMPLETED)
    done.return_value = None
    assert job_failed(other) is None and job_failed(done) is None


def test_the_public_return_value_of_a_failed_job_still_writes_to_stderr(capfd):
    """Why job_failed reads the private field: the public getter prints Hydra's own line first. If
    this fails, ``JobReturn.return_value`` has become quiet and job_failed can use it instead."""
    from hydra.core.utils import JobReturn, JobStatus

    run = JobReturn(status=JobStatus.FAILED)
    run.return_value = JobFailed("error: x", 2)
    with pytest.raises(JobFailed):
        run.return_value
    assert "Error executing job" in capfd.readouterr().err
