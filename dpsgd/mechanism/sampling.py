"""Lot samplers. The sampler is the single source of the sampling rate q that the ledger charges.

* ``PoissonSampler`` — Algorithm 1 of Abadi et al. 2016 as analysed by the moments accountant
  (§3.1: "each lot is formed by independently picking each example with probability q = L/N").
  Neighbouring datasets differ by adding/removing one example; the privacy analysis uses
  amplification by sampling, so each lot is charged as one subsampled Gaussian mechanism
  (q = L/N, noise multiplier σ).
* ``ShuffleSampler`` — a random permutation each epoch, partitioned into fixed lots of exactly L
  (the remainder N mod L is dropped for that epoch). The Poisson analysis does NOT cover it, and no
  amplification by sampling is claimed. Each example is in exactly one lot per epoch, so under
  substitution (replace-one) adjacency one epoch changes the sum of one lot by at most 2C while the
  other lots are unchanged (parallel composition). One epoch is charged as one Gaussian mechanism
  with q = 1 and noise multiplier σ/2 (sensitivity 2C, noise σC), recorded as soon as the first lot
  of the epoch is taken.

Both draw only from their own ``torch.Generator``; ``state_dict`` / ``load_state_dict`` capture it
so that a resumed run draws the same lots as an uninterrupted one.
"""
from __future__ import annotations

from typing import Iterator

import torch

from dpsgd.accountant.calibrate import lots_per_epoch


class Sampler:
    name = "?"
    adjacency = "?"
    amplification = False

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

    def release(self, sigma: float, lot_in_epoch: int) -> tuple[float, float] | None:
        """(q, noise multiplier) charged to the ledger before lot ``lot_in_epoch`` (0-based) of an
        epoch is used, or None when that lot is covered by an earlier charge."""
        raise NotImplementedError

    def lots_within(self, charges: int, lot_in_epoch: int) -> int:
        """How many lots, from lot ``lot_in_epoch`` of an epoch on, may run with ``charges`` more
        charges (releases) recorded."""
        raise NotImplementedError

    def state_dict(self) -> dict:
        return {"name": self.name, "N": self.N, "L": self.L, "generator": self.generator.get_state()}

    def load_state_dict(self, state: dict) -> None:
        if (state["name"], state["N"], state["L"]) != (self.name, self.N, self.L):
            raise ValueError(f"sampler state is for {state['name']} N={state['N']} L={state['L']}, "
                             f"not {self.name} N={self.N} L={self.L}")
        self.generator.set_state(state["generator"])


class PoissonSampler(Sampler):
    """Each example independently with probability q = L/N; an epoch is N/L lots, rounded to the
    nearest whole lot (accountant.calibrate.lots_per_epoch)."""

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
            yield mask.nonzero().flatten()

    def release(self, sigma: float, lot_in_epoch: int) -> tuple[float, float]:
        return self.q, float(sigma)

    def lots_within(self, charges: int, lot_in_epoch: int) -> int:
        return max(0, charges)          # every lot is charged


class ShuffleSampler(Sampler):
    """A fresh random permutation per epoch, cut into floor(N/L) lots of exactly L examples."""

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
            yield perm[i * self.L:(i + 1) * self.L]

    def release(self, sigma: float, lot_in_epoch: int) -> tuple[float, float] | None:
        # One Gaussian mechanism per epoch, sensitivity 2C (substitution) and noise σC: multiplier σ/2.
        return (1.0, float(sigma) / 2.0) if lot_in_epoch == 0 else None

    def lots_within(self, charges: int, lot_in_epoch: int) -> int:
        # the rest of an epoch already charged, then a whole epoch per charge
        rest = self.lots_per_epoch() - lot_in_epoch if lot_in_epoch > 0 else 0
        return rest + max(0, charges) * self.lots_per_epoch()


SAMPLERS = {"poisson": PoissonSampler, "shuffle": ShuffleSampler}


def make_sampler(name: str, N: int, L: int, generator: torch.Generator | None = None) -> Sampler:
    if name not in SAMPLERS:
        raise ValueError(f"privacy.sampling={name!r}: must be one of {sorted(SAMPLERS)}")
    return SAMPLERS[name](N, L, generator)
