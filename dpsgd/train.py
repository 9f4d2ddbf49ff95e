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
import secrets
import shutil
import sys
import time
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F

from .checkpoint import (CHECKPOINT, METRICS, PRIVACY, MetricsWriter, atomic_write_text, check_resumable,
                         load_checkpoint, save_checkpoint, write_json)
from .config import Config, ConfigError, build_model, check_run_dir, privacy_fingerprint, validate
from .data import DATASETS, DataUnavailable, ensure_dataset, load_dataset
from .report import COLUMNS, epsilons, metrics_row, privacy_statement, progress_line  # noqa: F401 (COLUMNS re-exported)
from .runtime import describe_runtime, set_tf32, tune_allocator

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
    """Run (or resume) Algorithm 1 in ``run_dir``; returns the final privacy statement."""
    from .accountant import Ledger
    from .clipping import PerExampleClipper
    from .noise import GaussianNoise
    from .optim import DPSGD
    from .pca import fit_projection, project
    from .sampling import make_sampler

    run_dir = Path(run_dir)
    run_dir.mkdir(parents=True, exist_ok=True)
    p, t = c.privacy, c.training
    fp = privacy_fingerprint(c)
    ckpt = None
    if c.resume:
        ckpt = load_checkpoint(run_dir)
        if ckpt is not None:
            check_resumable(ckpt["fingerprint"], fp)
            if ckpt["complete"] and (ckpt["stop_reason"] != "epochs_completed" or t.epochs <= ckpt["epoch"]):
                print(f"{run_dir}: run already finished ({ckpt['stop_reason']}); nothing to do")
                return ckpt["statement"]
    elif any((run_dir / f).exists() for f in (CHECKPOINT, PRIVACY, METRICS)):
        raise ConfigError(f"hydra.run.dir={run_dir}: already holds a run; never overwritten (use resume={run_dir})")

    device = resolve_device(c.device)
    set_tf32(c.tf32)
    runtime_info = describe_runtime(device, c.tf32)
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
    epoch, steps, wall_before, resumes = 0, 0, 0.0, []
    if ckpt is not None:
        sampler.load_state_dict(ckpt["sampler"])
        noise.load_state_dict(ckpt["noise"])
        epoch, steps, wall_before = ckpt["epoch"], ckpt["steps"], ckpt["wall_time_s"]
        resumes = list(ckpt["resumes"]) + [{"at_epoch": epoch, "at_steps": steps,
                                            "time": time.strftime("%Y-%m-%dT%H:%M:%S"),
                                            "overrides": overrides or []}]
    budget = None  # lots (or, for shuffle, epochs) that still fit within the target ε
    if p.private and p.target_epsilon is not None:
        if ckpt is not None and ckpt["budget"] is not None and ckpt["target_epsilon"] == p.target_epsilon:
            budget = ckpt["budget"]
        else:
            q0, s0 = sampler.release(p.sigma, 0)
            budget = int(ledger.steps_within(p.target_epsilon, p.delta, q0, s0, k,
                                             c.accountant.name, p.convention))
    writer = MetricsWriter(run_dir, COLUMNS, ckpt["rows"] if ckpt is not None else [])
    eps = epsilons(ledger, c)
    t_start = time.time()

    def statement(status, stop_reason):
        return privacy_statement(c, status, stop_reason, ledger, eps, sampler, k, noise, steps, epoch, fp,
                                 resumes, runtime_info)

    def checkpoint(complete, stop_reason):
        save_checkpoint(run_dir, {
            "version": 1, "epoch": epoch, "steps": steps, "complete": complete, "stop_reason": stop_reason,
            "model": {n: v.detach().cpu() for n, v in model.state_dict().items()},
            "ledger": _plain(ledger.to_dict()), "sampler": sampler.state_dict(), "noise": noise.state_dict(),
            "projection": None if V is None else V.cpu(), "budget": budget,
            "target_epsilon": p.target_epsilon, "rows": _plain(writer.rows), "fingerprint": fp,
            "wall_time_s": wall_before + time.time() - t_start, "resumes": _plain(resumes),
            "statement": _plain(statement("complete" if complete else "running", stop_reason)),
        })

    if not (run_dir / "config.resolved.yaml").exists():   # the validated, fully resolved config
        import yaml
        atomic_write_text(run_dir / "config.resolved.yaml", yaml.safe_dump(c.to_dict(), sort_keys=False))
    write_json(run_dir / PRIVACY, statement("running", None))
    print(f"dpsgd: {c.dataset.name} N={len(Xtr)} → {run_dir}  (device {device}, engine {clipper.mode}, "
          f"k={k}, {sampler.name} q={sampler.q:.4g}, σ={p.sigma}, C={p.clip_norm}, L={p.lot_size})"
          if p.private else f"dpsgd: NOT PRIVATE run on {c.dataset.name} → {run_dir}", flush=True)
    stop_reason = None
    try:
        while stop_reason is None and epoch < t.epochs:
            t_epoch = time.time()
            lr = lr_at(t, epoch)
            dp.set_lr(lr)
            lots, loss_sum, seen = 0, torch.zeros((), device=device), 0
            for i, idx in enumerate(sampler.epoch()):
                if t.max_steps is not None and steps >= t.max_steps:
                    stop_reason = "max_steps"
                    break
                charge = sampler.release(p.sigma, i) if p.private else None
                if charge is not None and budget is not None and budget <= 0:
                    stop_reason = "target_epsilon_reached"  # the next lot would exceed the target
                    break
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
            final = (stop_reason is not None or epoch == t.epochs
                     or (t.max_steps is not None and steps >= t.max_steps)
                     or (budget is not None and budget <= 0))
            if epoch % t.eval_every == 0 or final:
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
    except KeyboardInterrupt:
        write_json(run_dir / PRIVACY, statement("interrupted", "interrupted"))
        print(f"\ninterrupted: {run_dir} (resume with: python -m dpsgd.train resume={run_dir})", file=sys.stderr)
        raise
    checkpoint(True, stop_reason)
    final_statement = statement("complete", stop_reason)
    write_json(run_dir / PRIVACY, final_statement)
    last = writer.rows[-1] if writer.rows else {}
    print(f"done ({stop_reason}): {steps} lots, {epoch} epochs, test accuracy "
          f"{last.get('test_accuracy', math.nan):.4f}, ε = {eps['epsilon']:.4g} (δ = {p.delta:g})\n"
          f"results: {run_dir / METRICS}\n         {run_dir / PRIVACY}\n         {run_dir / '.hydra'}",
          flush=True)
    return final_statement


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


def _override_value(a: str) -> str:
    return a.split("=", 1)[1].strip().strip("'\"")


def prepare(args: list[str]) -> list[str]:
    """Validate a single run's overrides before Hydra creates anything; returns the overrides to run.

    ``resume=<dir>``: the run's own overrides (``<dir>/.hydra/overrides.yaml``) come first, the new
    ones after; Hydra then runs inside <dir> and writes nothing of its own there.
    """
    resume = [a for a in args if a.split("=", 1)[0].lstrip("+") == "resume"]
    if resume:
        rd = check_run_dir(_override_value(resume[-1])).resolve()
        saved = []
        ov = rd / ".hydra" / "overrides.yaml"
        if ov.is_file():
            import yaml
            saved = [o for o in (yaml.safe_load(ov.read_text()) or [])
                     if not o.split("=", 1)[0].lstrip("+~").startswith(("resume", "hydra."))]
        rest = [a for a in args if a not in resume]
        args = saved + rest + [f"resume='{rd}'", f"hydra.run.dir='{rd}'", "hydra.output_subdir=null"]
    else:
        for a in args:
            if a.split("=", 1)[0] == "hydra.run.dir":
                d = Path(_override_value(a))
                if d.exists() and (not d.is_dir() or any(d.iterdir())):
                    raise ConfigError(f"hydra.run.dir={d}: already exists and is not empty; never overwritten "
                                      f"(pick a new dir, or resume={d})")
    c = validate(_compose(args))
    if c.resume:
        ckpt = load_checkpoint(c.resume)
        if ckpt is not None:
            check_resumable(ckpt["fingerprint"], privacy_fingerprint(c))
    try:
        ensure_dataset(c.dataset.name, c.dataset.root, download=c.dataset.download)
    except DataUnavailable as e:
        raise ConfigError(str(e)) from None
    return args


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


def _task(cfg) -> None:
    from hydra.core.hydra_config import HydraConfig
    hc = HydraConfig.get()
    run_dir = Path(hc.runtime.output_dir)
    overrides = list(hc.overrides.task)
    try:
        c = validate(cfg)
        if c.resume and Path(c.resume).resolve() != run_dir.resolve():
            raise ConfigError(f"resume={c.resume}: resume a single run: python -m dpsgd.train resume=<run dir>")
        ensure_dataset(c.dataset.name, c.dataset.root, download=c.dataset.download)
        train(c, run_dir, overrides)
    except (ConfigError, DataUnavailable) as e:
        print(f"error: {_one_line(e)}", file=sys.stderr)
        if not cfg.get("resume"):
            _discard_fresh_run_dir(run_dir)
        raise SystemExit(2)


def main(argv: list[str] | None = None) -> None:
    import hydra
    tune_allocator()  # speed only: glibc keeps per-step buffers instead of re-faulting them
    args = list(sys.argv[1:] if argv is None else argv)
    if not any(a.startswith("-") for a in args):  # a single run: validate before Hydra makes a folder
        try:
            args = prepare(args)
        except ConfigError as e:
            print(f"error: {_one_line(e)}", file=sys.stderr)
            raise SystemExit(2)
    sys.argv = [sys.argv[0]] + args
    hydra.main(version_base="1.3", config_path=CONF_DIR, config_name="config")(_task)()


if __name__ == "__main__":
    main()
