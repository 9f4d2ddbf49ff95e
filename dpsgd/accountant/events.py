"""Privacy events: one release of a run, typed (in the manner of dp_accounting's ``DpEvent``).

A sampler says what each of its charges is by returning one of these (``mechanism/sampling.py``:
``Sampler.event``, ``Sampler.release``); the ledger records an event ``count`` times
(``Ledger.record(event, count, label)``) and stores it as an
:class:`~dpsgd.accountant.ledger.Entry`, the flat record of ``privacy.json`` and the checkpoint
(``entry``). Every event carries the noise multiplier ``sigma`` that the mechanism *adds* (noise
std σ·C, or σ_p for DP-PCA) and ``groups`` = k, the tensors clipped separately to C.

The events: ``Poisson`` (add/remove), ``Gaussian`` (either adjacency; DP-PCA), ``FixedSize``
(replace-one), ``TruncatedPoisson`` (add/remove), ``Allocation`` (add/remove), ``Shuffle``
(replace-one, charged as one Gaussian per epoch) and ``Cyclic`` (add/remove: one cycle of a
correlated-noise run, charged as one Poisson-subsampled Gaussian). An event is plain data, checked when it is
recorded (``Ledger.record``); ``from_entry`` reads a stored entry back as the event with the same
accounting.

Details (each event's fields, adjacency and stored form): docs/ACCOUNTING.md,
"dpsgd/accountant/events.py".
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar


@dataclass(frozen=True)
class Event:
    """One release: its noise multiplier ``sigma`` (as added), ``groups`` = k, its ``adjacency``."""

    def entry(self) -> dict:
        """The fields the ledger stores for one release of this event
        (``Entry`` minus count, groups, label)."""
        raise NotImplementedError


@dataclass(frozen=True)
class Poisson(Event):
    """A lot drawn by Poisson sampling at rate q, noised at σ (Abadi et al. 2016, §3.1)."""

    q: float
    sigma: float
    groups: int = 1
    adjacency: ClassVar[str] = "add_remove"

    def entry(self) -> dict:
        return {
            "q": float(self.q),
            "sigma": float(self.sigma),
            "event": "poisson",
            "adjacency": "add_remove",
        }


@dataclass(frozen=True)
class Gaussian(Event):
    """The Gaussian mechanism with noise multiplier σ (per unit of sensitivity), subsampled at rate
    q (1: not subsampled). DP-PCA: σ = σ_p, q = privacy.pca_fraction. Under replace_one only with
    q = 1 (a Gaussian whose σ already carries the sensitivity 2C: ``Ledger.converted``)."""

    sigma: float
    q: float = 1.0
    groups: int = 1
    adjacency: str = "add_remove"  # a field here: a Gaussian is under either relation

    def entry(self) -> dict:
        return {
            "q": float(self.q),
            "sigma": float(self.sigma),
            "event": "poisson",
            "adjacency": self.adjacency,
        }


@dataclass(frozen=True)
class FixedSize(Event):
    """A lot of exactly L of N examples without replacement, γ = L/N (Wang, Balle & Kasiviswanathan
    2019; Dong, Roth & Su 2022, Thm 9)."""

    gamma: float
    sigma: float
    groups: int = 1
    adjacency: ClassVar[str] = "replace_one"

    def entry(self) -> dict:
        return {
            "q": float(self.gamma),
            "sigma": float(self.sigma),
            "event": "wor",
            "adjacency": "replace_one",
        }


@dataclass(frozen=True)
class TruncatedPoisson(Event):
    """A Poisson lot (rate q) of N examples capped at B (Ganesh et al. 2025)."""

    q: float
    sigma: float
    N: int
    B: int
    groups: int = 1
    adjacency: ClassVar[str] = "add_remove"

    def entry(self) -> dict:
        return {
            "q": float(self.q),
            "sigma": float(self.sigma),
            "event": "truncated",
            "adjacency": "add_remove",
            "N": int(self.N),
            "B": int(self.B),
        }


@dataclass(frozen=True)
class Allocation(Event):
    """One epoch of random allocation (balls-in-bins) over t lots, each noised at σ (Feldman &
    Shenfeld 2025; Chua et al. 2025)."""

    sigma: float
    t: int
    groups: int = 1
    adjacency: ClassVar[str] = "add_remove"

    def entry(self) -> dict:
        return {
            "q": 1.0,
            "sigma": float(self.sigma),
            "event": "allocation",
            "adjacency": "add_remove",
            "t": int(self.t),
        }


@dataclass(frozen=True)
class Shuffle(Event):
    """One epoch of a shuffled dataset cut into t lots, each noised at σ: every example in exactly
    one lot, so under replace-one the epoch is one Gaussian with sensitivity 2C and noise σC
    (parallel composition), no amplification by sampling: charged as q = 1, σ/2."""

    sigma: float
    t: int = 1
    groups: int = 1
    adjacency: ClassVar[str] = "replace_one"

    def entry(self) -> dict:
        return {
            "q": 1.0,
            "sigma": float(self.sigma) / 2.0,
            "event": "poisson",
            "adjacency": "replace_one",
        }


@dataclass(frozen=True)
class Cyclic(Event):
    """One cycle of ``cycle`` lots of a correlated-noise run (matrix factorisation; mechanism/
    strategy.py), its strategy normalised so that one participation has sensitivity <= 1: each
    example is in one of the cycle's parts and takes part at most once per cycle. Charged as one
    Poisson-subsampled Gaussian at (q, σ) per cycle: cyclic Poisson sampling of a b-banded strategy,
    q = b·L/N (Choquette-Choo et al. 2023, arXiv 2306.08153, Thm 4; jax_privacy's
    ``amplified_bandmf_event``); q = 1: whole parts, b-min-separation, no amplification (the
    Gaussian mechanism with the strategy's per-participation sensitivity, composed over cycles)."""

    q: float
    sigma: float
    cycle: int
    groups: int = 1
    adjacency: ClassVar[str] = "add_remove"

    def entry(self) -> dict:
        return {
            "q": float(self.q),
            "sigma": float(self.sigma),
            "event": "cyclic",
            "adjacency": "add_remove",
            "t": int(self.cycle),
        }


EVENT_TYPES = (Poisson, Gaussian, FixedSize, TruncatedPoisson, Allocation, Shuffle, Cyclic)


def from_entry(e) -> Event:
    """The event a stored entry (an ``Entry``, or anything with its fields) records once."""
    if e.event == "wor":
        return FixedSize(e.q, e.sigma, e.groups)
    if e.event == "truncated":
        return TruncatedPoisson(e.q, e.sigma, e.N, e.B, e.groups)
    if e.event == "allocation":
        return Allocation(e.sigma, e.t, e.groups)
    if e.event == "cyclic":
        return Cyclic(e.q, e.sigma, e.t, e.groups)
    if e.event == "poisson" and e.adjacency == "add_remove":
        return Poisson(e.q, e.sigma, e.groups)
    if e.event == "poisson":
        return Gaussian(e.sigma, e.q, e.groups, e.adjacency)
    raise ValueError(
        f"event must be one of ['poisson', 'wor', 'truncated', 'allocation', 'cyclic'], got "
        f"event={e.event!r}"
    )
