"""Opening a run: ``setup`` decides which ``Run`` (dpsgd/run/state.py) this process trains, and
rank 0 makes its first writes.

Every read and every refusal comes first (``_open``): a fresh run refuses a folder that already
holds one; a resume reads the hash-checked checkpoint, refuses an audit's run, a changed fingerprint
(dpsgd/config/fingerprint.py) or another number of processes, and either restores the run
(``Run.from_checkpoint``) or returns the statement of one that has finished. Under torchrun the
ranks then agree (on refusals too) and compare what they built. Only then does rank 0 write
(``_open_run_dir``): metrics.csv, the charge for lost lots made durable, config.resolved.yaml,
privacy.json and the opening console line.
"""

from __future__ import annotations

import json
import secrets
import sys
from pathlib import Path

from dpsgd.config.fingerprint import config_fingerprint
from dpsgd.config.schema import Config, ConfigError
from dpsgd.core.fileio import atomic_write_text, write_json
from dpsgd.core.signals import held_signals
from dpsgd.run import distributed
from dpsgd.run import parts
from dpsgd.run.checkpoint import (
    CHECKPOINT,
    METRICS,
    PRIVACY,
    MetricsWriter,
    check_resumable,
    escaped_steps,
    refuse_audit_resume,
    resume_checkpoint,
)
from dpsgd.run.guard import RESERVATIONS, LotGuard
from dpsgd.run.report import COLUMNS, correlated_line
from dpsgd.run.state import Run, derive_seed


def setup(
    c: Config, run_dir: Path, overrides: list[str], instrument: parts.Instrument | None = None
) -> Run:
    """Build a fresh run or restore one from its checkpoint (or the statement of one that finished).

    Under torchrun every rank first compares its whole configuration with every other's, reads and
    builds (the same run), then all agree (a barrier that also agrees on refusals) and compare what
    they built, then rank 0 alone writes: nothing is written before every rank has read."""
    d = distributed.current()
    distributed.agree_on(distributed.config_items(c))  # torchrun: every rank, the same run
    p = c.privacy
    seeds = (
        distributed.broadcast_object(  # rank 0's (with secure_rng: OS-entropy) seeds on every rank
            {s: derive_seed(c.seed, s, p.secure_rng) for s in ("pca", "sampler")}
        )
    )
    seeds["model"] = derive_seed(c.seed, "model")
    seeds["noise"] = (
        None
        if p.secure_rng
        else (p.noise_seed if p.noise_seed is not None else derive_seed(c.seed, "noise"))
    )
    try:
        run, err = _open(c, run_dir, overrides, d, seeds, instrument), None
    except Exception as e:  # noqa: BLE001 (re-raised by agree, on this rank; the others stop quietly)
        run, err = None, e
    distributed.agree(err)
    if run.finished is not None:
        if run.writes:
            _restate(run)
        return run
    if (
        d.active
    ):  # and every rank read and built the same: data, weights, generators, projection, ledger
        at = run.progress
        distributed.agree_on(
            distributed.state_items(
                run.parts.data._asdict(),
                run.parts.state_dict(),
                {
                    "epoch": at.epoch,
                    "steps": at.steps,
                    "lost": at.lost,
                    "ledger": at.ledger.to_dict(),
                },
            ),
            distributed.SAME_BUILD,
        )
    if run.writes:
        _open_run_dir(run)
    return run


def _restate(run: Run) -> None:
    """A finished run: "nothing to do", and privacy.json is its final statement again (an extension
    that died before its first lot left ``running`` there)."""
    path = run.run_dir / PRIVACY
    try:
        same = json.loads(path.read_text()) == run.finished
    except (OSError, ValueError):
        same = False
    if not same:
        write_json(path, run.finished)
    print(
        f"{run.run_dir}: run already finished ({run.finished.get('stop_reason')}); nothing to do"
        + ("" if same else f" ({PRIVACY} restored to its final statement)"),
        flush=True,
    )


def _open(
    c: Config,
    run_dir: Path,
    overrides: list[str],
    d: distributed.Dist,
    seeds: dict,
    instrument: parts.Instrument | None = None,
) -> Run:
    """Every read and every refusal of ``setup``; writes nothing."""
    if not c.resume:
        if d.writes and any(
            (run_dir / f).exists() for f in (CHECKPOINT, PRIVACY, METRICS, RESERVATIONS)
        ):
            raise ConfigError(
                f"hydra.run.dir={run_dir}: already holds a run; never overwritten (use "
                f"resume={run_dir})"
            )
        return Run.fresh(c, run_dir, overrides, d, seeds, instrument)
    if instrument is not None:
        raise ConfigError(
            f"resume={run_dir}: an audit is one uninterrupted run; audit a fresh run instead"
        )
    ckpt = resume_checkpoint(run_dir)
    refuse_audit_resume(run_dir, ckpt)
    check_resumable(ckpt["fingerprint"], config_fingerprint(c))
    saved = int((ckpt.get("distributed") or {}).get("world_size", 1))
    if saved != d.world_size:
        raise ConfigError(
            f"resume: world_size={d.world_size} differs from the run's world_size={saved} "
            f"(processes: torchrun --nnodes × --nproc_per_node); resume with {saved}"
        )
    finished = ckpt["complete"] and (
        ckpt["stop_reason"] != "epochs_completed" or c.training.epochs <= ckpt["epoch"]
    )
    binding = ckpt["reservations"]
    per_epoch = binding.get("lots_per_epoch") or max(
        1, -(-int(ckpt["steps"]) // max(1, int(ckpt["epoch"])))
    )
    if (
        finished
    ):  # the binding is checked (a foreign checkpoint is refused), the lots past it charged
        owed = _owed(run_dir, ckpt, per_epoch)
        if not (owed.lots and c.privacy.private):
            return Run.already_finished(c, run_dir, overrides, d, ckpt)
        return Run.from_checkpoint(
            c, run_dir, overrides, d, seeds, ckpt, lambda _: owed, finish_as=ckpt["stop_reason"]
        )
    # read once the sampler is built (a checkpoint of format 4-5 records no lots_per_epoch)
    return Run.from_checkpoint(
        c, run_dir, overrides, d, seeds, ckpt, lambda per: _owed(run_dir, ckpt, per)
    )


def _owed(run_dir: Path, ckpt: dict, lots_per_epoch: int):
    """The guard's rule (guard.py) on this folder: what the resume of ``ckpt`` owes."""
    try:
        ended = json.loads((run_dir / PRIVACY).read_text()).get("status") != "running"
    except (OSError, ValueError, AttributeError):
        ended = False
    return LotGuard(run_dir).owed(ckpt, escaped_steps(run_dir, ckpt), lots_per_epoch, ended)


def _open_run_dir(run: Run) -> None:
    """Rank 0's first writes: metrics.csv (the checkpoint's rows), the charge for lost lots made
    durable (a new checkpoint: lots.reserved then holds this attempt's lines only),
    config.resolved.yaml, privacy.json, and the opening console line. A signal that arrives
    meanwhile is raised once they are all written (``held_signals``), so a stop leaves them
    whole."""
    with held_signals():
        _first_writes(run)


def _first_writes(run: Run) -> None:
    c, p, run_dir, lost = run.c, run.c.privacy, run.run_dir, run.progress.lost
    run.writer = MetricsWriter(
        run_dir, COLUMNS + (["audit"] if run.instrument is not None else []), run.writer.rows
    )
    guard = run.guard
    if lost:  # make the charge durable before anything else runs
        run.checkpoint(False, None)
    elif not c.resume:
        guard.bind(secrets.token_hex(8), 0)
    else:  # nothing owed: every line is covered; a fresh file, never appended to after a torn tail
        guard.bind(guard.expected, run.progress.steps)
    if not (run_dir / "config.resolved.yaml").exists():  # the validated, fully resolved config
        import yaml

        label = (
            f"# AUDIT RUN ({run.instrument.label.get('summary', 'audit')}): the training data held "
            "the audit's canaries\n"
            if run.instrument is not None
            else ""
        )
        atomic_write_text(
            run_dir / "config.resolved.yaml", label + yaml.safe_dump(c.to_dict(), sort_keys=False)
        )
    write_json(run_dir / PRIVACY, run.statement("running", None))
    built, d = run.parts, run.dist
    ws = f", {d.world_size} processes ({d.describe(built.device)['backend']})" if d.active else ""
    if p.private:
        tag = "dpsgd AUDIT RUN" if run.instrument is not None else "dpsgd"
        print(
            f"{tag}: {c.dataset.name} N={len(built.data.X_train)} → {run_dir}  (device "
            f"{built.device}{ws}, engine {built.clipper.mode}, k={built.k}, {built.sampler.name} "
            f"q={built.sampler.q:.4g}, σ={built.plan.sigma}, C={built.plan.clip_norm}, "
            f"L={built.plan.lot_size})",
            flush=True,
        )
    else:
        print(f"dpsgd: NOT PRIVATE run on {c.dataset.name} → {run_dir}", flush=True)
    if built.plan.strategy is not None:  # privacy.noise=bandmf|blt: the noise and its schema
        print(correlated_line(built.plan), flush=True)
    run.first_epoch = run.progress.epoch  # the console's ETA counts from here
    print(forecast_line(run), flush=True)
    if run.warning:
        print(f"warning: resume: {run.warning}", file=sys.stderr, flush=True)
    if lost:
        print(f"resume: charged {lost} lot(s) as lost: they {run.progress.lost_why}", flush=True)
    if run.finish_as is not None:
        print(
            f"resume: the run had finished ({run.finish_as}); lots ran past its final checkpoint "
            "(an extension that did not finish): charged, and the run finished again",
            flush=True,
        )


def forecast_line(run) -> str:
    """What the run will do: the epochs and lots planned, and what limits them."""
    c, t, at = run.c, run.c.training, run.progress
    K, lpe = run.planned_epochs(), run.parts.sampler.lots_per_epoch()
    left, p = run.lots.left(0), c.privacy
    lots = max(0, (K - at.epoch) * lpe)
    caps = [n for n in (left, t.max_steps and t.max_steps - at.steps) if n is not None]
    lots = min([lots, *caps])
    if left is not None and at.epoch + -(-left // lpe) <= K:
        why = (
            f"the target ε = {p.target_epsilon:g} ({c.accountant.name}, {p.convention}) allows "
            f"{left} more lot(s)"
        )
    elif t.max_steps is not None and K < t.epochs:
        why = f"training.max_steps = {t.max_steps}"
    else:
        why = f"training.epochs = {t.epochs}"
    start = f"from epoch {at.epoch} " if at.epoch else ""
    return f"plan: {start}≈ {K - at.epoch} epoch(s) of {lpe} lots (≈ {lots} lots): {why}"
