"""Charged σ = noised σ by construction: the step noises at the σ of the very event the run's plan
holds and the ledger records (dpsgd/mechanism/plan.py, dpsgd/run/parts.py:build,
dpsgd/mechanism/optim.py:DPSGD, dpsgd/train.py:run_epoch), lots charged as lost on resume included
(``Plan.charge_lots``). A whole tiny run records every noise draw and its ledger; the two must
agree, for each of the five samplers."""

import pytest

from conftest import TINY_RUN
from dpsgd.accountant import Ledger
from dpsgd.config.schema import validate
from dpsgd.launch.main import compose
from dpsgd.mechanism import noise as noise_mod
from dpsgd.mechanism.sampling import make_sampler
from dpsgd.run import parts as parts_mod
from dpsgd.train import train


SAMPLERS = {
    "poisson": ["accountant.name=rdp"],
    "shuffle": ["accountant.name=rdp"],
    "fixed_size": ["accountant.name=rdp"],
    "balls_in_bins": ["accountant.name=rdp"],
    "truncated_poisson": ["privacy.max_lot_size=75", "accountant.name=pld"],
}


@pytest.mark.parametrize("sampling", sorted(SAMPLERS))
def test_the_noise_is_drawn_at_the_charged_sigma(tmp_path, monkeypatch, sampling):
    args = [
        *TINY_RUN,
        "model.projection=none",
        "training.epochs=1",
        f"privacy.sampling={sampling}",
        "privacy.sigma=3.0",
        "privacy.clip_norm=2.0",
        *SAMPLERS[sampling],
    ]
    stds, built = [], []
    add_ = noise_mod.GaussianNoise.add_
    monkeypatch.setattr(
        noise_mod.GaussianNoise,
        "add_",
        lambda self, t, std: (stds.append(std), add_(self, t, std))[1],
    )
    build = parts_mod.build
    monkeypatch.setattr(
        parts_mod, "build", lambda *a, **k: (built.append(build(*a, **k)), built[-1])[1]
    )
    final = train(validate(compose(args)), tmp_path / "run", args)
    parts = built[0]
    ledger = Ledger.from_dict(final["ledger"])
    assert stds and ledger.entries
    # the step's event is the plan's, the one the sampler defines for this run's σ and k, and the
    # one the ledger holds
    assert parts.dp.event is parts.plan.event == parts.sampler.event(3.0, parts.k)
    assert {_fields(e) for e in ledger.entries} == {_fields(_one(parts.dp.event))}
    # every draw: std = σ·C with the σ of the charged event (shuffle stores σ/2: sensitivity 2C)
    assert set(stds) == {parts.dp.event.sigma * 2.0}  # exact: σ·C, one product
    charged = {
        make_sampler(sampling, 600, 60, max_lot_size=75).event(s / 2.0, parts.k).entry()["sigma"]
        for s in stds
    }
    assert charged == {
        e.sigma for e in ledger.entries
    }  # exact: the same float through the same mapping


def _fields(e):
    return e.q, e.sigma, e.groups, e.event, e.adjacency, e.N, e.B, e.t


def _one(event):
    led = Ledger()
    led.record(event, 1)
    return led.entries[0]


@pytest.mark.parametrize("sampling", sorted(SAMPLERS))
def test_lots_charged_as_lost_on_resume_carry_the_noised_sigma(tmp_path, monkeypatch, sampling):
    """A run killed in its second epoch and resumed: the lost lots are charged from the plan's
    event, the very σ and k the step noised at (never re-derived from the configuration)."""
    from resume_harness import Harness

    h = Harness(monkeypatch, tmp_path / "run")
    extra = [
        "model.projection=none",
        f"privacy.sampling={sampling}",
        "privacy.sigma=3.0",
        *SAMPLERS[sampling],
    ]
    h.fresh("training.epochs=2", *extra, kill=("lot", 13))
    built = []
    build = parts_mod.build
    monkeypatch.setattr(
        parts_mod, "build", lambda *a, **k: (built.append(build(*a, **k)), built[-1])[1]
    )
    final = h.resume()
    lost = [e for e in Ledger.from_dict(final["ledger"]).entries if e.label == "lost"]
    assert lost and {_fields(e) for e in lost} == {_fields(_one(built[0].plan.event))}
    assert final["resumes"][-1]["lost_lots_charged"] > 0
