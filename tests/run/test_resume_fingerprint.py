"""Resume trusts nothing it was not told to: one whole-configuration fingerprint (default deny), the
lots that may have run after the checkpoint charged whatever the resume changes, lots.reserved bound
to the checkpoint. Kills are simulated in-process (tests/resume_harness.py); the property test that
searches kill sequences is tests/run/test_lot_guard.py's.
"""

from __future__ import annotations

import copy
import hashlib
import json
from dataclasses import fields
from pathlib import Path

import pytest

from conftest import metrics_rows
from dpsgd.launch.main import train_main
from dpsgd.config.fingerprint import (
    FREE,
    LENGTH,
    REPLAY,
    RESUME_ALLOWED,
    config_fingerprint,
    config_leaves,
)
from dpsgd.config.schema import CHOICES, Config, ConfigError, validate
from dpsgd.workbench.lots import Lots
from dpsgd.run.checkpoint import fingerprint_hash, load_checkpoint
from dpsgd.launch.prepare import prepare_resume
from dpsgd.run.guard import RESERVATIONS
from resume_harness import Harness, copy_of, killed_once
from resume_harness import lots as _lots

REPO = Path(__file__).resolve().parents[2]


def _snapshot(root: Path) -> dict:
    return {
        str(p.relative_to(root)): hashlib.sha256(p.read_bytes()).hexdigest()
        for p in sorted(root.rglob("*"))
        if p.is_file()
    }


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
    return 1  # None


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
    # (the last: logger.name and logger.project, where the metrics rows are also sent)
    assert set(RESUME_ALLOWED) <= leaves and len(RESUME_ALLOWED) <= 22
    assert {cls for cls, _ in RESUME_ALLOWED.values()} <= {FREE, LENGTH, REPLAY}
    assert all(why for _, why in RESUME_ALLOWED.values())
    doc = (REPO / "docs" / "RUNS.md").read_text()
    for key in RESUME_ALLOWED:
        assert f"`{key}`" in doc, key
    assert {f.name for f in fields(Config)} >= {k.split(".")[0] for k in RESUME_ALLOWED}


def test_a_calibrated_sigma_names_its_calibration():
    from dpsgd.run.checkpoint import check_resumable

    saved = {"privacy.sigma": 1.2, "privacy.calibrate_sigma": True}
    with pytest.raises(
        ConfigError, match=r"privacy\.sigma=1\.3 .*privacy\.calibrate_sigma=true.*training\.epochs"
    ):
        check_resumable(saved, {**saved, "privacy.sigma": 1.3})


def test_an_option_newer_than_the_run_resumes_at_its_default_only():
    """A run written before dataset.label existed: at the default it does what the run did; set to
    anything else it is a changed key."""
    from dpsgd.run.checkpoint import check_resumable

    saved = {"privacy.sigma": 1.2}
    check_resumable(saved, {**saved, "dataset.label": "label", "model.args": {}})
    with pytest.raises(ConfigError, match=r"resume: dataset\.label=y differs"):
        check_resumable(saved, {**saved, "dataset.label": "y"})
    with pytest.raises(ConfigError, match=r"resume: not_an_option=1 differs"):
        check_resumable(saved, {**saved, "not_an_option": 1})


# ----------------------------------------------------------------- lost lots
@pytest.fixture(scope="module")
def killed_template(tmp_path_factory):
    """checkpoint_every=2: epoch 3's row is written, the run dies 5 lots into epoch 4 (made
    once)."""
    run, log = killed_once(
        tmp_path_factory,
        "killed",
        "training.epochs=4",
        "training.checkpoint_every=2",
        kill=("lot", 35),
    )
    assert [r["epoch"] for r in metrics_rows(run)] == ["1", "2", "3"] and load_checkpoint(run)[
        "steps"
    ] == 20
    return run, log


@pytest.fixture
def killed(killed_template, tmp_path, monkeypatch):
    """A copy of the killed run; returns (harness, the lots reserved after the epoch-2
    checkpoint)."""
    h = copy_of(killed_template, tmp_path, monkeypatch)
    reserved = max(
        json.loads(x).get("upto", 0) for x in (h.run / RESERVATIONS).read_text().splitlines()
    )
    assert reserved >= 35
    return h, reserved


def test_a_changed_key_that_no_list_names_is_refused(killed):
    h, _ = killed
    for bad, key in [
        ("model.init=torch", "model.init"),
        ("training.ema_decay=0.9", "training.ema_decay"),
        ("privacy.allow_large_delta=true", "privacy.allow_large_delta"),
        ("privacy.augment_multiplicity=2", "privacy.augment_multiplicity"),
    ]:
        with pytest.raises(ConfigError, match=key.replace(".", r"\.")):
            prepare_resume([f"resume={h.run}", "training.epochs=2", bad])


@pytest.mark.parametrize(
    "change",
    [
        [],
        ["training.lr=0.05"],
        ["training.momentum=0.5"],
        ["privacy.physical_batch_size=7"],
        ["training.epochs=3"],
        ["training.max_steps=32"],
    ],
)
def test_every_resume_charges_the_reserved_lots_whatever_it_changes(killed, change):
    """One rule (dpsgd/run/guard.py): the lots reserved past the checkpoint at 20 are charged as
    lost on resume, whether the resume changes nothing, the weights, the sums or the length."""
    h, reserved = killed
    st = h.resume(*change)
    assert _lots(st, ("lost",)) == reserved - 20 == st["resumes"][-1]["lost_lots_charged"]
    assert "lots.reserved reserved lots up to" in st["resumes"][-1]["lost_lots_reason"]
    ran = {"training.epochs=3": 30, "training.max_steps=32": 32}.get(
        change[0] if change else "", 40
    )
    assert st["status"] == "complete" and _lots(st, ("sgd",)) == ran
    assert _lots(st) >= h.executed()


def test_an_interrupted_resume_still_owes_nothing_twice(killed, monkeypatch):
    """A resume interrupted at lot 25: its statement holds the lost lots and the 25 it ran; the next
    resume charges the lots the interrupted one reserved past the checkpoint, once."""
    from dpsgd.core.errors import Interrupted

    h, reserved = killed
    orig = Lots.charge

    def interrupt(r, release):
        if r.tally.steps == 25:
            raise Interrupted(2)
        orig(r, release)

    with monkeypatch.context() as m:
        m.setattr(Lots, "charge", interrupt)
        with pytest.raises(Interrupted):
            h.resume()
    st = json.loads((h.run / "privacy.json").read_text())
    assert st["status"] == "interrupted" and _lots(st, ("sgd",)) == 25
    assert _lots(st, ("lost",)) == reserved - 20
    again = h.resume()
    assert again["status"] == "complete" and _lots(again, ("sgd",)) == 40
    assert _lots(again, ("lost",)) > reserved - 20 and _lots(again) >= h.executed()


# ------------------------------------------------------------ lots.reserved bound to the checkpoint
@pytest.mark.parametrize(
    "damage,why",
    [
        (lambda p: p.unlink(), "missing"),
        (lambda p: p.write_text('{"upto": 36}\n'), "no binding line"),
        (
            lambda p: p.write_text(
                '{"checkpoint": "0123456789abcdef", "steps": 20}\n{"upto": 36}\n'
            ),
            "bound to another checkpoint",
        ),
        (
            lambda p: p.write_text(
                p.read_text().splitlines()[0] + '\n{"upto": 1000000000000000}\n'
            ),
            "line 2",
        ),
        (
            lambda p: p.write_text(p.read_text().splitlines()[0] + '\n{"upto": 999999999}\n'),
            "line 2",
        ),
        (lambda p: p.write_text(p.read_text() + '{"upto": "many"}\n'), "is not a reservation"),
    ],
)
def test_a_missing_or_altered_reservation_file_is_refused(killed, capsys, damage, why):
    h, _ = killed
    damage(h.run / RESERVATIONS)
    before = _snapshot(h.run)
    with pytest.raises(SystemExit) as e:
        train_main([f"resume={h.run}"])
    err = capsys.readouterr().err.strip()
    assert (
        e.value.code == 2 and len(err.splitlines()) == 1 and RESERVATIONS in err and why in err
    ), err
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
    (h.run / RESERVATIONS).write_text(
        stale + '{"upto": 20}\n'
    )  # as if the binding had not been written
    st = h.resume("training.epochs=4")
    assert st["status"] == "complete" and _lots(st, ("lost",)) == 0 and _lots(st, ("sgd",)) == 40
