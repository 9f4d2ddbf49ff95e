"""The mechanism as one object: how each lot is sampled, what it is clipped to, the noise it gets,
and the privacy event it is charged as (in the manner of jax_privacy's ``DPExecutionPlan``).

    plan = Plan(event, clip_norm=C, lot_size=L, sampler=sampler)
    DPSGD(model, clipper, noise, plan, lr)   the step noises at N(0, (plan.sigma · C)²), divides
                                             by L
    plan.release(i)                          the event lot i of an epoch records (None: an earlier
                                             charge of its epoch covers it)
    plan.charge_lots(ledger, n, first)       n lots from position ``first``, as the loop charges
                                             them

σ is the event's own ``sigma`` (the noise multiplier the mechanism adds), so the σ that is noised
and the σ that is charged are one value by construction, for every sampler and for lots charged as
lost on resume alike; k = ``event.groups`` tensors clipped separately to C (a k-group lot is one
Gaussian mechanism at σ/√k: the joint convention). ``event`` None is the non-private step: no noise,
nothing charged. The neighbouring relation and the accountants that serve a charge follow from the
event's type (``adjacency``, ``accountants``; one table, ``ledger.EVENTS``).

``strategy`` (privacy.noise=bandmf|blt; mechanism/correlated/strategy.py) is the matrix C whose C⁻¹Z the step
adds instead of independent draws; its charge is a ``Cyclic`` event of the cyclic sampler it needs
(one participation per cycle, the strategy normalised to sensitivity <= 1 per participation), and
the plan refuses any other pairing (``check_strategy``): a b-banded C under cyclic Poisson over b
parts, or any strategy under whole parts visited every ``cycle`` >= b (BLT: >= its min_sep) lots.
"""

from __future__ import annotations

from dataclasses import dataclass

from dpsgd.accountant.events import Cyclic, Event, Gaussian
from dpsgd.accountant.ledger import EVENTS
from dpsgd.mechanism.sampling import record_lots
from dpsgd.mechanism.correlated.strategy import Strategy


@dataclass(frozen=True)
class Plan:
    """The mechanism of one run, built once (dpsgd/run/parts.py:build).

    Args:
        event: what one charged lot is (``dpsgd.accountant.events``: σ, k, and from its type the
            adjacency and the accountants); None: not private (no noise, nothing charged).
        clip_norm: C, the clipping bound the claim uses; the noise std is σ·C.
        lot_size: L, the expected lot size the noisy sum is divided by (never the realised one).
        sampler: draws the lots and says which positions carry a charge; None for steps driven by
            hand, outside a ledger (``Plan.by_hand``).
        strategy: the correlated noise's strategy matrix (None: Algorithm 1's independent noise).

    Raises:
        ValueError: naming the value, for σ < 0, C ≤ 0, L ≤ 0, an event that is not one, or a
            strategy its event does not cover.
    """

    event: Event | None
    clip_norm: float
    lot_size: float
    sampler: object | None = None
    strategy: Strategy | None = None

    def __post_init__(self):
        if self.event is not None and not isinstance(self.event, Event):
            raise ValueError(
                f"plan.event={self.event!r}: a privacy event of dpsgd.accountant.events (or None)"
            )
        if self.event is not None and not self.event.sigma >= 0:
            raise ValueError(f"privacy.sigma={self.event.sigma!r} must be >= 0")
        if not self.clip_norm > 0:
            raise ValueError(f"privacy.clip_norm={self.clip_norm!r} must be > 0")
        if not self.lot_size > 0:
            raise ValueError(f"privacy.lot_size={self.lot_size!r} must be > 0")
        check_strategy(self.event, self.strategy)

    @classmethod
    def by_hand(cls, sigma: float, clip_norm: float, lot_size: float, groups: int = 1) -> "Plan":
        """A plan for steps driven by hand (benchmarks, tests, the one-step game): noise σC, no
        sampler; σ = 0 is the non-private step."""
        if not sigma >= 0:
            raise ValueError(f"privacy.sigma={sigma!r} must be >= 0")
        return cls(Gaussian(float(sigma), 1.0, groups) if sigma > 0 else None, clip_norm, lot_size)

    @property
    def sigma(self) -> float:
        """The noise multiplier the step adds (the charged event's σ; 0 when not private)."""
        return 0.0 if self.event is None else float(self.event.sigma)

    @property
    def groups(self) -> int:
        """k: the tensors clipped separately to C, each noised at σC."""
        return 1 if self.event is None else int(self.event.groups)

    @property
    def private(self) -> bool:
        return self.event is not None

    @property
    def adjacency(self) -> str | None:
        """The neighbouring relation of the charge (None when not private)."""
        return None if self.event is None else self.event.entry()["adjacency"]

    @property
    def accountants(self) -> tuple[str, ...]:
        """The accountants that serve this plan's charges (``ledger.EVENTS``)."""
        return () if self.event is None else EVENTS[self.event.entry()["event"]]

    def release(self, lot_in_epoch: int) -> Event | None:
        """The event lot ``lot_in_epoch`` (0-based) of an epoch records; None when an earlier charge
        of its epoch covers it (shuffle, random allocation) or the plan is not private."""
        if self.event is None or not self.sampler.charged(lot_in_epoch):
            return None
        return self.event

    def charge_lots(self, ledger, lots: int, first: int = 0, label: str = "lost") -> int:
        """Record in ``ledger`` what ``lots`` consecutive lots from position ``first`` of an epoch
        cost, each as the loop charges it (``sampling.record_lots`` at this plan's σ and k); returns
        the charges."""
        if self.event is None:
            return 0
        return record_lots(ledger, self.sampler, self.sigma, lots, first, self.groups, label)


def check_strategy(event: Event | None, strategy: Strategy | None) -> None:
    """ValueError unless ``event`` covers the noise of ``strategy``: a ``Cyclic`` charge exactly when
    the noise is correlated; a banded strategy of b bands under cyclic Poisson over b parts (q < 1,
    Choquette-Choo et al. 2023 Thm 4) or whole parts visited every cycle >= b lots (q = 1); a BLT,
    which no amplification theorem covers, only the latter, with cycle >= its min_sep."""
    if event is None:
        return
    if (strategy is None) != (not isinstance(event, Cyclic)):
        raise ValueError(
            f"plan: event {type(event).__name__} with strategy {strategy and strategy.kind}: "
            "correlated noise is charged by its cyclic participation (events.Cyclic) and only so"
        )
    if strategy is None:
        return
    if strategy.kind == "bandmf":
        b = len(strategy.coef)
        ok = event.cycle == b if event.q < 1 else event.cycle >= b
    else:
        ok = event.q == 1 and event.cycle >= strategy.min_sep
    if not ok:
        raise ValueError(
            f"plan: a {strategy.kind} strategy (bands {strategy.bands}, min_sep "
            f"{strategy.min_sep}) is not covered by a cycle of {event.cycle} lots at q={event.q}"
        )
