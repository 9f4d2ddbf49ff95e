"""Lot samplers. The sampler is the single source of the sampling rate q that the ledger charges.

* ``PoissonSampler`` — Algorithm 1 of Abadi et al. 2016 (§3.1): each example in a lot with
  probability q = L/N; add/remove adjacency, one subsampled Gaussian mechanism per lot.
* ``ShuffleSampler`` — a random permutation per epoch cut into fixed lots; no amplification by
  sampling claimed: one Gaussian per epoch at q = 1 and σ/2 (replace-one adjacency).
* ``FixedSizeSampler`` — exactly L of the N examples, drawn without replacement for every lot;
  replace-one adjacency. Its privacy event is ``events.FixedSize``, whose stored code in a ledger
  is ``"wor"`` (sampled without replacement: a stored format, kept so that old privacy.json files
  read back).
* ``TruncatedPoissonSampler`` — a Poisson lot capped at B examples (``padded``: fixed shape B).
* ``BallsInBinsSampler`` — random allocation: every example in one of the epoch's t = N/L lots.

Every sampler draws only from its own ``torch.Generator`` (``state_dict`` resumes it); ``event``,
``release``, ``charges`` and ``record_lots`` are the one place its q, privacy event and neighbouring
relation are defined. ``make_sampler`` builds one by its config name.

Details: docs/ACCOUNTING.md, "dpsgd/mechanism/sampling.py".
"""

from __future__ import annotations

from typing import Iterator

import numpy as np
import torch

from dpsgd.accountant import events
from dpsgd.accountant.calibrate import lots_per_epoch
from dpsgd.accountant.ledger import EVENTS


class Sampler:
    """The base of the lot samplers: the lots of an epoch and what each lot is charged as.

    Args:
        N: the number of training examples (>= 1).
        L: the (expected) lot size, in [1, N].
        generator: the ``torch.Generator`` every draw comes from (a fresh one when None).

    Raises:
        ValueError: N < 1, or L outside [1, N].
    """

    name = "?"
    adjacency = "?"  # words, for privacy.json
    amplification = False
    pads = False  # ``padded`` adds zero-weight rows (fixed-shape lots; train.py)

    def __init__(self, N: int, L: int, generator: torch.Generator | None = None):
        N, L = int(N), int(L)
        if N < 1:
            raise ValueError(f"dataset size N={N} must be >= 1")
        if not 1 <= L <= N:
            raise ValueError(f"privacy.lot_size={L}: must be in [1, N={N}]")
        self.N, self.L = N, L
        self.generator = generator if generator is not None else torch.Generator()

    def lots_per_epoch(self) -> int:
        raise NotImplementedError

    def epoch(self) -> Iterator[torch.Tensor]:
        """The lots (int64 index tensors) of one epoch, drawn lazily from the generator."""
        raise NotImplementedError

    def event(self, sigma: float, groups: int = 1) -> events.Event:
        """The privacy event one charge of this sampler is, for lots noised at σ with ``groups`` = k
        separately clipped tensors."""
        raise NotImplementedError

    @property
    def relation(self) -> str:
        """The ledger's neighbouring relation of this sampler's charges: its event's
        (accountant/events.py)."""
        return self.event(1.0).entry()["adjacency"]

    @property
    def accountants(self) -> tuple[str, ...]:
        """The accountants that serve this sampler's charges: its event kind's
        (``ledger.EVENTS``)."""
        return EVENTS[self.event(1.0).entry()["event"]]

    def charged(self, lot_in_epoch: int) -> bool:
        """Whether lot ``lot_in_epoch`` (0-based) of an epoch carries a charge of its own (False: an
        earlier charge of its epoch covers it)."""
        return True

    def release(self, sigma: float, lot_in_epoch: int, groups: int = 1) -> events.Event | None:
        """The event recorded before lot ``lot_in_epoch`` (0-based) of an epoch is used, or None
        when that lot is covered by an earlier charge."""
        return self.event(sigma, groups) if self.charged(lot_in_epoch) else None

    def charges(self, sigma: float, lots: int, first: int = 0, groups: int = 1) -> dict:
        """{event: count} that ``lots`` lots from position ``first`` of an epoch record (what the
        training loop charges, lot by lot, aggregated)."""
        per, out = self.lots_per_epoch(), {}
        for j in range(min(lots, per)):
            ev = self.release(sigma, (first + j) % per, groups)
            reps = lots // per + (1 if j < lots % per else 0)
            if ev is not None and reps:
                out[ev] = out.get(ev, 0) + reps
        return out

    def padded(self, idx: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The lot as it is computed: (indices, weights); the default is the lot itself, weight
        1."""
        return idx, torch.ones(len(idx))

    def lots_within(self, charges: int, lot_in_epoch: int) -> int:
        """How many lots, from lot ``lot_in_epoch`` of an epoch on, may run with ``charges`` more
        charges (releases) recorded."""
        raise NotImplementedError

    def state_dict(self) -> dict:
        return {
            "name": self.name,
            "N": self.N,
            "L": self.L,
            "generator": self.generator.get_state(),
        }

    def load_state_dict(self, state: dict) -> None:
        if (state["name"], state["N"], state["L"]) != (self.name, self.N, self.L):
            raise ValueError(
                f"sampler state is for {state['name']} N={state['N']} L={state['L']}, "
                f"not {self.name} N={self.N} L={self.L}"
            )
        self.generator.set_state(state["generator"])


class PoissonSampler(Sampler):
    """Each example independently with probability q = L/N; an epoch is N/L lots, rounded to the
    nearest whole lot (accountant.calibrate.lots_per_epoch).

    Args:
        N: the number of training examples (>= 1).
        L: the (expected) lot size, in [1, N].
        generator: the ``torch.Generator`` every draw comes from (a fresh one when None).
    """

    name = "poisson"
    adjacency = "add/remove one example"
    amplification = True

    @property
    def q(self) -> float:
        return self.L / self.N

    def lots_per_epoch(self) -> int:
        return lots_per_epoch(self.N, self.L)

    def epoch(self) -> Iterator[torch.Tensor]:
        for _ in range(self.lots_per_epoch()):
            mask = torch.rand(self.N, generator=self.generator) < self.q
            # the indices of mask.nonzero(), in order: numpy's flatnonzero is ~10× faster on the CPU
            yield torch.from_numpy(np.flatnonzero(mask.numpy()))

    def event(self, sigma: float, groups: int = 1) -> events.Event:
        return events.Poisson(self.q, float(sigma), groups)

    def lots_within(self, charges: int, lot_in_epoch: int) -> int:
        return max(0, charges)  # every lot is charged


class ShuffleSampler(Sampler):
    """A fresh random permutation per epoch, cut into floor(N/L) lots of exactly L examples.

    Args:
        N: the number of training examples (>= 1).
        L: the (expected) lot size, in [1, N].
        generator: the ``torch.Generator`` every draw comes from (a fresh one when None).
    """

    name = "shuffle"
    adjacency = "substitution (replace one example), no amplification by sampling"
    amplification = False

    @property
    def q(self) -> float:
        # The accounting rate: every example is used once per epoch, nothing is gained by sampling.
        return 1.0

    def lots_per_epoch(self) -> int:
        return self.N // self.L

    def epoch(self) -> Iterator[torch.Tensor]:
        perm = torch.randperm(self.N, generator=self.generator)
        for i in range(self.lots_per_epoch()):
            yield perm[i * self.L : (i + 1) * self.L]

    def event(self, sigma: float, groups: int = 1) -> events.Event:
        # One Gaussian mechanism per epoch, sensitivity 2C (substitution) and noise σC: multiplier
        # σ/2.
        return events.Shuffle(float(sigma), self.lots_per_epoch(), groups)

    def charged(self, lot_in_epoch: int) -> bool:
        return lot_in_epoch == 0

    def lots_within(self, charges: int, lot_in_epoch: int) -> int:
        # the rest of an epoch already charged, then a whole epoch per charge
        rest = self.lots_per_epoch() - lot_in_epoch if lot_in_epoch > 0 else 0
        return rest + max(0, charges) * self.lots_per_epoch()


class FixedSizeSampler(Sampler):
    """Exactly L examples per lot, without replacement, drawn afresh for every lot; N // L lots per
    epoch (an epoch is only a unit of length here). Each lot is charged as ``events.FixedSize``.

    Args:
        N: the number of training examples (>= 1).
        L: the (expected) lot size, in [1, N].
        generator: the ``torch.Generator`` every draw comes from (a fresh one when None).
    """

    name = "fixed_size"
    adjacency = (
        "substitution (replace one example); sampling without replacement, amplified (PLD: Dong, "
        "Roth & Su 2022, Thm 9; RDP: Wang et al. 2019)"
    )
    amplification = True

    @property
    def q(self) -> float:
        return self.L / self.N

    def lots_per_epoch(self) -> int:
        return max(1, self.N // self.L)

    def epoch(self) -> Iterator[torch.Tensor]:
        for _ in range(self.lots_per_epoch()):
            yield torch.randperm(self.N, generator=self.generator)[: self.L].sort().values

    def event(self, sigma: float, groups: int = 1) -> events.Event:
        return events.FixedSize(self.q, float(sigma), groups)

    def lots_within(self, charges: int, lot_in_epoch: int) -> int:
        return max(0, charges)


class TruncatedPoissonSampler(PoissonSampler):
    """Poisson lots (rate q = L/N) capped at B examples: when more were drawn, a uniformly random B
    of them are kept. ``padded`` gives every lot the fixed shape B (zero-weight padding rows).

    Args:
        N: the number of training examples (>= 1).
        L: the (expected) lot size, in [1, N].
        generator: the ``torch.Generator`` every draw comes from (a fresh one when None).
        B: the cap on a lot's size (``privacy.max_lot_size``), >= L; None means N (no cap).

    Raises:
        ValueError: B < L (and the base class's checks of N and L).
    """

    name = "truncated_poisson"
    adjacency = "add/remove one example; Poisson lots truncated to B (Ganesh et al. 2025)"
    pads = True

    def __init__(
        self, N: int, L: int, generator: torch.Generator | None = None, B: int | None = None
    ):
        super().__init__(N, L, generator)
        B = int(B) if B is not None else N
        if not L <= B:
            raise ValueError(f"privacy.max_lot_size={B}: must be >= privacy.lot_size={L}")
        self.B = min(B, N)

    def epoch(self) -> Iterator[torch.Tensor]:
        for lot in super().epoch():
            if len(lot) > self.B:
                keep = torch.randperm(len(lot), generator=self.generator)[: self.B]
                lot = lot[keep.sort().values]
            yield lot

    def padded(self, idx: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        pad = self.B - len(idx)
        w = torch.cat([torch.ones(len(idx)), torch.zeros(pad)])
        return torch.cat([idx, torch.zeros(pad, dtype=idx.dtype)]), w

    def event(self, sigma: float, groups: int = 1) -> events.Event:
        return events.TruncatedPoisson(self.q, float(sigma), self.N, self.B, groups)

    def state_dict(self) -> dict:
        return {**super().state_dict(), "B": self.B}

    def load_state_dict(self, state: dict) -> None:
        if state.get("B") != self.B:
            raise ValueError(f"sampler state is for B={state.get('B')}, not B={self.B}")
        super().load_state_dict(state)


class BallsInBinsSampler(Sampler):
    """Each epoch, every example goes to one of t = N/L lots uniformly at random (balls in bins).

    Args:
        N: the number of training examples (>= 1).
        L: the (expected) lot size, in [1, N].
        generator: the ``torch.Generator`` every draw comes from (a fresh one when None).
    """

    name = "balls_in_bins"
    adjacency = (
        "add/remove one example; random allocation to one lot per epoch, amplified (PLD or RDP "
        "per epoch, both directions: Feldman & Shenfeld 2025, 2026)"
    )
    amplification = True

    @property
    def q(self) -> float:
        return 1.0

    def lots_per_epoch(self) -> int:
        return lots_per_epoch(self.N, self.L)

    def epoch(self) -> Iterator[torch.Tensor]:
        t = self.lots_per_epoch()
        bins = torch.randint(t, (self.N,), generator=self.generator)
        order = torch.argsort(bins, stable=True)
        counts = torch.bincount(bins, minlength=t).tolist()
        start = 0
        for n in counts:
            yield order[start : start + n]
            start += n

    def event(self, sigma: float, groups: int = 1) -> events.Event:
        # one epoch of random allocation over t lots (accountant/renyi/allocation.py), charged at
        # its first lot
        return events.Allocation(float(sigma), self.lots_per_epoch(), groups)

    def charged(self, lot_in_epoch: int) -> bool:
        return lot_in_epoch == 0

    def lots_within(self, charges: int, lot_in_epoch: int) -> int:
        rest = self.lots_per_epoch() - lot_in_epoch if lot_in_epoch > 0 else 0
        return rest + max(0, charges) * self.lots_per_epoch()


SAMPLERS = {
    "poisson": PoissonSampler,
    "shuffle": ShuffleSampler,
    "fixed_size": FixedSizeSampler,
    "truncated_poisson": TruncatedPoissonSampler,
    "balls_in_bins": BallsInBinsSampler,
}


def record_lots(
    ledger,
    sampler: Sampler,
    sigma: float,
    lots: int,
    first: int = 0,
    groups: int = 1,
    label: str = "sgd",
) -> int:
    """Record in ``ledger`` what ``lots`` consecutive lots of ``sampler`` cost, the first at
    position ``first`` of its epoch (``Sampler.charges``: each lot as the training loop charges it).

    Args:
        ledger: the ``dpsgd.accountant.Ledger`` the charges are recorded in.
        sampler: the sampler whose lots are charged.
        sigma: the noise multiplier σ of each charge.
        lots: the number of consecutive lots.
        first: the position in its epoch of the first of them.
        groups: k, the number of clipping groups.
        label: the ledger label of the charges.

    Returns:
        How many charges were recorded.
    """
    out = sampler.charges(sigma, lots, first, groups)
    for ev, n in out.items():
        ledger.record(ev, n, label)
    return sum(out.values())


def make_sampler(
    name: str,
    N: int,
    L: int,
    generator: torch.Generator | None = None,
    max_lot_size: int | None = None,
) -> Sampler:
    """The sampler that ``privacy.sampling`` names.

    Args:
        name: one of ``SAMPLERS`` (poisson, shuffle, fixed_size, truncated_poisson,
            balls_in_bins).
        N: the number of training examples.
        L: the (expected) lot size.
        generator: the ``torch.Generator`` its draws come from.
        max_lot_size: B, the cap of ``truncated_poisson`` (ignored by the others).

    Returns:
        The sampler.

    Raises:
        ValueError: an unknown name (or the sampler's own checks of N, L and B).
    """
    if name not in SAMPLERS:
        raise ValueError(f"privacy.sampling={name!r}: must be one of {sorted(SAMPLERS)}")
    if name == "truncated_poisson":
        return TruncatedPoissonSampler(N, L, generator, max_lot_size)
    return SAMPLERS[name](N, L, generator)
