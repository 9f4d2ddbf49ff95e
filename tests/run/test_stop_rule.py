"""The stop rule (dpsgd/run/state.py: Run.lots_left, Run.stop_reason; dpsgd/workbench/lots.py:
Lots.charge) and the epochs → lots rule (accountant.calibrate.lots_per_epoch, lots_for_epochs): one
answer for the loop, the write-ahead reservation, the end of an epoch, the budget and the privacy
command line."""

import itertools
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from dpsgd.run import guard
from dpsgd.accountant import Ledger, calibrate
from dpsgd.accountant.events import Poisson
from dpsgd.config.schema import validate
from dpsgd.run.distributed import Dist
from dpsgd.launch.main import compose
from dpsgd.privacy import main as privacy_main
from dpsgd.run.guard import LotGuard
from dpsgd.run.state import Progress, Rows, Run
from dpsgd.mechanism.plan import Plan
from dpsgd.mechanism.sampling import make_sampler
from dpsgd.train import train

TINY = [
    "dataset.subset=3000",
    "privacy.lot_size=150",
    "privacy.physical_batch_size=150",
    "model.hidden=[200]",
    "device=cpu",
]


def _run(tmp_path, sampling, epochs, max_steps, epoch, steps, budget, N=100, L=10):
    """A Run holding only what the stop rule reads: the training limits, the progress, the
    sampler."""
    c = SimpleNamespace(
        training=SimpleNamespace(epochs=epochs, max_steps=max_steps),
        privacy=SimpleNamespace(private=True, secure_rng=True, sigma=1.0),
    )
    sampler = make_sampler(sampling, N, L, torch.Generator().manual_seed(0))
    plan = Plan(sampler.event(1.0), 1.0, L, sampler)
    parts = SimpleNamespace(sampler=sampler, k=1, plan=plan, dp=None, ema=None)
    return Run(
        c=c,
        run_dir=Path(tmp_path),
        overrides=[],
        dist=Dist(),
        progress=Progress(ledger=Ledger(), epoch=epoch, steps=steps, budget=budget),
        parts=parts,
        writer=Rows([]),
        guard=LotGuard(tmp_path),
    )


def _spelled_out(run, lot):
    """The rule as it was written out at each of its callers: (stop reason before lot ``lot``, the
    write-ahead limit, whether the epoch just ended is the last)."""
    t, at, s = run.c.training, run.progress, run.parts.sampler
    if t.max_steps is not None and at.steps >= t.max_steps:
        why = "max_steps"
    elif at.budget is not None and at.budget <= 0 and s.release(1.0, lot) is not None:
        why = "target_epsilon_reached"
    else:
        why = None
    epoch_end = at.steps - lot + s.lots_per_epoch()
    limit = min(epoch_end, t.max_steps or epoch_end)
    if at.budget is not None and s.amplification:
        limit = min(limit, at.steps + at.budget)
    last = (
        at.epoch == t.epochs
        or (t.max_steps is not None and at.steps >= t.max_steps)
        or (at.budget is not None and at.budget <= 0)
    )
    return why, limit, last


@pytest.mark.parametrize("sampling", ["poisson", "shuffle"])
def test_one_rule_answers_what_each_caller_asked(tmp_path, sampling):
    grid = itertools.product([None, 5, 23, 40], [0, 1, 2, 3], [0, 3, 9], [None, 0, 1, 4])
    for max_steps, epoch, lot, budget in grid:
        steps = epoch * 10 + lot
        run = _run(tmp_path, sampling, 3, max_steps, epoch, steps, budget)
        why, limit, last = _spelled_out(run, lot)
        case = (max_steps, epoch, lot, budget)
        if lot == 0:  # at an epoch boundary: was the epoch before it the last one?
            assert (run.stop_reason(0) is not None) == last, case
        if epoch == 3:  # the loop runs no lot of a fourth epoch
            continue
        assert run.stop_reason(lot) == why, case
        if why is None:  # a lot runs: it is reserved up to the same limit
            assert steps + run.lots_left(lot) == limit, case
        else:
            assert run.lots_left(lot) == 0, case


def test_epochs_completed_comes_first_at_an_epoch_boundary(tmp_path):
    run = _run(tmp_path, "poisson", epochs=2, max_steps=20, epoch=2, steps=20, budget=0)
    assert run.stop_reason(0) == "epochs_completed" and run.lots_left(0) == 0
    run = _run(tmp_path, "poisson", epochs=3, max_steps=20, epoch=2, steps=20, budget=0)
    assert run.stop_reason(0) == "max_steps"


def test_a_charge_is_recorded_and_taken_off_the_budget(tmp_path):
    run = _run(tmp_path, "poisson", epochs=3, max_steps=None, epoch=0, steps=0, budget=2)
    run.lots.charge(Poisson(0.1, 4.0))
    run.lots.charge(None)  # a lot covered by an earlier charge (shuffle)
    assert run.progress.budget == 1 and run.progress.ledger.to_dict()["entries"][0]["count"] == 1
    assert run.lots_left(1) == 1


def test_shuffle_budget_counts_epochs(tmp_path):
    run = _run(tmp_path, "shuffle", epochs=9, max_steps=None, epoch=1, steps=13, budget=0)
    assert (
        run.stop_reason(3) is None and run.lots_left(3) == 7
    )  # the epoch was charged at its lot 0
    run = _run(tmp_path, "shuffle", epochs=9, max_steps=None, epoch=1, steps=10, budget=2)
    assert run.lots_left(0) == 10 and run.parts.sampler.lots_within(2, 0) == 20  # two epochs


@pytest.mark.parametrize(
    "stop, lots",
    [
        (["training.max_steps=27"], 27),
        (
            ["privacy.target_epsilon=0.8", "privacy.sigma=4"],
            calibrate.max_steps(0.8, 1e-5, 0.05, 4.0, "moments", 2),
        ),
    ],
)
def test_no_lot_is_reserved_past_the_stop(tmp_path, monkeypatch, stop, lots):
    # 20 lots an epoch: both stops fall inside an epoch
    limits = []
    ensure = guard.LotGuard.before_lot

    def spy(self, steps, limit):
        limits.append(limit)
        return ensure(self, steps, limit)

    monkeypatch.setattr(guard.LotGuard, "before_lot", spy)
    c = validate(compose(TINY + ["training.epochs=5", "model.projection=none"] + stop))
    st = train(c, tmp_path / "run")
    assert st["steps"] == lots and lots % 20 != 0
    assert max(limits) == lots


def test_epochs_to_lots_is_the_training_loops_epoch():
    for N, L in [
        (60000, 600),
        (60000, 4096),
        (60000, 2048),
        (50000, 2000),
        (60000, 512),
        (3000, 150),
        (7, 7),
    ]:
        s = make_sampler("poisson", N, L)
        assert calibrate.lots_per_epoch(N, L) == s.lots_per_epoch() == max(1, round(N / L))
        assert calibrate.lots_for_epochs(40, N, L) == 40 * s.lots_per_epoch()
        assert (
            calibrate.lots_for_epochs(40, 1, L / N) == 40 * s.lots_per_epoch()
        )  # from q = L/N alone
    assert (
        calibrate.lots_for_epochs(0.5, 1, 0.01) == 50
        and calibrate.lots_for_epochs(0.3, 1, 0.01) == 30
    )
    assert calibrate.lots_for_epochs(0.51, 1, 0.01) == 51  # a fraction: rounded up
    n = calibrate.max_steps(3.0, 1e-5, 4096 / 60000, 1.1, "rdp")
    e = calibrate.max_epochs(3.0, 1e-5, 4096 / 60000, 1.1, "rdp")
    assert (
        calibrate.lots_for_epochs(e, 1, 4096 / 60000)
        <= n
        < calibrate.lots_for_epochs(e + 1, 1, 4096 / 60000)
    )


def test_privacy_command_line_counts_the_lots_training_runs(capsys):
    privacy_main(["--q", str(4096 / 60000), "--sigma", "1.1", "--epochs", "40"])
    assert 40 * make_sampler("poisson", 60000, 4096).lots_per_epoch() == 600
    assert "lots=600 (epochs=40)" in capsys.readouterr().out
