"""What ``python -m dpsgd.train`` checks before anything is written: the overrides (no Hydra setting
that could write outside a fresh run directory), the output folder of a single run or every job's
folder of a sweep (dpsgd/launch/sweeps.py resolves them as Hydra will), the launcher, the validated
config and its data; for ``resume=<dir>``, the run's checkpoint, its own overrides and the
fingerprint a resume may not change (dpsgd/config/fingerprint.py).

A refused command exits 2 with one line and never writes into an existing run; dpsgd/launch/main.py
runs what these checks allowed (Hydra, the sweep, torchrun).
"""

from __future__ import annotations

import os
from pathlib import Path

from dpsgd.config.fingerprint import config_fingerprint
from dpsgd.config.overrides import check_run_dir, override_key
from dpsgd.config.schema import Config, validate
from dpsgd.core.errors import ConfigError
from dpsgd.data.datasets import DATASETS
from dpsgd.run.checkpoint import check_resumable, refuse_audit_resume, resume_checkpoint
from dpsgd.launch.cli import (
    check_name_lengths,
    compose,
    data_ready,
    dataset_ready,
    fresh_dir,
    literal_value,
)
from dpsgd.launch.launchers import Launch, check as check_launcher, parallel_jobs
from dpsgd.launch.sweeps import check_job_folders, resolve_sweep, unclaimed

_HYDRA_KEYS = (
    "hydra.run.dir",
    "hydra.sweep.dir",
    "hydra.sweep.subdir",
    "hydra.verbose",
    "hydra.job.name",
)
_HYDRA_PREFIXES = ("hydra.launcher.", "hydra.sweeper.", "hydra/launcher", "hydra/sweeper")


def _check_overrides(overrides: list[str], resume: bool) -> None:
    """Refuse Hydra overrides that could write outside a fresh run directory (or anything of Hydra's
    on resume, which runs without Hydra)."""
    for a in overrides:
        k = override_key(a)
        if not (k.startswith("hydra.") or k.startswith("hydra/")):
            continue
        if resume:
            raise ConfigError(
                f"{k}: Hydra settings cannot be given with resume= (a resume writes only into "
                "its own run directory)"
            )
        if k not in _HYDRA_KEYS and not k.startswith(_HYDRA_PREFIXES):
            raise ConfigError(
                f"{k}: not supported (dpsgd accepts hydra.run.dir, hydra.sweep.dir, "
                "hydra.sweep.subdir, hydra/launcher and hydra/sweeper settings)"
            )


def _check_name(cfg) -> None:
    """``name`` (a folder of the default output path) fits the file system, named before the folder
    is."""
    if isinstance(cfg.get("name"), str) and cfg.name:
        check_name_lengths("name", Path(cfg.name))


def prepare(args: list[str], multirun: bool = False, search: list[str] = ()) -> list[str]:
    """Validate a run's overrides before Hydra creates anything; returns the overrides to run
    (``prepare_launch`` also says how its jobs will be launched).

    The output folder is resolved the way Hydra will resolve it (any spelling of the key), and must
    be new or empty: a refused command never writes into an existing run. For a sweep, every job's
    folder is resolved the way Hydra will resolve it (dpsgd/launch/sweeps.py:resolve_sweep) and must
    lie inside the sweep folder, one new folder per job (``check_job_folders``); the sweep folder
    must be new or empty (``launch.main`` then claims it, ``SweepClaim``). Each job's config is
    validated when it starts, before it writes anything but Hydra's ``.hydra`` files into its own
    new folder.
    """
    return prepare_launch(args, multirun, search).args


def prepare_launch(args: list[str], multirun: bool = False, search: list[str] = ()) -> Launch:
    """``prepare``, and the launch plan: the launcher (checked), the sweep's jobs, how many run at
    once, and for a sweep its folder (resolved) and the override that hands it to Hydra."""
    from omegaconf import OmegaConf, open_dict

    if any(override_key(a) == "resume" for a in args):
        raise ConfigError(
            "resume: resume a single run on its own: python -m dpsgd.train resume=<run dir> "
            "[key=value ...]"
        )
    _check_overrides(args, resume=False)
    if multirun:
        sweep = resolve_sweep(list(args) + list(search))
        _check_name(sweep.config)
        check_job_folders(sweep)
        cfg, hc = sweep.config, sweep.config.hydra
        unclaimed(sweep.dir)
        fresh_dir("hydra.sweep.dir", Path(sweep.dir))
        params = OmegaConf.to_container(hc.launcher, resolve=False)
        if "n_jobs" in params:
            params["n_jobs"] = hc.launcher.n_jobs  # resolved (checked above)
        swept = {override_key(a).split(".")[0] for a in args if "," in a.split("=", 1)[-1]}
        if (
            sweep.launcher != "basic"
            and "dataset" not in swept
            and cfg.get("dataset", {}).get("name") in DATASETS
        ):
            # seeded here, once: jobs running at the same time never seed one data root together
            dataset_ready(
                cfg.dataset.name, cfg.dataset.get("root"), bool(cfg.dataset.get("download"))
            )
        jobs = len(sweep.subdirs)
        return Launch(
            args,
            sweep.launcher,
            jobs,
            parallel_jobs(sweep.launcher, params, jobs),
            sweep.dir,
            [sweep.pin],
            [os.path.join(sweep.dir, sub) for sub in sweep.subdirs],
        )
    cfg = compose(args + list(search), hydra_config=True)
    check_launcher(cfg.hydra)
    try:
        run_dir = Path(cfg.hydra.run.dir)
    except Exception as e:  # an interpolation that does not resolve
        raise ConfigError(
            f"hydra.run.dir={OmegaConf.to_container(cfg.hydra.run, resolve=False)['dir']}: "
            f"{str(e).splitlines()[0]}"
        ) from None
    _check_name(cfg)
    fresh_dir("hydra.run.dir", run_dir)
    with open_dict(cfg):
        del cfg["hydra"]  # resolved by Hydra itself at run time (hydra.job.num, ...)
    data_ready(validate(cfg))
    return Launch(args)


def prepare_resume(args: list[str]) -> tuple[Config, Path, list[str]]:
    """(config, run dir, overrides) of ``resume=<dir> [key=value ...]``, validated.

    Nothing is written. The run's own overrides come from its checkpoint (verified by its content
    hash), never from ``.hydra/overrides.yaml``, which any later command could have rewritten; the
    new overrides are applied after them. The configuration's fingerprint cannot change: every key
    but the few listed in ``dpsgd/config/fingerprint.py:RESUME_ALLOWED`` (default deny; docs/RUNS.md
    says what each allowed change costs).
    """
    resume = [a for a in args if override_key(a) == "resume"]
    rest = [a for a in args if override_key(a) != "resume"]
    _check_overrides(rest, resume=True)
    rd = check_run_dir(literal_value(resume[-1])).resolve()
    ckpt = resume_checkpoint(rd)
    refuse_audit_resume(rd, ckpt)
    saved = [o for o in ckpt["overrides"] if override_key(o) != "resume"]
    c = validate(compose(saved + rest), check_resume_dir=False)
    c.resume = str(rd)
    check_resumable(ckpt["fingerprint"], config_fingerprint(c))
    data_ready(c)
    return c, rd, rest
