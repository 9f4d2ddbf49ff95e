"""Typed configuration: dataclass schemas for the Hydra config groups, validated before any work.

``validate(cfg)`` turns the composed ``DictConfig`` (or a plain dict) into a ``Config`` and raises
``ConfigError`` with a one-line message naming the offending key
(``privacy.sigma=-1: must be >= 0``) for every bad value: unknown keys and names, σ < 0, C <= 0, L
outside [1, N], δ outside (0, 1), non-integer epochs, NaN learning rates, PCA wider than the input,
models that mix examples, ...

Each group is checked next to what it configures, in this order (the first bad key is reported):
``dataset.*``, ``model.*`` (dpsgd/config/model.py), ``privacy.*`` and ``accountant.*``
(dpsgd/config/privacy.py), ``training.*`` (``validate_training``, here), ``optimizer.*`` and
``training.schedule`` (dpsgd/config/optimizer.py), ``logger.*``
(``validate_logger``, here: a logger's missing package is named), σ from the target ε
(dpsgd/config/calibration.py), then the top-level keys (``validate_top``, here). What a resume may
change (``RESUME_ALLOWED``, the fingerprint) is dpsgd/config/fingerprint.py.

Learning rates are only required to be finite and > 0: no principled upper bound exists
(divergence depends on the loss surface and C), so a run that diverges is the trainer's to stop.

Details: docs/CONFIGURATION.md, "dpsgd/config/schema.py".
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field, fields

from dpsgd.accountant import ACCOUNTANTS, CONVENTIONS, limits
from dpsgd.config.calibration import calibrated_sigma
from dpsgd.config.model import validate_model
from dpsgd.config.overrides import check_run_dir
from dpsgd.config.privacy import sigma_served, validate_accountant, validate_privacy
from dpsgd.core.checks import boolean, choice, fmt, num
from dpsgd.core.errors import ConfigError
from dpsgd.core.loggers import LOGGERS, require
from dpsgd.data.augment import AUGMENTATIONS
from dpsgd.data.datasets import DATASETS, dataset_info, validate_dataset
from dpsgd.data.files import DTYPES, FILE_FORMATS
from dpsgd.data.features import FEATURE_NORMS, FEATURES
from dpsgd.config.optimizer import OPTIMIZERS, SCHEDULES, validate_optimizer
from dpsgd.mechanism.clipping.clip import CLIPPINGS, MODES, PRECISIONS
from dpsgd.mechanism.cyclic import CYCLIC, NOISES
from dpsgd.mechanism.pca import PROJECTIONS
from dpsgd.mechanism.sampling import SAMPLERS
from dpsgd.models.networks import FREEZE, INITS, MODELS, NORMS


@dataclass
class DatasetConfig:
    name: str = "mnist"
    root: str | None = None  # None: $DPSGD_DATA_ROOT or <repo>/data
    subset: int | None = None  # use only the first n training examples
    validation: int | None = (
        None  # hold out the last n of them and evaluate on those, not the test set
    )
    # centre crop of CIFAR images (conf/dataset/cifar10.yaml: the paper's 24); None keeps 32
    crop: int | None = None
    download: bool = True  # allow torchvision to download when no local copy exists
    augment: str = "none"  # none | crop_flip (random crop to `crop` + horizontal flip, per lot)
    standardize: bool = False  # per-image standardisation (TF per_image_standardization)
    train: str | None = None  # dataset=tensors|csv: the training file (.pt/.npz, .csv)
    test: str | None = None  # dataset=tensors|csv: the test file
    label: str = "label"  # dataset=csv: the label column
    image_size: int = 32  # dataset=imagefolder: images resized to image_size × image_size
    train_sha256: str | None = None  # filled when first read; a changed file is refused
    test_sha256: str | None = None
    # named classes of your files (image folders, text labels), matched by name across train and
    # test: filled when first read; a changed list is refused (dpsgd/data/files.py)
    classes: list[str] | None = None
    dtype: str = "float32"  # dataset=tensors|csv: float32, or int64 (token ids, an Embedding's)
    cls: str | None = None  # dataset=torchvision: the torchvision.datasets class name
    train_split: str | None = None  # dataset=torchvision: split= names (None: train=True/False)
    test_split: str | None = None


@dataclass
class ModelConfig:
    name: str = "mlp"  # mlp | cnn | tanh_cnn
    hidden: list[int] = field(default_factory=lambda: [1000])
    bias: bool = False
    projection: str = "pca"  # pca | random | none
    pca_dims: int = 60  # 0 = no projection
    init: str = "paper"  # paper (original code: truncated normal, std 1/sqrt(fan_in)) | torch
    norm: str = "none"  # none | group: GroupNorm after each convolution (tanh_cnn)
    pretrained: str | None = (
        None  # artifact of python -m dpsgd.pretrain (public weights), loaded at setup
    )
    pretrained_sha256: str | None = (
        None  # None: filled from the artifact's sidecar (after checking it)
    )
    freeze: str = "none"  # none | features: requires_grad=False (not clipped, noised, charged)
    # what fine-tuning trains (dpsgd/models/trainable.py): all (as the model and freeze say) | bias |
    # head | norm | lora, or several joined by + (bias+head); the rest frozen (not clipped, noised,
    # nor in k); lora inserts LoRA adapters (peft) of rank lora_rank and scaling lora_alpha/rank
    trainable: str = "all"
    lora_rank: int = 8
    lora_alpha: float = 16.0
    features: str = "none"  # none | scatter (fixed ScatterNet features, dpsgd/data/features.py)
    feature_norm: str = "group"  # none | group (per-example GroupNorm of the features; free)
    feature_groups: int = 27  # G of the GroupNorm (Tramèr & Boneh 2021: 27 for 81 channels)
    _target_: str | None = None  # your own nn.Module class (pkg.module.Class), built with args
    args: dict = field(default_factory=dict)  # keyword arguments of _target_


@dataclass
class PrivacyConfig:
    private: bool = True  # false: no clipping, no noise, no accounting ("not private")
    sigma: float | None = 4.0  # σ: noise multiplier of Algorithm 1; None: from the target ε
    sigma_p: float = 7.0  # σ_p: DP-PCA noise
    clip_norm: float = 4.0  # C
    lot_size: int = 600  # L (expected lot size; q = L/N)
    delta: float = limits.DELTA_DEFAULT  # δ, < 1/N unless allow_large_delta
    allow_large_delta: bool = False  # true: accept δ >= 1/N (recorded in config.resolved.yaml)
    clipping: str = "per_layer"  # per_layer | global
    convention: str = "joint"  # joint | per_tensor (the paper's code)
    sampling: str = "poisson"  # poisson | fixed_size | truncated_poisson | balls_in_bins | shuffle
    max_lot_size: int | None = (
        None  # B: truncated_poisson's cap (lots padded to B); None for the others
    )
    grad_sample_mode: str = "auto"  # auto | vmap | ghost
    secure_rng: bool = False
    noise_seed: int | None = None  # None: derived from seed
    target_epsilon: float | None = None
    physical_batch_size: int | None = None  # None: the whole lot in one forward/backward
    pca_fraction: float = 1.0  # DP-PCA sampling rate
    augment_multiplicity: int = 1  # K augmented copies per example, averaged before clipping
    calibrate_sigma: bool = (
        False  # true: σ computed from target_epsilon and training.epochs (accountant)
    )
    noise: str = "independent"  # independent (Algorithm 1) | bandmf | blt (correlated, DP-MF)
    bands: int | None = None  # noise=bandmf: b, the bands of C (1: Algorithm 1's noise)
    blt_buffers: int = 4  # noise=blt: at most this many buffers d


@dataclass
class AccountantConfig:
    name: str = "moments"  # moments | rdp | pld: target-ε stop and headline ε


@dataclass
class TrainingConfig:
    epochs: int = 100
    lr: float = 0.1
    lr_end: float = 0.052
    lr_saturate_epochs: int = 10
    momentum: float = (
        0.0  # heavy-ball momentum on the noisy gradient (post-processing; 0 = plain SGD)
    )
    max_steps: int | None = None  # stop after this many lots in total (tiny runs)
    eval_every: int = 1
    eval_batch_size: int = 10000
    checkpoint_every: int = 1  # epochs; 0 = only at the end
    ema_decay: float | None = None  # EMA of the weights (evaluated and released); None = off
    train_metrics: bool = True  # training-set loss/accuracy in metrics.csv (private data, no noise)
    schedule: str = "paper"  # paper | constant | linear | cosine (dpsgd/config/optimizer.py)
    precision: str = "fp32"  # fp32 | bf16: the forward pass under autocast, norms and noise fp32


@dataclass
class OptimizerConfig:
    name: str = "sgd"  # sgd (DP-SGD's own update) | adam | adamw | custom (_target_)
    betas: list[float] = field(default_factory=lambda: [0.9, 0.999])  # adam, adamw
    eps: float = 1e-8  # adam, adamw
    weight_decay: float = 0.0  # adam, adamw, custom
    _target_: str | None = None  # optimizer=custom: a torch.optim.Optimizer class
    args: dict = field(default_factory=dict)  # more keyword arguments of the optimizer


@dataclass
class LoggerConfig:
    name: str = "none"  # none | csv | tensorboard | wandb: each epoch's metrics.csv row, sent on
    project: str = "dpsgd"  # logger=wandb: the project (offline unless WANDB_MODE says otherwise)


@dataclass
class Config:
    dataset: DatasetConfig = field(default_factory=DatasetConfig)
    model: ModelConfig = field(default_factory=ModelConfig)
    privacy: PrivacyConfig = field(default_factory=PrivacyConfig)
    accountant: AccountantConfig = field(default_factory=AccountantConfig)
    training: TrainingConfig = field(default_factory=TrainingConfig)
    logger: LoggerConfig = field(default_factory=LoggerConfig)
    optimizer: OptimizerConfig = field(default_factory=OptimizerConfig)
    seed: int = 0
    device: str = "auto"
    tf32: bool = False
    resume: str | None = None
    name: str = "run"

    @property
    def N(self) -> int:
        n = dataset_info(self.dataset).n_train
        n = min(n, self.dataset.subset) if self.dataset.subset else n
        return n - (self.dataset.validation or 0)

    def to_dict(self) -> dict:
        return asdict(self)


CHOICES = {  # each list is defined once, where the choice is implemented
    "dataset.name": sorted((*DATASETS, *FILE_FORMATS)),
    "model.name": sorted(MODELS),
    "model.projection": sorted(PROJECTIONS),
    "model.init": sorted(INITS),
    "model.norm": sorted(NORMS),
    "model.freeze": sorted(FREEZE),
    "dataset.augment": sorted(AUGMENTATIONS),
    "dataset.dtype": sorted(DTYPES),
    "model.features": sorted(FEATURES),
    "model.feature_norm": sorted(FEATURE_NORMS),
    "privacy.clipping": sorted(CLIPPINGS),
    "privacy.convention": sorted(CONVENTIONS),
    "privacy.sampling": sorted({*SAMPLERS, *CYCLIC}),
    "privacy.grad_sample_mode": sorted(MODES),
    "privacy.noise": list(NOISES),
    "accountant.name": sorted(ACCOUNTANTS),
    "logger.name": sorted(LOGGERS),
    "optimizer.name": sorted(OPTIMIZERS),
    "training.schedule": sorted(SCHEDULES),
    "training.precision": sorted(PRECISIONS),
}
GROUPS = {
    "dataset": DatasetConfig,
    "model": ModelConfig,
    "privacy": PrivacyConfig,
    "accountant": AccountantConfig,
    "training": TrainingConfig,
    "logger": LoggerConfig,
    "optimizer": OptimizerConfig,
}


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
    c = _typed(cfg)
    validate_dataset(c.dataset)
    shape = validate_model(c.model, c.dataset)
    _sigma_to_calibrate(c.privacy)
    sampler = validate_privacy(c)
    validate_accountant(c)
    validate_training(c, sampler)
    validate_optimizer(c)
    validate_logger(c)
    p = c.privacy
    p.calibrate_sigma = boolean("privacy.calibrate_sigma", p.calibrate_sigma)
    if p.calibrate_sigma:
        p.sigma = calibrated_sigma(c, sampler, shape)
        sigma_served("privacy.sigma", p.sigma, sampler.event(p.sigma).entry()["sigma"])
    validate_top(c, check_resume_dir)
    return c


def _sigma_to_calibrate(p) -> None:
    """``privacy.sigma=null`` (model=custom's default): σ calibrated from privacy.target_epsilon
    over training.epochs (``privacy.calibrate_sigma``, set here), which must then be given; 0 in a
    non-private run."""
    if p.sigma is not None:
        return
    if p.private is not True:
        p.sigma = 0.0
        return
    if p.target_epsilon is None:
        raise ConfigError(
            "privacy.sigma=null: give σ (privacy.sigma=1.1), or privacy.target_epsilon to "
            "calibrate σ so that training.epochs spend it"
        )
    p.sigma, p.calibrate_sigma = 1.0, True  # checked as a σ until the calibration sets it


def _typed(cfg) -> Config:
    """The ``Config`` of a composed config, its values not yet checked; unknown keys refused."""
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
            raise ConfigError(f"{g}={fmt(sub)}: must be a config group")
        names = {f.name for f in fields(cls)}
        for k in sub:
            if k not in names:
                raise ConfigError(f"{g}.{k}: unknown config key (known: {sorted(names)})")
        groups[g] = cls(**sub)
    return Config(**groups, **{k: raw[k] for k in top - set(GROUPS) if k in raw})


def validate_training(c: Config, sampler) -> None:
    """The ``training.*`` group, checked and coerced in place: at most STEPS_MAX planned lots (those
    of ``sampler``), evaluation batches no larger than the largest evaluated set."""
    t, N = c.training, c.N
    t.epochs = num("training.epochs", t.epochs, integer=True, lo=0)
    validate_step(t)
    t.lr_end = num("training.lr_end", t.lr_end, lo=0, lo_open=True)
    t.lr_saturate_epochs = num(
        "training.lr_saturate_epochs", t.lr_saturate_epochs, integer=True, lo=0
    )
    t.max_steps = num(
        "training.max_steps", t.max_steps, integer=True, optional=True, lo=1, hi=limits.STEPS_MAX
    )
    lots = t.epochs * sampler.lots_per_epoch()
    if lots > limits.STEPS_MAX:
        p = c.privacy
        raise ConfigError(
            f"training.epochs={t.epochs}: {lots} lots ({p.sampling} sampling, L={p.lot_size}, "
            f"N={N}) exceed STEPS_MAX={limits.STEPS_MAX}, the most the accountants serve; lower "
            "training.epochs"
        )
    t.eval_every = num("training.eval_every", t.eval_every, integer=True, lo=1)
    # evaluation runs over the training set (N) and the test set; a batch larger than both is both
    # sets whole, the same batches: cut to that size (a small dataset keeps the default)
    n_eval = max(N, dataset_info(c.dataset).n_test)
    t.eval_batch_size = min(
        num("training.eval_batch_size", t.eval_batch_size, integer=True, lo=1), n_eval
    )
    t.checkpoint_every = num("training.checkpoint_every", t.checkpoint_every, integer=True, lo=0)
    t.ema_decay = num(
        "training.ema_decay", t.ema_decay, optional=True, lo=0, lo_open=True, hi=1, hi_open=True
    )
    t.train_metrics = boolean("training.train_metrics", t.train_metrics)


def validate_step(t) -> None:
    """The update θ ← θ − η g̃ (heavy ball with momentum μ): ``training.lr`` finite and > 0,
    ``training.momentum`` in [0, 1), ``training.precision`` fp32 or bf16; checked for the command
    line and the Python API alike (dpsgd/config/arguments.py)."""
    t.lr = num("training.lr", t.lr, lo=0, lo_open=True)
    t.momentum = num("training.momentum", t.momentum, lo=0, hi=1, hi_open=True)
    choice("training.precision", t.precision, PRECISIONS)


def validate_logger(c: Config) -> None:
    """``logger.*``: a known logger whose package is installed (one line naming the pip install),
    and a wandb project name."""
    lg = c.logger
    choice("logger.name", lg.name, LOGGERS)
    require(lg.name)
    if not isinstance(lg.project, str) or not lg.project or "/" in lg.project:
        raise ConfigError(f"logger.project={fmt(lg.project)}: must be a non-empty name without '/'")


def validate_top(c: Config, check_resume_dir: bool = True) -> None:
    """The top-level keys: seed, name (a folder name), device (CUDA present if asked for), tf32,
    resume."""
    c.seed = num("seed", c.seed, integer=True, lo=0)
    if not isinstance(c.name, str) or not c.name or "/" in c.name or c.name.startswith("."):
        raise ConfigError(f"name={fmt(c.name)}: must be a non-empty folder name without '/'")
    if not isinstance(c.device, str) or not (
        c.device in ("auto", "cpu", "cuda") or c.device.startswith("cuda:")
    ):
        raise ConfigError(f"device={fmt(c.device)}: must be auto, cpu, cuda or cuda:N")
    if not isinstance(c.tf32, bool):
        raise ConfigError(f"tf32={fmt(c.tf32)}: must be true or false")
    if c.device.startswith("cuda"):
        import torch

        if not torch.cuda.is_available():
            raise ConfigError(
                f"device={c.device}: CUDA is not available on this machine (use device=auto or cpu)"
            )
    if c.resume is not None:
        if not isinstance(c.resume, str) or not c.resume:
            raise ConfigError(f"resume={fmt(c.resume)}: must be a run directory")
        if check_resume_dir:
            check_run_dir(c.resume)
