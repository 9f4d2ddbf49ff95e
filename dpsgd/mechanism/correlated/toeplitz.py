"""Lower-triangular Toeplitz algebra of correlated noise (pure numpy/scipy): the workload of the
update, the error a noise matrix leaves in it, the BLT's coefficients, rational form and stability,
and the min-separation sensitivities (mechanism/correlated/strategy.py optimises over these).

* ``apply_workload``, ``workload_error``: A(x) = 1/((1 − x)(1 − μx)), the prefix sums of SGD with
  heavy-ball momentum μ (θ_t = θ_0 − η Σ_s a_{t−s} g_s, a_k = Σ_{i<=k} μ^i); ‖A R‖_F² / n.
* ``blt_coefficients``, ``blt_rational``, ``stable``: c_0 = 1, c_k = Σ_j ω_j θ_j^{k−1} (Dvijotham
  et al. 2024, arXiv 2404.16706), C(x) = P(x)/Q(x), and whether C⁻¹ = Q/P is a stable filter.
* ``blt_sensitivity_squared``: Δ_∞², what any participation t or more lots after the previous one
  adds to ‖C u‖² (closed form); ``sensitivity_squared_minsep``: the exact finite worst case.

Details: docs/CORRELATED_NOISE.md.
"""

from __future__ import annotations

import numpy as np
from scipy import signal


def apply_workload(v: np.ndarray, momentum: float) -> np.ndarray:
    """A v for the workload A(x) = 1 / ((1 − x)(1 − μx)) (prefix sums of heavy-ball momentum)."""
    return signal.lfilter([1.0], [1.0, -(1.0 + momentum), momentum], v)


def workload_error(noise: np.ndarray, momentum: float = 0.0) -> float:
    """‖A R‖_F² / n for the lower-triangular Toeplitz noise matrix R with first column ``noise``
    (length n): the mean over steps of the squared workload error per unit of σ (identity R: the
    independent noise of Algorithm 1)."""
    n = len(noise)
    m = apply_workload(noise, momentum)
    return float(np.dot(np.arange(n, 0, -1, dtype=np.float64), m * m) / n)


def blt_coefficients(theta: np.ndarray, omega: np.ndarray, n: int) -> np.ndarray:
    """c_0 = 1, c_k = Σ_j ω_j θ_j^{k−1} (k >= 1)."""
    k = np.arange(max(0, n - 1), dtype=np.float64)
    return np.concatenate([[1.0], (omega[None, :] * theta[None, :] ** k[:, None]).sum(1)])[:n]


def blt_rational(theta: np.ndarray, omega: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(Q, P), ascending powers of x, with C(x) = P(x)/Q(x): Q = Π_j (1 − θ_j x), P = Q + Σ_j ω_j x
    Π_{l≠j} (1 − θ_l x); so C⁻¹(x) = Q(x)/P(x)."""
    Q = np.array([1.0])
    for t in theta:
        Q = np.convolve(Q, [1.0, -t])
    P = np.concatenate([Q, [0.0]])
    for j, w in enumerate(omega):
        term = np.array([0.0, w])
        for l, t in enumerate(theta):
            if l != j:
                term = np.convolve(term, [1.0, -t])
        P[: len(term)] += term
    return Q, P[: len(Q)]


def stable(theta: np.ndarray, omega: np.ndarray) -> bool:
    """Whether C⁻¹ = Q/P is stable: every root of P(x) outside the closed unit disc."""
    _, P = blt_rational(theta, omega)
    roots = np.roots(P[::-1])
    return bool(np.all(np.abs(roots) > 1.0))


def blt_sensitivity_squared(theta, omega, min_sep: int) -> float:
    """Δ_∞² = ‖c‖² + 2 Σ_{d>=1} ρ(d t), ρ(s) = Σ_i c_i c_{i+s} (t = ``min_sep``), in closed form.

    Each participation, t or more lots after the previous one of the same example, adds to ‖C u‖²
    its own column's ‖c‖² (at most) plus twice its inner products with the earlier participations'
    columns, each at most ρ((k − m) t) when c >= 0 (the horizon only cuts non-negative terms): so
    Δ_∞² bounds what any participation adds, for every horizon, and K participations have
    sensitivity at most √K·Δ_∞ (exact for the worst pattern as K → ∞; sensitivity_squared_minsep
    gives the exact finite value). With c_k = Σ_j ω_j θ_j^{k−1}: ‖c‖² = 1 + Σ_{jl} ω_jω_l/(1 −
    θ_jθ_l), Σ_d c_{dt} = Σ_j ω_j θ_j^{t−1}/(1 − θ_j^t), Σ_d Σ_{i>=1} c_i c_{i+dt} = Σ_{jl}
    ω_jω_l/(1 − θ_jθ_l) · θ_l^t/(1 − θ_l^t)."""
    th, om, t = np.asarray(theta, float), np.asarray(omega, float), int(min_sep)
    G = np.outer(om, om) / (1.0 - np.outer(th, th))
    norm2 = 1.0 + G.sum()
    cross = float((om * th ** (t - 1) / (1.0 - th**t)).sum())
    cross += float((G * (th**t / (1.0 - th**t))[None, :]).sum())
    return float(norm2 + 2.0 * cross)


def sensitivity_squared_minsep(coef: np.ndarray, min_sep: int, n: int) -> float:
    """‖C_n u‖² for u the participations 0, t, 2t, ... < n of C_n (n × n, first column ``coef``):
    the exact min-separation sensitivity² when the coefficients are non-negative and non-increasing
    (the worst pattern is the earliest one; McMahan et al. 2024, arXiv 2405.13763, Thm 2)."""
    c = np.zeros(n)
    c[: min(n, len(coef))] = np.asarray(coef, float)[:n]
    u = np.zeros(n)
    u[:: int(min_sep)] = 1.0
    v = signal.fftconvolve(c, u)[:n] if n > 4096 else np.convolve(c, u)[:n]
    return float(v @ v)
