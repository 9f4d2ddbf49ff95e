"""Every sampler resumes bit-identically: a run stopped after 2 epochs and resumed to 4 ends with
the weights, the ledger and the ε of an uninterrupted 4-epoch run (the sampler's generator, and for
truncated_poisson the fixed-shape padding, replayed exactly)."""

import json

import pytest
import torch

from conftest import TINY_RUN
from dpsgd.config.schema import validate
from dpsgd.run.checkpoint import load_checkpoint
from dpsgd.launch.main import compose
from dpsgd.launch.prepare import prepare_resume
from dpsgd.train import train

SAMPLERS = {
    "poisson": [],
    "shuffle": [],
    "fixed_size": ["accountant.name=rdp"],
    "truncated_poisson": ["privacy.max_lot_size=75", "accountant.name=pld"],
    "balls_in_bins": ["accountant.name=rdp"],
}


@pytest.mark.parametrize("sampler", sorted(SAMPLERS))
def test_resume_replays_every_sampler_bit_identically(tmp_path, sampler):
    args = TINY_RUN + [
        f"privacy.sampling={sampler}",
        "privacy.sigma=2",
        "seed=4",
        *SAMPLERS[sampler],
    ]
    ref, run = tmp_path / "ref", tmp_path / "run"
    train(validate(compose(args + ["training.epochs=4"])), ref)
    train(validate(compose(args + ["training.epochs=2"])), run, args + ["training.epochs=2"])
    c, rd, rest = prepare_resume([f"resume={run}", "training.epochs=4"])
    train(c, rd, rest)
    a, b = load_checkpoint(ref), load_checkpoint(run)
    assert a["steps"] == b["steps"] > 0 and a["ledger"] == b["ledger"]
    assert torch.equal(
        a["sampler"]["generator"], b["sampler"]["generator"]
    )  # the same lots were drawn
    assert all(
        torch.equal(a["model"][k], b["model"][k]) for k in a["model"]
    )  # bit-identical weights
    pa, pb = (json.loads((d / "privacy.json").read_text()) for d in (ref, run))
    assert pa["epsilon_valid"] == pb["epsilon_valid"]  # exact: the same ledger, the same accountant
