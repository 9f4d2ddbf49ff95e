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
jobs and decides how many share this machine (``parallel_jobs``), so that jobs at once × threads
per job never exceed the cores (``share_cores``: ``DPSGD_PARALLEL_JOBS``).

The sweep's folders are resolved, checked and claimed in ``dpsgd/launch/sweeps.py``; a job that
fails or dies in a worker process or cluster job is reported in ``dpsgd/launch/jobfailures.py``.
Details: docs/SCALING.md, "dpsgd/launch/launchers.py".
"""

from __future__ import annotations

import importlib.util
import os
from dataclasses import dataclass, field

from dpsgd.core.errors import ConfigError

# the kind of launcher, from the Launcher class its _target_ names (any hydra/launcher option;
# Hydra's own, basic, in launcher_kind)
LAUNCHERS = {
    "hydra_plugins.hydra_joblib_launcher.joblib_launcher.JoblibLauncher": "joblib",
    "hydra_plugins.hydra_submitit_launcher.submitit_launcher.LocalLauncher": "submitit_local",
    "hydra_plugins.hydra_submitit_launcher.submitit_launcher.SlurmLauncher": "submitit_slurm",
}
PARALLEL_ENV = "DPSGD_PARALLEL_JOBS"

# Integer settings: key -> (smallest value, None allowed). tasks_per_node and nodes must be 1: a job
# is one training process (several tasks would be several writers of one run directory).
_INTS = {
    "n_jobs": (None, False),
    "verbose": (0, False),
    "timeout_min": (1, False),
    "cpus_per_task": (1, True),
    "gpus_per_node": (0, True),
    "gpus_per_task": (0, True),
    "cpus_per_gpu": (1, True),
    "mem_gb": (1, True),
    "tasks_per_node": (1, False),
    "nodes": (1, False),
    "signal_delay_s": (0, False),
    "max_num_timeout": (0, False),
    "array_parallelism": (1, False),
}
_ONE = ("tasks_per_node", "nodes")


@dataclass
class Launch:
    """What the launching process decided: the overrides to run, the kind of launcher, the sweep's
    size and how many of its jobs run at once on this machine (1 for a single run)."""

    args: list
    launcher: str = "basic"
    jobs: int = 1
    parallel: int = 1
    sweep_dir: str | None = (
        None  # a sweep's folder, resolved (claimed by ``SweepClaim`` before Hydra runs)
    )
    pin: list = field(
        default_factory=list
    )  # the override that hands that folder to Hydra literally
    folders: list = field(
        default_factory=list
    )  # each job's folder, by job number (resolved as Hydra will)


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
        raise ConfigError(
            f"hydra/launcher={name}: its plugin is not installed ({module}; pinned in "
            "requirements.txt: make install)"
        )
    for key, (lo, optional) in _INTS.items():
        if key not in params:
            continue
        v = params[key]
        if isinstance(v, str) and "${" in v:  # an interpolation: its value
            try:
                v = hc.launcher[key]
            except Exception:
                continue
        if v is None and optional:
            continue
        if isinstance(v, bool) or not isinstance(v, int):
            raise ConfigError(
                f"hydra.launcher.{key}={v}: must be an integer" + (" or null" if optional else "")
            )
        if key == "n_jobs" and v == 0:
            raise ConfigError(
                "hydra.launcher.n_jobs=0: must be >= 1 (jobs at once), or -1 for one per usable "
                "core"
            )
        if key in _ONE and v != 1:
            raise ConfigError(
                f"hydra.launcher.{key}={v}: must be 1 (a job is one training process; one writer "
                "per run directory)"
            )
        if lo is not None and v < lo:
            raise ConfigError(f"hydra.launcher.{key}={v}: must be >= {lo}")
    return launcher_kind(target)


def launcher_kind(target: str) -> str:
    """The kind of launcher whose Launcher class ``target`` (``hydra.launcher._target_``) names:
    basic, joblib, submitit_local, submitit_slurm, else other. Hydra's own launcher
    (``hydra/launcher=basic``, the default) lives in Hydra's private modules: its path is spelt here
    alone, and tests/launch/test_hydra_private.py fails if a Hydra upgrade moves it."""
    if target == "hydra._internal.core_plugins.basic_launcher.BasicLauncher":
        return "basic"
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
        except (TypeError, ValueError):  # an unresolved interpolation: as many as joblib's default
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
    if plan.parallel <= 1 or any(
        (env.get(k) or "").strip() for k in ("DPSGD_THREADS", "OMP_NUM_THREADS")
    ):
        return False
    env[PARALLEL_ENV] = str(plan.parallel)
    return True
