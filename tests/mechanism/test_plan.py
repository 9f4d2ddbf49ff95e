"""The mechanism as one object (dpsgd/mechanism/plan.py): built once from the configuration, it is
the only source of σ, C and L for the step, the ledger, the lost-lot charge and the statement."""

import dataclasses
import json

import pytest
import torch

from conftest import TINY_RUN, metrics_rows
from dpsgd.accountant.events import Gaussian, Poisson
from dpsgd.config.schema import validate
from dpsgd.launch.main import compose
from dpsgd.mechanism.plan import Plan
from dpsgd.mechanism.sampling import SAMPLERS, make_sampler
from dpsgd.run import parts as parts_mod
from dpsgd.run.checkpoint import load_checkpoint
from dpsgd.train import train


def test_nothing_reads_sigma_c_or_l_from_the_configuration_after_the_plan_is_built(
    tmp_path, monkeypatch
):
    """The same run twice; in the second, privacy.sigma, clip_norm and lot_size are overwritten with
    wrong values right after the plan is built. Every number the run releases or states is the
    same."""
    args = [*TINY_RUN, "training.epochs=2", "privacy.sigma=3.0", "privacy.clip_norm=2.0"]
    ref = train(validate(compose(args)), tmp_path / "ref", args)
    build = parts_mod.build

    def build_then_spoil(c, *a, **k):
        built = build(c, *a, **k)
        spoiled = dataclasses.replace(c.privacy, sigma=999.0, clip_norm=777.0, lot_size=1)
        object.__setattr__(c, "privacy", spoiled)
        return built

    monkeypatch.setattr(parts_mod, "build", build_then_spoil)
    got = train(validate(compose(args)), tmp_path / "got", args)
    for key in ("ledger", "epsilon", "epsilon_valid", "mechanism", "sampling", "statement"):
        assert got[key] == ref[key], key
    cols = ("sigma", "C", "L", "q", "epsilon", "test_accuracy", "lot_loss")
    assert [{k: r[k] for k in cols} for r in metrics_rows(tmp_path / "got")] == [
        {k: r[k] for k in cols} for r in metrics_rows(tmp_path / "ref")
    ]
    a, b = load_checkpoint(tmp_path / "ref")["model"], load_checkpoint(tmp_path / "got")["model"]
    assert all(torch.equal(a[n], b[n]) for n in a)  # the same noise, the same divisor


@pytest.mark.parametrize("name", sorted(SAMPLERS))
def test_a_plans_relation_and_accountants_are_its_events(name):
    s = make_sampler(name, 600, 60, max_lot_size=75)
    plan = Plan(s.event(2.0, 3), 1.0, 60, s)
    assert plan.adjacency == s.relation and plan.accountants == s.accountants
    assert plan.sigma == 2.0 and plan.groups == 3 and plan.private
    assert [plan.release(i) is not None for i in range(s.lots_per_epoch())] == [
        s.charged(i) for i in range(s.lots_per_epoch())
    ]


def test_a_plan_by_hand_and_its_refusals():
    assert Plan.by_hand(0.0, 1.0, 8).event is None and Plan.by_hand(0.0, 1.0, 8).sigma == 0.0
    assert Plan.by_hand(2.0, 1.0, 8, groups=2).event == Gaussian(2.0, 1.0, 2)
    for bad, what in [
        (lambda: Plan.by_hand(-1.0, 1.0, 8), "privacy.sigma"),
        (lambda: Plan(Poisson(0.1, 1.0), 0.0, 8), "privacy.clip_norm"),
        (lambda: Plan(Poisson(0.1, 1.0), 1.0, 0), "privacy.lot_size"),
        (lambda: Plan(1.5, 1.0, 8), "plan.event"),
    ]:
        with pytest.raises(ValueError, match=what):
            bad()


def test_a_plan_charges_lots_as_the_loop_does():
    from dpsgd.accountant import Ledger

    s = make_sampler("shuffle", 600, 60)
    plan, led = Plan(s.event(2.0, 2), 1.0, 60, s), Ledger()
    # positions 3..27 of shuffled epochs of 10 lots: charges at 10 and 20 (position 3 is covered by
    # its epoch's charge at 0; dpsgd/run/state.py:Run._charge_lots goes back to it when it charges
    # lost lots)
    assert plan.charge_lots(led, 25, first=3) == 2
    assert json.dumps(led.to_dict()) and {e.label for e in led.entries} == {"lost"}
