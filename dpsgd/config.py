"""Typed configuration: dataclass schemas for the Hydra config groups, validated before any work.

``validate(cfg)`` turns the composed ``DictConfig`` (or a plain dict) into a ``Config`` and raises
``ConfigError`` with a one-line message naming the offending key (``privacy.sigma=-1: must be >= 0``)
for every bad value: unknown keys and names, σ < 0, C <= 0, L outside [1, N], δ outside (0, 1),
non-integer epochs, NaN learning rates, PCA wider than the input, models that mix examples, ...

It also refuses what would only fail once training has started:

* values the accountants cannot serve (their ranges are ``dpsgd.accountant._checks``: σ and σ_p in
  [SIGMA_MIN, SIGMA_MAX] for private runs, as charged (σ/2 under shuffle sampling), q = L/N >= Q_MIN, δ >= DELTA_MIN, target ε <= EPSILON_MAX,
  at most STEPS_MAX lots, at most GROUPS_MAX per-layer clipped groups);
* δ >= 1/N in a private run (δ is the probability of a catastrophic failure: at δ >= 1/N a mechanism
  that publishes one random example in full is (0, δ)-DP; Dwork & Roth 2014 §2.3). Only
  ``privacy.allow_large_delta=true`` accepts it, and that is recorded in the resolved config;
* models over PARAMS_MAX parameters (counted on the meta device), physical batches larger than N and
  evaluation batches larger than the largest evaluated set (such a batch is never formed).

Learning rates are only required to be finite and > 0: no principled upper bound exists (divergence
depends on the loss surface and C), so a run that diverges is the trainer's to stop.
"""
from __future__ import annotations

import functools
import math
from dataclasses import asdict, dataclass, field, fields
from pathlib import Path
from typing import Any

from .accountant import ACCOUNTANTS, CONVENTIONS
from .accountant import _checks as acc_limits
from .augment import AUGMENTATIONS
from .clipping.clip import CLIPPINGS, MODES
from .data import DATASETS, input_shape
from .errors import ConfigError
from .features import FEATURE_NORMS, FEATURES, feature_shape
from .models import FREEZE, INITS, MODELS, NORMS
from .pca import PROJECTIONS
from .sampling import SAMPLERS

# The largest model validated: 10**9 float32 parameters are 4 GB of weights alone, before gradients,
# noise and optimiser buffers (several times that); beyond what one CPU or GPU run of this repo holds.
PARAMS_MAX = 10**9



@dataclass
class DatasetConfig:
    name: str = "mnist"
    root: str | None = None            # None: $DPSGD_DATA_ROOT or <repo>/data
    subset: int | None = None          # use only the first n training examples
    validation: int | None = None      # hold out the last n of them and evaluate on those, not the test set
    crop: int | None = 24              # CIFAR center crop (paper: 24); None keeps 32
    download: bool = True              # allow torchvision to download when no local copy exists
    augment: str = "none"              # none | crop_flip (random crop to `crop` + horizontal flip, per lot)
    standardize: bool = False          # per-image standardisation (TF per_image_standardization)


@dataclass
class ModelConfig:
    name: str = "mlp"                  # mlp | cnn | tanh_cnn
    hidden: list[int] = field(default_factory=lambda: [1000])
    bias: bool = False
    projection: str = "pca"            # pca | random | none
    pca_dims: int = 60                 # 0 = no projection
    init: str = "paper"                # paper (original code: truncated normal, std 1/sqrt(fan_in)) | torch
    norm: str = "none"                 # none | group: GroupNorm after each convolution (tanh_cnn)
    pretrained: str | None = None      # artifact of python -m dpsgd.pretrain (public weights), loaded at setup
    pretrained_sha256: str | None = None   # None: filled from the artifact's sidecar (after checking it)
    freeze: str = "none"               # none | features: requires_grad=False (not clipped, noised, charged)
    features: str = "none"             # none | scatter (fixed ScatterNet features, dpsgd/features.py)
    feature_norm: str = "group"        # none | group (per-example GroupNorm of the features; free)
    feature_groups: int = 27           # G of the GroupNorm (Tramèr & Boneh 2021: 27 for 81 channels)


@dataclass
class PrivacyConfig:
    private: bool = True               # false: no clipping, no noise, no accounting ("not private")
    sigma: float = 4.0                 # σ: noise multiplier of Algorithm 1
    sigma_p: float = 7.0               # σ_p: DP-PCA noise
    clip_norm: float = 4.0             # C
    lot_size: int = 600                # L (expected lot size; q = L/N)
    delta: float = 1e-5                # δ, < 1/N unless allow_large_delta
    allow_large_delta: bool = False    # true: accept δ >= 1/N (recorded in config.resolved.yaml)
    clipping: str = "per_layer"        # per_layer | global
    convention: str = "joint"          # joint | per_tensor (the paper's code)
    sampling: str = "poisson"          # poisson | shuffle
    grad_sample_mode: str = "auto"     # auto | vmap | ghost
    secure_rng: bool = False
    noise_seed: int | None = None      # None: derived from seed
    target_epsilon: float | None = None
    physical_batch_size: int | None = None   # None: the whole lot in one forward/backward
    pca_fraction: float = 1.0          # DP-PCA sampling rate
    augment_multiplicity: int = 1      # K augmented copies per example, averaged before clipping
    calibrate_sigma: bool = False      # true: σ computed from target_epsilon and training.epochs (accountant)


@dataclass
class AccountantConfig:
    name: str = "moments"              # moments | rdp | pld: target-ε stop and headline ε


@dataclass
class TrainingConfig:
    epochs: int = 100
    lr: float = 0.1
    lr_end: float = 0.052
    lr_saturate_epochs: int = 10
    momentum: float = 0.0              # heavy-ball momentum on the noisy gradient (post-processing; 0 = plain SGD)
    max_steps: int | None = None       # stop after this many lots in total (tiny runs)
    eval_every: int = 1
    eval_batch_size: int = 10000
    checkpoint_every: int = 1          # epochs; 0 = only at the end
    ema_decay: float | None = None     # EMA of the weights (evaluated and released); None = off


@dataclass
class Config:
    dataset: DatasetConfig = field(default_factory=DatasetConfig)
    model: ModelConfig = field(default_factory=ModelConfig)
    privacy: PrivacyConfig = field(default_factory=PrivacyConfig)
    accountant: AccountantConfig = field(default_factory=AccountantConfig)
    training: TrainingConfig = field(default_factory=TrainingConfig)
    seed: int = 0
    device: str = "auto"
    tf32: bool = False
    resume: str | None = None
    name: str = "run"

    @property
    def N(self) -> int:
        n = DATASETS[self.dataset.name][1]
        n = min(n, self.dataset.subset) if self.dataset.subset else n
        return n - (self.dataset.validation or 0)

    def to_dict(self) -> dict:
        return asdict(self)


CHOICES = {   # each list is defined once, where the choice is implemented
    "dataset.name": sorted(DATASETS),
    "model.name": sorted(MODELS),
    "model.projection": sorted(PROJECTIONS),
    "model.init": sorted(INITS),
    "model.norm": sorted(NORMS),
    "model.freeze": sorted(FREEZE),
    "dataset.augment": sorted(AUGMENTATIONS),
    "model.features": sorted(FEATURES),
    "model.feature_norm": sorted(FEATURE_NORMS),
    "privacy.clipping": sorted(CLIPPINGS),
    "privacy.convention": sorted(CONVENTIONS),
    "privacy.sampling": sorted(SAMPLERS),
    "privacy.grad_sample_mode": sorted(MODES),
    "accountant.name": sorted(ACCOUNTANTS),
}
GROUPS = {"dataset": DatasetConfig, "model": ModelConfig, "privacy": PrivacyConfig,
          "accountant": AccountantConfig, "training": TrainingConfig}


def _fmt(v: Any) -> str:
    return "null" if v is None else str(v)


def _num(key: str, v: Any, *, integer: bool = False, optional: bool = False, lo=None, lo_open=False,
         hi=None, hi_open=False):
    """Coerce a number, refusing bools, strings, NaN/inf and (for integers) fractional values."""
    if v is None:
        if optional:
            return None
        raise ConfigError(f"{key}=null: a value is required")
    what = "an integer" if integer else "a number"
    if isinstance(v, bool) or not isinstance(v, (int, float)):
        raise ConfigError(f"{key}={_fmt(v)}: must be {what}")
    if not math.isfinite(v):
        raise ConfigError(f"{key}={_fmt(v)}: must be a finite number")
    if integer:
        if isinstance(v, float) and not v.is_integer():
            raise ConfigError(f"{key}={_fmt(v)}: must be an integer")
        v = int(v)
    else:
        v = float(v)
    if lo is not None and (v <= lo if lo_open else v < lo):
        raise ConfigError(f"{key}={_fmt(v)}: must be {'>' if lo_open else '>='} {lo}")
    if hi is not None and (v >= hi if hi_open else v > hi):
        raise ConfigError(f"{key}={_fmt(v)}: must be {'<' if hi_open else '<='} {hi}")
    return v


def _bool(key: str, v: Any) -> bool:
    if not isinstance(v, bool):
        raise ConfigError(f"{key}={_fmt(v)}: must be true or false")
    return v


def _sigma_served(key: str, v: float, charged: float) -> None:
    """Refuse a noise multiplier whose charge to the ledger lies outside [SIGMA_MIN, SIGMA_MAX]."""
    lo, hi = acc_limits.SIGMA_MIN, acc_limits.SIGMA_MAX
    if not lo <= charged <= hi:
        how = "" if charged == v else f" (charged as {charged:g})"
        raise ConfigError(f"{key}={_fmt(v)}{how}: must be in [{lo:g}, {hi:g}], the range the accountants serve "
                          "(SIGMA_MIN, SIGMA_MAX in dpsgd/accountant/_checks.py)")


def _choice(key: str, v: Any) -> str:
    if v not in CHOICES[key]:
        raise ConfigError(f"{key}={_fmt(v)}: unknown, must be one of {CHOICES[key]}")
    return v


def _plain(cfg) -> dict:
    try:
        from omegaconf import DictConfig, OmegaConf
        if isinstance(cfg, DictConfig):
            return OmegaConf.to_container(cfg, resolve=True)
    except ImportError:  # pragma: no cover
        pass
    return dict(cfg)


def validate(cfg, *, check_resume_dir: bool = True) -> Config:
    """The typed ``Config`` of a composed config, or ``ConfigError`` naming the first bad key."""
    try:
        raw = _plain(cfg)
    except Exception as e:  # an interpolation that cannot be resolved, ...
        raise ConfigError(f"config: {str(e).splitlines()[0]}") from None
    raw = {k: v for k, v in raw.items() if k != "hydra"}
    top = {f.name for f in fields(Config)}
    for k in raw:
        if k not in top:
            raise ConfigError(f"{k}: unknown config key (known: {sorted(top)})")
    groups = {}
    for g, cls in GROUPS.items():
        sub = raw.get(g) or {}
        if not isinstance(sub, dict):
            raise ConfigError(f"{g}={_fmt(sub)}: must be a config group")
        names = {f.name for f in fields(cls)}
        for k in sub:
            if k not in names:
                raise ConfigError(f"{g}.{k}: unknown config key (known: {sorted(names)})")
        groups[g] = cls(**sub)
    c = Config(**groups, **{k: raw[k] for k in top - set(GROUPS) if k in raw})
    d, m, p, a, t = c.dataset, c.model, c.privacy, c.accountant, c.training

    # dataset
    _choice("dataset.name", d.name)
    full_n = DATASETS[d.name][1]
    d.subset = _num("dataset.subset", d.subset, integer=True, optional=True, lo=1, hi=full_n)
    d.validation = _num("dataset.validation", d.validation, integer=True, optional=True, lo=1,
                        hi=(d.subset or full_n) - 1)
    d.crop = _num("dataset.crop", d.crop, integer=True, optional=True, lo=1, hi=32)
    if d.root is not None and not isinstance(d.root, str):
        raise ConfigError(f"dataset.root={_fmt(d.root)}: must be a path")
    d.download = _bool("dataset.download", d.download)
    _choice("dataset.augment", d.augment)
    d.standardize = _bool("dataset.standardize", d.standardize)
    if d.augment != "none" and (len(DATASETS[d.name][4]) != 3 or not d.crop or d.crop >= DATASETS[d.name][4][-1]):
        raise ConfigError(f"dataset.augment={d.augment}: random crops need images and dataset.crop smaller than "
                          f"them ({d.name}, crop={_fmt(d.crop)})")
    if d.standardize and len(DATASETS[d.name][4]) != 3:
        raise ConfigError(f"dataset.standardize=true: per-image standardisation is for image datasets, not {d.name}")
    N = c.N

    # model
    _choice("model.name", m.name)
    if not isinstance(m.hidden, (list, tuple)):
        raise ConfigError(f"model.hidden={_fmt(m.hidden)}: must be a list of layer widths")
    if m.name == "mlp" and len(m.hidden) + 1 > acc_limits.GROUPS_MAX:
        raise ConfigError(f"model.hidden: {len(m.hidden)} hidden layers; per-layer clipping charges one group "
                          f"per layer, at most GROUPS_MAX={acc_limits.GROUPS_MAX} (dpsgd/accountant/_checks.py)")
    m.hidden = [_num(f"model.hidden[{i}]", h, integer=True, lo=1) for i, h in enumerate(m.hidden)]
    for i, h in enumerate(m.hidden):   # a layer of width h has >= h weights (checked before any build)
        if h > PARAMS_MAX:
            raise ConfigError(f"model.hidden[{i}]={h}: a layer this wide holds more than PARAMS_MAX={PARAMS_MAX:.0e} "
                              "parameters (4 GB of float32 weights before gradients and noise)")
    m.bias = _bool("model.bias", m.bias)
    _choice("model.projection", m.projection)
    _choice("model.init", m.init)
    _choice("model.features", m.features)
    _choice("model.feature_norm", m.feature_norm)
    shape = input_shape(d.name, d.crop)
    if m.features != "none":
        try:
            shape = feature_shape(m.features, shape)
        except ValueError as e:
            raise ConfigError(f"model.features={m.features}: {e}") from None
        if m.projection != "none" and m.pca_dims != 0:
            raise ConfigError(f"model.projection={m.projection}: the {m.features} features are the input "
                              "transform; use model.projection=none")
        m.feature_groups = _num("model.feature_groups", m.feature_groups, integer=True, lo=1)
        if m.feature_norm == "group" and shape[0] % m.feature_groups:
            raise ConfigError(f"model.feature_groups={m.feature_groups}: must divide the {shape[0]} feature channels")
    in_dim = math.prod(shape)
    m.pca_dims = _num("model.pca_dims", m.pca_dims, integer=True, lo=0)
    if m.projection != "none" and m.pca_dims > in_dim:
        raise ConfigError(f"model.pca_dims={m.pca_dims}: exceeds the input dimension {in_dim} of {d.name}")
    if m.projection != "none" and m.pca_dims == 0:
        m.projection = "none"
    if m.name == "cnn":
        if shape != (3, 24, 24):
            raise ConfigError(f"model.name=cnn: needs 3x24x24 images (cifar10/cifar100 with dataset.crop=24), "
                              f"{d.name} gives {'x'.join(map(str, shape))}")
        if m.projection != "none":
            raise ConfigError(f"model.projection={m.projection}: the cnn model takes images; use none")
    _choice("model.norm", m.norm)
    if m.name == "tanh_cnn":
        if d.name not in ("mnist", "fashion_mnist"):
            raise ConfigError(f"model.name=tanh_cnn: needs 1x28x28 images (mnist, fashion_mnist), {d.name} "
                              f"gives {'x'.join(map(str, shape))}")
        if m.projection != "none":
            raise ConfigError(f"model.projection={m.projection}: the tanh_cnn model takes images; use none")
    elif m.norm != "none":
        raise ConfigError(f"model.norm={m.norm}: only model.name=tanh_cnn has a normalisation option")
    if d.augment != "none" and m.projection != "none":
        raise ConfigError(f"model.projection={m.projection}: a projection is fit on fixed inputs; "
                          f"dataset.augment={d.augment} needs model.projection=none")
    _choice("model.freeze", m.freeze)
    _check_model(c, shape)

    # privacy
    p.private = _bool("privacy.private", p.private)
    p.sigma = _num("privacy.sigma", p.sigma, lo=0)
    p.sigma_p = _num("privacy.sigma_p", p.sigma_p, lo=0)
    p.clip_norm = _num("privacy.clip_norm", p.clip_norm, lo=0, lo_open=True)
    p.lot_size = _num("privacy.lot_size", p.lot_size, integer=True, lo=1)
    if p.lot_size > N:
        raise ConfigError(f"privacy.lot_size={p.lot_size}: must be <= N={N} (the number of training examples)")
    p.delta = _num("privacy.delta", p.delta, lo=acc_limits.DELTA_MIN, hi=1, hi_open=True)
    p.allow_large_delta = _bool("privacy.allow_large_delta", p.allow_large_delta)
    if p.private and p.delta >= 1 / N and not p.allow_large_delta:
        raise ConfigError(f"privacy.delta={p.delta:g}: must be < 1/N = {1 / N:.4g} (N={N} training examples), "
                          "else publishing one random example is within the guarantee; "
                          "set privacy.allow_large_delta=true to accept it")
    for k in ("clipping", "convention", "sampling", "grad_sample_mode"):
        _choice(f"privacy.{k}", getattr(p, k))
    sampler = SAMPLERS[p.sampling](N, p.lot_size)
    q, charged = sampler.release(p.sigma, 0)     # what the ledger records per charge (shuffle: 1, σ/2)
    if p.private and q < acc_limits.Q_MIN:
        raise ConfigError(f"privacy.lot_size={p.lot_size}: q = L/N = {q:.4g} (N={N}) is below "
                          f"Q_MIN={acc_limits.Q_MIN:g}, the smallest sampling rate the accountants serve")
    p.secure_rng = _bool("privacy.secure_rng", p.secure_rng)
    p.noise_seed = _num("privacy.noise_seed", p.noise_seed, integer=True, optional=True, lo=0)
    if p.secure_rng and p.noise_seed is not None:
        raise ConfigError(f"privacy.noise_seed={p.noise_seed}: a fixed noise seed is refused with "
                          "privacy.secure_rng=true")
    if p.private and p.sigma == 0:
        raise ConfigError("privacy.sigma=0.0: a private run needs noise (σ > 0); for a non-private run "
                          "set privacy.private=false")
    if p.private and p.sigma_p == 0 and m.projection == "pca":
        raise ConfigError("privacy.sigma_p=0.0: DP-PCA needs noise (σ_p > 0) in a private run; use "
                          "model.projection=random|none or privacy.private=false")
    if p.private:
        _sigma_served("privacy.sigma", p.sigma, charged)
        if m.projection == "pca":
            _sigma_served("privacy.sigma_p", p.sigma_p, p.sigma_p)
    p.target_epsilon = _num("privacy.target_epsilon", p.target_epsilon, optional=True, lo=0, lo_open=True,
                            hi=acc_limits.EPSILON_MAX)
    if p.target_epsilon is not None and not p.private:
        raise ConfigError(f"privacy.target_epsilon={p.target_epsilon}: a non-private run "
                          "(privacy.private=false) has no ε to stop at")
    # a lot holds at most N examples, so a larger physical batch is never formed
    p.physical_batch_size = _num("privacy.physical_batch_size", p.physical_batch_size, integer=True,
                                 optional=True, lo=1, hi=N)
    p.pca_fraction = _num("privacy.pca_fraction", p.pca_fraction, lo=acc_limits.Q_MIN, hi=1)
    p.augment_multiplicity = _num("privacy.augment_multiplicity", p.augment_multiplicity, integer=True, lo=1)

    # accountant
    _choice("accountant.name", a.name)
    if p.private and p.target_epsilon is not None and m.projection == "pca":
        # The DP-PCA release is charged before the first lot: a target below its cost is unreachable.
        from .accountant import Ledger
        led = Ledger()
        led.record(q=p.pca_fraction, sigma=p.sigma_p, count=1, groups=1, label="pca")
        eps_pca, _ = led.epsilon(p.delta, accountant=a.name, convention=p.convention)
        if eps_pca >= p.target_epsilon:
            raise ConfigError(f"privacy.target_epsilon={p.target_epsilon}: the DP-PCA release alone costs "
                              f"ε={eps_pca:.4g} (σ_p={p.sigma_p}, δ={p.delta:g}, {a.name}); raise the target "
                              "or privacy.sigma_p")

    # training
    t.epochs = _num("training.epochs", t.epochs, integer=True, lo=0)
    t.lr = _num("training.lr", t.lr, lo=0, lo_open=True)
    t.lr_end = _num("training.lr_end", t.lr_end, lo=0, lo_open=True)
    t.lr_saturate_epochs = _num("training.lr_saturate_epochs", t.lr_saturate_epochs, integer=True, lo=0)
    t.max_steps = _num("training.max_steps", t.max_steps, integer=True, optional=True, lo=1,
                       hi=acc_limits.STEPS_MAX)
    lots = t.epochs * sampler.lots_per_epoch()
    if lots > acc_limits.STEPS_MAX:
        raise ConfigError(f"training.epochs={t.epochs}: {lots} lots ({p.sampling} sampling, L={p.lot_size}, N={N}) "
                          f"exceed STEPS_MAX={acc_limits.STEPS_MAX}, the most the accountants serve; "
                          "lower training.epochs")
    t.momentum = _num("training.momentum", t.momentum, lo=0, hi=1, hi_open=True)
    t.eval_every = _num("training.eval_every", t.eval_every, integer=True, lo=1)
    # evaluation runs over the training set (N) and the test set; a larger batch is never formed
    n_eval = max(N, DATASETS[d.name][2])
    t.eval_batch_size = _num("training.eval_batch_size", t.eval_batch_size, integer=True, lo=1, hi=n_eval)
    t.checkpoint_every = _num("training.checkpoint_every", t.checkpoint_every, integer=True, lo=0)
    t.ema_decay = _num("training.ema_decay", t.ema_decay, optional=True, lo=0, lo_open=True, hi=1, hi_open=True)

    p.calibrate_sigma = _bool("privacy.calibrate_sigma", p.calibrate_sigma)
    if p.calibrate_sigma:
        p.sigma = _calibrated_sigma(c, sampler, shape)
        _sigma_served("privacy.sigma", p.sigma, sampler.release(p.sigma, 0)[1])

    # top level
    c.seed = _num("seed", c.seed, integer=True, lo=0)
    if not isinstance(c.name, str) or not c.name or "/" in c.name or c.name.startswith("."):
        raise ConfigError(f"name={_fmt(c.name)}: must be a non-empty folder name without '/'")
    if not isinstance(c.device, str) or not (c.device in ("auto", "cpu", "cuda") or c.device.startswith("cuda:")):
        raise ConfigError(f"device={_fmt(c.device)}: must be auto, cpu, cuda or cuda:N")
    if not isinstance(c.tf32, bool):
        raise ConfigError(f"tf32={_fmt(c.tf32)}: must be true or false")
    if c.device.startswith("cuda"):
        import torch
        if not torch.cuda.is_available():
            raise ConfigError(f"device={c.device}: CUDA is not available on this machine (use device=auto or cpu)")
    if c.resume is not None:
        if not isinstance(c.resume, str) or not c.resume:
            raise ConfigError(f"resume={_fmt(c.resume)}: must be a run directory")
        if check_resume_dir:
            check_run_dir(c.resume)
    return c


def _calibrated_sigma(c: Config, sampler, shape) -> float:
    """σ such that the planned lots (training.epochs, or training.max_steps if fewer) spend at most
    privacy.target_epsilon under the configured accountant and convention
    (``dpsgd/accountant/calibrate.py:sigma_for_epsilon``; ε within 0.5 % below the target)."""
    import torch

    p, t, key = c.privacy, c.training, "privacy.calibrate_sigma=true"
    if not p.private:
        raise ConfigError(f"{key}: a non-private run has no σ to calibrate")
    if p.target_epsilon is None:
        raise ConfigError(f"{key}: needs privacy.target_epsilon (the ε to spend over training.epochs)")
    if p.sampling != "poisson":
        raise ConfigError(f"{key}: calibrates Poisson-sampled lots only (privacy.sampling=poisson)")
    if c.model.projection == "pca":
        raise ConfigError(f"{key}: does not include the DP-PCA release; set privacy.sigma or model.projection=none")
    steps = t.epochs * sampler.lots_per_epoch()
    if t.max_steps is not None:
        steps = min(steps, t.max_steps)
    if steps < 1:
        raise ConfigError(f"{key}: training.epochs={t.epochs} plans no lot to calibrate σ for")
    with torch.device("meta"):
        model = build_model(c.model, shape, DATASETS[c.dataset.name][3])
    k = clipping_groups(model, p.clipping, c.model.freeze)
    try:
        return _sigma_for_epsilon(p.target_epsilon, p.delta, sampler.q, steps, c.accountant.name, k, p.convention)
    except ValueError as e:
        raise ConfigError(f"{key}: {str(e).splitlines()[0]}") from None


@functools.lru_cache(maxsize=32)
def _sigma_for_epsilon(target, delta, q, steps, accountant, groups, convention) -> float:
    """``sigma_for_epsilon``, remembered per process (a command validates its config more than once)."""
    from .accountant.calibrate import sigma_for_epsilon
    return float(sigma_for_epsilon(target, delta, q, steps, accountant, groups, convention))


def clipping_groups(model, clipping: str, freeze: str = "none") -> int:
    """k, the separately clipped groups of ``model`` once ``model.freeze`` has frozen its public tensors
    (frozen here, in place): ``dpsgd/clipping/groups.py:clipping_groups``, the rule the engine clips by."""
    from .clipping.groups import clipping_groups as groups
    for n in frozen_names(model, freeze):
        model.get_parameter(n).requires_grad_(False)
    return len(groups(model, clipping))


def override_key(a: str) -> str:
    """The config key of a command-line override, whatever its spelling (key=, +key=, ++key=, ~key)."""
    return a.split("=", 1)[0].lstrip("+~").strip()


def check_run_dir(path: str) -> Path:
    """A directory holding a dpsgd run (privacy.json or checkpoint.pt), else ConfigError."""
    rd = Path(path)
    if not rd.is_dir():
        raise ConfigError(f"resume={path}: no such run directory")
    if not ((rd / "privacy.json").is_file() or (rd / "checkpoint.pt").is_file()):
        raise ConfigError(f"resume={path}: not a dpsgd run directory (no privacy.json or checkpoint.pt)")
    return rd


def _check_model(c: Config, shape) -> None:
    """Refuse models over PARAMS_MAX parameters or that mix examples (BatchNorm, ...), built on the meta
    device (no memory, no time)."""
    import torch

    from .models import check_dp_compatible
    with torch.device("meta"):
        model = build_model(c.model, shape, DATASETS[c.dataset.name][3])
    n_params = sum(p.numel() for p in model.parameters())
    if n_params > PARAMS_MAX:
        raise ConfigError(f"model.hidden={list(c.model.hidden)}: {n_params} parameters ({c.model.name}), more "
                          f"than PARAMS_MAX={PARAMS_MAX:.0e} (4 GB of float32 weights before gradients and noise)")
    try:
        check_dp_compatible(model)
    except ValueError as e:
        raise ConfigError(f"model.name={c.model.name}: {str(e).splitlines()[0]}") from None
    m = c.model
    frozen = frozen_names(model, m.freeze)
    if m.freeze != "none" and not frozen:
        raise ConfigError(f"model.freeze={m.freeze}: the {m.name} model has no such parameters")
    if m.freeze != "none" and m.pretrained is None:
        raise ConfigError(f"model.freeze={m.freeze}: freezes public weights; set model.pretrained to their artifact")
    if len(frozen) == sum(1 for _ in model.parameters()):
        raise ConfigError(f"model.freeze={m.freeze}: nothing left to train")
    if m.pretrained_sha256 is not None and (not isinstance(m.pretrained_sha256, str) or m.pretrained is None):
        raise ConfigError(f"model.pretrained_sha256={_fmt(m.pretrained_sha256)}: a hex digest, with model.pretrained")
    if m.pretrained is not None:
        if not isinstance(m.pretrained, str) or not m.pretrained:
            raise ConfigError(f"model.pretrained={_fmt(m.pretrained)}: must be the path of an artifact")
        from .pretrained import verify
        tensors, m.pretrained_sha256 = verify(m.pretrained, m.pretrained_sha256)
        shapes = {n: tuple(t.shape) for n, t in model.state_dict().items()}
        for n, shape in tensors.items():
            if shapes.get(n) != shape:
                raise ConfigError(f"model.pretrained={m.pretrained}: its tensor {n} {list(shape)} does not fit the "
                                  f"{m.name} model ({list(shapes[n]) if n in shapes else 'no such tensor'})")
        missing = [n for n in frozen if n not in tensors]
        if missing:
            raise ConfigError(f"model.pretrained={m.pretrained}: holds no {missing[0]}, which model.freeze={m.freeze} "
                              "freezes (a frozen tensor must be the public one)")


def frozen_names(model, freeze: str) -> list[str]:
    """The parameters ``model.freeze`` freezes (requires_grad=False: public, neither clipped nor noised)."""
    return [n for n, _ in model.named_parameters() if n.startswith(FREEZE[freeze])] if FREEZE[freeze] else []


def build_model(m: ModelConfig, shape, classes: int):
    """The network of ``model.*`` for inputs of ``shape`` (after any projection)."""
    in_features = m.pca_dims if m.projection != "none" and m.features == "none" else math.prod(shape)
    return MODELS[m.name](in_features=in_features, hidden=tuple(m.hidden), num_classes=classes, bias=m.bias,
                          init=m.init, norm=m.norm)


def privacy_fingerprint(c: Config) -> dict:
    """The values a resumed run must share with the original (refused otherwise): everything the
    privacy claim depends on, the target ε and the accountant that enforces it included."""
    d, m, p = c.dataset, c.model, c.privacy
    # keys added after format version 2 appear only when set, so runs checkpointed before them resume
    later = {k: v for k, v, off in (("model.norm", m.norm, "none"),
                                    ("privacy.augment_multiplicity", p.augment_multiplicity, 1),
                                    ("training.ema_decay", c.training.ema_decay, None)) if v != off}
    return later | {
        "dataset.name": d.name, "dataset.subset": d.subset, "dataset.crop": d.crop,
        "dataset.validation": d.validation,
        "model.name": m.name, "model.hidden": list(m.hidden), "model.bias": m.bias,
        "model.projection": m.projection, "model.pca_dims": m.pca_dims, "model.init": m.init,
        "model.features": m.features, "model.feature_norm": m.feature_norm,
        "model.feature_groups": m.feature_groups, "privacy.calibrate_sigma": p.calibrate_sigma,
        "privacy.private": p.private, "privacy.sigma": p.sigma, "privacy.sigma_p": p.sigma_p,
        "privacy.clip_norm": p.clip_norm, "privacy.lot_size": p.lot_size, "q": p.lot_size / c.N,
        "privacy.delta": p.delta, "privacy.clipping": p.clipping, "privacy.convention": p.convention,
        "privacy.sampling": p.sampling, "privacy.pca_fraction": p.pca_fraction,
        "privacy.secure_rng": p.secure_rng, "privacy.noise_seed": p.noise_seed, "seed": c.seed,
        "privacy.target_epsilon": p.target_epsilon, "accountant.name": c.accountant.name,
        # added with the CIFAR path, present only when not at their defaults: earlier runs keep their
        # fingerprint (their resume and config_hash are unchanged)
        **{k: v for k, v, default in (("dataset.augment", d.augment, "none"),
                                      ("dataset.standardize", d.standardize, False),
                                      ("model.pretrained_sha256", m.pretrained_sha256, None),
                                      ("model.freeze", m.freeze, "none")) if v != default},
    }
