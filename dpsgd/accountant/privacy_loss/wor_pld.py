"""PLD of the Gaussian mechanism on fixed-size lots (sampling without replacement), replace-one adjacency.

A lot is a uniformly random subset of exactly L of the N examples (γ = L/N); neighbouring datasets
differ by replacing one example. On a given lot the noisy sum Σ clip(g_i) + N(0, σ²C²) moves by at
most 2C when one example is replaced, so the lot's mechanism is f-DP with f = G_{2/σ} = T(N(0, s²),
N(1, s²)), s = σ/2 (Dong, Roth & Su 2022, "Gaussian differential privacy", Sec. 2; sensitivity 2C,
noise σC).

Subsampling without replacement under replace-one (Dong, Roth & Su 2022, **Theorem 9**, the operator
C_γ; Zhu, Dong & Wang 2022, "Optimal accounting of differential privacy via characteristic function",
Sec. 5, the dominating pair for sampling without replacement): each lot is C_γ(f)-DP,

    C_γ(f) = min{f_γ, f_γ^{-1}}^{**},   f_γ = γ f + (1 − γ) Id = T(N(0, s²), (1 − γ) N(0, s²) + γ N(1, s²)),

so f_γ is the *add* pair of the Poisson-subsampled Gaussian at rate γ and noise s, f_γ^{-1} its
*remove* pair (``pld.py``'s two directions). A convex conjugate turns the minimum of trade-off
functions into the maximum of privacy profiles, and the double conjugate does not change it:

    δ_lot(ε) = max(δ_remove(ε), δ_add(ε))   for every ε in R (negative ε too).

This one symmetric pair, not the two directions composed separately, is what survives composition
(Lebeda, Regehr, Kamath & Steinke 2024, "Avoiding pitfalls for privacy accounting of subsampled
mechanisms under composition": under substitution a run can look like "remove" at one lot and like
"add" at the next, so max(δ_remove^{⊗T}, δ_add^{⊗T}) is not an upper bound; f-DP composition of C_γ(f)
is, Dong, Roth & Su 2022, Thm 4).

Discrete pair (connect the dots, Doroshenko et al. 2022): the two directions are first discretised
pessimistically on the grid ε_i = i·h (``pld_lot._step_pmf`` at (γ, s)); the hull's Neyman–Pearson
curve is replaced by the envelope of the lines y = δ*_i + e^{ε_i} x, δ*_i = max(δ_remove(ε_i),
δ_add(ε_i)) of the two discrete pmfs, each line above the hull's curve, so the envelope is a
dominating pair. Its PLD: mass e^{ε_i}·(x_{i−1,i} − x_{i,i+1}) at ε_i, where x_{i,i+1} is where lines i
and i+1 cross (inside a run of grid points where the same direction is the larger, x_{i,i+1} is that
direction's Q-mass at losses >= ε_{i+1}, so the mass is that direction's own, without cancellation);
an ∞ atom of mass δ* at the top grid point. Crossings are made monotone by raising them (a higher
curve, pessimistic). The pair is symmetric, the same in both directions. Lots compose by FFT with
the other lots of the run (``truncated.epsilon_for_releases``, release ("wor", γ, σ); Chernoff window,
mass above it into δ, aliasing upwards), δ >= 1e-12; ``truncated.fixed_size_epsilon`` for lots alone.
"""

from __future__ import annotations

import math
from functools import lru_cache

import numpy as np

from ..limits import check_q, check_sigma
from .pld_lot import _step_pmf


def _on_grid(i_lo: int, probs: np.ndarray, lo: int, n: int) -> np.ndarray:
    out = np.zeros(n)
    out[i_lo - lo : i_lo - lo + probs.size] = probs
    return out


@lru_cache(maxsize=32)
def lot_pmf(gamma: float, sigma: float, h: float):
    """(i_lo, probs over ε_i = i·h, p_inf) of one fixed-size lot (γ = L/N, noise multiplier σ), the
    symmetric dominating pair of the module doc."""
    gamma, sigma = check_q(gamma, "gamma"), check_sigma(sigma)
    s = sigma / 2.0  # sensitivity 2C, noise σC
    rm, ad = _step_pmf(gamma, s, h, "remove")[:3], _step_pmf(gamma, s, h, "add")[:3]
    lo = min(rm[0], ad[0])
    n = max(rm[0] + rm[1].size, ad[0] + ad[1].size) - lo
    loss = (lo + np.arange(n)) * h
    deltas, qtails = [], []
    for i_lo, probs, p_inf in (rm, ad):
        w = _on_grid(i_lo, probs, lo, n)
        with np.errstate(over="ignore", under="ignore"):
            qm = w * np.exp(-loss)  # Q-masses of the discrete pair
        qtail = np.cumsum(qm[::-1])[::-1]  # Σ_{k>=i} ω_k e^{−ε_k}
        ptail = np.cumsum(w[::-1])[::-1]  # Σ_{k>=i} ω_k
        above_p = np.append(ptail[1:], 0.0)  # losses > ε_i
        above_q = np.append(qtail[1:], 0.0)
        with np.errstate(over="ignore", invalid="ignore"):
            d = (
                p_inf + above_p - np.exp(loss) * above_q
            )  # δ(ε_i) = Σ_{ε_k>ε_i} ω_k(1 − e^{ε_i−ε_k}) + p_inf
        d = np.where(above_q > 0, d, p_inf + above_p)
        deltas.append(np.clip(d, p_inf, 1.0))
        qtails.append(qtail)
    use_rm = deltas[0] >= deltas[1]
    dstar = np.where(use_rm, deltas[0], deltas[1])
    # crossing of lines i and i+1: that direction's Q-tail where both are the same direction, else solved
    same = use_rm[:-1] == use_rm[1:]
    tail_next = np.where(use_rm[1:], qtails[0][1:], qtails[1][1:])
    solved = (dstar[:-1] - dstar[1:]) / (np.exp(loss[1:]) - np.exp(loss[:-1]))
    x = np.where(same, tail_next, solved)
    x = np.maximum.accumulate(np.maximum(x, 0.0)[::-1])[
        ::-1
    ]  # non-increasing in i: raised, pessimistic
    p_inf = float(dstar[-1])
    probs = np.empty(n)
    probs[1:-1] = np.exp(loss[1:-1]) * (x[:-1] - x[1:])
    probs[-1] = np.exp(loss[-1]) * x[-1]
    probs[0] = max(0.0, 1.0 - p_inf - float(probs[1:].sum()))  # the lowest line runs until P-mass 1
    probs = np.maximum(probs, 0.0)
    probs.setflags(write=False)
    return lo, probs, p_inf
