"""Privacy accounting for DP-SGD (pure numpy/scipy; no torch).

Modules: ``moments`` (Abadi et al. 2016), ``rdp`` (Mironov, Talwar & Zhang 2019), ``pld``
(connect-the-dots PLD, FFT composition; built on ``pld_lot`` and ``pld_fft``), ``strong_composition``
(Figure 2 comparator), ``compose`` (the per-layer convention and the composition of a run's releases),
``calibrate`` (σ for a target ε, lots within a budget), ``events`` (the typed release a sampler returns and the ledger records), ``ledger`` (the record a run keeps). ``limits``: the ranges
the accountants serve (SIGMA_MIN, ..., STEPS_MAX) and the argument checks against them, the one
source the training config and the privacy command line use too.
"""
from . import _checks as limits
from . import calibrate, compose, events, moments, pld, rdp, strong_composition
from .compose import ACCOUNTANTS, CONVENTIONS
from .ledger import Entry, Ledger

__all__ = ["Ledger", "Entry", "ACCOUNTANTS", "CONVENTIONS", "limits", "moments", "rdp", "pld",
           "strong_composition", "calibrate", "compose", "events"]
