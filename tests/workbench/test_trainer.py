"""dpsgd.PrivateTrainer: a user's model and data get the command line's mechanism and charge.

Its ε is the privacy command line's for the same schedule, each lot run is charged once (by the
sampler's own analysis, all five samplers), the stop holds ε at or below the target, a state_dict
continues bit for bit, and a non-private run goes through the same loop and claims nothing.
"""

from __future__ import annotations

import contextlib
import copy
import json
import math

import pytest
import torch
from torch import nn

import dpsgd
from dpsgd.accountant import Ledger
from dpsgd.mechanism.sampling import SAMPLERS, record_lots
from dpsgd.privacy import main as privacy_main
from tolerances import pld_epsilon_tol


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
    # the API's default accountant is the tightest valid one (PLD for Poisson lots): the same
    # releases composed by two call paths, within the PLD grid's resolution
    assert t.accountant == "pld"
    tol = pld_epsilon_tol([(0.1, t.plan.sigma, t.steps)])
    assert t.epsilon == pytest.approx(cli["pld"]["epsilon"], abs=tol)
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


def test_non_private_runs_go_through_the_same_loop_and_claim_nothing():
    t = _trainer(private=False)
    t.fit(1)
    assert t.steps == 10 and t.ledger.entries == () and t.epsilon == math.inf
    assert t.plan.sigma == 0.0 and not t.plan.private


def test_a_per_example_loss_of_the_users_choice():
    """Regression with a per-example squared error: ghost and vmap give the same clipped sum (the
    engines hand the noise its tensors in different orders, so the sums are compared before it)."""
    X = torch.randn(120, 5, generator=torch.Generator().manual_seed(1))
    y = X.sum(1, keepdim=True)

    def sq(out, target):
        return ((out - target) ** 2).sum(1)

    sums = []
    for mode in ("ghost", "vmap"):
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(5, 8), nn.Tanh(), nn.Linear(8, 1))
        t = dpsgd.PrivateTrainer(
            model, (X, y), lot_size=30, sigma=1.0, loss=sq, mode=mode, seed=3, threads=False
        )
        sums.append(t.clipper.clipped_sum(X[:30], y[:30]).grads)
    for n in sums[0]:
        torch.testing.assert_close(sums[0][n], sums[1][n], rtol=1e-5, atol=1e-6)


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


# ------------------------------------------------------------ one validation, two callers
# Each case: the API's arguments, and the command line's overrides of the same values (N = 400 on
# both sides: dataset.subset=400). The API refuses with the command line's own line, naming the
# argument as the API spells it.
REFUSED = [
    ({"clip_norm": math.inf}, ["privacy.clip_norm=inf"]),
    ({"lr": math.nan}, ["training.lr=nan"]),
    ({"sigma": 0.0}, ["privacy.sigma=0"]),
    ({"sigma": 0.0, "target_epsilon": 1.0}, ["privacy.sigma=0", "privacy.target_epsilon=1"]),
    (
        {"private": False, "target_epsilon": 1.0},
        ["privacy.private=false", "privacy.target_epsilon=1"],
    ),
    ({"delta": 0.01}, ["privacy.delta=0.01"]),
    ({"lot_size": 500}, ["privacy.lot_size=500"]),
    ({"momentum": 1.0}, ["training.momentum=1"]),
    (
        {"sampling": "balls_in_bins", "accountant": "moments"},
        ["privacy.sampling=balls_in_bins", "accountant.name=moments"],
    ),
    ({"seed": 3, "secure_rng": True}, ["privacy.noise_seed=3", "privacy.secure_rng=true"]),
    ({"sigma": 1e-6}, ["privacy.sigma=1e-6"]),
]


@pytest.mark.parametrize("kw, overrides", REFUSED, ids=lambda v: str(v)[:40])
def test_the_api_refuses_what_the_command_line_refuses_in_its_words(kw, overrides):
    from dpsgd.config.arguments import api_message
    from dpsgd.config.schema import ConfigError, validate
    from dpsgd.launch.main import compose

    with pytest.raises(ConfigError) as cli:
        base = ["dataset.subset=400", "model.projection=none", "privacy.lot_size=40"]
        mine = {o.split("=")[0] for o in overrides}
        validate(compose([b for b in base if b.split("=")[0] not in mine] + overrides))
    with pytest.raises(ValueError) as api:
        _trainer(**kw)
    assert str(api.value) == api_message(str(cli.value)) and "\n" not in str(api.value)
    assert "privacy." not in str(api.value) and "training." not in str(api.value)


def test_a_target_epsilon_without_a_charge_never_runs():
    """target_epsilon with σ = 0 or private=False ran to epochs_completed with ε = ∞."""
    for kw in ({"sigma": 0.0}, {"private": False}):
        with pytest.raises(ValueError, match=r"(sigma=0.0|target_epsilon=1.0): "):
            _trainer(target_epsilon=1.0, **kw)


# ---------------------------------------------------------------- load_state_dict
def _fitted(**kw) -> dpsgd.PrivateTrainer:
    t = _trainer(**kw)
    t.fit(1)
    return t


def _same(a: dict, b: dict) -> bool:
    """Two state_dicts equal, tensor by tensor (generators and momentum included)."""
    if a.keys() != b.keys():
        return False
    for k in a:
        x, y = a[k], b[k]
        if isinstance(x, dict):
            if not _same(x, y):
                return False
        elif isinstance(x, torch.Tensor):
            if not (isinstance(y, torch.Tensor) and torch.equal(x, y)):
                return False
        elif x != y:
            return False
    return True


def _uncharged(state: dict, why: str) -> dict:
    """``state`` as one whose lots were not charged: made by a trainer at σ = 0 (which the API now
    refuses; written by hand, as an older version wrote it), or with its ledger cut short."""
    state = copy.deepcopy(state)
    if why == "sigma=0":
        state["record"]["sigma"], state["ledger"]["entries"] = 0.0, []
    elif why == "no record":
        del state["record"]
        state["ledger"]["entries"] = []
    else:  # a ledger short of its steps
        state["ledger"]["entries"][0]["count"] = 3
    return state


@pytest.mark.parametrize("why", ["private=False", "sigma=0", "no record", "short ledger"])
def test_a_state_whose_lots_were_not_charged_is_refused_by_a_private_trainer(why):
    """Loaded, a private trainer claimed (4.177, 1e-5)-DP for 40 lots, 30 of them unnoised."""
    if why == "private=False":
        state = _fitted(private=False, momentum=0.5).state_dict()
    else:
        state = _uncharged(_fitted(momentum=0.5).state_dict(), why)
    t = _fitted(momentum=0.5)
    before = t.state_dict()
    with pytest.raises(ValueError, match=r"^load_state_dict: the state's (10 lot|ledger holds)"):
        t.load_state_dict(state)
    assert _same(t.state_dict(), before) and t.steps == 10  # nothing loaded


def _refused_states():
    base = _fitted(momentum=0.5)
    yield "sampler", _fitted(sampling="shuffle", momentum=0.5).state_dict()
    yield "lot size", _fitted(lot_size=50, momentum=0.5).state_dict()
    yield "secure rng", _fitted(secure_rng=True, seed=None, momentum=0.5).state_dict()
    other = dpsgd.PrivateTrainer(SmallCNN(classes=12), _data(), lot_size=40, sigma=1.5, seed=0,
                                 threads=False, momentum=0.5)  # fmt: skip
    other.fit(1)
    yield "model shape", other.state_dict()
    s = base.state_dict()
    s["record"]["data_sha256"] = "0" * 64
    yield "data", s
    s = base.state_dict()
    s["sampler"]["generator"] = torch.zeros(3, dtype=torch.uint8)
    yield "generator", s


def test_a_refused_state_loads_nothing():
    """The model (and momentum) were loaded before the sampler, lot size, secure-RNG or shape
    checks failed: a caller who caught the error trained on from uncounted lots."""
    for what, state in _refused_states():
        t = _fitted(momentum=0.5, seed=1)
        before = t.state_dict()
        with pytest.raises(ValueError, match=r"^load_state_dict: .*; nothing was loaded$"):
            t.load_state_dict(state)
        assert _same(t.state_dict(), before), what


def test_what_may_change_on_load_loads_and_the_rest_is_named():
    saved = _fitted().state_dict()
    t = _trainer(lr=0.05, epochs=3, target_epsilon=50.0)  # MAY_CHANGE: the length, the update
    t.load_state_dict(saved)
    assert t.steps == 10 and t.ledger.to_dict() == saved["ledger"]
    with pytest.raises(ValueError, match=r"clip_norm=2.0 differs from the state's clip_norm=1.0"):
        _trainer(clip_norm=2.0).load_state_dict(saved)
