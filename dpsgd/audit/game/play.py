"""The distinguishing game, played against the real DP-SGD step (Abadi et al. 2016, Algorithm 1).

Neighbours D = ∅ and D' = {canary} (add/remove; the worst case for a white-box adversary, Nasr et
al. 2021, 2023); the mechanism is ``dpsgd.mechanism.optim.DPSGD`` with the clipper and noise that
training builds, at L = η = 1 (the released step is the noisy sum itself). The gradient canary is
one crafted input whose per-example gradient at θ₀ has norm ≥ ``canary_norm`` × C in every
clipping group, injected through the data with Poisson inclusion q. The score is the projection
of the released noisy sum onto the direction of the canary's clipped gradient (the
likelihood-ratio statistic for a Gaussian mechanism, by Neyman–Pearson).

``run_audit`` plays ``cfg.trials`` trials, half with the canary, bounds ε from below with
``dpsgd.audit.game.stats`` and sets it beside the claimed ε of ``dpsgd.audit.game.claim``.

Details (the neighbours, the mechanism, the canary, the score): docs/AUDIT.md,
"dpsgd/audit/game/play.py".
"""

from __future__ import annotations

import time
from dataclasses import asdict
from types import SimpleNamespace

import numpy as np
import torch

from dpsgd.mechanism.clipping import PerExampleClipper
from dpsgd.mechanism.noise import GaussianNoise
from dpsgd.mechanism.optim import DPSGD
from dpsgd.mechanism.plan import Plan
from dpsgd.models.networks import MLP

from ..variants import break_mechanism
from .claim import claimed_epsilon
from .settings import AuditConfig, AuditResult
from .stats import clopper_pearson_bound


def _mechanism(model, cfg: AuditConfig, noise):
    """(clipper, DPSGD) as training builds them, L = η = 1 (post-processing), then broken as
    ``cfg.mechanism`` says by the variants the one-run audit uses too (``dpsgd.audit.variants``)."""
    clipper = PerExampleClipper(model, clip_norm=cfg.clip_norm, clipping=cfg.clipping)
    dp = DPSGD(model, clipper, noise, Plan.by_hand(cfg.sigma, cfg.clip_norm, 1.0), lr=1.0)
    break_mechanism(SimpleNamespace(dp=dp, clipper=clipper), cfg.mechanism)
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
    """Vectorised trials: column t of nn.Linear(T, 2) is trial t's one-feature model (θ₀ = 0).
    Example t only touches column t and the noise is i.i.d. per coordinate, so one step plays T
    independent trials."""
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
    u = u / u.norm()  # direction of the canary's contribution
    remaining = cfg.trials
    while remaining > 0:
        n = min(T, remaining)
        is_in = torch.zeros(T, dtype=torch.bool)  # columns beyond n are unused this round
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
            released = -model.weight.detach().double()  # (θ₀ − θ₁)·L/η with θ₀ = 0, L = η = 1
        s = (u[:, None] * released).sum(0)
        scores.append(s[:n].numpy())
        present.append(is_in[:n].numpy())
        remaining -= n
    return np.concatenate(scores), np.concatenate(present), len(clipper.groups)


def _run_mnist(cfg: AuditConfig, noise, gen: torch.Generator):
    """The paper's MNIST network shape, one real DP-SGD step per trial from the same θ₀.

    ``mnist``: D = ∅ against D' = {canary}, scored by the projection of the release on the canary's
    direction. ``mnist_other``: D = {x_o} against D' = {x_o, canary}, scored by −‖(θ₀ − θ₁) − g_o‖²,
    with g_o = x_o's clipped gradient at θ₀ (known to a white-box adversary)."""
    with torch.random.fork_rng():
        torch.manual_seed(cfg.seed)
        model = MLP(60, (1000,), 10, bias=False)
    clipper, dp = _mechanism(model, cfg, noise)
    names = list(dp.params)
    theta0 = {n: p.detach().clone() for n, p in dp.params.items()}
    direction = torch.randn(60, generator=gen)
    x_c, y_c, g_c = _calibrate_canary(model, clipper, direction / direction.norm(), cfg)
    if cfg.setting == "mnist_other":
        x_o = torch.randn(1, 60, generator=gen)
        y_o = model(x_o).argmax(1).detach()
        g_o = _flat(clipper.clipped_sum(x_o, y_o).grads, names)
        score = lambda released: -float(((released - g_o) ** 2).sum())  # noqa: E731
    else:
        x_o, y_o = x_c[:0], y_c[:0]
        u = _flat(g_c, names)
        u = u / u.norm()
        score = lambda released: float(released @ u)  # noqa: E731
    theta0_flat = _flat(theta0, names)
    present = (torch.randperm(cfg.trials, generator=gen) < cfg.trials // 2).numpy()
    sampled = present & (torch.rand(cfg.trials, generator=gen) < cfg.q).numpy()
    scores = np.empty(cfg.trials)
    for i in range(cfg.trials):
        with torch.no_grad():
            for n, p in dp.params.items():
                p.copy_(theta0[n])
        x, y = (torch.cat([x_o, x_c]), torch.cat([y_o, y_c])) if sampled[i] else (x_o, y_o)
        dp.step(x, y, physical_batch_size=2)
        scores[i] = score(theta0_flat - _flat({n: p.detach() for n, p in dp.params.items()}, names))
    return scores, present, len(clipper.groups)


RUNS = {"tiny": _run_tiny, "mnist": _run_mnist, "mnist_other": _run_mnist}


def run_audit(cfg: AuditConfig) -> AuditResult:
    """Play the distinguishing game for ``cfg.trials`` trials and bound ε from below."""
    cfg.validate()
    start = time.perf_counter()
    gen = torch.Generator().manual_seed(cfg.seed)
    noise = GaussianNoise(seed=None if cfg.secure_rng else cfg.seed + 1, secure=cfg.secure_rng)
    run = RUNS[cfg.setting]
    threads = torch.get_num_threads()
    torch.set_num_threads(cfg.threads)
    try:
        scores, present, groups = run(cfg, noise, gen)
    finally:
        torch.set_num_threads(threads)
    stat = clopper_pearson_bound(
        scores, present, cfg.delta, cfg.alpha, cfg.select_fraction, seed=cfg.seed
    )
    claimed = claimed_epsilon(cfg, groups)
    return AuditResult(
        config=asdict(cfg),
        eps_claimed=claimed,
        groups=groups,
        seconds=time.perf_counter() - start,
        **stat,
    )
