"""Sweep folders: resolved as Hydra will resolve them, checked, claimed by one launching process.

Before Hydra starts, the launching process composes the sweep as Hydra will (``resolve_sweep``: the
sweep's config, every job's overrides as the basic sweeper expands them, every job's config as the
launcher composes it, ``hydra.job.num`` set) and resolves ``hydra.sweep.subdir`` for each job,
interpolations included. Every job's folder must lie inside the sweep folder after
``Path.resolve()``, differ from every other job's folder (and not lie inside one) and change with
the job's number; the sweep folder must not lie inside another run (``check_job_folders``). The
resolved sweep folder is handed to Hydra literally (``${now:...}`` is resolved once, here) and
claimed with an exclusive create of ``.sweep.claim`` held for the whole sweep (``SweepClaim``): of
two sweeps started together into one folder exactly one proceeds; a claim whose launching process
has ended is stale.
"""

from __future__ import annotations

import fcntl
import os
import socket
import stat
import sys
import time
from dataclasses import dataclass
from pathlib import Path

from dpsgd.core.errors import ConfigError
from dpsgd.core.errors import one_line
from dpsgd.launch.cli import config_loader, hydra_quoted, name_max
from dpsgd.launch.launchers import check


SWEEP_CLAIM = ".sweep.claim"  # created exclusively by the launching process, removed when it ends
RUN_MARKERS = (".hydra", "privacy.json", "checkpoint.pt")  # what a run folder holds


@dataclass
class Sweep:
    """A sweep as Hydra will run it: its config (Hydra's node included), its folder (resolved) and
    the override that hands that folder to Hydra, the launcher's kind, and each job's
    ``hydra.sweep.subdir`` resolved (``probe``: job 0's with another job number)."""

    config: object
    dir: str
    pin: str
    launcher: str
    subdir: str
    subdirs: list
    probe: str


def resolve_sweep(args: list[str]) -> Sweep:
    """The sweep of the command-line overrides ``args``, every job's folder resolved the way Hydra
    will resolve it; nothing is written. ConfigError in one line (the launcher, an interpolation
    that does not resolve, a job that does not compose)."""
    from hydra.core.hydra_config import HydraConfig
    from hydra.types import RunMode
    from omegaconf import OmegaConf

    with config_loader() as loader:
        try:
            master = loader.load_configuration(
                "config", overrides=list(args), run_mode=RunMode.MULTIRUN
            )
        except Exception as e:
            raise ConfigError(one_line(e)) from None
        try:
            folder = str(master.hydra.sweep.dir)
        except Exception as e:
            text = OmegaConf.to_container(master.hydra.sweep, resolve=False)["dir"]
            raise ConfigError(f"hydra.sweep.dir={text}: {one_line(e)}") from None
        pin = f"hydra.sweep.dir={hydra_quoted(folder)}"
        try:
            master = loader.load_configuration(
                "config", overrides=list(args) + [pin], run_mode=RunMode.MULTIRUN
            )
        except Exception as e:
            raise ConfigError(f"hydra.sweep.dir={folder}: {one_line(e)}") from None
        if str(master.hydra.sweep.dir) != folder:
            raise ConfigError(
                f"hydra.sweep.dir={folder}: cannot be handed to Hydra literally (pick a folder "
                "name without quote characters or '${')"
            )
        kind = check(master.hydra)
        subdir = str(OmegaConf.to_container(master.hydra.sweep, resolve=False)["subdir"])
        jobs = _job_overrides(loader, master)
        subdirs, first, current = [], None, HydraConfig.instance().cfg
        try:
            for num, overrides in enumerate(jobs):
                try:
                    cfg = loader.load_sweep_config(master, list(overrides))
                except Exception as e:
                    raise ConfigError(
                        f"sweep job {num} ({' '.join(overrides)}): {one_line(e)}"
                    ) from None
                subdirs.append(_subdir(cfg, num, kind, subdir))
                first = cfg if first is None else first
            probe = _subdir(first, len(jobs) + 1, kind, subdir) if first is not None else ""
        finally:
            HydraConfig.instance().cfg = current  # as it was (each job's was made current)
    return Sweep(master, folder, pin, kind, subdir, subdirs, probe)


def _job_overrides(loader, master) -> list[list[str]]:
    """Each job's overrides, in Hydra's order: the basic sweeper's expansion of the sweep file's
    params and the command line (glob() included, through the config loader)."""
    from hydra.core.override_parser.overrides_parser import OverridesParser

    target = str(master.hydra.sweeper.get("_target_"))
    if target != BASIC_SWEEPER:
        name = (master.hydra.runtime.choices or {}).get("hydra/sweeper") or target
        raise ConfigError(
            f"hydra/sweeper={name}: not supported (dpsgd resolves and checks every job's folder "
            "before a sweep starts, with Hydra's basic sweeper)"
        )
    params = [f"{k}={v}" for k, v in (master.hydra.sweeper.get("params") or {}).items()]
    try:
        parsed = OverridesParser.create(config_loader=loader).parse_overrides(
            params + list(master.hydra.overrides.task)
        )
        return basic_sweeper_jobs(parsed)
    except Exception as e:
        raise ConfigError(one_line(e)) from None


# Hydra's own sweeper (``hydra/sweeper=basic``, the default), as ``hydra.sweeper._target_`` names
# it. It lives in Hydra's private modules; this name and ``basic_sweeper_jobs`` are all dpsgd takes
# from it, and tests/launch/test_hydra_private.py fails if a Hydra upgrade moves or changes either.
BASIC_SWEEPER = "hydra._internal.core_plugins.basic_sweeper.BasicSweeper"


def basic_sweeper_jobs(overrides: list) -> list[list[str]]:
    """Every job's overrides (one list per job, in Hydra's order) as Hydra's basic sweeper expands
    the parsed ``overrides``: the product of every key's values, a later override of a key replacing
    an earlier one. Its private ``BasicSweeper.split_arguments``, called rather than copied: no
    public Hydra API expands a sweep without running it, and a copy would drift from what Hydra runs
    unseen."""
    from hydra._internal.core_plugins.basic_sweeper import BasicSweeper

    return [list(job) for batch in BasicSweeper.split_arguments(overrides, None) for job in batch]


def _subdir(cfg, num: int, kind: str, text: str) -> str:
    """``hydra.sweep.subdir`` of job ``num`` (its config ``cfg``), resolved as the launcher ``kind``
    will resolve it: job number and id set, Hydra's node current (``${hydra:...}``)."""
    from hydra.core.hydra_config import HydraConfig
    from omegaconf import OmegaConf, open_dict, read_write

    with (
        read_write(cfg.hydra.job),
        open_dict(cfg.hydra.job),
    ):  # read-only once Hydra's node is current
        cfg.hydra.job.num = num
        cfg.hydra.job.id = (
            num
            if kind == "basic"
            else (f"{cfg.hydra.job.name}_{num}" if kind == "joblib" else f"job_id_for_{num}")
        )
    HydraConfig.instance().set_config(cfg)
    try:
        return str(OmegaConf.select(cfg, "hydra.sweep.subdir"))
    except Exception as e:
        raise ConfigError(f"hydra.sweep.subdir={text}: {one_line(e)}") from None


def _resolved(key: str, path: str) -> Path:
    try:
        return Path(path).resolve()
    except (OSError, RuntimeError) as e:  # a symlink loop
        raise ConfigError(f"{key}: {path} cannot be resolved ({one_line(e)})") from None


def check_job_folders(sweep: Sweep) -> None:
    """Every job's folder (``<sweep dir>/<its subdir>``, as Hydra joins them) lies inside the sweep
    folder after ``Path.resolve()``, is no other job's folder nor inside one, changes with the job's
    number, and has names the file system takes; the sweep folder lies inside no run. ConfigError in
    one line naming ``hydra.sweep.subdir`` (or ``hydra.sweep.dir``)."""
    key = f"hydra.sweep.subdir={sweep.subdir}"
    base = _resolved(f"hydra.sweep.dir={sweep.dir}", sweep.dir)
    limit = name_max(base)
    for name in base.parts:
        if len(os.fsencode(name)) > limit:
            raise ConfigError(
                f"hydra.sweep.dir={sweep.dir}: a folder name is {len(os.fsencode(name))} bytes, "
                f"longer than the file system's {limit}; pick a shorter one"
            )
    for p in (base, *base.parents):
        marker = next((m for m in RUN_MARKERS if (p / m).exists()), None)
        if marker is not None and p != base:
            raise ConfigError(
                f"hydra.sweep.dir={sweep.dir}: lies inside the run folder {p} (it holds {marker}); "
                "pick a folder outside every run"
            )
    folders: dict[Path, int] = {}
    for num, sub in enumerate(sweep.subdirs):
        job = _resolved(key, os.path.join(sweep.dir, sub))
        if base not in job.parents:
            raise ConfigError(
                f"{key}: job {num}'s folder {job} is not inside the sweep folder {base} (a "
                "relative path below it, one new folder per job)"
            )
        long = [n for n in job.relative_to(base).parts if len(os.fsencode(n)) > limit]
        if long:
            raise ConfigError(
                f"{key}: job {num}'s folder name is {len(os.fsencode(long[0]))} bytes, longer than "
                f"the file system's {limit} (keep it short, e.g. "
                "${dpsgd.short:${hydra.job.override_dirname}})"
            )
        if job in folders:
            raise ConfigError(
                f"{key}: jobs {folders[job]} and {num} would share the folder {job} (it must vary "
                "with ${hydra.job.num})"
            )
        folders[job] = num
    for job, num in folders.items():
        outer = next((p for p in job.parents if p in folders), None)
        if outer is not None:
            raise ConfigError(
                f"{key}: job {num}'s folder {job} lies inside job {folders[outer]}'s folder"
            )
    if sweep.subdirs and _resolved(key, os.path.join(sweep.dir, sweep.probe)) == _resolved(
        key, os.path.join(sweep.dir, sweep.subdirs[0])
    ):
        raise ConfigError(
            f"{key}: does not vary with the job number; must contain ${{hydra.job.num}} (one new "
            "folder per job)"
        )


def unclaimed(folder: str, key: str = "hydra.sweep.dir") -> None:
    """ConfigError in one line (naming ``key``) if another sweep's launching process holds
    ``folder`` (``SweepClaim``).

    A claim whose launching process is gone (SIGKILL, power loss) is removed here, with a note: its
    launcher held an ``flock`` on the claim for as long as it lived, and the kernel drops that lock
    when the process and every child it forked have ended (``_stale``). A claim that is not a
    regular file (a folder, a symlink) was made by no launcher: refused, and never read or
    followed."""
    path = Path(folder) / SWEEP_CLAIM
    if not os.path.lexists(path):
        return
    not_file = _not_a_file(path)
    if not_file:
        raise ConfigError(
            f"{key}={folder}: {path} is {not_file}, not a sweep claim; remove it if no sweep "
            "runs there"
        )
    stale = _stale(path)
    if stale is not None:
        print(
            f"note: {key}={folder}: removed a stale sweep claim ({stale.strip()}; its launching "
            "process has ended)",
            file=sys.stderr,
            flush=True,
        )
        return
    try:
        holder = _read_claim(path)
    except OSError:
        holder = ""
    raise ConfigError(
        f"{key}={folder}: another sweep holds this folder ({path}"
        f"{': ' + holder if holder else ''}; delete that file if no sweep runs there); one sweep "
        f"per folder (pick a new {key})"
    )


def _not_a_file(path: Path) -> str:
    """'' if ``path`` is a regular file (not followed if a symlink), else what it is."""
    try:
        mode = os.lstat(path).st_mode
    except OSError:
        return ""
    if stat.S_ISREG(mode):
        return ""
    return (
        "a symlink"
        if stat.S_ISLNK(mode)
        else "a folder"
        if stat.S_ISDIR(mode)
        else "not a regular file"
    )


def _read_claim(path: Path) -> str:
    """The text of a claim file, never following a symlink (ELOOP) or reading more than a claim
    holds."""
    fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK)
    try:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            return ""
        return os.read(fd, 4096).decode(errors="replace").strip()
    finally:
        os.close(fd)


def _stale(path: Path) -> str | None:
    """Remove the claim ``path`` and return its text if no process holds it, else None (held, being
    written, or its lock cannot be tested: then it counts as held).

    A live claim is locked from before its text is written until it is removed (``SweepClaim``), so
    a claim that can be locked and holds a complete text was left by a launcher that has ended. It
    is unlinked while locked: a concurrent tester fails to lock it and refuses; the next claim is
    created anew with ``O_EXCL``."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK)
    except OSError:
        return None
    try:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            return None  # a folder, a fifo: never read; counts as held
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:
            return None  # held (EWOULDBLOCK), or no locks here (ENOLCK): held
        text = os.read(fd, 4096).decode(errors="replace")
        if not (text.startswith("pid ") and text.endswith("\n")):
            return None  # its creator has not locked and written it yet
        try:
            if os.stat(path, follow_symlinks=False).st_ino != os.fstat(fd).st_ino:
                return None  # replaced since it was opened
            os.unlink(path)
        except OSError:
            return None
        return text
    finally:
        os.close(fd)  # drops the lock


class SweepClaim:
    """The launching process's hold on its sweep folder: ``.sweep.claim`` (pid, host, time) created
    with ``O_CREAT | O_EXCL``, which exactly one process can do, then the folder must hold nothing
    else.

    Of two sweeps started together into one folder, one creates the claim and proceeds; the other is
    refused in one line (exit 2) and writes nothing there. ``release`` removes the claim when the
    sweep ends, and the folders the claim created if they are left empty. The claim is ``flock``'d
    from before its text is written until the sweep ends, so a claim whose launching process was
    killed (SIGKILL) holds no lock, and the next sweep into the folder removes it (``unclaimed``).

    ``key`` is the parameter the refusals name (``hydra.sweep.dir``; ``python -m dpsgd.tune`` claims
    its tuning folder the same way, as ``--sweep-dir`` or ``--resume``); ``fresh=False`` claims a
    folder that already holds a sweep being resumed."""

    def __init__(self, folder: str, key: str = "hydra.sweep.dir", fresh: bool = True):
        self.folder = Path(folder)
        self.key = key
        self.path = self.folder / SWEEP_CLAIM
        self.token = (
            f"pid {os.getpid()} on {socket.gethostname()} since "
            f"{time.strftime('%Y-%m-%dT%H:%M:%S%z')} ({os.urandom(4).hex()})\n"
        )
        self.created = [
            p for p in (self.folder, *self.folder.parents) if not os.path.lexists(p)
        ]  # deepest first
        self.fd = None
        try:
            self.folder.mkdir(parents=True, exist_ok=True)
        except FileExistsError:
            raise ConfigError(f"{key}={folder}: exists and is not a folder") from None
        except OSError as e:
            raise ConfigError(f"{key}={folder}: cannot be created ({e.strerror or e})") from None
        fd = self._create()
        if fd is None:  # a claim is there: refused, unless its launcher has ended
            try:
                unclaimed(folder, key)
                fd = self._create()
            except ConfigError:
                self._remove_created()
                raise
        if fd is None:
            self._remove_created()
            raise ConfigError(
                f"{key}={folder}: another sweep held this folder; one sweep per folder "
                f"(pick a new {key})"
            )
        try:
            fcntl.flock(
                fd, fcntl.LOCK_EX
            )  # held until release() or this process's end: the claim is live
        except OSError:
            pass  # no locks on this file system: the claim never reads as stale
        self.fd = fd
        try:
            os.write(fd, self.token.encode())
        except OSError as e:  # a full disk: nothing claimed, nothing left behind
            try:
                os.unlink(self.path)
            except OSError:
                pass
            self.token = None  # never matches a claim's text: release() removes nothing more
            self.release()
            raise ConfigError(
                f"{key}={folder}: cannot be claimed ({self.path}: {e.strerror or e})"
            ) from None
        others = sorted(p.name for p in self.folder.iterdir() if p.name != SWEEP_CLAIM)
        if others and fresh:
            self.release()
            raise ConfigError(
                f"{key}={folder}: already exists and is not empty ({others[0]}); never "
                "overwritten (pick a new dir)"
            )

    def _create(self) -> int | None:
        """The claim file, created exclusively (its descriptor), or None if one is there."""
        try:
            return os.open(self.path, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644)
        except FileExistsError:
            return None
        except OSError as e:
            self._remove_created()
            raise ConfigError(
                f"{self.key}={self.folder}: cannot be claimed ({e.strerror or e})"
            ) from None

    def _remove_created(self) -> None:
        for p in self.created:
            try:
                p.rmdir()
            except OSError:
                return

    def release(self) -> None:
        """Remove the claim (if still this process's), and the folders it created if left empty."""
        try:
            if (
                self.token is not None and _read_claim(self.path) == self.token.strip()
            ):  # never follows a link
                self.path.unlink()
        except OSError:
            pass
        if self.fd is not None:
            os.close(self.fd)  # drops the lock
            self.fd = None
        self._remove_created()
