"""A run's files: the checkpoint (hash-checked) and ``metrics.csv`` (one fsync'd row per epoch).

A checkpoint is taken at an epoch boundary and holds everything a resumed run needs to continue
bit-identically: model parameters, epoch/step position (the learning rate is a function of the
epoch), the optimiser state (momentum buffers), the privacy ledger, the sampler's and the noise's
generator states, the input projection,
the metrics rows so far, the overrides the run was started with, the configuration's fingerprint
(every key but the few a resume may change, ``dpsgd/config/fingerprint.py:RESUME_ALLOWED``; a
resumed run with other values is refused, naming the key), and the binding of ``lots.reserved`` (the
token its first line must carry, the lots its ledger covers; ``dpsgd/run/guard.py``). With
``training.ema_decay`` set it also holds ``ema`` (the EMA weights, the released model;
``dpsgd.mechanism.ema``; None when EMA is off). Files are written with ``fileio`` (atomic replace).
"""

from __future__ import annotations

import csv
import hashlib
import io
import json
import os
from pathlib import Path

import torch

from dpsgd.core.errors import ConfigError
from dpsgd.core.fileio import atomic_write_bytes, atomic_write_text, naming

CHECKPOINT = "checkpoint.pt"
PRIVACY = "privacy.json"
METRICS = "metrics.csv"


class CheckpointError(ConfigError):
    """A checkpoint that cannot be trusted (truncated, corrupted, old format, missing keys); one
    line."""


_MAGIC = b"DPSGD-CHECKPOINT\n"
FORMAT_VERSION = 6  # 3: the optimiser state (momentum buffers); 4: whole-config fingerprint,
# bound lots.reserved; 5: the debts of earlier attempts with their lot digests; 6: no digests, the
# binding's ``covers`` and ``lots_per_epoch`` (dpsgd/run/guard.py)
READS = (4, 5, 6)  # 4 and 5 are read: the lots they owe (``owed``, ``debts``) are charged whole
SUPERSEDED = "metrics.superseded.csv"
REQUIRED_KEYS = (
    "version",
    "epoch",
    "steps",
    "complete",
    "stop_reason",
    "model",
    "ledger",
    "sampler",
    "noise",
    "optimizer",
    "projection",
    "target_epsilon",
    "rows",
    "fingerprint",
    "overrides",
    "wall_time_s",
    "resumes",
    "statement",
    "reservations",
)


def save_checkpoint(run_dir: str | Path, state: dict) -> None:
    """``checkpoint.pt``: a magic line, a JSON header {format, sha256, bytes}, the payload.

    The payload is written by torch.save. The SHA-256 of the payload is checked on every load, so a
    flipped byte or a truncated file is refused instead of resuming from a silently corrupted model,
    projection or ledger."""
    buf = io.BytesIO()
    torch.save(dict(state, version=FORMAT_VERSION), buf)
    payload = buf.getvalue()
    header = (
        json.dumps(
            {
                "format": FORMAT_VERSION,
                "sha256": hashlib.sha256(payload).hexdigest(),
                "bytes": len(payload),
            }
        ).encode()
        + b"\n"
    )
    atomic_write_bytes(Path(run_dir) / CHECKPOINT, _MAGIC + header + payload)


def load_checkpoint(run_dir: str | Path) -> dict | None:
    """The verified checkpoint of ``run_dir``, None when there is none; CheckpointError (one line)
    when it is empty, truncated, corrupted, of another format version or lacks a key."""
    path = Path(run_dir) / CHECKPOINT
    if not path.is_file():
        return None

    def bad(why: str) -> CheckpointError:
        return CheckpointError(
            f"resume: {path}: {why}; it cannot be resumed from (start a new run)"
        )

    try:
        data = path.read_bytes()
    except OSError as e:
        raise bad(f"unreadable ({e.strerror or e})") from None
    if not data.startswith(_MAGIC):
        raise bad(
            "empty"
            if not data
            else "not a dpsgd checkpoint of format version "
            f"{FORMAT_VERSION} (older versions carry no content hash)"
        )
    head_end = data.find(b"\n", len(_MAGIC))
    try:
        header = json.loads(data[len(_MAGIC) : head_end])
        fmt, digest, size = header["format"], header["sha256"], header["bytes"]
    except (ValueError, KeyError, TypeError):
        raise bad("damaged header") from None
    if fmt not in READS:
        raise bad(f"format version {fmt}, this dpsgd reads versions {', '.join(map(str, READS))}")
    payload = data[head_end + 1 :]
    if len(payload) != size:
        raise bad(f"truncated ({len(payload)} of {size} bytes)")
    if hashlib.sha256(payload).hexdigest() != digest:
        raise bad("content hash mismatch (the file was modified or corrupted)")
    try:
        state = torch.load(io.BytesIO(payload), map_location="cpu", weights_only=True)
    except Exception as e:  # noqa: BLE001 (a payload that hashes right but does not load)
        raise bad(f"payload does not load ({type(e).__name__})") from None
    missing = [k for k in REQUIRED_KEYS if not isinstance(state, dict) or k not in state]
    if missing:
        raise bad(f"missing {', '.join(missing)}")
    return state


def resume_checkpoint(run_dir: str | Path) -> dict:
    """The verified checkpoint of the run that ``resume=run_dir`` continues; ConfigError when it has
    none."""
    ckpt = load_checkpoint(run_dir)
    if ckpt is None:
        raise ConfigError(
            f"resume={run_dir}: no {CHECKPOINT} (the run stopped before its first checkpoint); "
            "start a new run"
        )
    return ckpt


def refuse_audit_resume(run_dir: str | Path, ckpt: dict) -> None:
    """An audit run (its data holds the audit's canaries; dpsgd/audit) is never resumed."""
    if ckpt.get("audit"):
        raise ConfigError(
            f"resume={run_dir}: is an audit run (its canaries are part of its data); "
            "audit runs are not resumed, run the audit again"
        )


def fingerprint_hash(fp: dict) -> str:
    return hashlib.sha256(json.dumps(fp, sort_keys=True).encode()).hexdigest()[:16]


def check_resumable(saved: dict, current: dict) -> None:
    """Refuse a resume whose fingerprint (every configuration key but those a resume may change,
    ``dpsgd/config/fingerprint.py:RESUME_ALLOWED``) differs from the original run's, naming the
    first key."""
    added = _defaults()  # a key newer than the run: its default is what the run ran with
    for key in [*saved, *(k for k in current if k not in saved)]:
        if key not in saved and key in added and current.get(key) == added[key]:
            continue
        if saved.get(key) != current.get(key):
            why = ""
            if key == "privacy.sigma" and current.get("privacy.calibrate_sigma"):
                why = (
                    " (privacy.calibrate_sigma=true: σ is calibrated from privacy.target_epsilon, "
                    "training.epochs and training.max_steps, so these cannot change either)"
                )
            raise ConfigError(
                f"resume: {key}={current.get(key)} differs from the run's {key}={saved.get(key)}"
                f"{why}; privacy-relevant values cannot change on resume"
            )


def _defaults() -> dict:
    """The fingerprint keys at their schema defaults: an option added after a run was written is
    absent from its fingerprint and, at its default, does what the run did (new options default to
    the old behaviour); set to anything else, it is refused like any changed key."""
    from dpsgd.config.fingerprint import config_leaves
    from dpsgd.config.schema import Config

    return config_leaves(Config())


def escaped_steps(run_dir: str | Path, ckpt: dict) -> int:
    """The most lots that any output written after the checkpoint shows had run: the ``steps`` of
    the metrics rows beyond the checkpoint's (in metrics.csv, and in metrics.superseded.csv beyond
    the rows an earlier checkpoint already covered) and of the last privacy.json. Evidence
    independent of lots.reserved: removing it can only stop the resume (one line), never lower the
    charge. A value that is not an integer is not evidence (a row torn by a crash); one past
    ``STEPS_MAX`` is refused."""
    from dpsgd.accountant import limits

    run_dir, seen = Path(run_dir), [int(ckpt["steps"])]
    bind = ckpt.get("reservations") or {}
    for name, skip in ((METRICS, len(ckpt["rows"])), (SUPERSEDED, bind.get("superseded") or 0)):
        rows = _csv_rows(run_dir / name)
        if name == SUPERSEDED and len(rows) < skip:
            raise ConfigError(
                f"resume: {run_dir / name}: holds {len(rows)} rows, the checkpoint covers {skip}: "
                "rows that show which lots ran were removed; restore the file or start a new run"
            )
        seen += [_int(r.get("steps")) for r in rows[skip:]]
    try:
        seen.append(_int(json.loads((run_dir / PRIVACY).read_text()).get("steps")))
    except (OSError, ValueError, AttributeError):
        pass
    best = max(v for v in seen if v is not None)
    if best > limits.STEPS_MAX:
        raise ConfigError(
            f"resume: {run_dir}: an output shows steps={best}, past what any run can reach "
            f"({limits.STEPS_MAX}); the files were altered"
        )
    return best


def _csv_rows(path: Path) -> list[dict]:
    try:
        with open(path, newline="") as f:
            return list(csv.DictReader(f))
    except FileNotFoundError:
        return []
    except (OSError, UnicodeDecodeError, csv.Error) as e:
        raise ConfigError(
            f"resume: {path}: unreadable ({getattr(e, 'strerror', None) or type(e).__name__}); "
            "it shows which lots ran: restore it or start a new run"
        ) from None


def _int(v) -> int | None:
    try:
        return int(v) if v is not None and float(v) == int(v) else None
    except (TypeError, ValueError):
        return None


class MetricsWriter:
    """Tidy ``metrics.csv``: one row per epoch, each appended with flush + fsync.

    A row is first ``hold``-ed: it is one of ``rows`` (so the checkpoint written next holds it) but
    not yet on disk; ``commit`` writes the rows held (dpsgd/train.py publishes an epoch's row only
    once the statement and the checkpoint that cover it are written). The file is never trusted to
    still be what was written: if it was removed, replaced or changed size since the last row, the
    whole file (header and every row so far) is rewritten atomically instead of appending to
    something else."""

    def __init__(self, run_dir: str | Path, columns: list[str], rows: list[dict] | None = None):
        self.path = Path(run_dir) / METRICS
        self.columns = list(columns)
        self.rows = list(rows or [])
        # (Re)write header + the rows we know of atomically: on resume this drops rows written after
        # the checkpoint (they are recomputed identically), so no epoch appears twice.
        self._keep_superseded()
        self.superseded = len(
            _csv_rows(self.path.with_name(SUPERSEDED))
        )  # rows a checkpoint covers
        self._rewrite()

    def _csv(self, rows, header: bool) -> str:
        buf = io.StringIO()
        w = csv.DictWriter(buf, self.columns, extrasaction="ignore", lineterminator="\n")
        if header:
            w.writeheader()
        w.writerows(rows)
        return buf.getvalue()

    def _rewrite(self) -> None:
        atomic_write_text(self.path, self._csv(self.rows, header=True))
        self._seen, self._written = self._stat(), len(self.rows)

    def _stat(self):
        try:
            st = self.path.stat()
        except FileNotFoundError:
            return None
        return st.st_ino, st.st_size

    def _keep_superseded(self) -> None:
        """Rows on disk beyond the checkpoint's go to metrics.superseded.csv rather than being
        lost."""
        if not self.path.is_file():
            return
        lines = self.path.read_text().splitlines(keepends=True)
        extra = lines[1 + len(self.rows) :]
        if extra:
            sup = self.path.with_name(SUPERSEDED)
            with naming(sup), open(sup, "a") as f:
                if f.tell() == 0:
                    f.write(lines[0])
                f.writelines(extra)
                f.flush()
                os.fsync(f.fileno())

    def hold(self, row: dict) -> None:
        """One more row, in ``rows`` (and so in the next checkpoint), not yet on disk."""
        self.rows.append(dict(row))

    def commit(self) -> None:
        """The rows held, appended to the file (fsync'd)."""
        pending = self.rows[self._written :]
        if not pending:
            return
        if self._stat() != self._seen:  # removed or replaced under us: rewrite it whole
            self._rewrite()
            return
        with naming(self.path), open(self.path, "a") as f:
            f.write(self._csv(pending, header=False))
            f.flush()
            os.fsync(f.fileno())
        self._seen, self._written = self._stat(), len(self.rows)

    def append(self, row: dict) -> None:
        self.hold(row)
        self.commit()
