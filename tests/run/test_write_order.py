"""Nothing of an epoch leaves the process before the privacy statement and the checkpoint that cover
it are on disk (dpsgd/train.py: end_of_epoch, publish), so a failure while printing is a failure
after the charge, never before; and run.log is written line by line, so a process killed at any
point leaves every line it printed.

The first epoch of ``python -m dpsgd.train … | head -2`` (a closed pipe) left a metrics row of 10
lots beside a privacy.json of 0 lots and no checkpoint, which no resume could correct; a logger that
raised in its first ``log`` did the same. The property test at the end kills runs at random points,
lots and outputs alike (the metrics row, the logger, the console line), and checks after every
attempt that the statement covers every output that left, and at the end every lot that ran.
"""

from __future__ import annotations

import csv
import json
import random
import subprocess
import sys
from pathlib import Path

import pytest

from conftest import TINY_RUN, train_env
from dpsgd import train as training
from dpsgd.config.schema import validate
from dpsgd.core.console import tee_to
from dpsgd.launch import main as T
from dpsgd.run import report
from dpsgd.run.checkpoint import PRIVACY, MetricsWriter, load_checkpoint
from resume_harness import Harness, Killed, lots


def _statement(run: Path) -> dict:
    return json.loads((run / PRIVACY).read_text())


def _rows(run: Path) -> list[dict]:
    try:
        with open(run / "metrics.csv", newline="") as f:
            return list(csv.DictReader(f))
    except FileNotFoundError:
        return []


def _covered(run: Path, shown: int = 0) -> None:
    """privacy.json's lots cover every metrics row, and ``shown`` (lots a console line showed)."""
    st = _statement(run)
    seen = max([shown, *(int(r["steps"]) for r in _rows(run))])
    assert st["steps"] >= seen and lots(st) >= seen, (st["steps"], lots(st), seen)


def test_a_closed_pipe_in_the_first_epoch_leaves_a_statement_that_covers_it(tmp_path):
    """``python -m dpsgd.train … | head -2``: the epoch's console line fails (EPIPE) after its
    statement and checkpoint; the run resumes and ends with every lot charged."""
    run = tmp_path / "run"
    args = [*TINY_RUN, "training.epochs=2", f"hydra.run.dir={run}"]
    cmd = " ".join([sys.executable, "-m", "dpsgd.train", *args]) + " | head -2"
    r = subprocess.run(["bash", "-o", "pipefail", "-c", cmd], cwd=tmp_path, env=train_env(),
                       capture_output=True, text=True, timeout=300)  # fmt: skip
    assert r.returncode == 1 and len(r.stdout.splitlines()) == 2, r.stderr[-2000:]
    assert r.stderr.strip().splitlines()[-1] == "error: Broken pipe"
    st = _statement(run)
    assert st["status"] == "running" and st["steps"] == 10 and lots(st) == 10
    assert load_checkpoint(run)["steps"] == 10  # resumable
    _covered(run)
    r = subprocess.run([sys.executable, "-m", "dpsgd.train", f"resume={run}"], cwd=tmp_path,
                       env=train_env(), capture_output=True, text=True, timeout=300)  # fmt: skip
    assert r.returncode == 0, r.stderr[-2000:]
    st = _statement(run)
    assert st["status"] == "complete" and lots(st) >= st["steps"] == 20
    _covered(run)
    log = (run / "run.log").read_text()
    assert log.count("plan: ") == 2 and "epoch    1 |" in log  # both attempts' console


class _RaisingLogger:
    def __init__(self):
        self.calls = 0

    def log(self, row, step):
        self.calls += 1
        raise RuntimeError("the logger's server is down")

    def close(self):
        pass


def test_a_logger_that_raises_in_its_first_log_raises_after_the_charge(tmp_path, monkeypatch):
    logger = _RaisingLogger()
    monkeypatch.setattr(training, "opened_logger", lambda run: logger)
    args = [*TINY_RUN, "training.epochs=2"]
    with pytest.raises(RuntimeError, match="server is down"):
        training.train(validate(T.compose(args)), tmp_path / "run", args)
    run = tmp_path / "run"
    assert logger.calls == 1 and load_checkpoint(run)["steps"] == _statement(run)["steps"] == 10
    _covered(run)


def test_run_log_is_written_line_by_line(tmp_path):
    """An attempt killed before its first epoch line lost its console (run.log was buffered),
    ``resume: charged N lot(s) as lost`` included."""
    path = tmp_path / "run.log"
    with tee_to(path) as log:
        print("held until the run is accepted")
        log.release()
        assert path.read_text() == "held until the run is accepted\n"
        print("resume: charged 7 lot(s) as lost: ...")
        sys.stdout.write("a line in two ")
        assert path.read_text().endswith("as lost: ...\n")  # on disk now, not at the end
        sys.stdout.write("writes\n")
        assert path.read_text().endswith("a line in two writes\n")


# ------------------------------------------------------------------- the property, searched
OUTPUTS = ("row", "logger", "print")


class Outputs:
    """Kill points at the outputs of an epoch (the metrics row to disk, the logger, the console
    line), each raising ``Killed`` before the output leaves, counted within one attempt; and the
    lots every output that left showed."""

    def __init__(self, monkeypatch):
        self.kill, self.n, self.shown = None, dict.fromkeys(OUTPUTS, 0), 0
        commit, line = MetricsWriter.commit, report.progress_line

        def killable_commit(w):
            self._due("row")
            commit(w)

        def killable_line(row, c, tail=""):
            self._due("print")
            line(row, c, tail)
            self.shown = max(self.shown, int(row["steps"]))

        outputs = self

        class Logger:
            def log(self, row, step):
                outputs._due("logger")

            def close(self):
                pass

        monkeypatch.setattr(MetricsWriter, "commit", killable_commit)
        monkeypatch.setattr(training, "progress_line", killable_line)
        monkeypatch.setattr(training, "opened_logger", lambda run: Logger())

    def arm(self, kill) -> None:
        self.kill, self.n = kill, dict.fromkeys(OUTPUTS, 0)

    def _due(self, what: str) -> None:
        self.n[what] += 1
        if self.kill == (what, self.n[what]):
            raise Killed


def _kill(rng: random.Random):
    return rng.choice(
        [
            None,
            ("lot", rng.randint(1, 40)),
            ("checkpoint", rng.randint(1, 3)),
            *((o, rng.randint(1, 4)) for o in OUTPUTS),
            *((o, 1) for o in OUTPUTS),  # the first epoch's outputs: the case that was open
        ]
    )


def play(h: Harness, out: Outputs, rng: random.Random) -> None:
    """A fresh run and resumes, each killed at a random lot, checkpoint or output; after every
    attempt the statement covers every output that left; at the end (when the folder can be
    resumed at all) the ledger covers every lot that ran."""
    every = rng.choice([1, 2])
    for attempt in range(6):
        kill = _kill(rng) if attempt < 4 else None
        (lot_kill, output_kill) = (kill, None) if kill and kill[0] in ("lot", "checkpoint") else (
            None, kill)  # fmt: skip
        out.arm(output_kill)
        if attempt == 0:
            h.fresh("training.epochs=3", f"training.checkpoint_every={every}", "logger.name=csv",
                    kill=lot_kill)  # fmt: skip
        elif load_checkpoint(h.run) is None:
            break  # never checkpointed: nothing to resume; the statement must cover what left
        else:
            h.resume(kill=lot_kill)
        if (h.run / PRIVACY).exists():
            _covered(h.run, out.shown)
        if load_checkpoint(h.run) is not None and load_checkpoint(h.run)["complete"]:
            break
    ckpt = load_checkpoint(h.run)
    if ckpt is not None and ckpt["complete"]:
        st = _statement(h.run)
        assert st["status"] == "complete" and lots(st) >= h.executed(), (lots(st), h.executed())


@pytest.mark.parametrize("seed", range(6))
def test_the_statement_covers_every_output_and_lot_under_random_kills(tmp_path, monkeypatch, seed):
    h = Harness(monkeypatch, tmp_path / "run")
    play(h, Outputs(monkeypatch), random.Random(seed))


@pytest.mark.slow
def test_the_statement_covers_every_output_and_lot_in_60_searched_sequences(tmp_path, monkeypatch):
    for seed in range(100, 160):
        with monkeypatch.context() as m:
            h = Harness(m, tmp_path / f"run{seed}")
            play(h, Outputs(m), random.Random(seed))
