"""Cyclic participation: the samplers a correlated-noise run (privacy.noise=bandmf|blt) is accounted
under. Each example belongs to one part, fixed for the run; lot s of the run draws only from part
s mod (number of parts), so two participations of an example are a whole cycle apart.

* ``CyclicPoissonSampler`` (``cyclic_poisson``) — cyclic Poisson sampling (Choquette-Choo et al.
  2023, arXiv 2306.08153, Alg. 2): b parts (b = the bands), lot s Poisson-samples part s mod b at
  rate q = b·L/N, so a lot holds L examples in expectation. With a b-banded strategy normalised to
  column norm 1, one cycle of b lots is charged as one Poisson-subsampled Gaussian at (q, σ) (their
  Thm 4): n lots cost ⌈n/b⌉ such charges (``events.Cyclic``). b = 1 draws the lots of
  ``PoissonSampler`` draw for draw.
* ``CyclicSampler`` (``cyclic``) — b-min-separation without amplification: t = N/L parts (rounded),
  lot s is the whole part s mod t, so each example takes part once every t lots (once per epoch).
  One epoch is charged as one Gaussian at σ (q = 1) on the strategy's per-participation
  sensitivity (<= 1 after its normalisation, strategy.py).

The parts are a fixed function of each example's index and the sampler's seed (SplitMix64 of
(seed, i), mod the number of parts), so removing or adding one example moves no other example: the
neighbouring datasets of the add/remove analysis differ in that example's participations only. A
lot that the loop abandons (a stop before it ran) is not counted: the position (lots run) moves
when the next lot is asked for, and an epoch must start at a cycle boundary (``epoch`` refuses
otherwise; a cycle cut short by training.max_steps cannot be continued).

Details: docs/CORRELATED_NOISE.md.
"""

from __future__ import annotations

from typing import Iterator

import numpy as np
import torch

from dpsgd.accountant import events
from dpsgd.accountant.calibrate import lots_per_epoch
from dpsgd.mechanism.sampling import Sampler, make_sampler

_M64 = (1 << 64) - 1


def assignment(N: int, parts: int, seed: int) -> np.ndarray:
    """The part (0..parts−1) of each of N examples: SplitMix64(seed + (i + 1)·γ) mod parts (Steele
    et al. 2014's finaliser), a fixed function of (seed, i), independent of N."""
    if parts == 1:
        return np.zeros(N, dtype=np.int64)
    with np.errstate(over="ignore"):
        z = np.uint64(int(seed) & _M64) + (np.arange(1, N + 1, dtype=np.uint64)) * np.uint64(
            0x9E3779B97F4A7C15
        )
        z = (z ^ (z >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
        z = (z ^ (z >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
        z = z ^ (z >> np.uint64(31))
    return (z % np.uint64(parts)).astype(np.int64)


class _Cyclic(Sampler):
    """What both cyclic samplers share: the parts, the position (lots run), one charge per cycle."""

    cycle = 1  # lots per charge (the parts visited in turn)

    def __init__(self, N: int, L: int, generator: torch.Generator | None, parts: int):
        super().__init__(N, L, generator)
        self.n_parts = int(parts)
        self.partition_seed = int(self.generator.initial_seed())
        a = assignment(self.N, self.n_parts, self.partition_seed)
        self.parts = [torch.from_numpy(np.flatnonzero(a == j)) for j in range(self.n_parts)]
        self.position = 0  # lots run (a lot counts once the next one is asked for)

    def charged(self, lot_in_epoch: int) -> bool:
        return lot_in_epoch % self.cycle == 0

    def lots_within(self, charges: int, lot_in_epoch: int) -> int:
        # the rest of a cycle already charged, then a whole cycle per charge
        into = lot_in_epoch % self.cycle
        return (self.cycle - into if into else 0) + max(0, charges) * self.cycle

    @property
    def aligned(self) -> bool:
        """Whether the next lot starts a cycle (an epoch may begin)."""
        return self.position % self.cycle == 0

    def _lots(self, draw) -> Iterator[torch.Tensor]:
        if not self.aligned:
            raise ValueError(
                f"privacy.sampling={self.name}: lot {self.position % self.cycle} of a cycle of "
                f"{self.cycle}: a run cut mid-cycle (training.max_steps) cannot continue, the next "
                "lots would break the separation its charge assumes"
            )
        for i in range(self.lots_per_epoch()):
            yield draw(self.parts[i % self.n_parts])
            self.position += 1  # asked for the next lot: this one ran

    def state_dict(self) -> dict:
        return {
            **super().state_dict(),
            "parts": self.n_parts,
            "partition_seed": self.partition_seed,
            "position": self.position,
        }

    def load_state_dict(self, state: dict) -> None:
        got = (state.get("parts"), state.get("partition_seed"))
        if got != (self.n_parts, self.partition_seed):
            raise ValueError(
                f"sampler state is for {got[0]} parts (seed {got[1]}), not {self.n_parts} "
                f"(seed {self.partition_seed})"
            )
        super().load_state_dict(state)
        self.position = int(state["position"])


class CyclicPoissonSampler(_Cyclic):
    """Cyclic Poisson sampling over b parts: lot s draws each example of part s mod b with
    probability q = b·L/N (b·L <= N); an epoch is b·round(N/(b·L)) lots (whole cycles).

    Args:
        N: the number of training examples (>= 1).
        L: the expected lot size, in [1, N/b].
        generator: the ``torch.Generator`` every draw comes from; its seed fixes the parts.
        bands: b, the parts (the bands of the strategy), >= 1.
    """

    name = "cyclic_poisson"
    adjacency = (
        "add/remove one example; cyclic Poisson sampling over b fixed parts (rate b·L/N within "
        "the part of the lot), amplified (Choquette-Choo et al. 2023, Thm 4)"
    )
    amplification = True

    def __init__(self, N: int, L: int, generator: torch.Generator | None = None, bands: int = 1):
        b = int(bands)
        if b < 1:
            raise ValueError(f"privacy.bands={bands!r}: must be >= 1")
        if b * int(L) > int(N):
            raise ValueError(
                f"privacy.bands={b}: cyclic Poisson sampling draws lots of L={L} from parts of "
                f"N/b = {int(N) / b:.6g} examples (rate b·L/N > 1); needs b·L <= N={N}"
            )
        super().__init__(N, L, generator, b)
        self.cycle = b

    @property
    def q(self) -> float:
        return self.n_parts * self.L / self.N

    def lots_per_epoch(self) -> int:
        return self.n_parts * lots_per_epoch(self.N, self.n_parts * self.L)

    def epoch(self) -> Iterator[torch.Tensor]:
        def draw(part: torch.Tensor) -> torch.Tensor:
            mask = torch.rand(len(part), generator=self.generator) < self.q
            hit = torch.from_numpy(np.flatnonzero(mask.numpy()))
            return hit if self.n_parts == 1 else part[hit]  # b = 1: PoissonSampler's lot

        return self._lots(draw)

    def event(self, sigma: float, groups: int = 1) -> events.Event:
        return events.Cyclic(self.q, float(sigma), self.cycle, groups)


class CyclicSampler(_Cyclic):
    """b-min-separation without amplification: t = round(N/L) fixed parts, lot s is the whole part
    s mod t (one epoch = one cycle); charged as one Gaussian at σ per epoch (q = 1).

    Args:
        N: the number of training examples (>= 1).
        L: the lot size the parts are cut for, in [1, N].
        generator: the ``torch.Generator`` whose seed fixes the parts.
    """

    name = "cyclic"
    adjacency = (
        "add/remove one example; fixed parts visited in turn (each example once per epoch, "
        "b-min-separation), no amplification by sampling"
    )
    amplification = False

    def __init__(self, N: int, L: int, generator: torch.Generator | None = None):
        t = lots_per_epoch(int(N), int(L))
        super().__init__(N, L, generator, t)
        self.cycle = t

    @property
    def q(self) -> float:
        return 1.0

    def lots_per_epoch(self) -> int:
        return self.n_parts

    def epoch(self) -> Iterator[torch.Tensor]:
        return self._lots(lambda part: part)

    def event(self, sigma: float, groups: int = 1) -> events.Event:
        return events.Cyclic(1.0, float(sigma), self.cycle, groups)


CYCLIC = {"cyclic_poisson": CyclicPoissonSampler, "cyclic": CyclicSampler}

NOISES = ("independent", "bandmf", "blt")
SCHEMA = {"bandmf": "cyclic_poisson", "blt": "cyclic"}  # what privacy.sampling=poisson becomes


def participation(noise: str, sampling: str) -> str:
    """The sampler a run with ``noise`` draws its lots with: ``sampling`` for independent noise; for
    correlated noise the cyclic schema its charge needs (``poisson``, the default, becomes
    cyclic_poisson for BandMF and cyclic for BLT). ValueError, one line naming the value, for a
    sampler that cannot be accounted with that noise."""
    if noise not in NOISES:
        raise ValueError(f"privacy.noise={noise!r}: must be one of {list(NOISES)}")
    if noise == "independent":
        if sampling in CYCLIC:
            raise ValueError(
                f"privacy.sampling={sampling}: the participation of correlated noise; with "
                "privacy.noise=independent use poisson (or privacy.noise=bandmf privacy.bands=1, "
                "Algorithm 1's noise under it)"
            )
        return sampling
    if sampling == "poisson":
        return SCHEMA[noise]
    if noise == "blt" and sampling == "cyclic_poisson":
        raise ValueError(
            "privacy.sampling=cyclic_poisson: a BLT strategy is not banded, so no amplification "
            "theorem covers it; use privacy.sampling=cyclic (b-min-separation, not amplified)"
        )
    if sampling not in CYCLIC:
        raise ValueError(
            f"privacy.sampling={sampling}: privacy.noise={noise} is accounted only under cyclic "
            "participation (each example in one fixed part, parts visited in turn): use "
            f"{' or '.join(CYCLIC) if noise == 'bandmf' else 'cyclic'}"
        )
    return sampling


def make_run_sampler(
    noise: str,
    sampling: str,
    N: int,
    L: int,
    generator: torch.Generator | None = None,
    max_lot_size: int | None = None,
    bands: int | None = None,
) -> Sampler:
    """The sampler of a run with ``noise`` (``participation``): a cyclic one for correlated noise
    (cyclic_poisson over b = ``bands`` parts), else ``sampling.make_sampler``'s."""
    name = participation(noise, sampling)
    if (noise == "bandmf") != (bands is not None):
        raise ValueError(
            "bands=None: noise=bandmf needs the number of bands b (1 = Algorithm 1's noise)"
            if noise == "bandmf"
            else f"bands={bands!r}: applies to noise=bandmf only (noise={noise})"
        )
    if name == "cyclic_poisson":
        return CyclicPoissonSampler(N, L, generator, 1 if bands is None else bands)
    if name == "cyclic":
        return CyclicSampler(N, L, generator)
    return make_sampler(name, N, L, generator, max_lot_size)
