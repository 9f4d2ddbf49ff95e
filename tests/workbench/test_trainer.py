"""dpsgd.PrivateTrainer: a user's model and data get the command line's mechanism and charge.

Its ε is the privacy command line's for the same schedule, each lot run is charged once (by the
sampler's own analysis, all five samplers), the stop holds ε at or below the target, a state_dict
continues bit for bit, and a non-private run goes through the same loop and claims nothing.
"""

from __future__ import annotations

import contextlib
import json
import math

import pytest
import torch
from torch import nn

import dpsgd
from dpsgd.accountant import Ledger
from dpsgd.mechanism.sampling import SAMPLERS, record_lots
from dpsgd.privacy import main as privacy_main


class SmallCNN(nn.Module):
    """A user's model: Conv2d, GroupNorm, Linear (no BatchNorm)."""

    def __init__(self, classes: int = 10):
        super().__init__()
        self.conv = nn.Conv2d(3, 8, 3, padding=1)
        self.norm = nn.GroupNorm(2, 8)
        self.fc = nn.Linear(8 * 4 * 4, classes)

    def forward(self, x):
        x = nn.functional.max_pool2d(torch.relu(self.norm(self.conv(x))), 2)
        return self.fc(x.flatten(1))


def _data(n=400, seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(n, 3, 8, 8, generator=g), torch.randint(0, 10, (n,), generator=g)


def _trainer(**kw):
    torch.manual_seed(0)
    args = dict(lot_size=40, clip_norm=1.0, sigma=1.5, epochs=2, seed=0, threads=False)
    return dpsgd.PrivateTrainer(SmallCNN(), torch.utils.data.TensorDataset(*_data()), **args | kw)


def test_a_cnn_trained_to_a_target_epsilon_spends_what_the_privacy_cli_says(capsys):
    t = _trainer(sigma=None, target_epsilon=2.0, epochs=2)
    assert t.fit() == "epochs_completed"
    (entry,) = t.ledger.to_dict()["entries"]
    assert entry["count"] == t.steps == 2 * 10  # one charge per lot run
    assert (
        privacy_main(
            ["--q", "0.1", "--sigma", repr(t.plan.sigma), "--steps", str(t.steps), "--json"]
        )
        == 0
    )
    cli = json.loads(capsys.readouterr().out)
    # the same log moments of the same releases, composed by two call paths: they may differ in
    # the last bits of the sums, far below the accountant's own resolution
    assert t.epsilon == pytest.approx(cli["moments"]["epsilon"], rel=1e-6)
    # calibrated: at or below the target, within the σ search's rtol (0.005, calibrate.py) of it
    assert (1 - 0.005) * 2.0 <= t.epsilon <= 2.0


@pytest.mark.parametrize("sampling", sorted(SAMPLERS))
def test_every_sampler_is_charged_by_its_own_analysis(sampling):
    t = _trainer(sampling=sampling, max_lot_size=60 if sampling == "truncated_poisson" else None)
    t.fit(1)
    want = Ledger()
    record_lots(want, t.sampler, 1.5, t.steps, 0, t.plan.groups)
    assert t.ledger == want and t.steps == t.sampler.lots_per_epoch()
    assert t.accountant in t.plan.accountants and math.isfinite(t.epsilon)


def test_per_layer_clipping_is_charged_as_its_k_groups():
    t = _trainer(clipping="per_layer")
    t.fit(1)
    assert t.plan.groups == 3 and {e["groups"] for e in t.ledger.to_dict()["entries"]} == {3}


def test_the_stop_keeps_epsilon_at_or_below_the_target():
    t = _trainer(sigma=2.0, target_epsilon=1.0, epochs=50)
    assert t.fit() == "target_epsilon_reached"
    assert 0 < t.steps < 500 and t.epsilon <= 1.0
    more = Ledger(t.ledger.entries)
    more.record(t.plan.event, 1, "next")
    assert more.epsilon(1e-5, "moments")[0] > 1.0  # one lot more would pass it


def test_a_state_dict_continues_bit_for_bit():
    whole = _trainer()
    whole.fit(2)
    half = _trainer()
    half.fit(1)
    saved = half.state_dict()
    resumed = _trainer()
    resumed.load_state_dict(saved)
    resumed.fit(1)
    assert resumed.ledger == whole.ledger and resumed.steps == whole.steps
    a, b = whole.model.state_dict(), resumed.model.state_dict()
    assert all(torch.equal(a[n], b[n]) for n in a)


@pytest.mark.parametrize("how", [{"sigma": 0.0}, {"private": False}])
def test_non_private_runs_go_through_the_same_loop_and_claim_nothing(how):
    t = _trainer(**how)
    t.fit(1)
    assert t.steps == 10 and t.ledger.entries == () and t.epsilon == math.inf
    assert t.plan.sigma == 0.0 and not t.plan.private


def test_a_per_example_loss_of_the_users_choice():
    """Regression with a per-example squared error: ghost and vmap give the same clipped step (σ =
    0: the engines hand the noise its tensors in different orders)."""
    X = torch.randn(120, 5, generator=torch.Generator().manual_seed(1))
    y = X.sum(1, keepdim=True)

    def sq(out, target):
        return ((out - target) ** 2).sum(1)

    weights = []
    for mode in ("ghost", "vmap"):
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(5, 8), nn.Tanh(), nn.Linear(8, 1))
        t = dpsgd.PrivateTrainer(
            model, (X, y), lot_size=30, sigma=0.0, loss=sq, mode=mode, seed=3, threads=False
        )
        t.fit(1)
        weights.append(torch.cat([p.flatten() for p in model.parameters()]))
    torch.testing.assert_close(weights[0], weights[1], rtol=1e-5, atol=1e-6)


def test_a_loss_over_the_batch_is_refused_naming_it():
    with pytest.raises(ValueError, match=r"loss must return one value per example"):
        _trainer(loss=lambda out, y: nn.functional.cross_entropy(out, y))  # before any lot


def test_batchnorm_is_refused_naming_the_layer():
    model = nn.Sequential(nn.Conv2d(3, 4, 3), nn.BatchNorm2d(4), nn.Flatten(), nn.Linear(144, 10))
    with pytest.raises(ValueError, match=r"BatchNorm"):
        dpsgd.PrivateTrainer(model, _data(), lot_size=40, sigma=1.0, threads=False)


@pytest.mark.parametrize(
    "kw, name",
    [({"sigma": -1.0}, "sigma"), ({"sigma": None}, "sigma=None"), ({"threads": 0}, "threads")],
)
def test_bad_arguments_name_themselves(kw, name):
    with pytest.raises(ValueError, match=name):
        _trainer(**kw)


def test_data_as_a_dataset_or_an_iterable_of_pairs():
    X, y = _data(50)
    pairs = [(X[i], y[i]) for i in range(50)]
    for data in (pairs, iter(pairs), (X.numpy(), y.numpy())):
        t = dpsgd.PrivateTrainer(SmallCNN(), data, lot_size=10, sigma=1.0, threads=False)
        assert torch.equal(t.X, X) and torch.equal(t.y, y)


def test_the_thread_policy_applies_to_library_users(monkeypatch):
    before = torch.get_num_threads()
    monkeypatch.setenv("DPSGD_THREADS", "1")
    try:
        t = _trainer(threads=None)
        assert t.threads == 1 == torch.get_num_threads()
    finally:
        torch.set_num_threads(before)


class Scale(nn.Module):
    """A user's layer with parameters and no ghost rule."""

    def __init__(self, n):
        super().__init__()
        self.w = nn.Parameter(torch.linspace(0.5, 1.5, n))

    def forward(self, x):
        return x * self.w


def test_a_layer_without_a_ghost_rule_is_named_and_takes_the_exact_path():
    X, y = torch.randn(60, 6, generator=torch.Generator().manual_seed(2)), torch.arange(60) % 3
    sums = []
    for mode in ("auto", "vmap"):
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(6, 8), Scale(8), nn.Tanh(), nn.Linear(8, 3))
        with pytest.warns(UserWarning, match=r"no layer rule for 1 \(Scale\)") if mode == "auto" \
                else contextlib.nullcontext():  # fmt: skip
            t = dpsgd.PrivateTrainer(
                model, (X, y), lot_size=20, sigma=1.0, mode=mode, threads=False
            )
        assert t.clipper.mode == ("ghost" if mode == "auto" else "vmap")
        sums.append(t.clipper.clipped_sum(X, y).grads)
    for n in sums[0]:
        torch.testing.assert_close(sums[0][n], sums[1][n], rtol=1e-5, atol=1e-6)
