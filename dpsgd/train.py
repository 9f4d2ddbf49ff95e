"""Train with DP-SGD — Algorithm 1 of Abadi et al. 2016 ("Deep Learning with Differential Privacy").

    python -m dpsgd.train experiment=mnist_medium [key=value ...]
    python -m dpsgd.train resume=<run dir>

    load data → (DP-)PCA (charged to the ledger) → model → PerExampleClipper → DPSGD
    for each epoch, for each lot from the sampler (q = L/N):
        budget check (stop BEFORE a lot that would exceed the target ε) → dp.step → ledger.record
    end of epoch: evaluate, ε under moments / RDP / PLD (configured convention and joint),
                  one metrics.csv row, privacy.json, checkpoint

Everything is written into Hydra's run directory, atomically (see checkpoint.py). The config is
validated before Hydra creates that directory (``main``), so a refused run leaves no files behind.
"""
from __future__ import annotations

import math
import os
import secrets
import shutil
import signal
import sys
import time
from contextlib import contextmanager
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F

from .checkpoint import (CHECKPOINT, METRICS, PRIVACY, MetricsWriter, atomic_write_text, check_resumable,
                         load_checkpoint, save_checkpoint, write_json)
from .config import Config, ConfigError, build_model, check_run_dir, privacy_fingerprint, validate
from .data import DATASETS, DataUnavailable, ensure_dataset, load_dataset
from .report import COLUMNS, epsilons, final_line, metrics_row, privacy_statement, progress_line  # noqa: F401 (COLUMNS re-exported)
from .rundir import RESERVATIONS, LotReservations, RunLock
from .runtime import configure_threads, describe_runtime, set_tf32, tune_allocator

CONF_DIR = str(Path(__file__).resolve().parent.parent / "conf")
_T0 = time.time()


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


def train(c: Config, run_dir: str | Path, overrides: list[str] | None = None) -> dict:
    """Run (or resume) Algorithm 1 in ``run_dir``; returns the final privacy statement.

    The run directory is locked for the whole call (one writer); every refusal happens before the
    first write into it."""
    run_dir = Path(run_dir)
    run_dir.mkdir(parents=True, exist_ok=True)
    with RunLock(run_dir, "resume" if c.resume else "hydra.run.dir"):
        return _train(c, run_dir, overrides)


def replay_key(c: Config, device: torch.device) -> dict:
    """What a seeded resume must share with the original run for its recomputed lots to be the very
    same releases (bit-identical sums); see rundir.LotReservations."""
    return {"device": device.type, "grad_sample_mode": c.privacy.grad_sample_mode,
            "physical_batch_size": c.privacy.physical_batch_size, "tf32": bool(c.tf32),
            "torch": str(torch.__version__), "threads": torch.get_num_threads()}


def _train(c: Config, run_dir: Path, overrides: list[str] | None) -> dict:
    from .accountant import Ledger
    from .clipping import PerExampleClipper
    from .noise import GaussianNoise
    from .optim import DPSGD
    from .pca import fit_projection, project
    from .sampling import make_sampler

    p, t = c.privacy, c.training
    fp = privacy_fingerprint(c)
    ckpt = None
    if c.resume:
        ckpt = load_checkpoint(run_dir)
        if ckpt is None:
            raise ConfigError(f"resume={run_dir}: no checkpoint.pt (the run stopped before its first "
                              "checkpoint); start a new run")
        check_resumable(ckpt["fingerprint"], fp)
        if ckpt["complete"] and (ckpt["stop_reason"] != "epochs_completed" or t.epochs <= ckpt["epoch"]):
            print(f"{run_dir}: run already finished ({ckpt['stop_reason']}); nothing to do")
            return ckpt["statement"]
    elif any((run_dir / f).exists() for f in (CHECKPOINT, PRIVACY, METRICS, RESERVATIONS)):
        raise ConfigError(f"hydra.run.dir={run_dir}: already holds a run; never overwritten (use resume={run_dir})")

    device = resolve_device(c.device)
    set_tf32(c.tf32)
    runtime_info = describe_runtime(device, c.tf32, configure_threads())
    replay = replay_key(c, device)
    # 1. data (in-memory tensors)
    Xtr, ytr, Xte, yte = load_dataset(c.dataset.name, c.dataset.root, c.dataset.subset, c.dataset.crop,
                                      download=c.dataset.download)
    classes = DATASETS[c.dataset.name][3]
    # 2. input projection: DP-PCA is the first release charged to the ledger
    ledger = Ledger() if ckpt is None else Ledger.from_dict(ckpt["ledger"])
    if ckpt is None:
        gen = torch.Generator().manual_seed(derive_seed(c.seed, "pca", p.secure_rng))
        V = fit_projection(c.model.projection, Xtr, c.model.pca_dims, p.sigma_p if p.private else 0.0,
                           gen, ledger if p.private else None, p.pca_fraction)
    else:
        V = ckpt["projection"]
    if V is not None:
        Xtr, Xte = project(Xtr, V), project(Xte, V)
    # 3. model (initialised from its own seed, global RNG state untouched)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(derive_seed(c.seed, "model"))
        model = build_model(c.model, tuple(Xtr.shape[1:]), classes)
    if ckpt is not None:
        model.load_state_dict(ckpt["model"])
    model.to(device)
    Xtr, ytr, Xte, yte = (a.to(device) for a in (Xtr, ytr, Xte, yte))
    # 4. clipping engine, noise, DP-SGD step
    clipper = PerExampleClipper(model, p.clip_norm if p.private else None, clipping=p.clipping,
                                mode=p.grad_sample_mode)
    k = len(clipper.groups)
    noise_seed = None if p.secure_rng else (p.noise_seed if p.noise_seed is not None
                                            else derive_seed(c.seed, "noise"))
    noise = GaussianNoise(seed=noise_seed, secure=p.secure_rng, device=device)
    dp = DPSGD(model, clipper, noise, sigma=p.sigma if p.private else 0.0, max_grad_norm=p.clip_norm,
               expected_lot_size=p.lot_size, lr=t.lr)
    # 5. sampler: the single source of q for the ledger
    sampler = make_sampler(p.sampling, len(Xtr), p.lot_size,
                           torch.Generator().manual_seed(derive_seed(c.seed, "sampler", p.secure_rng)))
    lots_per_epoch = sampler.lots_per_epoch()
    reservations = LotReservations(run_dir)
    epoch, steps, wall_before, resumes, lost = 0, 0, 0.0, [], 0
    if ckpt is not None:
        sampler.load_state_dict(ckpt["sampler"])
        noise.load_state_dict(ckpt["noise"])
        epoch, steps, wall_before = ckpt["epoch"], ckpt["steps"], ckpt["wall_time_s"]
        overrides = list(ckpt["overrides"]) + [o for o in overrides or [] if o not in ckpt["overrides"]]
        # lots that ran after the checkpoint and cannot be replayed as the same releases: charged
        lost = max(0, (reservations.reserved() or 0) - steps)
        if lost and p.private and (p.secure_rng or ckpt["replay"] != replay):
            _charge_lost(ledger, sampler, p.sigma, k, lost)
        else:
            lost = 0
        resumes = list(ckpt["resumes"]) + [{"at_epoch": epoch, "at_steps": steps, "lost_lots_charged": lost,
                                            "time": time.strftime("%Y-%m-%dT%H:%M:%S"),
                                            "overrides": overrides}]
    budget = None  # charges (lots; for shuffle, epochs) that still fit within the target ε
    if p.private and p.target_epsilon is not None:   # recomputed from the ledger, never trusted from a file
        q0, s0 = sampler.release(p.sigma, 0)
        budget = int(ledger.steps_within(p.target_epsilon, p.delta, q0, s0, k, c.accountant.name, p.convention))
        spent = epsilons(ledger, c)["epsilon"]
        if ckpt is not None and budget == 0 and spent is not None and spent >= p.target_epsilon:
            raise ConfigError(f"privacy.target_epsilon={p.target_epsilon}: at or below the ε={spent:.6g} this run "
                              f"has already spent ({c.accountant.name}, {p.convention}); nothing left to resume")
    writer = MetricsWriter(run_dir, COLUMNS, ckpt["rows"] if ckpt is not None else [])
    eps = epsilons(ledger, c)
    t_start = time.time()

    def statement(status, stop_reason):
        return privacy_statement(c, status, stop_reason, ledger, eps, sampler, k, noise, steps, epoch, fp,
                                 resumes, runtime_info)

    def checkpoint(complete, stop_reason, status=None):
        save_checkpoint(run_dir, {
            "epoch": epoch, "steps": steps, "complete": complete, "stop_reason": stop_reason,
            "model": {n: v.detach().cpu() for n, v in model.state_dict().items()},
            "ledger": _plain(ledger.to_dict()), "sampler": sampler.state_dict(), "noise": noise.state_dict(),
            "projection": None if V is None else V.cpu(), "target_epsilon": p.target_epsilon,
            "rows": _plain(writer.rows), "fingerprint": fp, "overrides": list(overrides or []),
            "replay": replay, "wall_time_s": wall_before + time.time() - t_start, "resumes": _plain(resumes),
            "statement": _plain(statement(status or ("complete" if complete else "running"), stop_reason)),
        })
        reservations.clear()   # the checkpoint's ledger covers every lot reserved so far

    if lost:   # make the charge durable before anything else runs
        checkpoint(False, None)
    if not (run_dir / "config.resolved.yaml").exists():   # the validated, fully resolved config
        import yaml
        atomic_write_text(run_dir / "config.resolved.yaml", yaml.safe_dump(c.to_dict(), sort_keys=False))
    write_json(run_dir / PRIVACY, statement("running", None))
    print(f"dpsgd: {c.dataset.name} N={len(Xtr)} → {run_dir}  (device {device}, engine {clipper.mode}, "
          f"k={k}, {sampler.name} q={sampler.q:.4g}, σ={p.sigma}, C={p.clip_norm}, L={p.lot_size})"
          if p.private else f"dpsgd: NOT PRIVATE run on {c.dataset.name} → {run_dir}", flush=True)
    if lost:
        print(f"resume: charged {lost} lot(s) that ran after the last checkpoint and cannot be replayed "
              "as the same releases", flush=True)
    stop_reason = None
    try:
        with _signals_as_interrupts():
            while stop_reason is None and epoch < t.epochs:
                t_epoch = time.time()
                lr = lr_at(t, epoch)
                dp.set_lr(lr)
                lots, loss_sum, seen = 0, torch.zeros((), device=device), 0
                epoch_end = steps + lots_per_epoch
                for i, idx in enumerate(sampler.epoch()):
                    if t.max_steps is not None and steps >= t.max_steps:
                        stop_reason = "max_steps"
                        break
                    charge = sampler.release(p.sigma, i) if p.private else None
                    if charge is not None and budget is not None and budget <= 0:
                        stop_reason = "target_epsilon_reached"  # the next lot would exceed the target
                        break
                    if p.private:   # write-ahead: never past the epoch, max_steps or the budget
                        limit = min(epoch_end, t.max_steps or epoch_end)
                        if budget is not None and sampler.amplification:
                            limit = min(limit, steps + budget)
                        reservations.ensure(steps, limit)
                    idx = idx.to(device)
                    out = dp.step(Xtr[idx], ytr[idx], physical_batch_size=p.physical_batch_size)
                    if charge is not None:
                        ledger.record(q=charge[0], sigma=charge[1], count=1, groups=k, label="sgd")
                        if budget is not None:
                            budget -= 1
                    steps, lots = steps + 1, lots + 1
                    loss_sum, seen = loss_sum + out["loss_sum"], seen + out["lot_size"]
                if lots == 0:
                    break
                epoch += 1
                eps = epsilons(ledger, c)
                if not (bool(torch.isfinite(loss_sum)) and all(bool(torch.isfinite(w).all())
                                                               for w in model.parameters())):
                    stop_reason = "diverged"
                final = (stop_reason is not None or epoch == t.epochs
                         or (t.max_steps is not None and steps >= t.max_steps)
                         or (budget is not None and budget <= 0))
                if (epoch % t.eval_every == 0 or final) and stop_reason != "diverged":
                    ev = evaluate(model, Xtr, ytr, t.eval_batch_size) + (evaluate(model, Xte, yte, t.eval_batch_size)[1],)
                else:
                    ev = (math.nan, math.nan, math.nan)
                now = time.time()
                row = metrics_row(epoch, steps, lr, float(loss_sum) / max(1, seen), ev, eps, c, sampler, clipper,
                                  k, now - t_epoch, wall_before + now - t_start)
                writer.append(row)
                progress_line(row, c)
                if not final:
                    write_json(run_dir / PRIVACY, statement("running", None))
                    if t.checkpoint_every and epoch % t.checkpoint_every == 0:
                        checkpoint(False, None)
        if stop_reason is None:
            stop_reason = "epochs_completed"
    except Interrupted as e:
        eps = epsilons(ledger, c)   # every lot that ran is in the ledger
        write_json(run_dir / PRIVACY, statement("interrupted", "interrupted"))
        e.run_dir = run_dir
        raise
    status = "diverged" if stop_reason == "diverged" else "complete"
    checkpoint(True, stop_reason, status)
    final_statement = statement(status, stop_reason)
    write_json(run_dir / PRIVACY, final_statement)
    if status == "diverged":
        raise Diverged(f"training diverged at epoch {epoch} (non-finite loss or parameters; training.lr={t.lr:g} "
                       f"may be too large): {final_statement['statement']}; {run_dir / PRIVACY}")
    last = writer.rows[-1] if writer.rows else {}
    print(final_line(final_statement, last.get("test_accuracy", math.nan), run_dir), flush=True)
    return final_statement


def _charge_lost(ledger, sampler, sigma: float, k: int, lost: int) -> None:
    """Charge ``lost`` lots that ran from an epoch boundary on: each lot's release, as the loop would."""
    per_epoch = sampler.lots_per_epoch()
    counts: dict = {}
    for j in range(lost):
        charge = sampler.release(sigma, j % per_epoch)
        if charge is not None:
            counts[charge] = counts.get(charge, 0) + 1
    for (q, s), n in counts.items():
        ledger.record(q=q, sigma=s, count=n, groups=k, label="lost")


class Interrupted(Exception):
    """Ctrl-C, SIGTERM or SIGHUP during training (the run's privacy.json says 'interrupted')."""

    def __init__(self, signum: int):
        super().__init__(signal.Signals(signum).name)
        self.signum = signum
        self.run_dir = None


class Diverged(RuntimeError):
    """A non-finite loss or parameter stopped the run (status 'diverged', no model released)."""


@contextmanager
def _signals_as_interrupts():
    """SIGINT, SIGTERM and SIGHUP raise Interrupted in the main thread (handlers restored after)."""
    import threading
    if threading.current_thread() is not threading.main_thread():
        yield
        return

    def handler(signum, frame):
        raise Interrupted(signum)

    sigs = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)
    before = {s: signal.signal(s, handler) for s in sigs}
    try:
        yield
    finally:
        for s, h in before.items():
            signal.signal(s, h)


def _plain(obj):
    """JSON-like structure of plain python values (safe for torch.load(weights_only=True))."""
    import json
    from .checkpoint import _json_default
    return json.loads(json.dumps(obj, default=_json_default))


# --------------------------------------------------------------------------- Hydra entry point
def _one_line(e: BaseException) -> str:
    msg = " ".join(s.strip() for s in str(e).splitlines() if s.strip()) or type(e).__name__
    return msg.split(" Config search path:")[0]


def _compose(args: list[str]):
    from hydra import compose, initialize_config_dir
    from hydra.core.global_hydra import GlobalHydra
    GlobalHydra.instance().clear()
    try:
        with initialize_config_dir(config_dir=CONF_DIR, version_base="1.3", job_name="train"):
            return compose("config", overrides=args)
    except Exception as e:
        raise ConfigError(_one_line(e)) from None
    finally:
        GlobalHydra.instance().clear()


_INFO_FLAGS = ("--help", "-h", "--hydra-help", "--version", "--cfg", "-c", "--info", "-i", "--resolve",
               "--package", "-p", "--shell-completion", "-sc")
_MULTIRUN_FLAGS = ("--multirun", "-m")
_CONFIG_DIR_FLAGS = ("--config-dir", "-cd")     # an extra config folder (searched after conf/)
_HYDRA_KEYS = ("hydra.run.dir", "hydra.sweep.dir", "hydra.sweep.subdir", "hydra.verbose", "hydra.job.name")
_HYDRA_PREFIXES = ("hydra.launcher.", "hydra.sweeper.", "hydra/launcher", "hydra/sweeper")


def _key(a: str) -> str:
    """The config key of an override, whatever its spelling (+key, ++key, ~key)."""
    return a.split("=", 1)[0].lstrip("+~").strip()


def _check_overrides(overrides: list[str], resume: bool) -> None:
    """Refuse Hydra overrides that could write outside a fresh run directory (or anything of Hydra's
    on resume, which runs without Hydra)."""
    for a in overrides:
        k = _key(a)
        if not (k.startswith("hydra.") or k.startswith("hydra/")):
            continue
        if resume:
            raise ConfigError(f"{k}: Hydra settings cannot be given with resume= (a resume writes only into "
                              "its own run directory)")
        if k not in _HYDRA_KEYS and not k.startswith(_HYDRA_PREFIXES):
            raise ConfigError(f"{k}: not supported (dpsgd accepts hydra.run.dir, hydra.sweep.dir, "
                              "hydra.sweep.subdir, hydra/launcher and hydra/sweeper settings)")


def _fresh_dir(key: str, d: Path) -> None:
    """``d`` is a folder that holds nothing yet and can be created; else ConfigError naming ``key``."""
    if d.exists() and (not d.is_dir() or any(d.iterdir())):
        raise ConfigError(f"{key}={d}: already exists and is not empty; never overwritten "
                          f"(pick a new dir, or resume=<run dir>)")
    parent = d
    while not parent.exists():
        parent = parent.parent
    if not parent.is_dir() or not os.access(parent, os.W_OK | os.X_OK):
        raise ConfigError(f"{key}={d}: cannot be created ({parent} is not a writable folder)")


def _compose_with_hydra(args: list[str]):
    from hydra import compose, initialize_config_dir
    from hydra.core.global_hydra import GlobalHydra
    GlobalHydra.instance().clear()
    try:
        with initialize_config_dir(config_dir=CONF_DIR, version_base="1.3", job_name="train"):
            return compose("config", overrides=args, return_hydra_config=True)
    except Exception as e:
        raise ConfigError(_one_line(e)) from None
    finally:
        GlobalHydra.instance().clear()


def prepare(args: list[str], multirun: bool = False, search: list[str] = ()) -> list[str]:
    """Validate a run's overrides before Hydra creates anything; returns the overrides to run.

    The output folder is resolved the way Hydra will resolve it (any spelling of the key), and must be
    new or empty: a refused command never writes into an existing run. For a sweep, the sweep folder
    must be new or empty and the job sub-folder must contain ``${hydra.job.num}`` (one folder per
    job); each job's config is validated when it starts, before it writes anything but Hydra's
    ``.hydra`` files into its own new folder.
    """
    from omegaconf import OmegaConf, open_dict
    if any(_key(a) == "resume" for a in args):
        raise ConfigError("resume: resume a single run on its own: python -m dpsgd.train resume=<run dir> "
                          "[key=value ...]")
    _check_overrides(args, resume=False)
    if multirun:
        hc = _compose_with_hydra([a for a in args if "," not in a.split("=", 1)[-1]] + list(search)).hydra
        subdir = str(OmegaConf.to_container(hc.sweep, resolve=False)["subdir"])
        if "hydra.job.num" not in subdir or ".." in Path(subdir).parts or Path(subdir).is_absolute():
            raise ConfigError(f"hydra.sweep.subdir={subdir}: must contain ${{hydra.job.num}} and stay inside the "
                              "sweep folder (one new folder per job)")
        _fresh_dir("hydra.sweep.dir", Path(hc.sweep.dir))
        return args
    cfg = _compose_with_hydra(args + list(search))
    _fresh_dir("hydra.run.dir", Path(cfg.hydra.run.dir))
    with open_dict(cfg):
        del cfg["hydra"]          # resolved by Hydra itself at run time (hydra.job.num, ...)
    c = validate(cfg)
    try:
        ensure_dataset(c.dataset.name, c.dataset.root, download=c.dataset.download)
    except DataUnavailable as e:
        raise ConfigError(str(e)) from None
    return args


def prepare_resume(args: list[str]) -> tuple[Config, Path, list[str]]:
    """(config, run dir, overrides) of ``resume=<dir> [key=value ...]``, validated; nothing is written.

    The run's own overrides come from its checkpoint (verified by its content hash), never from
    ``.hydra/overrides.yaml``, which any later command could have rewritten; the new overrides are
    applied after them. Privacy-relevant values (the fingerprint: σ, C, L, δ, the target ε, the
    accountant, the convention, ...) cannot change.
    """
    resume = [a for a in args if _key(a) == "resume"]
    rest = [a for a in args if _key(a) != "resume"]
    _check_overrides(rest, resume=True)
    rd = check_run_dir(resume[-1].split("=", 1)[1].strip().strip("'\"")).resolve()
    ckpt = load_checkpoint(rd)
    if ckpt is None:
        raise ConfigError(f"resume={rd}: no checkpoint.pt (the run stopped before its first checkpoint); "
                          "start a new run")
    saved = [o for o in ckpt["overrides"] if _key(o) != "resume"]
    c = validate(_compose(saved + rest), check_resume_dir=False)
    c.resume = str(rd)
    check_resumable(ckpt["fingerprint"], privacy_fingerprint(c))
    try:
        ensure_dataset(c.dataset.name, c.dataset.root, download=c.dataset.download)
    except DataUnavailable as e:
        raise ConfigError(str(e)) from None
    return c, rd, rest


def _discard_fresh_run_dir(run_dir: Path) -> None:
    """Remove a run dir that Hydra created for this refused job and that holds only Hydra's files."""
    hydra_files = {".hydra", ".hydra/config.yaml", ".hydra/hydra.yaml", ".hydra/overrides.yaml"}
    try:
        entries = {str(f.relative_to(run_dir)) for f in run_dir.rglob("*")}
        if not entries <= hydra_files or any((run_dir / f).stat().st_mtime < _T0 - 1 for f in entries):
            return
        shutil.rmtree(run_dir)
        for parent in run_dir.parents:
            if parent == Path.cwd() or parent.stat().st_ctime < _T0 - 1:
                break
            sweep_file = parent / "multirun.yaml"   # written by Hydra into a fresh sweep dir
            if [f.name for f in parent.iterdir()] == ["multirun.yaml"] and sweep_file.stat().st_mtime >= _T0 - 1:
                sweep_file.unlink()
            if any(parent.iterdir()):
                break
            parent.rmdir()
    except OSError:
        pass


def _run_or_exit(fn, *a) -> None:
    """Run ``fn``; every expected failure is one line on stderr and an exit code, never a traceback."""
    try:
        fn(*a)
    except (ConfigError, DataUnavailable) as e:
        _fail(_one_line(e), 2)
    except Diverged as e:
        _fail(str(e), 1)
    except (Interrupted, KeyboardInterrupt) as e:
        signum = getattr(e, "signum", signal.SIGINT)
        rd = getattr(e, "run_dir", None)
        hint = f": {rd} (resume with: python -m dpsgd.train resume={rd})" if rd else ""
        _fail(f"interrupted by {signal.Signals(signum).name}{hint}", 128 + signum)
    except OSError as e:
        where = f"{e.filename}: " if e.filename else ""
        _fail(f"{where}{e.strerror or e}", 1)


def _fail(msg: str, code: int) -> None:
    print(f"error: {msg}" if code in (1, 2) else msg, file=sys.stderr, flush=True)
    raise SystemExit(code)


def _task(cfg) -> None:
    from hydra.core.hydra_config import HydraConfig
    hc = HydraConfig.get()
    run_dir = Path(hc.runtime.output_dir)
    overrides = list(hc.overrides.task)

    def run():
        with RunLock(run_dir):        # held before anything is decided about this folder
            try:
                c = validate(cfg)
                if c.resume:
                    raise ConfigError("resume: resume a single run on its own: python -m dpsgd.train resume=<run dir>")
                ensure_dataset(c.dataset.name, c.dataset.root, download=c.dataset.download)
                train(c, run_dir, overrides)
            except (ConfigError, DataUnavailable):
                _discard_fresh_run_dir(run_dir)
                raise

    _run_or_exit(run)


def _split_cli(args: list[str]) -> tuple[bool, list[str], list[str]]:
    """(multirun, extra config dirs, overrides) of a command line; ConfigError for flags dpsgd refuses."""
    multirun, dirs, overrides, i = False, [], [], 0
    while i < len(args):
        a = args[i]
        if a in _MULTIRUN_FLAGS:
            multirun = True
        elif a.split("=", 1)[0] in _CONFIG_DIR_FLAGS:
            if "=" in a:
                dirs.append(a.split("=", 1)[1])
            elif i + 1 < len(args):
                i += 1
                dirs.append(args[i])
            else:
                raise ConfigError(f"{a}: needs a folder")
        elif a.startswith("-"):
            raise ConfigError(f"{a}: not supported (dpsgd takes key=value overrides, -m/--multirun, "
                              "-cd/--config-dir, --cfg, --help)")
        else:
            overrides.append(a)
        i += 1
    return multirun, dirs, overrides


def main(argv: list[str] | None = None) -> None:
    import hydra
    tune_allocator()  # speed only: glibc keeps per-step buffers instead of re-faulting them
    args = list(sys.argv[1:] if argv is None else argv)
    if any(a.split("=", 1)[0] in _INFO_FLAGS for a in args):     # help / print the config: no run
        sys.argv = [sys.argv[0]] + args
        hydra.main(version_base="1.3", config_path=CONF_DIR, config_name="config")(lambda cfg: None)()
        return
    try:
        multirun, dirs, overrides = _split_cli(args)
        search = [f"hydra.searchpath=[{','.join('file://' + str(Path(d).resolve()) for d in dirs)}]"] if dirs else []
        if any(_key(a) == "resume" for a in overrides) and not multirun and not dirs:
            def resume():
                c, rd, rest = prepare_resume(overrides)
                train(c, rd, rest)
            _run_or_exit(resume)
            return
        prepare(overrides, multirun, search)
    except ConfigError as e:
        _fail(_one_line(e), 2)
    sys.argv = [sys.argv[0]] + args
    try:
        hydra.main(version_base="1.3", config_path=CONF_DIR, config_name="config")(_task)()
    except KeyboardInterrupt:
        _fail("interrupted by SIGINT", 128 + signal.SIGINT)


if __name__ == "__main__":
    main()
