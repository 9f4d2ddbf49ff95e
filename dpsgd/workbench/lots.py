"""One lot of Algorithm 1 and its charge: the only place a lot runs, for the command line
(``dpsgd/train.py``) and the Python API (``dpsgd.PrivateTrainer``) alike.

``Lots.run`` is lines 4–8 of Algorithm 1 (Abadi et al. 2016) for one lot, followed by the ledger's
record of what the lot cost: the plan's release for the lot's position (``Plan.release``: the event
whose σ the step noised; None where an earlier charge of its epoch covers it), held together with
the step count against a signal, so a lot that ran is charged and counted, or none is. The budget of
a target ε is counted down here too, and ``left`` says how many lots it still lets run.
"""

from __future__ import annotations

from dataclasses import dataclass

from dpsgd.accountant.ledger import Ledger
from dpsgd.core.signals import held_signals


@dataclass
class Tally:
    """What the lots have spent: the ledger, the lots run, and the charges still within the target
    ε (None: no target). ``dpsgd.run.state.Progress`` extends it with what a run directory keeps."""

    ledger: Ledger
    steps: int = 0  # lots run
    budget: int | None = (
        None  # charges (lots; for shuffle, epochs) that still fit within the target
    )


class Lots:
    """The lot loop's body, shared by every way of training.

    Args:
        plan: the mechanism (``dpsgd.mechanism.plan.Plan``): its sampler and the event each lot
            records.
        dp: the DP step (``dpsgd.mechanism.optim.DPSGD``) built on that plan.
        tally: where the charges go (``Tally``).
        ema: an EMA of the weights updated after each lot (post-processing), or None.
    """

    def __init__(self, plan, dp, tally: Tally, ema=None):
        self.plan, self.dp, self.tally, self.ema = plan, dp, tally, ema

    def left(self, lot: int) -> int | None:
        """Lots the target ε still lets run from position ``lot`` of the epoch (None: no target)."""
        budget = self.tally.budget
        if budget is None:
            return None
        return self.plan.sampler.lots_within(budget, lot) if budget >= 0 else 0

    def run(self, lot: int, x, y, physical_batch_size: int | None = None, **kw) -> dict:
        """Lot ``lot`` (its position in the epoch) on examples ``x``, ``y``: the DP step, then its
        charge (``held``). Returns the step's {'loss_sum', 'lot_size'}."""
        return self.held(
            lot, lambda: self.dp.step(x, y, physical_batch_size=physical_batch_size, **kw)
        )

    def held(self, lot: int, step) -> dict:
        """``step()``, the DP step of lot ``lot`` (its position in the epoch), then its charge.

        A step that raises (a KeyboardInterrupt in the Python API, a failure) after it began to
        release something of its lot (moved the weights, or wrote the noisy gradient into
        ``.grad``: the parameters' version counters and the step's count of updates tell) is
        charged and counted all the same, and the exception goes on. One that raises before is
        not charged: nothing of it left."""
        release = self.plan.release(lot)  # what this lot costs (None: its epoch's charge covers it)
        before, out = self._released(), None
        try:
            out = step()
        finally:
            if out is not None or self._released() != before:
                with held_signals():  # the lot that ran is charged and counted, or none is
                    self.charge(release)
                    if self.ema is not None and out is not None:
                        self.ema.update(self.dp.model)
                    self.tally.steps += 1
        return out

    def _released(self) -> tuple:
        """What moves when a step releases: the weights' write counters, the step's updates."""
        return _versions(self.dp.model), getattr(self.dp, "updates", 0)

    def charge(self, release) -> None:
        """Record one lot's release in the ledger: one charge less fits within the target ε."""
        if release is not None:
            self.tally.ledger.record(release, 1, "sgd")
            if self.tally.budget is not None:
                self.tally.budget -= 1


def _versions(model) -> list[int]:
    """The in-place write counters of the model's parameters (torch bumps one on every write)."""
    return [p._version for p in model.parameters()]
