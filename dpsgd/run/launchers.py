"""Sweeps through Hydra launchers: which launcher, its checked settings, how many jobs run at once.

``python -m dpsgd.train -m ... hydra/launcher=<name>`` runs the jobs of a sweep

* ``basic`` (Hydra's default): one after another, in the launching process;
* ``joblib`` (hydra-joblib-launcher): in loky worker processes on this machine, ``n_jobs`` at once
  (default -1: one per usable core);
* ``submitit_local`` (hydra-submitit-launcher): every job at once, each a process of its own here;
* ``submitit_slurm``: one SLURM array task per job, each in its own allocation; ``slurm``
  (conf/hydra/launcher/slurm.yaml) is the same launcher with the settings a cluster user changes.

The plugins type their settings; the launching process also checks their ranges here before Hydra
writes anything (``check``: one line naming ``hydra.launcher.<key>``, exit 2), counts the sweep's
jobs and decides how many share this machine (``parallel_jobs``). Jobs at once × threads per job must not exceed the cores, so when more than one
job shares the machine the launching process exports ``DPSGD_PARALLEL_JOBS`` (unless the user chose
the threads with ``DPSGD_THREADS`` / ``OMP_NUM_THREADS``) and every job takes its share of the cores
(``dpsgd/core/runtime.py:thread_policy``). A SLURM job gets the cores of its own allocation (its CPU
affinity), so nothing is shared there.

A job that fails in a worker process or a cluster job does not stop its siblings: it prints its one
line into its own log and returns ``JobFailed``; once the batch is done the launching process prints
the first failure's line (``failures_reported``) and the command exits with that job's code. A joblib worker process
that dies (killed, out of memory, crashed) breaks joblib's pool, which then kills the other workers
and runs no further job; ``failures_reported`` turns that into one line naming the jobs that were
running and the launcher, saying which jobs finished, which stopped (resumable from their folders:
everything they wrote is whole) and which never ran, and the command exits with 128 + the signal.
A submitit job whose process dies leaves no result (submitit's ``UncompletedJobError``); its siblings
run on, so the launching process waits for all of them and then reports the lost job the same way
(``lost_jobs``, exit 1: submitit does not pass on the signal).

Sweep folders (``resolve_sweep``, ``check_job_folders``, ``SweepClaim``): before Hydra starts, the
launching process composes the sweep as Hydra will (the sweep's config, every job's overrides as the
basic sweeper expands them, every job's config as the launcher composes it, ``hydra.job.num`` set)
and resolves ``hydra.sweep.subdir`` for each job, interpolations included. Every job's folder must lie
inside the sweep folder after ``Path.resolve()``, differ from every other job's folder (and not lie
inside one) and change with the job's number; the sweep folder must not lie inside another run. The
resolved sweep folder is handed to Hydra literally (``${now:...}`` is resolved once, here) and claimed
with an exclusive create of ``.sweep.claim`` held for the whole sweep: of two sweeps started together
into one folder exactly one proceeds.
"""
from __future__ import annotations

import fcntl
import importlib.util
import json
import os
import re
import shlex
import socket
import sys
import time
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path

from hydra.errors import CompactHydraException

from dpsgd.core.errors import ConfigError
from dpsgd.run.cli import config_loader, error_line, hydra_quoted, one_line

# the kind of launcher, from the Launcher class its _target_ names (any hydra/launcher option)
LAUNCHERS = {
    "hydra._internal.core_plugins.basic_launcher.BasicLauncher": "basic",
    "hydra_plugins.hydra_joblib_launcher.joblib_launcher.JoblibLauncher": "joblib",
    "hydra_plugins.hydra_submitit_launcher.submitit_launcher.LocalLauncher": "submitit_local",
    "hydra_plugins.hydra_submitit_launcher.submitit_launcher.SlurmLauncher": "submitit_slurm",
}
PARALLEL_ENV = "DPSGD_PARALLEL_JOBS"

# Integer settings: key -> (smallest value, None allowed). tasks_per_node and nodes must be 1: a job
# is one training process (several tasks would be several writers of one run directory).
_INTS = {"n_jobs": (None, False), "verbose": (0, False), "timeout_min": (1, False), "cpus_per_task": (1, True),
         "gpus_per_node": (0, True), "gpus_per_task": (0, True), "cpus_per_gpu": (1, True), "mem_gb": (1, True),
         "tasks_per_node": (1, False), "nodes": (1, False), "signal_delay_s": (0, False),
         "max_num_timeout": (0, False), "array_parallelism": (1, False)}
_ONE = ("tasks_per_node", "nodes")


@dataclass
class Launch:
    """What the launching process decided: the overrides to run, the kind of launcher, the sweep's
    size and how many of its jobs run at once on this machine (1 for a single run)."""
    args: list
    launcher: str = "basic"
    jobs: int = 1
    parallel: int = 1
    sweep_dir: str | None = None     # a sweep's folder, resolved (claimed by ``SweepClaim`` before Hydra runs)
    pin: list = field(default_factory=list)    # the override that hands that folder to Hydra literally
    folders: list = field(default_factory=list)    # each job's folder, by job number (resolved as Hydra will)


class JobFailed(CompactHydraException):
    """A sweep job that failed in a worker process or a cluster job (returned to the launching process).

    Hydra prints ``str()`` of it as one line; ``dpsgd/run/launch.py:main`` exits with ``code``."""

    def __init__(self, line: str, code: int):
        super().__init__(line, code)
        self.line, self.code = line, code

    def __str__(self) -> str:
        return self.line


# ------------------------------------------------------------------------------- lost worker processes
_LAUNCHER_CLASSES = {   # where each kind's ``launch`` is defined
    "joblib": ("hydra_plugins.hydra_joblib_launcher.joblib_launcher", "JoblibLauncher"),
    "submitit_local": ("hydra_plugins.hydra_submitit_launcher.submitit_launcher", "BaseSubmititLauncher"),
    "submitit_slurm": ("hydra_plugins.hydra_submitit_launcher.submitit_launcher", "BaseSubmititLauncher")}
_LOST_WORKER = {"joblib": ("joblib.externals.loky.process_executor", "TerminatedWorkerError")}


@contextmanager
def failures_reported(plan: Launch):
    """While a sweep runs (in the launching process), the launcher's ``launch`` ends the command with
    one line and its exit code instead of Hydra's report: a job whose process died (``lost_worker``:
    joblib's pool is then broken; ``lost_jobs``: a submitit job killed or lost, its siblings run on),
    else the first job that failed (``JobFailed``, its line)."""
    spec = _LAUNCHER_CLASSES.get(plan.launcher)
    if spec is None:
        yield
        return
    from hydra.core.utils import JobStatus
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
        failed = next((r._return_value for r in runs if r.status == JobStatus.FAILED
                       and isinstance(r._return_value, JobFailed)), None)
        if failed is not None:
            print(failed.line, file=sys.stderr, flush=True)
            raise SystemExit(failed.code)
        return runs

    launcher.launch = launch
    try:
        yield
    finally:
        launcher.launch = original


@dataclass
class LostJob:
    """A submitit job that produced no result (its process killed, out of memory, crashed, a lost
    node), with its state as submitit saw it. Its exit code is not known: submitit_local's controller
    process does not pass on its task's, and SLURM reports states, not signals."""
    state: str


@contextmanager
def _submitit_losses(kind: str):
    """For submitit launchers: a job that produced no result comes back as ``LostJob`` instead of
    raising ``UncompletedJobError`` out of the launcher's wait on the first such job, so the launcher
    still waits for every other job (each a process or cluster job of its own, running on)."""
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
    for name, c in re.findall(r"\b([A-Z][A-Z0-9]*)\((-?\d+)\)", str(exc)):    # loky: {SIGKILL(-9)}
        if int(c) < 0:
            how, code = f"was killed by {name}", 128 - int(c)
            break
        if int(c) > 0:
            how, code = f"exited with code {c}", int(c)
            break
    states = {num: job_state(folders[num] if num < len(folders) else None) for num, _ in jobs}
    named = [(n, o) for n, o in jobs if states[n][0] == "stopped"] or \
            [(n, o) for n, o in jobs if states[n][0] == "not run"] or jobs
    what = (f"its hydra/launcher={kind} worker process {how}" if len(named) == 1 else
            f"a hydra/launcher={kind} worker process running one of them {how}, and the others were stopped")
    return error_line(f"{_who(named, jobs)}: {what}; the sweep stopped (jobs {_outcomes(jobs, states, folders)})",
                      code), code


def lost_jobs(dead: list, kind: str, jobs: list, folders: list) -> tuple[str, int]:
    """(one line, exit code 1) for submitit jobs that produced no result (``dead``: [((job number,
    overrides), LostJob)]) once every job of the batch ``jobs`` has ended: which, their submitit
    state, and what each job's folder shows."""
    states = {num: job_state(folders[num] if num < len(folders) else None) for num, _ in jobs}
    seen = ", ".join(dict.fromkeys(lost.state for _, lost in dead))
    what = (f"{'its' if len(dead) == 1 else 'their'} hydra/launcher={kind} job{'' if len(dead) == 1 else 's'} "
            f"ended without a result (the process died: killed, out of memory or crashed; submitit state {seen})")
    return error_line(f"{_who([j for j, _ in dead], jobs)}: {what}; the other jobs ran to their end (jobs "
                      f"{_outcomes(jobs, states, folders)})", 1), 1


def _who(named: list, jobs: list) -> str:
    """'sweep job(s) N, M (the overrides that tell them apart)'."""
    shared = set.intersection(*(set(o) for _, o in jobs)) if len(jobs) > 1 else set()
    return (f"sweep job{'' if len(named) == 1 else 's'} {', '.join(str(n) for n, _ in named)} "
            f"({' | '.join(' '.join(a for a in o if a not in shared) or 'no overrides' for _, o in named)})")


def _outcomes(jobs: list, states: dict, folders: list) -> str:
    """'complete: 0; stopped: 1 (resume with: ...); not run: 2': what each job's folder shows."""
    groups: dict[str, list[str]] = {}
    for num, _ in jobs:
        state, resumable = states[num]
        groups.setdefault(state, []).append(
            f"{num} (resume with: python -m dpsgd.train {shlex.quote('resume=' + folders[num])})" if resumable
            else f"{num} (before its first checkpoint)" if state == "stopped" else str(num))
    return "; ".join(f"{state}: {', '.join(nums)}" for state, nums in groups.items())


def check(hc) -> str:
    """The launcher's settings (``hc = cfg.hydra``), checked; returns its kind (basic, joblib,
    submitit_local, submitit_slurm or other). ConfigError in one line naming the key."""
    from omegaconf import OmegaConf
    name = str((hc.runtime.choices or {}).get("hydra/launcher") or "basic")
    params = OmegaConf.to_container(hc.launcher, resolve=False)
    target = str(params.get("_target_"))
    module = target.rsplit(".", 1)[0]
    try:
        found = importlib.util.find_spec(".".join(module.split(".")[:2])) is not None
    except (ImportError, ValueError):
        found = False
    if not found:
        raise ConfigError(f"hydra/launcher={name}: its plugin is not installed ({module}; pinned in "
                          "requirements.txt: make install)")
    for key, (lo, optional) in _INTS.items():
        if key not in params:
            continue
        v = params[key]
        if isinstance(v, str) and "${" in v:     # an interpolation: its value
            try:
                v = hc.launcher[key]
            except Exception:
                continue
        if v is None and optional:
            continue
        if isinstance(v, bool) or not isinstance(v, int):
            raise ConfigError(f"hydra.launcher.{key}={v}: must be an integer" + (" or null" if optional else ""))
        if key == "n_jobs" and v == 0:
            raise ConfigError("hydra.launcher.n_jobs=0: must be >= 1 (jobs at once), or -1 for one per usable core")
        if key in _ONE and v != 1:
            raise ConfigError(f"hydra.launcher.{key}={v}: must be 1 (a job is one training process; one writer "
                              "per run directory)")
        if lo is not None and v < lo:
            raise ConfigError(f"hydra.launcher.{key}={v}: must be >= {lo}")
    return LAUNCHERS.get(target, "other")


def usable_cores() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        return os.cpu_count() or 1


def parallel_jobs(kind: str, params: dict, jobs: int, cores: int | None = None) -> int:
    """How many of a sweep's ``jobs`` run at the same time on this machine.

    basic: 1; joblib: min(jobs, n_jobs), n_jobs < 0 counted as joblib does (cores + 1 + n_jobs);
    submitit_local: every job; submitit_slurm (and launchers dpsgd does not know): 1, each job on
    the cores of its own allocation."""
    if kind == "joblib":
        try:
            n = int(params.get("n_jobs") or -1)
        except (TypeError, ValueError):   # an unresolved interpolation: as many as joblib's default
            n = -1
        cores = usable_cores() if cores is None else cores
        n = max(1, cores + 1 + n) if n < 0 else n
        return max(1, min(jobs, n))
    if kind == "submitit_local":
        return max(1, jobs)
    return 1


def share_cores(plan: Launch, env: dict) -> bool:
    """Export DPSGD_PARALLEL_JOBS into ``env`` (inherited by the jobs) when several jobs share this
    machine and the user did not choose the threads; returns True if exported."""
    if plan.parallel <= 1 or any((env.get(k) or "").strip() for k in ("DPSGD_THREADS", "OMP_NUM_THREADS")):
        return False
    env[PARALLEL_ENV] = str(plan.parallel)
    return True


# ----------------------------------------------------------------------------------- sweep folders
SWEEP_CLAIM = ".sweep.claim"      # created exclusively by the launching process, removed when it ends
RUN_MARKERS = (".hydra", "privacy.json", "checkpoint.pt")     # what a run folder holds
_BASIC_SWEEPER = "hydra._internal.core_plugins.basic_sweeper.BasicSweeper"


@dataclass
class Sweep:
    """A sweep as Hydra will run it: its config (Hydra's node included), its folder (resolved) and the
    override that hands that folder to Hydra, the launcher's kind, and each job's ``hydra.sweep.subdir``
    resolved (``probe``: job 0's with another job number)."""
    config: object
    dir: str
    pin: str
    launcher: str
    subdir: str
    subdirs: list
    probe: str


def resolve_sweep(args: list[str]) -> Sweep:
    """The sweep of the command-line overrides ``args``, every job's folder resolved the way Hydra will
    resolve it; nothing is written. ConfigError in one line (the launcher, an interpolation that does
    not resolve, a job that does not compose)."""
    from hydra.core.hydra_config import HydraConfig
    from hydra.types import RunMode
    from omegaconf import OmegaConf
    with config_loader() as loader:
        try:
            master = loader.load_configuration("config", overrides=list(args), run_mode=RunMode.MULTIRUN)
        except Exception as e:
            raise ConfigError(one_line(e)) from None
        try:
            folder = str(master.hydra.sweep.dir)
        except Exception as e:
            text = OmegaConf.to_container(master.hydra.sweep, resolve=False)["dir"]
            raise ConfigError(f"hydra.sweep.dir={text}: {one_line(e)}") from None
        pin = f"hydra.sweep.dir={hydra_quoted(folder)}"
        try:
            master = loader.load_configuration("config", overrides=list(args) + [pin], run_mode=RunMode.MULTIRUN)
        except Exception as e:
            raise ConfigError(f"hydra.sweep.dir={folder}: {one_line(e)}") from None
        if str(master.hydra.sweep.dir) != folder:
            raise ConfigError(f"hydra.sweep.dir={folder}: cannot be handed to Hydra literally (pick a folder name "
                              "without quote characters or '${')")
        kind = check(master.hydra)
        subdir = str(OmegaConf.to_container(master.hydra.sweep, resolve=False)["subdir"])
        jobs = _job_overrides(loader, master)
        subdirs, first, current = [], None, HydraConfig.instance().cfg
        try:
            for num, overrides in enumerate(jobs):
                try:
                    cfg = loader.load_sweep_config(master, list(overrides))
                except Exception as e:
                    raise ConfigError(f"sweep job {num} ({' '.join(overrides)}): {one_line(e)}") from None
                subdirs.append(_subdir(cfg, num, kind, subdir))
                first = cfg if first is None else first
            probe = _subdir(first, len(jobs) + 1, kind, subdir) if first is not None else ""
        finally:
            HydraConfig.instance().cfg = current        # as it was (each job's was made current)
    return Sweep(master, folder, pin, kind, subdir, subdirs, probe)


def _job_overrides(loader, master) -> list[list[str]]:
    """Each job's overrides, in Hydra's order: the basic sweeper's expansion of the sweep file's params
    and the command line (glob() included, through the config loader)."""
    from hydra._internal.core_plugins.basic_sweeper import BasicSweeper
    from hydra.core.override_parser.overrides_parser import OverridesParser
    target = str(master.hydra.sweeper.get("_target_"))
    if target != _BASIC_SWEEPER:
        name = (master.hydra.runtime.choices or {}).get("hydra/sweeper") or target
        raise ConfigError(f"hydra/sweeper={name}: not supported (dpsgd resolves and checks every job's folder "
                          "before a sweep starts, with Hydra's basic sweeper)")
    params = [f"{k}={v}" for k, v in (master.hydra.sweeper.get("params") or {}).items()]
    try:
        parsed = OverridesParser.create(config_loader=loader).parse_overrides(params + list(master.hydra.overrides.task))
        return [list(job) for batch in BasicSweeper.split_arguments(parsed, None) for job in batch]
    except Exception as e:
        raise ConfigError(one_line(e)) from None


def _subdir(cfg, num: int, kind: str, text: str) -> str:
    """``hydra.sweep.subdir`` of job ``num`` (its config ``cfg``), resolved as the launcher ``kind``
    will resolve it: job number and id set, Hydra's node current (``${hydra:...}``)."""
    from hydra.core.hydra_config import HydraConfig
    from omegaconf import OmegaConf, open_dict, read_write
    with read_write(cfg.hydra.job), open_dict(cfg.hydra.job):     # read-only once Hydra's node is current
        cfg.hydra.job.num = num
        cfg.hydra.job.id = num if kind == "basic" else (f"{cfg.hydra.job.name}_{num}" if kind == "joblib"
                                                        else f"job_id_for_{num}")
    HydraConfig.instance().set_config(cfg)
    try:
        return str(OmegaConf.select(cfg, "hydra.sweep.subdir"))
    except Exception as e:
        raise ConfigError(f"hydra.sweep.subdir={text}: {one_line(e)}") from None


def name_max(folder: Path) -> int:
    """The longest file name (bytes) the file system of ``folder`` (or its nearest existing parent) takes."""
    while not folder.exists() and folder != folder.parent:
        folder = folder.parent
    try:
        return int(os.pathconf(folder, "PC_NAME_MAX"))
    except (OSError, ValueError):
        return 255


def _resolved(key: str, path: str) -> Path:
    try:
        return Path(path).resolve()
    except (OSError, RuntimeError) as e:       # a symlink loop
        raise ConfigError(f"{key}: {path} cannot be resolved ({one_line(e)})") from None


def check_job_folders(sweep: Sweep) -> None:
    """Every job's folder (``<sweep dir>/<its subdir>``, as Hydra joins them) lies inside the sweep
    folder after ``Path.resolve()``, is no other job's folder nor inside one, changes with the job's
    number, and has names the file system takes; the sweep folder lies inside no run. ConfigError in
    one line naming ``hydra.sweep.subdir`` (or ``hydra.sweep.dir``)."""
    key = f"hydra.sweep.subdir={sweep.subdir}"
    base = _resolved(f"hydra.sweep.dir={sweep.dir}", sweep.dir)
    limit = name_max(base)
    for p in (base, *base.parents):
        marker = next((m for m in RUN_MARKERS if (p / m).exists()), None)
        if marker is not None and p != base:
            raise ConfigError(f"hydra.sweep.dir={sweep.dir}: lies inside the run folder {p} (it holds {marker}); "
                              "pick a folder outside every run")
    for name in base.parts:
        if len(os.fsencode(name)) > limit:
            raise ConfigError(f"hydra.sweep.dir={sweep.dir}: a folder name is longer than {limit} bytes")
    folders: dict[Path, int] = {}
    for num, sub in enumerate(sweep.subdirs):
        job = _resolved(key, os.path.join(sweep.dir, sub))
        if base not in job.parents:
            raise ConfigError(f"{key}: job {num}'s folder {job} is not inside the sweep folder {base} (a relative "
                              "path below it, one new folder per job)")
        long = [n for n in job.relative_to(base).parts if len(os.fsencode(n)) > limit]
        if long:
            raise ConfigError(f"{key}: job {num}'s folder name is {len(os.fsencode(long[0]))} bytes, longer than the "
                              f"file system's {limit} (keep it short, e.g. ${{dpsgd.short:${{hydra.job.override_dirname}}}})")
        if job in folders:
            raise ConfigError(f"{key}: jobs {folders[job]} and {num} would share the folder {job} (it must vary with "
                              "${hydra.job.num})")
        folders[job] = num
    for job, num in folders.items():
        outer = next((p for p in job.parents if p in folders), None)
        if outer is not None:
            raise ConfigError(f"{key}: job {num}'s folder {job} lies inside job {folders[outer]}'s folder")
    if sweep.subdirs and _resolved(key, os.path.join(sweep.dir, sweep.probe)) == \
            _resolved(key, os.path.join(sweep.dir, sweep.subdirs[0])):
        raise ConfigError(f"{key}: does not vary with the job number; must contain ${{hydra.job.num}} (one new "
                          "folder per job)")


def unclaimed(folder: str) -> None:
    """ConfigError in one line if another sweep's launching process holds ``folder`` (``SweepClaim``).

    A claim whose launching process is gone (SIGKILL, power loss) is removed here, with a note: its
    launcher held an ``flock`` on the claim for as long as it lived, and the kernel drops that lock
    when the process and every child it forked have ended (``_stale``)."""
    path = Path(folder) / SWEEP_CLAIM
    if not os.path.lexists(path):
        return
    stale = _stale(path)
    if stale is not None:
        print(f"note: hydra.sweep.dir={folder}: removed a stale sweep claim ({stale.strip()}; its launching "
              "process has ended)", file=sys.stderr, flush=True)
        return
    try:
        holder = path.read_text().strip()
    except OSError:
        holder = ""
    raise ConfigError(f"hydra.sweep.dir={folder}: another sweep holds this folder ({path}"
                      f"{': ' + holder if holder else ''}; delete that file if no sweep runs there); one sweep "
                      "per folder (pick a new hydra.sweep.dir)")


def _stale(path: Path) -> str | None:
    """Remove the claim ``path`` and return its text if no process holds it, else None (held, being
    written, or its lock cannot be tested: then it counts as held).

    A live claim is locked from before its text is written until it is removed (``SweepClaim``), so a
    claim that can be locked and holds a complete text was left by a launcher that has ended. It is
    unlinked while locked: a concurrent tester fails to lock it and refuses; the next claim is created
    anew with ``O_EXCL``."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW)
    except OSError:
        return None
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:
            return None                       # held (EWOULDBLOCK), or no locks here (ENOLCK): held
        text = os.read(fd, 4096).decode(errors="replace")
        if not (text.startswith("pid ") and text.endswith("\n")):
            return None                       # its creator has not locked and written it yet
        try:
            if os.stat(path, follow_symlinks=False).st_ino != os.fstat(fd).st_ino:
                return None                   # replaced since it was opened
            os.unlink(path)
        except OSError:
            return None
        return text
    finally:
        os.close(fd)                          # drops the lock


class SweepClaim:
    """The launching process's hold on its sweep folder: ``.sweep.claim`` (pid, host, time) created
    with ``O_CREAT | O_EXCL``, which exactly one process can do, then the folder must hold nothing else.

    Of two sweeps started together into one folder, one creates the claim and proceeds; the other is
    refused in one line (exit 2) and writes nothing there. ``release`` removes the claim when the sweep
    ends, and the folders the claim created if they are left empty. The claim is ``flock``'d from
    before its text is written until the sweep ends, so a claim whose launching process was killed
    (SIGKILL) holds no lock, and the next sweep into the folder removes it (``unclaimed``)."""

    def __init__(self, folder: str):
        self.folder = Path(folder)
        self.path = self.folder / SWEEP_CLAIM
        self.token = f"pid {os.getpid()} on {socket.gethostname()} since " \
                     f"{time.strftime('%Y-%m-%dT%H:%M:%S%z')} ({os.urandom(4).hex()})\n"
        self.created = [p for p in (self.folder, *self.folder.parents) if not p.exists()]   # deepest first
        self.fd = None
        try:
            self.folder.mkdir(parents=True, exist_ok=True)
        except FileExistsError:
            raise ConfigError(f"hydra.sweep.dir={folder}: exists and is not a folder") from None
        except OSError as e:
            raise ConfigError(f"hydra.sweep.dir={folder}: cannot be created ({e.strerror or e})") from None
        fd = self._create()
        if fd is None:                 # a claim is there: refused, unless its launcher has ended
            try:
                unclaimed(folder)
                fd = self._create()
            except ConfigError:
                self._remove_created()
                raise
        if fd is None:
            self._remove_created()
            raise ConfigError(f"hydra.sweep.dir={folder}: another sweep held this folder; one sweep per folder "
                              "(pick a new hydra.sweep.dir)")
        try:
            fcntl.flock(fd, fcntl.LOCK_EX)    # held until release() or this process's end: the claim is live
        except OSError:
            pass                              # no locks on this file system: the claim never reads as stale
        os.write(fd, self.token.encode())
        self.fd = fd
        others = sorted(p.name for p in self.folder.iterdir() if p.name != SWEEP_CLAIM)
        if others:
            self.release()
            raise ConfigError(f"hydra.sweep.dir={folder}: already exists and is not empty ({others[0]}); never "
                              "overwritten (pick a new dir)")

    def _create(self) -> int | None:
        """The claim file, created exclusively (its descriptor), or None if one is there."""
        try:
            return os.open(self.path, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644)
        except FileExistsError:
            return None
        except OSError as e:
            self._remove_created()
            raise ConfigError(f"hydra.sweep.dir={self.folder}: cannot be claimed ({e.strerror or e})") from None

    def _remove_created(self) -> None:
        for p in self.created:
            try:
                p.rmdir()
            except OSError:
                return

    def release(self) -> None:
        """Remove the claim (if still this process's), and the folders it created if left empty."""
        try:
            if self.path.read_text() == self.token:
                self.path.unlink()
        except OSError:
            pass
        if self.fd is not None:
            os.close(self.fd)                 # drops the lock
            self.fd = None
        self._remove_created()
