"""The Python API's arguments, checked by the command line's own validators: one validation, two
callers.

``check_arguments`` takes what ``dpsgd.PrivateTrainer`` takes (and what the engine that will run
its loop will take), puts each value where the configuration holds it (``privacy.sigma``,
``training.lr``, ``accountant.name``, ...) and runs the very checks ``python -m dpsgd.train`` runs
(``validate_privacy``, ``validate_accountant``, ``validate_step``: σ, C, L, δ < 1/N, q and the
charged σ within what the accountants serve, a private run with noise, no target ε without a
charge, a finite learning rate, ...). A refusal is the command line's one line, naming the argument
as the API spells it (``sigma=0.0: a private run needs noise (σ > 0); for a non-private run set
private=False``); ConfigError is a ValueError. What only the API has is checked here too: epochs
that may be fractional, σ left to calibration. The API's default accountant is the tightest valid
one for the sampler (``dpsgd/config/privacy.py:tightest``: PLD), the command line's the
configuration's (the presets: the paper's moments accountant).
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass
from types import SimpleNamespace

from dpsgd.accountant import limits
from dpsgd.accountant.limits import DELTA_DEFAULT
from dpsgd.config.privacy import sigma_served, tightest, validate_accountant, validate_privacy
from dpsgd.config.schema import AccountantConfig, PrivacyConfig, TrainingConfig, validate_step
from dpsgd.core.checks import num
from dpsgd.core.errors import ConfigError

# the configuration key of each API argument (the command line's name in its messages)
KEYS = {
    "privacy.sigma": "sigma",
    "privacy.clip_norm": "clip_norm",
    "privacy.lot_size": "lot_size",
    "privacy.delta": "delta",
    "privacy.allow_large_delta": "allow_large_delta",
    "privacy.private": "private",
    "privacy.sampling": "sampling",
    "privacy.max_lot_size": "max_lot_size",
    "privacy.clipping": "clipping",
    "privacy.grad_sample_mode": "mode",
    "privacy.secure_rng": "secure_rng",
    "privacy.noise_seed": "seed",
    "privacy.target_epsilon": "target_epsilon",
    "privacy.physical_batch_size": "physical_batch_size",
    "accountant.name": "accountant",
    "training.lr": "lr",
    "training.momentum": "momentum",
    "training.precision": "precision",
}
_KEY = re.compile(r"\b(" + "|".join(re.escape(k) for k in KEYS) + r")\b(=(true|false))?")


def api_message(message: str) -> str:
    """A command-line refusal in the API's words: each key as its argument, true/false as
    True/False (``privacy.private=false`` → ``private=False``)."""

    def name(m: re.Match) -> str:
        value = m.group(3)
        return KEYS[m.group(1)] + ("" if value is None else f"={value.capitalize()}")

    return _KEY.sub(name, message)


@dataclass(frozen=True)
class Arguments:
    """The checked and coerced arguments (σ None: to be calibrated; accountant resolved)."""

    lot_size: int
    clip_norm: float
    sigma: float | None
    target_epsilon: float | None
    epochs: float | None
    delta: float
    sampling: str
    max_lot_size: int | None
    accountant: str
    lr: float
    momentum: float
    clipping: str
    mode: str
    physical_batch_size: int | None
    private: bool
    secure_rng: bool
    precision: str = "fp32"


def check_arguments(
    n_examples: int,
    *,
    lot_size: int,
    clip_norm: float = 1.0,
    sigma: float | None = None,
    target_epsilon: float | None = None,
    epochs: float | None = None,
    delta: float = DELTA_DEFAULT,
    sampling: str = "poisson",
    max_lot_size: int | None = None,
    accountant: str | None = None,
    lr: float = 0.1,
    momentum: float = 0.0,
    clipping: str = "global",
    mode: str = "auto",
    physical_batch_size: int | None = None,
    private: bool = True,
    seed: int | None = None,
    secure_rng: bool = False,
    allow_large_delta: bool = False,
    precision: str = "fp32",
) -> Arguments:
    """The API's arguments through the command line's validators (module doc): an ``Arguments``,
    or ConfigError (a ValueError) in one line naming the argument. ``n_examples``: N."""
    try:
        return _checked(n_examples, locals())
    except ConfigError as e:
        raise ConfigError(api_message(str(e))) from None


def _checked(n: int, a: dict) -> Arguments:
    sigma = a["sigma"]
    if (
        a["private"] is True
        and sigma is None
        and (a["target_epsilon"] is None or a["epochs"] is None)
    ):
        raise ConfigError("sigma=None: give sigma, or target_epsilon and epochs to calibrate it")
    p = PrivacyConfig(
        private=a["private"],
        sigma=1.0 if sigma is None else sigma,  # σ to be calibrated: checked once it is
        clip_norm=a["clip_norm"],
        lot_size=a["lot_size"],
        delta=a["delta"],
        allow_large_delta=a["allow_large_delta"],
        clipping=a["clipping"],
        sampling=a["sampling"],
        max_lot_size=a["max_lot_size"],
        grad_sample_mode=a["mode"],
        secure_rng=a["secure_rng"],
        noise_seed=a["seed"],
        target_epsilon=a["target_epsilon"],
        physical_batch_size=a["physical_batch_size"],
    )
    c = SimpleNamespace(
        privacy=p,
        accountant=AccountantConfig(name=a["accountant"]),
        model=SimpleNamespace(projection="none"),
        N=int(n),
    )
    sampler = validate_privacy(c)
    if c.accountant.name is None:  # the tightest accountant that serves the sampler's charge
        c.accountant.name = tightest(sampler.accountants)
    validate_accountant(c)
    t = TrainingConfig(lr=a["lr"], momentum=a["momentum"], precision=a["precision"])
    validate_step(t)
    epochs = num("epochs", a["epochs"], optional=True, lo=0, lo_open=True)
    if epochs is not None and math.ceil(epochs * sampler.lots_per_epoch()) > limits.STEPS_MAX:
        raise ConfigError(
            f"epochs={epochs:g}: {math.ceil(epochs * sampler.lots_per_epoch())} lots "
            f"({p.sampling} sampling, L={p.lot_size}, N={n}) exceed STEPS_MAX={limits.STEPS_MAX}, "
            "the most the accountants serve"
        )
    return Arguments(
        lot_size=p.lot_size,
        clip_norm=p.clip_norm,
        sigma=None if sigma is None or not p.private else p.sigma,
        target_epsilon=p.target_epsilon,
        epochs=epochs,
        delta=p.delta,
        sampling=p.sampling,
        max_lot_size=p.max_lot_size,
        accountant=c.accountant.name,
        lr=t.lr,
        momentum=t.momentum,
        clipping=p.clipping,
        mode=p.grad_sample_mode,
        physical_batch_size=p.physical_batch_size,
        private=p.private,
        secure_rng=p.secure_rng,
        precision=t.precision,
    )


def check_calibrated(sigma: float, sampler) -> float:
    """A σ calibrated for the target ε, within what the accountants serve as it is charged (the
    command line's check after ``privacy.calibrate_sigma``)."""
    try:
        sigma_served("privacy.sigma", sigma, sampler.event(sigma).entry()["sigma"])
    except ConfigError as e:
        raise ConfigError(api_message(str(e))) from None
    return sigma
