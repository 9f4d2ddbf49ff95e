"""The idealised one-run game, simulated directly (no training): what ``audit run``'s white-box game
would see if the run were exactly its claimed mechanism, or a broken variant of it.

One game: m canaries, canary i in with probability 1/2 (bit S_i); T lots; in each lot an included
canary is present with probability q (Poisson sampling), and the released coordinate of canary i,
in units of the claimed noise std σ_eff·C (σ_eff = σ/√k, joint convention), is

    z_{t,i} = μ·[present] + ν·N(0, 1),     μ = 1/σ_eff,  ν = 1 for the claimed mechanism

(``observe.py``: a canary clipped to C in each of its k groups, read along u_i = Σ_g e_{c(g,i)}/√k,
shifts ⟨s_t, u_i⟩/(σC) by √k/σ = 1/σ_eff). ``noise_factor`` ν < 1 is the broken mechanism
"noise ν·σC" (ν = 1/2: noise σC/2).
The score is the one ``audit run`` writes (``observe.py``, ``audit.score=llr``): each lot's z and μ
are divided by the noise std measured across the m canaries (1.4826 × MAD), then

    s_i = Σ_t log(1 − q + q·exp(μ′ z′_{t,i} − μ′²/2))       (z′ = z/ŝ_t, μ′ = μ/ŝ_t)

the log-likelihood ratio of the claimed Poisson-subsampled Gaussian, summed over lots.
"""

from __future__ import annotations

import math

import numpy as np
from scipy import integrate

from .family import Claim, tradeoff
from .bounds import _p_value, default_grid, fdp_rejected, guess_counts
from .order_stats import rejects as order_stats_rejects

MAD_TO_SD = 1.4826  # σ = 1.4826 × MAD for a Gaussian (as observe.noise_scale)
CHUNK = 1 << 20  # z values drawn at a time


def game_scores(rng: np.random.Generator, m: int, claim: Claim, noise_factor: float = 1.0):
    """(scores, bits) of one idealised game of the claimed mechanism (``noise_factor`` = 1) or of
    the mechanism with noise ``noise_factor``·σC (module doc)."""
    bits = rng.integers(0, 2, m)
    mu = 1.0 / claim.sigma_eff(claim.sigma)
    log_out = math.log1p(-claim.q) if claim.q < 1 else -math.inf
    scores = np.zeros(m)
    per = max(1, CHUNK // m)
    for t0 in range(0, claim.steps, per):
        n = min(per, claim.steps - t0)
        present = (rng.random((n, m)) < claim.q) & (bits[None, :] == 1)
        z = mu * present + noise_factor * rng.standard_normal((n, m))
        med = np.median(z, axis=1, keepdims=True)
        scale = MAD_TO_SD * np.median(np.abs(z - med), axis=1, keepdims=True)
        scale = np.where(scale > 0, scale, 1.0)
        zs, ms = z / scale, mu / scale
        scores += np.logaddexp(log_out, math.log(claim.q) + ms * zs - ms**2 / 2).sum(axis=0)
    return scores, bits


def play(
    rng: np.random.Generator,
    m: int,
    claim: Claim,
    beta: float,
    noise_factor: float = 1.0,
    order_stats: bool = False,
) -> dict:
    """One game and the tests of the claim on it: ``family`` (H₀(σ) rejected, ``family.py``),
    ``steinke`` ((ε_claimed, δ)-DP rejected by the Steinke et al. p-value on the same grid at
    β/|grid|) and, with ``order_stats``, ``order_stats``
    (H₀(σ) rejected by ``order_stats.py`` on its own grid)."""
    scores, bits = game_scores(rng, m, claim, noise_factor)
    grid = default_grid(m)
    per = beta / len(grid)
    rows = guess_counts(scores, bits, grid)
    f = tradeoff(claim.q, claim.sigma_eff(claim.sigma), claim.steps)
    eps = claim.epsilon()
    out = {
        "family": any(fdp_rejected(f, r["guesses"], r["correct"], m, per) for r in rows),
        "steinke": any(
            _p_value(r["guesses"], r["correct"], m, eps, claim.delta) <= per for r in rows
        ),
    }
    if order_stats:
        out["order_stats"] = order_stats_rejects(scores, bits, claim, beta)
    return out


def llr_moments(claim: Claim) -> dict:
    """Mean and variance of the score under the claimed mechanism, per canary, with ŝ_t = 1: the sum
    of T i.i.d. terms ℓ(z) = log(1 − q + q·exp(μz − μ²/2)), z ~ N(0, 1) for an excluded canary and
    z ~ (1 − q)·N(0, 1) + q·N(μ, 1) for an included one (one-dimensional quadrature,
    scipy.integrate.quad). {"out": (mean, var), "in": (mean, var)} of the sum over the T lots."""
    q, mu = claim.q, 1.0 / claim.sigma_eff(claim.sigma)
    log_out = math.log1p(-q) if q < 1 else -math.inf

    def ell(z):
        return float(np.logaddexp(log_out, math.log(q) + mu * z - mu * mu / 2))

    def expect(g, shift):  # E[g(z)], z ~ N(shift, 1)
        f = lambda z: g(z) * math.exp(-((z - shift) ** 2) / 2) / math.sqrt(2 * math.pi)  # noqa: E731
        return integrate.quad(f, shift - 40, shift + 40, epsabs=0, epsrel=1e-10, limit=200)[0]

    m0, m1 = expect(ell, 0.0), expect(ell, mu)
    m_in = (1 - q) * m0 + q * m1
    v0 = expect(lambda z: (ell(z) - m0) ** 2, 0.0)  # central moments: no cancellation
    v_in = (1 - q) * expect(lambda z: (ell(z) - m_in) ** 2, 0.0) + q * expect(
        lambda z: (ell(z) - m_in) ** 2, mu
    )
    t = claim.steps
    return {"out": (t * m0, t * v0), "in": (t * m_in, t * v_in)}
