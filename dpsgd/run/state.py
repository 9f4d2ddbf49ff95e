"""The state of one run of Algorithm 1: its parts, its progress, the stop rule, and its checkpoint.

A ``Run`` is its built parts (parts.py: data, projection, model, clipping engine, DP-SGD step,
sampler) and its progress (epoch, lots, the ledger and what still fits within the target ε, resumes,
wall time). ``setup`` (opening.py) makes one of three: a fresh run (``Run.fresh``: the DP-PCA
release is the first charge to a new ledger), a run continued from its verified checkpoint
(``Run.from_checkpoint``: every generator and the ledger restored, the lots that ran after it
charged unless the resume proves, lot by lot, that it replays them as the very same releases (equal
parameter digests: ``Run.charge_lost``, ``Run.charge``, ``Run.settle``; why, and the charge itself:
replay.py), the remaining budget recomputed from the ledger), or a run that has already finished
(``Run.finished``: its final statement, nothing to build or run).
"""
from __future__ import annotations

import secrets
import time
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch

from dpsgd.accountant import Ledger
from dpsgd.accountant.events import Event
from dpsgd.config.fingerprint import config_fingerprint
from dpsgd.config.overrides import override_key
from dpsgd.config.schema import Config, ConfigError
from dpsgd.core.fileio import plain
from dpsgd.core.runtime import configure_threads, describe_runtime, set_tf32
from dpsgd.run import distributed
from dpsgd.run import parts
from dpsgd.run.checkpoint import MetricsWriter, escaped_steps, save_checkpoint
from dpsgd.run.parts import Parts
from dpsgd.run.replay import Debt, aligned, charge_lots, debts_of, digest, lost_reason, merge, replay_key
from dpsgd.run.report import epsilons, privacy_statement
from dpsgd.run.rundir import LotReservations


def derive_seed(seed: int, stream: str, secure: bool = False) -> int:
    """Independent 63-bit seeds per random stream (pca, model, sampler, noise) from one seed.

    With ``secure=True`` (privacy.secure_rng) the seed comes from OS entropy instead, so the lots
    and the DP-PCA noise cannot be replayed from the (public) config seed."""
    if secure:
        return secrets.randbits(63)
    tag = int.from_bytes(stream.encode(), "little")
    return int(np.random.SeedSequence([seed, tag]).generate_state(1, np.uint64)[0] >> np.uint64(1))


def resolve_device(name: str, local_rank: int | None = None) -> torch.device:
    """``auto``: CUDA when present; under torchrun ``auto``/``cuda`` mean cuda:LOCAL_RANK."""
    if name == "auto":
        name = "cuda" if torch.cuda.is_available() else "cpu"
    if name == "cuda" and local_rank is not None:
        return torch.device(f"cuda:{local_rank % torch.cuda.device_count()}")
    return torch.device(name)


class Rows:
    """The metrics rows of a process that does not write them (ranks > 0, or before setup writes)."""

    def __init__(self, rows: list):
        self.rows = list(rows)

    def append(self, row: dict) -> None:
        self.rows.append(dict(row))


@dataclass
class Progress:
    """Where a run stands: what moves with every lot. The checkpoint saves it, all but the budget and
    ε, which are recomputed from the ledger."""
    ledger: Ledger                   # every release so far (DP-PCA, lots, lots lost on resume)
    epoch: int = 0
    steps: int = 0                   # lots run
    budget: int | None = None        # charges (lots; for shuffle, epochs) that still fit within the target ε
    resumes: list[dict] = field(default_factory=list)
    lost: int = 0                    # lots charged on resume as lost (ran after the checkpoint, not replayed)
    lost_why: str | None = None      # why the resume does not replay them
    debts: list[Debt] = field(default_factory=list)   # earlier attempts' lots this replay must still prove
    base: int = 0                    # lots at the checkpoint resumed from (an epoch boundary)
    wall_before: float = 0.0         # seconds run before this process
    t_start: float = field(default_factory=time.time)
    eps: dict = field(default_factory=dict)   # report.epsilons of the ledger, after the last epoch

    def wall_time(self, now: float | None = None) -> float:
        return self.wall_before + (time.time() if now is None else now) - self.t_start


@dataclass(kw_only=True)
class Run:
    """One run of Algorithm 1: its parts and its progress, in its run directory."""
    c: Config
    run_dir: Path
    overrides: list[str]
    dist: distributed.Dist
    progress: Progress
    parts: Parts | None              # None only for a run that had already finished
    writer: MetricsWriter | Rows
    reservations: LotReservations
    finished: dict | None = None     # the final statement of a run that had already finished
    instrument: parts.Instrument | None = None   # an audit's canaries and observers (dpsgd.audit.onerun.run)

    @classmethod
    def fresh(cls, c: Config, run_dir: Path, overrides: list[str], d: distributed.Dist, seeds: dict,
              instrument: parts.Instrument | None = None) -> Run:
        """A new run: the data (with an audit's canaries), DP-PCA charged to a new ledger, the model
        from its seed."""
        device, runtime = _device(c, d)
        ledger = Ledger()
        data = parts.load_data(c)
        if instrument is not None:
            data = instrument.data(data)
        V = parts.fit_projection(c, data, seeds["pca"], ledger)
        data = parts.project(data, V)
        model = parts.init_model(c, data, seeds["model"])
        built = parts.build(c, d, device, runtime, data, V, model, seeds)
        if ledger.entries and built.sampler.relation != ledger.adjacency:   # one relation per statement
            ledger = ledger.converted(built.sampler.relation)              # DP-PCA under replace-one
        run = cls(c=c, run_dir=run_dir, overrides=list(overrides), dist=d, progress=Progress(ledger=ledger),
                  parts=built, writer=Rows([]), reservations=LotReservations(run_dir), instrument=instrument)
        if instrument is not None:
            instrument.attach(run.parts)
        run.progress.budget = run.compute_budget(resumed=False)
        run.progress.eps = epsilons(ledger, c)
        return run

    @classmethod
    def from_checkpoint(cls, c: Config, run_dir: Path, overrides: list[str], d: distributed.Dist, seeds: dict,
                        ckpt: dict) -> Run:
        """The run continued from its checkpoint: the projection, weights, generators, momentum, EMA
        and ledger restored; the lots after the checkpoint that cannot be replayed charged as lost."""
        device, runtime = _device(c, d)
        data = parts.project(parts.load_data(c), ckpt["projection"])
        model = parts.init_model(c, data, seeds["model"])
        model.load_state_dict(ckpt["model"])
        built = parts.build(c, d, device, runtime, data, ckpt["projection"], model, seeds)
        built.load_state_dict(ckpt)
        new_keys = {override_key(o) for o in overrides}        # a new value replaces the saved one
        progress = Progress(ledger=Ledger.from_dict(ckpt["ledger"]), epoch=ckpt["epoch"], steps=ckpt["steps"],
                            wall_before=ckpt["wall_time_s"], base=ckpt["steps"])
        run = cls(c=c, run_dir=run_dir,
                  overrides=[o for o in ckpt["overrides"] if override_key(o) not in new_keys] + list(overrides),
                  dist=d, progress=progress, parts=built, writer=Rows(ckpt["rows"]),
                  reservations=LotReservations(run_dir))
        progress.lost = run.charge_lost(ckpt)
        progress.resumes = list(ckpt["resumes"]) + [{
            "at_epoch": progress.epoch, "at_steps": progress.steps, "lost_lots_charged": progress.lost,
            "lost_lots_reason": progress.lost_why, "lots_to_prove": sum(d.lots for d in progress.debts),
            "time": time.strftime("%Y-%m-%dT%H:%M:%S"),
            "overrides": run.overrides}]
        progress.budget = run.compute_budget(resumed=True)
        progress.eps = epsilons(progress.ledger, c)
        return run

    @classmethod
    def already_finished(cls, c: Config, run_dir: Path, overrides: list[str], d: distributed.Dist,
                         ckpt: dict) -> Run:
        """A resume of a run that has finished: its progress and final statement, nothing to run."""
        progress = Progress(ledger=Ledger.from_dict(ckpt["ledger"]), epoch=ckpt["epoch"], steps=ckpt["steps"],
                            resumes=list(ckpt["resumes"]), wall_before=ckpt["wall_time_s"])
        return cls(c=c, run_dir=run_dir, overrides=list(overrides), dist=d, progress=progress, parts=None,
                   writer=Rows(ckpt["rows"]), reservations=LotReservations(run_dir), finished=ckpt["statement"])

    @property
    def writes(self) -> bool:    # rank 0 (or the one process) writes the run directory
        return self.dist.writes

    # -- the stop rule ---------------------------------------------------------------------------

    def lots_left(self, lot: int) -> int:
        """How many lots may still run from lot ``lot`` (0-based) of the current epoch on: to the end
        of the epoch (none once training.epochs have run), within training.max_steps, and within the
        budget of the target ε."""
        return max(0, min(self._limits(lot).values()))

    def stop_reason(self, lot: int) -> str | None:
        """Why lot ``lot`` (< lots_per_epoch) of the current epoch may not run; None when it may."""
        return next((why for why, n in self._limits(lot).items() if n <= 0), None)

    def _limits(self, lot: int) -> dict[str, int]:
        """Lots that may still run from lot ``lot`` of the current epoch, by what stops the run."""
        t, at, sampler = self.c.training, self.progress, self.parts.sampler
        limits = {"epochs_completed": sampler.lots_per_epoch() - lot if at.epoch < t.epochs else 0}
        if t.max_steps is not None:
            limits["max_steps"] = t.max_steps - at.steps
        if at.budget is not None:
            # while a debt is owed, room is kept for the charge its first differing lot would bring
            spare = at.budget - self._pending(lot)
            limits["target_epsilon_reached"] = sampler.lots_within(spare, lot) if spare >= 0 else 0
        return limits

    def _pending(self, lot: int) -> int:
        """Charges that the debts covering the next lot (position ``lot`` of its epoch) would record if
        it differed from their runs of it (``_witness``)."""
        if not self.progress.debts:
            return 0
        S, sampler, sigma = self.progress.steps + 1, self.parts.sampler, self.c.privacy.sigma
        back = aligned(sampler, lot)
        return sum(sum(sampler.charges(sigma, d.upto - S + 1 + back, lot - back).values())
                   for d in self.progress.debts if d.first <= S <= d.upto)

    def reserve(self, lot: int) -> None:
        """Write-ahead (rank 0): lot ``lot`` of the epoch is reserved in lots.reserved before it runs,
        never past what may still run; under torchrun no rank passes this lot's all-reduce before
        rank 0 reserved it."""
        if self.c.privacy.private and self.writes:
            at = self.progress
            self.reservations.ensure(at.steps, at.steps + self.lots_left(lot))

    def charge(self, release: Event | None) -> None:
        """Record one lot's release (the privacy event it ran: ``parts.dp.event``) in the ledger: one
        charge less fits within the target ε.
        Then the lot's parameter digest: written into lots.reserved and, while this resume owes an
        earlier attempt's lots, compared with the digest it recorded (``_witness``)."""
        if release is not None:
            self.progress.ledger.record(release, 1, "sgd")
            if self.progress.budget is not None:
                self.progress.budget -= 1
        if self.c.privacy.private and not self.c.privacy.secure_rng:   # replayable: its lots are proved
            self._witness(self.progress.steps + 1)     # lot S (the count moves after the charge)

    def _witness(self, S: int) -> None:
        """Lot S's digest recorded (rank 0) and, for each debt that covers S, compared with the one it
        recorded on every rank: equal on all, the same release; otherwise that debt's lots S..upto are
        charged as lost now (replay.py), before anything this lot computed can escape."""
        at = self.progress
        owing = [d for d in at.debts if d.first <= S <= d.upto]
        if not (owing or self.writes):
            return
        h = digest(self.parts.model)
        if self.writes:
            self.reservations.ran(S, h)
        if not owing:
            return
        every = {x.decode() for x in distributed.all_gather_bytes(h.encode())}   # one rank: {h}
        charged = 0
        for d in owing:
            if every == {d.hashes.get(S)}:
                d.first = S + 1                 # proved up to S
                continue
            why = "no recorded digest" if d.hashes.get(S) is None else "another digest"
            charged += self._charge_lots(S - 1, d.upto - S + 1)
            at.lost_why = f"lot {S} of the replay does not equal its earlier run ({why})"
            d.first = d.upto + 1
        at.debts = [d for d in at.debts if d.lots]
        if charged:
            at.lost += charged
            at.resumes[-1]["lost_lots_charged"] += charged
            at.resumes[-1]["lost_lots_reason"] = at.lost_why
            at.budget = self.compute_budget(resumed=False)

    def compute_budget(self, resumed: bool) -> int | None:
        """Charges that still fit within the target ε, recomputed from the ledger (never read from a file)."""
        c, p, ledger = self.c, self.c.privacy, self.progress.ledger
        if not (p.private and p.target_epsilon is not None):
            return None
        budget = int(ledger.steps_within(p.target_epsilon, p.delta, self.parts.dp.event, c.accountant.name,
                                         p.convention))
        spent = epsilons(ledger, c)["epsilon"]
        if resumed and budget == 0 and spent is not None and spent >= p.target_epsilon:
            raise ConfigError(f"privacy.target_epsilon={p.target_epsilon}: at or below the ε={spent:.6g} this run "
                              f"has already spent ({c.accountant.name}, {p.convention}); nothing left to resume")
        return budget

    def charge_lost(self, ckpt: dict) -> int:
        """On resume: what earlier attempts may have run after the checkpoint, as debts (replay.py): the
        ones the checkpoint carries, and the latest attempt's, up to the largest of its reservations
        (``lots.reserved``, verified against the checkpoint's binding) and of every output that escaped
        (``escaped_steps``), with the digests it recorded. A seeded resume (no ``privacy.secure_rng``)
        with the same replay key owes them and proves them lot by lot (``charge``, ``settle``); any
        other resume charges every debt's lots now. Returns how many lots were charged now."""
        p, at, binding = self.c.privacy, self.progress, ckpt["reservations"]
        reserved = self.reservations.verified(binding, at.steps, self.parts.sampler.lots_per_epoch())
        if not p.private:
            return 0
        debts = debts_of(binding, at.steps)
        upto = max(reserved or at.steps, escaped_steps(self.run_dir, ckpt))
        if upto > at.steps:
            debts = merge(debts, Debt(at.steps + 1, upto, dict(self.reservations.recorded)))
        if not debts:
            return 0
        at.lost_why = lost_reason(self.c, ckpt, self.parts.device)
        if at.lost_why is None:
            at.debts = debts
            return 0
        return sum(self._charge_lots(d.first - 1, d.lots) for d in debts)

    def settle(self) -> int:
        """Before the last statement of a process (complete, diverged, interrupted): the lots of earlier
        attempts this replay owed but did not reach (it stopped before them) are charged as lost;
        returns how many."""
        at = self.progress
        debts, at.debts = at.debts, []
        n = sum(self._charge_lots(d.first - 1, d.lots) for d in debts if d.lots)
        if not n:
            return 0
        at.lost += n
        if at.resumes:
            at.resumes[-1]["lost_lots_charged"] += n
            at.resumes[-1]["lost_lots_reason"] = "the resume stopped before the lots of an earlier attempt"
        at.eps = epsilons(at.ledger, self.c)
        return n

    def _charge_lots(self, start: int, n: int) -> int:
        """Charge lots ``start`` .. ``start + n − 1`` (absolute, 0-based, counted from the checkpoint's
        epoch boundary) as lost, each as the loop charges it (``dpsgd/run/replay.py:charge_lots``),
        from the first lot of its epoch when its own position carries no charge (``aligned``);
        returns how many lots were charged."""
        sampler, sigma = self.parts.sampler, self.c.privacy.sigma
        first = (start - self.progress.base) % sampler.lots_per_epoch()
        back = aligned(sampler, first)
        return charge_lots(self.progress.ledger, sampler, sigma, self.parts.k, first - back, n + back)

    # -- what a run writes -----------------------------------------------------------------------

    def statement(self, status: str, stop_reason: str | None) -> dict:
        return privacy_statement(self.c, self, status, stop_reason)

    def checkpoint(self, complete: bool, stop_reason: str | None, status: str | None = None) -> None:
        if not self.writes:
            return
        at = self.progress
        token = secrets.token_hex(8)
        save_checkpoint(self.run_dir, {
            "epoch": at.epoch, "steps": at.steps, "complete": complete, "stop_reason": stop_reason,
            **self.parts.state_dict(), "ledger": plain(at.ledger.to_dict()),
            "target_epsilon": self.c.privacy.target_epsilon, "rows": plain(self.writer.rows),
            "fingerprint": config_fingerprint(self.c), "overrides": list(self.overrides),
            "audit": plain(self.instrument.label) if self.instrument is not None else None,
            "replay": replay_key(self.c, self.parts.device), "distributed": self.dist.describe(self.parts.device),
            "wall_time_s": at.wall_time(), "resumes": plain(at.resumes),
            "statement": plain(self.statement(status or ("complete" if complete else "running"), stop_reason)),
            "reservations": {"token": token, "previous": self.reservations.token,
                             "debts": [d.to_dict() for d in at.debts if d.lots],
                             "superseded": getattr(self.writer, "superseded", 0)},
        })
        self.reservations.bind(token, at.steps)   # the checkpoint's ledger covers every lot reserved so far


def _device(c: Config, d: distributed.Dist) -> tuple[torch.device, dict]:
    device = resolve_device(c.device, d.local_rank if d.active else None)
    set_tf32(c.tf32)
    return device, describe_runtime(device, c.tf32, configure_threads())
