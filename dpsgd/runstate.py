"""The state of one run of Algorithm 1: built fresh, or restored from its checkpoint, and saved to one.

``setup`` loads the data, runs (DP-)PCA (the first release charged to the ledger), builds the model,
the clipping engine, the noise and the DP-SGD step, and the sampler (the one source of q). On resume it
restores every generator and the ledger from the verified checkpoint, charges the lots that ran after
it when they cannot be replayed as the same releases (see rundir.py), and recomputes the remaining
budget from the ledger. Every refusal happens before the first write into the run directory.
"""
from __future__ import annotations

import secrets
import time
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch

from .checkpoint import CHECKPOINT, METRICS, PRIVACY, MetricsWriter, check_resumable, load_checkpoint, save_checkpoint
from .config import Config, ConfigError, build_model, override_key, privacy_fingerprint
from .data import DATASETS, load_dataset
from .fileio import atomic_write_text, plain, write_json
from .report import COLUMNS, epsilons, privacy_statement
from .rundir import RESERVATIONS, LotReservations
from .runtime import configure_threads, describe_runtime, set_tf32


def derive_seed(seed: int, stream: str, secure: bool = False) -> int:
    """Independent 63-bit seeds per random stream (pca, model, sampler, noise) from one seed.

    With ``secure=True`` (privacy.secure_rng) the seed comes from OS entropy instead, so the lots
    and the DP-PCA noise cannot be replayed from the (public) config seed."""
    if secure:
        return secrets.randbits(63)
    tag = int.from_bytes(stream.encode(), "little")
    return int(np.random.SeedSequence([seed, tag]).generate_state(1, np.uint64)[0] >> np.uint64(1))


def resolve_device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(name)


def replay_key(c: Config, device: torch.device) -> dict:
    """What a seeded resume must share with the original run for its recomputed lots to be the very
    same releases (bit-identical sums); see rundir.LotReservations."""
    return {"device": device.type, "grad_sample_mode": c.privacy.grad_sample_mode,
            "physical_batch_size": c.privacy.physical_batch_size, "tf32": bool(c.tf32),
            "torch": str(torch.__version__), "threads": torch.get_num_threads()}


@dataclass
class Run:
    """One run of Algorithm 1: its parts (built by ``setup``) and the state that moves as it runs."""
    c: Config
    run_dir: Path
    overrides: list
    device: torch.device
    data: tuple                  # X_train, y_train, X_test, y_test (projected, on the device)
    projection: torch.Tensor | None
    model: torch.nn.Module
    clipper: object
    dp: object                   # DPSGD: clip, noise, divide by L, descend
    sampler: object              # the one source of q for the ledger
    ledger: object
    writer: MetricsWriter
    reservations: LotReservations
    runtime: dict
    epoch: int = 0
    steps: int = 0
    budget: int | None = None    # charges (lots; for shuffle, epochs) that still fit within the target ε
    resumes: list = field(default_factory=list)
    wall_before: float = 0.0
    eps: dict = field(default_factory=dict)
    t_start: float = field(default_factory=time.time)

    @property
    def k(self) -> int:          # separately clipped groups per lot
        return len(self.clipper.groups)

    @property
    def noise(self):
        return self.dp.noise

    def statement(self, status: str, stop_reason: str | None) -> dict:
        return privacy_statement(self.c, self, status, stop_reason)

    def checkpoint(self, complete: bool, stop_reason: str | None, status: str | None = None) -> None:
        save_checkpoint(self.run_dir, {
            "epoch": self.epoch, "steps": self.steps, "complete": complete, "stop_reason": stop_reason,
            "model": {n: v.detach().cpu() for n, v in self.model.state_dict().items()},
            "ledger": plain(self.ledger.to_dict()), "sampler": self.sampler.state_dict(),
            "noise": self.dp.noise.state_dict(), "optimizer": self.dp.state_dict(),
            "projection": None if self.projection is None else self.projection.cpu(),
            "target_epsilon": self.c.privacy.target_epsilon, "rows": plain(self.writer.rows),
            "fingerprint": privacy_fingerprint(self.c), "overrides": list(self.overrides),
            "replay": replay_key(self.c, self.device),
            "wall_time_s": self.wall_before + time.time() - self.t_start, "resumes": plain(self.resumes),
            "statement": plain(self.statement(status or ("complete" if complete else "running"), stop_reason)),
        })
        self.reservations.clear()   # the checkpoint's ledger covers every lot reserved so far


def setup(c: Config, run_dir: Path, overrides: list[str]) -> Run | dict:
    """Build a fresh run, or restore one from its checkpoint (a finished run: its statement)."""
    from .accountant import Ledger
    from .clipping import PerExampleClipper
    from .noise import GaussianNoise
    from .optim import DPSGD
    from .pca import fit_projection, project
    from .sampling import make_sampler

    p, t = c.privacy, c.training
    ckpt, finished = _checkpoint_to_resume(c, run_dir) if c.resume else (None, None)
    if finished is not None:
        return finished
    if ckpt is None and any((run_dir / f).exists() for f in (CHECKPOINT, PRIVACY, METRICS, RESERVATIONS)):
        raise ConfigError(f"hydra.run.dir={run_dir}: already holds a run; never overwritten (use resume={run_dir})")
    device = resolve_device(c.device)
    set_tf32(c.tf32)
    runtime = describe_runtime(device, c.tf32, configure_threads())
    # data, then DP-PCA: the first release charged to the ledger
    Xtr, ytr, Xte, yte = load_dataset(c.dataset.name, c.dataset.root, c.dataset.subset, c.dataset.crop,
                                      download=c.dataset.download)
    if c.model.features != "none":   # fixed per-example features (ScatterNet): no privacy cost, cached
        from .data import default_root
        from .features import transform
        Xtr, Xte = transform(c.model.features, Xtr, Xte, dataset=c.dataset.name,
                             root=Path(c.dataset.root) if c.dataset.root else default_root(),
                             norm=c.model.feature_norm, groups=c.model.feature_groups)
    if c.dataset.validation:   # tuning: train on the rest, evaluate on held-out training examples (never the test set)
        n = len(Xtr) - c.dataset.validation
        Xtr, ytr, Xte, yte = Xtr[:n], ytr[:n], Xtr[n:], ytr[n:]
    ledger = Ledger() if ckpt is None else Ledger.from_dict(ckpt["ledger"])
    if ckpt is None:
        gen = torch.Generator().manual_seed(derive_seed(c.seed, "pca", p.secure_rng))
        V = fit_projection(c.model.projection, Xtr, c.model.pca_dims, p.sigma_p if p.private else 0.0,
                           gen, ledger if p.private else None, p.pca_fraction)
    else:
        V = ckpt["projection"]
    if V is not None:
        Xtr, Xte = project(Xtr, V), project(Xte, V)
    # the model, initialised from its own seed (global RNG state untouched)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(derive_seed(c.seed, "model"))
        model = build_model(c.model, tuple(Xtr.shape[1:]), DATASETS[c.dataset.name][3])
    if ckpt is not None:
        model.load_state_dict(ckpt["model"])
    model.to(device)
    # clipping engine, noise, the DP-SGD step, the sampler
    clipper = PerExampleClipper(model, p.clip_norm if p.private else None, clipping=p.clipping,
                                mode=p.grad_sample_mode)
    noise_seed = None if p.secure_rng else (p.noise_seed if p.noise_seed is not None
                                            else derive_seed(c.seed, "noise"))
    noise = GaussianNoise(seed=noise_seed, secure=p.secure_rng, device=device)
    dp = DPSGD(model, clipper, noise, sigma=p.sigma if p.private else 0.0, max_grad_norm=p.clip_norm,
               expected_lot_size=p.lot_size, lr=t.lr, momentum=t.momentum)
    sampler = make_sampler(p.sampling, len(Xtr), p.lot_size,
                           torch.Generator().manual_seed(derive_seed(c.seed, "sampler", p.secure_rng)))
    run = Run(c, run_dir, overrides, device, tuple(a.to(device) for a in (Xtr, ytr, Xte, yte)), V, model,
              clipper, dp, sampler, ledger, None, LotReservations(run_dir), runtime)
    lost = _restore(run, ckpt) if ckpt is not None else 0
    run.budget = _budget(run, resumed=ckpt is not None)
    run.writer = MetricsWriter(run_dir, COLUMNS, ckpt["rows"] if ckpt is not None else [])
    run.eps = epsilons(ledger, c)
    if lost:   # make the charge durable before anything else runs
        run.checkpoint(False, None)
    if not (run_dir / "config.resolved.yaml").exists():   # the validated, fully resolved config
        import yaml
        atomic_write_text(run_dir / "config.resolved.yaml", yaml.safe_dump(c.to_dict(), sort_keys=False))
    write_json(run_dir / PRIVACY, run.statement("running", None))
    print(f"dpsgd: {c.dataset.name} N={len(Xtr)} → {run_dir}  (device {device}, engine {clipper.mode}, "
          f"k={run.k}, {sampler.name} q={sampler.q:.4g}, σ={p.sigma}, C={p.clip_norm}, L={p.lot_size})"
          if p.private else f"dpsgd: NOT PRIVATE run on {c.dataset.name} → {run_dir}", flush=True)
    if lost:
        print(f"resume: charged {lost} lot(s) that ran after the last checkpoint and cannot be replayed "
              "as the same releases", flush=True)
    return run


def _checkpoint_to_resume(c: Config, run_dir: Path) -> tuple[dict, dict | None]:
    """(the verified checkpoint of a run to resume, its final statement when it has finished)."""
    ckpt = load_checkpoint(run_dir)
    if ckpt is None:
        raise ConfigError(f"resume={run_dir}: no checkpoint.pt (the run stopped before its first "
                          "checkpoint); start a new run")
    check_resumable(ckpt["fingerprint"], privacy_fingerprint(c))
    if ckpt["complete"] and (ckpt["stop_reason"] != "epochs_completed" or c.training.epochs <= ckpt["epoch"]):
        print(f"{run_dir}: run already finished ({ckpt['stop_reason']}); nothing to do")
        return ckpt, ckpt["statement"]
    return ckpt, None


def _restore(run: Run, ckpt: dict) -> int:
    """Continue from the checkpoint; charge the lots after it that cannot be replayed (returns how many)."""
    p = run.c.privacy
    run.sampler.load_state_dict(ckpt["sampler"])
    run.dp.noise.load_state_dict(ckpt["noise"])
    run.dp.load_state_dict(ckpt["optimizer"])
    run.epoch, run.steps, run.wall_before = ckpt["epoch"], ckpt["steps"], ckpt["wall_time_s"]
    new_keys = {override_key(o) for o in run.overrides}        # a new value replaces the saved one
    run.overrides = [o for o in ckpt["overrides"] if override_key(o) not in new_keys] + list(run.overrides)
    lost = max(0, (run.reservations.reserved() or 0) - run.steps)
    if not (lost and p.private and (p.secure_rng or ckpt["replay"] != replay_key(run.c, run.device))):
        lost = 0
    counts: dict = {}
    for j in range(lost):   # from an epoch boundary on, each lot's release as the loop charges it
        charge = run.sampler.release(p.sigma, j % run.sampler.lots_per_epoch())
        if charge is not None:
            counts[charge] = counts.get(charge, 0) + 1
    for (q, s), n in counts.items():
        run.ledger.record(q=q, sigma=s, count=n, groups=run.k, label="lost")
    run.resumes = list(ckpt["resumes"]) + [{"at_epoch": run.epoch, "at_steps": run.steps, "lost_lots_charged": lost,
                                            "time": time.strftime("%Y-%m-%dT%H:%M:%S"),
                                            "overrides": run.overrides}]
    return lost


def _budget(run: Run, resumed: bool) -> int | None:
    """Charges that still fit within the target ε, recomputed from the ledger (never read from a file)."""
    c, p = run.c, run.c.privacy
    if not (p.private and p.target_epsilon is not None):
        return None
    q0, s0 = run.sampler.release(p.sigma, 0)
    budget = int(run.ledger.steps_within(p.target_epsilon, p.delta, q0, s0, run.k, c.accountant.name,
                                         p.convention))
    spent = epsilons(run.ledger, c)["epsilon"]
    if resumed and budget == 0 and spent is not None and spent >= p.target_epsilon:
        raise ConfigError(f"privacy.target_epsilon={p.target_epsilon}: at or below the ε={spent:.6g} this run "
                          f"has already spent ({c.accountant.name}, {p.convention}); nothing left to resume")
    return budget
