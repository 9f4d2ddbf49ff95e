"""A sweep job that fails, is killed or is lost (dpsgd/launch/jobfailures.py) ends the command in
one line naming the job, the launcher and how to resume it, with the exit code of its kind (1 a lost
job, 128 + n a signal), after its siblings have run to their end; other launchers are left alone.

In-process where the behaviour is about values: the handler is driven with the exceptions joblib and
submitit raise. Two real sweeps (a joblib worker, a submitit_local job, each killed with SIGKILL)
are marked slow.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from conftest import TINY_RUN, snapshot
from dpsgd.launch.jobfailures import failures_reported
from dpsgd.launch.launchers import Launch

REPO = Path(__file__).resolve().parents[2]
TINY = TINY_RUN
_snapshot = snapshot


# ------------------------------------------------------------------- a joblib worker process killed
def _sweep_folders(root: Path) -> list[str]:
    """Three jobs' folders: job 0 complete, job 1 stopped after a checkpoint, job 2 never
    started."""
    folders = [str(root / f"{n}_job") for n in range(3)]
    for n, status in ((0, "complete"), (1, "running")):
        Path(folders[n]).mkdir(parents=True)
        (Path(folders[n]) / "privacy.json").write_text(json.dumps({"status": status}))
        (Path(folders[n]) / "checkpoint.pt").write_bytes(b"checkpoint")
    return folders


def test_a_killed_joblib_worker_is_one_line_naming_the_job_and_the_launcher(
    tmp_path, monkeypatch, capsys
):
    """joblib's pool breaks when a worker dies (TerminatedWorkerError, exit codes {SIGKILL(-9)}):
    the command prints one line naming the job (its number and the overrides that tell it apart) and
    the launcher, what became of every job, and exits 128 + 9; every job folder is left as it
    was."""
    from hydra_plugins.hydra_joblib_launcher import _core
    from hydra_plugins.hydra_joblib_launcher.joblib_launcher import JoblibLauncher
    from joblib.externals.loky.process_executor import TerminatedWorkerError

    def broken(launcher, job_overrides, initial_job_idx):
        raise TerminatedWorkerError(
            "A worker process managed by the executor was unexpectedly terminated. "
            "This could be caused by a segmentation fault while calling the function "
            "or by an excessive memory usage causing the Operating System to kill the "
            "worker.\n\nThe exit codes of the workers are {SIGKILL(-9)}"
        )

    monkeypatch.setattr(_core, "launch", broken)
    folders = _sweep_folders(tmp_path / "mr")
    before = _snapshot(tmp_path)
    original = JoblibLauncher.launch
    jobs = [
        ["seed=0", "privacy.clip_norm=1"],
        ["seed=0", "privacy.clip_norm=2"],
        ["seed=0", "privacy.clip_norm=3"],
    ]
    with failures_reported(Launch([], "joblib", 3, 2, str(tmp_path / "mr"), [], folders)):
        with pytest.raises(SystemExit) as e:
            JoblibLauncher.launch(object.__new__(JoblibLauncher), jobs, 0)
    assert JoblibLauncher.launch is original  # only while the sweep runs
    err = capsys.readouterr().err
    assert e.value.code == 128 + signal.SIGKILL and err.count("\n") == 1, err
    assert err.startswith(
        "sweep job 1 (privacy.clip_norm=2): its hydra/launcher=joblib worker process was "
        "killed by SIGKILL"
    ), err
    assert (
        "complete: 0" in err
        and "stopped: 1 (resume with: python -m dpsgd.train " in err
        and folders[1] in err
    )
    assert "not run: 2" in err and "Traceback" not in err
    assert _snapshot(tmp_path) == before


def _fake_submitit_jobs(outcomes):
    """submitit jobs (real ``Job`` subclasses, so the launcher's ``results`` is the one patched)
    whose outcome is given: a JobReturn, or the submitit state of a process that left no result."""
    from hydra.core.utils import JobReturn, JobStatus
    from submitit.core import core, utils

    class Fake(core.Job):
        def __init__(self, outcome):  # no folder, no process: only what results() reads
            self.outcome, self._sub_jobs, self.waited = outcome, [], False
            self._cancel_at_deletion = False

        def wait(self):
            self.waited = True

        @property
        def state(self):
            return self.outcome

        def _get_outcome_and_result(self):
            if isinstance(self.outcome, str):
                raise utils.UncompletedJobError(
                    f"Job x (task: 0) has not produced any output (state: {self.state})"
                )
            r = JobReturn()
            r.status, r._return_value = JobStatus.COMPLETED, None
            return "success", r

    return [Fake(o) for o in outcomes]


@pytest.mark.parametrize("state", ["FINISHED", "OUT_OF_MEMORY"])
def test_a_lost_submitit_job_is_one_line_after_its_siblings_end(
    state, tmp_path, monkeypatch, capsys
):
    """A submitit job that leaves no result (killed locally, or OOM / node failure on SLURM) raised
    submitit's UncompletedJobError out of Hydra's wait on it, a traceback, while later jobs were not
    waited for. Now the launcher still waits for every job (each runs on in its own process or
    cluster job), then the command prints one line naming the lost job and what every folder
    shows."""
    from hydra_plugins.hydra_submitit_launcher.submitit_launcher import BaseSubmititLauncher

    fakes = _fake_submitit_jobs([object(), state, object()])

    def launch(self, job_overrides, initial_job_idx):  # the plugin's last line, as it is
        return [j.results()[0] for j in fakes]

    monkeypatch.setattr(BaseSubmititLauncher, "launch", launch)
    folders = _sweep_folders(tmp_path / "mr")
    before = _snapshot(tmp_path)
    jobs = [
        ["seed=0", "privacy.clip_norm=1"],
        ["seed=0", "privacy.clip_norm=2"],
        ["seed=0", "privacy.clip_norm=3"],
    ]
    with failures_reported(Launch([], "submitit_local", 3, 3, str(tmp_path / "mr"), [], folders)):
        with pytest.raises(SystemExit) as e:
            BaseSubmititLauncher.launch(object.__new__(BaseSubmititLauncher), jobs, 0)
    err = capsys.readouterr().err
    assert e.value.code == 1 and err.count("\n") == 1, err
    assert err.startswith(
        "error: sweep job 1 (privacy.clip_norm=2): its hydra/launcher=submitit_local job "
        "ended without a result "
        f"(the process died: killed, out of memory or crashed; submitit state {state}); the "
        "other jobs ran to their end (jobs complete: 0; stopped: 1 (resume with: python -m "
        f"dpsgd.train resume={folders[1]}); not run: 2)"
    ), err
    assert all(f.waited for f in fakes) and "Traceback" not in err
    assert _snapshot(tmp_path) == before
    from submitit.core import core

    assert core.Job.results is type(fakes[0]).__mro__[1].results  # only while the sweep runs
    with pytest.raises(Exception, match="has not produced any output"):
        fakes[1].results()


def test_a_failed_job_in_a_worker_is_its_one_line(monkeypatch, capsys):
    """A job refused in its worker comes back as JobFailed: once the batch is done the command
    prints that job's line alone (no Hydra hint after it) and exits with its code."""
    from hydra.core.utils import JobReturn, JobStatus
    from hydra_plugins.hydra_joblib_launcher import _core
    from hydra_plugins.hydra_joblib_launcher.joblib_launcher import JoblibLauncher
    from dpsgd.launch.jobfailures import JobFailed

    def launch(launcher, job_overrides, initial_job_idx):
        ok, refused = JobReturn(), JobReturn()
        ok.status, ok._return_value = JobStatus.COMPLETED, None
        refused.status = JobStatus.FAILED
        refused._return_value = JobFailed(
            "error: sweep job 1 (mr/1): privacy.sigma=-1.0: must be >= 0", 2
        )
        return [ok, refused]

    monkeypatch.setattr(_core, "launch", launch)
    with failures_reported(Launch([], "joblib", 2, 2, "mr", [], ["mr/0", "mr/1"])):
        with pytest.raises(SystemExit) as e:
            JoblibLauncher.launch(object.__new__(JoblibLauncher), [["seed=0"], ["seed=1"]], 0)
    assert e.value.code == 2
    assert (
        capsys.readouterr().err == "error: sweep job 1 (mr/1): privacy.sigma=-1.0: must be >= 0\n"
    )


def test_other_launchers_are_left_alone():
    from hydra_plugins.hydra_joblib_launcher.joblib_launcher import JoblibLauncher

    original = JoblibLauncher.launch
    with failures_reported(Launch([], "basic")):
        assert JoblibLauncher.launch is original


def _lock_holder(folder: Path) -> int | None:
    """The pid holding the flock of a run folder (dpsgd/run/rundir.py:RunLock), from /proc/locks."""
    ino = os.stat(folder).st_ino
    for line in Path("/proc/locks").read_text().splitlines():
        f = line.split()
        if "FLOCK" in f and len(f) > 5 and f[5].endswith(f":{ino}"):
            return int(f[4])
    return None


def _kill_a_job_in_a_real_sweep(tmp_path, launcher: list[str], epochs: str, victim: int):
    """A real 2-job sweep (``training.epochs=<epochs>``) through ``launcher``; once job ``victim``
    has written a checkpoint, the process holding its folder's lock is killed with SIGKILL. Returns
    (exit code, stderr, the sweep folder, the victim's folder)."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("HYDRA_")}
    env["PYTHONPATH"] = str(REPO) + os.pathsep + env.get("PYTHONPATH", "")
    mr = tmp_path / "mr"
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "dpsgd.train",
            "-m",
            *TINY,
            f"training.epochs={epochs}",
            *launcher,
            f"hydra.sweep.dir={mr}",
        ],
        cwd=tmp_path,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        deadline, pid = time.monotonic() + 120, None
        while pid is None and time.monotonic() < deadline and proc.poll() is None:
            long = next(iter(mr.glob(f"{victim}_*")), None) if mr.is_dir() else None
            if long is not None and (long / "checkpoint.pt").is_file():
                pid = _lock_holder(long)
            time.sleep(0.05)
        assert pid is not None, proc.communicate()[1][-3000:]
        os.kill(pid, signal.SIGKILL)
        _, err = proc.communicate(timeout=180)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert (long / "checkpoint.pt").is_file() and not (mr / ".sweep.claim").exists()
    assert f"resume={long}" in err and err.count("\n") == 1 and "Traceback" not in err, err
    done = next(mr.glob(f"{1 - victim}_*"))  # the sibling ran to its end
    assert json.loads((done / "privacy.json").read_text())["status"] == "complete"
    return proc.returncode, err


@pytest.mark.slow  # a real joblib sweep whose worker is killed (~6 s, more on a loaded machine)
@pytest.mark.skipif(
    not Path("/proc/locks").is_file(), reason="finds the worker through /proc/locks"
)
def test_a_joblib_worker_killed_in_a_real_sweep(tmp_path):
    code, err = _kill_a_job_in_a_real_sweep(
        tmp_path, ["hydra/launcher=joblib", "hydra.launcher.n_jobs=2"], "1,100000", victim=1
    )
    assert code == 128 + signal.SIGKILL
    assert err.startswith(
        "sweep job 1 (training.epochs=100000): its hydra/launcher=joblib worker process was "
        "killed by SIGKILL"
    ), err


# a real submitit_local sweep whose job is killed (~25 s: submitit waits 15 s for a result)
@pytest.mark.slow
@pytest.mark.skipif(not Path("/proc/locks").is_file(), reason="finds the job through /proc/locks")
def test_a_submitit_job_killed_in_a_real_sweep(tmp_path):
    """Job 0 is killed; job 1 (after it in submitit's wait) is still waited for, and the line says
    so."""
    code, err = _kill_a_job_in_a_real_sweep(
        tmp_path, ["hydra/launcher=submitit_local"], "100000,1", victim=0
    )
    assert code == 1
    assert err.startswith(
        "error: sweep job 0 (training.epochs=100000): its hydra/launcher=submitit_local job "
        "ended without a result (the process died"
    ), err
    assert (
        "; the other jobs ran to their end (jobs stopped: 0 (resume with: " in err
        and "complete: 1" in err
    )
