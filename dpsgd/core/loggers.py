"""Experiment loggers (``logger=csv|tensorboard|wandb``): each epoch's metrics.csv row, sent on.

The row is the one ``metrics.csv`` gets (dpsgd/run/report.py:metrics_row: ε under every accountant,
accuracies, losses, lr, ...), logged once per epoch with the epoch as the step. Everything goes
inside the run folder:

* ``csv``: ``log.csv``, the rows appended (a resumed run appends the epochs it runs again);
* ``tensorboard``: ``tb/``, one scalar per numeric column (``torch.utils.tensorboard``), and the
  text columns (sampling, clipping, ...) once, as text;
* ``wandb``: ``wandb/``, ``wandb.log(row, step=epoch)``; offline (``WANDB_MODE=offline``) unless
  the environment sets a mode, so nothing leaves the machine unless asked to.

tensorboard and wandb stay optional (``pip install -e .[loggers]``): ``require`` refuses a logger
whose package is missing with one line naming the pinned install, before any work
(dpsgd/config/schema.py calls it). The Python API takes any object with ``log(row, step)``
(``dpsgd.PrivateTrainer(logger=make_logger("tensorboard", folder))``).
"""

from __future__ import annotations

import csv
import importlib.util
import os
import sys
from pathlib import Path

from dpsgd.core.errors import ConfigError

LOGGERS = ("none", "csv", "tensorboard", "wandb")  # logger.name
PINS = {"tensorboard": "tensorboard==2.21.0", "wandb": "wandb==0.31.0"}  # pyproject's [loggers]
FOLDERS = {"csv": "log.csv", "tensorboard": "tb", "wandb": "wandb"}  # inside the run folder


def _installed(package: str) -> bool:
    if package in sys.modules:
        return sys.modules[package] is not None
    try:
        return importlib.util.find_spec(package) is not None
    except (ImportError, ValueError):
        return False


def require(name: str, key: str = "logger.name") -> None:
    """Refuse, in one line naming the install, a logger whose package is not installed."""
    package = name if name in PINS else None
    if package is not None and not _installed(package):
        raise ConfigError(
            f"{key}={name}: the {package} package is not installed "
            f"(pip install {PINS[package]}, or pip install -e .[loggers])"
        )


def _number(v) -> float | None:
    """A numeric column's value as a float (NaN and inf kept); None for text and missing values."""
    if isinstance(v, bool) or v is None:
        return None
    return float(v) if isinstance(v, (int, float)) else None


class CsvLogger:
    """``log.csv``: the rows, appended; the header written when the file is new."""

    def __init__(self, path: str | Path):
        self.path = Path(path)
        self.columns: list[str] | None = None

    def log(self, row: dict, step: int) -> None:
        new = not self.path.exists() or self.path.stat().st_size == 0
        if self.columns is None:
            self.columns = list(row) if new else self._header()
        with open(self.path, "a", newline="") as f:
            w = csv.DictWriter(f, self.columns, extrasaction="ignore", lineterminator="\n")
            if new:
                w.writeheader()
            w.writerow(row)

    def _header(self) -> list[str]:
        with open(self.path, newline="") as f:
            return next(csv.reader(f))

    def close(self) -> None:
        return None


class TensorBoardLogger:
    """``tb/``: an event file with a scalar per numeric column, the step being the epoch."""

    def __init__(self, folder: str | Path):
        from torch.utils.tensorboard import SummaryWriter

        self.writer, self.texts_done = SummaryWriter(log_dir=str(folder)), False

    def log(self, row: dict, step: int) -> None:
        texts = {}
        for k, v in row.items():
            x = _number(v)
            if x is not None:
                self.writer.add_scalar(k, x, step)
            elif isinstance(v, str):
                texts[k] = v
        if texts and not self.texts_done:  # the run's settings: once
            self.writer.add_text("settings", ", ".join(f"{k}={v}" for k, v in texts.items()), step)
            self.texts_done = True
        self.writer.flush()

    def close(self) -> None:
        self.writer.close()


class WandbLogger:
    """``wandb/``: one ``wandb.log(row, step=epoch)`` per epoch, offline unless WANDB_MODE says."""

    def __init__(self, folder: str | Path, project: str, name: str | None, config: dict | None):
        import wandb

        os.environ.setdefault("WANDB_MODE", "offline")
        Path(folder).parent.mkdir(parents=True, exist_ok=True)
        self.wandb = wandb
        self.run = wandb.init(
            project=project, name=name, dir=str(Path(folder).parent), config=config or {}
        )

    def log(self, row: dict, step: int) -> None:
        self.wandb.log({k: v for k, v in row.items() if v is not None}, step=step)

    def close(self) -> None:
        self.wandb.finish()


def make_logger(
    name: str,
    run_dir: str | Path,
    *,
    project: str = "dpsgd",
    run_name: str | None = None,
    config: dict | None = None,
):
    """The logger ``name`` writing inside ``run_dir`` (None for ``none``)."""
    if name == "none":
        return None
    if name not in LOGGERS:
        raise ConfigError(f"logger.name={name!r}: unknown, must be one of {sorted(LOGGERS)}")
    require(name)
    where = Path(run_dir) / FOLDERS[name]
    if name == "csv":
        return CsvLogger(where)
    if name == "tensorboard":
        return TensorBoardLogger(where)
    return WandbLogger(where, project, run_name, config)
