"""A run's privacy claim is never below what it spent, and nothing it wrote is lost or rewritten.

In-process where the behaviour is about values (``main`` exits with SystemExit, capsys reads the one
line); a real subprocess only where it is about signals and processes.
"""

from __future__ import annotations

import csv
import fcntl
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from conftest import metrics_row_count
from dpsgd.launch import main as T
from dpsgd import train as training
from dpsgd.launch.main import train_main
from dpsgd.run import state as runstate
from dpsgd.run.checkpoint import CheckpointError, MetricsWriter, load_checkpoint, save_checkpoint
from dpsgd.launch.prepare import prepare_resume
from dpsgd.core.fileio import atomic_write_bytes
from dpsgd.config.schema import validate
from dpsgd.run.guard import CHUNK, RESERVATIONS, LotGuard
from dpsgd.run.rundir import RunLock
from conftest import TINY_RUN, snapshot

REPO = Path(__file__).resolve().parents[2]
TINY = TINY_RUN
_snapshot = snapshot


def _fresh(run: Path, *extra: str) -> dict:
    """A finished tiny run in ``run`` (in-process, same code path as the CLI's)."""
    args = [*TINY, *extra]
    c = validate(T.compose(args))
    return training.train(c, run, args)


def _main(capsys, *argv) -> tuple[int, str]:
    with pytest.raises(SystemExit) as e:
        train_main(list(argv))
    err = capsys.readouterr().err.strip()
    return e.value.code, err


def _train_cli(capsys, run: Path, *extra: str) -> tuple[int, str]:
    """A fresh run through the command line's error handling (exit code, one stderr line), without
    running Hydra's app in this process (its logging would outlive pytest's captured streams)."""
    args = [*TINY, *extra]
    with pytest.raises(SystemExit) as e:
        T.run_or_exit(lambda: training.train(validate(T.compose(args)), run, args))
    return e.value.code, capsys.readouterr().err.strip()


def _ledger_lots(st: dict, labels=("sgd", "lost")) -> int:
    return sum(e["count"] for e in st["ledger"]["entries"] if e["label"] in labels)


# ----------------------------------------------------------------- refused commands write nothing
@pytest.fixture(scope="module")
def finished(tmp_path_factory):
    run = tmp_path_factory.mktemp("trust") / "run"
    _fresh(run, "training.epochs=2", "privacy.target_epsilon=1.5")
    return run


@pytest.mark.parametrize(
    "argv,key",
    [
        (["++hydra.run.dir={run}"], "hydra.run.dir"),
        (["+hydra.run.dir={run}"], "hydra.run.dir"),
        (["hydra.run.dir='{run}'"], "hydra.run.dir"),
        (["-m", "hydra.sweep.dir={run}"], "hydra.sweep.dir"),
        (["--multirun", "hydra.sweep.dir={tmp}", "hydra.sweep.subdir=."], "hydra.sweep.subdir"),
        (["-m", "hydra.sweep.dir={tmp}", "hydra.sweep.subdir=../x"], "hydra.sweep.subdir"),
        (["hydra.output_subdir=../run/.hydra"], "hydra.output_subdir"),
        (["--experimental-rerun", "x"], "--experimental-rerun"),
        (["resume={run}", "hydra.run.dir={tmp}"], "hydra.run.dir"),
        (["resume={run}", "privacy.target_epsilon=3"], "privacy.target_epsilon"),
        (["resume={run}", "accountant=pld"], "accountant.name"),
        (["resume={run}", "privacy.convention=per_tensor"], "privacy.convention"),
        (["-m", "resume={run}"], "resume"),
        (["hydra.run.dir={tmp}/file/sub"], "hydra.run.dir"),
    ],
)
def test_refused_command_leaves_the_run_byte_identical(finished, tmp_path, capsys, argv, key):
    (tmp_path / "file").write_text("x")
    (tmp_path / "keep").write_text("x")  # the sweep dir candidates are not empty
    before = _snapshot(finished.parent), _snapshot(tmp_path)
    code, err = _main(capsys, *[a.format(run=finished, tmp=tmp_path) for a in argv] + TINY)
    assert code == 2 and len(err.splitlines()) == 1 and err.startswith("error: ") and key in err, (
        err
    )
    assert (_snapshot(finished.parent), _snapshot(tmp_path)) == before


def test_resume_reads_its_checkpoint_not_hydra_files(finished, tmp_path, capsys):
    """A rewritten or missing .hydra/overrides.yaml cannot drop the target: the target comes from
    the hash-checked checkpoint, and the budget is recomputed from the ledger."""
    import shutil

    run = tmp_path / "copy"
    shutil.copytree(finished, run)
    shutil.rmtree(run / ".hydra", ignore_errors=True)
    (run / ".hydra").mkdir()
    (run / ".hydra" / "overrides.yaml").write_text(
        "- privacy.target_epsilon=null\n- accountant=pld\n"
    )
    train_main([f"resume={run}", "training.epochs=40"])
    st = json.loads((run / "privacy.json").read_text())
    assert st["target_epsilon"] == 1.5 and st["accountant"] == "moments"
    assert st["stop_reason"] == "target_epsilon_reached" and st["epsilon"] <= 1.5
    assert st["status"] == "complete"


def test_a_resume_whose_ledger_already_spends_the_target_finishes_at_once(tmp_path, capsys):
    """Lots charged as lost can take a run past its target before its checkpoint is marked complete:
    the resume runs no lot and writes the final statement (ε above the target, stated), never a
    refusal that leaves privacy.json at ``running``."""
    run = tmp_path / "run"
    _fresh(run, "training.epochs=2", "privacy.target_epsilon=2", "training.checkpoint_every=1")
    ck = load_checkpoint(run)
    ck["complete"], ck["stop_reason"] = False, None
    ck["ledger"]["entries"][-1]["count"] += (
        100000  # as if more had been spent than the target allows
    )
    save_checkpoint(run, ck)
    train_main([f"resume={run}", "training.epochs=3"])
    st = json.loads((run / "privacy.json").read_text())
    assert (
        "target_epsilon_reached" in capsys.readouterr().out
        and st["status"] == "complete"
        and st["stop_reason"] == "target_epsilon_reached"
    )
    assert st["epsilon"] > 2 and st["steps"] == ck["steps"]
    assert load_checkpoint(run)["complete"]


# ----------------------------------------------------------------- checkpoint integrity
def _corrupt_flip(p: Path):
    d = bytearray(p.read_bytes())
    for i in range(64):
        d[len(d) // 2 + 7 * i] ^= 0xFF
    p.write_bytes(bytes(d))


@pytest.mark.parametrize(
    "damage,why",
    [
        (_corrupt_flip, "content hash mismatch"),
        (lambda p: p.write_bytes(p.read_bytes()[:-100]), "truncated"),
        (lambda p: p.write_bytes(b""), "empty"),
        (lambda p: p.write_bytes(b"PK\x03\x04 an old torch.save zip"), "format version"),
    ],
)
def test_damaged_checkpoint_is_refused_in_one_line(finished, tmp_path, capsys, damage, why):
    import shutil

    run = tmp_path / "run"
    shutil.copytree(finished, run)
    damage(run / "checkpoint.pt")
    before = _snapshot(run)
    code, err = _main(capsys, f"resume={run}", "training.epochs=3")
    assert code == 2 and len(err.splitlines()) == 1 and "checkpoint.pt" in err and why in err, err
    assert _snapshot(run) == before


def test_checkpoint_missing_a_key_is_refused(tmp_path):
    save_checkpoint(tmp_path, {"epoch": 1})
    with pytest.raises(CheckpointError, match="missing .*ledger"):
        load_checkpoint(tmp_path)


def test_checkpoint_round_trip_is_exact(finished):
    ck = load_checkpoint(finished)
    assert (
        ck["version"] == 6
        and ck["target_epsilon"] == 1.5
        and ck["fingerprint"]["accountant.name"] == "moments"
    )
    assert ck["optimizer"] == {"momentum": 0.0, "velocity": {}}  # plain SGD: no buffers


# ----------------------------------------------------------------- one writer
def test_second_writer_is_refused_while_the_first_holds_the_run(finished, capsys):
    fd = os.open(finished, os.O_RDONLY)  # another process's lock (a separate open file)
    fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    try:
        before = _snapshot(finished)
        code, err = _main(capsys, f"resume={finished}", "training.epochs=5")
        assert code == 2 and "another process is writing" in err
        assert _snapshot(finished) == before
    finally:
        os.close(fd)


def test_resume_while_the_original_process_runs_is_refused(tmp_path, capsys):
    """The finding this guards: both exited 0 and metrics.csv held duplicated, out-of-order rows."""
    run = tmp_path / "run"
    proc = _start([*TINY, "training.epochs=100000", f"hydra.run.dir={run}"], tmp_path)
    try:
        _wait_rows(run, 2, proc)
        code, err = _main(capsys, f"resume={run}", "training.epochs=100001")
        assert code == 2 and "another process is writing this run directory" in err, err
    finally:
        proc.send_signal(signal.SIGTERM)
        proc.communicate(timeout=60)
    assert proc.returncode == 128 + signal.SIGTERM
    epochs = [int(r["epoch"]) for r in csv.DictReader(open(run / "metrics.csv"))]
    assert epochs == list(range(1, len(epochs) + 1))


def test_run_lock_is_reentrant_and_released(tmp_path):
    with RunLock(tmp_path):
        with RunLock(tmp_path):
            pass
        fd = os.open(tmp_path, os.O_RDONLY)
        with pytest.raises(BlockingIOError):
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        os.close(fd)
    fd = os.open(tmp_path, os.O_RDONLY)
    fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)  # free again
    os.close(fd)


# ----------------------------------------------------------------- lots after the last checkpoint
def test_reservations_never_pass_the_limit_and_survive_a_torn_line(tmp_path):
    r = LotGuard(tmp_path)
    r.bind("t", 0)
    ckpt = {"steps": 0, "reservations": {"token": "t"}}
    assert r.owed(ckpt, 0, 20).lots == 0
    r.before_lot(0, 10)
    assert r.owed(ckpt, 0, 20).windows == ((0, min(CHUNK, 10)),)
    for s in range(10):
        r.before_lot(s, 10)
    assert r.owed(ckpt, 0, 20).windows == ((0, 10),)
    with open(tmp_path / RESERVATIONS, "a") as f:
        f.write('{"upto": 9999')  # a line cut short by a crash: never fsync'd
    assert r.owed(ckpt, 0, 20).windows == ((0, 10),)
    r.bind("t2", 10)
    assert r.owed({"steps": 10, "reservations": {"token": "t2"}}, 0, 20).lots == 0


@pytest.mark.parametrize("change,charged", [([], 12), (["privacy.physical_batch_size=7"], 12)])
def test_reserved_lots_are_charged_even_to_a_seeded_replay(tmp_path, change, charged):
    """Every reserved lot past the checkpoint is charged, whatever the resume changes (the one rule:
    dpsgd/run/guard.py)."""
    run = tmp_path / "run"
    _fresh(run, "training.epochs=2", "training.checkpoint_every=1")
    ck = load_checkpoint(run)  # pretend the process died 12 lots after epoch 1's checkpoint
    ck.update(complete=False, stop_reason=None, epoch=1, steps=10)
    ck["ledger"]["entries"][-1]["count"] -= 10
    ck["rows"] = ck["rows"][:1]
    save_checkpoint(run, ck)
    binding = ck["reservations"]
    (run / RESERVATIONS).write_text(
        json.dumps({"checkpoint": binding["token"], "steps": 10}) + '\n{"upto": 16}\n{"upto": 22}\n'
    )
    c, rd, rest = prepare_resume([f"resume={run}", "training.epochs=3", *change])
    st = training.train(c, rd, rest)
    assert _ledger_lots(st, ("lost",)) == charged
    assert _ledger_lots(st, ("sgd",)) == 30 and st["resumes"][-1]["lost_lots_charged"] == charged


def _start(args, cwd):
    env = dict(os.environ, PYTHONPATH=str(REPO), OMP_NUM_THREADS="1")
    return subprocess.Popen(
        [sys.executable, "-m", "dpsgd.train", *args],
        cwd=cwd,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )


def _wait_rows(run: Path, rows: int, proc, timeout=120):
    deadline = time.time() + timeout
    while time.time() < deadline and proc.poll() is None:
        if metrics_row_count(run) >= rows:
            return
        time.sleep(0.01)


def test_secure_mode_charges_every_lot_that_ran_after_a_kill(tmp_path):
    """privacy.secure_rng: the noise after the last checkpoint cannot be replayed, so the lots that
    ran after it (their rows reached metrics.superseded.csv) are charged on resume; the target
    holds."""
    run = tmp_path / "run"
    args = [
        *TINY,
        "privacy.secure_rng=true",
        "training.checkpoint_every=5",
        "training.epochs=400",
        "privacy.target_epsilon=2",
        "privacy.sigma=5",
        f"hydra.run.dir={run}",
    ]
    proc = _start(args, tmp_path)
    _wait_rows(run, 7, proc)
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    ran = max(
        int(r["steps"]) for r in csv.DictReader(open(run / "metrics.csv"))
    )  # at least these ran
    ckpt_steps = load_checkpoint(run)["steps"]
    assert ran > ckpt_steps
    r = subprocess.run(
        [sys.executable, "-m", "dpsgd.train", f"resume={run}"],
        cwd=tmp_path,
        env=dict(os.environ, PYTHONPATH=str(REPO), OMP_NUM_THREADS="1"),
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert r.returncode == 0, r.stderr
    st = json.loads((run / "privacy.json").read_text())
    lost = _ledger_lots(st, ("lost",))
    assert lost >= ran - ckpt_steps and lost == st["resumes"][-1]["lost_lots_charged"]
    assert _ledger_lots(st) >= st["steps"] + (ran - ckpt_steps)
    assert st["stop_reason"] == "target_epsilon_reached" and st["epsilon"] <= 2.0


# ----------------------------------------------------------------- failing loudly
def test_nonfinite_training_stops_as_diverged(tmp_path, capsys):
    run = tmp_path / "run"
    code, err = _train_cli(capsys, run, "training.lr=1e38", "training.epochs=3")
    assert code == 1 and len(err.splitlines()) == 1 and "diverged" in err
    st = json.loads((run / "privacy.json").read_text())
    assert st["status"] == "diverged" and st["stop_reason"] == "diverged" and st["epochs"] == 1


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGHUP, signal.SIGINT])
def test_signals_interrupt_with_one_line_and_no_traceback(tmp_path, sig):
    run = tmp_path / "run"
    proc = _start(
        [*TINY, "training.epochs=100000", "training.checkpoint_every=2", f"hydra.run.dir={run}"],
        tmp_path,
    )
    _wait_rows(run, 3, proc)
    proc.send_signal(sig)
    out, err = proc.communicate(timeout=60)
    assert proc.returncode == 128 + sig
    assert len(err.strip().splitlines()) == 1 and "Traceback" not in err
    assert f"interrupted by {signal.Signals(sig).name}" in err and f"resume={run}" in err
    st = json.loads((run / "privacy.json").read_text())
    assert st["status"] == "interrupted"
    assert _ledger_lots(st) == st["steps"] >= 30  # every lot that ran is in the statement's ledger


def test_metrics_file_removed_mid_run_is_rewritten_whole(tmp_path):
    w = MetricsWriter(tmp_path, ["epoch", "loss"])
    w.append({"epoch": 1, "loss": 0.5})
    w.append({"epoch": 2, "loss": 0.4})
    (tmp_path / "metrics.csv").unlink()
    w.append({"epoch": 3, "loss": 0.3})
    assert (tmp_path / "metrics.csv").read_text() == "epoch,loss\n1,0.5\n2,0.4\n3,0.3\n"
    (tmp_path / "metrics.csv").write_text("epoch,loss\n")  # truncated under us
    w.append({"epoch": 4, "loss": 0.2})
    assert (tmp_path / "metrics.csv").read_text().splitlines()[-4:] == [
        "1,0.5",
        "2,0.4",
        "3,0.3",
        "4,0.2",
    ]


def test_a_failed_write_leaves_no_temporary_file(tmp_path, monkeypatch):
    import errno

    def full(fd):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(os, "fsync", full)
    with pytest.raises(OSError):
        atomic_write_bytes(tmp_path / "privacy.json", b"{}")
    assert list(tmp_path.iterdir()) == []


def test_disk_errors_during_training_are_one_line(tmp_path, capsys, monkeypatch):
    import errno

    def full(*a, **k):
        raise OSError(
            errno.ENOSPC, "No space left on device", str(tmp_path / "run" / "checkpoint.pt")
        )

    monkeypatch.setattr(runstate, "save_checkpoint", full)
    code, err = _train_cli(capsys, tmp_path / "run", "training.epochs=1")
    assert (
        code == 1 and err == f"error: {tmp_path / 'run' / 'checkpoint.pt'}: No space left on device"
    )


def test_run_dir_with_a_quote_can_be_resumed(tmp_path, capsys):
    run = tmp_path / "it's a run"
    _fresh(run, "training.epochs=1")
    train_main([f"resume={run}", "training.epochs=2"])
    rows = list(csv.DictReader(open(run / "metrics.csv")))
    assert [r["epoch"] for r in rows] == ["1", "2"]


def test_resume_without_checkpoint_is_refused(tmp_path, capsys):
    run = tmp_path / "run"
    run.mkdir()
    (run / "privacy.json").write_text('{"status": "running"}')
    code, err = _main(capsys, f"resume={run}")
    assert code == 2 and "no checkpoint.pt" in err


def test_each_resume_replaces_the_overrides_it_changes(tmp_path):
    run = tmp_path / "run"
    _fresh(run, "training.epochs=1")
    for e in (2, 3):
        train_main([f"resume={run}", f"training.epochs={e}"])
    ov = load_checkpoint(run)["overrides"]
    assert [o for o in ov if o.startswith("training.epochs=")] == ["training.epochs=3"]
    assert [r["epoch"] for r in csv.DictReader(open(run / "metrics.csv"))] == ["1", "2", "3"]
