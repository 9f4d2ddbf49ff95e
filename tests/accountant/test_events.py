"""The typed privacy events (dpsgd/accountant/events.py) and how the ledger records them: each event
is stored as the entry the flat form recorded (so ε and privacy.json are unchanged), ledgers written
before the events load and give the same ε, and steps_within takes an event."""

import json

import pytest

from dpsgd.accountant import Ledger
from dpsgd.accountant.events import (
    Allocation,
    FixedSize,
    Gaussian,
    Poisson,
    Shuffle,
    TruncatedPoisson,
    from_entry,
)

DELTA = 1e-5

# the fields of a stored entry (Entry, privacy.json) that a case below leaves at their defaults
FLAT_DEFAULTS = dict(groups=1, event="poisson", adjacency="add_remove", N=0, B=0, t=0)

# each event and the flat entry the ledger stores for it (the record the flat form made before the
# events)
CASES = [
    (Poisson(0.01, 4.0, 2), dict(q=0.01, sigma=4.0, groups=2)),
    (Gaussian(8.0, 0.5), dict(q=0.5, sigma=8.0)),
    (
        Gaussian(2.0, 1.0, 3, "replace_one"),
        dict(q=1.0, sigma=2.0, groups=3, adjacency="replace_one"),
    ),
    (FixedSize(0.01, 4.0), dict(q=0.01, sigma=4.0, event="wor", adjacency="replace_one")),
    (
        TruncatedPoisson(0.01, 4.0, 60000, 660),
        dict(q=0.01, sigma=4.0, event="truncated", N=60000, B=660),
    ),
    (Allocation(4.0, 100), dict(q=1.0, sigma=4.0, event="allocation", t=100)),
    (Shuffle(4.0, 100, 2), dict(q=1.0, sigma=2.0, groups=2, adjacency="replace_one")),
]


@pytest.mark.parametrize("event,flat", CASES)
def test_an_event_is_stored_as_its_flat_entry(event, flat):
    a = Ledger()
    a.record(event, 7, "sgd")
    stored = {**FLAT_DEFAULTS, **flat, "count": 7, "label": "sgd"}
    b = Ledger([stored])  # the flat entry, loaded (and checked) as a stored ledger is
    assert a.to_dict()["entries"] == [stored]
    assert a.to_dict() == b.to_dict()  # exact: the same entry, field by field
    assert json.dumps(a.to_dict()) == json.dumps(b.to_dict())
    assert event.adjacency == a.adjacency


@pytest.mark.parametrize("event,flat", CASES)
def test_an_entry_reads_back_as_an_event_with_the_same_entry(event, flat):
    # a Gaussian under add/remove reads back as Poisson, a Shuffle epoch as its replace-one
    # Gaussian: other names, the same record and so the same ε
    a, b = Ledger(), Ledger()
    a.record(event, 3)
    b.record(from_entry(a.entries[0]), 3)
    assert a == b


def test_a_shuffle_epoch_reads_back_as_the_gaussian_it_is_charged_as():
    led = Ledger()
    led.record(Shuffle(4.0, 100), 3)
    assert from_entry(led.entries[0]) == Gaussian(2.0, 1.0, 1, "replace_one")


def test_an_old_ledger_loads_and_gives_the_same_epsilon():
    # a ledger dict as committed privacy.json files and checkpoints hold it (format dpsgd.ledger/1)
    old = {
        "format": "dpsgd.ledger/1",
        "entries": [
            {
                "q": 1.0,
                "sigma": 4.0,
                "count": 1,
                "groups": 1,
                "label": "pca",
                "event": "poisson",
                "adjacency": "add_remove",
                "N": 0,
                "B": 0,
                "t": 0,
            },
            {
                "q": 0.2,
                "sigma": 2.0,
                "count": 10,
                "groups": 2,
                "label": "sgd",
                "event": "poisson",
                "adjacency": "add_remove",
                "N": 0,
                "B": 0,
                "t": 0,
            },
        ],
    }
    led = Ledger.from_dict(old)
    assert led.to_dict() == old  # exact: loaded and written back unchanged
    new = Ledger()
    new.record(Gaussian(4.0), 1, "pca")
    new.record(Poisson(0.2, 2.0, 2), 10, "sgd")
    assert new == led
    for acc in ("moments", "rdp", "pld"):
        assert new.epsilon(DELTA, acc) == led.epsilon(
            DELTA, acc
        )  # exact: the same entries, the same computation


@pytest.mark.parametrize(
    "event,flat,acc",
    [
        (Poisson(0.01, 4.0, 2), dict(q=0.01, sigma=4.0, groups=2), "rdp"),
        (
            TruncatedPoisson(0.01, 4.0, 60000, 660),
            dict(q=0.01, sigma=4.0, event="truncated", N=60000, B=660),
            "pld",
        ),
        (Allocation(1.5, 100), dict(q=1.0, sigma=1.5, event="allocation", t=100), "rdp"),
    ],
)
def test_steps_within_takes_an_event(event, flat, acc):
    led = Ledger()
    led.record(Gaussian(8.0), 1, "pca")
    stored = Ledger([{**FLAT_DEFAULTS, **flat, "count": 1, "label": ""}]).entries[0]
    assert from_entry(stored) == event
    assert led.steps_within(2.0, DELTA, event, acc) == led.steps_within(
        2.0, DELTA, from_entry(stored), acc
    )  # integer


def test_an_event_is_checked_when_recorded():
    with pytest.raises(ValueError, match="sigma"):
        Ledger().record(Poisson(0.01, -1.0), 1)
    with pytest.raises(ValueError, match="replace_one needs q = 1"):
        Ledger().record(Gaussian(2.0, 0.5, 1, "replace_one"), 1)
    with pytest.raises(ValueError, match="t >= 1"):
        Ledger().record(Allocation(2.0, 0), 1)
    with pytest.raises(ValueError, match="q="):
        Ledger().steps_within(1.0, DELTA, Poisson(2.0, 4.0))  # checked as if recorded


def test_only_an_event_is_recorded_or_counted():
    with pytest.raises(ValueError, match="a privacy event"):
        Ledger().record(0.01, 4.0)
    with pytest.raises(ValueError, match="a privacy event"):
        Ledger().steps_within(1.0, DELTA, 0.01, 4.0)
