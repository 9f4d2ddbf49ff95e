"""A run directory has one writer, and every lot that ran is charged even when the process dies.

* ``RunLock``: an exclusive ``flock`` on the run directory itself (no lock file is created), held for
  the life of the training process. The kernel drops it when the process dies, SIGKILL included, so
  a stale lock never blocks a resume; a second writer (a ``resume=`` while the original still runs,
  two runs given the same ``hydra.run.dir``) is refused with one line.

* ``LotReservations``: a write-ahead record of lots (``lots.reserved``). Before a lot runs, the run
  has reserved it: one fsync'd line ``{"upto": S}`` says that at most S lots in total will have run
  before the next reservation. Reservations are made in chunks that start at ``CHUNK`` lots and
  double while they last less than ``SECONDS`` (an fsync costs ~4 ms here, so about one per second
  of training, < 0.5 %), never past the end of the epoch (where the next checkpoint may be taken)
  nor past the privacy budget, and the file is emptied after each checkpoint. So after a crash, ``upto − checkpoint steps`` bounds the lots that
  ran after the last checkpoint from above, and is within the budget.

  Whether those lots must be charged again on resume depends on the replay. A seeded run resumed on
  the same device with the same engine settings re-draws the very same lots and noise from the
  checkpointed generator states and recomputes the same gradients: the outputs that escaped (rows
  in ``metrics.superseded.csv``) are the same releases, charged once. With ``privacy.secure_rng``
  the noise after the checkpoint cannot be replayed (it came from OS entropy), and when the device or
  the engine settings change the recomputed sums are not bit-identical; then the lots after the
  checkpoint were separate releases and are charged (``label="lost"``) before training continues.
"""
from __future__ import annotations

import errno
import fcntl
import json
import os
import time
from pathlib import Path

from dpsgd.core.fileio import atomic_write_text
from dpsgd.core.errors import ConfigError

RESERVATIONS = "lots.reserved"
CHUNK = 16          # lots in the first reservation of a process (and the smallest chunk)
SECONDS = 1.0       # chunks double while a chunk of lots takes less than this


class RunLock:
    """Exclusive lock on a run directory, held until ``release()`` or the death of the process.

    Re-entrant within one process (a nested ``RunLock`` on a folder this process holds is a no-op)."""

    _held: dict = {}    # realpath -> open descriptor holding its flock, in this process

    def __init__(self, run_dir: str | Path, key: str = "hydra.run.dir"):
        self.run_dir, self.key = Path(run_dir), key
        self.fd = None

    def acquire(self) -> "RunLock":
        real = os.path.realpath(self.run_dir)
        if real in RunLock._held:
            return self
        fd = os.open(self.run_dir, os.O_RDONLY)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError as e:
            os.close(fd)
            if e.errno in (errno.EWOULDBLOCK, errno.EAGAIN, errno.EACCES):
                raise ConfigError(f"{self.key}={self.run_dir}: another process is writing this run directory; "
                                  "one run directory has one writer (wait for it or stop it)") from None
            raise
        self.fd = RunLock._held[real] = fd
        return self

    def release(self) -> None:
        if self.fd is not None:
            RunLock._held.pop(os.path.realpath(self.run_dir), None)
            os.close(self.fd)          # closing the descriptor drops the flock
            self.fd = None

    def __enter__(self):
        return self.acquire()

    def __exit__(self, *exc):
        self.release()


class LotReservations:
    """Write-ahead record of the lots a run may have run since its last checkpoint."""

    def __init__(self, run_dir: str | Path):
        self.path = Path(run_dir) / RESERVATIONS
        self.upto = None            # lots reserved so far in this process (absolute step count)
        self.chunk, self._t = CHUNK, None

    def reserved(self) -> int | None:
        """The largest reservation on disk (None when the file is absent or empty).

        A line cut short by a crash is ignored: it was not fsync'd, so the lots it would have reserved
        did not start (a reservation is complete before its lots run)."""
        if not self.path.is_file():
            return None
        best = None
        for line in self.path.read_text().splitlines():
            try:
                v = int(json.loads(line)["upto"])
            except (ValueError, KeyError, TypeError):
                continue
            best = v if best is None else max(best, v)
        return best

    def ensure(self, steps: int, limit: int) -> None:
        """Make sure lot number ``steps`` (0-based, absolute) is reserved; reserve up to ``limit``."""
        if self.upto is not None and steps < self.upto:
            return
        now = time.monotonic()
        if self._t is not None:
            self.chunk = self.chunk * 2 if now - self._t < SECONDS else max(CHUNK, self.chunk // 2)
        self._t = now
        upto = min(steps + self.chunk, limit)
        with open(self.path, "a") as f:
            f.write(json.dumps({"upto": upto}) + "\n")
            f.flush()
            os.fsync(f.fileno())
        self.upto = upto

    def clear(self) -> None:
        """After a checkpoint: its ledger covers every lot reserved so far."""
        atomic_write_text(self.path, "")
        self.upto = None
