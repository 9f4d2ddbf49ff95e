"""The mechanism around a model, built once: clipping engine, sampler, plan, DP step.

``assemble`` is the one builder: the command line (``dpsgd/run/parts.py:build``) and the Python API
(``dpsgd.PrivateTrainer``) call it with the same arguments a configuration holds, so a user's model
gets the very objects, checks and charge that a preset gets. The plan is built from the sampler's
own event at σ and the k groups the engine clips (``Sampler.event(σ, k)``), so what the step noises
and what the ledger charges cannot differ. With correlated noise (``noise`` = bandmf|blt) the sampler
is the cyclic one its charge needs (``cyclic.participation``) and the plan carries the strategy
matrix optimised for the run's ``horizon`` (or the one a checkpoint gives).
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from dpsgd.accountant import Ledger
from dpsgd.mechanism.correlated import strategy as strategies
from dpsgd.mechanism.clipping import PerExampleClipper
from dpsgd.mechanism.cyclic import make_run_sampler
from dpsgd.mechanism.noise import GaussianNoise
from dpsgd.mechanism.optim import DPSGD
from dpsgd.mechanism.plan import Plan
from dpsgd.mechanism.sampling import Sampler


PROOF_SAMPLE = 32  # the first training examples the clipper proves on before the first lot


class Mechanism(NamedTuple):
    clipper: PerExampleClipper  # Σ_i clip_C(g_i), per group
    sampler: Sampler  # the lots, and q for the accountant
    plan: Plan  # the charged event (σ, k), C, L
    dp: DPSGD  # clip, noise, divide by L, descend


def assemble(model: torch.nn.Module, n_examples: int, *, lot_size: int, clip_norm: float,
             sigma: float, noise: GaussianNoise, sampler_seed: int, lr: float,
             private: bool = True, sampling: str = "poisson", max_lot_size: int | None = None,
             clipping: str = "global", mode: str = "auto", momentum: float = 0.0,
             augment_multiplicity: int = 1, augment=None, check_finite: bool = True, loss=None,
             sample: tuple | None = None, optimizer=None, precision: str = "fp32",
             noise_kind: str = "independent", bands: int | None = None, blt_buffers: int = 4,
             horizon: int | None = None, strategy: strategies.Strategy | None = None,
             ) -> Mechanism:  # fmt: skip
    """The mechanism of one run around ``model`` (its weights final, on its device).

    Args:
        model: the network (refused, naming the layer, if it mixes examples: BatchNorm; with
            ``sample``, also a model whose examples mix in its forward).
        n_examples, lot_size, clip_norm, sigma: N; L (q = L/N for Poisson); C; σ (noise std σC;
            0 with ``private``: clipped, not noised, not charged).
        noise, sampler_seed: the Gaussian source; the seed of the sampler's generator.
        lr, momentum: the update (the built-in SGD, heavy ball with ``momentum``).
        private: False: the non-private baseline, a plain step (one backward pass of the summed
            loss, divided by L: ``DPSGD(plain=True)``), nothing clipped, noised, charged or proved.
        sampling, max_lot_size: ``poisson``, ``fixed_size``, ``truncated_poisson`` (its cap),
            ``balls_in_bins``, ``shuffle``.
        clipping, mode: ``global`` (k = 1) or ``per_layer`` (k = layers, derived from the model,
            never given); the engine ``auto``, ``ghost`` or ``vmap``.
        augment_multiplicity, augment: K augmented copies per example, made by the step.
        check_finite: refuse a non-finite example (one device sync per physical batch).
        loss: ``loss(output, target) -> [B]``; None: cross-entropy; a ``BatchLoss`` for batches.
        sample: ``(x, y)``, ``(x, y, generator)`` or ``(batch, None)``: the clipper proves on these
            few examples, before the first lot, that they are independent and its engine's
            structure holds (``PerExampleClipper.prove``; NotPerExample refuses a mixing model).
        optimizer, precision: a torch optimizer taking g̃ in ``.grad`` (None: the built-in
            update); ``fp32`` or ``bf16`` (the forward pass under autocast).
        noise_kind, bands, blt_buffers, horizon, strategy: ``independent``, ``bandmf`` (b bands) or
            ``blt`` (d buffers): correlated noise (mechanism/correlated/) under its cyclic sampler
            (cyclic.py), its strategy optimised for ``horizon`` lots, or given (a resume's).
    """
    clipper = PerExampleClipper(
        model,
        clip_norm if private else None,
        clipping=clipping,
        mode=mode,
        check_finite=check_finite,
        loss=loss,
        precision=precision,
    )
    gen = torch.Generator().manual_seed(sampler_seed)
    sampler = make_run_sampler(noise_kind, sampling, n_examples, lot_size, gen, max_lot_size, bands)
    charged = private and sigma > 0
    if charged and noise_kind != "independent" and strategy is None:
        strategy = _strategy(noise_kind, bands, blt_buffers, horizon, sampler, momentum)
    event = sampler.event(sigma, len(clipper.groups)) if charged else None
    plan = Plan(event, clip_norm, lot_size, sampler, strategy if charged else None)
    dp = DPSGD(
        model,
        clipper,
        noise,
        plan,
        lr=lr,
        momentum=momentum,
        augment_multiplicity=augment_multiplicity,
        augment=augment,
        optimizer=optimizer,
        plain=not private,
    )
    if sample is not None:
        dp.prove(*sample)
    return Mechanism(clipper, sampler, plan, dp)


def _strategy(noise_kind, bands, blt_buffers, horizon, sampler, momentum):
    """The correlated noise's strategy, optimised for ``horizon`` lots of ``sampler``'s cycle."""
    if horizon is None:
        raise ValueError(f"noise={noise_kind}: the horizon (lots) its strategy is optimised for")
    return strategies.for_run(noise_kind, bands, blt_buffers, horizon, sampler.cycle, momentum)


def planned_lots(
    sampler: Sampler,
    sigma: float,
    groups: int,
    lots: int,
    target_epsilon: float | None,
    delta: float,
    accountant: str,
    convention: str = "joint",
    ledger: Ledger | None = None,
) -> int:
    """The lots a run plans, the horizon a correlated-noise strategy is optimised for: ``lots``
    (epochs × lots per epoch, or max_steps), fewer where the target ε stops the run first (the
    charges its budget allows after ``ledger``'s, e.g. DP-PCA, each covering the sampler's cycle)."""
    lots = max(1, int(lots))
    if target_epsilon is None or not sigma > 0:
        return lots
    led = ledger if ledger is not None else Ledger()
    charges = led.steps_within(
        target_epsilon, delta, sampler.event(sigma, groups), accountant, convention
    )
    return max(1, min(lots, charges * getattr(sampler, "cycle", 1)))
