"""Privacy accounting for DP-SGD (pure numpy/scipy; no torch).

Modules: ``moments`` (Abadi et al. 2016), ``rdp`` (Mironov, Talwar & Zhang 2019), ``pld``
(connect-the-dots PLD, FFT composition), ``strong_composition`` (Figure 2 comparator),
``calibrate`` (σ for a target ε, steps within a budget), ``ledger`` (the record a run keeps).
"""
from . import calibrate, moments, pld, rdp, strong_composition
from .ledger import ACCOUNTANTS, CONVENTIONS, Entry, Ledger

__all__ = ["Ledger", "Entry", "ACCOUNTANTS", "CONVENTIONS", "moments", "rdp", "pld",
           "strong_composition", "calibrate"]
