"""Runs and resumes in-process, killed where told, with every lot that runs counted outside the
ledger.

A kill is ``Killed`` (a BaseException: like SIGKILL it runs no handler of the trainer and writes
nothing more), raised at one of these points, counted within one attempt:

* ``("lot", n)``: the n-th lot has run (its noisy step), before the run charges or counts it;
* ``("checkpoint", n)``: just before the n-th checkpoint is written (at the end of an epoch, after
  its metrics row; or at a resume's opening, when it charges lost lots);
* ``("bind", n)``: the n-th checkpoint is written, ``lots.reserved`` not yet bound to it;
* ``("open", 1)``: a resume has read and built everything and is about to make its first write.

Every lot that runs is logged (its absolute position and a SHA-256 of the weights it produced), so
the lots that ran, counting repeats, are known independently of the ledger (``executed``).
"""

from __future__ import annotations

import hashlib
from pathlib import Path

import torch

from conftest import TINY_RUN
from dpsgd import train as training
from dpsgd.config.schema import validate
from dpsgd.launch import main as T
from dpsgd.launch.prepare import prepare_resume
from dpsgd.run import opening
from dpsgd.run import state as runstate
from dpsgd.run.guard import LotGuard
from dpsgd.workbench.lots import Lots

TINY = TINY_RUN + ["seed=1"]
LOTS = 10  # lots per epoch of TINY
KINDS = ("lot", "checkpoint", "bind", "open")


class Killed(BaseException):
    """The process dies here (no handler of the trainer runs)."""


class Harness:
    """Runs and resumes in-process, killing where told, logging every lot that ran."""

    def __init__(self, monkeypatch, run: Path):
        self.run, self.log, self.kill = run, [], None
        self.other_cpu = False
        self._n = dict.fromkeys(KINDS, 0)
        charge, checkpoint, bind, first = (
            Lots.charge,
            runstate.Run.checkpoint,
            LotGuard.bind,
            opening._first_writes,
        )

        def logged_charge(r, release):
            if self.other_cpu:
                flip_last_bit(next(r.dp.model.parameters()))
            w = b"".join(p.detach().cpu().numpy().tobytes() for p in r.dp.model.parameters())
            self.log.append((r.tally.steps + 1, hashlib.sha256(w).hexdigest()))
            self._due("lot")
            charge(r, release)

        def killable_checkpoint(r, *a, **k):
            self._due("checkpoint")
            checkpoint(r, *a, **k)

        def killable_bind(g, token, steps):
            if (
                g.path.parent / "checkpoint.pt"
            ).exists():  # after a checkpoint (not a fresh run's first)
                self._due("bind")
            bind(g, token, steps)

        def killable_open(r):
            if r.c.resume:
                self._due("open")
            first(r)

        monkeypatch.setattr(Lots, "charge", logged_charge)
        monkeypatch.setattr(runstate.Run, "checkpoint", killable_checkpoint)
        monkeypatch.setattr(LotGuard, "bind", killable_bind)
        monkeypatch.setattr(opening, "_first_writes", killable_open)

    def _due(self, what: str) -> None:
        self._n[what] += 1
        if self.kill is not None and self.kill == (what, self._n[what]):
            raise Killed

    def _go(self, fn, kill, other_cpu=False):
        self.kill, self._n, self.other_cpu = kill, dict.fromkeys(KINDS, 0), other_cpu
        try:
            return fn()
        except Killed:
            return None
        finally:
            self.kill, self.other_cpu = None, False

    def fresh(self, *extra: str, kill=None) -> dict | None:
        args = [*TINY, *extra]
        return self._go(lambda: training.train(validate(T.compose(args)), self.run, args), kill)

    def resume(self, *extra: str, kill=None, other_cpu=False) -> dict | None:
        def go():
            c, rd, rest = prepare_resume([f"resume={self.run}", *extra])
            return training.train(c, rd, rest)

        return self._go(go, kill, other_cpu)

    def executed(self) -> int:
        """Lots that ran, in every attempt, repeats counted."""
        return len(self.log)

    def releases(self) -> int:
        """Distinct releases that ran (a lot's position and the weights it produced): the least that
        a proof of identical replays could have charged."""
        return len(set(self.log))


def flip_last_bit(p) -> None:
    """The last bit of the first element of ``p`` flipped, in place (a one-ulp change)."""
    with torch.no_grad():
        p.view(-1)[:1].view(torch.int32).bitwise_xor_(1)


def lots(st: dict, labels=("sgd", "lost")) -> int:
    """Lots in a statement's ledger with one of ``labels``."""
    return sum(e["count"] for e in st["ledger"]["entries"] if e["label"] in labels)


def killed_once(tmp_path_factory, name: str, *args: str, kill) -> tuple[Path, list]:
    """A fresh run of ``args`` killed at ``kill``, made once for a module: (its folder, its lot
    log)."""
    import pytest

    run = tmp_path_factory.mktemp(name) / "run"
    with pytest.MonkeyPatch.context() as mp:
        h = Harness(mp, run)
        h.fresh(*args, kill=kill)
    return run, list(h.log)


def copy_of(template: tuple[Path, list], tmp_path: Path, monkeypatch) -> Harness:
    """A harness over a copy of a ``killed_once`` folder, its lot log carried over."""
    import shutil

    folder, log = template
    shutil.copytree(folder, tmp_path / "run")
    h = Harness(monkeypatch, tmp_path / "run")
    h.log.extend(log)
    return h
