"""What an audit is asked (``AuditConfig``) and what it answers (``AuditResult``).

Settings: ``tiny`` — T independent one-feature models in one ``nn.Linear(T, 2, bias=False)``, so one
DP-SGD step plays T trials; ``mnist`` — the paper's MNIST network shape (PCA-60 → 1000 ReLU → 10,
no biases; Abadi et al. 2016, §5.2), per-layer clipping C = 4, σ = 4, one step per trial.

``mnist_other`` — the same network, with one known other example x_o in every lot: D = {x_o} against
D' = {x_o, canary}, scored by the size of the release once x_o's clipped gradient is subtracted
(‖θ₀ − θ₁ − g_o‖², which a white-box adversary who knows x_o can compute).

Mechanisms (``dpsgd.audit.variants.GAME_VARIANTS``, implemented there for both audits): ``correct``;
``no_clip`` (the clipper has clip_norm=None while DPSGD still adds σC noise for the claimed C);
``noise_div10`` (DPSGD adds σC/10 while σ is claimed); ``realised_lot`` (``mnist_other`` only: the
noisy sum divided by the realised lot size |L_t| instead of the expected L, so the noise shrinks by
half when the canary is in — invisible to a one-run audit, whose canaries all share the one number
|L_t|, docs/AUDIT.md). The broken ones show the audit has teeth.

Option lists come from where they are defined: clipping modes from ``dpsgd.config.schema.CHOICES``,
accountant names from ``dpsgd.accountant.ACCOUNTANTS``.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from dpsgd.accountant import ACCOUNTANTS, limits
from dpsgd.config.schema import CHOICES
from dpsgd.core.checks import boolean, choice, fmt, num
from dpsgd.core.errors import ConfigError

from ..variants import GAME_VARIANTS

CLIPPINGS = tuple(CHOICES["privacy.clipping"])
MECHANISMS = GAME_VARIANTS
# the mechanisms each setting can play (realised_lot needs a known other example in every lot)
SETTING_MECHANISMS = {"tiny": MECHANISMS[:3], "mnist": MECHANISMS[:3], "mnist_other": MECHANISMS}
TRIALS_MAX = 10**7  # the scores of every trial are held in memory
CLIP_NORM_MAX = 1e6  # C and the canary's gradient norm (canary_norm · C) stay far from overflow
CANARY_NORM_MAX = 1e6
SEED_MAX = 2**63 - 2  # the noise generator is seeded with seed + 1
THREADS_MAX = 1024
# the claimed ε charges σ/√k for k <= 2 clipping groups (mnist, per_layer): kept where the
# accountants serve
SIGMA_MIN = 0.015  # >= limits.SIGMA_MIN · √2
SETTINGS = {
    # name: defaults (σ, C, clipping, trials)
    "tiny": dict(sigma=2.0, clip_norm=1.0, clipping="global", trials=50000),
    "mnist": dict(sigma=4.0, clip_norm=4.0, clipping="per_layer", trials=20000),
    "mnist_other": dict(sigma=4.0, clip_norm=4.0, clipping="per_layer", trials=4000),
}


@dataclass
class AuditConfig:
    setting: str = "tiny"
    mechanism: str = "correct"
    sigma: float = 2.0
    clip_norm: float = 1.0
    clipping: str = "global"
    q: float = 1.0
    delta: float = limits.DELTA_DEFAULT
    trials: int = 50000
    select_fraction: float = 0.5
    alpha: float = 0.05
    canary_norm: float = 10.0  # canary gradient norm (every group) as a multiple of C
    seed: int = 0
    secure_rng: bool = False
    chunk: int = 2000  # tiny setting: trials per DP-SGD step
    threads: int = 1  # torch intra-op threads (small tensors: 1 is fastest)
    accountants: tuple = ("pld", "rdp", "moments")

    def validate(self, label=str) -> None:
        """Check and coerce every field in place, as training checks its config: numbers finite and
        in range, integers integral, names from their lists; a ``ValueError`` (``ConfigError``) in
        one line naming the first bad field as ``label(field)``
        (the CLI passes its option names)."""

        def number(key, **bounds):
            setattr(self, key, num(label(key), getattr(self, key), **bounds))

        choice(label("setting"), self.setting, SETTINGS)
        choice(label("mechanism"), self.mechanism, SETTING_MECHANISMS[self.setting])
        choice(label("clipping"), self.clipping, CLIPPINGS)
        number("sigma", lo=SIGMA_MIN, hi=limits.SIGMA_MAX)
        number("clip_norm", lo=0, lo_open=True, hi=CLIP_NORM_MAX)
        number("q", lo=limits.Q_MIN, hi=1)
        number("delta", lo=limits.DELTA_MIN, hi=1, hi_open=True)
        number("alpha", lo=0, lo_open=True, hi=1, hi_open=True)
        number("select_fraction", lo=0, lo_open=True, hi=1, hi_open=True)
        number("trials", integer=True, lo=20, hi=TRIALS_MAX)
        n_sel = int(
            round(self.select_fraction * self.trials)
        )  # as stats.clopper_pearson_bound splits them
        if not 1 <= n_sel <= self.trials - 2:
            raise ConfigError(
                f"{label('select_fraction')}={self.select_fraction:g}: selects {n_sel} of the "
                f"{self.trials} trials; at least 1 must choose the threshold and 2 evaluate it"
            )
        number("canary_norm", lo=1, hi=CANARY_NORM_MAX)
        number("seed", integer=True, lo=0, hi=SEED_MAX)
        number("chunk", integer=True, lo=2, hi=TRIALS_MAX)
        number("threads", integer=True, lo=1, hi=THREADS_MAX)
        boolean(label("secure_rng"), self.secure_rng)
        acc = self.accountants
        if not isinstance(acc, (tuple, list)) or not all(a in ACCOUNTANTS for a in acc):
            shown = ",".join(map(str, acc)) if isinstance(acc, (tuple, list)) else fmt(acc)
            raise ConfigError(
                f"{label('accountants')}={shown}: must be names from {list(ACCOUNTANTS)}, "
                "separated by commas"
            )
        if not acc and self.q < 1:  # no claimed ε at all would call every mechanism consistent
            raise ConfigError(
                f"{label('accountants')}=: names no accountant, and q={self.q:g} < 1 has no "
                "exact ε to hold the lower bound to"
            )


@dataclass
class AuditResult:
    config: dict
    eps_lb: float  # Clopper–Pearson lower bound on ε (confidence 1 − α)
    eps_point: float  # same test, observed rates, no confidence interval
    eps_claimed: dict = field(default_factory=dict)  # accountant -> ε for the configured mechanism
    threshold: float = 0.0
    direction: str = "in>t"  # "in>t": decide "canary present" when score ≥ t; "in<t": when <
    n_out: int = 0  # held-out trials with D (canary absent)
    n_in: int = 0  # held-out trials with D' (canary present)
    false_pos: int = 0
    false_neg: int = 0
    groups: int = 1
    seconds: float = 0.0

    @property
    def violation(self) -> bool:
        """True when the audit refutes the mechanism's analysis: every claimed ε is a valid upper
        bound for a correct implementation, so ε_lb above any of them (with 1 − α confidence)
        means the code does not do what the analysis assumes."""
        return bool(self.eps_claimed) and self.eps_lb > min(self.eps_claimed.values())
