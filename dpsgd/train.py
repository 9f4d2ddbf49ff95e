"""Train with DP-SGD — Algorithm 1 of Abadi et al. 2016 ("Deep Learning with Differential Privacy").

    python -m dpsgd.train experiment=mnist_medium [key=value ...]
    python -m dpsgd.train resume=<run dir>                      (command line: dpsgd/launch/main.py)

    setup:  data → (DP-)PCA, charged to the ledger → model → clipping engine → DPSGD
            → sampler (q = L/N)
    for each epoch, for each lot L_t drawn with probability q per example:
        stop before a lot that would pass max_steps or the target ε          (run.stop_reason)
        x_i ← augment(x_i), each example on its own (CIFAR: crop, flip, standardise)  (parts.lot)
        g̃_t ← (Σ_i clip_C(∇ℓ(θ, x_i)) + N(0, σ²C² I)) / L ;  θ ← θ − η_t g̃_t   (run.lots.run:
        record the release (q, σ) in the ledger                                dp.step, charge,
        θ̄ ← β θ̄ + (1 − β) θ   when training.ema_decay = β (post-processing)     ema.update)
    end of epoch: evaluate, ε under every accountant, privacy.json and the checkpoint, then the
    metrics.csv row, the logger's row and the console line (``publish``)

Nothing of an epoch leaves the process (its metrics row, the logger's row, the console line) before
the privacy statement and the checkpoint that cover its lots are on disk: a failure while printing
(a closed pipe, a logger that raises) is a failure after the charge, never before it.
Everything is written into the run directory, atomically, by one process at a time (rundir.RunLock).
Under torchrun (dpsgd/run/distributed.py) the lot is shared among the ranks, the clipped sums are
all-reduced, the noise is added once, and rank 0 alone writes.
"""

from __future__ import annotations

import sys

if __name__ == "__main__":  # `--help`: Hydra's help before torch is imported (dpsgd/launch/info.py)
    from dpsgd.launch.info import help_and_exit

    help_and_exit(sys.argv[1:])

import math
import time
from contextlib import nullcontext
from pathlib import Path

import torch

from dpsgd.config.optimizer import lr_at
from dpsgd.config.schema import Config
from dpsgd.core.console import progress, tee_to
from dpsgd.core.loggers import FOLDERS, make_logger
from dpsgd.core.errors import Diverged, Interrupted
from dpsgd.core.signals import held_signals, signals_as_interrupts
from dpsgd.core.fileio import write_json
from dpsgd.run import distributed
from dpsgd.run.checkpoint import PRIVACY
from dpsgd.run.evaluate import evaluate
from dpsgd.run.opening import setup
from dpsgd.run.report import epsilons, eta, final_line, metrics_row, progress_line
from dpsgd.run.rundir import RunLock
from dpsgd.run.state import Run


def train(
    c: Config, run_dir: str | Path, overrides: list[str] | None = None, instrument=None
) -> dict:
    """Run (or resume) Algorithm 1 in ``run_dir``; returns the final privacy statement.

    The run directory is locked for the whole call (one writer); every refusal happens in ``setup``,
    before the first write into it. ``instrument``: an audit's canaries and observers
    (``dpsgd.run.parts.Instrument``; only ``dpsgd.audit`` passes one)."""
    run_dir = Path(run_dir)
    writer = distributed.current().writes  # under torchrun: rank 0 only
    if writer:
        run_dir.mkdir(parents=True, exist_ok=True)
    lock = RunLock(run_dir, "resume" if c.resume else "hydra.run.dir") if writer else nullcontext()
    # every console line of the run is also kept in its folder (run.log; rank 0 under torchrun)
    with lock, tee_to(run_dir / "run.log") if writer else nullcontext() as log:
        # SIGINT, SIGTERM, SIGHUP: one line, for the whole run (set-up, epochs, the last writes),
        # and the writes that open or finish a run and each lot's charge are held whole
        with signals_as_interrupts():
            run = setup(c, run_dir, list(overrides or []), instrument)
            if log is not None and run.finished is None:  # it runs: its console to run.log
                log.release()  # (held until now: a refused or finished run's folder is untouched)
            if run.finished is not None:
                return run.finished
            if (
                run.finish_as is not None
            ):  # a finished run whose lots past its final checkpoint were charged
                return finish(run, run.finish_as)
            run.logger = opened_logger(run)
            try:
                return algorithm1(run)
            finally:
                if run.logger is not None:
                    run.logger.close()


def opened_logger(run: Run):
    """``logger=csv|tensorboard|wandb``: each epoch's metrics.csv row also sent there (rank 0;
    None for ``none``), its files inside the run folder (dpsgd/core/loggers.py)."""
    lg = run.c.logger
    if not run.writes or lg.name == "none":
        return None
    return make_logger(
        lg.name,
        run.run_dir,
        project=lg.project,
        run_name=run.run_dir.name,
        config=run.c.to_dict(),
    )


def algorithm1(run: Run) -> dict:
    """Epochs of lots until the epochs, max_steps or the target ε are reached, or the run
    diverges."""
    c, t, at = run.c, run.c.training, run.progress
    stop_reason = None
    try:
        while stop_reason is None and at.epoch < t.epochs:
            t_epoch, lr = time.time(), lr_at(t, at.epoch)
            run.parts.dp.set_lr(lr)
            stop_reason, lots, loss_sum, seen = run_epoch(run)
            if lots == 0:
                break
            at.epoch += 1
            at.eps = epsilons(at.ledger, c)
            if not (
                bool(torch.isfinite(loss_sum))
                and all(bool(torch.isfinite(w).all()) for w in run.parts.model.parameters())
            ):
                stop_reason = "diverged"
            end_of_epoch(run, stop_reason, lr, float(loss_sum) / max(1, seen), t_epoch)
        stop_reason = stop_reason or "epochs_completed"
    except Interrupted as e:
        at.eps = epsilons(at.ledger, c)  # every lot that ran is in the ledger
        if run.writes:
            write_json(run.run_dir / PRIVACY, run.statement("interrupted", "interrupted"))
        e.run_dir = run.run_dir
        raise
    return finish(run, stop_reason)


def finish(run: Run, stop_reason: str) -> dict:
    """The last checkpoint and the final statement (``complete``, or ``diverged``: raised)."""
    at, t = run.progress, run.c.training
    status = "diverged" if stop_reason == "diverged" else "complete"
    at.eps = epsilons(at.ledger, run.c)
    with held_signals():  # the final checkpoint and statement are written whole
        run.checkpoint(True, stop_reason, status)
        final = run.statement(status, stop_reason)
        if run.writes:
            write_json(run.run_dir / PRIVACY, final)
    publish(run)  # the last epoch's row, now that the final statement covers it
    if status == "diverged":
        raise Diverged(
            f"training diverged at epoch {at.epoch} (non-finite loss or parameters; training.lr="
            f"{t.lr:g} may be too large): {final['statement']}; {run.run_dir / PRIVACY}"
        )
    if not run.writes:
        return final
    last = run.writer.rows[-1] if run.writer.rows else {}
    text = final_line(final, last.get("test_accuracy", math.nan), run.run_dir)
    if run.logger is not None:  # where logger= sent the rows too
        name = run.c.logger.name
        text += f"\n         {run.run_dir / FOLDERS[name]} (logger={name})"
    print(text, flush=True)
    return final


def run_epoch(run: Run):
    """One epoch of lots (Algorithm 1's inner loop); (stop reason or None, lots, Σ loss, Σ lot
    sizes)."""
    p, parts, at = run.c.privacy, run.parts, run.progress
    lots, loss_sum, seen = 0, torch.zeros((), device=parts.device), 0
    total, desc = parts.sampler.lots_per_epoch(), f"epoch {at.epoch + 1}"
    # a bar over the lots on a terminal (rank 0), never in run.log (core/console.py:progress)
    with progress(
        parts.sampler.epoch(), total=total, desc=desc, unit="lot", show=run.writes
    ) as lot_idx:
        for i, idx in enumerate(lot_idx):
            stop_reason = run.stop_reason(i)
            if stop_reason is not None:
                return stop_reason, lots, loss_sum, seen
            run.reserve(i)  # write-ahead, before the lot runs
            x, y, kw = parts.lot(idx, at.steps, run.dist.share)  # this rank's share, augmented
            # the DP step, then the ledger's charge and the step count, held whole
            # (workbench/lots.py)
            out = run.lots.run(i, x, y, p.physical_batch_size, **kw)
            lots += 1
            loss_sum, seen = loss_sum + out["loss_sum"], seen + out["lot_size"]
    return None, lots, loss_sum, seen


def end_of_epoch(
    run: Run, stop_reason: str | None, lr: float, lot_loss: float, t_epoch: float
) -> None:
    """Evaluate (when due) and make the epoch's metrics.csv row; unless this was the last epoch
    (``finish`` writes its final statement and checkpoint), privacy.json and the checkpoint, then
    the row is published (``publish``). The row is held meanwhile: it is in the checkpoint, and
    nothing of it has left the process."""
    c, t, parts = run.c, run.c.training, run.parts
    if not run.writes:  # ranks > 0: rank 0 evaluates and writes
        return
    final = (
        stop_reason is not None or run.stop_reason(0) is not None
    )  # no lot of the next epoch may run
    if (run.progress.epoch % t.eval_every == 0 or final) and stop_reason != "diverged":
        Xtr, ytr, Xte, yte = parts.data
        tf = parts.transform.eval
        with (
            parts.ema.applied(parts.model)
            if parts.ema is not None
            else nullcontext(parts.model) as model
        ):
            # (train loss, train accuracy): private data without noise, not covered by ε
            # (report.not_covered)
            ev = (
                evaluate(model, Xtr, ytr, t.eval_batch_size, tf)
                if t.train_metrics
                else (math.nan, math.nan)
            )
            ev += (evaluate(model, Xte, yte, t.eval_batch_size, tf)[1],)  # test accuracy
    else:
        ev = (math.nan, math.nan, math.nan)
    now = time.time()
    lot_loss = lot_loss if t.train_metrics else math.nan
    row = metrics_row(c, run, lr, lot_loss, ev, now - t_epoch, run.progress.wall_time(now))
    run.writer.hold(row)  # in the checkpoint; on disk, to the logger and the console: publish
    run.pending = (row, eta(run, now))
    if final:
        return
    with held_signals():  # the statement and the checkpoint that cover the row, written whole
        write_json(run.run_dir / PRIVACY, run.statement("running", None))
        if t.checkpoint_every and run.progress.epoch % t.checkpoint_every == 0:
            run.checkpoint(False, None)
    publish(run)


def publish(run: Run) -> None:
    """The row held by ``end_of_epoch``, out of the process: metrics.csv, the logger
    (``logger=csv|tensorboard|wandb``, the epoch its step) and the console line. Called once the
    statement (and the checkpoint) covering its lots are written; a failure here (a closed pipe, a
    logger that raises) comes after the charge."""
    if run.pending is None or not run.writes:
        return
    (row, tail), run.pending = run.pending, None
    run.writer.commit()
    if run.logger is not None:
        run.logger.log(row, row["epoch"])
    progress_line(row, run.c, tail)


if __name__ == "__main__":  # python -m dpsgd.train: the command line (the layer above) runs train
    from dpsgd.launch.main import train_main

    train_main()
