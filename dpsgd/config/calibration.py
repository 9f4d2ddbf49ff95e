"""σ from the target ε: ``privacy.calibrate_sigma=true`` sets ``privacy.sigma`` so that the planned
lots spend at most ``privacy.target_epsilon`` under the configured accountant and convention.

One σ search (``dpsgd/accountant/calibrate.py:smallest_sigma``, bisection on log σ): over the
configured accountant's ε after the planned lots for Poisson sampling
(``calibrate.sigma_for_epsilon``), over the sampler's own charges (the events
``dpsgd/mechanism/sampling.py:record_lots`` records) in a ``Ledger`` for the others. Either way ε(σ)
is kept at or below the target and within 0.5 % of it. The k of the charge is the number of
separately clipped groups (``clipping_groups``), the rule the clipping engine clips by.
"""

from __future__ import annotations

import functools

from dpsgd.core.errors import ConfigError
from dpsgd.data.datasets import dataset_info
from dpsgd.models.networks import build_unloaded, frozen_names
from dpsgd.models.trainable import fine_tune


def calibrated_sigma(c, sampler, shape) -> float:
    """σ such that the planned lots (training.epochs, or training.max_steps if fewer) of the
    ``Config`` ``c`` spend at most privacy.target_epsilon under the configured accountant and
    convention (``dpsgd/accountant/calibrate.py:sigma_for_epsilon``; ε within 0.5 % below the
    target)."""

    p, t, key = c.privacy, c.training, "privacy.calibrate_sigma=true"
    if not p.private:
        raise ConfigError(f"{key}: a non-private run has no σ to calibrate")
    if p.target_epsilon is None:
        raise ConfigError(
            f"{key}: needs privacy.target_epsilon (the ε to spend over training.epochs)"
        )
    if p.sampling == "shuffle":
        raise ConfigError(
            f"{key}: shuffle is charged without amplification; set privacy.sigma (or another "
            "sampling)"
        )
    if c.model.projection == "pca":
        raise ConfigError(
            f"{key}: does not include the DP-PCA release; set privacy.sigma or "
            "model.projection=none"
        )
    steps = t.epochs * sampler.lots_per_epoch()
    if t.max_steps is not None:
        steps = min(steps, t.max_steps)
    if steps < 1:
        raise ConfigError(f"{key}: training.epochs={t.epochs} plans no lot to calibrate σ for")
    model = build_unloaded(c.model, shape, dataset_info(c.dataset).classes)
    k = clipping_groups(model, p.clipping, c.model.freeze, c.model)
    try:
        return sigma_for_lots(
            sampler, p.target_epsilon, p.delta, steps, c.accountant.name, k, p.convention
        )
    except ValueError as e:
        raise ConfigError(f"{key}: {str(e).splitlines()[0]}") from None


def sigma_for_lots(
    sampler, target_epsilon, delta, steps, accountant, groups=1, convention="joint"
) -> float:
    """The smallest σ (ε within 0.5 % below the target) at which ``steps`` lots of ``sampler``, k =
    ``groups``, spend at most ``target_epsilon`` at δ under ``accountant``: the σ search the command
    line and ``dpsgd.PrivateTrainer`` share. ValueError, naming the value, where none does."""
    if sampler.name == "shuffle":
        raise ValueError("shuffle is charged without amplification; give sigma, not a target ε")
    if sampler.name == "poisson":
        return _sigma_for_epsilon(
            target_epsilon, delta, sampler.q, steps, accountant, groups, convention
        )
    if sampler.name in ("cyclic_poisson", "cyclic"):  # one Poisson-subsampled Gaussian per cycle
        charges = -(-int(steps) // sampler.cycle)
        return _sigma_for_epsilon(
            target_epsilon, delta, sampler.q, charges, accountant, groups, convention
        )
    return _sigma_for_sampler(sampler, target_epsilon, delta, steps, accountant, groups, convention)


@functools.lru_cache(maxsize=32)
def _sigma_for_epsilon(target, delta, q, steps, accountant, groups, convention) -> float:
    """``sigma_for_epsilon``, remembered per process (a command validates its config more than
    once)."""
    from dpsgd.accountant.calibrate import sigma_for_epsilon

    return float(sigma_for_epsilon(target, delta, q, steps, accountant, groups, convention))


def _sigma_for_sampler(
    sampler, target, delta, steps, accountant, groups, convention, rtol=0.005
) -> float:
    """σ for samplers other than Poisson: the one σ search (``calibrate.smallest_sigma``) over the
    sampler's own charges (its events for the ``steps`` lots, ``record_lots``) in a ledger."""
    from dpsgd.accountant import Ledger
    from dpsgd.accountant.calibrate import smallest_sigma
    from dpsgd.mechanism.sampling import record_lots

    def eps(sigma: float) -> float:
        led = Ledger()
        record_lots(led, sampler, sigma, steps, 0, groups)
        return led.epsilon(delta, accountant, convention)[0]

    return smallest_sigma(eps, target, rtol, f"{sampler.name} ({accountant})")


def clipping_groups(model, clipping: str, freeze: str = "none", m=None) -> int:
    """k, the separately clipped groups of ``model`` once ``model.freeze`` has frozen its public
    tensors and ``m.trainable`` (``m``: the ``model.*`` group, when given) has chosen what trains
    (both in place, as a run does): ``dpsgd/mechanism/clipping/groups.py:clipping_groups``, the
    rule the engine clips by."""
    from dpsgd.mechanism.clipping.groups import clipping_groups as groups

    for n in frozen_names(model, freeze):
        model.get_parameter(n).requires_grad_(False)
    if m is not None:
        fine_tune(model, m.trainable, m.lora_rank, m.lora_alpha)
    return len(groups(model, clipping))
