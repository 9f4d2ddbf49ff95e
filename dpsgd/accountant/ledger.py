"""Ledger: the record of every release a training run made, answering ε(δ) under any accountant.

A release is (q, σ, count, groups, label): ``count`` lots of the Poisson-sampled Gaussian mechanism
with sampling rate q and noise multiplier σ, where each lot clips ``groups = k`` tensors separately
to C and adds N(0, σ²C²) to each (the DP-PCA release is q = 1, count = 1). Consecutive identical
records are merged. Queries charge the records under an explicit ``convention`` (joint, correct; or
the paper's per_tensor) and compose them under an accountant (``compose.py``): ``"moments"``,
``"rdp"`` or ``"pld"``.

A release is recorded as a typed privacy event (``events.py``: ``record(event, count, label)``) and
stored as one flat ``Entry`` (the format of ``privacy.json`` and the checkpoint). Every entry names
its **event** (``poisson``, ``wor``, ``truncated``, ``allocation``, ``cyclic``) and its **neighbouring
relation** (``adjacency``). Composing entries of different relations is refused (ValueError) unless
they were converted first (:meth:`Ledger.converted`, which names the conversion in the label).

Details (each event, the accountants that serve it, their papers): docs/ACCOUNTING.md,
"dpsgd/accountant/ledger.py".
"""

from __future__ import annotations

import numbers
from dataclasses import asdict, dataclass, replace

import numpy as np

from . import calibrate, compose
from .privacy_loss import truncated
from .renyi import allocation, wor
from .events import Event, Gaussian
from .limits import (
    STEPS_MAX,
    check_choice,
    check_delta,
    check_epsilon,
    check_groups,
    check_q,
    check_sigma,
    check_steps,
)
from .compose import ACCOUNTANTS
from .renyi.rdp import CONVERSIONS, rdp_curve, rdp_to_epsilon_unchecked

ADJACENCIES = ("add_remove", "replace_one")
# the one table: an entry's event kind → the accountants that serve it, first the one that is
# tightest for it; a sampler's and a plan's accountants and neighbouring relation are read from
# their event
EVENTS = {
    "poisson": ("moments", "rdp", "pld"),
    "wor": ("pld", "rdp"),
    "truncated": ("pld",),
    "allocation": ("pld", "rdp"),
    # one Poisson-subsampled Gaussian per cycle (events.Cyclic): the Poisson entries' own math and
    # order (b = 1 is Algorithm 1, its default accountant included)
    "cyclic": ("moments", "rdp", "pld"),
}
# the kinds composed as Poisson-subsampled Gaussians (q, σ, count) by compose.py
PLAIN = ("poisson", "cyclic")

_FORMAT = "dpsgd.ledger/1"


@dataclass(frozen=True)
class Entry:
    q: float
    sigma: float
    count: int
    groups: int = 1
    label: str = ""
    event: str = "poisson"
    adjacency: str = "add_remove"
    N: int = 0  # truncated: dataset size
    B: int = 0  # truncated: the cap on the lot size
    t: int = 0  # allocation: lots per epoch; cyclic: lots per cycle


class Ledger:
    """Records releases; answers ε(δ), δ(ε) and how many more lots fit in a budget."""

    def __init__(self, entries=()):
        self._entries: list[Entry] = []
        for e in entries:
            e = e if isinstance(e, Entry) else Entry(**e)
            self._record_fields(
                e.q, e.sigma, e.count, e.groups, e.label, e.event, e.adjacency, e.N, e.B, e.t
            )

    # -- recording -------------------------------------------------------------------------
    def record(self, event: Event, count: int = 1, label: str = "") -> None:
        """Record ``count`` releases of ``event``, stored as the event's ``entry`` with its groups.

        Args:
            event: an :mod:`~dpsgd.accountant.events` event (Poisson, Gaussian, FixedSize,
                TruncatedPoisson, Allocation, Shuffle).
            count: how many releases (≥ 0; 0 records nothing).
            label: what they were (``pca``, ``sgd``, ``lost``, ...), kept in privacy.json.

        Raises:
            ValueError: naming the value, for a non-event or an event outside what the accountants
                serve (q, σ, count, k, the adjacency its kind allows).
        """
        _check_event(event, "Ledger.record")
        return self._record_event(event, count, label)

    def _record_event(self, event: Event, count: int = 1, label: str = "") -> None:
        for name in ("q", "gamma", "sigma"):  # as given: entry() coerces with float() ("0.1", True)
            v = getattr(event, name, None)
            if (
                v is not None
                and type(v) is not float
                and (isinstance(v, bool) or not isinstance(v, numbers.Real))
            ):
                raise ValueError(f"{name} must be a real number, got {name}={v!r}")
        f = event.entry()
        self._record_fields(f.pop("q"), f.pop("sigma"), count, event.groups, label, **f)

    def _record_fields(
        self,
        q: float,
        sigma: float,
        count: int = 1,
        groups: int = 1,
        label: str = "",
        event: str = "poisson",
        adjacency: str = "add_remove",
        N: int = 0,
        B: int = 0,
        t: int = 0,
    ) -> None:
        q, sigma = check_q(q), check_sigma(sigma)
        count, groups = check_steps(count, "count"), check_groups(groups)
        if not isinstance(label, str):
            raise ValueError(f"label must be a string, got label={label!r}")
        check_choice(event, "event", tuple(EVENTS))
        check_choice(adjacency, "adjacency", ADJACENCIES)
        if event == "poisson" and adjacency == "replace_one" and q != 1.0:
            raise ValueError(
                "a Poisson-subsampled entry under replace_one needs q = 1 (a Gaussian), got "
                f"q={q!r}"
            )
        if (event == "wor") != (adjacency == "replace_one") and event != "poisson":
            raise ValueError(
                f"event={event!r} is accounted under "
                f"{'replace_one' if event == 'wor' else 'add_remove'}"
            )
        if event == "truncated" and not (int(N) >= 1 and int(B) >= 1):
            raise ValueError(f"a truncated entry needs N >= 1 and B >= 1, got N={N!r}, B={B!r}")
        if event in ("allocation", "cyclic") and not int(t) >= 1:
            raise ValueError(f"an {event} entry needs t >= 1 lots per charge, got t={t!r}")
        self._append(
            Entry(q, sigma, count, groups, label, event, adjacency, int(N), int(B), int(t))
        )

    def _append(self, e: Entry) -> None:
        """Store ``e``, merged into the last entry when they differ only in count."""
        if e.count == 0:
            return
        last = self._entries[-1] if self._entries else None
        if (
            last is not None and replace(last, count=e.count) == e
        ):  # every field but the count equal
            self._entries[-1] = replace(e, count=last.count + e.count)
        else:
            self._entries.append(e)

    @property
    def adjacency(self) -> str | None:
        """The one neighbouring relation of every entry (None if empty);
        ValueError if they differ."""
        rel = sorted({e.adjacency for e in self._entries})
        if len(rel) > 1:
            raise ValueError(
                f"ledger entries are under different neighbouring relations {rel}; convert them "
                "first (Ledger.converted) — composing them as one statement is refused"
            )
        return rel[0] if rel else None

    def converted(self, adjacency: str) -> "Ledger":
        """This ledger with every entry under ``adjacency``. add/remove → replace-one, for a
        (subsampled) Gaussian release: replacing one example is removing it and adding another, so
        the sum moves by at most 2× the add/remove sensitivity; charged as the Gaussian with q = 1
        (no amplification by sampling claimed) and σ/2 (Dwork & Roth 2014, group privacy for k = 2
        is the general rule; for the Gaussian, doubling the sensitivity is exact). replace-one →
        add/remove is not offered (fixed-size lots have no add/remove analysis here)."""
        check_choice(adjacency, "adjacency", ADJACENCIES)
        out = Ledger()
        for e in self._entries:
            if e.adjacency == adjacency:
                out._entries.append(e)
            elif adjacency == "replace_one" and e.event == "poisson":
                out.record(
                    Gaussian(e.sigma / 2.0, 1.0, e.groups, "replace_one"),
                    e.count,
                    f"{e.label} [add/remove→replace-one: sensitivity doubled, sigma/2, q=1]",
                )
            else:
                raise ValueError(
                    f"no conversion of a {e.event} entry under {e.adjacency} to {adjacency}"
                )
        return out

    @property
    def entries(self) -> tuple:
        """The merged records, oldest first (immutable :class:`Entry` objects)."""
        return tuple(self._entries)

    @property
    def steps(self) -> int:
        """Total number of recorded lots / releases (Σ count over all entries)."""
        return sum(e.count for e in self._entries)

    # -- queries ---------------------------------------------------------------------------
    def _plain(self, accountant: str, conversion: str) -> bool:
        """Checks the query; True when every entry is a Poisson-subsampled Gaussian (compose.py)."""
        check_choice(accountant, "accountant", ACCOUNTANTS)
        check_choice(conversion, "conversion", CONVERSIONS)
        self.adjacency  # one relation, or ValueError
        for e in self._entries:
            if accountant not in EVENTS[e.event]:
                raise ValueError(
                    f"accountant={accountant!r} does not serve {e.event} lots "
                    f"({e.label or 'entry'}); use one of {list(EVENTS[e.event])}"
                )
        return all(e.event in PLAIN for e in self._entries)

    def epsilon(
        self,
        delta: float,
        accountant: str = "moments",
        convention: str = "joint",
        conversion: str = "improved",
    ):
        """ε of every release recorded, composed, at δ.

        Args:
            delta: δ in (0, 1).
            accountant: ``moments``, ``rdp`` or ``pld``
                (an entry's kind may be served by some only).
            convention: ``joint`` (k groups = one Gaussian at σ/√k: correct) or ``per_tensor`` (the
                paper code's k mechanisms at σ: under-states ε).
            conversion: ``improved`` or ``paper``: the RDP → (ε, δ) conversion (RDP only).

        Returns:
            (ε, order): order = λ* (moments), α* (rdp) or None (pld); (0.0, None) if empty.
        """
        delta = check_delta(delta)
        if self._plain(accountant, conversion):
            return compose.epsilon(
                compose.mechanisms(self._entries, convention), delta, accountant, conversion
            )
        return _events_epsilon(self._entries, delta, accountant, convention, conversion)

    def epsilons(
        self,
        deltas,
        accountant: str = "moments",
        convention: str = "joint",
        conversion: str = "improved",
    ) -> list[float]:
        """ε at each δ of ``deltas`` (one composition for all of them)."""
        deltas = [check_delta(d) for d in deltas]
        if self._plain(accountant, conversion):
            return compose.epsilons(
                compose.mechanisms(self._entries, convention), deltas, accountant, conversion
            )
        if accountant == "pld":  # one composition for every δ
            return truncated.epsilons_for_releases(_releases(self._entries, convention), deltas)
        return [
            _events_epsilon(self._entries, d, accountant, convention, conversion)[0] for d in deltas
        ]

    def delta(
        self,
        epsilon: float,
        accountant: str = "moments",
        convention: str = "joint",
        conversion: str = "improved",
    ):
        """(δ, order) at ε under the chosen accountant; (0.0, None) if empty
        (Poisson entries only)."""
        epsilon = check_epsilon(epsilon)
        if not self._plain(accountant, conversion):
            raise ValueError("delta(epsilon) is served for Poisson-subsampled entries only")
        return compose.delta(
            compose.mechanisms(self._entries, convention), epsilon, accountant, conversion
        )

    def steps_within(
        self,
        target_epsilon: float,
        delta: float,
        event: Event,
        accountant: str = "moments",
        convention: str = "joint",
        conversion: str = "improved",
    ) -> int:
        """Largest n >= 0 such that ε after n more releases of ``event`` (an
        :mod:`~dpsgd.accountant.events` event) is <= target
        (:func:`dpsgd.accountant.calibrate.steps_within` for Poisson lots; otherwise a doubling and
        bisection search on n, ε being non-decreasing in n). ValueError for anything that is not an
        event; the event is checked as if recorded."""
        _check_event(event, "Ledger.steps_within")
        Ledger()._record_event(event, 1)  # q, σ, k, adjacency: checked as recorded
        f = {"N": 0, "B": 0, "t": 0} | event.entry()
        if f["event"] in PLAIN and all(e.event in PLAIN for e in self._entries):
            if self._entries and {e.adjacency for e in self._entries} != {f["adjacency"]}:
                raise ValueError(
                    f"steps_within: lots under {f['adjacency']} after entries under "
                    f"{sorted({e.adjacency for e in self._entries})}; convert first "
                    "(Ledger.converted)"
                )
            return calibrate.steps_within(
                self._entries,
                target_epsilon,
                delta,
                f["q"],
                f["sigma"],
                event.groups,
                accountant,
                convention,
                conversion,
            )
        target = check_epsilon(target_epsilon, "target_epsilon")

        def eps_at(n: int) -> float:
            led = Ledger(self._entries)
            led.record(event, n, "next")
            return led.epsilon(delta, accountant, convention, conversion)[0]

        if eps_at(0) > target:
            return 0
        lo, hi = 0, 1
        while eps_at(hi) <= target:
            lo, hi = hi, hi * 2
            if hi > STEPS_MAX:
                return lo
        while hi - lo > 1:
            mid = (lo + hi) // 2
            lo, hi = (mid, hi) if eps_at(mid) <= target else (lo, mid)
        return lo

    # -- serialisation ---------------------------------------------------------------------
    def to_dict(self) -> dict:
        """JSON-serialisable dict (floats round-trip exactly through json)."""
        return {"format": _FORMAT, "entries": [asdict(e) for e in self._entries]}

    @classmethod
    def from_dict(cls, d: dict) -> "Ledger":
        if (
            not isinstance(d, dict)
            or d.get("format") != _FORMAT
            or not isinstance(d.get("entries"), list)
        ):
            raise ValueError(f"not a ledger dict (expected format {_FORMAT!r}), got {d!r:.200}")
        led = cls()
        for e in d["entries"]:
            led._entries.append(
                Entry(
                    check_q(e["q"]),
                    check_sigma(e["sigma"]),
                    check_steps(e["count"], "count"),
                    check_groups(e["groups"]),
                    str(e["label"]),
                    str(e.get("event", "poisson")),
                    str(e.get("adjacency", "add_remove")),
                    int(e.get("N", 0)),
                    int(e.get("B", 0)),
                    int(e.get("t", 0)),
                )
            )
        return led

    def __eq__(self, other) -> bool:
        return isinstance(other, Ledger) and self._entries == other._entries

    def __repr__(self) -> str:
        return f"Ledger({[asdict(e) for e in self._entries]!r})"


def _check_event(event, where: str) -> None:
    if not isinstance(event, Event):
        raise ValueError(
            f"{where}: a privacy event of dpsgd.accountant.events (Poisson, Gaussian, FixedSize, "
            f"TruncatedPoisson, Allocation, Shuffle, Cyclic), got {event!r}"
        )


def _events_epsilon(entries, delta: float, accountant: str, convention: str, conversion: str):
    """(ε, order) of entries that include fixed-size (RDP, ``wor.py``; PLD, ``wor_pld.py``),
    random-allocation epochs (RDP, ``allocation.py``, at the same integer orders; PLD,
    ``allocation_pld.py``) or truncated (PLD, ``truncated.py``) lots; every entry is charged under ``convention`` (compose.charge)."""
    if accountant == "rdp":
        total = 0.0
        for e in entries:
            q, s, per_lot = compose.charge(e.q, e.sigma, e.groups, convention)
            curve = (
                wor.rdp_curve(q, s)
                if e.event == "wor"
                else allocation.rdp_curve(s, e.t, wor.ORDERS)
                if e.event == "allocation"
                else rdp_curve(q, s, wor.ORDERS)
            )
            total = total + e.count * per_lot * curve
        return rdp_to_epsilon_unchecked(np.array(wor.ORDERS), np.asarray(total), delta, conversion)
    return truncated.epsilon_for_releases(_releases(entries, convention), delta), None


def _releases(entries, convention: str) -> list:
    """The PLD releases [(kind, count)] of ``entries``, each charged under ``convention``."""
    rel = []
    for e in entries:
        q, s, per_lot = compose.charge(e.q, e.sigma, e.groups, convention)
        kind = (
            ("truncated", e.N, q, e.B, s)
            if e.event == "truncated"
            else ("wor", q, s)
            if e.event == "wor"
            else ("allocation", e.t, s)
            if e.event == "allocation"
            else ("poisson", q, s)
        )
        rel.append((kind, e.count * per_lot))
    return rel
