"""The order-statistics one-run bound of Xiang, Wang, Xiao, Tian & Wang ("Tight Privacy Audit in
One Run", arXiv 2509.08704): the number of mistakes among the r most confident released guesses,
against its exact law under a null channel (docs/AUDIT_MATH.md §5).

A null channel (``Profile``) is a pair (P, Q) held as its log-likelihood ratio L on a grid; the law
of the mistakes (their Theorem 2) is P[T <= u] = E_W[BinCDF(u; r, γ̄(W))], W ~ Beta(m − r, r + 1),
bounded from above by ``tail_probability``. ``channel`` is the claimed mechanism's: the T-fold
composition of the Poisson-subsampled Gaussian, the law of the summed per-lot LLR. The test of the
claim (``order_stats_test``) releases the r largest |score| for each r of ``RELEASE_FRACTIONS``,
each at β/|grid|; σ_ub and ε_lb come from the family test's σ′ search (``family.search_sigma``).

It assumes, beyond the family test, that canaries are independent (each its own copy of the
per-canary channel, as in ``simulate.py``). In a real run the canaries share lots, the noise-scale
estimate and the other examples' gradients; the bound is then labelled a heuristic.

Details: docs/AUDIT_MATH.md, "dpsgd/audit/onerun/stats/order_stats.py".
"""

from __future__ import annotations

import math
from functools import lru_cache

import numpy as np
from scipy import special, stats

from .bounds import check_scores
from .family import Claim, search_sigma

BINS = 1 << 14  # equal-probability bins of the cut's Beta law (p-value at most 1/BINS high)
Z_SPAN = 12.0  # one lot's z grid: [−Z_SPAN, μ + Z_SPAN]
Z_POINTS = 200_000
H_DIV = 2000  # the L grid's spacing: the composed L's smaller sd / H_DIV
WINDOW_SD = 40.0  # the composed L is kept within its means ∓ this many sd
FFT_MAX = 1 << 22
RELEASE_FRACTIONS = (0.005, 0.01, 0.02, 0.05, 0.1, 0.2, 0.5, 1.0)  # r/m of the pre-declared grid


class Profile:
    """The (confidence, error) law of one bit through a channel (module doc):
    from L and its mixture mass."""

    def __init__(self, log_lr, mass):
        a = np.abs(np.asarray(log_lr, dtype=float))
        mass = np.asarray(mass, dtype=float)
        keep = mass > 0
        a, mass = a[keep], mass[keep] / mass[keep].sum()
        gamma = special.expit(-a)  # 1/(1 + e^{|L|}), no overflow
        order = np.argsort(-gamma, kind="stable")  # falling error = rising confidence
        self.gamma, self.mass = gamma[order], mass[order]
        self.w_hi = np.cumsum(self.mass)
        err = self.gamma * self.mass
        self.G_above = err[::-1].cumsum()[::-1] - err  # error mass strictly above each entry
        self.e_opt = float(err.sum())  # the optimal single-bit error, E[γ]

    def gammabar(self, w):
        """γ̄(w): the mean error rate above quantile w (exact inside an entry's band)."""
        w = np.asarray(w, dtype=float)
        j = np.clip(np.searchsorted(self.w_hi, w, side="right"), 0, len(self.gamma) - 1)
        g = self.gamma[j] * np.maximum(self.w_hi[j] - w, 0.0) + self.G_above[j]
        return np.where(w < 1.0, g / np.maximum(1.0 - w, np.finfo(float).tiny), 0.0)


def tail_probability(profile: Profile, u: int, r: int, m: int, bins: int = BINS) -> float:
    """P[T <= u] for r released guesses among m canaries (module doc), from above."""
    if not 0 <= u <= r <= m:
        raise ValueError(f"need 0 <= u <= r <= m, got u={u}, r={r}, m={m}")
    if r == m:
        return float(stats.binom.cdf(u, m, profile.e_opt))
    w = stats.beta.ppf(
        np.arange(1, bins + 1) / bins, m - r, r + 1
    )  # each bin's upper end (the last: 1)
    return float(min(1.0, np.mean(stats.binom.cdf(u, r, np.clip(profile.gammabar(w), 0.0, 1.0)))))


def _split(values, masses, base, h, n):
    """Masses at ``values`` split between the two neighbouring points base + k·h
    (mean kept exactly)."""
    x = (values - base) / h
    k = np.floor(x).astype(np.int64)
    frac = x - k
    out = np.bincount(k, masses * (1 - frac), minlength=n + 2)
    out += np.bincount(k + 1, masses * frac, minlength=n + 2)
    return out


def channel(q: float, mu: float, steps: int) -> tuple[np.ndarray, np.ndarray]:
    """(L, mixture mass) of ``steps`` lots of the Poisson-subsampled Gaussian at q and μ
    (module doc)."""
    edges = np.linspace(-Z_SPAN, mu + Z_SPAN, Z_POINTS + 1)
    z, dz = 0.5 * (edges[:-1] + edges[1:]), edges[1] - edges[0]
    log_out = math.log1p(-q) if q < 1 else -math.inf
    ell = np.logaddexp(log_out, math.log(q) + mu * z - mu * mu / 2)
    p_step = stats.norm.pdf(z) * dz
    q_step = ((1 - q) * stats.norm.pdf(z) + q * stats.norm.pdf(z - mu)) * dz
    p_step, q_step = p_step / p_step.sum(), q_step / q_step.sum()
    if steps == 1:  # one lot: the z grid itself, no L grid
        return ell, 0.5 * (p_step + q_step)
    moments = [(float(w @ ell), float(w @ ell**2) - float(w @ ell) ** 2) for w in (p_step, q_step)]
    sd = min(math.sqrt(max(v, 1e-300) * steps) for _, v in moments)
    lo = max(
        steps * moments[0][0] - WINDOW_SD * math.sqrt(steps * moments[0][1]),
        steps * float(ell.min()),
    )
    hi = min(
        steps * moments[1][0] + WINDOW_SD * math.sqrt(steps * moments[1][1]),
        steps * float(ell.max()),
    )
    width = max(hi - lo, float(ell.max() - ell.min())) * 1.05
    h = sd / H_DIV
    n = 1 << max(10, math.ceil(math.log2(width / h + 4)))
    if n > FFT_MAX:
        n, h = FFT_MAX, width / (FFT_MAX - 4)
    base = math.floor(float(ell.min()) / h) * h
    k0 = math.floor((lo - steps * base) / h)  # composed index k ↔ L = steps·base + k·h
    j = np.arange(n)
    k = k0 + np.mod(j - k0, n)
    out = []
    for w in (p_step, q_step):
        pmf = _split(ell, w, base, h, n)
        if len(pmf) > n:  # the top of one lot's range, folded (never reached)
            pmf[: len(pmf) - n] += pmf[n:]
            pmf = pmf[:n]
        comp = np.fft.irfft(np.fft.rfft(pmf, n) ** steps, n)
        out.append(np.clip(comp, 0.0, None))
    values = steps * base + k * h
    p_mass, q_mass = out[0] / out[0].sum(), out[1] / out[1].sum()
    return values, 0.5 * (p_mass + q_mass)


@lru_cache(maxsize=8)
def _profile(q: float, mu: float, steps: int) -> Profile:
    return Profile(*channel(q, mu, steps))


def claim_profile(claim: Claim, sigma: float) -> Profile:
    """The profile of the claimed mechanism at noise σ (cached: a σ′ search and repeated games reuse
    it)."""
    return _profile(claim.q, 1.0 / claim.sigma_eff(sigma), claim.steps)


def rejects(scores, bits, claim: Claim, beta: float, sigma: float | None = None) -> bool:
    """H₀(σ′) (default: the claimed σ) rejected at level β by the order-statistics test on these
    scores."""
    s, b = check_scores(scores, bits)
    rows = mistakes(s, b, release_grid(s.size))
    prof = claim_profile(claim, claim.sigma if sigma is None else sigma)
    return any(
        tail_probability(prof, row["mistakes"], row["released"], s.size) <= beta / len(rows)
        for row in rows
    )


def release_grid(m: int) -> list[int]:
    """The pre-declared release counts r for m canaries: round(f·m) for f in RELEASE_FRACTIONS
    (>= 1, distinct)."""
    return sorted({min(m, max(1, round(f * m))) for f in RELEASE_FRACTIONS})


def mistakes(scores, bits, grid) -> list[dict]:
    """For each r of ``grid``: the guesses "in" iff score > 0 on the r largest |score| (ties: lower
    index), {"released": r, "mistakes": u}."""
    order = np.lexsort((np.arange(len(scores)), -np.abs(scores)))
    wrong = ((scores > 0).astype(int) != np.asarray(bits, dtype=int))[order]
    cum = np.concatenate([[0], np.cumsum(wrong)])
    return [{"released": r, "mistakes": int(cum[r])} for r in grid]


def order_stats_test(scores, bits, claim: Claim, beta: float = 0.05) -> dict:
    """The order-statistics test of the claim and its ε_lb (module doc): {"claim_rejected",
    "verdict", "sigma_upper_bound", "at_search_floor", "eps_lower_bound", "eps_claimed", "m",
    "beta", "beta_per_point", "grid"}."""
    s, b = check_scores(scores, bits)
    m = s.size
    rows = mistakes(s, b, release_grid(m))
    per = beta / len(rows)

    def rejected_at(sigma):
        prof = claim_profile(claim, sigma)
        return any(
            tail_probability(prof, row["mistakes"], row["released"], m) <= per for row in rows
        )

    rejected, hi, at_floor = search_sigma(claim, rejected_at)
    return {
        "method": "order_stats",
        "claim_rejected": rejected,
        "verdict": "violation" if rejected else "consistent",
        "sigma_upper_bound": hi,
        "at_search_floor": at_floor,
        "eps_lower_bound": 0.0 if hi is None else claim.epsilon(hi),
        "eps_claimed": claim.epsilon(),
        "m": m,
        "beta": beta,
        "beta_per_point": per,
        "grid": rows,
    }


def mu_lower_bound(
    u: int,
    r: int,
    m: int,
    beta: float,
    q: float = 1.0,
    lo: float = 0.01,
    hi: float = 32.0,
    iters: int = 40,
) -> float:
    """The largest μ whose single-release channel (q = 1: μ-GDP; q < 1: one Poisson-subsampled
    Gaussian lot) is rejected at level β by u mistakes among r released of m (bisection;
    0 when μ = lo is not rejected)."""

    def p(mu):
        return tail_probability(Profile(*channel(q, mu, 1)), u, r, m)

    if p(lo) > beta:
        return 0.0
    if p(hi) <= beta:
        return hi
    for _ in range(iters):
        mid = 0.5 * (lo + hi)
        lo, hi = (mid, hi) if p(mid) <= beta else (lo, mid)
    return lo
