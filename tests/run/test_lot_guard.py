"""Every crash leaves a run that resumes, and every lot that ran is charged (dpsgd/run/guard.py).

The rule: a resume charges, as ``lost``, every lot past its checkpoint that an earlier attempt
reserved or that an output shows ran. Each case below counts the lots that ran outside the ledger
(tests/resume_harness.py logs every lot, repeats included) and checks the ledger against that count;
the property test at the end searches random kill sequences for a violation.
"""

from __future__ import annotations

import csv
import json
import os
import random
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from conftest import metrics_rows, snapshot
from dpsgd.launch.main import train_main
from dpsgd.config.schema import ConfigError
from dpsgd.run import parts as runparts
from dpsgd.run.checkpoint import PRIVACY, SUPERSEDED, load_checkpoint
from dpsgd.run.guard import RESERVATIONS, LotGuard
from resume_harness import LOTS, TINY, Harness, copy_of, killed_once, lots

REPO = Path(__file__).resolve().parents[2]
ESCAPED = [
    "training.epochs=4",
    "training.checkpoint_every=2",
]  # epoch 3's row escapes past the checkpoint


def _reserved(run: Path) -> int:
    return max(json.loads(x).get("upto", 0) for x in (run / RESERVATIONS).read_text().splitlines())


def _statement(run: Path) -> dict:
    return json.loads((run / PRIVACY).read_text())


@pytest.fixture(scope="module")
def escaped_template(tmp_path_factory):
    """checkpoint_every=2, killed as it writes its final checkpoint: lots 21..40 ran after the
    epoch-2 checkpoint, and the row and statement of epoch 3 escaped (epoch 4's row is held until
    the final statement and checkpoint that cover it are written: dpsgd/train.py:publish)."""
    run, log = killed_once(tmp_path_factory, "escaped", *ESCAPED, kill=("checkpoint", 2))
    assert load_checkpoint(run)["steps"] == 20
    assert [r["steps"] for r in metrics_rows(run)] == ["10", "20", "30"]
    assert _statement(run)["steps"] == 30
    return run, log


@pytest.fixture
def escaped(escaped_template, tmp_path, monkeypatch):
    return copy_of(escaped_template, tmp_path, monkeypatch)


def test_a_resume_charges_what_ran_past_the_checkpoint_and_ends_where_the_run_would(
    escaped, tmp_path, monkeypatch
):
    st = escaped.resume()
    assert (
        lots(st, ("lost",)) == 20
        and lots(st, ("sgd",)) == 40
        and st["resumes"][-1]["lost_lots_charged"] == 20
    )
    assert lots(st) >= escaped.executed() == 60
    whole = Harness(monkeypatch, tmp_path / "whole")
    whole.fresh(*ESCAPED)
    assert whole.log[-1] == escaped.log[-1]  # the same weights after lot 40, bit for bit


# ----------------------------------------------------------------- an extension that died
@pytest.fixture
def extended(tmp_path, monkeypatch):
    """A finished 2-epoch run, resumed with training.epochs=4 and killed in lot 25."""
    h = Harness(monkeypatch, tmp_path / "run")
    done = h.fresh("training.epochs=2")
    assert done["status"] == "complete" and lots(done) == 20
    h.resume("training.epochs=4", kill=("lot", 5))
    assert h.executed() == 25 and _statement(h.run)["status"] == "running"
    return h


def test_an_extension_that_died_is_charged_without_repeating_its_override(extended, capsys):
    reserved = _reserved(extended.run)
    st = extended.resume()  # training.epochs back to the checkpoint's 2
    assert (
        st["status"] == "complete" and st["steps"] == 20 and st["stop_reason"] == "epochs_completed"
    )
    assert lots(st, ("lost",)) == reserved - 20 >= 5 and lots(st) >= extended.executed()
    assert _statement(extended.run) == st and load_checkpoint(extended.run)["complete"]
    assert "an extension that did not finish" in capsys.readouterr().out
    before = snapshot(extended.run)
    assert extended.resume() == st  # now finished, nothing owed: nothing to do, nothing written
    assert snapshot(extended.run) == before


def test_an_extension_that_died_is_charged_with_its_override_too(extended):
    reserved = _reserved(extended.run)
    st = extended.resume("training.epochs=4")
    assert (
        st["status"] == "complete"
        and lots(st, ("sgd",)) == 40
        and lots(st, ("lost",)) == reserved - 20
    )
    assert lots(st) >= extended.executed()


def test_an_extension_that_died_before_its_first_lot_gets_its_final_statement_back(
    tmp_path, monkeypatch, capsys
):
    h = Harness(monkeypatch, tmp_path / "run")
    done = h.fresh("training.epochs=2")
    h.resume("training.epochs=4", kill=("lot", 1))
    (h.run / RESERVATIONS).write_text(
        (h.run / RESERVATIONS).read_text().splitlines()[0] + "\n"
    )  # no lot reserved
    rows = metrics_rows(h.run)
    assert _statement(h.run)["status"] == "running" and len(rows) == 2
    st = h.resume()
    assert st == done and _statement(h.run) == done and "restored" in capsys.readouterr().out


# ----------------------------------------------------------------- a crash at any point of opening
@pytest.mark.parametrize("kill", [("open", 1), ("checkpoint", 1), ("bind", 1)])
def test_a_resume_killed_while_it_opens_leaves_a_folder_that_opens(escaped, kill):
    """The first resume dies as it opens: before its first write, before its checkpoint-at-open (the
    charge of the lost lots), or between that checkpoint and binding lots.reserved to it."""
    assert escaped.resume(kill=kill) is None
    st = escaped.resume()
    assert st["status"] == "complete" and lots(st, ("sgd",)) == 40 and lots(st, ("lost",)) == 20
    assert lots(st) >= escaped.executed()


def test_a_signal_while_a_resume_opens_is_one_line_and_leaves_its_writes_whole(
    escaped, monkeypatch, capsys
):
    from dpsgd.run import opening

    write = opening.write_json

    def signalled(path, obj):  # SIGTERM arrives between the checkpoint-at-open and privacy.json
        os.kill(os.getpid(), signal.SIGTERM)
        write(path, obj)

    monkeypatch.setattr(opening, "write_json", signalled)
    with pytest.raises(SystemExit) as e:
        train_main([f"resume={escaped.run}"])
    assert e.value.code == 128 + signal.SIGTERM
    assert (
        _statement(escaped.run)["status"] == "running"
        and lots(_statement(escaped.run), ("lost",)) == 20
    )
    monkeypatch.setattr(opening, "write_json", write)
    st = escaped.resume()
    assert st["status"] == "complete" and lots(st, ("lost",)) == 20


def test_a_signal_while_the_data_load_is_one_line_and_writes_nothing(escaped, monkeypatch, capsys):
    load = runparts.load_data

    def signalled(c):
        os.kill(os.getpid(), signal.SIGTERM)
        return load(c)

    monkeypatch.setattr(runparts, "load_data", signalled)
    before = snapshot(escaped.run)
    with pytest.raises(SystemExit) as e:
        train_main([f"resume={escaped.run}"])
    err = capsys.readouterr().err.strip()
    assert e.value.code == 128 + signal.SIGTERM and len(err.splitlines()) == 1 and "SIGTERM" in err
    assert snapshot(escaped.run) == before


# -------------------------------------------------------------- edits the files can and cannot show
def test_cutting_lots_reserved_back_lowers_nothing_while_an_output_shows_the_lots(escaped):
    # epoch 3's row and statement show lots up to 30 (epoch 4's row never left the process: it
    # waited for the final statement and checkpoint, which the kill prevented)
    path = escaped.run / RESERVATIONS
    path.write_text(path.read_text().splitlines()[0] + "\n")
    st = escaped.resume("training.lr=0.05")
    assert (
        lots(st, ("lost",)) == 10
        and "an output shows lots up to 30 ran" in st["resumes"][-1]["lost_lots_reason"]
    )


def test_the_escaped_statement_alone_is_evidence(escaped):
    path = escaped.run / RESERVATIONS
    path.write_text(path.read_text().splitlines()[0] + "\n")
    rows = (escaped.run / "metrics.csv").read_text().splitlines(keepends=True)
    (escaped.run / "metrics.csv").write_text("".join(rows[:3]))  # epoch 3's row removed too
    assert _statement(escaped.run)["steps"] == 30  # epoch 3's statement
    st = escaped.resume()
    assert lots(st, ("lost",)) == 10


def test_a_file_cut_back_with_no_output_past_the_checkpoint_is_warned_about(
    tmp_path, monkeypatch, capsys
):
    """Killed in lot 15, before any output past the checkpoint at 10: lots.reserved alone shows lots
    11..15 ran. Cut back to its binding line, nothing can show them: the resume says so."""
    h = Harness(monkeypatch, tmp_path / "run")
    h.fresh("training.epochs=3", kill=("lot", 15))
    path = h.run / RESERVATIONS
    path.write_text(path.read_text().splitlines()[0] + "\n")
    st = h.resume()
    err = capsys.readouterr().err
    assert (
        err.startswith("warning: resume:")
        and "ended without a statement" in err
        and "cut back" in err
    )
    assert (
        lots(st, ("lost",)) == 0 and lots(st) == 30 < h.executed()
    )  # the stated limit (docs/RUNS.md)


def test_removed_superseded_rows_stop_the_resume_in_one_line(escaped, capsys):
    escaped.resume("training.epochs=3")  # moves epoch 3's row to metrics.superseded.csv
    sup = escaped.run / SUPERSEDED
    assert len(list(csv.DictReader(open(sup)))) == 1
    assert load_checkpoint(escaped.run)["reservations"]["superseded"] == 1
    sup.write_text(sup.read_text().splitlines(keepends=True)[0])
    before = snapshot(escaped.run)
    with pytest.raises(SystemExit) as e:
        train_main([f"resume={escaped.run}", "training.epochs=5"])
    err = capsys.readouterr().err.strip()
    assert (
        e.value.code == 2 and len(err.splitlines()) == 1 and SUPERSEDED in err and "removed" in err
    ), err
    assert snapshot(escaped.run) == before


def test_an_output_past_any_possible_run_is_refused(escaped):
    st = _statement(escaped.run)
    (escaped.run / PRIVACY).write_text(json.dumps({**st, "steps": 10**15}))
    with pytest.raises(ConfigError, match="privacy.json|past what any run"):
        escaped.resume()


# ----------------------------------------------------------------- a foreign finished checkpoint
def test_a_foreign_finished_checkpoint_is_refused_in_one_line(
    escaped, tmp_path, monkeypatch, capsys
):
    other = Harness(monkeypatch, tmp_path / "other")
    other.fresh("training.epochs=4", "training.checkpoint_every=2")
    shutil.copy(other.run / "checkpoint.pt", escaped.run / "checkpoint.pt")
    before = snapshot(escaped.run)
    with pytest.raises(SystemExit) as e:
        train_main([f"resume={escaped.run}"])
    err = capsys.readouterr().err.strip()
    assert (
        e.value.code == 2 and len(err.splitlines()) == 1 and "bound to another checkpoint" in err
    ), err
    assert snapshot(escaped.run) == before


# ----------------------------------------------------------------- the file itself
def test_a_torn_tail_is_read_as_a_crash_but_not_before_a_reservation(tmp_path):
    g = LotGuard(tmp_path)
    g.bind("t", 0)
    g.before_lot(0, 20)
    ckpt = {"steps": 0, "reservations": {"token": "t"}}
    with open(tmp_path / RESERVATIONS, "ab") as f:
        f.write(b"\x00\x00\x00\n")
    assert LotGuard(tmp_path).owed(ckpt, 0, 20).windows == ((0, 16),)
    with open(tmp_path / RESERVATIONS, "a") as f:
        f.write('{"upto": 20}\n')
    with pytest.raises(ConfigError, match="not JSON, and a reservation follows"):
        LotGuard(tmp_path).owed(ckpt, 0, 20)


def test_a_torn_tail_is_never_appended_to(tmp_path, monkeypatch):
    """A power loss can leave a reservation cut short; the next attempt binds a fresh file as it
    opens, so its own reservations never run into the torn line and the folder still opens after it
    dies (found by the property search: seed 1002, a torn tail and then an extension)."""
    h = Harness(monkeypatch, tmp_path / "run")
    h.fresh("training.epochs=2")
    with open(h.run / RESERVATIONS, "a") as f:
        f.write('{"upto": 9')
    h.resume("training.epochs=4", kill=("lot", 5))
    assert all(
        line.startswith("{") and line.endswith("}")
        for line in (h.run / RESERVATIONS).read_text().splitlines()
    )
    st = h.resume()
    assert st["status"] == "complete" and lots(st) >= h.executed()


def test_a_stale_binding_holds_only_what_the_checkpoint_covers(tmp_path):
    """A crash between a checkpoint and the binding: the file is bound to the checkpoint before it,
    and its reservations must be covered by this checkpoint's ledger (``covers``)."""
    g = LotGuard(tmp_path)
    g.bind("old", 10)
    g.before_lot(10, 27)
    opened = {"steps": 10, "reservations": {"token": "new", "previous": "old", "covers": 27}}
    assert (
        LotGuard(tmp_path).owed(opened, 27, 10).lots == 0
    )  # the checkpoint-at-open charged 11..27
    with pytest.raises(ConfigError, match="line 2 is not a reservation"):
        LotGuard(tmp_path).owed(
            {**opened, "reservations": {**opened["reservations"], "covers": 10}}, 0, 10
        )


def test_old_checkpoints_debts_are_charged_whole(tmp_path):
    g = LotGuard(tmp_path)
    g.bind("t", 20)
    with open(
        tmp_path / RESERVATIONS, "a"
    ) as f:  # a format-5 file: digest lines are read, not used
        f.write('{"upto": 30}\n{"ran": 21, "digest": "' + "a" * 32 + '"}\n')
    five = {
        "steps": 20,
        "reservations": {"token": "t", "debts": [{"first": 21, "upto": 36, "hashes": {}}]},
    }
    assert g.owed(five, 0, 10).windows == ((20, 16), (20, 10))
    four = {"steps": 20, "reservations": {"token": "t", "owed": 33}}
    assert g.owed(four, 0, 10).windows == ((20, 13), (20, 10))


# --------------------------------------------------------------- the property: searched, not listed
ALLOWED = [
    [],
    [],
    ["training.lr=0.05"],
    ["training.momentum=0.5"],
    ["training.epochs=2"],
    ["training.epochs=3"],
    ["training.epochs=5"],
    ["training.max_steps=27"],
    ["training.checkpoint_every=1"],
    ["training.eval_every=2"],
    ["privacy.physical_batch_size=7"],
    ["training.lr_end=0.02"],
]
DENIED = [
    ["privacy.sigma=3"],
    ["privacy.lot_size=50"],
    ["privacy.clip_norm=2"],
    ["seed=5"],
    ["privacy.noise_seed=9"],
    ["model.hidden=[9]"],
]


def _kill(rng: random.Random):
    return rng.choice(
        [
            None,
            None,
            ("lot", rng.randint(1, 30)),
            ("checkpoint", rng.randint(1, 3)),
            ("bind", rng.randint(1, 3)),
            ("open", 1),
        ]
    )


def _edit(rng: random.Random, run: Path) -> None:
    """A non-forging edit: what a careless user or a sync tool does (a metrics row removed, a stale
    privacy.json, a torn tail), never a forged or removed reservation."""
    what = rng.choice(["rows", "statement", "torn"])
    if what == "rows" and (run / "metrics.csv").exists():
        lines = (run / "metrics.csv").read_text().splitlines(keepends=True)
        (run / "metrics.csv").write_text("".join(lines[: max(1, len(lines) - 1)]))
    elif what == "statement" and (run / PRIVACY).exists():
        (run / PRIVACY).unlink()
    elif what == "torn" and (run / RESERVATIONS).exists():
        with open(run / RESERVATIONS, "a") as f:
            f.write('{"upto": 9')


def play(h: Harness, seed: int) -> dict:
    """A fresh run killed at a random point, then random resumes (allowed changes, refused ones, a
    finished run extended, non-forging edits, another thread count, computing as another CPU does
    (``other_cpu``), each killed at a random point or not), then plain
    resumes to the end; returns the final statement ({} when nothing could be resumed). Asserts that
    the folder always opens."""
    rng = random.Random(seed)
    every = rng.choice([1, 2, 3])
    kill = rng.choice(
        [
            ("lot", rng.randint(1, 40)),
            ("checkpoint", rng.randint(1, 4)),
            ("bind", rng.randint(1, 4)),
            None,
        ]
    )
    h.fresh("training.epochs=4", f"training.checkpoint_every={every}", kill=kill)
    if load_checkpoint(h.run) is None:
        return {}  # killed before its first checkpoint: nothing to resume, nothing claimed
    for _ in range(rng.randint(1, 4)):
        if rng.random() < 0.2:
            before = snapshot(h.run)
            with pytest.raises(ConfigError):
                h.resume(*rng.choice(DENIED))
            assert snapshot(h.run) == before
        if rng.random() < 0.2:
            _edit(rng, h.run)
        change = rng.choice(ALLOWED)
        if rng.random() < 0.25 and load_checkpoint(h.run)["complete"]:
            change = [
                f"training.epochs={load_checkpoint(h.run)['epoch'] + rng.randint(1, 2)}"
            ]  # an extension
        threads = torch.get_num_threads()
        with pytest.MonkeyPatch.context() as env:  # another thread count: other sums, the same rule
            env.setenv("DPSGD_THREADS", str(rng.choice([1, 2])))
            try:
                h.resume(*change, kill=_kill(rng), other_cpu=rng.random() < 0.3)
            finally:
                torch.set_num_threads(threads)
    for _ in range(3):  # plain resumes: the folder opens, and the run ends with a final statement
        st = h.resume()
        if st is not None and st["status"] == "complete":
            return st
    raise AssertionError("three plain resumes did not finish the run")


def check(h: Harness, st: dict) -> None:
    """Lots charged ≥ lots that ran (every attempt, repeats counted); privacy.json is the final
    statement."""
    if not st:
        return
    assert lots(st) >= h.executed(), (lots(st), h.executed())
    assert _statement(h.run) == st and st["status"] == "complete"


@pytest.mark.parametrize("seed", range(10))
def test_the_ledger_covers_every_lot_that_ran(tmp_path, monkeypatch, seed):
    h = Harness(monkeypatch, tmp_path / "run")
    check(h, play(h, seed))


@pytest.mark.slow
def test_the_ledger_covers_every_lot_that_ran_in_200_searched_sequences(tmp_path, monkeypatch):
    """The long seeded search (≥ 200 sequences, 0 violations)."""
    seeds = range(1000, 1200)
    for seed in seeds:
        with monkeypatch.context() as m:
            h = Harness(m, tmp_path / f"run{seed}")
            check(h, play(h, seed))


# ----------------------------------------------------------------- a real SIGKILL
@pytest.mark.slow
def test_a_real_kill_then_a_resume_with_another_lr_charges_what_ran(tmp_path):
    """The same with a real SIGKILL: rows escaped after the last checkpoint, the resume changes
    training.lr, and every lot that ran after the checkpoint is charged."""
    run = tmp_path / "run"
    env = dict(os.environ, PYTHONPATH=str(REPO), OMP_NUM_THREADS="1")
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "dpsgd.train",
            *TINY,
            "training.checkpoint_every=5",
            "training.epochs=400",
            f"hydra.run.dir={run}",
        ],
        cwd=tmp_path,
        env=env,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    deadline = time.time() + 120
    while (
        proc.poll() is None
        and time.time() < deadline
        and len(metrics_rows(run) if (run / "metrics.csv").exists() else []) < 7
    ):
        time.sleep(0.01)
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    ran = max(
        int(r["steps"]) for r in csv.DictReader(open(run / "metrics.csv"))
    )  # at least these ran
    ckpt_steps = load_checkpoint(run)["steps"]
    assert ran > ckpt_steps
    r = subprocess.run(
        [
            sys.executable,
            "-m",
            "dpsgd.train",
            f"resume={run}",
            "training.lr=0.05",
            "training.epochs=12",
        ],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert r.returncode == 0, r.stderr
    st = _statement(run)
    assert (
        lots(st, ("lost",)) >= ran - ckpt_steps
        and lots(st, ("lost",)) == st["resumes"][-1]["lost_lots_charged"]
    )
    assert LOTS == 10


def test_a_format_4_checkpoint_charges_what_it_owed_and_says_so(tmp_path, monkeypatch, capsys):
    """A format-4 checkpoint's owed lots carry no evidence of a replay: they are charged, and the
    console says so (never "replayed and proved")."""
    from dpsgd.run import checkpoint as ck

    h = Harness(monkeypatch, tmp_path / "run")
    h.fresh("training.epochs=2", "training.checkpoint_every=1", kill=("lot", 13))
    state = load_checkpoint(h.run)
    binding = state["reservations"]
    state["reservations"] = {
        "token": binding["token"],
        "previous": binding["previous"],
        "owed": 15,
        "superseded": binding["superseded"],
    }
    state.pop("version")
    with monkeypatch.context() as m:
        m.setattr(ck, "FORMAT_VERSION", 4)
        ck.save_checkpoint(h.run, state)
    capsys.readouterr()
    st = h.resume()
    out = capsys.readouterr().out
    reserved = (
        20  # lots.reserved: up to the end of epoch 2; the format-4 binding owed lots 11..15 besides
    )
    assert (
        "replayed and proved" not in out and f"charged {5 + reserved - 10} lot(s) as lost" in out
    ), out
    assert lots(st, ("lost",)) == 5 + reserved - 10 and lots(st) >= h.executed()
