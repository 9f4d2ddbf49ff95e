"""The state of one run of Algorithm 1: its parts, its progress, the stop rule, and its checkpoint.

A ``Run`` is its built parts (parts.py: data, projection, model, clipping engine, DP-SGD step,
sampler) and its progress (epoch, lots, the ledger and what still fits within the target ε, resumes,
wall time). ``setup`` (opening.py) makes one of three: a fresh run (``Run.fresh``: the DP-PCA
release is the first charge to a new ledger), a run continued from its verified checkpoint
(``Run.from_checkpoint``: every generator and the ledger restored, every lot that an earlier attempt
may have run after it charged as lost (the rule: guard.py), the remaining budget recomputed from the
ledger), or a run that has already finished (``Run.already_finished``: its final statement, nothing
to build or run). A finished run whose folder shows lots past its final checkpoint (an extension
that died) is restored instead, to charge them and finish again (``Run.finish_as``).
"""

from __future__ import annotations

import functools
import secrets
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

import numpy as np
import torch

from dpsgd.accountant import Ledger
from dpsgd.config.fingerprint import config_fingerprint
from dpsgd.config.overrides import override_key
from dpsgd.config.schema import Config
from dpsgd.core.errors import ConfigError
from dpsgd.core.fileio import plain
from dpsgd.mechanism.correlated.strategy import Strategy
from dpsgd.core.runtime import configure_threads, describe_runtime, set_tf32
from dpsgd.run import distributed
from dpsgd.run import parts
from dpsgd.run.checkpoint import MetricsWriter, save_checkpoint
from dpsgd.run.parts import Parts
from dpsgd.run.guard import LotGuard, Owed
from dpsgd.run.report import epsilons, privacy_statement
from dpsgd.workbench.lots import Lots, Tally


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
    """The metrics rows of a process that does not write them (ranks > 0, or before setup
    writes)."""

    def __init__(self, rows: list):
        self.rows = list(rows)

    def append(self, row: dict) -> None:
        self.rows.append(dict(row))

    hold = append

    def commit(self) -> None:  # nothing on disk
        return None


@dataclass
class Progress(Tally):
    """Where a run stands: what moves with every lot (the ledger, the lots run, the budget of the
    target ε: ``Tally``) and what its run directory keeps. The checkpoint saves it, all but the
    budget and ε, which are recomputed from the ledger."""

    epoch: int = 0
    resumes: list[dict] = field(default_factory=list)
    lost: int = 0  # lots charged on resume as lost (may have run after the checkpoint)
    lost_why: str | None = None  # what shows they may have run
    covers: int = 0  # lots the ledger covers: steps, and the lost lots charged past them
    base: int = 0  # lots at the checkpoint resumed from (an epoch boundary)
    wall_before: float = 0.0  # seconds run before this process
    t_start: float = field(default_factory=time.time)
    eps: dict = field(default_factory=dict)  # report.epsilons of the ledger, after the last epoch

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
    parts: Parts | None  # None only for a run that had already finished
    writer: MetricsWriter | Rows
    guard: LotGuard
    finished: dict | None = None  # the final statement of a run that had already finished
    finish_as: str | None = None  # a finished run restored to charge lots past its final checkpoint
    warning: str | None = None  # what the folder could not show on resume (guard.py: Owed.warning)
    instrument: parts.Instrument | None = (
        None  # an audit's canaries and observers (dpsgd.audit.onerun.run)
    )
    first_epoch: int = 0  # the epoch this process started at (the console's ETA)
    logger: object | None = None  # logger=csv|tensorboard|wandb (dpsgd/core/loggers.py), rank 0
    pending: tuple | None = None  # the epoch's (row, console tail), held until train.publish

    @classmethod
    def fresh(
        cls,
        c: Config,
        run_dir: Path,
        overrides: list[str],
        d: distributed.Dist,
        seeds: dict,
        instrument: parts.Instrument | None = None,
    ) -> Run:
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
        if (
            ledger.entries and built.sampler.relation != ledger.adjacency
        ):  # one relation per statement
            ledger = ledger.converted(built.sampler.relation)  # DP-PCA under replace-one
        run = cls(
            c=c,
            run_dir=run_dir,
            overrides=list(overrides),
            dist=d,
            progress=Progress(ledger=ledger),
            parts=built,
            writer=Rows([]),
            guard=LotGuard(run_dir),
            instrument=instrument,
        )
        if instrument is not None:
            instrument.attach(run.parts)
        run.progress.budget = run.compute_budget()
        run.progress.eps = epsilons(ledger, c)
        return run

    @classmethod
    def from_checkpoint(
        cls,
        c: Config,
        run_dir: Path,
        overrides: list[str],
        d: distributed.Dist,
        seeds: dict,
        ckpt: dict,
        owe: Callable[[int], Owed],
        finish_as: str | None = None,
    ) -> Run:
        """The run continued from its checkpoint: the projection, weights, generators, momentum, EMA
        and ledger restored; the lots it owes (``owe(lots per epoch)``: guard.py's rule on the
        folder) charged as lost. ``finish_as``: a finished run's stop reason, when it is restored
        only to charge lots past its final checkpoint."""
        device, runtime = _device(c, d)
        data = parts.project(parts.load_data(c), ckpt["projection"])
        model = parts.init_model(c, data, seeds["model"])
        model.load_state_dict(ckpt["model"])
        built = _rebuilt(c, d, device, runtime, data, model, seeds, ckpt)
        new_keys = {override_key(o) for o in overrides}  # a new value replaces the saved one
        binding = ckpt["reservations"]
        progress = Progress(
            ledger=Ledger.from_dict(ckpt["ledger"]),
            epoch=ckpt["epoch"],
            steps=ckpt["steps"],
            wall_before=ckpt["wall_time_s"],
            base=ckpt["steps"],
            covers=int(binding.get("covers", ckpt["steps"])),
        )
        run = cls(
            c=c,
            run_dir=run_dir,
            overrides=[o for o in ckpt["overrides"] if override_key(o) not in new_keys]
            + list(overrides),
            dist=d,
            progress=progress,
            parts=built,
            writer=Rows(ckpt["rows"]),
            guard=LotGuard(run_dir),
            finish_as=finish_as,
        )
        owed = owe(built.sampler.lots_per_epoch())
        run.guard.token, run.guard.expected, run.warning = (
            owed.token,
            binding["token"],
            owed.warning,
        )
        if c.privacy.private:
            progress.lost = sum(run._charge_lots(first, n) for first, n in owed.windows)
            progress.lost_why = owed.why
            progress.covers = max([progress.covers] + [first + n for first, n in owed.windows])
        progress.resumes = list(ckpt["resumes"]) + [
            {
                "at_epoch": progress.epoch,
                "at_steps": progress.steps,
                "lost_lots_charged": progress.lost,
                "lost_lots_reason": progress.lost_why,
                "time": time.strftime("%Y-%m-%dT%H:%M:%S"),
                "overrides": run.overrides,
            }
        ]
        progress.budget = run.compute_budget()
        progress.eps = epsilons(progress.ledger, c)
        return run

    @classmethod
    def already_finished(
        cls, c: Config, run_dir: Path, overrides: list[str], d: distributed.Dist, ckpt: dict
    ) -> Run:
        """A resume of a run that has finished: its progress and final statement, nothing to run."""
        progress = Progress(
            ledger=Ledger.from_dict(ckpt["ledger"]),
            epoch=ckpt["epoch"],
            steps=ckpt["steps"],
            resumes=list(ckpt["resumes"]),
            wall_before=ckpt["wall_time_s"],
        )
        return cls(
            c=c,
            run_dir=run_dir,
            overrides=list(overrides),
            dist=d,
            progress=progress,
            parts=None,
            writer=Rows(ckpt["rows"]),
            guard=LotGuard(run_dir),
            finished=ckpt["statement"],
        )

    @property
    def writes(self) -> bool:  # rank 0 (or the one process) writes the run directory
        return self.dist.writes

    # -- the stop rule ---------------------------------------------------------------------------

    def lots_left(self, lot: int) -> int:
        """How many lots may still run from lot ``lot`` (0-based) of the current epoch on: to the
        end of the epoch (none once training.epochs have run), within training.max_steps, and within
        the budget of the target ε."""
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
        left = self.lots.left(lot)
        if left is not None:
            limits["target_epsilon_reached"] = left
        return limits

    def planned_epochs(self) -> int:
        """≈ the epoch the run stops at: training.epochs, or sooner by training.max_steps or by the
        lots the target ε still allows (its budget, from the ledger)."""
        t, at, lpe = self.c.training, self.progress, self.parts.sampler.lots_per_epoch()
        ends = [t.epochs]
        if t.max_steps is not None:
            ends.append(at.epoch + -(-max(0, t.max_steps - at.steps) // lpe))
        left = self.lots.left(0)
        if left is not None:
            ends.append(at.epoch + -(-left // lpe))
        return max(at.epoch, min(ends))

    @functools.cached_property
    def lots(self) -> Lots:
        """The lot loop's body (``dpsgd.workbench.lots``): the step and its charge into this run's
        progress, the one the Python API runs too."""
        return Lots(self.parts.plan, self.parts.dp, self.progress, self.parts.ema)

    def reserve(self, lot: int) -> None:
        """Before lot ``lot`` of the epoch runs (rank 0): the guard's write-ahead reservation, never
        past what may still run; under torchrun no rank passes this lot's all-reduce before rank 0
        reserved it."""
        if self.c.privacy.private and self.writes:
            at = self.progress
            self.guard.before_lot(at.steps, at.steps + self.lots_left(lot))

    def compute_budget(self) -> int | None:
        """Charges that still fit within the target ε, recomputed from the ledger (never read from a
        file). 0 when the ledger already spends the target (lost lots charged on resume can take it
        there): the run then stops before its next lot, with its final statement."""
        c, p, ledger = self.c, self.c.privacy, self.progress.ledger
        if not (p.private and p.target_epsilon is not None):
            return None
        return int(
            ledger.steps_within(
                p.target_epsilon, p.delta, self.parts.plan.event, c.accountant.name, p.convention
            )
        )

    def _charge_lots(self, start: int, n: int) -> int:
        """Charge the lots after lot ``start`` (absolute, 0-based, counted from the checkpoint's
        epoch boundary), ``n`` of them, as lost, each as the loop charges it (``Plan.charge_lots``:
        the plan's event, the very σ and k that were noised); where the first one's position carries
        no charge of its own (one charge per epoch: shuffle, random allocation), from the epoch's
        first lot, whose charge covers it. Returns n."""
        plan = self.parts.plan
        first = (start - self.progress.base) % plan.sampler.lots_per_epoch()
        back = 0 if plan.sampler.charged(first) else first
        plan.charge_lots(self.progress.ledger, n + back, first - back, "lost")
        return n

    # -- what a run writes -----------------------------------------------------------------------

    def statement(self, status: str, stop_reason: str | None) -> dict:
        return privacy_statement(self.c, self, status, stop_reason)

    def checkpoint(
        self, complete: bool, stop_reason: str | None, status: str | None = None
    ) -> None:
        if not self.writes:
            return
        at = self.progress
        token = secrets.token_hex(8)
        save_checkpoint(
            self.run_dir,
            {
                "epoch": at.epoch,
                "steps": at.steps,
                "complete": complete,
                "stop_reason": stop_reason,
                **self.parts.state_dict(),
                "ledger": plain(at.ledger.to_dict()),
                "target_epsilon": self.c.privacy.target_epsilon,
                "rows": plain(self.writer.rows),
                "fingerprint": config_fingerprint(self.c),
                "overrides": list(self.overrides),
                "audit": plain(self.instrument.label) if self.instrument is not None else None,
                "distributed": self.dist.describe(self.parts.device),
                "wall_time_s": at.wall_time(),
                "resumes": plain(at.resumes),
                "statement": plain(
                    self.statement(status or ("complete" if complete else "running"), stop_reason)
                ),
                # lots.reserved's binding: its token, the one before (a crash may fall between the
                # two writes), the lots this ledger covers (steps, and any lost lots charged past
                # them)
                "reservations": {
                    "token": token,
                    "previous": self.guard.token,
                    "covers": max(at.covers, at.steps),
                    "lots_per_epoch": self.parts.sampler.lots_per_epoch(),
                    "superseded": getattr(self.writer, "superseded", 0),
                },
            },
        )
        self.guard.bind(token, at.steps)  # the checkpoint's ledger covers every lot reserved so far


def _rebuilt(c, d, device, runtime, data, model, seeds, ckpt) -> Parts:
    """A resumed run's parts, its states loaded from ``ckpt``: with correlated noise, built on the
    checkpoint's strategy (the noise sequence continues); a cyclic sampler at a whole cycle."""
    correlated = ckpt["optimizer"].get("correlated")
    strategy = Strategy.from_dict(correlated["strategy"]) if correlated else None
    built = parts.build(c, d, device, runtime, data, ckpt["projection"], model, seeds, strategy)
    built.load_state_dict(ckpt)
    if not getattr(built.sampler, "aligned", True):
        raise ConfigError(
            f"resume: the run stopped {built.sampler.position % built.sampler.cycle} lot(s) into "
            f"a cycle of {built.sampler.cycle}; privacy.sampling={built.sampler.name} continues "
            "only from a whole cycle"
        )
    return built


def _device(c: Config, d: distributed.Dist) -> tuple[torch.device, dict]:
    device = resolve_device(c.device, d.local_rank if d.active else None)
    set_tf32(c.tf32)
    return device, describe_runtime(device, c.tf32, configure_threads())
