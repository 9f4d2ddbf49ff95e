"""Empirical privacy audit of the DP-SGD step: ``python -m dpsgd.audit --help``.

A DP guarantee (ε, δ) bounds how well *any* test can tell M(D) from M(D') for neighbouring datasets
D, D' (Abadi et al. 2016, Def. 1): for every set S of outputs, P[M(D') ∈ S] ≤ e^ε P[M(D) ∈ S] + δ.
For a threshold test S = {score ≥ t} with false-positive rate FPR = P[M(D) ∈ S] and false-negative
rate FNR = P[M(D') ∉ S] this gives (Kairouz et al. 2015; Jagielski et al. 2020)

    ε ≥ log((1 − δ − FNR) / FPR)      and, with the roles of D and D' swapped,
    ε ≥ log((1 − δ − FPR) / FNR).

The audit plays this distinguishing game against the real code path — ``dpsgd.optim.DPSGD`` with
``dpsgd.clipping.PerExampleClipper`` and ``dpsgd.noise.GaussianNoise`` — and turns the observed error
counts into a lower bound on ε that holds with 95 % confidence:

* **Neighbours** (add/remove adjacency, the one the Poisson-sampling analysis covers):
  D = ∅ and D' = {canary}. The other examples of a real lot are known to a white-box adversary and
  can be subtracted; leaving them out is the worst case (Nasr et al. 2021, "Adversary instantiation:
  lower bounds for differentially private machine learning"; Nasr et al. 2023, "Tight auditing of
  differentially private machine learning").
* **Gradient canary**: one crafted input whose per-example gradient at the initial parameters θ₀
  has norm ≥ ``canary_norm`` × C in every clipping group, so that clipping gives it exactly the
  sensitivity C (per group) the analysis allows and no more. It is injected through the data:
  the lot passed to ``DPSGD.step`` is [canary] or empty (each with Poisson inclusion q).
* **Score**: the projection of the released noisy sum (θ₀ − θ₁)·L/η onto the direction u of the
  canary's (clipped) gradient — the likelihood-ratio statistic for a Gaussian mechanism.
* **Statistics**: the trials are split; the threshold and the direction of the test are chosen on
  the first part (``--select-fraction``), and only the held-out part is used for the bound, so
  choosing the best threshold does not inflate it. FPR and FNR get one-sided Clopper–Pearson upper
  bounds (``scipy.stats.beta``) at confidence 1 − α/2 each (Bonferroni: jointly ≥ 1 − α).

Settings: ``tiny`` runs many trials at once — an ``nn.Linear(T, 2, bias=False)`` whose T columns are
T independent one-feature models (example t only touches column t, and the noise is i.i.d. per
coordinate), so one DP-SGD step audits T trials; ``mnist`` audits the paper's MNIST network shape
(PCA-60 → 1000 ReLU → 10, no biases, per-layer clipping C = 4, σ = 4), one step per trial.

Mechanisms: ``correct``; ``no_clip`` (the clipper has max_grad_norm=None while DPSGD still adds
σC noise for the claimed C); ``noise_div10`` (DPSGD adds σC/10 while σ is claimed). The claimed ε
comes from ``dpsgd.accountant.Ledger`` for the mechanism as configured (q, σ, one step, k groups,
joint convention) and, for q = 1, from the closed form of the Gaussian mechanism (Balle & Wang 2018).
A sound implementation has ε_lb ≤ ε_claimed (with probability ≥ 95 %); ε_lb > ε_claimed proves a bug.
"""
from __future__ import annotations

import argparse
import json
import math
import os
import sys
import time
from dataclasses import asdict, dataclass, field

import numpy as np
import torch
from scipy import stats
from scipy.optimize import brentq

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
            ("clipping", self.clipping in ("global", "per_layer"), "'global' or 'per_layer'"),
            ("q", 0 < self.q <= 1, "in (0, 1]"),
            ("delta", 0 < self.delta < 1, "in (0, 1)"),
            ("alpha", 0 < self.alpha < 1, "in (0, 1)"),
            ("select_fraction", 0 < self.select_fraction < 1, "in (0, 1)"),
            ("trials", self.trials >= 20, ">= 20"),
            ("canary_norm", self.canary_norm >= 1, ">= 1 (canary gradient norm >= C)"),
            ("chunk", self.chunk >= 2, ">= 2"),
            ("threads", self.threads >= 1, ">= 1"),
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


# --- statistics ------------------------------------------------------------------------------------
def cp_upper(k, n, conf: float):
    """One-sided Clopper–Pearson upper bound on a binomial rate (k successes in n) at confidence conf."""
    k, n = np.asarray(k, dtype=float), np.asarray(n, dtype=float)
    with np.errstate(all="ignore"):
        ub = stats.beta.ppf(conf, k + 1, np.maximum(n - k, 1e-300))
    return np.where(k >= n, 1.0, ub)


def eps_from_rates(fpr, fnr, delta: float):
    """max(0, log((1 − δ − FNR) / FPR)): the ε a test with these error rates certifies."""
    fpr, fnr = np.asarray(fpr, dtype=float), np.asarray(fnr, dtype=float)
    with np.errstate(all="ignore"):
        e = np.log(np.maximum(1.0 - delta - fnr, 0.0) / fpr)
    return np.where(np.isfinite(e), np.maximum(e, 0.0), np.where(e > 0, np.inf, 0.0))


def _counts(out, inn, t):
    """For thresholds t (sorted scores): FP = #{out ≥ t}, FN = #{in < t}."""
    out, inn = np.sort(out), np.sort(inn)
    fp = len(out) - np.searchsorted(out, t, side="left")
    fn = np.searchsorted(inn, t, side="left")
    return fp, fn


def _best_threshold(out, inn, delta, conf):
    """Threshold maximising the CP lower bound of ε on this (selection) sample; returns (t, ε)."""
    t = np.unique(np.concatenate([out, inn]))
    fp, fn = _counts(out, inn, t)
    e = eps_from_rates(cp_upper(fp, len(out), conf), cp_upper(fn, len(inn), conf), delta)
    i = int(np.argmax(e))
    return float(t[i]), float(e[i])


def epsilon_lower_bound(scores, present, delta: float, alpha: float = 0.05,
                        select_fraction: float = 0.5, seed: int = 0) -> dict:
    """Clopper–Pearson lower bound on ε from scores of trials with (present=True) / without the canary.

    A random ``select_fraction`` of the trials chooses the threshold and the test's direction; the
    rest evaluate it. Both error rates are bounded at confidence 1 − α/2 (jointly 1 − α).
    """
    scores, present = np.asarray(scores, dtype=float), np.asarray(present, dtype=bool)
    perm = np.random.default_rng(seed).permutation(len(scores))
    n_sel = int(round(select_fraction * len(scores)))
    sel, ev = perm[:n_sel], perm[n_sel:]
    conf = 1.0 - alpha / 2
    best = None
    for direction, sign in (("in>t", 1.0), ("in<t", -1.0)):
        s = sign * scores
        t, e = _best_threshold(s[sel][~present[sel]], s[sel][present[sel]], delta, conf)
        if best is None or e > best[2]:
            best = (direction, sign, e, t)
    direction, sign, _, t = best
    s = sign * scores[ev]
    out, inn = s[~present[ev]], s[present[ev]]
    fp, fn = _counts(out, inn, np.array([t]))
    fp, fn = int(fp[0]), int(fn[0])
    eps_lb = float(eps_from_rates(cp_upper(fp, len(out), conf), cp_upper(fn, len(inn), conf), delta))
    eps_point = float(eps_from_rates(fp / len(out), fn / len(inn), delta))
    return dict(eps_lb=eps_lb, eps_point=eps_point, threshold=sign * t, direction=direction,
                n_out=len(out), n_in=len(inn), false_pos=fp, false_neg=fn)


# --- claimed ε -------------------------------------------------------------------------------------
def gaussian_epsilon(mu: float, delta: float) -> float:
    """Exact ε of the Gaussian mechanism with sensitivity/noise ratio μ (Balle & Wang 2018, Thm. 8):
    δ(ε) = Φ(μ/2 − ε/μ) − e^ε Φ(−μ/2 − ε/μ)."""
    def f(e):
        return (stats.norm.cdf(mu / 2 - e / mu)
                - math.exp(e + stats.norm.logcdf(-mu / 2 - e / mu)) - delta)

    if f(0.0) <= 0:
        return 0.0
    hi = 1.0
    while f(hi) > 0:
        hi *= 2
    return brentq(f, 0.0, hi, xtol=1e-12)


def claimed_epsilon(cfg: AuditConfig, groups: int) -> dict:
    """ε claimed for one step of the configured mechanism: the Ledger's accountants (joint
    convention: k groups at noise σC each = one Gaussian mechanism with multiplier σ/√k), plus the
    closed form for q = 1."""
    out = {}
    if cfg.accountants:
        from dpsgd.accountant import Ledger

        led = Ledger()
        led.record(q=cfg.q, sigma=cfg.sigma, count=1, groups=groups, label="audit")
        for acc in cfg.accountants:
            out[acc] = float(led.epsilon(cfg.delta, accountant=acc, convention="joint")[0])
    if cfg.q == 1.0:
        out["exact"] = gaussian_epsilon(math.sqrt(groups) / cfg.sigma, cfg.delta)
    return out


# --- the game --------------------------------------------------------------------------------------
def _mechanism(model, cfg: AuditConfig, noise):
    """(clipper, DPSGD) as the mechanism under audit builds them; L = η = 1 (post-processing)."""
    from dpsgd.clipping import PerExampleClipper
    from dpsgd.optim import DPSGD

    clip = None if cfg.mechanism == "no_clip" else cfg.clip_norm
    clipper = PerExampleClipper(model, max_grad_norm=clip, clipping=cfg.clipping)
    sigma = cfg.sigma / 10 if cfg.mechanism == "noise_div10" else cfg.sigma
    dp = DPSGD(model, clipper, noise, sigma=sigma, max_grad_norm=cfg.clip_norm,
               expected_lot_size=1.0, lr=1.0)
    return clipper, dp


def _calibrate_canary(model, clipper, direction: torch.Tensor, cfg: AuditConfig):
    """Scale M and label y so that x = M·direction has gradient norm ≥ canary_norm·C in every group.

    y is the class with the lowest logit, so that the softmax saturating at large M does not make
    the gradient vanish. Returns (x [1, d], y [1], the canary's contribution to the clipped sum).
    """
    with torch.no_grad():
        y = model(direction[None]).argmin(1)
    M = 1.0
    for _ in range(200):
        x = M * direction[None]
        res = clipper.clipped_sum(x, y)
        if float(res.norms.min()) >= cfg.canary_norm * cfg.clip_norm:
            return x, y, res.grads
        M *= 2.0
    raise RuntimeError("could not craft a gradient canary with the requested norm")


def _flat(d: dict, names) -> torch.Tensor:
    return torch.cat([d[n].reshape(-1).double() for n in names])


def _run_tiny(cfg: AuditConfig, noise, gen: torch.Generator):
    """Vectorised trials: column t of nn.Linear(T, 2) is trial t's one-feature model (θ₀ = 0)."""
    scores, present = [], []
    T = cfg.chunk
    model = torch.nn.Linear(T, 2, bias=False)
    clipper, dp = _mechanism(model, cfg, noise)
    with torch.no_grad():
        model.weight.zero_()
    e0 = torch.zeros(T)
    e0[0] = 1.0
    x0, y0, g0 = _calibrate_canary(model, clipper, e0, cfg)
    M, y_canary = float(x0[0, 0]), int(y0[0])
    u = g0["weight"][:, 0].double()
    u = u / u.norm()                                      # direction of the canary's contribution
    remaining = cfg.trials
    while remaining > 0:
        n = min(T, remaining)
        is_in = torch.zeros(T, dtype=torch.bool)          # columns beyond n are unused this round
        is_in[torch.randperm(n, generator=gen)[: n // 2]] = True
        sampled = is_in & (torch.rand(T, generator=gen) < cfg.q)
        idx = sampled.nonzero().flatten()
        x = torch.zeros(len(idx), T)
        x[torch.arange(len(idx)), idx] = M
        y = torch.full((len(idx),), y_canary, dtype=torch.long)
        with torch.no_grad():
            model.weight.zero_()
        dp.step(x, y, physical_batch_size=512)
        with torch.no_grad():
            released = -model.weight.detach().double()   # (θ₀ − θ₁)·L/η with θ₀ = 0, L = η = 1
        s = (u[:, None] * released).sum(0)
        scores.append(s[:n].numpy())
        present.append(is_in[:n].numpy())
        remaining -= n
    return np.concatenate(scores), np.concatenate(present), len(clipper.groups)


def _run_mnist(cfg: AuditConfig, noise, gen: torch.Generator):
    """The paper's MNIST network shape, one real DP-SGD step per trial from the same θ₀."""
    from dpsgd.models import MLP

    with torch.random.fork_rng():
        torch.manual_seed(cfg.seed)
        model = MLP(60, (1000,), 10, bias=False)
    clipper, dp = _mechanism(model, cfg, noise)
    names = list(dp.params)
    theta0 = {n: p.detach().clone() for n, p in dp.params.items()}
    direction = torch.randn(60, generator=gen)
    x_c, y_c, g_c = _calibrate_canary(model, clipper, direction / direction.norm(), cfg)
    u = _flat(g_c, names)
    u = u / u.norm()
    theta0_flat = _flat(theta0, names)
    present = (torch.randperm(cfg.trials, generator=gen) < cfg.trials // 2).numpy()
    sampled = present & (torch.rand(cfg.trials, generator=gen) < cfg.q).numpy()
    empty_x, empty_y = x_c[:0], y_c[:0]
    scores = np.empty(cfg.trials)
    for i in range(cfg.trials):
        with torch.no_grad():
            for n, p in dp.params.items():
                p.copy_(theta0[n])
        if sampled[i]:
            dp.step(x_c, y_c, physical_batch_size=1)
        else:
            dp.step(empty_x, empty_y, physical_batch_size=1)
        released = theta0_flat - _flat({n: p.detach() for n, p in dp.params.items()}, names)
        scores[i] = float(released @ u)
    return scores, present, len(clipper.groups)


def run_audit(cfg: AuditConfig) -> AuditResult:
    """Play the distinguishing game for ``cfg.trials`` trials and bound ε from below."""
    from dpsgd.noise import GaussianNoise

    cfg.validate()
    start = time.perf_counter()
    gen = torch.Generator().manual_seed(cfg.seed)
    noise = GaussianNoise(seed=None if cfg.secure_rng else cfg.seed + 1, secure=cfg.secure_rng)
    run = _run_tiny if cfg.setting == "tiny" else _run_mnist
    threads = torch.get_num_threads()
    torch.set_num_threads(cfg.threads)
    try:
        scores, present, groups = run(cfg, noise, gen)
    finally:
        torch.set_num_threads(threads)
    stat = epsilon_lower_bound(scores, present, cfg.delta, cfg.alpha, cfg.select_fraction,
                               seed=cfg.seed)
    claimed = claimed_epsilon(cfg, groups)
    return AuditResult(config=asdict(cfg), eps_claimed=claimed, groups=groups,
                       seconds=time.perf_counter() - start, **stat)


# --- CLI -------------------------------------------------------------------------------------------
def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m dpsgd.audit",
        description="Empirical privacy audit of one DP-SGD step: a gradient canary, the "
                    "distinguishing game D = ∅ vs D' = {canary} on the real DPSGD/clipper/noise "
                    "code, and a 95 % Clopper–Pearson lower bound on ε next to the accountant's ε.",
        epilog="Examples: python -m dpsgd.audit --mechanism all  |  "
               "python -m dpsgd.audit --setting mnist --sigma 4 --trials 20000")
    p.add_argument("--setting", choices=sorted(SETTINGS), default="tiny",
                   help="tiny: vectorised one-feature models (fast); mnist: the paper's "
                        "PCA-60 → 1000 → 10 network, per-layer clipping (default: tiny)")
    p.add_argument("--mechanism", choices=MECHANISMS + ("all",), default="all",
                   help="mechanism under audit; no_clip and noise_div10 are deliberately broken "
                        "(default: all three)")
    p.add_argument("--sigma", type=float, help="claimed noise multiplier σ (tiny: 2, mnist: 4)")
    p.add_argument("--clip-norm", type=float, help="claimed clipping bound C (tiny: 1, mnist: 4)")
    p.add_argument("--clipping", choices=("global", "per_layer"),
                   help="clipping groups (tiny: global, mnist: per_layer)")
    p.add_argument("--q", type=float, default=1.0, help="Poisson inclusion probability of the canary")
    p.add_argument("--delta", type=float, default=1e-5, help="δ (default 1e-5)")
    p.add_argument("--trials", type=int, help="trials per mechanism, half with the canary "
                                              "(tiny: 50000, mnist: 20000)")
    p.add_argument("--select-fraction", type=float, default=0.5,
                   help="fraction of trials used only to choose the threshold (default 0.5)")
    p.add_argument("--alpha", type=float, default=0.05, help="1 − confidence (default 0.05)")
    p.add_argument("--canary-norm", type=float, default=10.0,
                   help="canary gradient norm per group, in units of C (default 10)")
    p.add_argument("--accountants", default="pld,rdp,moments",
                   help="comma-separated accountants for the claimed ε (default pld,rdp,moments)")
    p.add_argument("--seed", type=int, default=0, help="seed of trials and noise (default 0)")
    p.add_argument("--secure-rng", action="store_true",
                   help="draw the noise from OS entropy (not reproducible)")
    p.add_argument("--threads", type=int, default=1, help="torch threads (default 1)")
    p.add_argument("--json", metavar="PATH", help="also write the results as JSON to PATH")
    return p


def _format(r: AuditResult) -> str:
    claimed = "  ".join(f"{k}={v:.3f}" for k, v in r.eps_claimed.items())
    verdict = "VIOLATION (ε_lb > claimed ε)" if r.violation else "consistent (ε_lb ≤ claimed ε)"
    return (f"{r.config['mechanism']:<12} ε_lb={r.eps_lb:6.3f} (point {r.eps_point:6.3f})  "
            f"claimed: {claimed}  FP={r.false_pos}/{r.n_out} FN={r.false_neg}/{r.n_in}  "
            f"{r.seconds:5.1f}s  {verdict}")


def main(argv=None) -> int:
    args = _parser().parse_args(argv)
    d = SETTINGS[args.setting]
    mechanisms = MECHANISMS if args.mechanism == "all" else (args.mechanism,)
    results = []
    try:
        base = dict(threads=args.threads, setting=args.setting,
                    sigma=d["sigma"] if args.sigma is None else args.sigma,
                    clip_norm=d["clip_norm"] if args.clip_norm is None else args.clip_norm,
                    clipping=args.clipping or d["clipping"],
                    trials=d["trials"] if args.trials is None else args.trials,
                    q=args.q, delta=args.delta, select_fraction=args.select_fraction,
                    alpha=args.alpha, canary_norm=args.canary_norm, seed=args.seed,
                    secure_rng=args.secure_rng,
                    accountants=tuple(a for a in args.accountants.split(",") if a))
        configs = [AuditConfig(mechanism=m, **base) for m in mechanisms]
        for c in configs:
            c.validate()
        if args.json and os.path.exists(args.json):
            raise ValueError(f"--json {args.json!r} exists: refusing to overwrite an earlier result")
        print(f"audit: setting={base['setting']} σ={base['sigma']} C={base['clip_norm']} "
              f"clipping={base['clipping']} q={base['q']} δ={base['delta']} trials={base['trials']} "
              f"confidence={1 - base['alpha']:.0%} seed={base['seed']}", flush=True)
        for c in configs:
            r = run_audit(c)
            results.append(r)
            print(_format(r), flush=True)
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    if args.json:
        with open(args.json, "x") as f:               # never overwrite an earlier result
            json.dump([dict(asdict(r), violation=r.violation) for r in results], f, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
