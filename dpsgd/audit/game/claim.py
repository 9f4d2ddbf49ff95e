"""The ε the analysis claims for the one audited DP-SGD step — the number the lower bound is held
to.

One step of DP-SGD on a Poisson lot with inclusion probability q, noise σC per clipping group and k
clipping groups of bound C each. Under the ``joint`` convention the k groups form one Gaussian
mechanism of ℓ2-sensitivity C√k and noise σC per coordinate, i.e. noise multiplier σ/√k
(sensitivity/noise ratio μ = √k/σ). Its ε comes from

* every accountant in ``cfg.accountants`` through ``dpsgd.accountant.Ledger`` (the record a training
  run keeps), one entry (q, σ, count = 1, groups = k);
* for q = 1, the exact ε of the Gaussian mechanism (Balle & Wang 2018, Thm 8):
  δ(ε) = Φ(μ/2 − ε/μ) − e^ε Φ(−μ/2 − ε/μ), solved for ε by
  ``dpsgd.accountant.strong_composition.gaussian_epsilon`` at noise multiplier 1/μ = σ/√k, as
  ``dpsgd.accountant.compose.charge`` charges a lot under the joint convention.

Each of these is an upper bound on the true ε of a correct implementation (PLD and the exact form
are tight), so an audit lower bound above any of them proves the code is not the analysed mechanism.
"""

from __future__ import annotations

from dpsgd.accountant import Ledger, compose
from dpsgd.accountant.events import Poisson
from dpsgd.accountant.strong_composition import gaussian_epsilon

from .settings import AuditConfig

CONVENTION = "joint"  # k groups at noise σC each = one Gaussian mechanism with multiplier σ/√k


def claimed_epsilon(cfg: AuditConfig, groups: int) -> dict:
    """{accountant: ε} for one step of the configured mechanism, plus ``exact`` when q = 1."""
    out = {}
    if cfg.accountants:
        led = Ledger()
        led.record(Poisson(cfg.q, cfg.sigma, groups), 1, "audit")
        for acc in cfg.accountants:
            out[acc] = float(led.epsilon(cfg.delta, accountant=acc, convention=CONVENTION)[0])
    if cfg.q == 1.0:  # one lot charged as one Gaussian mechanism at σ/√k
        _, sigma_eff, _ = compose.charge(cfg.q, cfg.sigma, groups, CONVENTION)
        out["exact"] = gaussian_epsilon(cfg.delta, sigma_eff, "analytic")
    return out
