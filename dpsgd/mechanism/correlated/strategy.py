"""Correlated-noise strategies: the lower-triangular Toeplitz C of the matrix mechanism, optimised
for a run (pure numpy/scipy).

DP matrix factorisation (Denisov et al. 2022; Choquette-Choo et al. 2023, arXiv 2306.08153) adds to
the gradient of step t the t-th row of C⁻¹Z instead of an independent draw: the model iterates are
A(x + C⁻¹Z) for the workload A (prefix sums for SGD; with heavy-ball momentum μ the Toeplitz matrix
of a_k = Σ_{i≤k} μ^i), so what the noise costs the iterates is ‖A C⁻¹‖_F² while what it costs the
privacy is the sensitivity of C. Two families:

* **BandMF** (``banded``): C banded Toeplitz with b coefficients c_0..c_{b−1}, normalised to
  ‖c‖₂ = 1, so its largest column norm is 1 (the last b − 1 columns, cut by the horizon, are
  shorter). The coefficients minimise the mean squared workload error ‖A C⁻¹‖_F² / n under that
  constraint (the objective ‖c‖²·‖A C⁻¹‖_F² is scale-free; L-BFGS with the exact gradient,
  c_0 = 1, started from the truncated coefficients of (1 − x)^{−1/2}, the optimal unbanded prefix-sum
  factor of Fichtenberger et al. 2023). McKenna 2024 (arXiv 2405.15913) shows banded Toeplitz is
  near-optimal among banded strategies for long runs.
* **BLT** (``blt``; buffered linear Toeplitz, Dvijotham et al. 2024, arXiv 2404.16706; McMahan et al.
  2024, arXiv 2408.08868): c_0 = 1, c_k = Σ_j ω_j θ_j^{k−1} with d buffers (θ_j ∈ (0, 1), ω_j > 0).
  Not banded, so no amplification theorem covers it: it is used under b-min-separation (each example
  in one part, parts visited every t lots) and normalised by its exact per-participation
  sensitivity Δ_∞ (``toeplitz.blt_sensitivity_squared``), the supremum over participations of what
  one more participation adds to ‖C u‖² (u the participation pattern); a run's charge of one
  Gaussian at σ per participation is then an upper bound for every horizon. θ, ω minimise Δ_∞²·‖A C⁻¹‖_F² / n
  (L-BFGS-B on logit θ, log ω; C⁻¹ must be stable, i.e. the roots of its denominator lie outside the
  unit disc).

A ``Strategy`` is plain data (it travels in privacy.json and the checkpoint); ``noise_coefficients``
are the Toeplitz coefficients of the noise matrix scale·C⁻¹ (``scale`` = 1 for BandMF, Δ_∞ for BLT),
whose row norm is the per-step noise multiplier relative to σ.

Details: docs/CORRELATED_NOISE.md.
"""

from __future__ import annotations

import functools
import math
from dataclasses import asdict, dataclass

import numpy as np
from scipy import optimize, signal, special

from dpsgd.mechanism.correlated.toeplitz import (
    apply_workload,
    blt_coefficients,
    blt_rational,
    blt_sensitivity_squared,
    stable,
    workload_error,
)

KINDS = ("bandmf", "blt")
BANDS_MAX = 256  # BandMF bands the optimiser serves (b − 1 model-sized buffers are kept)
BUFFERS_MAX = 16  # BLT buffers


@dataclass(frozen=True)
class Strategy:
    """The strategy matrix C of a correlated-noise run, as optimised (``banded``, ``blt``)."""

    kind: str  # "bandmf" | "blt"
    horizon: int  # n, the lots it was optimised for
    momentum: float = 0.0  # μ of the workload it was optimised for (0: prefix sums)
    coef: tuple[float, ...] = ()  # bandmf: c_0..c_{b−1}, ‖c‖₂ = 1
    theta: tuple[float, ...] = ()  # blt: the buffers' decays θ_j
    omega: tuple[float, ...] = ()  # blt: the buffers' output scales ω_j
    min_sep: int = 1  # blt: the separation Δ_∞ is computed for
    scale: float = 1.0  # the noise matrix is scale · C⁻¹ (blt: Δ_∞)

    @property
    def bands(self) -> int | None:
        return len(self.coef) if self.kind == "bandmf" else None

    @property
    def buffers(self) -> int:
        """Model-sized tensors the streaming noise keeps: b − 1 (BandMF) or d (BLT)."""
        return len(self.coef) - 1 if self.kind == "bandmf" else len(self.theta)

    @property
    def independent(self) -> bool:
        """b = 1: C = I, the noise of Algorithm 1 itself."""
        return self.kind == "bandmf" and len(self.coef) == 1

    def toeplitz(self, n: int) -> np.ndarray:
        """The first n Toeplitz coefficients of C (unnormalised for BLT: c_0 = 1)."""
        if self.kind == "bandmf":
            out = np.zeros(n)
            out[: min(n, len(self.coef))] = self.coef[:n]
            return out
        return blt_coefficients(np.array(self.theta), np.array(self.omega), n)

    def noise_coefficients(self, n: int) -> np.ndarray:
        """The first n Toeplitz coefficients of the noise matrix scale · C⁻¹ (float64)."""
        e0 = np.zeros(n)
        e0[0] = 1.0
        if self.kind == "bandmf":
            return signal.lfilter([1.0], np.array(self.coef), e0)
        num, den = blt_rational(np.array(self.theta), np.array(self.omega))
        return self.scale * signal.lfilter(num, den, e0)

    def to_dict(self) -> dict:
        return {k: list(v) if isinstance(v, tuple) else v for k, v in asdict(self).items()}

    @classmethod
    def from_dict(cls, d: dict) -> "Strategy":
        s = cls(
            kind=str(d["kind"]),
            horizon=int(d["horizon"]),
            momentum=float(d["momentum"]),
            coef=tuple(float(x) for x in d["coef"]),
            theta=tuple(float(x) for x in d["theta"]),
            omega=tuple(float(x) for x in d["omega"]),
            min_sep=int(d["min_sep"]),
            scale=float(d["scale"]),
        )
        check(s)
        return s


def check(s: Strategy) -> None:
    """ValueError unless ``s`` is a strategy its charge covers: BandMF ‖c‖₂ = 1 (to float64
    round-off of the b-term sum), BLT θ ∈ (0, 1), ω > 0, a stable C⁻¹ and scale = Δ_∞."""
    if s.kind not in KINDS:
        raise ValueError(f"strategy kind={s.kind!r}: must be one of {list(KINDS)}")
    if s.kind == "bandmf":
        c = np.array(s.coef)
        # ‖c‖² of b terms computed in float64: within b·eps of 1 when normalised (a few ulps)
        if not (len(c) >= 1 and c[0] > 0 and abs(c @ c - 1.0) <= 4 * len(c) * 2.2e-16):
            raise ValueError(f"bandmf coefficients {list(c)[:4]}...: need c_0 > 0 and ‖c‖₂ = 1")
        return
    th, om = np.array(s.theta), np.array(s.omega)
    if not (len(th) == len(om) >= 1 and np.all((th > 0) & (th < 1)) and np.all(om > 0)):
        raise ValueError("blt parameters: need θ_j in (0, 1) and ω_j > 0, as many of each")
    if not stable(th, om):
        raise ValueError(
            "blt parameters: C⁻¹ is not stable (a root of its denominator in |x| <= 1)"
        )
    want = math.sqrt(blt_sensitivity_squared(th, om, s.min_sep))
    if not abs(s.scale - want) <= 1e-12 * want:  # the same closed form, a few ulps apart
        raise ValueError(f"blt scale={s.scale!r}: must be Δ_∞ = {want!r} (min_sep={s.min_sep})")


# -- the workload and its error ---------------------------------------------------------------


def expected_error_ratio(s: Strategy, n: int | None = None) -> float:
    """√(‖A scale·C⁻¹‖_F² / ‖A‖_F²) over n lots (default the horizon): the workload's noise at
    equal σ relative to independent noise (< 1: the correlation removes noise)."""
    n = n or s.horizon
    e0 = np.zeros(n)
    e0[0] = 1.0
    return math.sqrt(
        workload_error(s.noise_coefficients(n), s.momentum) / workload_error(e0, s.momentum)
    )


def noise_multiplier_per_step(s: Strategy, n: int | None = None) -> float:
    """‖row n of scale·C⁻¹‖₂: the std of the noise added at a step (late in the run), in units of
    σC; 1 for independent noise."""
    r = s.noise_coefficients(n or s.horizon)
    return float(math.sqrt(r @ r))


# -- BandMF -----------------------------------------------------------------------------------


def _banded_objective(tail: np.ndarray, n: int, momentum: float, w: np.ndarray, e_ind: float):
    """(log(‖c‖²·‖A C⁻¹‖²_w / E_I), gradient) for c = (1, tail): the exact gradient by the adjoint
    of the triangular solves (C r = e_0 ⇒ ∂r/∂c_i = −C⁻¹ S_i r). The logarithm keeps the line
    search finite where C⁻¹ grows (a root of c(x) inside the unit disc: a huge, finite error)."""
    c = np.concatenate([[1.0], tail])
    e0 = np.zeros(n)
    e0[0] = 1.0
    with np.errstate(over="ignore", invalid="ignore"):
        r = signal.lfilter([1.0], c, e0)
        m = apply_workload(r, momentum)
        err = float(np.dot(w, m * m))
    if not (np.isfinite(err) and err > 0):
        return 1e3, np.zeros_like(tail)
    g = apply_workload((2 * w * m)[::-1], momentum)[::-1]  # Aᵀ(2 w ⊙ m) = ∂err/∂r
    lam = signal.lfilter([1.0], c, g[::-1])[::-1]  # C⁻ᵀ g
    derr = np.array([-np.dot(lam[i:], r[: n - i]) if i < n else 0.0 for i in range(1, len(c))])
    norm2 = float(c @ c)
    return math.log(norm2 * err / e_ind), 2 * tail / norm2 + derr / err


@functools.lru_cache(maxsize=64)
def banded(bands: int, horizon: int, momentum: float = 0.0) -> Strategy:
    """The BandMF strategy with ``bands`` = b coefficients for ``horizon`` = n lots and the workload
    of momentum μ (cached by (b, n, μ)): ‖c‖₂ = 1, c minimising the mean squared workload error
    (module docstring). b = 1 is C = I, the noise of Algorithm 1."""
    b, n = int(bands), int(horizon)
    if not 1 <= b <= BANDS_MAX:
        raise ValueError(f"privacy.bands={bands!r}: must be in [1, {BANDS_MAX}]")
    if n < 1:
        raise ValueError(f"horizon={horizon!r}: must be >= 1 lot")
    if b == 1:
        return Strategy("bandmf", n, float(momentum), coef=(1.0,), min_sep=1)
    k = np.arange(b)
    init = np.cumprod(np.where(k == 0, 1.0, (2 * k - 1) / np.maximum(2 * k, 1)))  # (1−x)^(−1/2)
    w = np.arange(n, 0, -1, dtype=np.float64)
    e_ind = float(np.dot(w, apply_workload(np.eye(1, n)[0], momentum) ** 2))
    args = (n, float(momentum), w, e_ind)
    res = optimize.minimize(
        _banded_objective,
        init[1:],
        args=args,
        jac=True,
        method="L-BFGS-B",
        options={"maxiter": 3000, "ftol": 1e-15, "gtol": 1e-12},
    )
    # the optimum, or the start where the search did not improve on it
    tail = res.x if res.fun < _banded_objective(init[1:], *args)[0] else init[1:]
    c = np.concatenate([[1.0], tail])
    c = c / math.sqrt(float(c @ c))
    c = c / math.sqrt(float(c @ c))  # a second pass: ‖c‖² within an ulp or two of 1
    return Strategy("bandmf", n, float(momentum), coef=tuple(float(x) for x in c), min_sep=b)


# -- BLT --------------------------------------------------------------------------------------


def _logit(p) -> np.ndarray:
    p = np.asarray(p, float)
    return np.log(p / (1.0 - p))


def _blt_params(x: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    d = len(x) // 2
    return special.expit(x[:d]), np.exp(np.clip(x[d:], -700.0, 700.0))


def _blt_objective(x, n, t, momentum, w, e_ind) -> float:
    theta, omega = _blt_params(x)
    if not (np.all((theta > 0) & (theta < 1)) and stable(theta, omega)):
        return 1e6
    Q, P = blt_rational(theta, omega)
    e0 = np.zeros(n)
    e0[0] = 1.0
    r = signal.lfilter(Q, P, e0)
    m = apply_workload(r, momentum)
    if not np.all(np.isfinite(m)):
        return 1e6
    return blt_sensitivity_squared(theta, omega, t) * float(np.dot(w, m * m)) / e_ind


@functools.lru_cache(maxsize=32)
def blt(buffers: int, horizon: int, min_sep: int, momentum: float = 0.0) -> Strategy:
    """The BLT strategy with ``buffers`` = d buffers for ``horizon`` = n lots under min-separation
    ``min_sep`` = t and the workload of momentum μ (cached): θ, ω minimise Δ_∞²·‖A C⁻¹‖_F² / n
    (module docstring) over 1..d buffers, each count from a few starts and from the best with one
    buffer less; at most d buffers are kept (fewer where more do not lower the objective);
    scale = Δ_∞."""
    d, n, t = int(buffers), int(horizon), int(min_sep)
    if not 1 <= d <= BUFFERS_MAX:
        raise ValueError(f"privacy.blt_buffers={buffers!r}: must be in [1, {BUFFERS_MAX}]")
    if n < 1 or t < 1:
        raise ValueError(f"horizon={horizon!r}, min_sep={min_sep!r}: must be >= 1")
    w = np.arange(n, 0, -1, dtype=np.float64)
    e_ind = float(np.dot(w, apply_workload(np.eye(1, n)[0], momentum) ** 2))
    args = (n, t, float(momentum), w, e_ind)
    best = prev = None  # k = 1, ..., d buffers; k is also started from the best k − 1 plus one
    for k in range(1, d + 1):
        starts = []
        for spread in (1.0, 0.5, 2.0):  # 1 − θ_j spaced geometrically between 1/2 and 1/n
            one_minus = np.geomspace(0.5, 1.0 / max(n, 4), k) ** spread if k > 1 else [0.1]
            theta0 = np.clip(1.0 - np.asarray(one_minus), 1e-3, 1 - 1e-9)
            starts.append(np.concatenate([_logit(theta0), np.log(0.5 * (1.0 - theta0) / k)]))
        if prev is not None:
            th, om = _blt_params(prev.x)
            new = min(0.5, th.min() / 2)  # a faster-decaying buffer, nearly off
            starts.append(np.concatenate([_logit(np.append(th, new)), np.log(np.append(om, 1e-4))]))
        runs = [
            optimize.minimize(_blt_objective, x0, args=args, method="L-BFGS-B") for x0 in starts
        ]
        prev = min(runs, key=lambda r: r.fun)
        if best is None or prev.fun < best.fun:  # more buffers only where they lower the error
            best = prev
    theta, omega = _blt_params(best.x)
    order = np.argsort(-theta)
    theta, omega = theta[order], omega[order]
    scale = math.sqrt(blt_sensitivity_squared(theta, omega, t))
    s = Strategy(
        "blt",
        n,
        float(momentum),
        theta=tuple(float(v) for v in theta),
        omega=tuple(float(v) for v in omega),
        min_sep=t,
        scale=scale,
    )
    check(s)
    return s


def for_run(
    noise: str, bands: int | None, buffers: int, horizon: int, cycle: int, momentum: float
) -> Strategy:
    """The strategy of a run with ``noise`` = bandmf|blt over ``horizon`` lots whose sampler visits
    each example's part every ``cycle`` lots: BandMF with ``bands`` (b <= cycle), or BLT with
    ``buffers`` and min-separation ``cycle``; optimised for the workload of ``momentum``."""
    if noise == "bandmf":
        b = int(bands or 1)
        if b > cycle:
            raise ValueError(
                f"privacy.bands={b}: more bands than the {cycle} lots between an example's "
                "participations (b-min-separation needs b <= the cycle)"
            )
        return banded(b, int(horizon), float(momentum))
    if noise == "blt":
        return blt(int(buffers), int(horizon), int(cycle), float(momentum))
    raise ValueError(f"privacy.noise={noise!r}: no strategy (bandmf or blt)")
