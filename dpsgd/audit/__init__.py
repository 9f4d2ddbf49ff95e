"""Empirical privacy audits of DP-SGD: ``python -m dpsgd.audit --help``.

An audit plays the distinguishing game of a DP guarantee (Abadi et al. 2016, Def. 1) against the
real code path and turns what it observes into a lower bound ε_lb on ε (or a test of the claim)
that holds with confidence 1 − α; ε_lb > ε_claimed proves a bug. Two audits, one sub-package
each, and the one module they share:

* ``variants`` — the broken mechanisms both audits must catch (``break_mechanism``);
* ``game/`` — the one-step distinguishing game (``python -m dpsgd.audit step``): ``game.settings``,
  ``game.play``, ``game.stats``, ``game.claim``, ``game.cli``;
* ``onerun/`` — the one-run audit of a training run (``python -m dpsgd.audit run``, ``rescore``,
  ``bound``): ``onerun.run``, ``onerun.instrument``, ``onerun.canaries``, ``onerun.placement``,
  ``onerun.observe``, ``onerun.report``, ``onerun.bound_file``, and its statistics
  ``onerun.stats.bounds``, ``onerun.stats.family``, ``onerun.stats.order_stats``,
  ``onerun.stats.noise_check``, ``onerun.stats.simulate``.

Nothing is imported here: ``python -m dpsgd.audit run`` loads only what the run needs.
Details (what each module holds): docs/AUDIT.md, "dpsgd/audit/__init__.py".
"""
