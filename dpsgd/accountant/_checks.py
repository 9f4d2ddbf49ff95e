"""Argument validation shared by every public accountant function.

Each check raises ``ValueError`` naming the parameter *and* the offending value, before any work
starts (house style rule 10). Booleans are rejected where numbers are expected.
"""
from __future__ import annotations

import math
import numbers


def _real(name: str, value) -> float:
    if type(value) is float or type(value) is int:      # fast path (hot in the training loop)
        if value != value:
            raise ValueError(f"{name} must not be NaN, got {name}={value!r}")
        return float(value)
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise ValueError(f"{name} must be a real number, got {name}={value!r}")
    v = float(value)
    if math.isnan(v):
        raise ValueError(f"{name} must not be NaN, got {name}={value!r}")
    return v


def check_q(q, name: str = "q") -> float:
    """Sampling rate q = L/N of the Poisson sampler: q ∈ (0, 1]."""
    v = _real(name, q)
    if not 0.0 < v <= 1.0:
        raise ValueError(f"{name} (sampling rate) must be in (0, 1], got {name}={q!r}")
    return v


def check_sigma(sigma, name: str = "sigma") -> float:
    """Noise multiplier σ (noise std / clipping bound C): σ > 0 and finite."""
    v = _real(name, sigma)
    if not (v > 0.0 and math.isfinite(v)):
        raise ValueError(f"{name} (noise multiplier) must be > 0 and finite, got {name}={sigma!r}")
    return v


def check_delta(delta, name: str = "delta") -> float:
    """δ ∈ (0, 1)."""
    v = _real(name, delta)
    if not 0.0 < v < 1.0:
        raise ValueError(f"{name} must be in (0, 1), got {name}={delta!r}")
    return v


def check_epsilon(epsilon, name: str = "epsilon") -> float:
    """ε > 0 and finite."""
    v = _real(name, epsilon)
    if not (v > 0.0 and math.isfinite(v)):
        raise ValueError(f"{name} must be > 0 and finite, got {name}={epsilon!r}")
    return v


def check_steps(steps, name: str = "steps") -> int:
    """A number of lots / releases: an integer >= 0 (integral floats such as 1e4 are accepted)."""
    if type(steps) is int and steps >= 0:               # fast path
        return steps
    if isinstance(steps, bool):
        raise ValueError(f"{name} must be an integer >= 0, got {name}={steps!r}")
    if isinstance(steps, numbers.Integral):
        v = int(steps)
    elif isinstance(steps, numbers.Real) and math.isfinite(float(steps)) and float(steps).is_integer():
        v = int(steps)
    else:
        raise ValueError(f"{name} must be an integer >= 0, got {name}={steps!r}")
    if v < 0:
        raise ValueError(f"{name} must be an integer >= 0, got {name}={steps!r}")
    return v


def check_groups(groups, name: str = "groups") -> int:
    """Number k of separately clipped tensors on one lot: integer >= 1."""
    v = check_steps(groups, name)
    if v < 1:
        raise ValueError(f"{name} must be an integer >= 1, got {name}={groups!r}")
    return v


def check_choice(value, name: str, choices) -> str:
    if value not in choices:
        raise ValueError(f"{name} must be one of {sorted(choices)}, got {name}={value!r}")
    return value


def check_orders(orders, name: str = "orders", minimum: float = 1.0, integer: bool = False) -> tuple:
    """A non-empty sequence of Rényi orders (> minimum); integers only if ``integer``."""
    try:
        vals = tuple(orders)
    except TypeError:
        raise ValueError(f"{name} must be a sequence of numbers, got {name}={orders!r}") from None
    if not vals:
        raise ValueError(f"{name} must not be empty, got {name}={orders!r}")
    out = []
    for o in vals:
        v = _real(name, o)
        if not (v > minimum and math.isfinite(v)):
            raise ValueError(f"{name} must all be > {minimum:g} and finite, got {name} containing {o!r}")
        if integer and not v.is_integer():
            raise ValueError(f"{name} must be integers, got {name} containing {o!r}")
        out.append(int(v) if integer else v)
    return tuple(out)


# The ranges the accountants serve (numerically tested); the trainer's config refuses anything outside.
SIGMA_MIN = 0.01          # noise multiplier σ
SIGMA_MAX = 1e6
Q_MIN = 1e-9              # sampling rate q
STEPS_MAX = 10**9         # lots T
GROUPS_MAX = 10**6        # separately clipped tensors k
DELTA_MIN = 1e-100        # δ
EPSILON_MAX = 1e4         # ε
