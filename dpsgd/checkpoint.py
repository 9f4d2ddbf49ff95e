"""Atomic run files: checkpoint, privacy statement, metrics rows. Nothing written is ever half-written.

Every file is replaced atomically (write a temporary file in the same folder, fsync it, ``os.replace``
it over the target, fsync the folder), so a process killed at any moment (SIGKILL included) leaves
either the old or the new version. ``metrics.csv`` rows are appended with flush + fsync.

A checkpoint is taken at an epoch boundary and holds everything a resumed run needs to continue
bit-identically: model parameters, epoch/step position (the learning rate is a function of the
epoch), the privacy ledger, the sampler's and the noise's generator states, the input projection,
the remaining budget, the metrics rows so far, and the privacy-relevant config values (a resumed run
with different values is refused, naming the key).
"""
from __future__ import annotations

import csv
import hashlib
import io
import json
import os
from pathlib import Path

import torch

from .config import ConfigError

CHECKPOINT = "checkpoint.pt"
PRIVACY = "privacy.json"
METRICS = "metrics.csv"


def _fsync_dir(path: Path) -> None:
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:  # pragma: no cover (platforms without directory fds)
        return
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def atomic_write_bytes(path: str | Path, data: bytes) -> None:
    path = Path(path)
    tmp = path.with_name(f".{path.name}.tmp{os.getpid()}")
    with open(tmp, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
    _fsync_dir(path.parent)


def atomic_write_text(path: str | Path, text: str) -> None:
    atomic_write_bytes(path, text.encode())


def write_json(path: str | Path, obj) -> None:
    atomic_write_text(path, json.dumps(obj, indent=2, sort_keys=False, default=_json_default) + "\n")


def _json_default(o):
    if hasattr(o, "item"):
        return o.item()
    if hasattr(o, "tolist"):
        return o.tolist()
    raise TypeError(f"not JSON serialisable: {type(o).__name__}")


def save_checkpoint(run_dir: str | Path, state: dict) -> None:
    buf = io.BytesIO()
    torch.save(state, buf)
    atomic_write_bytes(Path(run_dir) / CHECKPOINT, buf.getvalue())


def load_checkpoint(run_dir: str | Path) -> dict | None:
    path = Path(run_dir) / CHECKPOINT
    if not path.is_file():
        return None
    return torch.load(path, map_location="cpu", weights_only=True)


def fingerprint_hash(fp: dict) -> str:
    return hashlib.sha256(json.dumps(fp, sort_keys=True).encode()).hexdigest()[:16]


def check_resumable(saved: dict, current: dict) -> None:
    """Refuse a resume whose privacy-relevant values differ from the original run's, naming the key."""
    for key in sorted(set(saved) | set(current)):
        if saved.get(key) != current.get(key):
            raise ConfigError(f"resume: {key}={current.get(key)} differs from the run's {key}={saved.get(key)}; "
                              "privacy-relevant values cannot change on resume")


class MetricsWriter:
    """Tidy ``metrics.csv``: one row per epoch, each appended with flush + fsync."""

    def __init__(self, run_dir: str | Path, columns: list[str], rows: list[dict] | None = None):
        self.path = Path(run_dir) / METRICS
        self.columns = list(columns)
        self.rows = list(rows or [])
        # (Re)write header + the rows we know of atomically: on resume this drops rows written after
        # the checkpoint (they are recomputed identically), so no epoch appears twice.
        self._keep_superseded()
        buf = io.StringIO()
        w = csv.DictWriter(buf, self.columns, extrasaction="ignore", lineterminator="\n")
        w.writeheader()
        w.writerows(self.rows)
        atomic_write_text(self.path, buf.getvalue())

    def _keep_superseded(self) -> None:
        """Rows on disk beyond the checkpoint's go to metrics.superseded.csv rather than being lost."""
        if not self.path.is_file():
            return
        lines = self.path.read_text().splitlines(keepends=True)
        extra = lines[1 + len(self.rows):]
        if extra:
            sup = self.path.with_name("metrics.superseded.csv")
            with open(sup, "a") as f:
                if f.tell() == 0:
                    f.write(lines[0])
                f.writelines(extra)
                f.flush()
                os.fsync(f.fileno())

    def append(self, row: dict) -> None:
        buf = io.StringIO()
        csv.DictWriter(buf, self.columns, extrasaction="ignore", lineterminator="\n").writerow(row)
        with open(self.path, "a") as f:
            f.write(buf.getvalue())
            f.flush()
            os.fsync(f.fileno())
        self.rows.append(dict(row))
