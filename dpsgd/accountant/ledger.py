"""Ledger: the record of every release a training run made, answering ε(δ) under any accountant.

A release is (q, σ, count, groups, label): ``count`` lots of the Poisson-sampled Gaussian mechanism
with sampling rate q and noise multiplier σ, where each lot clips ``groups = k`` tensors separately
to C and adds N(0, σ²C²) to each (the DP-PCA release is q = 1, count = 1). Consecutive identical
records are merged. Queries charge the records under an explicit ``convention`` (joint, correct; or
the paper's per_tensor) and compose them under an accountant (``compose.py``): ``"moments"`` (Abadi
et al. 2016, λ = 1..32, tail bound; order = λ*), ``"rdp"`` (Mironov, Talwar & Zhang 2019, improved
conversion by default; order = α*), ``"pld"`` (connect-the-dots PLD, FFT; order = None).
"""
from __future__ import annotations

from dataclasses import asdict, dataclass

from . import calibrate, compose
from ._checks import check_choice, check_delta, check_epsilon, check_groups, check_q, check_sigma, check_steps
from .compose import ACCOUNTANTS
from .rdp import CONVERSIONS

_FORMAT = "dpsgd.ledger/1"


@dataclass(frozen=True)
class Entry:
    q: float
    sigma: float
    count: int
    groups: int = 1
    label: str = ""


class Ledger:
    """Records releases; answers ε(δ), δ(ε) and how many more lots fit in a budget."""

    def __init__(self, entries=()):
        self._entries: list[Entry] = []
        for e in entries:
            e = e if isinstance(e, Entry) else Entry(**e)
            self.record(e.q, e.sigma, e.count, e.groups, e.label)

    # -- recording -------------------------------------------------------------------------
    def record(self, q: float, sigma: float, count: int = 1, groups: int = 1, label: str = "") -> None:
        """Record ``count`` lots (q, σ) with ``groups`` separately clipped tensors."""
        q, sigma = check_q(q), check_sigma(sigma)
        count, groups = check_steps(count, "count"), check_groups(groups)
        if not isinstance(label, str):
            raise ValueError(f"label must be a string, got label={label!r}")
        if count == 0:
            return
        last = self._entries[-1] if self._entries else None
        if last is not None and (last.q, last.sigma, last.groups, last.label) == (q, sigma, groups, label):
            self._entries[-1] = Entry(q, sigma, last.count + count, groups, label)
        else:
            self._entries.append(Entry(q, sigma, count, groups, label))

    @property
    def entries(self) -> tuple:
        """The merged records, oldest first (immutable :class:`Entry` objects)."""
        return tuple(self._entries)

    @property
    def steps(self) -> int:
        """Total number of recorded lots / releases (Σ count over all entries)."""
        return sum(e.count for e in self._entries)

    # -- queries ---------------------------------------------------------------------------
    def epsilon(self, delta: float, accountant: str = "moments", convention: str = "joint",
                conversion: str = "improved"):
        """(ε, order) at δ: order = λ* (moments), α* (rdp) or None (pld); (0.0, None) if empty.

        ``conversion`` ("improved" | "paper") applies to the RDP accountant only.
        """
        delta = check_delta(delta)
        check_choice(accountant, "accountant", ACCOUNTANTS)
        check_choice(conversion, "conversion", CONVERSIONS)
        return compose.epsilon(compose.mechanisms(self._entries, convention), delta, accountant, conversion)

    def epsilons(self, deltas, accountant: str = "moments", convention: str = "joint",
                 conversion: str = "improved") -> list[float]:
        """ε at each δ of ``deltas`` (one composition for all of them)."""
        deltas = [check_delta(d) for d in deltas]
        check_choice(accountant, "accountant", ACCOUNTANTS)
        check_choice(conversion, "conversion", CONVERSIONS)
        return compose.epsilons(compose.mechanisms(self._entries, convention), deltas, accountant, conversion)

    def delta(self, epsilon: float, accountant: str = "moments", convention: str = "joint",
              conversion: str = "improved"):
        """(δ, order) at ε under the chosen accountant; (0.0, None) if empty."""
        epsilon = check_epsilon(epsilon)
        check_choice(accountant, "accountant", ACCOUNTANTS)
        check_choice(conversion, "conversion", CONVERSIONS)
        return compose.delta(compose.mechanisms(self._entries, convention), epsilon, accountant, conversion)

    def steps_within(self, target_epsilon: float, delta: float, q: float, sigma: float, groups: int = 1,
                     accountant: str = "moments", convention: str = "joint", conversion: str = "improved") -> int:
        """Largest n >= 0 such that ε after n more lots (q, σ, groups) is <= target
        (:func:`dpsgd.accountant.calibrate.steps_within`)."""
        return calibrate.steps_within(self._entries, target_epsilon, delta, q, sigma, groups, accountant,
                                      convention, conversion)

    # -- serialisation ---------------------------------------------------------------------
    def to_dict(self) -> dict:
        """JSON-serialisable dict (floats round-trip exactly through json)."""
        return {"format": _FORMAT, "entries": [asdict(e) for e in self._entries]}

    @classmethod
    def from_dict(cls, d: dict) -> "Ledger":
        if not isinstance(d, dict) or d.get("format") != _FORMAT or not isinstance(d.get("entries"), list):
            raise ValueError(f"not a ledger dict (expected format {_FORMAT!r}), got {d!r:.200}")
        led = cls()
        for e in d["entries"]:
            led._entries.append(Entry(check_q(e["q"]), check_sigma(e["sigma"]), check_steps(e["count"], "count"),
                                      check_groups(e["groups"]), str(e["label"])))
        return led

    def __eq__(self, other) -> bool:
        return isinstance(other, Ledger) and self._entries == other._entries

    def __repr__(self) -> str:
        return f"Ledger({[asdict(e) for e in self._entries]!r})"
