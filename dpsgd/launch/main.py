"""Command line: ``python -m dpsgd.train [key=value ...] | -m [key=value ...] | resume=<run dir>``.

Everything is decided before anything is written (the checks themselves: dpsgd/launch/prepare.py);
this module runs what they allowed:

* a single run: the config is validated and the output folder, resolved the way Hydra will
  resolve it, must be new or empty; then Hydra runs ``train`` in it;
* a sweep (``-m``): every job's folder must lie inside the sweep folder, which must be new or empty
  and is claimed (dpsgd/launch/sweeps.py); the launcher is checked (dpsgd/launch/launchers.py);
  jobs in worker processes or cluster jobs run only ``task`` and report a failure back;
* a resume: the config comes from the run's checkpoint, the new overrides are applied after it,
  and Hydra is not involved;
* under torchrun (``torchrun_main``): rank 0 makes the checks of a single run and every rank
  agrees on its folder before anything runs (the communication: dpsgd/run/distributed.py).

Every expected failure is one line on stderr and an exit code (2: bad input; 1: diverged, disk
error; 128 + n: signal n), never a traceback (dpsgd/launch/cli.py, shared with
``python -m dpsgd.pretrain``). Details: docs/CONFIGURATION.md, "dpsgd/launch/main.py".
"""

from __future__ import annotations

import importlib
import os
import shutil
import signal
import sys
import time
from pathlib import Path

from dpsgd.core.console import prefixed
from dpsgd.config.overrides import override_key
from dpsgd.config.schema import validate
from dpsgd.core.errors import ConfigError
from dpsgd.core.runtime import tune_allocator
from dpsgd.data.datasets import DataUnavailable
from dpsgd.run import distributed
from dpsgd.core.errors import one_line
from dpsgd.launch.cli import (
    CONF_DIR,
    compose,
    data_ready,
    error_line,
    fail,
    failure,
    hydra_quoted,
    run_or_exit,
    search_path,
    split_cli,
)
from dpsgd.launch.jobfailures import JobFailed, failures_reported
from dpsgd.launch.launchers import share_cores
from dpsgd.launch.prepare import prepare, prepare_launch, prepare_resume
from dpsgd.launch.sweeps import SWEEP_CLAIM, SweepClaim
from dpsgd.run.rundir import RunLock

_T0 = time.time()
_LAUNCHER_PID = (
    None  # set by main(): the process that runs Hydra (a worker or cluster job has another)
)
_INFO_FLAGS = (
    "--help",
    "-h",
    "--hydra-help",
    "--version",
    "--cfg",
    "-c",
    "--info",
    "-i",
    "--resolve",
    "--package",
    "-p",
    "--shell-completion",
    "-sc",
)


def _discard_fresh_run_dir(run_dir: Path, parents: bool = True) -> None:
    """Remove a run dir that Hydra created for this refused job and that holds only Hydra's files;
    with ``parents``, also the sweep folders this process created that are left empty (never from a
    worker process: its siblings may be creating their folders there at the same time)."""
    hydra_files = {".hydra", ".hydra/config.yaml", ".hydra/hydra.yaml", ".hydra/overrides.yaml"}
    try:
        entries = {str(f.relative_to(run_dir)) for f in run_dir.rglob("*")}
        if not entries <= hydra_files or any(
            (run_dir / f).stat().st_mtime < _T0 - 1 for f in entries
        ):
            return
        shutil.rmtree(run_dir)
        if not parents:
            return
        for parent in run_dir.parents:
            if parent == Path.cwd() or parent.stat().st_ctime < _T0 - 1:
                break
            sweep_file = (
                parent / "multirun.yaml"
            )  # written by Hydra into a fresh sweep dir (claimed: main)
            names = {f.name for f in parent.iterdir()}
            if (
                "multirun.yaml" in names
                and names <= {"multirun.yaml", SWEEP_CLAIM}
                and sweep_file.stat().st_mtime >= _T0 - 1
            ):
                sweep_file.unlink()
            if any(parent.iterdir()):
                break
            parent.rmdir()
    except OSError:
        pass


def task(train, cfg) -> None:
    """One Hydra job: ``train`` (Algorithm 1) in the job's new folder, held locked from the start.

    In the launching process (basic launcher) a failure exits at once, as a single run does. In a
    worker process (joblib) or a cluster job (submitit) it is printed into the job's log and
    returned to the launching process as ``JobFailed``, so that the siblings still finish."""
    from hydra.core.hydra_config import HydraConfig

    hc = HydraConfig.get()
    run_dir = Path(hc.runtime.output_dir)
    overrides = list(hc.overrides.task)
    launching = os.getpid() == _LAUNCHER_PID

    def run():
        with RunLock(run_dir):  # held before anything is decided about this folder
            try:
                c = validate(cfg)
                if c.resume:
                    raise ConfigError(
                        "resume: resume a single run on its own: "
                        "python -m dpsgd.train resume=<run dir>"
                    )
                data_ready(c)
                train(c, run_dir, overrides)
            except (ConfigError, DataUnavailable):
                _discard_fresh_run_dir(run_dir, parents=launching)
                raise

    if launching:
        run_or_exit(run)
        return
    with prefixed(f"[job {hc.job.num}] "):  # parallel jobs' lines interleave: each says its job
        failed = failure(run)
    if failed is not None:
        msg, code = failed
        print(error_line(msg, code), file=sys.stderr, flush=True)
        raise JobFailed(error_line(f"sweep job {hc.job.num} ({run_dir}): {msg}", code), code)


def _or_exit_2(fn):
    try:
        return fn()
    except ConfigError as e:
        fail(one_line(e), 2)


def _importable(fn):
    """``fn`` as an attribute of an importable module: ``python -m dpsgd.train`` runs that module as
    ``__main__``, and a worker process or cluster job must find the task by its module's name."""
    if getattr(fn, "__module__", None) == "__main__":
        spec = getattr(sys.modules["__main__"], "__spec__", None)
        if spec is not None and spec.name:
            return getattr(importlib.import_module(spec.name), fn.__qualname__, fn)
    return fn


def _resume(train, overrides: list[str]) -> None:
    c, rd, rest = prepare_resume(overrides)
    train(c, rd, rest)


def _run_hydra(app, args: list[str]) -> None:
    """Hydra's command line over ``args`` (conf/config.yaml), running ``app(cfg)``."""
    import hydra

    sys.argv = [sys.argv[0]] + args
    hydra.main(version_base="1.3", config_path=CONF_DIR, config_name="config")(app)()


def train_main(argv: list[str] | None = None) -> None:
    """``python -m dpsgd.train ...``: the command line running Algorithm 1
    (``dpsgd.train.train``)."""
    from dpsgd.train import train

    main(train, argv)


def main(train, argv: list[str] | None = None) -> None:
    """The command line around ``train(config, run_dir, overrides)`` (Algorithm 1,
    dpsgd/train.py)."""
    global _LAUNCHER_PID
    _LAUNCHER_PID = os.getpid()
    tune_allocator()  # speed only: glibc keeps per-step buffers instead of re-faulting them
    train = _importable(train)
    args = list(sys.argv[1:] if argv is None else argv)
    if any(a.split("=", 1)[0] in _INFO_FLAGS for a in args):  # help / print the config: no run
        _run_hydra(lambda cfg: None, args)
        return
    d = _or_exit_2(distributed.from_env)
    if d is not None:  # under torchrun: one run over several processes
        torchrun_main(train, args, d)
        return
    try:
        multirun, dirs, overrides = split_cli(args)
        search = search_path(dirs)
        if any(override_key(a) == "resume" for a in overrides) and not multirun and not dirs:
            run_or_exit(_resume, train, overrides)
            return
        plan = prepare_launch(overrides, multirun, search)
        claim = (
            SweepClaim(plan.sweep_dir) if plan.sweep_dir is not None else None
        )  # held for the sweep
    except ConfigError as e:
        fail(one_line(e), 2)
    share_cores(plan, os.environ)  # inherited by joblib workers and submitit_local jobs
    try:
        with failures_reported(plan):
            _run_hydra(lambda cfg: task(train, cfg), args + plan.pin)
    except KeyboardInterrupt:
        fail("interrupted by SIGINT", 128 + signal.SIGINT)
    except (
        SystemExit
    ) as e:  # Hydra reported a failed sweep job (HYDRA_FULL_ERROR unset) and exits 1: its code
        if isinstance(e.__context__, JobFailed):
            raise SystemExit(e.__context__.code) from None
        raise
    finally:
        if claim is not None:
            claim.release()


def torchrun_main(train, args: list[str], d: distributed.Dist) -> None:
    """The command line under torchrun: every rank agrees on one run directory before anything runs.

    Rank 0 resolves the run folder once (Hydra's ``${now:...}`` differs per process), checks it like
    a 1-process run (``prepare``) and runs Hydra in it; the other ranks receive that folder and run
    ``train`` without Hydra (they write nothing). ``resume=<dir>``: every rank reads the same run. A
    refusal is one line from rank 0 and exit 2 on every rank; ranks started on different runs
    (``distributed.agree_on``, in setup) all print the same line naming the first difference."""
    try:
        d = distributed.init(d)
    except (RuntimeError, ValueError) as e:
        fail(f"distributed: cannot join the process group ({one_line(e)})", 2)
    try:
        _torchrun(train, args, d)
    finally:
        distributed.shutdown()


def _torchrun(train, args: list[str], d: distributed.Dist) -> None:
    quiet = d.rank != 0

    def refuse(msg: str) -> None:  # rank 0 says why; every rank exits 2
        if quiet:
            raise SystemExit(2) from None
        fail(msg, 2)

    def run_quietly(fn, *a) -> None:
        def wrapped():
            try:
                try:
                    fn(*a)
                except (
                    ConfigError,
                    DataUnavailable,
                ) as e:  # before the ranks agree: every rank stops with it
                    distributed.join_refusal(
                        e if isinstance(e, ConfigError) else ConfigError(str(e))
                    )
            except distributed.RanksDisagree:  # the same line on every rank
                raise
            except ConfigError:
                if quiet:
                    raise SystemExit(2) from None
                raise

        run_or_exit(wrapped)

    try:
        multirun, dirs, overrides = split_cli(args)
        if multirun:
            raise ConfigError(
                "-m/--multirun: not under torchrun (one torchrun trains one run; sweeps use "
                "hydra/launcher, docs/SCALING.md)"
            )
        search = search_path(dirs)
    except ConfigError as e:
        refuse(one_line(e))
    if any(override_key(a) == "resume" for a in overrides) and not dirs:
        run_quietly(_resume, train, overrides)
        return
    msg, run_dir = None, None
    if d.rank == 0:
        try:
            run_dir = str(compose(overrides + search, hydra_config=True).hydra.run.dir)
            prepare(overrides + [f"hydra.run.dir={hydra_quoted(run_dir)}"], False, search)
        except ConfigError as e:
            msg = one_line(e)
    msg, run_dir = distributed.broadcast_object((msg, run_dir))
    if msg is not None:
        refuse(msg)
    if d.rank == 0:
        _run_hydra(lambda cfg: task(train, cfg), args + [f"hydra.run.dir={hydra_quoted(run_dir)}"])
    else:
        run_quietly(_follow, train, overrides + search, run_dir)


def _follow(train, composed: list[str], run_dir: str) -> None:
    """A rank other than 0: the run rank 0 checked, without Hydra (it writes nothing). Its overrides
    are read as rank 0's Hydra job reads them (interpolations resolved, Hydra's own left out), and
    its validated Config is compared with every other rank's (``distributed.config_items``)."""
    from omegaconf import open_dict

    cfg = compose(composed, hydra_config=True)
    overrides = [str(o) for o in cfg.hydra.overrides.task]
    with open_dict(cfg):
        del cfg["hydra"]
    c = validate(cfg)
    data_ready(c)
    train(c, run_dir, overrides)
