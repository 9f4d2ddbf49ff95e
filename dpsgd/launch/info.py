"""Hydra's help for ``python -m dpsgd.train --help`` without importing torch.

Start-up takes well under 1 s. ``dpsgd/train.py`` calls ``help_and_exit`` before its own imports:
for ``--help``/``-h``, ``--hydra-help`` and ``--version`` it prints what Hydra prints (the
configuration groups and the composed config) and exits 0; for anything else it returns at once and
the command line runs as before (dpsgd/launch/main.py, whose other information flags,
``--cfg``/``--info``/``--resolve``, need dpsgd's resolvers and go through it).
"""

from __future__ import annotations

import sys
from pathlib import Path


def _conf_dir() -> str:
    """conf/ of the repository (a checkout, or ``pip install -e .``); for ``pip install .``, the
    copy pyproject.toml installs under <prefix>/share/dpsgd/conf."""
    repo = Path(__file__).resolve().parents[2] / "conf"
    installed = Path(sys.prefix) / "share" / "dpsgd" / "conf"
    return str(repo if (repo / "config.yaml").is_file() or not installed.is_dir() else installed)


CONF_DIR = _conf_dir()  # conf/config.yaml and its groups
HELP_FLAGS = ("--help", "-h", "--hydra-help", "--version")


def help_and_exit(argv: list[str]) -> None:
    """Print Hydra's help (or version) and exit 0 when ``argv`` asks for it; otherwise return."""
    if not any(a.split("=", 1)[0] in HELP_FLAGS for a in argv):
        return
    import hydra

    sys.argv = [sys.argv[0]] + list(argv)
    hydra.main(version_base="1.3", config_path=CONF_DIR, config_name="config")(_none)()
    raise SystemExit(0)


def _none(cfg) -> None:  # Hydra prints the help before it would call the task
    return None


_none.__module__ = (
    "dpsgd.launch.main"  # Hydra names the app after it: the text of main.py's own help
)
