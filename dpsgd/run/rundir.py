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
  nor past the privacy budget. So after a crash, ``upto − checkpoint steps`` bounds the lots that
  ran after the last checkpoint from above, and is within the budget.

  The file is bound to the checkpoint: when a run starts and after each checkpoint it is replaced by
  one line ``{"checkpoint": token, "steps": S}`` carrying the token that checkpoint records. A
  resume reads it strictly (``verified``): a missing file, another token, a line that is not a
  reservation, or a reservation beyond what could have run (more than one epoch past the largest
  reservation before it, or past STEPS_MAX) is refused in one line, never read as "no lots".

  After each lot S the run also appends ``{"ran": S, "digest": H}``, the digest of the parameters the
  lot produced (``replay.digest``): the evidence that decides, on resume, whether a replayed lot is
  the very same release (replay.py). These lines are written without an fsync (a write reaches the
  kernel and survives the death of the process; what a power loss takes is a lot that can no longer
  be proved, so it is charged). A resume that finds a line which is not JSON reads it as the torn
  tail of a crash only when no reservation follows it (every reservation is fsync'd, so what comes
  before one is intact); hashes after it are not used.

  Whether the reserved lots are charged again on resume is decided lot by lot (replay.py,
  ``Run.charge_lost``): only a seeded resume with the same replay key whose own digest after each lot
  equals the recorded one repeats the very same release; every other lot is charged
  (``label="lost"``).
"""
from __future__ import annotations

import errno
import fcntl
import json
import os
import time
from pathlib import Path

from dpsgd.accountant import limits
from dpsgd.core.errors import ConfigError
from dpsgd.core.fileio import atomic_write_text, naming

DIGEST_HEX = 32      # hex characters of a lot's parameter digest (XXH3-128: dpsgd/run/replay.py:digest)

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
    """Write-ahead record of the lots a run may have run since its last checkpoint, bound to it."""

    def __init__(self, run_dir: str | Path):
        self.path = Path(run_dir) / RESERVATIONS
        self.upto = None            # lots reserved so far in this process (absolute step count)
        self.token = None           # the checkpoint token the file is bound to
        self.expected = None        # the token of the checkpoint a resume continues from
        self.recorded: dict[int, str] = {}   # lot -> digest, read by ``verified`` (lots after the checkpoint)
        self.chunk, self._t = CHUNK, None
        self._fd = None             # the file, open for appending digests (reopened after ``bind``)

    def reserved(self) -> int | None:
        """The largest reservation on disk (None when there is none), read leniently.

        A line cut short by a crash is ignored: it was not fsync'd, so the lots it would have reserved
        did not start (a reservation is complete before its lots run)."""
        if not self.path.is_file():
            return None
        vals = [_upto(_json(line)) for line in self.path.read_bytes().splitlines()]
        return max((v for v in vals if v is not None), default=None)

    def verified(self, binding: dict, steps: int, lots_per_epoch: int) -> int | None:
        """The largest reservation made after the checkpoint ``binding`` ({"token", "previous"}) taken
        at lot ``steps``, None when there is none; ConfigError (one line, naming the file) when the
        file is missing, bound to another checkpoint, or holds a line that no run could have written.

        A file still bound to the previous checkpoint (a crash between writing the checkpoint and
        binding the file) holds reservations up to this checkpoint only."""
        def bad(why: str) -> ConfigError:
            return ConfigError(f"resume: {self.path}: {why}; the checkpoint at lot {steps} is bound to it (the "
                               "lots that ran after the checkpoint cannot be counted without it); restore it or "
                               "start a new run")
        try:
            lines = self.path.read_bytes().split(b"\n")
        except FileNotFoundError:
            raise bad("missing") from None
        except OSError as e:
            raise bad(f"unreadable ({e.strerror or type(e).__name__})") from None
        lines.pop()                 # after the last newline: a line cut short by a crash (not fsync'd) or ''
        head = _json(lines[0]) if lines else None
        if not (isinstance(head, dict) and set(head) == {"checkpoint", "steps"}):
            raise bad("no binding line (the file was replaced or altered)")
        current = head["checkpoint"] == binding["token"] and head["steps"] == steps
        if not (current or head["checkpoint"] == binding.get("previous")):
            raise bad("bound to another checkpoint (the file was replaced or altered)")
        best, recorded, torn = steps, {}, None
        for n, line in enumerate(lines[1:], 2):
            d = _json(line)
            if d is _TORN:          # not JSON: the torn tail of a crash, unless a reservation follows
                torn = torn or n
                continue
            if _digest(d) is not None:
                s, h = _digest(d)
                if not steps < s <= best and current:
                    raise bad(f"line {n} is a digest of lot {s}, which no reservation before it covers")
                if s in recorded and recorded[s] != h:
                    raise bad(f"line {n} is a second digest of lot {s}")
                if current and torn is None:
                    recorded[s] = h
                continue
            v = _upto(d)
            bound = (-(-best // lots_per_epoch) + 1) * lots_per_epoch if current else steps
            if v is None or not 0 <= v <= min(bound, limits.STEPS_MAX):
                raise bad(f"line {n} is not a reservation a run could have made "
                          f"(after lot {best}: at most {min(bound, limits.STEPS_MAX)})")
            if torn is not None:
                raise bad(f"line {torn} is not JSON, and a reservation follows it (not the torn tail of a crash)")
            best = max(best, v)
        self.token, self.expected, self.recorded = head["checkpoint"], binding["token"], recorded
        return best if best > steps else None

    def bind(self, token: str, steps: int) -> None:
        """When a run starts and after each checkpoint: the file holds only the binding line of the
        checkpoint (token) taken at lot ``steps``, whose ledger covers every lot reserved so far."""
        self.close()
        atomic_write_text(self.path, json.dumps({"checkpoint": token, "steps": int(steps)}) + "\n")
        self.token, self.upto = token, None

    def ran(self, steps: int, digest: str) -> None:
        """After lot ``steps``: append its parameter digest (a write, no fsync: see the module)."""
        line = (json.dumps({"ran": int(steps), "digest": digest}) + "\n").encode()
        with naming(self.path):
            if self._fd is None:
                self._fd = os.open(self.path, os.O_WRONLY | os.O_APPEND)
            os.write(self._fd, line)

    def close(self) -> None:
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None

    def ensure(self, steps: int, limit: int) -> None:
        """Make sure lot number ``steps`` (0-based, absolute) is reserved; reserve up to ``limit``."""
        if self.upto is not None and steps < self.upto:
            return
        now = time.monotonic()
        if self._t is not None:
            self.chunk = self.chunk * 2 if now - self._t < SECONDS else max(CHUNK, self.chunk // 2)
        self._t = now
        upto = min(steps + self.chunk, limit)
        with naming(self.path), open(self.path, "a") as f:
            f.write(json.dumps({"upto": upto}) + "\n")
            f.flush()
            os.fsync(f.fileno())
        self.upto = upto


_TORN = object()     # a line that is not JSON (UTF-8): what a crash can leave after the last fsync


def _json(line: bytes):
    try:
        return json.loads(line.decode())
    except (ValueError, UnicodeDecodeError):
        return _TORN


def _upto(d) -> int | None:
    """The S of a reservation line ``{"upto": S}``; None for any other line."""
    if not (isinstance(d, dict) and set(d) == {"upto"}):
        return None
    v = d["upto"]
    return v if type(v) is int else None


def _digest(d) -> tuple[int, str] | None:
    """(S, H) of a digest line ``{"ran": S, "digest": H}``; None for any other line."""
    if not (isinstance(d, dict) and set(d) == {"ran", "digest"}):
        return None
    s, h = d["ran"], d["digest"]
    ok = type(s) is int and isinstance(h, str) and len(h) == DIGEST_HEX and all(c in "0123456789abcdef" for c in h)
    return (s, h) if ok else None
