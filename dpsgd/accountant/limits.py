"""Argument validation shared by every public accountant function, and the serviceable ranges.

Each check raises ``ValueError`` naming the parameter *and* the offending value, before any work
starts. Booleans are rejected where numbers are expected.

Serviceable ranges (what the accountants can compute, in double precision, in bounded time and
memory; the training config validator imports the same constants): ``SIGMA_MIN = 0.01`` and
``SIGMA_MAX = 1e6`` (noise multiplier σ; with per-layer clipping σ/√k must also be >= SIGMA_MIN for
the PLD and strong-composition accountants), ``Q_MIN = 1e-12`` (q ∈ [Q_MIN, 1]),
``STEPS_MAX = 10**9`` (lots in one query), ``GROUPS_MAX = 10**5`` (separately clipped tensors per
lot), ``DELTA_MIN = 1e-100`` (δ ∈ [DELTA_MIN, 1)) and ``EPSILON_MAX = 1e4`` (ε ∈ (0, EPSILON_MAX]).

Details (why each range ends where it does): docs/ACCOUNTING.md, "dpsgd/accountant/limits.py".
"""

from __future__ import annotations

import math
import numbers

# δ = 1e-5, the paper's (Abadi et al. 2016, §5: δ = 1e-5 < 1/N for MNIST's N = 60 000): the one
# default of every command and configuration (privacy.delta, --delta)
DELTA_DEFAULT = 1e-5
SIGMA_MIN = 0.01
SIGMA_MAX = 1e6
Q_MIN = 1e-12
STEPS_MAX = 10**9
GROUPS_MAX = 10**5
DELTA_MIN = 1e-100
EPSILON_MAX = 1e4


def _real(name: str, value) -> float:
    if type(value) is float or type(value) is int:  # fast path (hot in the training loop)
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
    """Sampling rate q = L/N of the Poisson sampler: q ∈ [Q_MIN, 1]."""
    v = _real(name, q)
    if not Q_MIN <= v <= 1.0:
        raise ValueError(f"{name} (sampling rate) must be in [{Q_MIN:g}, 1], got {name}={q!r}")
    return v


def check_sigma(sigma, name: str = "sigma") -> float:
    """Noise multiplier σ (noise std / clipping bound C): σ ∈ [SIGMA_MIN, SIGMA_MAX]."""
    if type(sigma) is float and SIGMA_MIN <= sigma <= SIGMA_MAX:  # fast path (Ledger.record)
        return sigma
    v = _real(name, sigma)
    if not SIGMA_MIN <= v <= SIGMA_MAX:
        raise ValueError(
            f"{name} (noise multiplier) must be in [{SIGMA_MIN:g}, {SIGMA_MAX:g}], "
            f"got {name}={sigma!r}"
        )
    return v


def check_delta(delta, name: str = "delta") -> float:
    """δ ∈ [DELTA_MIN, 1)."""
    v = _real(name, delta)
    if not DELTA_MIN <= v < 1.0:
        raise ValueError(f"{name} must be in [{DELTA_MIN:g}, 1), got {name}={delta!r}")
    return v


def check_epsilon(epsilon, name: str = "epsilon") -> float:
    """ε ∈ (0, EPSILON_MAX]."""
    v = _real(name, epsilon)
    if not 0.0 < v <= EPSILON_MAX:
        raise ValueError(f"{name} must be in (0, {EPSILON_MAX:g}], got {name}={epsilon!r}")
    return v


def check_steps(steps, name: str = "steps") -> int:
    """A number of lots / releases: an integer in [0, STEPS_MAX]
    (integral floats such as 1e4 too)."""
    if type(steps) is int and 0 <= steps <= STEPS_MAX:  # fast path
        return steps
    if isinstance(steps, bool):
        raise ValueError(f"{name} must be an integer >= 0, got {name}={steps!r}")
    if isinstance(steps, numbers.Integral):
        v = int(steps)
    elif (
        isinstance(steps, numbers.Real)
        and math.isfinite(float(steps))
        and float(steps).is_integer()
    ):
        v = int(steps)
    else:
        raise ValueError(f"{name} must be an integer >= 0, got {name}={steps!r}")
    if v < 0:
        raise ValueError(f"{name} must be an integer >= 0, got {name}={steps!r}")
    if v > STEPS_MAX:
        raise ValueError(
            f"{name} must be at most {STEPS_MAX:.0e} (STEPS_MAX), got {name}={steps!r}"
        )
    return v


def check_groups(groups, name: str = "groups") -> int:
    """Number k of separately clipped tensors on one lot: integer in [1, GROUPS_MAX]."""
    if type(groups) is int and 1 <= groups <= GROUPS_MAX:  # fast path
        return groups
    integral = isinstance(groups, numbers.Integral) or (
        isinstance(groups, numbers.Real)
        and math.isfinite(float(groups))
        and float(groups).is_integer()
    )
    if isinstance(groups, bool) or not integral or not 1 <= int(groups) <= GROUPS_MAX:
        raise ValueError(
            f"{name} must be an integer in [1, {GROUPS_MAX:.0e}] (GROUPS_MAX), got "
            f"{name}={groups!r}"
        )
    return int(groups)


def check_choice(value, name: str, choices) -> str:
    if value not in choices:
        raise ValueError(f"{name} must be one of {sorted(choices)}, got {name}={value!r}")
    return value


def check_orders(
    orders, name: str = "orders", minimum: float = 1.0, integer: bool = False
) -> tuple:
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
            raise ValueError(
                f"{name} must all be > {minimum:g} and finite, got {name} containing {o!r}"
            )
        if integer and not v.is_integer():
            raise ValueError(f"{name} must be integers, got {name} containing {o!r}")
        out.append(int(v) if integer else v)
    return tuple(out)
