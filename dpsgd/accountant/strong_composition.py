"""Strong (advanced) composition: the comparator of Abadi et al. 2016, Figure 2.

Each lot is a Gaussian mechanism (noise multiplier σ) run on a Poisson sample of rate q; T lots are
composed with the advanced composition theorem of Dwork, Rothblum & Vadhan 2010 (Dwork & Roth 2014,
Thm 3.20), ε = ε'·sqrt(2T ln(1/δ'')) + T·ε'(e^{ε'} − 1), the split of δ optimised numerically.
``form="expm1"`` (default) is the theorem as stated; ``form="square"`` (T·ε'², smaller, not a
bound) is what matches the figure's printed number.

Two labelled variants: ``variant="paper"`` (the classical Gaussian mechanism and *linear*
amplification by sampling: reproduces Figure 2, NOT a valid privacy bound) and
``variant="valid"`` (the correct amplification by Poisson sampling and, by default, the exact
"analytic" Gaussian mechanism of Balle & Wang 2018; ``gaussian="classical"`` isolates the effect
of the amplification alone). Where the bound overflows a double (σ ≲ 0.03), ε is ``math.inf``.

Details (the figure's numbers, each variant's theorems): docs/ACCOUNTING.md,
"dpsgd/accountant/strong_composition.py".
"""

from __future__ import annotations

import math

import numpy as np
from scipy import optimize, special

from .limits import check_choice, check_delta, check_q, check_sigma, check_steps

VARIANTS = ("paper", "valid")
GAUSSIANS = ("classical", "analytic")
FORMS = ("expm1", "square")


def gaussian_delta(eps0: float, sigma: float) -> float:
    """Exact δ(ε0) of the Gaussian mechanism, sensitivity 1 (Balle & Wang 2018, Thm 8):
    δ = Φ(1/(2σ) − ε0σ) − e^{ε0} Φ(−1/(2σ) − ε0σ)."""
    a, b = 0.5 / sigma - eps0 * sigma, -0.5 / sigma - eps0 * sigma
    return float(special.ndtr(a) - math.exp(eps0 + special.log_ndtr(b)))


def gaussian_epsilon(delta0: float, sigma: float, gaussian: str = "analytic") -> float:
    """ε0 of one Gaussian mechanism at δ0: classical σ = sqrt(2 ln(1.25/δ0))/ε0 or exact."""
    if gaussian == "classical":
        return math.sqrt(2.0 * math.log(1.25 / delta0)) / sigma
    if gaussian_delta(0.0, sigma) <= delta0:
        return 0.0
    hi = 1.0
    while gaussian_delta(hi, sigma) > delta0:
        hi *= 2.0
    return float(
        optimize.brentq(
            lambda e: gaussian_delta(e, sigma) - delta0, 0.0, hi, xtol=1e-14, rtol=1e-14
        )
    )


def _advanced(eps1: float, steps: int, delta2: float, form: str = "expm1") -> float:
    """Dwork–Rothblum–Vadhan 2010: ε = ε'·sqrt(2T ln(1/δ'')) + T ε'(e^{ε'} − 1) (or + T ε'²);
    math.inf where that overflows (ε' > ~700)."""
    if not math.isfinite(eps1) or eps1 > 700.0:
        return math.inf
    second = eps1 * eps1 if form == "square" else eps1 * math.expm1(eps1)
    return eps1 * math.sqrt(2.0 * steps * math.log(1.0 / delta2)) + steps * second


def _epsilon_at_split(
    frac: float, q, sigma, steps, delta, variant, gaussian, form="expm1"
) -> float:
    delta2 = frac * delta  # δ''
    delta0 = (1.0 - frac) * delta / (steps * q)  # per-lot δ0, so that T·q·δ0 + δ'' = δ
    if delta0 >= 1.0:  # every mechanism is (0, 1)-DP
        eps0 = 0.0
    else:
        eps0 = gaussian_epsilon(delta0, sigma, gaussian)
    if variant == "paper":
        eps1 = q * eps0
    elif eps0 > 700.0:  # log(1 + q(e^ε0 − 1)) without overflow
        eps1 = eps0 + math.log(q) + math.log1p(-(1.0 - q) * math.exp(-eps0) / q) if q < 1 else eps0
    else:
        eps1 = math.log1p(q * math.expm1(eps0))
    return _advanced(eps1, steps, delta2, form)


def epsilon_and_split(
    q: float,
    sigma: float,
    steps: int,
    delta: float,
    variant: str = "paper",
    gaussian: str | None = None,
    form: str = "expm1",
):
    """(ε, δ''/δ) with the split of δ optimised; see module docstring for the variants and forms."""
    q, sigma, steps, delta = check_q(q), check_sigma(sigma), check_steps(steps), check_delta(delta)
    check_choice(variant, "variant", VARIANTS)
    check_choice(form, "form", FORMS)
    gaussian = ("classical" if variant == "paper" else "analytic") if gaussian is None else gaussian
    check_choice(gaussian, "gaussian", GAUSSIANS)
    if steps == 0:
        return 0.0, None
    f = lambda u: _epsilon_at_split(
        special.expit(u), q, sigma, steps, delta, variant, gaussian, form
    )
    grid = np.linspace(-12.0, 12.0, 49)
    vals = [f(u) for u in grid]
    i = int(np.argmin(vals))
    if not math.isfinite(vals[i]):
        return math.inf, None
    lo, hi = grid[max(0, i - 1)], grid[min(len(grid) - 1, i + 1)]
    res = optimize.minimize_scalar(f, bounds=(lo, hi), method="bounded", options={"xatol": 1e-10})
    best = min((res.fun, res.x), (vals[i], grid[i]))
    return float(best[0]), float(special.expit(best[1]))


def epsilon(
    q: float,
    sigma: float,
    steps: int,
    delta: float,
    variant: str = "paper",
    gaussian: str | None = None,
    form: str = "expm1",
) -> float:
    """ε of ``steps`` lots under strong composition (math.inf where the bound overflows).
    ``variant="paper"`` is NOT a valid bound, nor is ``form="square"``."""
    return epsilon_and_split(q, sigma, steps, delta, variant, gaussian, form)[0]
