"""Empirical privacy audits of DP-SGD: ``python -m dpsgd.audit --help``.

A DP guarantee (ε, δ) bounds how well *any* test can tell M(D) from M(D') for neighbouring datasets
D, D' (Abadi et al. 2016, Def. 1). An audit plays that distinguishing game against the real code
path and turns what it observes into a lower bound ε_lb on ε (or a test of the claim) that holds
with confidence 1 − α (95 % by default). A sound implementation has ε_lb ≤ ε_claimed (with
probability ≥ 1 − α); ε_lb > ε_claimed proves a bug.

Two audits, one sub-package each, and the one module they share:

* ``variants`` — the broken mechanisms both audits must catch (the list and its one implementation,
  ``break_mechanism``);
* ``game/``    — the one-step distinguishing game (``python -m dpsgd.audit step``):

  * ``game.settings`` — ``AuditConfig`` (settings ``tiny`` / ``mnist`` / ``mnist_other``, mechanisms from
    ``variants.GAME_VARIANTS``) and ``AuditResult``;
  * ``game.play``     — the gradient canary, D = ∅ vs D' = {canary} through ``dpsgd.mechanism.optim.DPSGD``,
    the scores, and ``run_audit`` (game → statistics → claimed ε);
  * ``game.stats``    — ``clopper_pearson_bound``: ε ≥ log((1 − δ − FNR)/FPR) (Kairouz et al. 2015) with
    Clopper–Pearson bounds on held-out error counts of one threshold test;
  * ``game.claim``    — the ε the accountants claim for the audited step, and for q = 1 the exact
    Gaussian-mechanism ε (Balle & Wang 2018, Thm 8);
  * ``game.cli``      — its command line;

* ``onerun/``  — the one-run audit of a training run (``python -m dpsgd.audit run``, ``rescore``, ``bound``):

  * ``onerun.run``        — the audited run (``audit_train``), its command line and ``rescore``;
  * ``onerun.instrument`` — ``AuditOptions`` and the instrument the run carries (canaries, observer, variant);
  * ``onerun.canaries``   — the gradient and input canaries and their secret bits;
  * ``onerun.placement``  — where a gradient canary lives: Dirac coordinates, or the class-sum directions of
    the softmax output layer that no real example's gradient touches (``audit.placement``);
  * ``onerun.observe``    — the white-box observer and its per-canary score;
  * ``onerun.stats.bounds``     — the family-free one-run bounds: ``steinke_bound`` (Steinke, Nasr & Jagielski
    2023, (ε, δ)) and the f-DP recursion of Mahloujifar, Melis & Chaudhuri 2024 (μ-GDP, any trade-off curve);
  * ``onerun.stats.family``     — the claim as the null hypothesis: the f-DP test against the claimed mechanism's
    family (Poisson-subsampled Gaussian at q, T lots, k groups, noise σ′), σ_ub and ε_lb;
  * ``onerun.stats.order_stats`` — the order-statistics bound of Xiang et al. 2025 over all released guesses, in the
    claim's family, assuming independent canaries (proved under the null-space placement with the claimed
    normalisation; a labelled heuristic otherwise);
  * ``onerun.stats.noise_check`` — the exact χ² test of the noise along the canaries' directions (null-space placement);
  * ``onerun.report``     — audit.json and audit_scores.csv;
  * ``onerun.bound_file`` — ``python -m dpsgd.audit bound``: every bound of a score file against a claim;
  * ``onerun.stats.simulate``   — the idealised one-run game, simulated without training.

Nothing is imported here: ``python -m dpsgd.audit run`` loads only what the run needs.
"""
