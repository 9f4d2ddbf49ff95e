"""A *lower* bound on ε for shuffled fixed-size lots: what no amplification claim may fall below.

Chua, Ghazi, Kamath, Kumar, Manurangsi, Sinha & Zhang 2024, "How Private are DP-SGD
Implementations?" (ICML 2024, arXiv 2403.17673), §4 (lower bound for the shuffle batch sampler,
ABLQ_S): one epoch of T shuffled lots on a pair of replace-one neighbours is post-processed to the
slice of max_t y_t it falls in (their "cube" sets), each slice's privacy loss rounded *down* to
the grid h; E epochs compose by FFT (``truncated.compose_pmfs``). The result ε_lower satisfies
δ_true(ε) >= δ_lower(ε) > δ for every ε < ε_lower, so the true ε of the shuffled run is
>= ε_lower.

The upper bound of the same run is one Gaussian mechanism per epoch at σ/2 (sensitivity 2C under
replace-one, no amplification); ``sampling.ShuffleSampler`` charges it.

Details (the pair and the slices): docs/ACCOUNTING.md,
"dpsgd/accountant/privacy_loss/shuffle_lower.py".
"""

from __future__ import annotations

import math
from functools import lru_cache

import numpy as np
from scipy import special

from ..limits import check_delta, check_sigma, check_steps
from .truncated import _epsilon, compose_pmfs

INTERVAL = 1e-4  # h: loss grid (each epoch's loss is rounded down by < h)
_LOG_TRUNC = -40.0  # log of the P-mass left outside the slices (dropped: optimistic)
_UPPER, _LOWER = 2.0, 1.0  # the pair's shifts (Chua et al. 2024)


def _log_in_cube(caps, mean, sigma, T):
    return special.log_ndtr((caps - mean) / sigma) + (T - 1) * special.log_ndtr(caps / sigma)


@lru_cache(maxsize=32)
def epoch_pmf(sigma: float, T: int, epochs: int, h: float = INTERVAL):
    """(i_lo, probs, 0.0): the rounded-down discrete PLD of one epoch's max-statistic slices."""
    log_tr = _LOG_TRUNC - math.log(2.0 * epochs)
    lo_cap = sigma * float(special.ndtri(math.exp(log_tr / T)))
    hi_cap = _UPPER + sigma * float(-special.ndtri(-math.expm1(math.log1p(-math.exp(log_tr)) / T)))
    caps = np.arange(lo_cap, hi_cap + h * sigma * sigma, h * sigma * sigma)
    lp = _log_in_cube(caps, _UPPER, sigma, T)
    lq = _log_in_cube(caps, _LOWER, sigma, T)
    with np.errstate(divide="ignore", invalid="ignore"):
        lps = lp[:-1] + np.log(np.expm1(lp[1:] - lp[:-1]))
        lqs = lq[:-1] + np.log(np.expm1(lq[1:] - lq[:-1]))
    p_out, q_out = -math.expm1(lp[-1]), -math.expm1(lq[-1])
    masses = np.concatenate([[math.exp(lp[0])], np.exp(lps), [p_out]])
    losses = np.concatenate([[lp[0] - lq[0]], lps - lqs, [math.log(p_out) - math.log(q_out)]])
    keep = (masses > 0) & np.isfinite(losses)
    idx = np.floor(losses[keep] / h).astype(np.int64)  # rounded down: optimistic
    i_lo = int(idx.min())
    probs = np.bincount(idx - i_lo, weights=masses[keep])
    probs.setflags(write=False)
    return i_lo, probs, 0.0


def epsilon_lower(
    sigma: float, lots_per_epoch: int, epochs: int, delta: float, h: float = INTERVAL
) -> float:
    """Lower bound on ε(δ) of ``epochs`` epochs of ``lots_per_epoch`` shuffled lots at noise σ
    (replace-one adjacency): any valid ε of such a run is at least this."""
    sigma, delta = check_sigma(sigma), check_delta(delta)
    T, E = check_steps(lots_per_epoch, "lots_per_epoch"), check_steps(epochs, "epochs")
    if T < 1 or E < 1:
        return 0.0
    pmf = epoch_pmf(sigma, T, E, h)
    out = compose_pmfs([(pmf, E)], h)
    if out is None:
        raise ValueError("shuffle_lower: the composed loss needs too many grid points; not served")
    loss, c, _, below, _ = out
    # lower bound: nothing above the window is counted, the aliased mass below is subtracted
    return _epsilon(loss, c, -below, delta) if below < delta else 0.0
