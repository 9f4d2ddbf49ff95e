"""What a resume owes for the lots that ran after its checkpoint: one guard, one rule.

A lot that ran after the last checkpoint may have reached an output before the process died (a
metrics row, a statement, the weights of a later epoch). The rule (docs/RUNS.md, "What a crash
costs"): **a resume charges, as ``lost``, every lot past its checkpoint that an earlier attempt
reserved or that an output shows ran**, whatever the resume computes next. Nothing is assumed to be
"the same release again"; the price is that a replayed lot is charged twice (measured:
results/resume_cost.csv).

``LotGuard`` is everything that serves that rule, over one file, ``lots.reserved``: ``before_lot``
reserves lots write-ahead (fsync'd chunks from ``CHUNK`` lots), ``bind`` ties the file to the token
of a checkpoint, and ``owed`` says, on resume, which lots past the checkpoint are still to be
charged (``Owed``). The file is read strictly: a line no run could have written is refused in one
line naming the file, never read as "no lots"; what the file cannot show is said, not assumed
(``Owed.warning``).

Details: docs/RUNS.md, "dpsgd/run/guard.py".
"""

from __future__ import annotations

import json
import os
import time
from dataclasses import dataclass
from pathlib import Path

from dpsgd.accountant import limits
from dpsgd.core.errors import ConfigError
from dpsgd.core.fileio import atomic_write_text, naming

RESERVATIONS = "lots.reserved"
CHUNK = 16  # lots in the first reservation of a process (and the smallest chunk)
SECONDS = 1.0  # chunks double while a chunk of lots takes less than this


@dataclass(frozen=True)
class Owed:
    """Lots a resume charges as lost: ``windows`` of (first, count), absolute (lot S makes
    ``steps`` = S, so a window (f, n) is lots f+1 .. f+n); why; and what the files cannot show (a
    warning)."""

    windows: tuple[tuple[int, int], ...] = ()
    why: str | None = None
    warning: str | None = None
    token: str | None = None  # the token the file is bound to (the checkpoint's, or its previous)

    @property
    def lots(self) -> int:
        return sum(n for _, n in self.windows)


class LotGuard:
    """The write-ahead record of the lots a run may have run since its last checkpoint, and the rule
    for what a resume owes for them."""

    def __init__(self, run_dir: str | Path):
        self.path = Path(run_dir) / RESERVATIONS
        self.upto = None  # lots reserved so far in this process (absolute step count)
        self.token = None  # the checkpoint token the file is bound to
        self.expected = None  # on resume: the token of the checkpoint resumed from
        self.chunk, self._t = CHUNK, None

    # -- before a lot ---------------------------------------------------------------------------
    def before_lot(self, steps: int, limit: int) -> None:
        """Make sure lot number ``steps`` (0-based, absolute) is reserved; reserve up to
        ``limit``."""
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

    # -- after a checkpoint -----------------------------------------------------------------------
    def bind(self, token: str, steps: int) -> None:
        """When a run starts and after each checkpoint: the file holds only the binding line of the
        checkpoint (token) taken at lot ``steps``, whose ledger covers every lot reserved so far."""
        atomic_write_text(self.path, json.dumps({"checkpoint": token, "steps": int(steps)}) + "\n")
        self.token, self.upto = token, None

    # -- on resume --------------------------------------------------------------------------------
    def owed(self, ckpt: dict, escaped: int, lots_per_epoch: int, ended: bool = True) -> Owed:
        """What a resume of ``ckpt`` owes: the lots past what its ledger covers, up to the largest
        of every reservation after its binding and of ``escaped`` (the most lots an output shows
        ran); plus the debts an older checkpoint (format 4 or 5) carries, charged whole. ``ended``:
        the last attempt left a statement of its end (privacy.json not ``running``). ConfigError
        (one line, naming the file) when the file is missing, bound to another checkpoint, or
        altered."""
        steps, binding = int(ckpt["steps"]), ckpt["reservations"]
        reserved, current = self._read(binding, steps, lots_per_epoch)
        covers = steps if current else int(binding.get("covers", steps))
        upto = max(reserved, escaped)
        windows = [w for w in _old_debts(binding, steps) if w[1] > 0]
        if upto > covers:
            windows.append((covers, upto - covers))
        why = None
        if windows:
            end = max(upto, covers)
            shown = (
                f"an output shows lots up to {end} ran"
                if escaped > reserved
                else f"{RESERVATIONS} reserved lots up to {end}"
            )
            why = f"may have run after the checkpoint at lot {steps} ({shown})"
        warning = None
        if not windows and not ended and current:
            warning = (
                "the last attempt ended without a statement (privacy.json: running) and "
                f"{self.path} shows no lot past the checkpoint at lot {steps}: nothing is charged "
                "for it. A crash before its first lot leaves this; a file cut back leaves it too, "
                "and then the lots that ran are not charged (docs/RUNS.md)"
            )
        return Owed(tuple(windows), why, warning, self.token)

    def _read(self, binding: dict, steps: int, lots_per_epoch: int) -> tuple[int, bool]:
        """(the largest reservation, or ``steps``; whether the file is bound to this checkpoint),
        the file read strictly (the module docstring)."""

        def bad(why: str) -> ConfigError:
            return ConfigError(
                f"resume: {self.path}: {why}; the checkpoint at lot {steps} is bound to it (the "
                "lots that ran after the checkpoint cannot be counted without it); restore it or "
                "start a new run"
            )

        try:
            lines = self.path.read_bytes().split(b"\n")
        except FileNotFoundError:
            raise bad("missing") from None
        except OSError as e:
            raise bad(f"unreadable ({e.strerror or type(e).__name__})") from None
        lines.pop()  # after the last newline: a line cut short by a crash (not fsync'd) or ''
        head = _json(lines[0]) if lines else None
        if not (isinstance(head, dict) and set(head) == {"checkpoint", "steps"}):
            raise bad("no binding line (the file was replaced or altered)")
        current = head["checkpoint"] == binding["token"] and head["steps"] == steps
        if not (
            current or (head["checkpoint"] == binding.get("previous") and binding.get("previous"))
        ):
            raise bad("bound to another checkpoint (the file was replaced or altered)")
        # a file bound to the previous checkpoint holds only lots this checkpoint's ledger covers
        covers = steps if current else int(binding.get("covers", steps))
        best, torn = steps, None
        for n, line in enumerate(lines[1:], 2):
            d = _json(line)
            if d is _TORN:  # not JSON: the torn tail of a crash, unless a reservation follows
                torn = torn or n
                continue
            if _is_digest(
                d
            ):  # a lot's parameter digest (checkpoint formats 4-5): no longer evidence
                continue
            v = _upto(d)
            bound = (-(-best // lots_per_epoch) + 1) * lots_per_epoch if current else covers
            if v is None or not 0 <= v <= min(bound, limits.STEPS_MAX):
                raise bad(
                    f"line {n} is not a reservation a run could have made "
                    f"(after lot {best}: at most {min(bound, limits.STEPS_MAX)})"
                )
            if torn is not None:
                raise bad(
                    f"line {torn} is not JSON, and a reservation follows it (not the torn tail of "
                    "a crash)"
                )
            best = max(best, v)
        self.token, self.expected = head["checkpoint"], binding["token"]
        return best, current


def _old_debts(binding: dict, steps: int) -> list[tuple[int, int]]:
    """The lots an older checkpoint still owed, as windows (first, count): format 5's ``debts``
    (each an earlier attempt's lots ``first``..``upto``, whose digests no longer prove anything) and
    format 4's ``owed`` count; charged whole."""
    if binding.get("debts"):
        return [
            (int(d["first"]) - 1, int(d["upto"]) - int(d["first"]) + 1) for d in binding["debts"]
        ]
    owed = int(binding.get("owed") or 0)
    return [(steps, owed - steps)] if owed > steps else []


_TORN = object()  # a line that is not JSON (UTF-8): what a crash can leave after the last fsync


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


def _is_digest(d) -> bool:
    """A digest line ``{"ran": S, "digest": H}`` of checkpoint formats 4-5 (S an integer, H 32 hex
    digits)."""
    if not (isinstance(d, dict) and set(d) == {"ran", "digest"}):
        return False
    s, h = d["ran"], d["digest"]
    return (
        type(s) is int
        and isinstance(h, str)
        and len(h) == 32
        and all(c in "0123456789abcdef" for c in h)
    )
