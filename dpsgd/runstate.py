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

from .augment import LotTransform, lot_generator
from .checkpoint import CHECKPOINT, METRICS, PRIVACY, MetricsWriter, check_resumable, load_checkpoint, save_checkpoint
from . import distributed
from .config import Config, ConfigError, override_key, privacy_fingerprint
from .data import DATASETS, input_shape, load_dataset
from .fileio import atomic_write_text, plain, write_json
from .models import build_model, frozen_names
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


def resolve_device(name: str, local_rank: int | None = None) -> torch.device:
    """``auto``: CUDA when present; under torchrun ``auto``/``cuda`` mean cuda:LOCAL_RANK."""
    if name == "auto":
        name = "cuda" if torch.cuda.is_available() else "cpu"
    if name == "cuda" and local_rank is not None:
        return torch.device(f"cuda:{local_rank % torch.cuda.device_count()}")
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
    dist: distributed.Dist = field(default_factory=distributed.Dist)
    lost: int = 0                # lots charged on resume as lost (ran after the checkpoint, not replayable)
    epoch: int = 0
    steps: int = 0
    budget: int | None = None    # charges (lots; for shuffle, epochs) that still fit within the target ε
    resumes: list = field(default_factory=list)
    ema: object = None           # ema.EMA of the weights (training.ema_decay), or None
    wall_before: float = 0.0
    eps: dict = field(default_factory=dict)
    t_start: float = field(default_factory=time.time)
    transform: LotTransform = field(default_factory=LotTransform)   # per-example: augmentation, standardisation

    def augment(self, x: torch.Tensor, step: int) -> torch.Tensor:
        """Lot ``step``'s examples as the DP step sees them (seeded by the run's seed and ``step``).

        Under augmentation multiplicity (privacy.augment_multiplicity K > 1) the transform runs
        inside the DP step instead, on the K copies of each example (each copy its own draw from
        the lot's generator), so the lot is passed on as stored."""
        if self.dp.K > 1 and not self.transform.identity:
            self.dp.augment = self.transform
            self.dp.augment_generator = lot_generator(self.transform.seed, step)
            return x
        return self.transform.train(x, step)

    @property
    def k(self) -> int:          # separately clipped groups per lot
        return len(self.clipper.groups)

    @property
    def noise(self):
        return self.dp.noise

    @property
    def writes(self) -> bool:    # rank 0 (or the one process) writes the run directory
        return self.dist.writes

    def statement(self, status: str, stop_reason: str | None) -> dict:
        return privacy_statement(self.c, self, status, stop_reason)

    def checkpoint(self, complete: bool, stop_reason: str | None, status: str | None = None) -> None:
        if not self.writes:
            return
        save_checkpoint(self.run_dir, {
            "epoch": self.epoch, "steps": self.steps, "complete": complete, "stop_reason": stop_reason,
            "model": {n: v.detach().cpu() for n, v in self.model.state_dict().items()},
            "ledger": plain(self.ledger.to_dict()), "sampler": self.sampler.state_dict(),
            "noise": self.dp.noise.state_dict(), "optimizer": self.dp.state_dict(),
            "projection": None if self.projection is None else self.projection.cpu(),
            "target_epsilon": self.c.privacy.target_epsilon, "rows": plain(self.writer.rows),
            "fingerprint": privacy_fingerprint(self.c), "overrides": list(self.overrides),
            "replay": replay_key(self.c, self.device), "distributed": self.dist.describe(self.device),
            "wall_time_s": self.wall_before + time.time() - self.t_start, "resumes": plain(self.resumes),
            "ema": None if self.ema is None else self.ema.state_dict(),   # the released model when on
            "statement": plain(self.statement(status or ("complete" if complete else "running"), stop_reason)),
        })
        self.reservations.clear()   # the checkpoint's ledger covers every lot reserved so far


def setup(c: Config, run_dir: Path, overrides: list[str]) -> Run | dict:
    """Build a fresh run, or restore one from its checkpoint (a finished run: its statement).

    Under torchrun every rank reads and builds (the same run), then all agree (a barrier that also
    agrees on refusals), then rank 0 alone writes: nothing is written before every rank has read."""
    d = distributed.current()
    p = c.privacy
    seeds = distributed.broadcast_object(   # rank 0's (with secure_rng: OS-entropy) seeds on every rank
        {s: derive_seed(c.seed, s, p.secure_rng) for s in ("pca", "sampler")})
    try:
        run, err = _build(c, run_dir, overrides, d, seeds), None
    except Exception as e:  # noqa: BLE001 (re-raised by agree, on this rank; the others stop quietly)
        run, err = None, e
    distributed.agree(err)
    if isinstance(run, dict):
        return run
    if d.active:
        distributed.check_identical([*run.model.state_dict().values()]
                                    + ([] if run.projection is None else [run.projection]),
                                    "initial parameters or the projection")
    if not run.writes:
        return run
    lost = run.lost
    run.writer = MetricsWriter(run_dir, COLUMNS, run.writer.rows)
    if lost:   # make the charge durable before anything else runs
        run.checkpoint(False, None)
    if not (run_dir / "config.resolved.yaml").exists():   # the validated, fully resolved config
        import yaml
        atomic_write_text(run_dir / "config.resolved.yaml", yaml.safe_dump(c.to_dict(), sort_keys=False))
    write_json(run_dir / PRIVACY, run.statement("running", None))
    ws = f", {d.world_size} processes ({d.describe(run.device)['backend']})" if d.active else ""
    print(f"dpsgd: {c.dataset.name} N={len(run.data[0])} → {run_dir}  (device {run.device}{ws}, engine "
          f"{run.clipper.mode}, k={run.k}, {run.sampler.name} q={run.sampler.q:.4g}, σ={p.sigma}, C={p.clip_norm}, "
          f"L={p.lot_size})" if p.private else f"dpsgd: NOT PRIVATE run on {c.dataset.name} → {run_dir}", flush=True)
    if lost:
        print(f"resume: charged {lost} lot(s) that ran after the last checkpoint and cannot be replayed "
              "as the same releases", flush=True)
    return run


class _Rows:
    """The metrics rows of a rank that does not write (ranks > 0): kept, never written."""

    def __init__(self, rows: list):
        self.rows = list(rows)

    def append(self, row: dict) -> None:
        self.rows.append(dict(row))


def _build(c: Config, run_dir: Path, overrides: list[str], d: distributed.Dist, seeds: dict) -> Run | dict:
    """Every read and every refusal of ``setup``; writes nothing (``run.writer`` only holds the rows
    so far)."""
    from .accountant import Ledger
    from .clipping import PerExampleClipper
    from .noise import GaussianNoise
    from .optim import DPSGD
    from .pca import fit_projection, project
    from .sampling import make_sampler

    p, t = c.privacy, c.training
    ckpt, finished = _checkpoint_to_resume(c, run_dir, d) if c.resume else (None, None)
    if finished is not None:
        return finished
    if ckpt is None and d.writes and any((run_dir / f).exists() for f in (CHECKPOINT, PRIVACY, METRICS, RESERVATIONS)):
        raise ConfigError(f"hydra.run.dir={run_dir}: already holds a run; never overwritten (use resume={run_dir})")
    device = resolve_device(c.device, d.local_rank if d.active else None)
    set_tf32(c.tf32)
    runtime = describe_runtime(device, c.tf32, configure_threads())
    # data (kept at 32×32 when lots are randomly cropped), then DP-PCA: the first release charged to the ledger
    ds = c.dataset
    Xtr, ytr, Xte, yte = load_dataset(ds.name, ds.root, ds.subset, None if ds.augment != "none" else ds.crop,
                                      download=ds.download)
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
        gen = torch.Generator().manual_seed(seeds["pca"])
        V = fit_projection(c.model.projection, Xtr, c.model.pca_dims, p.sigma_p if p.private else 0.0,
                           gen, ledger if p.private else None, p.pca_fraction)
    else:
        V = ckpt["projection"]
    if V is not None:
        Xtr, Xte = project(Xtr, V), project(Xte, V)
    # the model, initialised from its own seed (global RNG state untouched)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(derive_seed(c.seed, "model"))
        shape = input_shape(ds.name, ds.crop) if ds.augment != "none" else tuple(Xtr.shape[1:])
        model = build_model(c.model, shape, DATASETS[ds.name].classes)
        if c.model.pretrained is not None:   # public weights (not charged); frozen before the clipper is built
            from .pretrained import load
            load(model, c.model.pretrained, c.model.pretrained_sha256, frozen_names(model, c.model.freeze))
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
               expected_lot_size=p.lot_size, lr=t.lr, momentum=t.momentum,
               augment_multiplicity=p.augment_multiplicity)
    sampler = make_sampler(p.sampling, len(Xtr), p.lot_size,
                           torch.Generator().manual_seed(seeds["sampler"]))
    data = tuple(a.to(device) for a in (Xtr, ytr, Xte, yte))
    if d.active:   # Σ over ranks, noise once; the noise is drawn in the engine's parameter order
        dp.comm = distributed.Aggregator(d, p.secure_rng, list(clipper.clipped_sum(data[0][:1], data[1][:1]).grads))
    run = Run(c, run_dir, overrides, device, data, V, model,
              clipper, dp, sampler, ledger, None, LotReservations(run_dir), runtime, d,
              transform=LotTransform(ds.augment, ds.standardize, ds.crop, c.seed))
    if t.ema_decay is not None:
        from .ema import EMA
        run.ema = EMA(model, t.ema_decay)
    run.lost = _restore(run, ckpt) if ckpt is not None else 0
    run.budget = _budget(run, resumed=ckpt is not None)
    run.writer = _Rows(ckpt["rows"] if ckpt is not None else [])
    run.eps = epsilons(ledger, c)
    return run


def _checkpoint_to_resume(c: Config, run_dir: Path, d: distributed.Dist) -> tuple[dict, dict | None]:
    """(the verified checkpoint of a run to resume, its final statement when it has finished)."""
    ckpt = load_checkpoint(run_dir)
    if ckpt is None:
        raise ConfigError(f"resume={run_dir}: no checkpoint.pt (the run stopped before its first "
                          "checkpoint); start a new run")
    check_resumable(ckpt["fingerprint"], privacy_fingerprint(c))
    saved = int((ckpt.get("distributed") or {}).get("world_size", 1))
    if saved != d.world_size:
        raise ConfigError(f"resume: world_size={d.world_size} differs from the run's world_size={saved} "
                          f"(processes: torchrun --nnodes × --nproc_per_node); resume with {saved}")
    if ckpt["complete"] and (ckpt["stop_reason"] != "epochs_completed" or c.training.epochs <= ckpt["epoch"]):
        if d.writes:
            print(f"{run_dir}: run already finished ({ckpt['stop_reason']}); nothing to do")
        return ckpt, ckpt["statement"]
    return ckpt, None


def _restore(run: Run, ckpt: dict) -> int:
    """Continue from the checkpoint; charge the lots after it that cannot be replayed (returns how many)."""
    p = run.c.privacy
    run.sampler.load_state_dict(ckpt["sampler"])
    run.dp.noise.load_state_dict(ckpt["noise"])
    run.dp.load_state_dict(ckpt["optimizer"])
    if run.ema is not None:     # training.ema_decay is in the fingerprint: the checkpoint has the EMA
        run.ema.load_state_dict(ckpt["ema"])
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
