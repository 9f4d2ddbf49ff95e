"""Empirical privacy audit of the DP-SGD step: ``python -m dpsgd.audit --help``.

A DP guarantee (ε, δ) bounds how well *any* test can tell M(D) from M(D') for neighbouring datasets
D, D' (Abadi et al. 2016, Def. 1). The audit plays that distinguishing game against the real code
path and turns the observed error counts into a lower bound ε_lb on ε that holds with confidence
1 − α (95 % by default). A sound implementation has ε_lb ≤ ε_claimed (with probability ≥ 1 − α);
ε_lb > ε_claimed proves a bug.

Modules, one idea each:

* ``settings`` — ``AuditConfig`` (settings ``tiny`` / ``mnist`` / ``mnist_other``, mechanisms ``correct`` /
  ``no_clip`` / ``noise_div10`` / ``realised_lot``) and ``AuditResult``;
* ``game``     — the gradient canary, D = ∅ vs D' = {canary} through ``dpsgd.mechanism.optim.DPSGD``, the
  scores, and ``run_audit`` (game → statistics → claimed ε);
* ``stats``    — ε ≥ log((1 − δ − FNR)/FPR) (Kairouz et al. 2015) with Clopper–Pearson bounds on
  held-out error counts;
* ``claim``    — the ε the accountants claim for the audited step, and for q = 1 the exact
  Gaussian-mechanism ε (Balle & Wang 2018, Thm 8, from ``dpsgd.accountant.strong_composition``);
* ``cli``      — the command line of the one-step game (``__main__`` dispatches ``run``, ``rescore``, ``bound``
  and ``step``).

The one-run audit of a training run (``python -m dpsgd.audit run``):

* ``run``, ``instrument``, ``canaries``, ``observe``, ``variants`` — the audited run, its canaries, the
  white-box observer and its score, the broken mechanisms;
* ``onerun``   — the family-free one-run bounds: Steinke, Nasr & Jagielski 2023 ((ε, δ)) and the f-DP
  recursion of Mahloujifar, Melis & Chaudhuri 2024 (μ-GDP, and any trade-off curve);
* ``family``   — the claim as the null hypothesis: the f-DP test against the claimed mechanism's family
  (Poisson-subsampled Gaussian at q, T lots, k groups, noise σ′), σ_ub and ε_lb;
* ``report``   — audit.json and audit_scores.csv;
* ``bound``    — ``python -m dpsgd.audit bound``: every bound of a score file against a claim;
* ``simulate`` — the idealised one-run game, simulated without training.
"""
from .claim import claimed_epsilon
from .cli import format_result, main
from .game import run_audit
from .settings import MECHANISMS, SETTING_MECHANISMS, SETTINGS, AuditConfig, AuditResult
from .stats import cp_upper, eps_from_rates, epsilon_lower_bound

__all__ = ["AuditConfig", "AuditResult", "MECHANISMS", "SETTING_MECHANISMS", "SETTINGS", "run_audit", "claimed_epsilon",
           "cp_upper", "eps_from_rates", "epsilon_lower_bound", "format_result", "main"]
