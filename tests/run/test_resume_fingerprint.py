"""Resume trusts nothing it was not told to: one whole-configuration fingerprint (default deny), lost
lots charged unless the resume is a faithful replay that runs through them, lots.reserved bound to
the checkpoint.

Kills are simulated in-process: ``Killed`` (a BaseException, like SIGKILL it runs no handler of the
trainer and writes nothing more) is raised after a chosen lot has run or just before a checkpoint is
written (after the epoch's metrics row). Every lot that runs is logged with its absolute position and a
digest of the weights it produced, so the releases that may have reached an output are counted
independently of the ledger (two runs of one lot are one release only when bit-identical). An
attempt may compute "as another CPU does" (``other_cpu``): after every lot the last bit of one weight
flips, as a kernel with another summation order or FMA would leave it; nothing in the replay key sees it.
"""
from __future__ import annotations

import copy
import hashlib
import json
import random
import shutil
from dataclasses import fields
from pathlib import Path

import pytest
import torch

from conftest import metrics_rows
from dpsgd import train as training
from dpsgd.accountant import Ledger
from dpsgd.config.fingerprint import FREE, LENGTH, REPLAY, RESUME_ALLOWED, config_fingerprint, config_leaves
from dpsgd.config.schema import CHOICES, Config, ConfigError, validate
from dpsgd.launch import main as T
from dpsgd.run import state as runstate
from dpsgd.run.checkpoint import fingerprint_hash, load_checkpoint
from dpsgd.launch.prepare import prepare_resume
from dpsgd.run.rundir import RESERVATIONS
from tolerances import chain_rel_tol
from conftest import TINY_RUN

REPO = Path(__file__).resolve().parents[2]
TINY = TINY_RUN + ["seed=1"]
LOTS = 10


class Killed(BaseException):
    """The process dies here (no handler of the trainer runs)."""


class Harness:
    """Runs and resumes in-process, killing where told, logging every lot that ran."""

    def __init__(self, monkeypatch, run: Path):
        self.run, self.log, self.kill = run, [], None     # kill: ("lot", n) or ("checkpoint", n) or None
        self.other_cpu = False
        self._n = {"lot": 0, "checkpoint": 0}
        charge, checkpoint = runstate.Run.charge, runstate.Run.checkpoint

        def logged_charge(r, release):
            if self.other_cpu:
                flip_last_bit(next(r.parts.model.parameters()))
            w = b"".join(p.detach().cpu().numpy().tobytes() for p in r.parts.model.parameters())
            self.log.append((r.progress.steps, hashlib.sha256(w).hexdigest()))
            self._due("lot")
            charge(r, release)

        def killable_checkpoint(r, *a, **k):
            self._due("checkpoint")
            checkpoint(r, *a, **k)

        monkeypatch.setattr(runstate.Run, "charge", logged_charge)
        monkeypatch.setattr(runstate.Run, "checkpoint", killable_checkpoint)

    def _due(self, what: str) -> None:
        self._n[what] += 1
        if self.kill is not None and self.kill == (what, self._n[what]):
            raise Killed

    def _go(self, fn, kill, other_cpu=False):
        self.kill, self._n, self.other_cpu = kill, {"lot": 0, "checkpoint": 0}, other_cpu
        try:
            return fn()
        except Killed:
            return None
        finally:
            self.kill, self.other_cpu = None, False

    def fresh(self, *extra: str, kill=None) -> dict | None:
        args = [*TINY, *extra]
        return self._go(lambda: training.train(validate(T.compose(args)), self.run, args), kill)

    def resume(self, *extra: str, kill=None, other_cpu=False) -> dict | None:
        def go():
            c, rd, rest = prepare_resume([f"resume={self.run}", *extra])
            return training.train(c, rd, rest)
        return self._go(go, kill, other_cpu)

    def releases(self) -> int:
        """Distinct releases that ran (a lot's position and the weights it produced)."""
        return len(set(self.log))


def flip_last_bit(p) -> None:
    """The last bit of the first element of ``p`` flipped, in place (a one-ulp change)."""
    with torch.no_grad():
        p.view(-1)[:1].view(torch.int32).bitwise_xor_(1)


def _lots(st: dict, labels=("sgd", "lost")) -> int:
    return sum(e["count"] for e in st["ledger"]["entries"] if e["label"] in labels)


def _snapshot(root: Path) -> dict:
    return {str(p.relative_to(root)): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(root.rglob("*")) if p.is_file()}


# ----------------------------------------------------------------- the fingerprint: default deny
def _changed(key, v):
    if key in CHOICES:
        return next(x for x in CHOICES[key] if x != v)
    if isinstance(v, bool):
        return not v
    if isinstance(v, (int, float)):
        return v + 1
    if isinstance(v, str):
        return v + "x"
    if isinstance(v, list):
        return [*v, 1]
    return 1          # None


LEAVES = sorted(config_leaves(validate({})))


@pytest.mark.parametrize("key", LEAVES)
def test_every_key_is_compared_unless_allowed(key):
    """Changing any leaf of the validated Config changes the fingerprint's hash, except the keys
    RESUME_ALLOWED lists: a new option is compared without being named anywhere."""
    c = validate({})
    before = fingerprint_hash(config_fingerprint(c))
    d = copy.deepcopy(c)
    group, _, name = key.rpartition(".")
    obj = getattr(d, group) if group else d
    setattr(obj, name, _changed(key, getattr(obj, name)))
    assert (fingerprint_hash(config_fingerprint(d)) == before) == (key in RESUME_ALLOWED)


def test_the_allow_list_is_short_known_and_documented():
    leaves = set(LEAVES)
    # short: a handful of keys per kind, each with its cost; a new key lands here only by review
    assert set(RESUME_ALLOWED) <= leaves and len(RESUME_ALLOWED) <= 20
    assert {cls for cls, _ in RESUME_ALLOWED.values()} <= {FREE, LENGTH, REPLAY}
    assert all(why for _, why in RESUME_ALLOWED.values())
    doc = (REPO / "docs" / "RUNS.md").read_text()
    for key in RESUME_ALLOWED:
        assert f"`{key}`" in doc, key
    assert {f.name for f in fields(Config)} >= {k.split(".")[0] for k in RESUME_ALLOWED}


def test_a_calibrated_sigma_names_its_calibration():
    from dpsgd.run.checkpoint import check_resumable
    saved = {"privacy.sigma": 1.2, "privacy.calibrate_sigma": True}
    with pytest.raises(ConfigError, match=r"privacy\.sigma=1\.3 .*privacy\.calibrate_sigma=true.*training\.epochs"):
        check_resumable(saved, {**saved, "privacy.sigma": 1.3})


# ----------------------------------------------------------------- lost lots
@pytest.fixture(scope="module")
def killed_template(tmp_path_factory):
    """checkpoint_every=2: epoch 3's row is written, the run dies 5 lots into epoch 4 (made once)."""
    run = tmp_path_factory.mktemp("killed") / "run"
    with pytest.MonkeyPatch.context() as mp:
        h = Harness(mp, run)
        h.fresh("training.epochs=4", "training.checkpoint_every=2", kill=("lot", 35))
    assert [r["epoch"] for r in metrics_rows(run)] == ["1", "2", "3"] and load_checkpoint(run)["steps"] == 20
    return run, list(h.log)


@pytest.fixture
def killed(killed_template, tmp_path, monkeypatch):
    """A copy of the killed run; returns (harness, the lots reserved after the epoch-2 checkpoint)."""
    template, log = killed_template
    shutil.copytree(template, tmp_path / "run")
    h = Harness(monkeypatch, tmp_path / "run")
    h.log.extend(log)
    reserved = max(json.loads(x).get("upto", 0) for x in (h.run / RESERVATIONS).read_text().splitlines())
    assert reserved >= 35 and _digested(h.run) == list(range(21, PROVED + 1))
    return h, reserved


PROVED = 34     # the killed run digested lots 21..34; lot 35 ran but died before its digest was written


def _digested(run: Path) -> list[int]:
    return [json.loads(x)["ran"] for x in (run / RESERVATIONS).read_text().splitlines() if '"ran"' in x]


def test_a_changed_key_that_no_list_names_is_refused(killed):
    h, _ = killed
    for bad, key in [("model.init=torch", "model.init"), ("training.ema_decay=0.9", "training.ema_decay"),
                     ("privacy.allow_large_delta=true", "privacy.allow_large_delta"),
                     ("privacy.augment_multiplicity=2", "privacy.augment_multiplicity")]:
        with pytest.raises(ConfigError, match=key.replace(".", r"\.")):
            prepare_resume([f"resume={h.run}", "training.epochs=2", bad])


@pytest.mark.parametrize("change,charged", [([], False), (["training.lr=0.05"], True),
                                            (["training.momentum=0.5"], True),
                                            (["privacy.physical_batch_size=7"], True)])
def test_a_resume_that_is_not_a_replay_charges_the_reserved_lots(killed, change, charged):
    h, reserved = killed
    st = h.resume(*change)
    lost = reserved - 20 if charged else reserved - PROVED    # a replay: only the lots no digest proves
    assert _lots(st, ("lost",)) == lost and st["resumes"][-1]["lost_lots_charged"] == lost
    assert _lots(st, ("sgd",)) == 40
    if charged:
        assert change[0].split("=")[0] in st["resumes"][-1]["lost_lots_reason"]
    assert _lots(st) >= h.releases()


@pytest.mark.parametrize("stop", ["training.epochs=3", "training.max_steps=32"])
def test_a_replay_that_stops_before_the_reserved_lots_charges_them(killed, stop):
    h, reserved = killed
    st = h.resume(stop)
    ran = 30 if "epochs" in stop else 32
    assert st["status"] == "complete" and _lots(st, ("sgd",)) == ran
    assert _lots(st, ("lost",)) == reserved - ran == st["resumes"][-1]["lost_lots_charged"]
    assert _lots(st) >= h.releases()


def test_an_interrupted_replay_charges_what_it_did_not_reach(killed, monkeypatch):
    from dpsgd.core.errors import Interrupted
    h, reserved = killed
    orig = runstate.Run.charge

    def interrupt(r, release):
        if r.progress.steps == 25:
            raise Interrupted(2)
        orig(r, release)

    monkeypatch.setattr(runstate.Run, "charge", interrupt)
    with pytest.raises(Interrupted):
        h.resume()
    st = json.loads((h.run / "privacy.json").read_text())
    assert st["status"] == "interrupted" and _lots(st, ("sgd",)) == 25
    assert _lots(st, ("lost",)) == reserved - 25


def test_an_owed_replay_survives_a_later_checkpoint(killed):
    """A faithful replay checkpoints before the reserved lots (checkpoint_every=1), dies, and the next
    resume stops early: the lots reserved before the first resume are still charged."""
    h, reserved = killed
    h.resume("training.checkpoint_every=1", kill=("lot", 12))     # checkpoint at 30, dies at lot 32
    debts = load_checkpoint(h.run)["reservations"]["debts"]
    assert [(d["first"], d["upto"]) for d in debts] == [(31, reserved)]       # 21..30 proved
    assert sorted(map(int, debts[0]["hashes"])) == list(range(31, PROVED + 1))
    second = max(json.loads(x).get("upto", 0) for x in (h.run / RESERVATIONS).read_text().splitlines())
    assert _digested(h.run) == [31]          # the replay's own lot 31 (equal to the first run's)
    st = h.resume("training.epochs=3")
    # the first run's lots 31..reserved, and the replay's lots 32..second: it died in lot 32, unproved
    assert _lots(st, ("sgd",)) == 30 and _lots(st, ("lost",)) == (reserved - 30) + (second - 31)
    assert _lots(st) >= h.releases()


# ----------------------------------------------------------------- lots.reserved bound to the checkpoint
@pytest.mark.parametrize("damage,why", [
    (lambda p: p.unlink(), "missing"),
    (lambda p: p.write_text('{"upto": 36}\n'), "no binding line"),
    (lambda p: p.write_text('{"checkpoint": "0123456789abcdef", "steps": 20}\n{"upto": 36}\n'),
     "bound to another checkpoint"),
    (lambda p: p.write_text(p.read_text().splitlines()[0] + '\n{"upto": 1000000000000000}\n'), "line 2"),
    (lambda p: p.write_text(p.read_text().splitlines()[0] + '\n{"upto": 999999999}\n'), "line 2"),
    (lambda p: p.write_text(p.read_text() + '{"upto": "many"}\n'), "is not a reservation"),
])
def test_a_missing_or_altered_reservation_file_is_refused(killed, capsys, damage, why):
    h, _ = killed
    damage(h.run / RESERVATIONS)
    before = _snapshot(h.run)
    with pytest.raises(SystemExit) as e:
        training.main([f"resume={h.run}"])
    err = capsys.readouterr().err.strip()
    assert e.value.code == 2 and len(err.splitlines()) == 1 and RESERVATIONS in err and why in err, err
    assert _snapshot(h.run) == before


def test_a_crash_between_checkpoint_and_binding_resumes(tmp_path, monkeypatch):
    """The file still bound to the previous checkpoint holds reservations up to this one only."""
    h = Harness(monkeypatch, tmp_path / "run")
    h.fresh("training.epochs=2")
    stale = (h.run / RESERVATIONS).read_text()
    binding = load_checkpoint(h.run)["reservations"]
    h.resume("training.epochs=3")
    ck = load_checkpoint(h.run)
    assert ck["reservations"]["previous"] == binding["token"]
    (h.run / RESERVATIONS).write_text(stale + '{"upto": 20}\n')   # as if the binding had not been written
    st = h.resume("training.epochs=4")
    assert st["status"] == "complete" and _lots(st, ("lost",)) == 0 and _lots(st, ("sgd",)) == 40


# ----------------------------------------------------------------- the property
ALLOWED = [[], [], ["training.lr=0.05"], ["training.momentum=0.5"], ["training.epochs=2"], ["training.epochs=3"],
           ["training.epochs=5"], ["training.max_steps=27"], ["training.checkpoint_every=1"],
           ["training.eval_every=2"], ["privacy.physical_batch_size=7"], ["training.lr_end=0.02"]]
DENIED = [["privacy.sigma=3"], ["privacy.lot_size=50"], ["privacy.clip_norm=2"], ["seed=5"],
          ["privacy.noise_seed=9"], ["model.hidden=[9]"]]


def _kill(rng: random.Random):
    return rng.choice([None, ("lot", rng.randint(1, 30)), ("checkpoint", rng.randint(1, 3))])


def _play(h: Harness, seed: int) -> dict:
    """A fresh run killed at a random point, then random resumes (allowed or refused changes, each
    killed at a random point or not), then a plain resume to the end; returns the final statement."""
    rng = random.Random(seed)
    every = rng.choice([1, 2, 3])      # killed after its first checkpoint (before it, nothing resumes)
    h.fresh("training.epochs=4", f"training.checkpoint_every={every}",
            kill=("lot", rng.randint(every * LOTS + 1, 40)) if rng.random() < 0.8 else ("checkpoint", 2))
    for _ in range(rng.randint(1, 3)):
        if load_checkpoint(h.run) is None:
            return {}
        if rng.random() < 0.3:
            before = _snapshot(h.run)
            with pytest.raises(ConfigError):
                h.resume(*rng.choice(DENIED))
            assert _snapshot(h.run) == before
        h.resume(*rng.choice(ALLOWED), kill=_kill(rng), other_cpu=rng.random() < 0.4)
    if load_checkpoint(h.run) is None:
        return {}
    return h.resume(other_cpu=rng.random() < 0.4)


def _epsilon(entries: list[tuple], delta: float) -> float:
    led = Ledger()
    for q, s, n, k, label in entries:
        led.record(q=q, sigma=s, count=n, groups=k, label=label)
    return led.epsilon(delta)[0]


def _check_property(h: Harness, st: dict) -> None:
    """The final ledger's ε is never below the ε of the distinct releases that ran."""
    if not st:                      # died before its first checkpoint: nothing to resume, nothing claimed
        return
    entries = st["ledger"]["entries"]
    pca = [e for e in entries if e["label"] == "pca"]
    lots = [e for e in entries if e["label"] in ("sgd", "lost")]
    assert len({(e["q"], e["sigma"], e["groups"]) for e in lots}) == 1    # one kind of lot (Poisson)
    q, s, k = lots[0]["q"], lots[0]["sigma"], lots[0]["groups"]
    assert _lots(st) >= h.releases()                   # integer counts
    claimed = _epsilon([(e["q"], e["sigma"], e["count"], e["groups"], e["label"]) for e in pca + lots], st["delta"])
    spent = _epsilon([(e["q"], e["sigma"], e["count"], e["groups"], "pca") for e in pca]
                     + [(q, s, h.releases(), k, "ran")], st["delta"])
    # the same composition with the lots' count split over entries: a few float operations apart
    assert claimed >= spent * (1 - chain_rel_tol(64))


@pytest.mark.parametrize("seed", [0, 1])
def test_the_ledger_covers_every_release_that_ran(tmp_path, monkeypatch, seed):
    h = Harness(monkeypatch, tmp_path / "run")
    _check_property(h, _play(h, seed))


@pytest.mark.slow
@pytest.mark.parametrize("seed", range(2, 14))
def test_the_ledger_covers_every_release_that_ran_more_cases(tmp_path, monkeypatch, seed):
    h = Harness(monkeypatch, tmp_path / "run")
    _check_property(h, _play(h, seed))


@pytest.mark.slow
def test_a_real_kill_then_a_resume_with_another_lr_charges_what_ran(tmp_path):
    """The same with a real SIGKILL: rows escaped after the last checkpoint, the resume changes
    training.lr, and every lot that ran after the checkpoint is charged."""
    import csv
    import os
    import signal
    import subprocess
    import sys
    import time
    run = tmp_path / "run"
    env = dict(os.environ, PYTHONPATH=str(REPO), OMP_NUM_THREADS="1")
    proc = subprocess.Popen([sys.executable, "-m", "dpsgd.train", *TINY, "training.checkpoint_every=5",
                             "training.epochs=400", f"hydra.run.dir={run}"], cwd=tmp_path, env=env,
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    deadline = time.time() + 120
    while proc.poll() is None and time.time() < deadline and len(metrics_rows(run) if (run / "metrics.csv").exists()
                                                                 else []) < 7:
        time.sleep(0.01)
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    ran = max(int(r["steps"]) for r in csv.DictReader(open(run / "metrics.csv")))   # at least these ran
    ckpt_steps = load_checkpoint(run)["steps"]
    assert ran > ckpt_steps
    r = subprocess.run([sys.executable, "-m", "dpsgd.train", f"resume={run}", "training.lr=0.05",
                        "training.epochs=12"], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr
    st = json.loads((run / "privacy.json").read_text())
    assert _lots(st, ("lost",)) >= ran - ckpt_steps and "training.lr" in st["resumes"][-1]["lost_lots_reason"]
