"""Training jobs of the experiment scripts (``make paper``, ``make seeds``): own processes or a
Hydra launcher.

* No launcher (``LAUNCHER`` unset): each job is a process ``python -m dpsgd.train ...`` of its own,
  at most ``n_parallel`` at a time, each with one thread (OMP_NUM_THREADS=1); a sweep job
  (``-m +sweep=<name>``) runs its points one after another (Hydra's basic launcher).
* ``--launcher <name>`` (``make paper LAUNCHER=joblib``; any ``hydra/launcher`` option: joblib,
  submitit_local, submitit_slurm, slurm): each job is one Hydra multirun ``python -m dpsgd.train -m
  ... hydra/launcher=<name>`` whose points the launcher runs — in parallel on this machine's cores
  (joblib, submitit_local: the jobs' threads share the cores, dpsgd/launch/launchers.py), or as a
  SLURM array. The scripts group their runs into as few multiruns as they can
  (``experiment=a,b,c,d``, ``seed=0,1,2``); local multiruns run one after another (each fills the
  cores), SLURM ones are all submitted at once.

The launcher name is checked before anything starts (a bad one: one line, exit 2).
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

from dpsgd.core.errors import ConfigError

from .paths import ROOT

LOCAL = ("basic", "joblib", "submitit_local")


def launcher_kind(name: str) -> tuple[str, dict]:
    """(kind, settings) of a ``hydra/launcher`` option, checked; ConfigError in one line."""
    from omegaconf import OmegaConf

    from dpsgd.launch.main import compose
    from dpsgd.launch.launchers import check

    hc = compose([f"hydra/launcher={name}"], hydra_config=True).hydra
    return check(hc), OmegaConf.to_container(hc.launcher, resolve=False)


def checked_launcher(name: str | None) -> str | None:
    """``name`` if it is a usable launcher (None: no launcher); else one line on stderr and exit
    2."""
    if name is None:
        return None
    try:
        launcher_kind(name)
    except ConfigError as e:
        print(f"error: --launcher {name}: {e}", file=sys.stderr)
        raise SystemExit(2) from None
    return name


def commands(jobs: list[dict], launcher: str | None) -> list[list[str]]:
    """The ``python -m dpsgd.train`` arguments of each job; with a launcher, every job is a
    multirun."""
    if launcher is None:
        return [list(j["args"]) for j in jobs]
    return [
        ["-m", *[a for a in j["args"] if a != "-m"], f"hydra/launcher={launcher}"] for j in jobs
    ]


def default_parallel(launcher: str | None, n_jobs: int) -> int:
    """Commands at a time: 2 own processes; one local multirun (it fills the cores); every cluster
    one."""
    if launcher is None:
        return 2
    return 1 if launcher_kind(launcher)[0] in LOCAL else max(1, n_jobs)


def run_jobs(
    jobs: list[dict], n_parallel: int, logs: Path, extra: list[str], launcher: str | None = None
) -> int:
    """Run the jobs ({name, args}), at most ``n_parallel`` commands at a time, each logged to
    ``<logs>/<name>.log``; returns the number that failed."""
    logs.mkdir(parents=True, exist_ok=True)
    env = dict(os.environ)
    if (
        launcher is None
    ):  # own processes: one thread each; a launcher's jobs share the cores themselves
        env.update(OMP_NUM_THREADS="1", MKL_NUM_THREADS="1")
    pending = list(zip(jobs, commands(jobs, launcher)))
    running, failed = [], 0
    while pending or running:
        while pending and len(running) < n_parallel:
            job, args = pending.pop(0)
            log = logs / f"{job['name']}.log"
            cmd = [sys.executable, "-m", "dpsgd.train", *args, *extra]
            print(
                f"[{time.strftime('%H:%M:%S')}] start {job['name']}: {' '.join(cmd[1:])}  (log "
                f"{log})",
                flush=True,
            )
            fh = open(log, "a")
            running.append(
                (
                    job,
                    subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=fh, stderr=subprocess.STDOUT),
                    fh,
                    time.time(),
                )
            )
        time.sleep(0.5)
        for item in list(running):
            job, proc, fh, t0 = item
            if proc.poll() is not None:
                fh.close()
                running.remove(item)
                ok = proc.returncode == 0
                failed += not ok
                print(
                    f"[{time.strftime('%H:%M:%S')}] {'done' if ok else 'FAILED'} {job['name']} "
                    f"(exit {proc.returncode}) in {(time.time() - t0) / 60:.1f} min",
                    flush=True,
                )
    return failed
