"""Privacy accounting for DP-SGD (pure numpy/scipy; no torch).

Two families of accountants, each a sub-package: ``renyi`` (Rényi DP: ``rdp``, Mironov, Talwar &
Zhang 2019; ``moments``, Abadi et al. 2016; ``wor``; ``allocation``) and ``privacy_loss`` (PLDs:
``pld``, connect-the-dots with FFT composition, built on ``pld_lot`` and ``pld_fft``; ``wor_pld``;
``truncated``; ``shuffle_lower``). Above them: ``strong_composition`` (Figure 2 comparator),
``compose`` (the per-layer convention and the composition of a run's releases), ``calibrate`` (σ for
a target ε, lots within a budget), ``events`` (the typed release a sampler returns and the ledger
records), ``ledger`` (the record a run keeps), ``selection`` and ``last_iterate``. ``limits``: the
ranges the accountants serve (SIGMA_MIN, ..., STEPS_MAX) and the argument checks against them, the
one source the training config and the privacy command line use too. ``moments``, ``rdp`` and
``pld`` are re-exported here, as before.
"""

from . import limits
from . import calibrate, compose, events, risk, strong_composition
from .privacy_loss import pld
from .renyi import moments, rdp
from .compose import ACCOUNTANTS, CONVENTIONS
from .ledger import Entry, Ledger

__all__ = [
    "Ledger",
    "Entry",
    "ACCOUNTANTS",
    "CONVENTIONS",
    "limits",
    "moments",
    "rdp",
    "pld",
    "strong_composition",
    "calibrate",
    "risk",
    "compose",
    "events",
]
