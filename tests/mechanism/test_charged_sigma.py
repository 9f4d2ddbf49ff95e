"""Charged σ = noised σ by construction: the step noises at the σ of the very event the sampler returns
and the ledger records (dpsgd/run/parts.py:build, dpsgd/mechanism/optim.py:DPSGD, dpsgd/train.py:run_epoch).
A whole tiny run records every noise draw and its ledger; the two must agree, sampler by sampler."""
import pytest

from conftest import TINY_RUN
from dpsgd.accountant import Ledger
from dpsgd.config.schema import validate
from dpsgd.launch.main import compose
from dpsgd.mechanism import noise as noise_mod
from dpsgd.mechanism.sampling import make_sampler
from dpsgd.run import parts as parts_mod
from dpsgd.train import train


@pytest.mark.parametrize("sampling", ["poisson", "shuffle", "fixed_size"])
def test_the_noise_is_drawn_at_the_charged_sigma(tmp_path, monkeypatch, sampling):
    args = [*TINY_RUN, "model.projection=none", "training.epochs=1", f"privacy.sampling={sampling}",
            "privacy.sigma=3.0", "privacy.clip_norm=2.0", "accountant.name=rdp"]
    stds, built = [], []
    add_ = noise_mod.GaussianNoise.add_
    monkeypatch.setattr(noise_mod.GaussianNoise, "add_", lambda self, t, std: (stds.append(std), add_(self, t, std))[1])
    build = parts_mod.build
    monkeypatch.setattr(parts_mod, "build", lambda *a, **k: (built.append(build(*a, **k)), built[-1])[1])
    final = train(validate(compose(args)), tmp_path / "run", args)
    parts = built[0]
    ledger = Ledger.from_dict(final["ledger"])
    assert stds and ledger.entries
    # the step's event is the one the sampler defines for this run's σ and k, and the one the ledger holds
    assert parts.dp.event == parts.sampler.event(3.0, parts.k)
    assert {_fields(e) for e in ledger.entries} == {_fields(_one(parts.dp.event))}
    # every draw: std = σ·C with the σ of the charged event (shuffle stores σ/2: sensitivity 2C)
    assert set(stds) == {parts.dp.event.sigma * 2.0}        # exact: σ·C, one product
    charged = {make_sampler(sampling, 600, 60).event(s / 2.0, parts.k).entry()["sigma"] for s in stds}
    assert charged == {e.sigma for e in ledger.entries}     # exact: the same float through the same mapping


def _fields(e):
    return e.q, e.sigma, e.groups, e.event, e.adjacency, e.N, e.B, e.t


def _one(event):
    led = Ledger()
    led.record(event, 1)
    return led.entries[0]
