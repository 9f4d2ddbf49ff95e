"""Ledger: the record of every release a training run made, answering ε(δ) under any accountant.

A release is (q, σ, count, groups, label): ``count`` lots of the Poisson-sampled Gaussian mechanism
with sampling rate q and noise multiplier σ, where each lot clips ``groups = k`` tensors separately
to C and adds N(0, σ²C²) to each (the DP-PCA release is q = 1, count = 1). Consecutive identical
records are merged. Per-layer clipping is charged by an explicit ``convention``:

* ``"joint"`` (correct, default): the k noisy tensors of one lot are one Gaussian mechanism whose
  sensitivity is sqrt(k)·C (each block has norm <= C), i.e. noise multiplier σ/√k, charged once.
* ``"per_tensor"`` (the paper's original code): k mechanisms at σ per lot. This under-states ε and
  is offered only to reproduce the paper's numbers.

Accountants: ``"moments"`` (Abadi et al. 2016, λ = 1..32, tail bound; order = λ*), ``"rdp"``
(Mironov, Talwar & Zhang 2019, improved conversion by default; order = α*), ``"pld"``
(connect-the-dots PLD, FFT; order = None). Per-(q, σ) curves are cached in the modules, so a query
costs a weighted sum plus a minimum (moments, RDP) or one FFT power per direction (PLD).
"""
from __future__ import annotations

import math
from dataclasses import asdict, dataclass

import numpy as np

from . import moments as _moments
from . import pld as _pld
from . import rdp as _rdp
from ._checks import (STEPS_MAX, check_choice, check_delta, check_epsilon, check_groups, check_q, check_sigma,
                      check_steps)

ACCOUNTANTS = ("moments", "rdp", "pld")
CONVENTIONS = ("joint", "per_tensor")
_FORMAT = "dpsgd.ledger/1"


@dataclass(frozen=True)
class Entry:
    q: float
    sigma: float
    count: int
    groups: int = 1
    label: str = ""


def mechanisms(entries, convention: str = "joint"):
    """[(q, σ_eff, count)] charged for ``entries`` under a convention, merged by (q, σ_eff)."""
    check_choice(convention, "convention", CONVENTIONS)
    out: dict = {}
    for e in entries:
        if convention == "joint":
            key, n = (e.q, e.sigma / math.sqrt(e.groups) if e.groups > 1 else e.sigma), e.count
        else:
            key, n = (e.q, e.sigma), e.count * e.groups
        if n:
            out[key] = out.get(key, 0) + n
    return [(q, s, n) for (q, s), n in out.items()]


def _curve(accountant, q, s):
    if accountant == "moments":
        return _moments._log_moments(q, s, _moments.PAPER_LAMBDAS)
    return _rdp._rdp_curve(q, s, _rdp.DEFAULT_ORDERS)


def _total(accountant, mechs):
    total = 0.0
    for q, s, n in mechs:
        total = total + n * _curve(accountant, q, s)
    return total


_LAMBDAS = np.asarray(_moments.PAPER_LAMBDAS, dtype=float)
_ORDERS = np.asarray(_rdp.DEFAULT_ORDERS, dtype=float)


def _eps_from_total(accountant, total, delta, conversion):
    """Fast path of moments.epsilon_from_log_moments / rdp.rdp_to_epsilon (arguments already valid)."""
    if accountant == "moments":
        return _moments._epsilon_from_log_moments(total, _LAMBDAS, delta)   # Abadi et al. 2016, Thm 2.2
    return _rdp._rdp_to_epsilon(_ORDERS, total, delta, conversion)


def _pld_servable(mechs) -> None:
    """The charged mechanisms within the PLD's ranges, named as charged (σ/√k, count·k)."""
    for _, s, n in mechs:
        check_sigma(s, "sigma/sqrt(groups)")
        check_steps(n, "count*groups")


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
        check_choice(conversion, "conversion", _rdp.CONVERSIONS)
        return self._epsilon(mechanisms(self._entries, convention), delta, accountant, conversion)

    @staticmethod
    def _epsilon(mechs, delta, accountant, conversion="improved"):
        if not mechs:
            return 0.0, None
        if accountant == "pld":
            _pld_servable(mechs)
            return _pld.epsilon_for_releases(mechs, delta), None
        eps, order = _eps_from_total(accountant, _total(accountant, mechs), delta, conversion)
        return eps, (int(order) if accountant == "moments" else float(order))

    def delta(self, epsilon: float, accountant: str = "moments", convention: str = "joint",
              conversion: str = "improved"):
        """(δ, order) at ε under the chosen accountant; (0.0, None) if empty."""
        epsilon = check_epsilon(epsilon)
        check_choice(accountant, "accountant", ACCOUNTANTS)
        check_choice(conversion, "conversion", _rdp.CONVERSIONS)
        mechs = mechanisms(self._entries, convention)
        if not mechs:
            return 0.0, None
        if accountant == "pld":
            _pld_servable(mechs)
            return _pld.delta_for_releases(mechs, epsilon), None
        total = _total(accountant, mechs)
        if accountant == "moments":
            return _moments.delta_from_log_moments(total, epsilon, _moments.PAPER_LAMBDAS)
        return _rdp.rdp_to_delta(_rdp.DEFAULT_ORDERS, total, epsilon, conversion)

    def steps_within(self, target_epsilon: float, delta: float, q: float, sigma: float, groups: int = 1,
                     accountant: str = "moments", convention: str = "joint",
                     conversion: str = "improved") -> int:
        """Largest n >= 0 such that ε after recording n more lots (q, σ, groups) is <= target.

        Moments / RDP: ε(n) = min_order (A + n·a + c)/…, solved per order in closed form and then
        checked exactly. PLD: safeguarded regula falsi on n, bracketed from the RDP answer
        (PLD ε <= RDP ε), doubling upwards. The answer is capped where the total number of lots
        would pass STEPS_MAX (more than that is not served by the accountants).
        """
        target = check_epsilon(target_epsilon, "target_epsilon")
        delta = check_delta(delta)
        q, sigma, groups = check_q(q), check_sigma(sigma), check_groups(groups)
        check_choice(accountant, "accountant", ACCOUNTANTS)
        check_choice(convention, "convention", CONVENTIONS)
        check_choice(conversion, "conversion", _rdp.CONVERSIONS)
        base = mechanisms(self._entries, convention)
        new = mechanisms([Entry(q, sigma, 1, groups)], convention)[0]      # (q, σ_eff, lots per lot)

        cap = max(0, (STEPS_MAX - sum(n for _, _, n in base)) // new[2])

        def eps_at(n, acc=accountant):
            m = base + ([(new[0], new[1], n * new[2])] if n else [])
            return self._epsilon(m, delta, acc, conversion)[0]

        if eps_at(0) > target:
            return 0
        if accountant == "pld":
            lo = min(self.steps_within(target, delta, q, sigma, groups, "rdp", convention), cap)
            e_lo = eps_at(lo)
            if e_lo > target:                  # PLD above RDP (round-off, or a coarse grid at huge T)
                lo, e_lo = 0, eps_at(0)
            if lo >= cap:
                return cap
            step = max(1, lo // 2)
            hi = min(lo + step, cap)
            e_hi = eps_at(hi)
            while e_hi <= target:
                if hi >= cap:
                    return cap
                lo, e_lo, step = hi, e_hi, step * 2
                hi = min(lo + step, cap)
                e_hi = eps_at(hi)
            # Illinois (regula falsi) on the integers, f = ε − target: f(lo) <= 0 < f(hi)
            f_lo, f_hi, last = e_lo - target, e_hi - target, 0
            while hi - lo > 1:
                mid = lo + int(round(-f_lo / (f_hi - f_lo) * (hi - lo))) if f_hi > f_lo else (lo + hi) // 2
                mid = min(max(mid, lo + 1), hi - 1)
                f_mid = eps_at(mid) - target
                if f_mid <= 0:
                    lo, f_lo = mid, f_mid
                    if last == 1:
                        f_hi /= 2.0
                    last = 1
                else:
                    hi, f_hi = mid, f_mid
                    if last == -1:
                        f_lo /= 2.0
                    last = -1
            return lo
        # moments / RDP: per order, the bound is affine in n
        per = _curve(accountant, new[0], new[1]) * new[2]
        tot = _total(accountant, base) if base else np.zeros_like(per)
        if accountant == "moments":
            lam = np.asarray(_moments.PAPER_LAMBDAS, dtype=float)
            slack = lam * target - math.log(1.0 / delta) - tot          # need n·per <= slack
        else:
            a = np.asarray(_rdp.DEFAULT_ORDERS, dtype=float)
            if conversion == "paper":
                c = -math.log(delta) / (a - 1.0)
            else:
                c = np.log1p(-1.0 / a) - (math.log(delta) + np.log(a)) / (a - 1.0)
            slack = target - c - tot
        with np.errstate(divide="ignore", invalid="ignore"):
            n_est = np.where(per > 0, np.floor(slack / per), np.where(slack >= 0, np.inf, -1))
        n = int(min(float(np.max(n_est)), cap))
        n = max(n, 0)
        while n > 0 and eps_at(n) > target:     # guard against rounding at the boundary
            n -= 1
        while n < cap and eps_at(n + 1) <= target:   # (e.g. the RDP ε = 0 special case)
            n += 1
        return n

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
