"""The console of a run, kept: ``tee_to(path)`` copies every line written to stdout and stderr
while it is active into ``path``, appended. Until ``release()`` the copy is held in memory: a run
refused while it opens leaves its folder untouched, and its opening lines still reach the file once
it is accepted. Each run folder's ``run.log`` is this copy (dpsgd/train.py).

``progress`` is a bar (tqdm) over the lots of an epoch or a one-off computation, drawn on the
terminal itself, beneath the copy: only when stderr is a terminal, and never into run.log or a
redirected stream."""

from __future__ import annotations

import sys
from contextlib import contextmanager
from pathlib import Path


class _Tee:
    """A text stream that writes to ``stream`` and appends the same text to a shared log."""

    def __init__(self, stream, log: "_Log"):
        self.stream, self.log = stream, log

    def write(self, text: str) -> int:
        self.log.write(text)
        return self.stream.write(text)

    def flush(self) -> None:
        self.stream.flush()
        self.log.flush()

    def __getattr__(self, name):  # isatty, fileno, encoding, ...: the console's
        return getattr(self.stream, name)


class _Log:
    """The copy: held in memory until ``release``, then written to the file line by line (each
    complete line flushed as it is written, as the console's own lines are), so a process killed at
    any point leaves in run.log every line it had printed."""

    def __init__(self, path: Path):
        self.path, self.file, self.held = path, None, []

    def write(self, text: str) -> None:
        if self.file is not None:
            self.file.write(text)
            if "\n" in text:
                self.file.flush()
        elif text:
            self.held.append(text)

    def release(self) -> None:
        """From now on, into the file (the held lines first)."""
        if self.file is None:
            self.file = open(self.path, "a", encoding="utf-8")
            self.file.write("".join(self.held))
            self.file.flush()
            self.held = []

    def flush(self) -> None:
        if self.file is not None:
            self.file.flush()


@contextmanager
def tee_to(path: str | Path):
    """stdout and stderr also into ``path`` for the duration of the block."""
    log = _Log(Path(path))
    out, err = sys.stdout, sys.stderr
    sys.stdout, sys.stderr = _Tee(out, log), _Tee(err, log)
    try:
        yield log
    finally:
        sys.stdout, sys.stderr = out, err
        if log.file is not None:
            log.file.close()


class _Prefixed:
    """A text stream that starts each line it writes with ``tag``."""

    def __init__(self, stream, tag: str):
        self.stream, self.tag, self.fresh = stream, tag, True

    def write(self, text: str) -> int:
        out = []
        for piece in text.splitlines(keepends=True):
            out.append((self.tag if self.fresh else "") + piece)
            self.fresh = piece.endswith("\n")
        return self.stream.write("".join(out)) if out else 0

    def flush(self) -> None:
        self.stream.flush()

    def __getattr__(self, name):
        return getattr(self.stream, name)


@contextmanager
def prefixed(tag: str):
    """Every console line of the block starts with ``tag`` (a sweep job's number under a parallel
    launcher, whose jobs' lines interleave); run.log, written below this, keeps them bare."""
    out, err = sys.stdout, sys.stderr
    sys.stdout, sys.stderr = _Prefixed(out, tag), _Prefixed(err, tag)
    try:
        yield
    finally:
        sys.stdout, sys.stderr = out, err


def terminal():
    """The stderr beneath every copy (``tee_to``) and tag (``prefixed``): where a bar is drawn."""
    stream = sys.stderr
    while isinstance(stream, (_Tee, _Prefixed)):
        stream = stream.stream
    return stream


def progress(
    iterable,
    *,
    total: float | None = None,
    desc: str | None = None,
    unit: str = "it",
    show: bool = True,
):
    """``iterable`` with a progress bar on the terminal (tqdm), removed when done (``leave=False``)
    so the console's lines stay as they are; a plain pass-through when stderr is not a terminal
    (logs, tests, run.log) or ``show`` is false. Use it in a ``with`` block: a loop left early
    closes the bar."""
    from tqdm import tqdm

    stream = terminal()
    try:
        tty = bool(stream.isatty())
    except (AttributeError, ValueError):  # a closed or stream-less stderr
        tty = False
    return tqdm(
        iterable,
        total=total,
        desc=desc,
        unit=unit,
        file=stream,
        leave=False,
        dynamic_ncols=True,
        disable=not (show and tty),
    )
