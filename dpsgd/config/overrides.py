"""The command line's overrides as the config sees them: the key an override sets, whatever its
spelling, and the run directory ``resume=<dir>`` names (checked before anything reads from it).

Used by the train command line (dpsgd/launch/main.py, dpsgd/launch/prepare.py), the run's setup and
its torchrun ranks (which compare overrides by key), the tuner's search space, and ``validate``
itself (``resume=``).
"""

from __future__ import annotations

from pathlib import Path

from dpsgd.core.errors import ConfigError


def override_key(a: str) -> str:
    """The config key of a command-line override, whatever its spelling (key=, +key=, ++key=,
    ~key)."""
    return a.split("=", 1)[0].lstrip("+~").strip()


def check_run_dir(path: str) -> Path:
    """A directory holding a dpsgd run (privacy.json or checkpoint.pt), else ConfigError."""
    rd = Path(path)
    if not rd.is_dir():
        raise ConfigError(f"resume={path}: no such run directory")
    if not ((rd / "privacy.json").is_file() or (rd / "checkpoint.pt").is_file()):
        raise ConfigError(
            f"resume={path}: not a dpsgd run directory (no privacy.json or checkpoint.pt)"
        )
    return rd
