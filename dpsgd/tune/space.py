"""The search space of a private selection: Hydra-style overrides, ``key=a,b,c`` being a choice.

Every point of the grid (the product of the choices) is composed and validated here, before any
work, and charged as the run it will be: q = L/N of the Poisson sampler, its planned lots
(training.epochs × lots per epoch, or training.max_steps if fewer) and k, the separately clipped
groups (``dpsgd/config/calibration.py:clipping_groups``). The selection's base curve must bound
every point of the grid, not only the points drawn (the hyperparameter draw is part of each
candidate run in Papernot & Steinke's analysis).
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass

from dpsgd.accountant.calibrate import lots_for_epochs
from dpsgd.config.model import validate_model
from dpsgd.config.calibration import clipping_groups
from dpsgd.config.overrides import override_key
from dpsgd.config.schema import Config, validate
from dpsgd.core.errors import ConfigError
from dpsgd.launch.cli import compose, data_ready

#: what the driver sets on every candidate itself
RESERVED = (
    "privacy.sigma",
    "privacy.calibrate_sigma",
    "privacy.target_epsilon",
    "seed",
    "resume",
    "hydra.run.dir",
    "dataset.validation",
)


@dataclass(frozen=True)
class Point:
    """One point of the grid: its choices, its overrides (fixed ones first) and its charge."""

    choice: dict
    overrides: tuple
    q: float
    lots: int
    groups: int


def split(overrides: list[str]) -> tuple[list[str], dict]:
    """(fixed overrides, {key: [choices]}); a value with a top-level comma is a choice list."""
    fixed, choices = [], {}
    for a in overrides:
        if "=" not in a:
            raise ConfigError(f"{a}: an override must be key=value")
        key, value = a.split("=", 1)
        k = override_key(a)
        if k in RESERVED or k.startswith("hydra"):
            raise ConfigError(f"{k}: set by the private selection itself (see docs/TUNING.md)")
        if "," in value and not value.lstrip().startswith(("[", "{", "'", '"')):
            vals = [v.strip() for v in value.split(",")]
            if any(not v for v in vals) or len(set(vals)) != len(vals):
                raise ConfigError(f"{k}={value}: choices must be distinct and non-empty")
            choices[key] = vals
        else:
            fixed.append(a)
    return fixed, choices


def grid(fixed: list[str], choices: dict) -> list[tuple[dict, tuple]]:
    """Every point of the product of the choices: ({key: value}, overrides)."""
    keys = list(choices)
    out = []
    for vals in itertools.product(*(choices[k] for k in keys)):
        choice = dict(zip(keys, vals))
        out.append((choice, tuple(fixed) + tuple(f"{k}={v}" for k, v in choice.items())))
    return out


def config(overrides, validation: int, sigma: float = 1.0, seed: int = 0) -> Config:
    """The validated config of one candidate run (σ given, not calibrated; no target-ε stop)."""
    return validate(compose(list(overrides) + run_overrides(validation, sigma, seed)))


def run_overrides(validation: int, sigma: float, seed: int) -> list[str]:
    """What the driver adds to a candidate's overrides: the validation split, its σ and seed."""
    return [
        f"dataset.validation={validation}",
        "privacy.calibrate_sigma=false",
        f"privacy.sigma={sigma!r}",
        "privacy.target_epsilon=null",
        f"seed={seed}",
    ]


def charge(c: Config) -> tuple[float, int, int]:
    """(q, planned lots, k) of a validated candidate config (Poisson sampling, no DP-PCA)."""
    from dpsgd.data.datasets import dataset_info
    from dpsgd.models.networks import build_unloaded

    p, t = c.privacy, c.training
    if not p.private:
        raise ConfigError(
            "privacy.private=false: a private selection trains private candidates only"
        )
    if p.sampling != "poisson":
        raise ConfigError(
            f"privacy.sampling={p.sampling}: the selection charges Poisson-sampled lots only"
        )
    if c.model.projection == "pca":
        raise ConfigError(
            "model.projection=pca: the DP-PCA release is not planned by the selection; use none"
        )
    lots = lots_for_epochs(t.epochs, c.N, p.lot_size)
    if t.max_steps is not None:
        lots = min(lots, t.max_steps)
    if lots < 1:
        raise ConfigError(f"training.epochs={t.epochs}: plans no lot")
    shape = validate_model(c.model, c.dataset)
    model = build_unloaded(c.model, shape, dataset_info(c.dataset).classes)
    return p.lot_size / c.N, int(lots), clipping_groups(model, p.clipping, c.model.freeze, c.model)


def points(overrides: list[str], validation: int) -> list[Point]:
    """The grid's points, each validated (ConfigError naming the first bad key) and charged; the
    dataset is checked to be in its data root."""
    fixed, choices = split(overrides)
    out = []
    for choice, ovr in grid(fixed, choices):
        c = config(ovr, validation)
        q, lots, k = charge(c)
        out.append(Point(choice, ovr, q, lots, k))
    data_ready(c)
    return out
