"""A sweep job that fails or dies away from the launching process, reported in one line.

A job that fails in a worker process or a cluster job does not stop its siblings: it prints its one
line into its own log and returns ``JobFailed``; once the batch is done the launching process prints
the first failure's line (``failures_reported``) and the command exits with that job's code. A
joblib worker process that dies (killed, out of memory, crashed) breaks joblib's pool, which then
kills the other workers and runs no further job; ``failures_reported`` turns that into one line
naming the jobs that were running and the launcher, saying which jobs finished, which stopped
(resumable from their folders: everything they wrote is whole) and which never ran, and the command
exits with 128 + the signal (``lost_worker``). A submitit job whose process dies leaves no result
(submitit's ``UncompletedJobError``); its siblings run on, so the launching process waits for all of
them and then reports the lost job the same way (``lost_jobs``, exit 1: submitit does not pass on
the signal).
"""

from __future__ import annotations

import importlib.util
import json
import os
import re
import shlex
import sys
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

from hydra.errors import CompactHydraException

from dpsgd.launch.cli import error_line
from dpsgd.launch.launchers import Launch


class JobFailed(CompactHydraException):
    """A sweep job that failed in a worker process or a cluster job.

    Returned to the launching process. Hydra prints ``str()`` of it as one line;
    ``dpsgd/launch/main.py:main`` exits with ``code``."""

    def __init__(self, line: str, code: int):
        super().__init__(line, code)
        self.line, self.code = line, code

    def __str__(self) -> str:
        return self.line


# ---------------------------------------------------------------------------- lost worker processes
_LAUNCHER_CLASSES = {  # where each kind's ``launch`` is defined
    "joblib": ("hydra_plugins.hydra_joblib_launcher.joblib_launcher", "JoblibLauncher"),
    "submitit_local": (
        "hydra_plugins.hydra_submitit_launcher.submitit_launcher",
        "BaseSubmititLauncher",
    ),
    "submitit_slurm": (
        "hydra_plugins.hydra_submitit_launcher.submitit_launcher",
        "BaseSubmititLauncher",
    ),
}
_LOST_WORKER = {"joblib": ("joblib.externals.loky.process_executor", "TerminatedWorkerError")}


@contextmanager
def failures_reported(plan: Launch):
    """While a sweep runs (in the launching process), the launcher's ``launch`` ends the command
    with one line and its exit code instead of Hydra's report: a job whose process died
    (``lost_worker``: joblib's pool is then broken; ``lost_jobs``: a submitit job killed or lost,
    its siblings run on), else the first job that failed (``JobFailed``, its line)."""
    spec = _LAUNCHER_CLASSES.get(plan.launcher)
    if spec is None:
        yield
        return
    launcher = getattr(importlib.import_module(spec[0]), spec[1])
    lost = _LOST_WORKER.get(plan.launcher)
    died = getattr(importlib.import_module(lost[0]), lost[1]) if lost else ()
    original = launcher.launch

    def launch(self, job_overrides, initial_job_idx):
        jobs = [(initial_job_idx + i, list(o)) for i, o in enumerate(job_overrides)]
        try:
            with _submitit_losses(plan.launcher):
                runs = original(self, job_overrides, initial_job_idx)
        except died as e:
            line, code = lost_worker(e, plan.launcher, jobs, plan.folders)
            print(line, file=sys.stderr, flush=True)
            raise SystemExit(code) from None
        dead = [(jobs[i], r) for i, r in enumerate(runs) if isinstance(r, LostJob)]
        if dead:
            line, code = lost_jobs(dead, plan.launcher, jobs, plan.folders)
            print(line, file=sys.stderr, flush=True)
            raise SystemExit(code)
        failed = next((f for f in map(job_failed, runs) if f is not None), None)
        if failed is not None:
            print(failed.line, file=sys.stderr, flush=True)
            raise SystemExit(failed.code)
        return runs

    launcher.launch = launch
    try:
        yield
    finally:
        launcher.launch = original


def job_failed(run) -> JobFailed | None:
    """The ``JobFailed`` a sweep job returned (``run``: Hydra's ``JobReturn``), else None.

    Read from the private field ``JobReturn._return_value``: the public ``return_value`` of a failed
    job raises its exception and first writes Hydra's own "Error executing job" line to stderr,
    which would precede the job's one line. tests/launch/test_hydra_private.py fails if a Hydra
    upgrade changes it."""
    from hydra.core.utils import JobStatus

    if run.status == JobStatus.FAILED and isinstance(run._return_value, JobFailed):
        return run._return_value
    return None


@dataclass
class LostJob:
    """A submitit job that produced no result (its process killed, out of memory, crashed, a lost
    node), with its state as submitit saw it. Its exit code is not known: submitit_local's
    controller process does not pass on its task's, and SLURM reports states, not signals."""

    state: str


@contextmanager
def _submitit_losses(kind: str):
    """For submitit launchers: a job that produced no result comes back as ``LostJob`` instead of
    raising ``UncompletedJobError`` out of the launcher's wait on the first such job, so the
    launcher still waits for every other job (each a process or cluster job of its own, running
    on)."""
    if not kind.startswith("submitit"):
        yield
        return
    from submitit.core import core, utils

    original = core.Job.results

    def results(job):
        try:
            return original(job)
        except utils.UncompletedJobError:
            return [LostJob(str(job.state))]

    core.Job.results = results
    try:
        yield
    finally:
        core.Job.results = original


def job_state(folder: str | None) -> tuple[str, bool]:
    """(what a sweep job's folder shows: complete, diverged, stopped or not run; resumable)."""
    if not folder or not os.path.isdir(folder):
        return "not run", False
    try:
        status = json.loads((Path(folder) / "privacy.json").read_text()).get("status")
    except (OSError, ValueError, AttributeError):
        status = None
    if status in ("complete", "diverged"):
        return status, False
    return "stopped", (Path(folder) / "checkpoint.pt").is_file()


def lost_worker(exc: BaseException, kind: str, jobs: list, folders: list) -> tuple[str, int]:
    """(one line, exit code) for a launcher's worker process that died while the batch ``jobs``
    ([(job number, overrides)]) ran: the jobs it may have been running (by number and the overrides
    that tell them apart), how it died, what each job's folder shows; the code is 128 + the signal
    that killed it (else its exit code, else 1)."""
    how, code = "died", 1
    for name, c in re.findall(r"\b([A-Z][A-Z0-9]*)\((-?\d+)\)", str(exc)):  # loky: {SIGKILL(-9)}
        if int(c) < 0:
            how, code = f"was killed by {name}", 128 - int(c)
            break
        if int(c) > 0:
            how, code = f"exited with code {c}", int(c)
            break
    states = {num: job_state(folders[num] if num < len(folders) else None) for num, _ in jobs}
    named = (
        [(n, o) for n, o in jobs if states[n][0] == "stopped"]
        or [(n, o) for n, o in jobs if states[n][0] == "not run"]
        or jobs
    )
    what = (
        f"its hydra/launcher={kind} worker process {how}"
        if len(named) == 1
        else f"a hydra/launcher={kind} worker process running one of them {how}, and the others "
        "were stopped"
    )
    return error_line(
        f"{_who(named, jobs)}: {what}; the sweep stopped (jobs {_outcomes(jobs, states, folders)})",
        code,
    ), code


def lost_jobs(dead: list, kind: str, jobs: list, folders: list) -> tuple[str, int]:
    """(one line, exit code 1) for submitit jobs that produced no result (``dead``: [((job number,
    overrides), LostJob)]) once every job of the batch ``jobs`` has ended: which, their submitit
    state, and what each job's folder shows."""
    states = {num: job_state(folders[num] if num < len(folders) else None) for num, _ in jobs}
    seen = ", ".join(dict.fromkeys(lost.state for _, lost in dead))
    what = (
        f"{'its' if len(dead) == 1 else 'their'} hydra/launcher={kind} "
        f"job{'' if len(dead) == 1 else 's'} ended without a result (the process died: killed, out "
        f"of memory or crashed; submitit state {seen})"
    )
    return error_line(
        f"{_who([j for j, _ in dead], jobs)}: {what}; the other jobs ran to their end (jobs "
        f"{_outcomes(jobs, states, folders)})",
        1,
    ), 1


def _who(named: list, jobs: list) -> str:
    """'sweep job(s) N, M (the overrides that tell them apart)'."""
    shared = set.intersection(*(set(o) for _, o in jobs)) if len(jobs) > 1 else set()
    return (
        f"sweep job{'' if len(named) == 1 else 's'} {', '.join(str(n) for n, _ in named)} "
        f"({' | '.join(' '.join(a for a in o if a not in shared) or 'no overrides' for _, o in named)})"
    )


def _outcomes(jobs: list, states: dict, folders: list) -> str:
    """'complete: 0; stopped: 1 (resume with: ...); not run: 2': what each job's folder shows."""
    groups: dict[str, list[str]] = {}
    for num, _ in jobs:
        state, resumable = states[num]
        groups.setdefault(state, []).append(
            f"{num} (resume with: python -m dpsgd.train {shlex.quote('resume=' + folders[num])})"
            if resumable
            else f"{num} (before its first checkpoint)"
            if state == "stopped"
            else str(num)
        )
    return "; ".join(f"{state}: {', '.join(nums)}" for state, nums in groups.items())
