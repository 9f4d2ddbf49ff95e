"""The update of the command line: the ``optimizer`` group and the learning-rate schedule.

DP-SGD's privacy is in the noisy gradient g̃ = (Σ_i clip_C(g_i) + N(0, σ²C²)) / L; whatever the
optimizer does with g̃ (momentum, Adam's moment estimates, weight decay, a schedule) reads only g̃
and the parameters, so it is post-processing and costs nothing more (Dwork & Roth 2014, Prop. 2.1).
DP-Adam is Adam on g̃.

``optimizer=sgd`` (the default) is DP-SGD's own update, ``θ ← θ − η g̃`` or heavy ball with
``training.momentum`` (``dpsgd/mechanism/optim.py:DPSGD``): the presets run it, bit for bit as
before. ``optimizer=adam`` / ``adamw`` build ``torch.optim.Adam`` / ``AdamW`` with ``betas``,
``eps`` and ``weight_decay``; ``optimizer=custom optimizer._target_=pkg.Class`` any
``torch.optim.Optimizer`` class with ``optimizer.args``. Each is built on the trainable parameters
at ``training.lr``; the schedule sets the learning rate of every epoch (``lr_at``):

    paper     the paper code's: η falls linearly from training.lr to training.lr_end over
              training.lr_saturate_epochs epochs, then stays (the presets)
    constant  training.lr throughout
    linear    from training.lr to training.lr_end over training.epochs
    cosine    from training.lr to training.lr_end along half a cosine over training.epochs
"""

from __future__ import annotations

import math

from dpsgd.core.checks import choice, fmt, num
from dpsgd.core.errors import ConfigError

OPTIMIZERS = ("sgd", "adam", "adamw", "custom")
SCHEDULES = ("paper", "constant", "linear", "cosine")


def validate_optimizer(c) -> None:
    """The ``optimizer.*`` group (and ``training.schedule``), checked and coerced in place."""
    o = c.optimizer
    choice("optimizer.name", o.name, OPTIMIZERS)
    choice("training.schedule", c.training.schedule, SCHEDULES)
    if not isinstance(o.args, dict):
        raise ConfigError(f"optimizer.args={fmt(o.args)}: must be a mapping of keyword arguments")
    if o._target_ == "???":  # optimizer=custom, and no class given (OmegaConf's missing value)
        o._target_ = None
    if (o.name == "custom") != (o._target_ is not None):
        raise ConfigError(
            "optimizer._target_: optimizer=custom builds the class optimizer._target_ "
            "(pkg.module.Class)"
            if o.name == "custom"
            else f"optimizer._target_={o._target_}: set optimizer=custom to build it"
        )
    if o.name == "sgd":
        if o.args or o.weight_decay:
            raise ConfigError(
                f"optimizer.weight_decay={o.weight_decay}, optimizer.args={fmt(o.args)}: "
                "optimizer=sgd is DP-SGD's own update (lr, momentum); use adam, adamw or custom"
            )
        return
    if c.training.momentum:
        raise ConfigError(
            f"training.momentum={c.training.momentum}: the heavy ball of optimizer=sgd; "
            f"optimizer={o.name} has its own (optimizer.betas, optimizer.args)"
        )
    if not isinstance(o.betas, (list, tuple)) or len(o.betas) != 2:
        raise ConfigError(f"optimizer.betas={fmt(o.betas)}: must be two numbers in [0, 1)")
    o.betas = [
        num(f"optimizer.betas[{i}]", b, lo=0, hi=1, hi_open=True) for i, b in enumerate(o.betas)
    ]
    o.eps = num("optimizer.eps", o.eps, lo=0, lo_open=True)
    o.weight_decay = num("optimizer.weight_decay", o.weight_decay, lo=0)
    if o.name == "custom":
        _check_target(o)


def _check_target(o):
    """The ``torch.optim.Optimizer`` class ``optimizer._target_`` names; ConfigError otherwise."""
    import importlib

    import torch

    module, _, name = str(o._target_).rpartition(".")
    try:
        cls = getattr(importlib.import_module(module), name)
    except (ImportError, AttributeError, ValueError):
        raise ConfigError(
            f"optimizer._target_={o._target_}: cannot be imported (pkg.module.Class)"
        ) from None
    if not (isinstance(cls, type) and issubclass(cls, torch.optim.Optimizer)):
        raise ConfigError(f"optimizer._target_={o._target_}: not a torch.optim.Optimizer class")
    return cls


def build_optimizer(o, params, lr: float):
    """The torch optimizer of ``optimizer.*`` over ``params`` at ``lr``; None for ``sgd`` (DP-SGD's
    own update). ConfigError naming optimizer.args when the class refuses them."""
    import torch

    if o.name == "sgd":
        return None
    params = list(params)
    if o.name in ("adam", "adamw"):
        cls = torch.optim.Adam if o.name == "adam" else torch.optim.AdamW
        return cls(params, lr=lr, betas=tuple(o.betas), eps=o.eps, weight_decay=o.weight_decay,
                   **dict(o.args))  # fmt: skip
    kw = dict(o.args)
    if o.weight_decay:
        kw.setdefault("weight_decay", o.weight_decay)
    try:
        return _check_target(o)(params, lr=lr, **kw)
    except (TypeError, ValueError) as e:
        raise ConfigError(f"optimizer.args={fmt(o.args)}: {str(e).splitlines()[0]}") from None


def lr_at(t, epoch0: int) -> float:
    """The learning rate of epoch ``epoch0`` (0-based) under ``training.schedule`` (module doc)."""
    if t.schedule == "constant":
        return t.lr
    if t.schedule in ("linear", "cosine"):
        frac = min(1.0, epoch0 / max(1, t.epochs - 1))
        if t.schedule == "cosine":
            frac = (1 - math.cos(math.pi * frac)) / 2
        return t.lr - (t.lr - t.lr_end) * frac
    # paper: the paper code's VaryRate: lr falls linearly from lr to lr_end over the first
    # lr_saturate_epochs epochs (epoch0 = 0 → lr, epoch0 = saturate − 1 → lr_end), then stays
    if t.lr_saturate_epochs <= 1:
        return t.lr_end if t.lr_saturate_epochs == 1 else t.lr
    if epoch0 >= t.lr_saturate_epochs:
        return t.lr_end
    return t.lr - (t.lr - t.lr_end) * epoch0 / (t.lr_saturate_epochs - 1)
