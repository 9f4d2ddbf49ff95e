"""A run directory has one writer.

``RunLock``: an exclusive ``flock`` on the run directory itself (no lock file is created), held for
the life of the training process. The kernel drops it when the process dies, SIGKILL included, so a
stale lock never blocks a resume; a second writer (a ``resume=`` while the original still runs, two
runs given the same ``hydra.run.dir``) is refused with one line. What a crash costs (the lots that
ran after the last checkpoint) is dpsgd/run/guard.py's.
"""

from __future__ import annotations

import errno
import fcntl
import os
from pathlib import Path

from dpsgd.core.errors import ConfigError


class RunLock:
    """Exclusive lock on a run directory, held until ``release()`` or the death of the process.

    Re-entrant within one process (a nested ``RunLock`` on a folder this process holds is a
    no-op)."""

    _held: dict = {}  # realpath -> open descriptor holding its flock, in this process

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
                raise ConfigError(
                    f"{self.key}={self.run_dir}: another process is writing this run directory; "
                    "one run directory has one writer (wait for it or stop it)"
                ) from None
            raise
        self.fd = RunLock._held[real] = fd
        return self

    def release(self) -> None:
        if self.fd is not None:
            RunLock._held.pop(os.path.realpath(self.run_dir), None)
            os.close(self.fd)  # closing the descriptor drops the flock
            self.fd = None

    def __enter__(self):
        return self.acquire()

    def __exit__(self, *exc):
        self.release()
