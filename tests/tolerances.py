"""Where the tolerances of the tests come from (docs/DEVELOPMENT.md, "Tolerances").

A float comparison in ``tests/`` uses one of these, or is exact (integers, values copied or replayed
bit for bit on the same machine) and says so in a comment. None of them depends on the CPU's last
bits: each is an error bound of the algorithm or of float arithmetic, never the scatter seen on
one machine.

* :func:`pld_grid_step`, :func:`pld_epsilon_tol`: ``PLD_GRID_STEPS`` steps h of the PLD grid.
* :func:`root_tol`, :func:`propagated_tol`: brentq's ``xtol + rtol·|x|``, carried through f.
* :func:`sum_tol`: round-off of a sum of n terms: ``n·eps·Σ|x_i|``.
* :func:`chain_rel_tol`: n float operations without cancellation: ``n·eps`` relative.
* :func:`reduction_rtol`, :func:`f64_rtol`, :func:`assert_f64_close`: values reduced over n terms,
  ``n·eps`` relative (a float64 model: n = its parameter count), with an absolute floor.

Details: docs/DEVELOPMENT.md, "Tolerances".
"""

from __future__ import annotations

from functools import lru_cache

import numpy as np

EPS64 = float(
    np.finfo(np.float64).eps
)  # 2.2e-16: spacing of float64 at 1 (twice the unit round-off)
EPS32 = float(np.finfo(np.float32).eps)  # 1.2e-7: the same for float32

# PLD: ε is solved on the grid of losses ε_i = i·h, interpolated between the two grid losses around
# the δ target. Last-bit differences in exp/log/FFT between CPUs can move that bracket by one grid
# point (one step h), and the FFT round-off (~1e-16 of the largest probability per bin, clipped but
# not bounded in pld.py) shifts δ near a tiny target, and with it ε, by up to about one more step.
# Observed: another CPU gives pld.epsilon(0.1, 0.5, 1000, 1e-10) = 165.68629090570252 (here
# 165.68442187235155: 1.17 steps of h = 1.6e-3) and pld.epsilon(0.01, 4, 10000, 1e-5) =
# 0.9469993067888189 (here 0.9469993042704778: 2.5e-5 steps of h = 1e-4). Two steps bound both.
PLD_GRID_STEPS = 2

# The xtol/rtol of the root-finders in dpsgd (tests/project/test_tolerance_policy.py checks them
# against the source, so a change there shows up here).
GAUSSIAN_EPSILON_XTOL = 1e-14  # strong_composition.gaussian_epsilon: brentq, xtol and rtol 1e-14
GAUSSIAN_EPSILON_RTOL = 1e-14


@lru_cache(maxsize=64)
def _pld_grid_step(releases: tuple, interval: float) -> float:
    from dpsgd.accountant import pld

    return max(c.h for c in pld.compose(list(releases), interval))


def pld_grid_step(releases, interval: float | None = None, delta: float | None = None) -> float:
    """The spacing h of the privacy-loss grid the PLD accountant uses for ``releases``
    [(q, σ, lots), ...] (the coarser of its two directions; h starts at ``interval`` and doubles
    where the composed loss needs more than pld_fft.MAX_POINTS grid points). With ``delta``: the
    grid behind ε(δ) (``pld.grid_step``; at tiny δ the tilted composition's, which may differ)."""
    from dpsgd.accountant import pld

    interval = pld.DEFAULT_INTERVAL if interval is None else float(interval)
    if delta is not None:
        return pld.grid_step(list(releases), delta, interval)
    return _pld_grid_step(tuple((float(q), float(s), int(n)) for q, s, n in releases), interval)


def pld_epsilon_tol(releases, interval: float | None = None, delta: float | None = None) -> float:
    """Absolute tolerance on a PLD ε: ``PLD_GRID_STEPS · h`` (:func:`pld_grid_step`)."""
    return PLD_GRID_STEPS * pld_grid_step(releases, interval, delta)


def ledger_pld_epsilon_tol(ledger, convention: str = "joint") -> float:
    """:func:`pld_epsilon_tol` for the releases a Ledger charges under ``convention``."""
    from dpsgd.accountant import compose

    return pld_epsilon_tol(compose.mechanisms(ledger.entries, convention))


def rdp_series_rtol() -> float:
    """Relative round-off of an RDP ε at fractional orders: a series of at most rdp._FRAC_MAX_TERMS
    terms (:func:`reduction_rtol`); integer orders need fewer."""
    from dpsgd.accountant import rdp

    return reduction_rtol(rdp._FRAC_MAX_TERMS)


def root_tol(x: float, xtol: float, rtol: float = 0.0) -> float:
    """Absolute error of a root x returned by brentq(xtol, rtol): ``xtol + rtol·|x|`` (scipy's stop
    rule; ``4·EPS64·|x|`` added, brentq's own floor on rtol)."""
    return xtol + (rtol + 4 * EPS64) * abs(x)


def propagated_tol(f, x: float, dx: float) -> float:
    """Error in f(x) when x is known to ±dx: ``|f'(x)|·dx`` (f' by a central difference at a step
    well above round-off), doubled for the curvature over the step."""
    step = max(dx, 1e-6 * max(abs(x), 1.0))
    return 2.0 * abs(f(x + step) - f(x - step)) / (2 * step) * dx


def sum_tol(terms, eps: float = EPS64) -> float:
    """Round-off bound of a sum of n terms in a format with machine epsilon ``eps``:
    ``n·eps·Σ|x_i|`` (recursive summation: (n − 1)·(eps/2)·Σ|x_i|, Higham 2002, §4.2; pairwise/BLAS
    orders are tighter). Also a dot product or a conv/matmul entry: pass the products a_i·b_i."""
    a = np.abs(np.asarray(terms, dtype=np.float64)).ravel()
    return float(a.size * eps * a.sum())


def chain_rel_tol(n_ops: int, eps: float = EPS64) -> float:
    """Relative round-off of n float operations without cancellation (each off by <= eps/2):
    ``n·eps``."""
    return n_ops * eps


def reduction_rtol(n: int, eps: float = EPS64) -> float:
    """Relative round-off of a value reduced over at most n terms: ``n·eps`` (:func:`sum_tol` over
    Σ|x_i| ≈ |Σx_i|: sums of squares, losses, and the outputs, gradients and norms of a model,
    where every value is a chain of dot products over at most n = the model's parameter count)."""
    return n * eps


def n_params(model) -> int:
    """Number of parameters of a torch module (the n of :func:`reduction_rtol` for its values)."""
    return sum(p.numel() for p in model.parameters())


def f64_rtol(model) -> float:
    """:func:`reduction_rtol` for a float64 model: ``n_params(model)·EPS64``."""
    return reduction_rtol(n_params(model))


def assert_f64_close(a, b, rtol: float) -> None:
    """torch.testing.assert_close with relative tolerance ``rtol`` and an absolute floor at the
    scale of b (``rtol·max|b|``): entries that are 0 in exact arithmetic are round-off of that
    size."""
    import torch

    torch.testing.assert_close(a, b, rtol=rtol, atol=rtol * float(b.detach().abs().max()))


__all__ = [
    "EPS64",
    "EPS32",
    "PLD_GRID_STEPS",
    "GAUSSIAN_EPSILON_XTOL",
    "GAUSSIAN_EPSILON_RTOL",
    "pld_grid_step",
    "pld_epsilon_tol",
    "ledger_pld_epsilon_tol",
    "rdp_series_rtol",
    "root_tol",
    "propagated_tol",
    "sum_tol",
    "chain_rel_tol",
    "reduction_rtol",
    "n_params",
    "f64_rtol",
    "assert_f64_close",
]
