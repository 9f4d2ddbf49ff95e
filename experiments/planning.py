"""What a planned training run will be, before it runs: its composed config, a sweep's points, its
epochs.

The experiment runners (``experiments.paper``, ``experiments.frontier``) estimate their wall time
from the configs the runs will get. Those come from Hydra's compose API over ``conf/``
(``dpsgd.launch.main.compose``), exactly as ``python -m dpsgd.train`` composes them, typed by the
dataclasses of ``dpsgd/config/schema.py`` (whose defaults fill the keys a config file leaves out, as
in a run) but not validated: every default is read from ``conf/`` or those dataclasses, never
restated here. A sweep file's points are its ``hydra.sweeper.params`` expanded by Hydra's override
parser, in the order Hydra's basic sweeper runs them.
"""

from __future__ import annotations

import functools
import itertools
from dataclasses import fields

from dpsgd.accountant import Ledger
from dpsgd.accountant.events import Poisson
from dpsgd.config.schema import GROUPS, Config
from dpsgd.launch.main import compose
from dpsgd.mechanism.pca import charge_pca

from . import claims


def typed(cfg) -> Config:
    """A composed config as the dataclasses of ``dpsgd/config/schema.py``, their defaults for the
    keys it leaves out (not validated: a setting training would refuse is not refused here)."""
    from omegaconf import OmegaConf

    raw = OmegaConf.to_container(cfg, resolve=True)
    top = {f.name for f in fields(Config)} - set(GROUPS)
    return Config(
        **{g: cls(**(raw.get(g) or {})) for g, cls in GROUPS.items()},
        **{k: v for k, v in raw.items() if k in top},
    )


@functools.lru_cache(maxsize=None)
def composed(*overrides: str) -> Config:
    """The typed config of these command-line overrides (``typed``); cached, so read it only."""
    return typed(compose(list(overrides)))


def sweep_points(name: str) -> list[list[str]]:
    """The overrides of each point of ``conf/sweep/<name>.yaml`` (without ``+sweep=<name>``
    itself)."""
    from hydra.core.override_parser.overrides_parser import OverridesParser

    params = compose([f"+sweep={name}"], hydra_config=True).hydra.sweeper.params or {}
    parser = OverridesParser.create()
    axes = []
    for line in (f"{key}={value}" for key, value in params.items()):
        o = parser.parse_override(line)
        key = o.get_key_element()
        axes.append(
            [f"{key}={v}" for v in o.sweep_string_iterator()] if o.is_sweep_override() else [line]
        )
    return [list(point) for point in itertools.product(*axes)]


def clipping_groups_estimate(c) -> int:
    """k for the estimate: 1 with global clipping, else 2 (the two weight tensors of the paper's
    MLP). Only the time estimate uses it; a run counts its own clipping groups."""
    return 1 if c.privacy.clipping == "global" else 2


def epochs_needed(c, n: int = claims.MNIST_N) -> float:
    """Epochs a run of the composed config ``c`` takes on ``n`` training examples:
    ``training.epochs``, or fewer when its target ε stops it first (σ fixed: the lots within the
    budget under the run's accountant and convention, the DP-PCA release charged first)."""
    p, epochs = c.privacy, float(c.training.epochs)
    if not p.private or p.target_epsilon is None or p.calibrate_sigma:
        return epochs
    led = Ledger()
    if c.model.projection == "pca" and p.sigma_p > 0:
        charge_pca(led, p.sigma_p, p.pca_fraction)
    q = p.lot_size / n
    lots = led.steps_within(
        p.target_epsilon,
        p.delta,
        Poisson(q, p.sigma, clipping_groups_estimate(c)),
        c.accountant.name,
        p.convention,
    )
    return min(epochs, lots * p.lot_size / n)
