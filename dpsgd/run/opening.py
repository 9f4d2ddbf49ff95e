"""Opening a run: ``setup`` decides which ``Run`` (dpsgd/run/state.py) this process trains, and rank 0
makes its first writes.

Every read and every refusal comes first (``_open``): a fresh run refuses a folder that already holds
one; a resume reads the hash-checked checkpoint, refuses an audit's run, a changed fingerprint
(dpsgd/config/fingerprint.py) or another number of processes, and either restores the run
(``Run.from_checkpoint``) or returns the statement of one that has finished. Under torchrun the ranks
then agree (on refusals too) and compare what they built. Only then does rank 0 write
(``_open_run_dir``): metrics.csv, the charge for lost lots made durable, config.resolved.yaml,
privacy.json and the opening console line.
"""
from __future__ import annotations

import secrets
from pathlib import Path

from dpsgd.config.fingerprint import config_fingerprint
from dpsgd.config.schema import Config, ConfigError
from dpsgd.core.fileio import atomic_write_text, write_json
from dpsgd.run import distributed
from dpsgd.run import parts
from dpsgd.run.checkpoint import (CHECKPOINT, METRICS, PRIVACY, MetricsWriter, check_resumable, refuse_audit_resume,
                                  resume_checkpoint)
from dpsgd.run.report import COLUMNS
from dpsgd.run.rundir import RESERVATIONS
from dpsgd.run.state import Run, derive_seed

def setup(c: Config, run_dir: Path, overrides: list[str], instrument: parts.Instrument | None = None) -> Run:
    """Build a fresh run, or restore one from its checkpoint (or the statement of one that finished).

    Under torchrun every rank first compares its whole configuration with every other's, reads and
    builds (the same run), then all agree (a barrier that also agrees on refusals) and compare what
    they built, then rank 0 alone writes: nothing is written before every rank has read."""
    d = distributed.current()
    distributed.agree_on(distributed.config_items(c))   # torchrun: every rank, the same run
    p = c.privacy
    seeds = distributed.broadcast_object(   # rank 0's (with secure_rng: OS-entropy) seeds on every rank
        {s: derive_seed(c.seed, s, p.secure_rng) for s in ("pca", "sampler")})
    seeds["model"] = derive_seed(c.seed, "model")
    seeds["noise"] = None if p.secure_rng else (p.noise_seed if p.noise_seed is not None
                                                else derive_seed(c.seed, "noise"))
    try:
        run, err = _open(c, run_dir, overrides, d, seeds, instrument), None
    except Exception as e:  # noqa: BLE001 (re-raised by agree, on this rank; the others stop quietly)
        run, err = None, e
    distributed.agree(err)
    if run.finished is not None:
        return run
    if d.active:   # and every rank read and built the same: data, weights, generators, projection, ledger
        at = run.progress
        distributed.agree_on(distributed.state_items(
            run.parts.data._asdict(), run.parts.state_dict(),
            {"epoch": at.epoch, "steps": at.steps, "lost": at.lost, "ledger": at.ledger.to_dict(),
             "debts": [d.to_dict() for d in at.debts]}),
            distributed.SAME_BUILD)
    if run.writes:
        _open_run_dir(run)
    return run


def _open(c: Config, run_dir: Path, overrides: list[str], d: distributed.Dist, seeds: dict,
          instrument: parts.Instrument | None = None) -> Run:
    """Every read and every refusal of ``setup``; writes nothing."""
    if not c.resume:
        if d.writes and any((run_dir / f).exists() for f in (CHECKPOINT, PRIVACY, METRICS, RESERVATIONS)):
            raise ConfigError(f"hydra.run.dir={run_dir}: already holds a run; never overwritten (use resume={run_dir})")
        return Run.fresh(c, run_dir, overrides, d, seeds, instrument)
    if instrument is not None:
        raise ConfigError(f"resume={run_dir}: an audit is one uninterrupted run; audit a fresh run instead")
    ckpt = resume_checkpoint(run_dir)
    refuse_audit_resume(run_dir, ckpt)
    check_resumable(ckpt["fingerprint"], config_fingerprint(c))
    saved = int((ckpt.get("distributed") or {}).get("world_size", 1))
    if saved != d.world_size:
        raise ConfigError(f"resume: world_size={d.world_size} differs from the run's world_size={saved} "
                          f"(processes: torchrun --nnodes × --nproc_per_node); resume with {saved}")
    if ckpt["complete"] and (ckpt["stop_reason"] != "epochs_completed" or c.training.epochs <= ckpt["epoch"]):
        if d.writes:
            print(f"{run_dir}: run already finished ({ckpt['stop_reason']}); nothing to do")
        return Run.already_finished(c, run_dir, overrides, d, ckpt)
    return Run.from_checkpoint(c, run_dir, overrides, d, seeds, ckpt)


def _open_run_dir(run: Run) -> None:
    """Rank 0's first writes: metrics.csv (the checkpoint's rows), the charge for lost lots or the debts
    of earlier attempts made durable (a new checkpoint: lots.reserved then holds this attempt's lines
    only), config.resolved.yaml, privacy.json, and the opening console line."""
    c, p, run_dir, lost = run.c, run.c.privacy, run.run_dir, run.progress.lost
    run.writer = MetricsWriter(run_dir, COLUMNS + (["audit"] if run.instrument is not None else []), run.writer.rows)
    res = run.reservations
    if lost or run.progress.debts:   # make the charge or the debts durable before anything else runs
        run.checkpoint(False, None)
    elif not c.resume:
        res.bind(secrets.token_hex(8), 0)
    elif res.token != res.expected:     # still bound to the previous checkpoint: bind it to this one
        res.bind(res.expected, run.progress.steps)
    if not (run_dir / "config.resolved.yaml").exists():   # the validated, fully resolved config
        import yaml
        label = (f"# AUDIT RUN ({run.instrument.label.get('summary', 'audit')}): the training data held the audit's "
                 "canaries\n" if run.instrument is not None else "")
        atomic_write_text(run_dir / "config.resolved.yaml", label + yaml.safe_dump(c.to_dict(), sort_keys=False))
    write_json(run_dir / PRIVACY, run.statement("running", None))
    built, d = run.parts, run.dist
    ws = f", {d.world_size} processes ({d.describe(built.device)['backend']})" if d.active else ""
    if p.private:
        tag = "dpsgd AUDIT RUN" if run.instrument is not None else "dpsgd"
        print(f"{tag}: {c.dataset.name} N={len(built.data.X_train)} → {run_dir}  (device {built.device}{ws}, engine "
              f"{built.clipper.mode}, k={built.k}, {built.sampler.name} q={built.sampler.q:.4g}, σ={p.sigma}, "
              f"C={p.clip_norm}, L={p.lot_size})", flush=True)
    else:
        print(f"dpsgd: NOT PRIVATE run on {c.dataset.name} → {run_dir}", flush=True)
    owed = sum(d.lots for d in run.progress.debts)
    if owed:
        print(f"resume: {owed} lot(s) that ran after the last checkpoint are replayed and proved lot by lot "
              "(parameter digests); each that differs is charged as lost", flush=True)
    if lost:
        print(f"resume: charged {lost} lot(s) that ran after the last checkpoint and cannot be replayed "
              f"as the same releases ({run.progress.lost_why})", flush=True)
