"""Private hyperparameter selection: RDP of "run a random number K of candidates, release the best".

Papernot & Steinke 2022, "Hyperparameter Tuning with Rényi Differential Privacy" (ICLR 2022,
arXiv 2110.03620; improving Liu & Talwar, STOC 2019). Each candidate run Q satisfies
(λ, ε(λ))-RDP at every order λ; A draws K ~ D, runs Q K times independently and releases only the
best (run, score). The distributions of K:

* ``fixed`` K = k: ε'(λ) = k·ε(λ) (composition; the best is post-processing);
* ``poisson`` K ~ Poisson(μ), μ >= 1 (their Thm 6);
* ``truncated_negative_binomial`` K ~ D_{η,γ} (their Thm 2), minimised over λ̂ in the orders.

Each ε'(λ) is then bounded by ε'(λ') for λ' > λ too (suffix minimum), and (ε, δ) follows from
``rdp.rdp_to_epsilon``. :func:`solve_base` is the inverse direction: the largest base budget whose
tuned release still meets a total target.

Details (each bound as implemented): docs/ACCOUNTING.md, "dpsgd/accountant/selection.py".
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass

import numpy as np

from . import calibrate
from .renyi import rdp
from .limits import check_choice, check_delta, check_epsilon, check_groups, check_q, check_steps

DISTRIBUTIONS = ("fixed", "poisson", "truncated_negative_binomial")


@dataclass(frozen=True)
class KDistribution:
    """The law of K, the number of candidates: ``fixed`` (k), ``poisson`` (mu) or
    ``truncated_negative_binomial`` (eta, gamma) in Papernot & Steinke's symbols."""

    name: str
    k: int | None = None
    mu: float | None = None
    eta: float | None = None
    gamma: float | None = None

    def __post_init__(self):
        check_choice(self.name, "distribution", DISTRIBUTIONS)
        if self.name == "fixed":
            if isinstance(self.k, bool) or not isinstance(self.k, int) or self.k < 1:
                raise ValueError(f"k must be an integer >= 1, got k={self.k!r}")
        elif self.name == "poisson":
            if not (_real(self.mu) and self.mu >= 1):  # as dp_accounting: E[K] >= 1
                raise ValueError(f"mu must be a real number >= 1, got mu={self.mu!r}")
        else:
            if not (_real(self.eta) and self.eta >= 0):
                raise ValueError(f"eta must be a real number >= 0, got eta={self.eta!r}")
            if not (_real(self.gamma) and 0 < self.gamma < 1):
                raise ValueError(f"gamma must be in (0, 1), got gamma={self.gamma!r}")

    @property
    def mean(self) -> float:
        """E[K] (Papernot & Steinke, Definition 1 for the truncated negative binomial)."""
        if self.name == "fixed":
            return float(self.k)
        if self.name == "poisson":
            return float(self.mu)
        eta, g = float(self.eta), float(self.gamma)
        if eta == 0:
            return (1.0 / g - 1.0) / math.log(1.0 / g)
        return eta * (1.0 - g) / (g * -math.expm1(eta * math.log(g)))

    def sample(self, rng: np.random.Generator) -> int:
        """One draw of K from ``rng``."""
        if self.name == "fixed":
            return int(self.k)
        if self.name == "poisson":
            return int(rng.poisson(self.mu))
        if self.eta == 0:  # logarithmic: P[K = k] ∝ (1 − γ)^k / k
            return int(rng.logseries(1.0 - self.gamma))
        while True:  # NB(η, γ) conditioned on K >= 1 (rejection)
            k = int(rng.negative_binomial(self.eta, self.gamma))
            if k >= 1:
                return k

    def to_dict(self) -> dict:
        return {k: v for k, v in asdict(self).items() if v is not None} | {"mean": self.mean}


def _real(v) -> bool:
    return not isinstance(v, bool) and isinstance(v, (int, float)) and math.isfinite(v)


def _positive(v) -> bool:
    return _real(v) and v > 0


def _curve(orders, rdp_curve) -> tuple[np.ndarray, np.ndarray]:
    return rdp.check_curve(orders, rdp_curve)


def selection_rdp(orders, rdp_curve, dist: KDistribution) -> np.ndarray:
    """ε'(λ) at each order of "run K ~ dist times, release the best", from the base curve ε(λ)."""
    a, r = _curve(orders, rdp_curve)
    if dist.name == "fixed":
        return dist.k * r
    if dist.name == "poisson":  # Papernot & Steinke, Thm 6
        out = np.empty_like(r)
        for i, lam in enumerate(a):
            eps_hat = math.log1p(1.0 / (lam - 1.0))
            delta_hat = rdp.rdp_to_delta(a, r, eps_hat)[0]
            out[i] = r[i] + dist.mu * delta_hat + math.log(dist.mu) / (lam - 1.0)
    else:  # Papernot & Steinke, Thm 2
        eta, g = float(dist.eta), float(dist.gamma)
        c = (1.0 + eta) * np.min((1.0 - 1.0 / a) * r + math.log(1.0 / g) / a)  # min over λ̂
        out = r + math.log(dist.mean) / (a - 1.0) + c
    order = np.argsort(a)  # RDP non-decreasing in λ
    out[order] = np.minimum.accumulate(out[order][::-1])[::-1]
    return out


def selection_epsilon(
    orders, rdp_curve, dist: KDistribution, delta: float, conversion: str = "improved"
):
    """(ε, λ*) at δ of the tuned release (``rdp.rdp_to_epsilon`` of :func:`selection_rdp`)."""
    delta = check_delta(delta)
    return rdp.rdp_to_epsilon(orders, selection_rdp(orders, rdp_curve, dist), delta, conversion)


def base_curve(curves) -> np.ndarray:
    """The per-order maximum of the candidates' RDP curves: one ε(λ) that bounds every candidate."""
    curves = [np.asarray(c, dtype=float) for c in curves]
    if not curves:
        raise ValueError("curves: at least one candidate curve is needed")
    return np.max(np.stack(curves), axis=0)


def solve_base(
    target_epsilon: float,
    delta: float,
    dist: KDistribution,
    curve_of,
    lo: float,
    hi: float,
    xtol: float,
    orders=rdp.DEFAULT_ORDERS,
    conversion: str = "improved",
) -> float:
    """Largest x in [lo, hi] (to within xtol) whose tuned release meets the target: bisection on
    ``selection_epsilon(curve_of(x)) <= target_epsilon``, ``curve_of`` non-decreasing in x. The x
    returned always meets the target (the bracket's low end is kept feasible)."""
    target, delta = check_epsilon(target_epsilon, "target_epsilon"), check_delta(delta)
    if not (_positive(xtol) and _real(lo) and _real(hi) and lo < hi):
        raise ValueError(f"need lo < hi and xtol > 0, got lo={lo!r}, hi={hi!r}, xtol={xtol!r}")
    total = lambda x: selection_epsilon(orders, curve_of(x), dist, delta, conversion)[0]
    if total(lo) > target:
        raise ValueError(
            f"target_epsilon={target_epsilon!r} is not reachable: the tuned release at the "
            f"smallest base budget {lo:g} already spends {total(lo):.4g}"
        )
    if total(hi) <= target:
        return float(hi)
    while hi - lo > xtol:
        mid = 0.5 * (lo + hi)
        lo, hi = (mid, hi) if total(mid) <= target else (lo, mid)
    return float(lo)


def score_rdp(score_sigma: float | None, orders=rdp.DEFAULT_ORDERS) -> np.ndarray:
    """RDP of the candidate's score: the count of correct validation predictions (sensitivity 1)
    plus N(0, score_sigma²), the Gaussian mechanism's α/(2σ²) (Mironov 2017, Prop. 7);
    0 without noise."""
    a = np.asarray(orders, dtype=float)
    return np.zeros_like(a) if score_sigma is None else a / (2.0 * float(score_sigma) ** 2)


def plan_sigmas(
    candidates,
    target_epsilon: float,
    delta: float,
    dist: KDistribution,
    xtol: float,
    score_sigma: float | None = None,
    convention: str = "joint",
):
    """σ_i for each candidate (q_i, lots_i, groups_i) so that the tuned release spends at most
    ``target_epsilon``: every candidate is calibrated (RDP accountant) to one base ε_b, and ε_b is
    the largest (:func:`solve_base`) whose base curve (max over the candidates, plus the score's
    RDP) passes through the theorem within the target. Returns (ε_b, [σ_i], base curve, (ε, λ*))."""
    cands = [(check_q(q), check_steps(n, "lots"), check_groups(k)) for q, n, k in candidates]
    if not cands:
        raise ValueError("candidates: at least one candidate is needed")
    orders = rdp.DEFAULT_ORDERS
    extra = score_rdp(score_sigma, orders)

    def sigmas(eps_b):
        return [
            calibrate.sigma_for_epsilon(eps_b, delta, q, n, "rdp", k, convention, rtol=1e-4)
            for q, n, k in cands
        ]

    def curve_of(eps_b):
        return (
            base_curve(
                [
                    candidate_curve(q, s, n, k, convention)
                    for (q, n, k), s in zip(cands, sigmas(eps_b))
                ]
            )
            + extra
        )

    eps_b = solve_base(
        target_epsilon, delta, dist, curve_of, 1e-3, float(target_epsilon), xtol, orders
    )
    curve = curve_of(eps_b)
    return eps_b, sigmas(eps_b), curve, selection_epsilon(orders, curve, dist, delta)


def candidate_curve(q: float, sigma: float, lots: int, groups: int = 1, convention: str = "joint"):
    """RDP curve (default orders) of ``lots`` lots (q, σ) with ``groups`` clipped tensors."""
    from .compose import charge

    q, s, per = charge(q, sigma, groups, convention)
    return lots * per * rdp.rdp_curve(q, s, rdp.DEFAULT_ORDERS)
