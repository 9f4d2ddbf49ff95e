"""What an audit is asked (``AuditConfig``) and what it answers (``AuditResult``).

Settings: ``tiny`` — T independent one-feature models in one ``nn.Linear(T, 2, bias=False)``, so one
DP-SGD step plays T trials; ``mnist`` — the paper's MNIST network shape (PCA-60 → 1000 ReLU → 10,
no biases; Abadi et al. 2016, §5.2), per-layer clipping C = 4, σ = 4, one step per trial.

Mechanisms: ``correct``; ``no_clip`` (the clipper has max_grad_norm=None while DPSGD still adds σC
noise for the claimed C); ``noise_div10`` (DPSGD adds σC/10 while σ is claimed). The two broken ones
show the audit has teeth.

Option lists come from where they are defined: clipping modes from ``dpsgd.config.schema.CHOICES``,
accountant names from ``dpsgd.accountant.ACCOUNTANTS``.
"""
from __future__ import annotations

from dataclasses import dataclass, field

from dpsgd.accountant import ACCOUNTANTS
from dpsgd.config.schema import CHOICES

CLIPPINGS = tuple(CHOICES["privacy.clipping"])
MECHANISMS = ("correct", "no_clip", "noise_div10")
SETTINGS = {
    # name: defaults (σ, C, clipping, trials)
    "tiny": dict(sigma=2.0, clip_norm=1.0, clipping="global", trials=50000),
    "mnist": dict(sigma=4.0, clip_norm=4.0, clipping="per_layer", trials=20000),
}


@dataclass
class AuditConfig:
    setting: str = "tiny"
    mechanism: str = "correct"
    sigma: float = 2.0
    clip_norm: float = 1.0
    clipping: str = "global"
    q: float = 1.0
    delta: float = 1e-5
    trials: int = 50000
    select_fraction: float = 0.5
    alpha: float = 0.05
    canary_norm: float = 10.0         # canary gradient norm (every group) as a multiple of C
    seed: int = 0
    secure_rng: bool = False
    chunk: int = 2000                 # tiny setting: trials per DP-SGD step
    threads: int = 1                  # torch intra-op threads (small tensors: 1 is fastest)
    accountants: tuple = ("pld", "rdp", "moments")

    def validate(self) -> None:
        """Raise ValueError naming the first bad field."""
        checks = [
            ("setting", self.setting in SETTINGS, f"one of {sorted(SETTINGS)}"),
            ("mechanism", self.mechanism in MECHANISMS, f"one of {MECHANISMS}"),
            ("sigma", self.sigma > 0, "> 0"),
            ("clip_norm", self.clip_norm > 0, "> 0"),
            ("clipping", self.clipping in CLIPPINGS, f"one of {CLIPPINGS}"),
            ("q", 0 < self.q <= 1, "in (0, 1]"),
            ("delta", 0 < self.delta < 1, "in (0, 1)"),
            ("alpha", 0 < self.alpha < 1, "in (0, 1)"),
            ("select_fraction", 0 < self.select_fraction < 1, "in (0, 1)"),
            ("trials", self.trials >= 20, ">= 20"),
            ("canary_norm", self.canary_norm >= 1, ">= 1 (canary gradient norm >= C)"),
            ("chunk", self.chunk >= 2, ">= 2"),
            ("threads", self.threads >= 1, ">= 1"),
            ("accountants", all(a in ACCOUNTANTS for a in self.accountants),
             f"names from {ACCOUNTANTS}"),
        ]
        for key, ok, want in checks:
            if not ok:       # NaN fails every comparison, so it is refused too
                raise ValueError(f"{key}={getattr(self, key)!r} must be {want}")


@dataclass
class AuditResult:
    config: dict
    eps_lb: float                     # Clopper–Pearson lower bound on ε (confidence 1 − α)
    eps_point: float                  # same test, observed rates, no confidence interval
    eps_claimed: dict = field(default_factory=dict)   # accountant -> ε for the configured mechanism
    threshold: float = 0.0
    direction: str = "in>t"           # "in>t": decide "canary present" when score ≥ t; "in<t": when <
    n_out: int = 0                    # held-out trials with D (canary absent)
    n_in: int = 0                     # held-out trials with D' (canary present)
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
