"""A replay is proved identical, never assumed (dpsgd/run/replay.py): the digest of the parameters after
each lot decides whether a resumed lot is the release that ran before, and what any output shows had
run is charged even when lots.reserved was cut back.

Each privacy case counts the releases that ran independently of the ledger (the Harness of
tests/run/test_resume_fingerprint.py logs every lot's position and a digest of its weights; a real
subprocess logs the same through tests/lot_logger.py) and checks the final ledger against that count.
"""
from __future__ import annotations

import csv
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from conftest import TINY_RUN, metrics_rows, snapshot
from dpsgd import train as training
from dpsgd.config.schema import ConfigError
from dpsgd.run.checkpoint import SUPERSEDED, load_checkpoint, save_checkpoint
from dpsgd.run.replay import Debt, debts_of, digest, merge
from dpsgd.run.rundir import RESERVATIONS, LotReservations
from test_resume_fingerprint import Harness, _lots, flip_last_bit

REPO = Path(__file__).resolve().parents[2]
ESCAPED = ["training.epochs=4", "training.checkpoint_every=2"]   # epoch 3's row escapes past the checkpoint


def _reserved(run: Path) -> int:
    return max(json.loads(x).get("upto", 0) for x in (run / RESERVATIONS).read_text().splitlines())


@pytest.fixture(scope="module")
def digested_template(tmp_path_factory):
    """checkpoint_every=2, killed as it writes its final checkpoint: lots 21..40 ran after the epoch-2
    checkpoint, epochs 3 and 4 escaped (rows, statement), and every lot's digest was written."""
    run = tmp_path_factory.mktemp("digested") / "run"
    with pytest.MonkeyPatch.context() as mp:
        h = Harness(mp, run)
        h.fresh(*ESCAPED, kill=("checkpoint", 2))
    assert load_checkpoint(run)["steps"] == 20 and [r["steps"] for r in metrics_rows(run)] == ["10", "20", "30", "40"]
    return run, list(h.log)


@pytest.fixture
def digested(digested_template, tmp_path, monkeypatch):
    template, log = digested_template
    shutil.copytree(template, tmp_path / "run")
    h = Harness(monkeypatch, tmp_path / "run")
    h.log.extend(log)
    return h


def test_every_lot_leaves_its_digest_in_the_reservations(digested):
    lines = [json.loads(x) for x in (digested.run / RESERVATIONS).read_text().splitlines()[1:]]
    assert [d["ran"] for d in lines if "ran" in d] == list(range(21, 41))
    upto = 0
    for d in lines:       # each digest comes after the reservation that covers its lot
        upto = max(upto, d.get("upto", 0))
        assert d.get("ran", 0) <= upto


def test_a_replay_that_proves_every_lot_costs_nothing_and_ends_where_the_run_would(digested, tmp_path, monkeypatch):
    st = digested.resume()
    assert _lots(st, ("lost",)) == 0 and _lots(st, ("sgd",)) == 40 and st["resumes"][-1]["lots_to_prove"] == 20
    assert _lots(st) >= digested.releases() == 40
    whole = Harness(monkeypatch, tmp_path / "whole")
    whole.fresh(*ESCAPED)
    assert whole.log[-1] == digested.log[-1]           # the same weights after lot 40, bit for bit


def test_a_replay_that_differs_from_one_lot_on_charges_that_attempt_from_there(digested, monkeypatch):
    """A one-ulp difference after lot 33 (as another kernel leaves it; the replay key cannot see it):
    lots 21..32 are proved, the first run's lots 33..40 are charged as lost at once."""
    from dpsgd.run import state as runstate
    orig = runstate.Run.charge

    def differ(r, release):
        if r.progress.steps + 1 == 33:
            flip_last_bit(next(r.parts.model.parameters()))
        orig(r, release)

    monkeypatch.setattr(runstate.Run, "charge", differ)
    st = digested.resume()
    assert _lots(st, ("lost",)) == 8 == st["resumes"][-1]["lost_lots_charged"]
    assert "lot 33" in st["resumes"][-1]["lost_lots_reason"] and "another digest" in st["resumes"][-1]["lost_lots_reason"]
    assert _lots(st) >= digested.releases()


def test_a_removed_digest_is_a_lot_that_cannot_be_proved(digested):
    path = digested.run / RESERVATIONS
    path.write_text("".join(x for x in path.read_text().splitlines(keepends=True) if '"ran": 27,' not in x))
    st = digested.resume()
    assert _lots(st, ("lost",)) == 40 - 27 + 1 and "no recorded digest" in st["resumes"][-1]["lost_lots_reason"]


# ----------------------------------------------------------------- every piece of evidence
def test_cutting_lots_reserved_back_to_its_binding_line_lowers_nothing(digested):
    """The rows and statement that escaped show 40 lots ran past the checkpoint at 20."""
    path = digested.run / RESERVATIONS
    path.write_text(path.read_text().splitlines()[0] + "\n")
    st = digested.resume("training.lr=0.05")             # not a replay: every lot that ran is charged
    assert _lots(st, ("lost",)) == 20 and _lots(st) >= digested.releases()
    path.write_text(path.read_text().splitlines()[0] + "\n")


def test_the_escaped_statement_alone_is_evidence(digested):
    path = digested.run / RESERVATIONS
    path.write_text(path.read_text().splitlines()[0] + "\n")
    rows = (digested.run / "metrics.csv").read_text().splitlines(keepends=True)
    (digested.run / "metrics.csv").write_text("".join(rows[:3]))     # rows of epochs 3 and 4 removed too
    assert json.loads((digested.run / "privacy.json").read_text())["steps"] == 30   # epoch 3's statement
    st = digested.resume()
    assert _lots(st, ("lost",)) == 10 and "no recorded digest" in st["resumes"][-1]["lost_lots_reason"]
    assert _lots(st) >= digested.releases()


def test_removed_superseded_rows_stop_the_resume_in_one_line(digested, capsys):
    digested.resume("training.epochs=3")                 # moves epochs 3-4's rows to metrics.superseded.csv
    sup = digested.run / SUPERSEDED
    assert len(list(csv.DictReader(open(sup)))) == 2
    assert load_checkpoint(digested.run)["reservations"]["superseded"] == 2
    sup.write_text(sup.read_text().splitlines(keepends=True)[0])
    before = snapshot(digested.run)
    with pytest.raises(SystemExit) as e:
        training.main([f"resume={digested.run}", "training.epochs=5"])
    err = capsys.readouterr().err.strip()
    assert e.value.code == 2 and len(err.splitlines()) == 1 and SUPERSEDED in err and "removed" in err, err
    assert snapshot(digested.run) == before


def test_an_output_past_any_possible_run_is_refused(digested):
    st = json.loads((digested.run / "privacy.json").read_text())
    (digested.run / "privacy.json").write_text(json.dumps({**st, "steps": 10 ** 15}))
    with pytest.raises(ConfigError, match="privacy.json|past what any run"):
        digested.resume()


# ----------------------------------------------------------------- the file itself
def test_a_torn_tail_is_read_as_a_crash_but_not_before_a_reservation(tmp_path):
    r = LotReservations(tmp_path)
    r.bind("t", 0)
    r.ensure(0, 20)
    for s in (1, 2, 3):
        r.ran(s, f"{s:032x}")
    r.close()
    path = tmp_path / RESERVATIONS
    with open(path, "ab") as f:
        f.write(b"\x00\x00\x00\n" + b'{"ran": 4, "digest": "' + b"4" * 32 + b'"}\n')
    assert LotReservations(tmp_path).verified({"token": "t"}, 0, 20) == 16
    fresh = LotReservations(tmp_path)
    fresh.verified({"token": "t"}, 0, 20)
    assert sorted(fresh.recorded) == [1, 2, 3]           # nothing after the torn line is used
    with open(path, "a") as f:
        f.write('{"upto": 20}\n')
    with pytest.raises(ConfigError, match="not JSON, and a reservation follows"):
        LotReservations(tmp_path).verified({"token": "t"}, 0, 20)


@pytest.mark.parametrize("line,why", [
    ('{"ran": 30, "digest": "' + "a" * 32 + '"}', "no reservation before it covers"),
    ('{"ran": 2, "digest": "' + "b" * 32 + '"}', "second digest of lot 2"),
    ('{"ran": 3, "digest": "short"}', "is not a reservation"),
])
def test_a_digest_no_run_could_have_written_is_refused(tmp_path, line, why):
    r = LotReservations(tmp_path)
    r.bind("t", 0)
    r.ensure(0, 20)
    r.ran(2, "a" * 32)
    r.close()
    with open(tmp_path / RESERVATIONS, "a") as f:
        f.write(line + "\n")
    with pytest.raises(ConfigError, match=why):
        LotReservations(tmp_path).verified({"token": "t"}, 0, 20)


def test_debts_merge_and_old_checkpoints():
    a = Debt(21, 40, {s: f"{s:032x}" for s in range(21, 35)})
    b = Debt(21, 40, {21: f"{21:032x}", 22: f"{22:032x}", 23: "f" * 32})
    merged = merge([a], b)
    assert [(d.first, d.upto) for d in merged] == [(21, 40), (23, 40)]    # b's lots 21, 22 were a's releases
    assert merge([a], Debt(21, 22, {21: f"{21:032x}", 22: f"{22:032x}"})) == [a]
    assert debts_of({"owed": 36}, 20) == [Debt(21, 36)]          # format 4: no digests, only a count
    assert debts_of({"owed": None}, 20) == [] and debts_of({"debts": [a.to_dict()]}, 20) == [a]


def test_the_digest_sees_one_ulp_and_nothing_else():
    m = torch.nn.Linear(3, 2)
    d0 = digest(m)
    assert digest(m) == d0 and len(d0) == 32
    flip_last_bit(m.weight)
    assert digest(m) != d0


# ----------------------------------------------------------------- another CPU, for real
OTHER_CPU = {"ATEN_CPU_CAPABILITY": "default", "MKL_CBWR": "COMPATIBLE",
             "NPY_DISABLE_CPU_FEATURES": "X86_V3,X86_V4,AVX512_ICL,AVX512_SPR", "DPSGD_CPU_PROFILE": "baseline"}


def _logged(args, log: Path, env: dict, kill_at: int = 0):
    env = {**env, "PYTHONPATH": os.pathsep.join([str(REPO), str(REPO / "tests")]), "OMP_NUM_THREADS": "1",
           "DPSGD_LOT_LOG": str(log), "DPSGD_KILL_AT": str(kill_at)}
    return subprocess.run([sys.executable, "-m", "lot_logger", *args], cwd=log.parent, env=env,
                          capture_output=True, text=True, timeout=300)


AVX2 = {"ATEN_CPU_CAPABILITY": "avx2"}      # a CPU with AVX2 but no AVX-512 (torch's kernels only)


@pytest.mark.parametrize("kill_at,profile", [(35, OTHER_CPU), pytest.param(25, OTHER_CPU, marks=pytest.mark.slow),
                                             pytest.param(35, AVX2, marks=pytest.mark.slow)])
def test_a_replay_on_another_cpu_is_charged_unless_its_digests_agree(tmp_path, kill_at, profile):
    """The run on this CPU's kernels, SIGKILL'd in the escaped-release window (lot 35: epoch 3's row
    escaped past the checkpoint at 20) or before it (lot 25); the resume computes as another CPU does:
    one without AVX2/AVX-512 (the switches of ``make test-other-cpu``), or one with AVX2 only. Every
    lot that ran, counted by its position and weights, is covered by the final ledger; where the
    digests differ, every lot the first run may have run past the checkpoint is charged. (On a CPU
    whose kernels are those of the profile, the two runs agree and nothing more is charged.)"""
    run, log = tmp_path / "run", tmp_path / "lots.log"
    native = {k: v for k, v in os.environ.items() if k not in OTHER_CPU}
    first = _logged([*TINY_RUN, "seed=1", *ESCAPED, f"hydra.run.dir={run}"], log, native, kill_at)
    assert first.returncode == -9, first.stderr
    reserved = _reserved(run)
    second = _logged([f"resume={run}"], log, {**native, **profile})
    assert second.returncode == 0, second.stderr
    ran = [tuple(x.split()) for x in log.read_text().splitlines()]
    st = json.loads((run / "privacy.json").read_text())
    assert _lots(st) >= len(set(ran))
    twice = {int(s) for s, _ in ran if sum(1 for t, _ in ran if t == s) == 2}
    differ = [s for s in sorted(twice) if len({h for t, h in ran if int(t) == s}) == 2]
    if differ:            # charged from the first lot that differs, or the killed one (never digested)
        assert _lots(st, ("lost",)) == reserved - min(differ[0], kill_at) + 1
    differs = bool(differ)
    print(f"kill at {kill_at}, {profile}: the other CPU's lots {'differ' if differs else 'agree'}; "
          f"lost {_lots(st, ('lost',))}, {len(set(ran))} releases, ledger {_lots(st)}")
