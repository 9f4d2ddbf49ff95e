"""Tight accounting: the privacy loss distribution (PLD) of the Poisson-subsampled Gaussian.

Privacy loss of one lot (q, σ), add-or-remove adjacency (Koskela, Jälkö & Honkela 2020; Zhu, Dong &
Wang 2022), with μ0 = N(0, σ²), μ = (1 − q)·μ0 + q·N(1, σ²):

* remove: P = μ, Q = μ0,  L(z) = log(1 − q + q·exp((2z − 1)/(2σ²))) (increasing in z)
* add:    P = μ0, Q = μ,  L(z) = −log(1 − q + q·exp((2z − 1)/(2σ²))) (decreasing in z)

and δ(ε) = E_P[(1 − e^{ε − L})_+] (hockey-stick divergence); the composed guarantee is the
maximum over the two directions, each composed over all lots.

Discretisation ("connect the dots", Doroshenko, Ghazi, Kamath, Kumar & Manurangsi 2022, PETS):
on the grid ε_i = i·h the per-lot PLD is replaced by the discrete PLD whose privacy profile, as a
function of x = e^ε, linearly interpolates the exact profile at the grid points. The exact profile
is convex in x, so the interpolation dominates it: the discrete PLD is a *pessimistic* (dominating)
pair and every ε reported is an upper bound, with O(h²) error per lot instead of the O(h) of
rounding losses up. The probabilities are computed from exact Gaussian interval masses
(interval (ε_i, ε_{i+1}]: its Q-mass is split between the two end points so that the P-mass is
preserved), all terms non-negative; mass beyond the largest grid loss goes to an "infinite loss"
atom (added to δ) and mass below the smallest is moved up to it (pessimistic). Where the grid
reaches losses above 700 (σ ≲ 0.04), the products e^{ε_i}·Q(I_i) are formed in log space
(log-Gaussian interval masses), so no overflow can empty the pmf; so are those of intervals whose
Q-mass is below _Q_NORMAL = 1e-280 (near the subnormal range, where Q(I) loses its digits or
underflows to 0 while e^{ε_i}·Q(I) ≈ P(I) can still be ~δ: at σ = 0.035, q = 1 the P-mass of the
losses 660..690 was lost that way, and ε(1e-20) came out 668.12 against the exact 671.94). A
per-lot grid wider than STEP_POINTS points (tiny σ: the loss of one lot spans ~2·z/σ) doubles h
first. One lot alone is its own composition: no FFT, hence no round-off (below).

Composition by FFT: the per-lot pmf is placed on a cyclic grid of M points (index k at k mod M);
its FFT is cached and T lots are F^T followed by one inverse FFT. The window [a, a + M) is chosen
from Chernoff bounds on the composed loss (with the discrete pmf's own moment generating
function Λ(t), on a grid of t): the mass above the window, τ ≤ 1e-15 by construction, is added to
δ; mass below the window aliases into the window, where it can only be counted with a larger
weight, so aliasing never makes δ smaller. FFT round-off is clipped at zero; it grows with the
number of lots T (F^T multiplies each coefficient's relative error by T), and its estimate
``noise`` = T·eps·√M·‖c‖₂ (Parseval, M bins summed; 10^4..10^5 times the largest negative bin
seen) decides where this untilted composition answers (next paragraph). h starts at 1e-4 and
doubles only when the window would need more than 2^18 points (nested grids: a coarser h can
only increase ε), so ε is monotone in T (the exact discrete PLD's δ(ε) cannot fall when a lot is
added, since E[e^{−L}] <= 1 for each lot).

Tiny δ. Three things above are budgets in absolute probability — the per-lot tail STEP_TAIL, the
window tail WINDOW_TAIL, and the FFT round-off ``noise`` (~1e-13..1e-10 for 10^3..10^5 lots) — so
for small δ they, not the mechanism, would set ε (150 000 lots at q = 0.002, σ = 2: ε(1e-12) = 5.98
untilted, 2.835 tilted). The untilted composition therefore answers only where δ >= TILT_BELOW =
1e-12 *and* noise <= TAIL_FRACTION·δ (for ε queries; for δ queries, its own answer); otherwise:

* the per-lot tail is TAIL_FRACTION·δ / (total lots) (a power of ten), so the ∞ atom stays a
  1e-3 share of δ;
* the composition is computed under exponential tilting (Esscher transform): with θ the Chernoff
  optimum for this δ, each lot's pmf ω_i is replaced by ω_i·e^{θε_i − Λ(θ)} (a probability), the
  tilted pmfs are composed by FFT, and the composed pmf is untilted, c_k = c̃_k·e^{ΣnΛ(θ) − θℓ_k}.
  Tilting commutes with convolution, so this is the same composed PLD, but the FFT now resolves
  the region ℓ ≈ ε (the tilted mean) to ~1e-16 *relative* accuracy. The window is placed on the
  tilted pmf; its mass above the window (wrapped down by M·h, hence weighted e^{θMh} too much, and
  mass below it (weighted e^{−θMh}) only ever add to δ, and the window is made wide enough that
  both additions are below TAIL_FRACTION·δ; the untilted mass above the window is added to δ as
  before. If the answer falls below the window, the untilted result is returned instead;
* nothing is kept above the support's top (Σ n·largest per-lot loss with mass): there the
  composed pmf is exactly 0, so round-off and aliasing are dropped and the tail is 0 if the
  window reaches it;
* the interval excess P(I) − e^{ε_i} Q(I) is formed as q(G1 − G0) − (e^{ε_i} − 1)G0 (remove; the
  add direction likewise), not as the difference of two probabilities that agree to ~q/σ: for
  tiny q/σ that difference, ~1e-19, is itself below δ's scale and must not round to 0.

Both paths return upper bounds, so the switch between them moves ε by no more than their
discretisation (ε is continuous and monotone across δ = 1e-12). Where ε is below
~log(1/δ)/316 (the largest tilt on the t grid; 0.15 at δ = 1e-20) the tilt cannot reach the answer:
the untilted composition with δ-scaled tails answers, its round-off estimate added to δ, and ε can
be loose (an upper bound still; e.g. 0.027 for q = 1e-6, σ = 1, 100 lots, δ = 1e-20). The inversion
ε(δ) on one discrete PLD is rounded up: the ε returned satisfies δ(ε) <= δ in floating point too.
Off the ordinary path (tilted, or h already coarsened for tiny σ) h jumps straight to about the
needed coarseness instead of doubling one step at a time; a grid coarser than MAX_INTERVAL = 1
is refused (ValueError naming pld).
"""
from __future__ import annotations

import math
from functools import lru_cache

import numpy as np
from scipy import fft as sfft
from scipy import signal, special

from ._checks import check_delta, check_epsilon, check_q, check_sigma, check_steps

DEFAULT_INTERVAL = 1e-4          # h: spacing of the privacy-loss grid
MAX_POINTS = 1 << 18             # largest FFT grid before h is doubled
STEP_POINTS = 1 << 19            # largest per-lot grid before h is doubled (tiny σ)
STEP_TAIL = 1e-22                # per-lot P-mass left outside the per-lot grid (into the ∞ atom)
WINDOW_TAIL = 1e-15              # Chernoff bound on the composed mass above the FFT window
TILT_BELOW = 1e-12               # δ below this: δ-scaled tails and the tilted FFT (module doc)
TAIL_FRACTION = 1e-3             # tiny δ: share of δ allowed to each tail budget
_TILT_TAIL = 1e-30               # tiny δ: tilted mass outside the window (tightness only)
MAX_INTERVAL = 1.0               # coarser than this: refused (ValueError naming pld)
_LOG_EXP_MAX = 700.0             # above this loss, e^ε·Q is formed in log space
_EPS = float(np.finfo(float).eps)
_Q_NORMAL = 1e-280               # interval Q-masses below this: e^ε·Q in log space (near subnormal)
_T_GRID = np.concatenate([-np.logspace(-3, 2.5, 22)[::-1], np.logspace(-3, 2.5, 34)])
DIRECTIONS = ("remove", "add")


@lru_cache(maxsize=64)
def _z_tail(step_tail: float) -> float:
    return float(-special.ndtri(step_tail))


def _step_tail(delta: float, lots: int) -> float:
    """Per-lot tail mass of the tilted path: a power of ten <= TAIL_FRACTION·δ / lots and
    below STEP_TAIL (so that the tail also marks the tiny-δ pmfs and compositions: :func:`_tiny`)."""
    v = TAIL_FRACTION * delta / max(1, lots)
    return max(1e-300, min(STEP_TAIL / 10.0, 10.0 ** math.floor(math.log10(v))))


def _tiny(z_tail: float) -> bool:
    """Tiny-δ path (exact interval excess, support truncation): marked by its smaller tail."""
    return z_tail != _z_tail(STEP_TAIL)


def _gauss_mass(a, b, mean, sigma):
    """P(a < Z <= b) for Z ~ N(mean, σ²), accurate in both tails (a <= b elementwise)."""
    x, y = (a - mean) / sigma, (b - mean) / sigma
    upper = special.ndtr(-x) - special.ndtr(-y)
    lower = special.ndtr(y) - special.ndtr(x)
    return np.where(x > 0, upper, lower)


def _log_gauss_mass(a, b, mean, sigma):
    """log P(a < Z <= b) for Z ~ N(mean, σ²), no underflow (log-Φ differences)."""
    x, y = (np.asarray(a, float) - mean) / sigma, (np.asarray(b, float) - mean) / sigma
    with np.errstate(divide="ignore", invalid="ignore"):
        ux, uy = special.log_ndtr(-x), special.log_ndtr(-y)          # log Φ(−x) >= log Φ(−y)
        upper = ux + np.log(-np.expm1(uy - ux))
        lx, ly = special.log_ndtr(x), special.log_ndtr(y)
        lower = ly + np.log(-np.expm1(lx - ly))
    out = np.where(x > 0, upper, lower)
    return np.where(np.isnan(out), -np.inf, out)                      # empty interval


def _z_of_loss(eps, q, sigma):
    """Threshold z(ε) with L_remove(z) > ε ⇔ z > z(ε); −∞ where ε <= log(1 − q)."""
    eps = np.asarray(eps, dtype=float)
    with np.errstate(divide="ignore", invalid="ignore", over="ignore"):
        if q == 1.0:                                    # log(e^ε − 0) = ε exactly
            log_arg, ok = eps, np.isfinite(eps)
        elif q >= 0.5:
            # log(e^ε − r), r = 1 − q: log r + log(expm1(ε − log r)), no cancellation when e^ε ≪ 1
            lr = math.log1p(-q)
            d = eps - lr
            log_arg = np.where(d > _LOG_EXP_MAX, eps, lr + np.log(np.expm1(np.minimum(d, _LOG_EXP_MAX))))
            ok = d > 0
        else:
            arg = np.expm1(np.minimum(eps, _LOG_EXP_MAX)) + q    # e^ε − (1 − q)
            # for ε > 700, log(e^ε − (1 − q)) = ε to double precision (relative correction < e^−700)
            log_arg = np.where(eps > _LOG_EXP_MAX, eps, np.log(arg))
            ok = arg > 0
        z = sigma * sigma * (log_arg - math.log(q)) + 0.5
    return np.where(ok, z, -np.inf)


def _loss_remove(z, q, sigma):
    return np.logaddexp(math.log1p(-q) if q < 1 else -np.inf, math.log(q) + (2.0 * z - 1.0) / (2.0 * sigma * sigma))


def _mix_mass(a, b, q, sigma):
    return (1.0 - q) * _gauss_mass(a, b, 0.0, sigma) + q * _gauss_mass(a, b, 1.0, sigma)


def _log_mix_mass(a, b, q, sigma):
    l0 = _log_gauss_mass(a, b, 0.0, sigma) + (math.log1p(-q) if q < 1 else -np.inf)
    return np.logaddexp(l0, _log_gauss_mass(a, b, 1.0, sigma) + math.log(q))


def _loss_range(q: float, sigma: float, direction: str, z_tail: float):
    """Smallest and largest loss kept on one lot's grid (beyond: P-mass <= the per-lot tail)."""
    if direction == "remove":
        lo = math.log1p(-q) if q < 1 else float(_loss_remove(1.0 - z_tail * sigma, q, sigma))
        hi = float(_loss_remove(1.0 + z_tail * sigma, q, sigma))
    else:
        lo = -float(_loss_remove(z_tail * sigma, q, sigma))
        hi = -math.log1p(-q) if q < 1 else -float(_loss_remove(-z_tail * sigma, q, sigma))
    return lo, hi


@lru_cache(maxsize=64)
def _step_pmf(q: float, sigma: float, h: float, direction: str, z_tail: float = _z_tail(STEP_TAIL)):
    """Connect-the-dots discrete PLD of one lot: (i_lo, probs over ε_i = i·h, p_inf, lambda(t))."""
    lo, hi = _loss_range(q, sigma, direction, z_tail)
    i_lo, i_hi = math.floor(lo / h), math.ceil(hi / h)
    i_hi = max(i_hi, i_lo + 1)
    eps = np.arange(i_lo, i_hi + 1) * h                 # grid ε_0..ε_n
    if direction == "remove":
        t = _z_of_loss(eps, q, sigma)                   # L > ε ⇔ z > t (t increasing)
        a, b = t[:-1], t[1:]                            # interval (ε_i, ε_{i+1}] ⇔ z ∈ (t_i, t_{i+1}]
        p_int, q_int = _mix_mass(a, b, q, sigma), _gauss_mass(a, b, 0.0, sigma)
        p_below = float(_mix_mass(-np.inf, t[0], q, sigma))
        p_above = float(_mix_mass(t[-1], np.inf, q, sigma))
        q_above = float(_gauss_mass(t[-1], np.inf, 0.0, sigma))
        log_q = lambda lo_, hi_: _log_gauss_mass(lo_, hi_, 0.0, sigma)
    else:
        # L_add(z) = −L_remove(z) > ε ⇔ z < t = z(−ε) (t decreasing in ε); for ε >= −log(1−q)
        # no z has L > ε (threshold −∞)
        t = np.where(eps >= (-math.log1p(-q) if q < 1 else np.inf), -np.inf, _z_of_loss(-eps, q, sigma))
        a, b = t[1:], t[:-1]                            # interval (ε_i, ε_{i+1}] ⇔ z ∈ [t_{i+1}, t_i)
        p_int, q_int = _gauss_mass(a, b, 0.0, sigma), _mix_mass(a, b, q, sigma)
        p_below = float(_gauss_mass(t[0], np.inf, 0.0, sigma))
        p_above = float(_gauss_mass(-np.inf, t[-1], 0.0, sigma))
        q_above = float(_mix_mass(-np.inf, t[-1], q, sigma))
        log_q = lambda lo_, hi_: _log_mix_mass(lo_, hi_, q, sigma)
    em1 = math.expm1(h)
    top = (t[-1], np.inf) if direction == "remove" else (-np.inf, t[-1])
    # Q(I) below _Q_NORMAL (near or in the subnormal range, or underflowed to 0) has lost its
    # relative precision while x_i Q(I) ≈ P(I) may still matter (x_i up to e^700): there, and
    # wherever e^ε overflows, x_i Q(I_i) is formed in log space
    sub = (q_int < _Q_NORMAL) & (p_int > 0)
    if eps[-1] <= _LOG_EXP_MAX:
        x = np.exp(eps)
        B = x[:-1] * q_int                               # x_i Q(I_i)
        if sub.any():
            B[sub] = np.exp(eps[:-1][sub] + log_q(a[sub], b[sub]))
        xq_above = x[-1] * q_above if q_above >= _Q_NORMAL else float(np.exp(eps[-1] + log_q(*top)))
    else:                                                # e^ε overflows: x_i Q(I_i) in log space
        B = np.exp(eps[:-1] + log_q(a, b))
        xq_above = float(np.exp(eps[-1] + log_q(*top)))
    excess = p_int - B                                   # P(I_i) − x_i Q(I_i)
    if _tiny(z_tail) and eps[-1] <= _LOG_EXP_MAX:
        # tiny δ: the same difference without cancelling (1 − q)·G0 against x_i·G0, which loses
        # it entirely where q/σ is tiny (it is ~q/σ·G0, far below δ only for ordinary δ)
        g0, g1 = _gauss_mass(a, b, 0.0, sigma), _gauss_mass(a, b, 1.0, sigma)
        em = np.expm1(eps[:-1])
        exact = q * (g1 - g0) - em * g0 if direction == "remove" else q * x[:-1] * (g0 - g1) - em * g0
        excess = np.where(sub, excess, exact)           # (g0 imprecise where Q(I) is subnormal)
    D = np.clip(excess / em1, 0.0, B)                    # share moved to the right end point
    probs = np.zeros(eps.size)
    probs[:-1] += B - D
    probs[1:] += math.exp(h) * D
    probs[0] += p_below
    probs[-1] += xq_above
    p_inf = max(0.0, p_above - xq_above)
    # log moment generating function Λ(t) = log Σ ω_i e^{t ε_i} of the finite part on a grid of t
    # (for the Chernoff windows); exact, since composition multiplies it by the number of lots
    nz = probs > 0
    lp, e = np.log(probs[nz]), eps[nz]
    lam = np.empty(_T_GRID.size)
    for k, tt in enumerate(_T_GRID):
        v = lp + tt * e
        mx = v.max()
        lam[k] = mx + math.log(np.exp(v - mx).sum())
    probs.setflags(write=False)
    return i_lo, probs, p_inf, lam


@lru_cache(maxsize=48)
def _step_fft(q: float, sigma: float, h: float, direction: str, m: int, z_tail: float, k_theta: int = -1):
    """rfft (log-magnitude, phase) of one lot's pmf on the cyclic grid of m points; tilted by
    θ = _T_GRID[k_theta] (ω_i e^{θε_i − Λ(θ)}) when k_theta >= 0."""
    i_lo, probs, _, lam = _step_pmf(q, sigma, h, direction, z_tail)
    pos = i_lo + np.arange(probs.size)
    w = probs
    if k_theta >= 0:
        with np.errstate(divide="ignore"):
            w = np.exp(np.log(probs) + _T_GRID[k_theta] * (pos * h) - lam[k_theta])
    grid = np.bincount(pos % m, weights=w, minlength=m)
    f = sfft.rfft(grid)
    with np.errstate(divide="ignore"):
        return np.log(np.abs(f)), np.angle(f)


def _lot_interval(releases, direction, interval, z_tail):
    """h: ``interval`` doubled until every lot's grid has at most STEP_POINTS points."""
    h = interval
    for q, s, _ in releases:
        lo, hi = _loss_range(q, s, direction, z_tail)
        while (hi - lo) / h > STEP_POINTS:
            h *= 2.0
    return h


def _lam(releases, h, direction, z_tail):
    return sum(n * _step_pmf(q, s, h, direction, z_tail)[3] for q, s, n in releases)


def _window(releases, h, direction, z_tail=_z_tail(STEP_TAIL)):
    """Chernoff window [a, b] (grid indices) holding all but WINDOW_TAIL of the composed mass."""
    lam = _lam(releases, h, direction, z_tail)
    log_tau = math.log(WINDOW_TAIL)
    pos, neg = _T_GRID > 0, _T_GRID < 0
    b = float(np.min((lam[pos] - log_tau) / _T_GRID[pos]))
    a = float(np.max((lam[neg] - log_tau) / _T_GRID[neg]))
    return math.floor(a / h), max(math.ceil(b / h), 1), lam


def _theta_index(lam, delta=None, eps=None) -> int:
    """Grid index of the Chernoff-optimal tilt θ > 0 for δ (ε query) or for ε (δ query)."""
    ks = np.flatnonzero(_T_GRID > 0)[:-1]                # keep one larger t for the window
    t = _T_GRID[ks]
    vals = (lam[ks] - math.log(delta)) / t if delta is not None else lam[ks] - t * eps
    return int(ks[int(np.argmin(vals))])


def _support_top(releases, h, direction, z_tail) -> int:
    """Largest composed grid index with mass: Σ n·(largest index with mass of each lot's pmf)."""
    top = 0
    for q, s, n in releases:
        i_lo, probs, _, _ = _step_pmf(q, s, h, direction, z_tail)
        top += n * (i_lo + int(np.flatnonzero(probs)[-1]))
    return top


def _tilted_window(lam, k, h, log_eta, sup):
    """Window [a, b] (grid indices) for the pmf tilted by θ = _T_GRID[k] (module doc, tiny δ).

    a: tilted mass below <= _TILT_TAIL. b: tilted mass above <= _TILT_TAIL, and both aliasing
    terms below e^{log_eta}: e^{θ(b − a)}·P(ℓ > b) (Chernoff, s > θ) and e^{−θ(b − a)}; the first
    two are void above ``sup`` (the largest loss with mass), which caps them.
    """
    th, lt, log_tau = _T_GRID[k], lam[k], math.log(_TILT_TAIL)
    lo, hi = _T_GRID < th, _T_GRID > th
    a = float(np.max((lam[lo] - lt - log_tau) / (_T_GRID[lo] - th)))
    b1 = float(np.min((lam[hi] - lt - log_tau) / (_T_GRID[hi] - th)))
    b2 = float(np.min((lam[hi] - th * a - log_eta) / (_T_GRID[hi] - th)))
    b3 = a - log_eta / th
    return math.floor(a / h), max(math.ceil(max(min(max(b1, b2), sup), b3) / h), math.floor(a / h) + 1)


def _plan(releases, direction, interval, z_tail=_z_tail(STEP_TAIL), delta=None, eps=None):
    """(h, a, m, lam, k_theta): grid spacing, window start, FFT size, Λ totals, tilt index (−1: none)."""
    h = _lot_interval(releases, direction, interval, z_tail)
    ordinary = delta is None and eps is None and h == interval
    while True:
        if delta is None and eps is None:
            a, b, lam = _window(releases, h, direction, z_tail)
            k = -1
        else:
            lam = _lam(releases, h, direction, z_tail)
            k = _theta_index(lam, delta, eps)
            scale = delta if delta is not None else math.exp(min(0.0, lam[k] - _T_GRID[k] * eps))
            sup = _support_top(releases, h, direction, z_tail) * h
            a, b = _tilted_window(lam, k, h, math.log(TAIL_FRACTION * max(scale, 1e-300)), sup)
        if b - a + 1 <= MAX_POINTS:
            m = max(1 << 10, 1 << (b - a).bit_length())
            return h, a, m, lam, k
        # h doubles; off the ordinary path (tilted, or h already coarsened for a tiny σ) it jumps
        # to one doubling short of the estimated fit, to save recomputing the per-lot pmf
        jump = 0 if ordinary else (b - a + 1) // (2 * MAX_POINTS)
        h *= 2.0 ** max(1, jump.bit_length())
        if h > MAX_INTERVAL:
            raise ValueError(f"pld: the composed privacy loss spans more than {MAX_POINTS} grid points even at "
                             f"spacing h = {MAX_INTERVAL:g} (epsilon in the hundreds of thousands); not served")


def _fft_compose(releases, direction, h, a, m, z_tail, k):
    """Composed pmf (before clipping round-off at 0) on the window [a, a + m) by one FFT power, and
    the log of the composed finite mass (each lot keeps 1 − p_inf)."""
    logmag = np.zeros(m // 2 + 1)
    phase = np.zeros(m // 2 + 1)
    log_fin = 0.0
    for q, s, n in releases:
        lm, ph = _step_fft(q, s, h, direction, m, z_tail, k)
        logmag += n * lm
        phase += n * ph
        log_fin += n * math.log1p(-_step_pmf(q, s, h, direction, z_tail)[2])
    spec = np.zeros(m // 2 + 1, dtype=complex)
    keep = logmag > -745.0                               # the rest underflows to 0 anyway
    spec[keep] = np.exp(logmag[keep] + 1j * phase[keep])
    c = sfft.irfft(spec, n=m)
    return np.roll(c, -(a % m)), log_fin                 # c[j] ↔ loss (a + j)·h


class _Composed:
    """Composed discrete PLD of one direction on the window [a, a + m) (grid spacing h).

    ``delta`` (ε queries) or ``eps`` (δ queries) given: the tilted path for tiny δ (module doc).
    """

    def __init__(self, releases, direction, interval, z_tail=_z_tail(STEP_TAIL), delta=None, eps=None):
        lots = sum(n for _, _, n in releases)
        if lots == 1:                        # one lot: its pmf is the composition (no FFT, no tilt)
            q, s, _ = releases[0]
            h = _lot_interval(releases, direction, interval, z_tail)
            a, c, p_inf, lam = _step_pmf(q, s, h, direction, z_tail)
            m, k, c, log_fin, self.noise = c.size, -1, c.copy(), math.log1p(-p_inf), 0.0
        else:
            h, a, m, lam, k = _plan(releases, direction, interval, z_tail, delta, eps)
            c, log_fin = _fft_compose(releases, direction, h, a, m, z_tail, k)
            # round-off of F^T: log-magnitudes and phases multiplied by T give each coefficient a
            # relative error ~T·eps; through the inverse FFT (Parseval) ~T·eps·‖c‖₂/√m per bin, at
            # most m bins summed into δ. An estimate (observed: 10^4..10^5 times the largest
            # negative bin), which decides where the untilted composition is served (module doc)
            self.noise = float(lots * _EPS * math.sqrt(m) * np.linalg.norm(c))
        np.maximum(c, 0.0, out=c)                        # FFT round-off below zero
        top = a + m                                      # first index above the window
        tp = _T_GRID > 0
        self.tail = 0.0 if lots == 1 else float(min(1.0, np.exp(np.min(lam[tp] - _T_GRID[tp] * top * h))))
        if _tiny(z_tail):                                # tiny δ: nothing has loss above the support
            sup = _support_top(releases, h, direction, z_tail)
            if top > sup:
                self.tail = 0.0                          # no finite mass above the window
            c[max(0, sup + 1 - a):] = 0.0                # above it: FFT round-off and aliasing only
        self.inf_mass = float(-math.expm1(log_fin))
        self.base = max(a, 0)                           # c[i] ↔ loss (base + i)·h, all >= 0
        self.floor = a * h                               # answers below this: not served (tilted)
        self.tilted = k >= 0
        c = c[self.base - a:]
        if self.tilted:                                  # untilt: c = c̃ e^{ΣnΛ(θ) − θℓ}, <= 1
            with np.errstate(divide="ignore"):
                log_c = np.log(c) + lam[k] - _T_GRID[k] * ((self.base + np.arange(c.size)) * h)
            c = np.exp(np.minimum(log_c, 0.0))
        self.c = c
        self.h = h
        # S[i] = Σ_{k>=i} c_k ;  R[i] = Σ_{k>i} c_k e^{(i−k)h}
        self.S = np.cumsum(self.c[::-1])[::-1]
        n = self.c.size
        if (self.base + n) * h < 600.0 and not self.tilted:   # scaled suffix sums (no overflow)
            w = self.c * np.exp(-(np.arange(n) * h))
            suffix = np.cumsum(w[::-1])[::-1]            # Σ_{k>=i} c_k e^{−(k)h}
            self.R = np.append(suffix[1:], 0.0) * np.exp(np.arange(n) * h)
        else:                                            # stable backward recursion
            u = np.concatenate([[0.0], self.c[::-1][:-1]])
            r = math.exp(-h)
            self.R = signal.lfilter([r], [1.0, -r], u)[::-1]
        self.extra = self.tail + self.inf_mass

    def _loss(self, i):
        return (self.base + i) * self.h

    def _delta_above(self, eps: float, k: int) -> float:
        """Σ_{i>=k} c_i (1 − e^{ε−ℓ_i}), valid when ℓ_{k−1} <= ε <= ℓ_k."""
        return self.S[k] - math.exp(eps - self._loss(k)) * (self.c[k] + self.R[k])

    def delta(self, eps: float) -> float:
        """δ(ε) = Σ_{ℓ>ε} c_ℓ (1 − e^{ε−ℓ}) + tail + ∞-mass (an upper bound)."""
        k = max(0, math.floor(eps / self.h) - self.base + 1)   # first index with loss > ε
        if k >= self.c.size:
            return min(1.0, self.extra)
        return float(min(1.0, max(0.0, self._delta_above(eps, k)) + self.extra))

    def epsilon(self, delta: float) -> float:
        target = delta - self.extra
        if target <= 0:
            return math.inf
        if self.delta(0.0) - self.extra <= target:
            return 0.0
        d_grid = np.append(self.S[1:] - self.R[:-1], 0.0)   # δ at ε = ℓ_i (without extra)
        k = int(np.argmax(d_grid <= target))                 # first grid loss meeting the target
        # on [ℓ_{k−1}, ℓ_k] (or [0, ℓ_0]): δ(ε) = S[k] − e^{ε−ℓ_k}(c_k + R_k), solve for ε
        lo = max(0.0, self._loss(k - 1)) if k > 0 else 0.0
        hi = self._loss(k)
        num, den = self.S[k] - target, self.c[k] + self.R[k]
        if den <= 0 or num <= 0:
            return hi
        eps = float(min(hi, max(lo, hi + math.log(num / den))))
        # rounded up (pessimistic): the returned ε meets δ(ε) <= δ on this same discrete PLD, not
        # only in exact arithmetic (at worst hi, where δ(ℓ_k) <= δ holds by the choice of k)
        for i in range(8):                   # steps of 4·ulp, growing fourfold
            if eps >= hi or self.delta(eps) <= delta:
                return eps
            eps = min(hi, eps + 4.0 * (math.ulp(eps) + math.ulp(hi)) * 4 ** i)
        return hi


def _normalise(releases):
    merged: dict = {}
    for q, s, n in releases:
        q, s, n = check_q(q), check_sigma(s), check_steps(n)
        if n:
            merged[(q, s)] = merged.get((q, s), 0) + n
    return tuple((q, s, n) for (q, s), n in sorted(merged.items()))


def compose(releases, interval: float = DEFAULT_INTERVAL):
    """Composed PLDs (remove, add) of heterogeneous releases [(q, σ, count), ...]; None if empty.

    The untilted composition (δ >= TILT_BELOW); :func:`epsilon_for_releases` and
    :func:`delta_for_releases` switch to the tilted one for tiny δ.
    """
    rel = _normalise(releases)
    if not rel:
        return None
    return tuple(_Composed(rel, d, float(interval)) for d in DIRECTIONS)


def _serves(comp, delta: float) -> bool:
    """The untilted composition answers at δ: δ >= TILT_BELOW and its FFT round-off estimate is
    within the TAIL_FRACTION share of δ (long compositions: T·eps grows with the lots)."""
    return delta >= TILT_BELOW and comp.noise <= TAIL_FRACTION * delta


def _epsilon_tiny(rel, direction, interval, delta):
    """ε(δ) of one direction where the untilted composition does not serve δ: δ-scaled tails,
    tilted at the Chernoff θ for δ."""
    z_tail = _z_tail(_step_tail(delta, sum(n for _, _, n in rel)))
    comp = _Composed(rel, direction, interval, z_tail, delta=delta)
    eps = comp.epsilon(delta)
    if eps < comp.floor:                      # answer below the tilted window: not resolved there;
        comp = _Composed(rel, direction, interval, z_tail)    # untilted, its round-off added to δ
        comp.extra += comp.noise
        eps = comp.epsilon(delta)
    return eps, comp


def _epsilon_one(rel, direction, interval, delta, comp=None):
    """(ε(δ), the composition that answered) of one direction: the untilted composition ``comp``
    where it serves δ, else the tilted one."""
    if delta >= TILT_BELOW:
        comp = comp if comp is not None else _Composed(rel, direction, interval)
        if _serves(comp, delta):
            return comp.epsilon(delta), comp
    return _epsilon_tiny(rel, direction, interval, delta)


def _delta_tiny(rel, direction, interval, eps, untilted):
    """δ(ε) of one direction where the untilted composition does not serve its own answer
    ``untilted`` (a _Composed): tilted at θ for ε."""
    lots = sum(n for _, _, n in rel)
    h = _lot_interval(rel, direction, interval, _z_tail(STEP_TAIL))
    lam = _lam(rel, h, direction, _z_tail(STEP_TAIL))
    tp = _T_GRID > 0
    est = math.exp(min(0.0, float(np.min(lam[tp] - _T_GRID[tp] * eps))))    # Chernoff bound on δ(ε)
    comp = _Composed(rel, direction, interval, _z_tail(_step_tail(max(est, 1e-300), lots)), eps=eps)
    flat = min(1.0, untilted.delta(eps) + untilted.noise)   # round-off added: an upper bound
    if eps < comp.floor:
        return flat
    return min(flat, comp.delta(eps))         # both are upper bounds


def epsilon_for_releases(releases, delta: float, interval: float = DEFAULT_INTERVAL) -> float:
    """ε(δ) of a heterogeneous composition: max over the two adjacency directions (upper bound)."""
    delta = check_delta(delta)
    rel = _normalise(releases)
    if not rel:
        return 0.0
    return max(_epsilon_one(rel, d, float(interval), delta)[0] for d in DIRECTIONS)


def grid_step(releases, delta: float, interval: float = DEFAULT_INTERVAL) -> float:
    """The privacy-loss grid spacing h behind ε(δ) (the coarser of the two directions): h starts
    at ``interval`` and doubles where a lot's or the composed loss needs too many points."""
    delta = check_delta(delta)
    rel = _normalise(releases)
    if not rel:
        return float(interval)
    return max(_epsilon_one(rel, d, float(interval), delta)[1].h for d in DIRECTIONS)


def epsilons_for_releases(releases, deltas, interval: float = DEFAULT_INTERVAL) -> list[float]:
    """ε(δ) for each δ of ``deltas``, composing the untilted PLDs once for all δ >= TILT_BELOW."""
    deltas = [check_delta(d) for d in deltas]
    rel = _normalise(releases)
    if not rel:
        return [0.0] * len(deltas)
    interval = float(interval)
    comp = [_Composed(rel, d, interval) for d in DIRECTIONS] if any(d >= TILT_BELOW for d in deltas) else [None] * 2
    return [max(_epsilon_one(rel, d, interval, x, c)[0] for d, c in zip(DIRECTIONS, comp)) for x in deltas]


def delta_for_releases(releases, epsilon: float, interval: float = DEFAULT_INTERVAL) -> float:
    """δ(ε) of a heterogeneous composition: max over the two adjacency directions (upper bound)."""
    epsilon = check_epsilon(epsilon)
    rel = _normalise(releases)
    if not rel:
        return 0.0
    out = 0.0
    for d in DIRECTIONS:
        comp = _Composed(rel, d, float(interval))
        v = comp.delta(epsilon)
        if not _serves(comp, v):
            v = _delta_tiny(rel, d, float(interval), epsilon, comp)
        out = max(out, v)
    return out


def epsilon(q: float, sigma: float, steps: int, delta: float, interval: float = DEFAULT_INTERVAL) -> float:
    """ε(δ) after ``steps`` lots of the Poisson-subsampled Gaussian (PLD, connect-the-dots, FFT)."""
    q, sigma, steps, delta = check_q(q), check_sigma(sigma), check_steps(steps), check_delta(delta)
    return epsilon_for_releases([(q, sigma, steps)], delta, interval)


def delta(q: float, sigma: float, steps: int, epsilon: float, interval: float = DEFAULT_INTERVAL) -> float:
    """δ(ε) after ``steps`` lots of the Poisson-subsampled Gaussian (PLD, connect-the-dots, FFT)."""
    q, sigma, steps, epsilon = check_q(q), check_sigma(sigma), check_steps(steps), check_epsilon(epsilon)
    return delta_for_releases([(q, sigma, steps)], epsilon, interval)
