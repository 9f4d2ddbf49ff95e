"""Signals as one clean stop: SIGINT, SIGTERM and SIGHUP raise ``Interrupted`` in the main thread
(``signals_as_interrupts``), except inside ``held_signals``, where the signal waits until the block
has finished: a lot's charge and count, and the writes that open or finish a run, are never split by
an interruption (dpsgd/train.py, dpsgd/run/opening.py)."""

from __future__ import annotations

import signal
from contextlib import contextmanager

from dpsgd.core.errors import Interrupted

_HELD: list = []  # [signal or None] while a lot's bookkeeping runs (``held_signals``)


@contextmanager
def held_signals():
    """A signal that arrives inside is raised (as Interrupted) once the block has finished, so that
    a lot's charge and count, or the writes that open or finish a run, are never split by an
    interruption."""
    _HELD.append(None)
    try:
        yield
    finally:
        signum = _HELD.pop()
    if signum is not None:
        if _HELD:  # nested: the outer block raises it
            _HELD[-1] = _HELD[-1] or signum
        else:
            raise Interrupted(signum)


@contextmanager
def signals_as_interrupts():
    """SIGINT, SIGTERM and SIGHUP raise Interrupted in the main thread (handlers restored after)."""
    import threading

    if threading.current_thread() is not threading.main_thread():
        yield
        return

    def handler(signum, frame):
        if _HELD:
            _HELD[-1] = signum  # raised when the bookkeeping of the lot is done
            return
        raise Interrupted(signum)

    before = {s: signal.signal(s, handler) for s in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)}
    try:
        yield
    finally:
        for s, h in before.items():
            signal.signal(s, h)
