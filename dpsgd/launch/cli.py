"""What every command line of dpsgd shares (``python -m dpsgd.train``, under torchrun or not, and
``python -m dpsgd.pretrain``): the composed config, the checks made before anything is written, and
the rule that every expected failure is one line on stderr and an exit code, never a traceback.

Exit codes: 2 bad input (``ConfigError``, ``DataUnavailable``); 1 divergence or a disk error;
128 + n an interrupting signal n.
"""

from __future__ import annotations

import hashlib
import os
import re
import signal
import sys
from contextlib import contextmanager
from pathlib import Path

from dpsgd.core.errors import ConfigError, Diverged, Interrupted, NotPerExample, one_line
from dpsgd.data.archives import ensure_dataset
from dpsgd.data.datasets import DataUnavailable
from dpsgd.data.files import FILE_FORMATS
from dpsgd.launch.info import CONF_DIR  # noqa: F401 (conf/, re-exported for its callers)

MULTIRUN_FLAGS = ("--multirun", "-m")
CONFIG_DIR_FLAGS = ("--config-dir", "-cd")  # an extra config folder (searched after conf/)
SHORT_BYTES = (
    96  # the longest text ``${dpsgd.short:...}`` keeps whole (a folder name holds 255 bytes)
)


def short_name(text) -> str:
    """``text`` when it takes at most SHORT_BYTES bytes (UTF-8) and holds no "/", else its head ("/"
    as "_") and 12 hex digits of the SHA-256 of all of it: short, stable (the same text always gives
    the same name), unique (different texts differ in the digest) and one folder deep. The resolver
    ``${dpsgd.short:...}`` of conf/config.yaml, which keeps a sweep job's folder name (its
    overrides) within the file system's limit."""
    s = str(text)
    b = s.encode("utf-8", "surrogateescape")
    if len(b) <= SHORT_BYTES and "/" not in s:
        return s
    # a path in an override (dataset.train=/data/x.pt) would nest folders: flattened, and the
    # digest of the text as given keeps names that differ only there apart
    flat = s.replace("/", "_").encode("utf-8", "surrogateescape")
    return (
        f"{flat[: SHORT_BYTES - 13].decode('utf-8', 'ignore')}_{hashlib.sha256(b).hexdigest()[:12]}"
    )


def register_resolvers() -> None:
    """dpsgd's OmegaConf resolvers (``dpsgd.short``). Called when this module is imported, so they
    exist wherever Hydra resolves dpsgd's config: the launching process, joblib workers and submitit
    jobs (which import dpsgd/launch/main.py to unpickle the task before resolving the job's
    folder)."""
    from omegaconf import OmegaConf

    OmegaConf.register_new_resolver("dpsgd.short", short_name, replace=True)


register_resolvers()


def compose(args: list[str], hydra_config: bool = False):
    """The composed (not yet validated) config of command-line overrides; ConfigError in one line.
    ``hydra_config=True`` includes Hydra's own node (run and sweep folders)."""
    import hydra
    from hydra.core.global_hydra import GlobalHydra

    GlobalHydra.instance().clear()
    try:
        with hydra.initialize_config_dir(config_dir=CONF_DIR, version_base="1.3", job_name="train"):
            return hydra.compose("config", overrides=args, return_hydra_config=hydra_config)
    except Exception as e:
        raise ConfigError(did_you_mean(one_line(e))) from None
    finally:
        GlobalHydra.instance().clear()


def did_you_mean(message: str) -> str:
    """Hydra's message for an unknown key or option, said as the user's mistake with the closest
    names ("+key" would add a key that nothing reads: every key is in the schema already)."""
    import difflib

    from dpsgd.config.fingerprint import config_leaves
    from dpsgd.config.schema import Config

    key = re.match(r"Could not override '([^']+)'\. To append to your config use \+", message)
    if key:
        keys = [k for k in config_leaves(Config()) if "." in k or k == key.group(1).split(".")[0]]
        owners = _options_reading(key.group(1))
        if key.group(1) in keys and owners:  # a key of another option of its group
            group = key.group(1).split(".")[0]
            return (
                f"{key.group(1)}: not read by the chosen {group}; "
                f"{' or '.join(f'{group}={o}' for o in owners)} reads it (choose that first)"
            )
        close = difflib.get_close_matches(key.group(1), keys, n=2, cutoff=0.8)
        hint = f"; did you mean {' or '.join(close)}?" if close else ""
        return f"{key.group(1)}: no such key{hint} (python -m dpsgd.train --help lists them)"
    opt = re.search(
        r"Could not find '([^']+)/([^'/]+)'\s+Available options in '[^']+':(.*)", message
    )
    if opt:
        group, name, options = opt.group(1), opt.group(2), opt.group(3).split()
        close = difflib.get_close_matches(name, options, n=3, cutoff=0.6)
        hint = f"did you mean {' or '.join(close)}?" if close else f"one of {', '.join(options)}"
        return f"{group}={name}: no such {group.split('/')[-1]}; {hint}"
    return message


def _options_reading(key: str) -> list[str]:
    """The options of ``key``'s config group whose yaml sets that key (conf/<group>/<option>.yaml)."""
    group, _, leaf = key.partition(".")
    if "." in leaf or not leaf:
        return []
    folder = Path(CONF_DIR) / group
    pattern = re.compile(rf"^{re.escape(leaf)}\s*:", re.M)
    return sorted(
        f.stem for f in folder.glob("*.yaml") if pattern.search(f.read_text(encoding="utf-8"))
    ) if folder.is_dir() else []  # fmt: skip


@contextmanager
def config_loader():
    """Hydra's config loader over conf/ (the one ``hydra.main`` uses), for composing as Hydra
    does."""
    import hydra
    from hydra.core.global_hydra import GlobalHydra

    GlobalHydra.instance().clear()
    try:
        with hydra.initialize_config_dir(config_dir=CONF_DIR, version_base="1.3", job_name="train"):
            yield GlobalHydra.instance().config_loader()
    finally:
        GlobalHydra.instance().clear()


def hydra_quoted(text: str) -> str:
    """``text`` as one quoted value of a Hydra override (``key=<this>`` gives back ``text``)."""
    body = re.sub(r"(\\*)('|$)", lambda m: m.group(1) * 2 + ("\\'" if m.group(2) else ""), text)
    return f"'{body}'"


def literal_value(arg: str) -> str:
    """The value of a ``key=value`` argument taken literally: a value Hydra reads as one string (one
    quoted string, unquoted; or plain text, with Hydra's escapes) is that string; anything else (a
    name ending in a quote, a comma list, a number) is the text exactly as given. Nothing else is
    stripped: a folder whose name ends in a quote is that folder, never its sibling."""
    from hydra.core.override_parser.overrides_parser import OverridesParser

    raw = arg.split("=", 1)[1]
    try:
        value = OverridesParser.create().parse_override(arg).value()
    except Exception:
        return raw
    return value if isinstance(value, str) else raw


def split_cli(args: list[str]) -> tuple[bool, list[str], list[str]]:
    """(multirun, extra config dirs, overrides) of a command line; ConfigError for flags dpsgd
    refuses."""
    multirun, dirs, overrides, i = False, [], [], 0
    while i < len(args):
        a = args[i]
        if a in MULTIRUN_FLAGS:
            multirun = True
        elif a.split("=", 1)[0] in CONFIG_DIR_FLAGS:
            if "=" in a:
                dirs.append(a.split("=", 1)[1])
            elif i + 1 < len(args):
                i += 1
                dirs.append(args[i])
            else:
                raise ConfigError(f"{a}: needs a folder")
        elif a.startswith("-"):
            raise ConfigError(
                f"{a}: not supported (dpsgd takes key=value overrides, -m/--multirun, "
                "-cd/--config-dir, --cfg, --help)"
            )
        else:
            overrides.append(a)
        i += 1
    return multirun, dirs, overrides


def search_path(dirs: list[str]) -> list[str]:
    """The override that adds the extra config folders (``-cd``) to Hydra's search path; [] for
    none."""
    return (
        [f"hydra.searchpath=[{','.join('file://' + str(Path(d).resolve()) for d in dirs)}]"]
        if dirs
        else []
    )


def data_ready(c) -> None:
    """The run's dataset is in its data root (seeded or downloaded now, md5-verified), else
    ConfigError; your own files (dataset=tensors|csv) were read and hashed by validation."""
    if c.dataset.name in FILE_FORMATS:
        return
    dataset_ready(c.dataset.name, c.dataset.root, c.dataset.download)


def dataset_ready(name: str, root: str | None, download: bool) -> None:
    """``name`` is in the data root ``root`` (seeded or downloaded now, md5-verified), else
    ConfigError."""
    try:
        ensure_dataset(name, root, download=download)
    except DataUnavailable as e:
        raise ConfigError(str(e)) from None


def name_max(folder: Path) -> int:
    """The longest file name (bytes) the file system of ``folder`` (or its nearest existing parent)
    takes."""
    folder = Path(folder)
    while (
        not os.path.lexists(folder) and folder != folder.parent
    ):  # lexists: False, never an OSError
        folder = folder.parent
    try:
        return int(os.pathconf(folder, "PC_NAME_MAX"))
    except (OSError, ValueError):
        return 255


def check_name_lengths(key: str, d: Path) -> None:
    """Every folder name of ``d`` fits the file system (``name_max``); else ConfigError naming
    ``key`` (the kernel would refuse it with ENAMETOOLONG only once something is created)."""
    limit = name_max(d)
    for name in Path(d).parts:
        size = len(os.fsencode(name))
        if size > limit:
            raise ConfigError(
                f"{key}={d}: a folder name is {size} bytes, longer than the file system's {limit} "
                f"({name[:24]}...); pick a shorter one"
            )


def fresh_dir(key: str, d: Path) -> None:
    """``d`` is a folder that holds nothing yet and can be created; else ConfigError naming
    ``key``."""
    check_name_lengths(key, d)
    if os.path.lexists(d) and not d.exists():
        raise ConfigError(
            f"{key}={d}: is a symlink to nothing (dangling, or a loop); pick a new dir"
        )
    if d.exists() and (not d.is_dir() or any(d.iterdir())):
        raise ConfigError(
            f"{key}={d}: already exists and is not empty; never overwritten "
            f"(pick a new dir, or resume=<run dir>)"
        )
    parent = d
    while not parent.exists():
        parent = parent.parent
    if not parent.is_dir() or not os.access(parent, os.W_OK | os.X_OK):
        raise ConfigError(f"{key}={d}: cannot be created ({parent} is not a writable folder)")


def failure(fn, *a) -> tuple[str, int] | None:
    """Run ``fn``; an expected failure becomes (one-line message, exit code), else None."""
    try:
        fn(*a)
    except (ConfigError, DataUnavailable, NotPerExample) as e:  # NotPerExample: a model whose
        return one_line(e), 2  # examples mix, refused before the first lot (nothing written)
    except Diverged as e:
        return str(e), 1
    except (Interrupted, KeyboardInterrupt) as e:
        signum = getattr(e, "signum", signal.SIGINT)
        rd = getattr(e, "run_dir", None)
        hint = f": {rd} (resume with: python -m dpsgd.train resume={rd})" if rd else ""
        return f"interrupted by {signal.Signals(signum).name}{hint}", 128 + signum
    except OSError as e:
        where = f"{e.filename}: " if e.filename else ""
        return f"{where}{e.strerror or e}", 1
    return None


def error_line(msg: str, code: int) -> str:
    """The stderr line of a failure: ``error: ...`` for bad input and run failures, a signal's as it
    is."""
    return f"error: {msg}" if code in (1, 2) else msg


def fail(msg: str, code: int) -> None:
    """Print the failure's one line and exit with ``code``."""
    print(error_line(msg, code), file=sys.stderr, flush=True)
    raise SystemExit(code)


def run_or_exit(fn, *a) -> None:
    """Run ``fn``; every expected failure is one line on stderr and an exit code, never a
    traceback."""
    failed = failure(fn, *a)
    if failed is not None:
        fail(*failed)
