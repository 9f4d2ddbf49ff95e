"""Shared test setup and helpers.

Tests run with one intra-op thread (torch and the subprocesses the tests start): their tensors are
small, and on a busy 2-core CI machine thread oversubscription makes OpenMP several times slower.
Results do not depend on it; set DPSGD_TEST_THREADS to change it.

Helpers used by several test files (``from conftest import ...``): :func:`metrics_rows` and
:func:`metrics_row_count` read a run folder's metrics.csv; :data:`TINY_RUN` is a run of ~0.1 s per
epoch; :func:`snapshot` fingerprints a folder, to show that a refused command left it untouched;
:func:`run_train` and :func:`start_train` run ``python -m dpsgd.train`` in a child process.
Tolerances live in tests/tolerances.py, the batch-of-1 reference loop in tests/dp_reference.py.
pytest.ini puts tests/ on the path, so a test in any folder imports these by name.
"""

import csv
import hashlib
import os
import subprocess
import sys
import time
from pathlib import Path

import absl.logging
import torch

THREADS = int(os.environ.get("DPSGD_TEST_THREADS", "1"))
os.environ.setdefault("OMP_NUM_THREADS", str(THREADS))  # inherited by subprocesses
torch.set_num_threads(THREADS)


class _CurrentStderr:
    """Whatever ``sys.stderr`` is at the moment of writing; closing it closes nothing.

    absl (imported by dp_accounting, a test reference) creates its logging handler on the stream
    that is ``sys.stderr`` at import, which under pytest is the capture's file, and its ``close``
    closes that stream. A later ``logging.config.dictConfig`` in this process (submitit's import
    does one; so does Hydra's job logging) closes every existing handler, so pytest's own capture
    was closed under it and the session died at its end ("I/O operation on closed file") in
    whichever test imported submitit after dp_accounting. Pointed at this, absl still writes into
    the capture of the test running."""

    def write(self, s: str) -> int:
        return sys.stderr.write(s)

    def flush(self) -> None:
        sys.stderr.flush()

    def close(self) -> None:
        pass


absl.logging.get_absl_handler().python_handler.stream = _CurrentStderr()


def metrics_rows(run: Path) -> list[dict]:
    """The rows of ``run``/metrics.csv as dicts of strings."""
    with open(Path(run) / "metrics.csv") as f:
        return list(csv.DictReader(f))


def metrics_row_count(run: Path) -> int:
    """Number of data rows written to ``run``/metrics.csv so far (0 before the file exists)."""
    try:
        return len((Path(run) / "metrics.csv").read_text().splitlines()) - 1
    except FileNotFoundError:
        return 0


# 600 examples, lots of 60 (10 lots per epoch), a 10-d DP-PCA and 8 hidden units: ~0.1 s per epoch
TINY_RUN = [
    "dataset.subset=600",
    "privacy.lot_size=60",
    "model.hidden=[8]",
    "model.pca_dims=10",
    "training.eval_batch_size=1000",
    "device=cpu",
    "privacy.sigma_p=20",
]


def snapshot(root: Path) -> dict:
    """relative path -> SHA-256 of every file ('<dir>' for every folder) under ``root``."""
    return {
        str(p.relative_to(root)): (
            hashlib.sha256(p.read_bytes()).hexdigest() if p.is_file() else "<dir>"
        )
        for p in sorted(Path(root).rglob("*"))
    }


REPO = Path(__file__).resolve().parents[1]


def train_env() -> dict:
    """This environment with the repository importable (a child runs from a temporary folder)."""
    return dict(os.environ, PYTHONPATH=str(REPO))


def run_train(args, cwd) -> subprocess.CompletedProcess:
    """``python -m dpsgd.train ARGS`` in a child process in ``cwd``, run to its end (output
    captured)."""
    return subprocess.run(
        [sys.executable, "-m", "dpsgd.train", *args],
        cwd=cwd,
        env=train_env(),
        capture_output=True,
        text=True,
        timeout=300,
    )


def start_train(args, cwd, run, rows) -> subprocess.Popen:
    """``python -m dpsgd.train ARGS`` started in a child process; returns once ``run`` has ``rows``
    metrics rows (or the child ended, or 240 s passed), for a test that then signals it."""
    proc = subprocess.Popen(
        [sys.executable, "-m", "dpsgd.train", *args],
        cwd=cwd,
        env=train_env(),
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    deadline = time.time() + 240
    while metrics_row_count(run) < rows and proc.poll() is None and time.time() < deadline:
        time.sleep(0.02)
    return proc
