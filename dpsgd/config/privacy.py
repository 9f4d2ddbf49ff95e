"""The ``privacy.*`` and ``accountant.*`` groups of the config, checked against what the mechanism
and the accountants serve.

Besides the types and ranges of each value, these refuse what would only fail once training has
started:

* values the accountants cannot serve (their ranges are ``dpsgd.accountant.limits``: σ and σ_p in
  [SIGMA_MIN, SIGMA_MAX] for private runs, as charged (σ/2 under shuffle sampling), q = L/N >=
  Q_MIN, δ >= DELTA_MIN, target ε <= EPSILON_MAX);
* δ >= 1/N in a private run (δ is the probability of a catastrophic failure: at δ >= 1/N a mechanism
  that publishes one random example in full is (0, δ)-DP; Dwork & Roth 2014 §2.3). Only
  ``privacy.allow_large_delta=true`` accepts it, and that is recorded in the resolved config;
* a private run without noise, a fixed noise seed with OS-entropy noise, a target ε in a non-private
  run or below what the DP-PCA release alone costs; physical batches larger than N (never formed);
* correlated noise (``privacy.noise=bandmf|blt``) with a sampler it cannot be accounted under: its
  cyclic participation replaces ``privacy.sampling=poisson`` (recorded in the resolved config),
  any other sampler is refused (``_check_correlated``).
"""

from __future__ import annotations

from dpsgd.accountant import ACCOUNTANTS, CONVENTIONS, Ledger, limits
from dpsgd.core.checks import boolean, choice, fmt, num
from dpsgd.core.errors import ConfigError
from dpsgd.mechanism.clipping.clip import CLIPPINGS, MODES
from dpsgd.mechanism.cyclic import CYCLIC, NOISES, make_run_sampler, participation
from dpsgd.mechanism.pca import charge_pca
from dpsgd.mechanism.sampling import SAMPLERS
from dpsgd.mechanism.correlated.strategy import BANDS_MAX, BUFFERS_MAX


TIGHTEST = ("pld", "rdp", "moments")  # by tightness at equal σ: PLD (near exact), then Rényi DP


def tightest(served) -> str:
    """The tightest of the accountants ``served`` (a sampler's ``accountants``): PLD where it
    serves the charge (every sampler here), else RDP, else the paper's moments accountant. Each
    is a valid upper bound on ε; PLD's pessimistic discretisation is the smallest of them
    (docs/ACCOUNTING.md)."""
    return next(a for a in TIGHTEST if a in served)


def validate_privacy(c):
    """The ``privacy.*`` group of ``c`` (a ``Config`` whose dataset and model are validated),
    checked and coerced in place; returns the run's sampler (the one source of q). ConfigError
    naming the key."""
    p, N = c.privacy, c.N
    _check_lot(p, N)
    p.max_lot_size = num(
        "privacy.max_lot_size", p.max_lot_size, integer=True, optional=True, lo=p.lot_size, hi=N
    )
    if p.max_lot_size is not None and p.sampling != "truncated_poisson":
        raise ConfigError(
            f"privacy.max_lot_size={p.max_lot_size}: applies to privacy.sampling=truncated_poisson "
            f"only (sampling={p.sampling})"
        )
    if p.sampling == "truncated_poisson" and p.max_lot_size is None:
        raise ConfigError(
            "privacy.max_lot_size=null: privacy.sampling=truncated_poisson needs the cap B "
            "(an integer in [privacy.lot_size, N])"
        )
    _check_correlated(p, N)
    try:
        sampler = make_run_sampler(
            p.noise, p.sampling, N, p.lot_size, max_lot_size=p.max_lot_size, bands=p.bands
        )
    except ValueError as e:
        raise ConfigError(str(e).splitlines()[0]) from None
    if p.noise == "bandmf" and p.bands > sampler.cycle:  # b-min-separation: b <= the cycle
        raise ConfigError(
            f"privacy.bands={p.bands}: more bands than the {sampler.cycle} lots between an "
            f"example's participations under privacy.sampling={p.sampling} (needs b <= "
            f"{sampler.cycle})"
        )
    if p.private and c.accountant.name is not None and c.accountant.name not in sampler.accountants:
        raise ConfigError(
            f"accountant.name={c.accountant.name}: privacy.sampling={p.sampling} is accounted by "
            f"{' or '.join(sampler.accountants)} only"
        )
    _check_noise(p, sampler, c.model.projection)
    p.target_epsilon = num(
        "privacy.target_epsilon",
        p.target_epsilon,
        optional=True,
        lo=0,
        lo_open=True,
        hi=limits.EPSILON_MAX,
    )
    if p.target_epsilon is not None and not p.private:
        raise ConfigError(
            f"privacy.target_epsilon={p.target_epsilon}: a non-private run "
            "(privacy.private=false) has no ε to stop at"
        )
    # a lot holds at most N examples, so a larger physical batch is never formed
    p.physical_batch_size = num(
        "privacy.physical_batch_size",
        p.physical_batch_size,
        integer=True,
        optional=True,
        lo=1,
        hi=N,
    )
    p.pca_fraction = num("privacy.pca_fraction", p.pca_fraction, lo=limits.Q_MIN, hi=1)
    _check_multiplicity(p)
    return sampler


# Augmentation multiplicity K: De et al. 2022 train their CIFAR-10 results with K = 16; 1024 leaves
# a wide margin above that. Each physical batch becomes B·K rows held at once (the copies, their
# activations and per-row gradients), so B·K is bounded too: 2^20 rows of a CIFAR image are 12 GiB
# of input alone, before any activation. A larger K, or a larger B·K, would only exhaust the memory
# once training has started.
AUGMENT_MULTIPLICITY_MAX = 1024
ROWS_PER_PASS_MAX = 2**20


def _check_multiplicity(p) -> None:
    """K in [1, AUGMENT_MULTIPLICITY_MAX], and the rows of one pass, B·K (B the physical batch, or
    the lot when none is set), at most ROWS_PER_PASS_MAX."""
    p.augment_multiplicity = K = num(
        "privacy.augment_multiplicity",
        p.augment_multiplicity,
        integer=True,
        lo=1,
        hi=AUGMENT_MULTIPLICITY_MAX,
    )
    B = p.physical_batch_size or p.lot_size
    if K > 1 and B * K > ROWS_PER_PASS_MAX:
        which = (
            "privacy.physical_batch_size"
            if p.physical_batch_size
            else "privacy.lot_size (no physical batch)"
        )
        raise ConfigError(
            f"privacy.augment_multiplicity={K}: {B} examples per pass ({which}) × K = {B * K} rows "
            f"at once, more than ROWS_PER_PASS_MAX={ROWS_PER_PASS_MAX}; set a smaller "
            "privacy.physical_batch_size (memory only: the result is the same)"
        )


def _check_lot(p, N: int) -> None:
    """σ, σ_p, C, L and δ as numbers in range, δ < 1/N, and the named choices of the group."""
    p.private = boolean("privacy.private", p.private)
    p.sigma = num("privacy.sigma", p.sigma, lo=0)
    p.sigma_p = num("privacy.sigma_p", p.sigma_p, lo=0)
    p.clip_norm = num("privacy.clip_norm", p.clip_norm, lo=0, lo_open=True)
    p.lot_size = num("privacy.lot_size", p.lot_size, integer=True, lo=1)
    if p.lot_size > N:
        raise ConfigError(
            f"privacy.lot_size={p.lot_size}: must be <= N={N} (the number of training examples)"
        )
    p.delta = num("privacy.delta", p.delta, lo=limits.DELTA_MIN, hi=1, hi_open=True)
    p.allow_large_delta = boolean("privacy.allow_large_delta", p.allow_large_delta)
    if p.private and p.delta >= 1 / N and not p.allow_large_delta:
        raise ConfigError(
            f"privacy.delta={p.delta:g}: must be < 1/N = {1 / N:.4g} (N={N} training examples), "
            "else publishing one random example is within the guarantee; "
            "set privacy.allow_large_delta=true to accept it"
        )
    for k, options in (
        ("clipping", CLIPPINGS),
        ("convention", CONVENTIONS),
        ("sampling", sorted({*SAMPLERS, *CYCLIC})),
        ("grad_sample_mode", MODES),
        ("noise", NOISES),
    ):
        choice(f"privacy.{k}", getattr(p, k), options)


def _check_correlated(p, N: int) -> None:
    """privacy.noise, privacy.bands and privacy.blt_buffers: bands only with BandMF, a private run,
    and the sampler the noise is accounted under (``cyclic.participation``: privacy.sampling=poisson
    becomes that schema here, so the resolved config says what runs)."""
    p.bands = num("privacy.bands", p.bands, integer=True, optional=True, lo=1, hi=BANDS_MAX)
    p.blt_buffers = num("privacy.blt_buffers", p.blt_buffers, integer=True, lo=1, hi=BUFFERS_MAX)
    if p.noise != "bandmf" and p.bands is not None:
        raise ConfigError(
            f"privacy.bands={p.bands}: applies to privacy.noise=bandmf only (noise={p.noise})"
        )
    if p.noise == "bandmf" and p.bands is None:
        raise ConfigError(
            "privacy.bands=null: privacy.noise=bandmf needs the number of bands b (1 = Algorithm "
            "1's noise)"
        )
    if p.noise != "independent" and not p.private:
        raise ConfigError(
            f"privacy.noise={p.noise}: a non-private run adds no noise (privacy.private=false)"
        )
    try:
        p.sampling = participation(p.noise, p.sampling)
    except ValueError as e:
        raise ConfigError(str(e)) from None


def _check_noise(p, sampler, projection: str) -> None:
    """q and the noise as the ledger charges them: within what the accountants serve, never zero in
    a private run, a fixed seed only for seeded noise."""
    ch = sampler.event(p.sigma).entry()  # what the ledger records per charge (shuffle: 1, σ/2)
    q, charged = ch["q"], ch["sigma"]
    if p.private and q < limits.Q_MIN:
        raise ConfigError(
            f"privacy.lot_size={p.lot_size}: q = L/N = {q:.4g} (N={sampler.N}) is below "
            f"Q_MIN={limits.Q_MIN:g}, the smallest sampling rate the accountants serve"
        )
    p.secure_rng = boolean("privacy.secure_rng", p.secure_rng)
    p.noise_seed = num("privacy.noise_seed", p.noise_seed, integer=True, optional=True, lo=0)
    if p.secure_rng and p.noise_seed is not None:
        raise ConfigError(
            f"privacy.noise_seed={p.noise_seed}: a fixed noise seed is refused with "
            "privacy.secure_rng=true"
        )
    if p.private and p.sigma == 0:
        raise ConfigError(
            "privacy.sigma=0.0: a private run needs noise (σ > 0); for a non-private run "
            "set privacy.private=false"
        )
    if p.private and p.sigma_p == 0 and projection == "pca":
        raise ConfigError(
            "privacy.sigma_p=0.0: DP-PCA needs noise (σ_p > 0) in a private run; use "
            "model.projection=random|none or privacy.private=false"
        )
    if p.private:
        sigma_served("privacy.sigma", p.sigma, charged)
        if projection == "pca":
            sigma_served("privacy.sigma_p", p.sigma_p, p.sigma_p)


def sigma_served(key: str, v: float, charged: float) -> None:
    """Refuse a noise multiplier whose charge to the ledger lies outside [SIGMA_MIN, SIGMA_MAX]."""
    lo, hi = limits.SIGMA_MIN, limits.SIGMA_MAX
    if not lo <= charged <= hi:
        how = "" if charged == v else f" (charged as {charged:g})"
        raise ConfigError(
            f"{key}={fmt(v)}{how}: must be in [{lo:g}, {hi:g}], the range the accountants serve "
            "(SIGMA_MIN, SIGMA_MAX in dpsgd/accountant/limits.py)"
        )


def validate_accountant(c) -> None:
    """The ``accountant.*`` group: a known accountant, and a target ε above the DP-PCA release's
    cost (charged before the first lot, so a lower target is unreachable)."""
    p, a = c.privacy, c.accountant
    choice("accountant.name", a.name, ACCOUNTANTS)
    if p.private and p.target_epsilon is not None and c.model.projection == "pca":
        led = Ledger()
        charge_pca(led, p.sigma_p, p.pca_fraction)
        eps_pca, _ = led.epsilon(p.delta, accountant=a.name, convention=p.convention)
        if eps_pca >= p.target_epsilon:
            raise ConfigError(
                f"privacy.target_epsilon={p.target_epsilon}: the DP-PCA release alone costs "
                f"ε={eps_pca:.4g} (σ_p={p.sigma_p}, δ={p.delta:g}, {a.name}); raise the target "
                "or privacy.sigma_p"
            )
