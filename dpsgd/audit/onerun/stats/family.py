"""The claim as the null hypothesis: a one-run test of "this run is at most as leaky as the
mechanism its accountant charges for", and the ε lower bound it implies within that mechanism's
family.

Family: M(σ′) = T lots of the Poisson-subsampled Gaussian at rate q, k groups under the joint
convention, add/remove (``dpsgd.accountant.compose.charge``), with σ′ in place of the run's σ.
H₀(σ′): "with respect to each canary, the run is f_{σ′}-DP" (Dong, Roth & Su 2022, §2). The curve
is bounded from below from the PLD accountant's δ(ε) on a grid of ε, tabulated at log-spaced x.
The test is the f-DP recursion of Mahloujifar, Melis & Chaudhuri 2024 on the guesses of
``bounds.default_grid``, each at β/|grid|: valid for any score and finite m, and monotone in σ′.

Outputs: ``claim_rejected`` (H₀ at the claimed σ rejected → verdict ``violation``),
``sigma_upper_bound`` σ_ub (doubling and bisection in log σ′, to SIGMA_RTOL) and ε_lb = ε of
M(σ_ub) at δ (``pld.epsilon``). This is a test of the claim's family, not a lower bound on ε for
every mechanism (the family-free bounds of ``bounds`` are that).

Details (the curve, the test, the outputs): docs/AUDIT_MATH.md,
"dpsgd/audit/onerun/stats/family.py".
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from functools import lru_cache

import numpy as np

from dpsgd.accountant import compose, limits, pld
from dpsgd.core.errors import ConfigError

from .bounds import check_scores, default_grid, fdp_rejected, guess_counts

EPS_STEP = 0.02  # spacing of the ε grid E of the curve's envelope
EPS_TOP = 80.0  # E stops here, or where δ(ε) falls below DELTA_FLOOR
DELTA_FLOOR = 1e-14  # δ(ε) below this: the guarantees add nothing above x ≈ 1e-14
X_MIN = 1e-15  # f̄(x) = 0 below (a lower bound: f̄ >= 0)
X_STEP = 0.005  # spacing of the f̄ table in log x
SIGMA_RTOL = 1e-3  # bisection in log σ′ stops when hi/lo − 1 <= this
SEARCH_FACTOR = (
    64.0  # σ′ is searched within [σ/64, 64σ] (and the accountant's [SIGMA_MIN·√k, SIGMA_MAX])
)
PLD_INTERVAL = (
    1e-3  # privacy-loss grid of the PLD behind δ(ε) (pessimistic: a coarser grid only raises δ)
)


@dataclass(frozen=True)
class Claim:
    """The claimed mechanism: T = ``steps`` lots at Poisson rate q, noise multiplier σ, k groups
    (joint)."""

    q: float
    sigma: float
    steps: int
    groups: int = 1
    delta: float = limits.DELTA_DEFAULT

    def validate(self, label=lambda name: name) -> Claim:
        """ConfigError naming the first bad field, as ``label(field)``."""
        try:
            object.__setattr__(self, "q", limits.check_q(self.q, label("q")))
            object.__setattr__(self, "sigma", limits.check_sigma(self.sigma, label("sigma")))
            object.__setattr__(self, "steps", limits.check_steps(self.steps, label("steps")))
            object.__setattr__(self, "groups", limits.check_groups(self.groups, label("groups")))
            object.__setattr__(self, "delta", limits.check_delta(self.delta, label("delta")))
        except ValueError as e:
            raise ConfigError(str(e)) from None
        if self.steps < 1:
            raise ConfigError(f"{label('steps')}={self.steps}: must be >= 1 (the number of lots)")
        return self

    def sigma_eff(self, sigma: float) -> float:
        """Noise multiplier of one lot's Gaussian mechanism under the joint convention: σ/√k."""
        return compose.charge(self.q, sigma, self.groups, "joint")[1]

    def epsilon(self, sigma: float | None = None) -> float:
        """ε of M(σ) at δ: PLD accountant, joint convention
        (the run's own valid ε for these lots)."""
        s = self.sigma if sigma is None else sigma
        return float(pld.epsilon(self.q, self.sigma_eff(s), self.steps, self.delta))


class TradeOff:
    """f̄(x) = f̂(1 − x) for M: a lower bound on the trade-off curve (module doc), tabulated."""

    def __init__(self, q: float, sigma_eff: float, steps: int):
        comps = pld.compose([(q, sigma_eff, steps)], interval=PLD_INTERVAL)
        eps, deltas = [], []
        e = 0.0
        while e <= EPS_TOP:
            d = min(1.0, max(c.delta(e) for c in comps))
            eps.append(e)
            deltas.append(d)
            if d < DELTA_FLOOR:
                break
            e = round(e + EPS_STEP, 10)
        self.eps, self.deltas = np.array(eps), np.array(deltas)
        self.log_x0 = math.log(X_MIN)
        self.x = np.exp(np.arange(self.log_x0, X_STEP / 2, X_STEP))
        self.x[-1] = min(self.x[-1], 1.0)
        best = np.zeros_like(self.x)
        for i in range(0, len(self.eps), 256):  # max over ε in chunks (memory)
            ee, dd = self.eps[i : i + 256, None], self.deltas[i : i + 256, None]
            x = self.x[None, :]
            lines = np.maximum(np.exp(-ee) * (x - dd), 1.0 - dd - np.exp(ee) * (1.0 - x))
            best = np.maximum(best, lines.max(axis=0))
        self.fbar_table = np.minimum(best, self.x)  # f(α) <= 1 − α for every trade-off curve
        self._table = self.fbar_table.tolist()

    def __call__(self, x: float) -> float:
        """f̄ at the table point just below x (a lower bound on f̂(1 − x))."""
        if x < X_MIN:
            return 0.0
        j = min(int((math.log(x) - self.log_x0) / X_STEP), len(self._table) - 1)
        return self._table[j]


@lru_cache(maxsize=64)
def tradeoff(q: float, sigma_eff: float, steps: int) -> TradeOff:
    return TradeOff(q, sigma_eff, steps)


def _rejects(claim: Claim, sigma: float, rows: list[dict], m: int, per: float) -> bool:
    f = tradeoff(claim.q, claim.sigma_eff(sigma), claim.steps)
    return any(fdp_rejected(f, row["guesses"], row["correct"], m, per) for row in rows)


def family_test(scores, bits, claim: Claim, beta: float = 0.05, guesses=None) -> dict:
    """The test of H₀(σ′) on one run's canaries (module doc): {"claim_rejected", "verdict",
    "sigma_upper_bound", "eps_lower_bound", "eps_claimed", "m", "beta", "beta_per_point", "grid"}.

    ``scores[i]``, ``bits[i]`` as in ``bounds.audit_bound`` (all m randomised canaries; any score).
    ``sigma_upper_bound`` is None and ε_lb = 0 when no σ′ <= SEARCH_FACTOR·σ is rejected; when even
    σ/SEARCH_FACTOR is rejected it is that σ′ and ``at_search_floor`` is True
    (ε_lb then understates)."""
    s, b = check_scores(scores, bits)
    if not (isinstance(beta, (int, float)) and 0 < beta < 1):
        raise ConfigError(f"beta={beta!r}: must be a number in (0, 1)")
    m = s.size
    grid = default_grid(m) if guesses is None else [tuple(g) for g in guesses]
    per = beta / len(grid)
    rows = guess_counts(s, b.astype(int), grid)
    rejected, hi, at_floor = search_sigma(claim, lambda sigma: _rejects(claim, sigma, rows, m, per))
    eps_lb = 0.0 if hi is None else claim.epsilon(hi)
    return {
        "method": "family",
        "claim_rejected": bool(rejected),
        "verdict": "violation" if rejected else "consistent",
        "sigma_upper_bound": hi,
        "at_search_floor": at_floor,
        "eps_lower_bound": eps_lb,
        "eps_claimed": claim.epsilon(),
        "sigma_claimed": claim.sigma,
        "m": m,
        "beta": beta,
        "beta_per_point": per,
        "grid": rows,
    }


def search_sigma(claim: Claim, rejects) -> tuple[bool, float | None, bool]:
    """(H₀(σ) rejected, σ_ub, at_search_floor) for a test ``rejects(σ′)`` that is monotone in σ′
    (rejects every σ′ above one it rejects: a larger σ′ claims more privacy): σ_ub is a σ′ it
    rejects with the σ′ SIGMA_RTOL below it not rejected (doubling from σ, then bisection in log
    σ′); None when nothing up to SEARCH_FACTOR·σ is rejected; the floor σ/SEARCH_FACTOR (and
    at_search_floor True) when even that is rejected."""
    rejected = rejects(claim.sigma)
    floor = max(claim.sigma / SEARCH_FACTOR, limits.SIGMA_MIN * math.sqrt(claim.groups))
    at_floor = False
    if rejected:  # search down for a σ′ that is not rejected
        hi, lo = claim.sigma, claim.sigma / 2
        while lo > floor and rejects(lo):
            hi, lo = lo, lo / 2
        if lo <= floor:
            lo = floor
            at_floor = rejects(lo)
            if at_floor:
                hi = lo
    else:  # search up for one that is
        ceiling = min(claim.sigma * SEARCH_FACTOR, limits.SIGMA_MAX)
        lo, hi = claim.sigma, claim.sigma * 2
        while hi <= ceiling and not rejects(hi):
            lo, hi = hi, hi * 2
        if hi > ceiling:
            hi = None
    if hi is not None and not at_floor:
        while hi / lo - 1 > SIGMA_RTOL:  # keep lo not rejected, hi rejected
            mid = math.sqrt(lo * hi)
            lo, hi = (lo, mid) if rejects(mid) else (mid, hi)
    return bool(rejected), hi, at_floor
