"""PLD of the Gaussian mechanism on fixed-size lots (sampling without replacement), replace-one.

A lot is a uniformly random subset of exactly L of the N examples (γ = L/N); neighbouring datasets
differ by replacing one example (sensitivity 2C, noise σC: s = σ/2 per unit). Each lot is
C_γ(f)-DP (Dong, Roth & Su 2022, **Theorem 9**; Zhu, Dong & Wang 2022, Sec. 5), whose privacy
profile is max(δ_remove(ε), δ_add(ε)) of the Poisson-subsampled Gaussian at (γ, s). This one
symmetric pair, not the two directions composed separately, is what survives composition (Lebeda,
Regehr, Kamath & Steinke 2024).

The two directions are discretised pessimistically (``pld_lot._step_pmf`` at (γ, s)) and replaced
by the envelope of their lines, a dominating symmetric pair. Lots compose by FFT with the other
lots of the run (``truncated.epsilon_for_releases``, release ("wor", γ, σ)), δ >= 1e-12;
``truncated.fixed_size_epsilon`` for lots alone.

Details (the operator C_γ, the discrete pair): docs/ACCOUNTING.md,
"dpsgd/accountant/privacy_loss/wor_pld.py".
"""

from __future__ import annotations

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
    # crossing of lines i and i+1: that direction's Q-tail where both are the same direction,
    # else solved
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
