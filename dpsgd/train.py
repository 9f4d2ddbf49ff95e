"""Train with DP-SGD — Algorithm 1 of Abadi et al. 2016 ("Deep Learning with Differential Privacy").

    python -m dpsgd.train experiment=mnist_medium [key=value ...]      (command line: launch.py)
    python -m dpsgd.train resume=<run dir>

    setup:  data → (DP-)PCA, charged to the ledger → model → clipping engine → DPSGD → sampler (q = L/N)
    for each epoch, for each lot L_t drawn with probability q per example:
        stop before a lot that would pass max_steps or the target ε          (should_stop)
        g̃_t ← (Σ_i clip_C(∇ℓ(θ, x_i)) + N(0, σ²C² I)) / L ;  θ ← θ − η_t g̃_t   (dp.step)
        record the release (q, σ) in the ledger                             (ledger.record)
    end of epoch: evaluate, ε under every accountant, one metrics.csv row, privacy.json, checkpoint

Everything is written into the run directory, atomically, by one process at a time (rundir.RunLock).
"""
from __future__ import annotations

import math
import secrets
import signal
import time
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F

from .checkpoint import (CHECKPOINT, METRICS, PRIVACY, MetricsWriter, check_resumable, load_checkpoint,
                         save_checkpoint)
from .config import Config, ConfigError, build_model, privacy_fingerprint
from .data import DATASETS, load_dataset
from .fileio import atomic_write_text, plain, write_json
from .report import COLUMNS, epsilons, final_line, metrics_row, privacy_statement, progress_line
from .rundir import RESERVATIONS, LotReservations, RunLock
from .runtime import configure_threads, describe_runtime, set_tf32


def lr_at(t, epoch0: int) -> float:
    """The paper code's VaryRate: lr falls linearly from lr to lr_end over the first lr_saturate_epochs
    epochs (epoch0 = 0 → lr, epoch0 = saturate − 1 → lr_end), then stays at lr_end."""
    if t.lr_saturate_epochs <= 1:
        return t.lr_end if t.lr_saturate_epochs == 1 else t.lr
    if epoch0 >= t.lr_saturate_epochs:
        return t.lr_end
    return t.lr - (t.lr - t.lr_end) * epoch0 / (t.lr_saturate_epochs - 1)


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


@torch.no_grad()
def evaluate(model, X, y, batch_size: int) -> tuple[float, float]:
    """(mean cross-entropy, accuracy) on (X, y), eval mode, batched."""
    was = model.training
    model.eval()
    loss, correct = 0.0, 0
    for s in range(0, len(X), batch_size):
        out = model(X[s:s + batch_size])
        loss += F.cross_entropy(out, y[s:s + batch_size], reduction="sum").item()
        correct += (out.argmax(1) == y[s:s + batch_size]).sum().item()
    model.train(was)
    return loss / max(1, len(X)), correct / max(1, len(X))


class Interrupted(Exception):
    """Ctrl-C, SIGTERM or SIGHUP during training (the run's privacy.json says 'interrupted')."""

    def __init__(self, signum: int):
        super().__init__(signal.Signals(signum).name)
        self.signum, self.run_dir = signum, None


class Diverged(RuntimeError):
    """A non-finite loss or parameter stopped the run (status 'diverged', no model released)."""


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
            "noise": self.dp.noise.state_dict(),
            "projection": None if self.projection is None else self.projection.cpu(),
            "target_epsilon": self.c.privacy.target_epsilon, "rows": plain(self.writer.rows),
            "fingerprint": privacy_fingerprint(self.c), "overrides": list(self.overrides),
            "replay": replay_key(self.c, self.device),
            "wall_time_s": self.wall_before + time.time() - self.t_start, "resumes": plain(self.resumes),
            "statement": plain(self.statement(status or ("complete" if complete else "running"), stop_reason)),
        })
        self.reservations.clear()   # the checkpoint's ledger covers every lot reserved so far


def train(c: Config, run_dir: str | Path, overrides: list[str] | None = None) -> dict:
    """Run (or resume) Algorithm 1 in ``run_dir``; returns the final privacy statement.

    The run directory is locked for the whole call (one writer); every refusal happens in ``setup``,
    before the first write into it."""
    run_dir = Path(run_dir)
    run_dir.mkdir(parents=True, exist_ok=True)
    with RunLock(run_dir, "resume" if c.resume else "hydra.run.dir"):
        run = setup(c, run_dir, list(overrides or []))
        return run if isinstance(run, dict) else algorithm1(run)


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
               expected_lot_size=p.lot_size, lr=t.lr)
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
    run.epoch, run.steps, run.wall_before = ckpt["epoch"], ckpt["steps"], ckpt["wall_time_s"]
    run.overrides = list(ckpt["overrides"]) + [o for o in run.overrides if o not in ckpt["overrides"]]
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


def should_stop(run: Run, lot_in_epoch: int) -> str | None:
    """The one stop rule, asked before each lot: max_steps, or the lot's charge would pass the target ε."""
    t = run.c.training
    if t.max_steps is not None and run.steps >= t.max_steps:
        return "max_steps"
    if run.budget is not None and run.budget <= 0 and run.c.privacy.private \
            and run.sampler.release(run.c.privacy.sigma, lot_in_epoch) is not None:
        return "target_epsilon_reached"
    return None


def algorithm1(run: Run) -> dict:
    """Epochs of lots until the epochs, max_steps or the target ε are reached, or the run diverges."""
    c, t = run.c, run.c.training
    stop_reason = None
    try:
        with _signals_as_interrupts():
            while stop_reason is None and run.epoch < t.epochs:
                t_epoch, lr = time.time(), lr_at(t, run.epoch)
                run.dp.set_lr(lr)
                stop_reason, lots, loss_sum, seen = run_epoch(run)
                if lots == 0:
                    break
                run.epoch += 1
                run.eps = epsilons(run.ledger, c)
                if not (bool(torch.isfinite(loss_sum)) and all(bool(torch.isfinite(w).all())
                                                               for w in run.model.parameters())):
                    stop_reason = "diverged"
                stop_reason = end_of_epoch(run, stop_reason, lr, float(loss_sum) / max(1, seen), t_epoch)
        stop_reason = stop_reason or "epochs_completed"
    except Interrupted as e:
        run.eps = epsilons(run.ledger, c)   # every lot that ran is in the ledger
        write_json(run.run_dir / PRIVACY, run.statement("interrupted", "interrupted"))
        e.run_dir = run.run_dir
        raise
    status = "diverged" if stop_reason == "diverged" else "complete"
    run.checkpoint(True, stop_reason, status)
    final = run.statement(status, stop_reason)
    write_json(run.run_dir / PRIVACY, final)
    if status == "diverged":
        raise Diverged(f"training diverged at epoch {run.epoch} (non-finite loss or parameters; training.lr="
                       f"{t.lr:g} may be too large): {final['statement']}; {run.run_dir / PRIVACY}")
    last = run.writer.rows[-1] if run.writer.rows else {}
    print(final_line(final, last.get("test_accuracy", math.nan), run.run_dir), flush=True)
    return final


def run_epoch(run: Run):
    """One epoch of lots (Algorithm 1's inner loop); (stop reason or None, lots, Σ loss, Σ lot sizes)."""
    p, t = run.c.privacy, run.c.training
    X, y = run.data[0], run.data[1]
    lots, loss_sum, seen = 0, torch.zeros((), device=run.device), 0
    epoch_end = run.steps + run.sampler.lots_per_epoch()
    for i, idx in enumerate(run.sampler.epoch()):
        stop_reason = should_stop(run, i)
        if stop_reason is not None:
            return stop_reason, lots, loss_sum, seen
        charge = run.sampler.release(p.sigma, i) if p.private else None
        if p.private:   # write-ahead: never past the epoch, max_steps or the budget
            limit = min(epoch_end, t.max_steps or epoch_end)
            if run.budget is not None and run.sampler.amplification:
                limit = min(limit, run.steps + run.budget)
            run.reservations.ensure(run.steps, limit)
        idx = idx.to(run.device)
        out = run.dp.step(X[idx], y[idx], physical_batch_size=p.physical_batch_size)
        if charge is not None:
            run.ledger.record(q=charge[0], sigma=charge[1], count=1, groups=run.k, label="sgd")
            if run.budget is not None:
                run.budget -= 1
        run.steps, lots = run.steps + 1, lots + 1
        loss_sum, seen = loss_sum + out["loss_sum"], seen + out["lot_size"]
    return None, lots, loss_sum, seen


def end_of_epoch(run: Run, stop_reason, lr: float, lot_loss: float, t_epoch: float) -> str | None:
    """Evaluate (when due), one metrics.csv row, and (unless this was the last epoch) privacy.json and
    the checkpoint."""
    c, t = run.c, run.c.training
    final = (stop_reason is not None or run.epoch == t.epochs
             or (t.max_steps is not None and run.steps >= t.max_steps)
             or (run.budget is not None and run.budget <= 0))
    Xtr, ytr, Xte, yte = run.data
    if (run.epoch % t.eval_every == 0 or final) and stop_reason != "diverged":
        ev = evaluate(run.model, Xtr, ytr, t.eval_batch_size) + (evaluate(run.model, Xte, yte, t.eval_batch_size)[1],)
    else:
        ev = (math.nan, math.nan, math.nan)
    now = time.time()
    row = metrics_row(c, run, lr, lot_loss, ev, now - t_epoch, run.wall_before + now - run.t_start)
    run.writer.append(row)
    progress_line(row, c)
    if not final:
        write_json(run.run_dir / PRIVACY, run.statement("running", None))
        if t.checkpoint_every and run.epoch % t.checkpoint_every == 0:
            run.checkpoint(False, None)
    return stop_reason


@contextmanager
def _signals_as_interrupts():
    """SIGINT, SIGTERM and SIGHUP raise Interrupted in the main thread (handlers restored after)."""
    import threading
    if threading.current_thread() is not threading.main_thread():
        yield
        return

    def handler(signum, frame):
        raise Interrupted(signum)

    before = {s: signal.signal(s, handler) for s in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)}
    try:
        yield
    finally:
        for s, h in before.items():
            signal.signal(s, h)


if __name__ == "__main__":
    from .launch import main
    main()
