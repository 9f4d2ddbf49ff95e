"""Momentum, ScatterNet features and models, σ calibration, the frontier recipes and runner.

Momentum 0 is the plain DP-SGD step bit for bit, momentum follows a hand-written heavy-ball
reference, and a resumed run with momentum ends where the uninterrupted one does. The scattering
features have the published shape, their cache is keyed and hash-checked (a corrupt or mismatched
file is recomputed). The ScatterNet models' ghost norms equal the vmap reference in float64. Each
recipe runs end to end on a small subset; the runner's plan/collect and the figure/table rendering
run on fake runs and a fixture.
"""

import csv
import json
import os
import subprocess
import sys
from pathlib import Path

import pandas as pd
import pytest
import torch
from torch import nn

from dpsgd.data import features
from dpsgd.accountant.calibrate import epsilon as calibrated_epsilon
from dpsgd.run.checkpoint import load_checkpoint
from dpsgd.mechanism.clipping import PerExampleClipper
from dpsgd.config.schema import ConfigError, validate
from dpsgd.launch.main import compose
from dpsgd.models.networks import MLP, Linear, ScatterCNN
from dpsgd.mechanism.noise import GaussianNoise
from dpsgd.mechanism.optim import DPSGD
from dpsgd.mechanism.plan import Plan
from dpsgd.train import train
from tolerances import assert_f64_close, chain_rel_tol, f64_rtol

REPO = Path(__file__).resolve().parents[2]
FIXTURES = Path(__file__).resolve().parents[1] / "fixtures"
DT = torch.float64


def _cfg(*overrides):
    return validate(compose(list(overrides)))


def _dp(model, momentum, seed=0, lr=0.5):
    clipper = PerExampleClipper(model, 1.0, "per_layer", mode="ghost")
    return DPSGD(
        model,
        clipper,
        GaussianNoise(seed=seed),
        Plan.by_hand(1.0, 1.0, 8),
        lr=lr,
        momentum=momentum,
    )


def _batches(n=4, seed=1):
    g = torch.Generator().manual_seed(seed)
    return [
        (torch.randn(8, 6, generator=g), torch.randint(0, 3, (8,), generator=g)) for _ in range(n)
    ]


# --- momentum -------------------------------------------------------------------------------------


def test_momentum_zero_is_the_plain_step_bit_for_bit():
    torch.manual_seed(0)
    a = MLP(6, (5,), 3, bias=True)
    b = MLP(6, (5,), 3, bias=True)
    b.load_state_dict(a.state_dict())
    dp_a, dp_b = _dp(a, 0.0), _dp(b, 0.0)
    for x, y in _batches():
        dp_a.step(x, y)
        total, _, _ = dp_b._noisy_sum(x, y, None)  # the plain update, written out
        with torch.no_grad():
            for n, p in dp_b.params.items():
                p.add_(total[n], alpha=-dp_b.lr / dp_b.L)
    for (n, p), q in zip(a.named_parameters(), b.parameters()):
        assert torch.equal(p, q), n
    assert dp_a.velocity == {}


def test_momentum_follows_the_heavy_ball_reference():
    mu, lr = 0.9, 0.5
    torch.manual_seed(0)
    a = MLP(6, (5,), 3, bias=True).to(DT)
    b = MLP(6, (5,), 3, bias=True).to(DT)
    b.load_state_dict(a.state_dict())
    dp_a, dp_b = _dp(a, mu, lr=lr), _dp(b, 0.0, lr=lr)
    v = {}
    for x, y in _batches(5):
        x = x.to(DT)
        dp_a.step(x, y)
        g, _, _ = dp_b.noisy_gradient(x, y)  # the same noisy gradient g̃_t (same noise seed)
        with torch.no_grad():  # v ← μ v + g̃ (v_1 = g̃_1); θ ← θ − η v
            for n, p in dp_b.params.items():
                v[n] = g[n].clone() if n not in v else mu * v[n] + g[n]
                p -= lr * v[n]
    # the same noisy gradients; 5 steps of v ← μv + g̃, θ ← θ − ηv replayed by hand: a few float64
    # operations per step, relative to the scale of each tensor
    rtol = chain_rel_tol(4 * 5)
    for (n, p), q in zip(a.named_parameters(), b.parameters()):
        assert_f64_close(p, q, rtol)
    for n in v:
        assert_f64_close(dp_a.velocity[n], v[n], rtol)


def test_momentum_state_round_trips():
    torch.manual_seed(0)
    dp = _dp(MLP(6, (5,), 3), 0.5)
    for x, y in _batches(2):
        dp.step(x, y)
    other = _dp(MLP(6, (5,), 3), 0.5)
    other.load_state_dict(dp.state_dict())
    assert all(torch.equal(other.velocity[n], dp.velocity[n]) for n in dp.velocity)
    with pytest.raises(ValueError, match="momentum"):
        _dp(MLP(6, (5,), 3), 1.0)


def test_resume_with_momentum_equals_the_uninterrupted_run(tmp_path):
    args = [
        "dataset.subset=1000",
        "privacy.lot_size=100",
        "model.hidden=[50]",
        "privacy.sigma=2",
        "training.momentum=0.9",
        "training.lr=0.05",
        "device=cpu",
        "seed=1",
    ]
    env = dict(os.environ, PYTHONPATH=str(REPO))

    def run(*extra):
        r = subprocess.run(
            [sys.executable, "-m", "dpsgd.train", *extra],
            cwd=tmp_path,
            env=env,
            capture_output=True,
            text=True,
            timeout=300,
        )
        assert r.returncode == 0, r.stderr[-2000:]

    run(*args, "training.epochs=2", f"hydra.run.dir={tmp_path / 'full'}")
    run(*args, "training.epochs=1", f"hydra.run.dir={tmp_path / 'half'}")
    half = load_checkpoint(tmp_path / "half")
    assert half["optimizer"]["momentum"] == 0.9 and half["optimizer"]["velocity"]
    run(f"resume={tmp_path / 'half'}", "training.epochs=2")
    full, resumed = load_checkpoint(tmp_path / "full"), load_checkpoint(tmp_path / "half")
    assert resumed["epoch"] == full["epoch"] == 2
    for n in full["model"]:
        assert torch.equal(full["model"][n], resumed["model"][n]), n
    for n in full["optimizer"]["velocity"]:
        assert torch.equal(full["optimizer"]["velocity"][n], resumed["optimizer"]["velocity"][n]), n


# --- ScatterNet features --------------------------------------------------------------------------


def _images(n=6, seed=0):
    return torch.rand(n, 784, generator=torch.Generator().manual_seed(seed))


def test_scattering_has_81_channels_of_7x7_and_groupnorm_is_torchs():
    F = features.scatter(_images(3))
    assert F.shape == (3, 81, 7, 7) and features.scatter_channels() == 81
    assert features.feature_shape("scatter", (784,)) == (81, 7, 7)
    ref = nn.GroupNorm(27, 81, affine=False)(F)
    torch.testing.assert_close(features.group_norm(F, 27), ref)
    # per example: one example's features do not depend on the others in the batch
    torch.testing.assert_close(features.scatter(_images(3)[1:2]), F[1:2], rtol=1e-5, atol=1e-6)


def test_feature_cache_is_keyed_and_hash_checked(tmp_path, monkeypatch, capsys):
    X = _images(5)
    calls = []
    real = features.scatter
    monkeypatch.setattr(features, "scatter", lambda X: calls.append(len(X)) or real(X))
    F = features.cached_scatter(X, "mnist", "train", tmp_path)
    assert calls == [5]
    (path,) = (tmp_path / "features").glob("*.pt")
    assert torch.equal(features.cached_scatter(X, "mnist", "train", tmp_path), F) and calls == [5]
    data = bytearray(path.read_bytes())  # corrupt one byte: recomputed, not trusted
    data[-100] ^= 0xFF
    path.write_bytes(bytes(data))
    assert torch.equal(features.cached_scatter(X, "mnist", "train", tmp_path), F) and calls == [
        5,
        5,
    ]
    assert "recomputing" in capsys.readouterr().out
    state = torch.load(path, weights_only=True)  # another transform's key: recomputed
    state["key"] = dict(state["key"], J=3)
    torch.save(state, path)
    features.cached_scatter(X, "mnist", "train", tmp_path)
    assert calls == [5, 5, 5]
    key = features.cache_key("mnist", "train", 5)
    assert (
        key["J"] == 2
        and key["L"] == 8
        and key["kymatio"]
        and "raw/train-images-idx3-ubyte.gz" in key["archives_md5"]
    )


@pytest.mark.parametrize("fails", ["write", "fsync", "replace"])
def test_a_feature_cache_write_failing_part_way_leaves_nothing_behind(
    fails, tmp_path, monkeypatch, capsys
):
    """The disk fills (or the rename fails) while the cache is written: the features are still
    returned, a note says the cache was not written, and no temporary file (nor a partial cache) is
    left."""
    import errno
    import io as _io
    import os

    X = _images(3)
    full = OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
    if fails == "write":
        real_open = open

        class Full(_io.FileIO):
            def write(self, b):
                super().write(b[: len(b) // 2])  # half of it reached the disk
                raise full

        monkeypatch.setattr(
            "builtins.open",
            lambda f, mode="r", *a, **k: (
                Full(f, "wb") if mode == "wb" else real_open(f, mode, *a, **k)
            ),
        )
    else:
        monkeypatch.setattr(os, fails, lambda *a, **k: (_ for _ in ()).throw(full))
    F = features.cached_scatter(X, "mnist", "train", tmp_path)
    monkeypatch.undo()
    assert F.shape == (3, 81, 7, 7) and "features: cannot cache to " in capsys.readouterr().out
    assert [p.name for p in (tmp_path / "features").iterdir()] == []


# --- models: ghost = vmap -------------------------------------------------------------------------


@pytest.mark.parametrize(
    "model_fn",
    [lambda: Linear(81 * 49, 10), lambda: ScatterCNN(81 * 49, 10)],
    ids=["linear", "scatter_cnn"],
)
@pytest.mark.parametrize("clipping", ["global", "per_layer"])
def test_scatter_models_ghost_equals_vmap(model_fn, clipping):
    torch.manual_seed(0)
    model = model_fn().to(DT)
    x, y = torch.randn(7, 81, 7, 7, dtype=DT), torch.randint(0, 10, (7,))
    g = PerExampleClipper(model, 0.05, clipping, mode="ghost")
    v = PerExampleClipper(model, 0.05, clipping, mode="vmap")
    rg, rv = g.clipped_sum(x, y), v.clipped_sum(x, y)
    assert g.mode == "ghost"
    rtol = f64_rtol(model)  # two kernels, float64 (tests/tolerances.py)
    for n in rv.grads:
        assert_f64_close(rg.grads[n], rv.grads[n], rtol)
    assert_f64_close(rg.norms, rv.norms, rtol)


# --- config: features, momentum, σ calibration ----------------------------------------------------


@pytest.mark.parametrize(
    "override, key",
    [
        ("training.momentum=1.0", "training.momentum"),
        ("training.momentum=-0.1", "training.momentum"),
        ("model.feature_groups=4", "model.feature_groups"),
        ("model.features=wavelets", "model.features"),
        ("model.projection=pca", "model.projection"),
    ],
)
def test_bad_frontier_values_are_refused_naming_the_key(override, key):
    with pytest.raises(ConfigError) as e:
        _cfg("experiment=mnist_scatter_linear", "model.pca_dims=60", override)
    assert str(e.value).startswith(key) and "\n" not in str(e.value)


@pytest.mark.parametrize(
    "extra",
    [
        ["privacy.target_epsilon=null"],
        ["privacy.sampling=shuffle"],
        ["model.features=none", "model.projection=pca", "model.pca_dims=60"],
    ],
)
def test_calibrate_sigma_refuses_what_it_cannot_calibrate(extra):
    with pytest.raises(ConfigError, match=r"^privacy.calibrate_sigma=true: "):
        _cfg("experiment=mnist_scatter_linear", *extra)


@pytest.mark.parametrize("eps", [1.2, 2.0])
def test_calibrated_sigma_spends_the_target_over_the_planned_epochs(eps):
    c = _cfg("experiment=mnist_scatter_linear", f"privacy.target_epsilon={eps}")
    lots = c.training.epochs * round(60000 / 4096)
    spent = calibrated_epsilon(4096 / 60000, c.privacy.sigma, lots, 1e-5, "pld", 1, "joint")
    assert 0.99 * eps <= spent <= eps  # never above; within the 0.5 % bisection rtol
    assert (
        c.privacy.clipping == "global"
        and c.training.momentum == 0.9
        and c.model.features == "scatter"
    )


# --- recipes end to end on a small subset ---------------------------------------------------------


@pytest.mark.parametrize(
    "recipe, extra",
    [
        ("mnist_scatter_linear", []),
        ("mnist_scatter_cnn", []),
        pytest.param(
            "fmnist_scatter_linear", [], marks=pytest.mark.slow
        ),  # first use: F-MNIST test features
        (
            "mnist_paper_tight",
            [
                "model.hidden=[100]",
                "privacy.lot_size=60",
                "privacy.sigma=2.0",
                "privacy.sigma_p=4.0",
                "training.epochs=5",
            ],
        ),  # stopped by the ε = 2 budget
    ],
)
def test_each_recipe_runs_end_to_end_on_a_subset(tmp_path, recipe, extra):
    c = _cfg(
        f"experiment={recipe}",
        "dataset.subset=1200",
        "privacy.lot_size=300",
        "training.epochs=2",
        "device=cpu",
        *extra,
    )
    st = train(c, tmp_path / "run")
    assert st["status"] == "complete" and st["epsilon"] <= c.privacy.target_epsilon
    assert st["epsilon_by_accountant"]["pld"]["joint"] <= c.privacy.target_epsilon
    with open(tmp_path / "run" / "metrics.csv") as f:
        rows = list(csv.DictReader(f))
    assert float(rows[-1]["test_accuracy"]) > 0.3  # chance is 0.1
    if c.privacy.calibrate_sigma:
        assert st["stop_reason"] == "epochs_completed" and st["steps"] == 2 * 4
    else:
        assert st["stop_reason"] == "target_epsilon_reached" and c.accountant.name == "pld"


# --- the runner, the figure, the table ------------------------------------------------------------


@pytest.mark.slow  # ~12 s: calibrates σ for every recipe and ε of the plan
def test_frontier_plan_covers_recipes_eps_seeds_and_prints_the_time(capsys):
    from experiments import frontier

    jobs = frontier.plan(frontier.RECIPES, frontier.EPSILONS, frontier.SEEDS)
    assert (
        len(jobs)
        == sum(len(frontier.RECIPE_EPSILONS.get(r, frontier.EPSILONS)) for r in frontier.RECIPES)
        * 3
    )
    assert {j["eps"] for j in jobs if j["recipe"] == "mnist_scatter_linear_val"} == {1.2}
    assert frontier.EPSILONS == (0.5, 1.0, 1.2, 2.0, 3.0, 8.0)
    j = next(j for j in jobs if j["name"] == "mnist_paper_tight/eps0.5_seed1")
    assert "privacy.sigma=8.0" in j["cmd"] and "seed=1" in j["cmd"] and 0 < j["epochs"] < 2000
    assert (
        frontier.main(
            ["--dry-run", "--recipes", "mnist_scatter_linear", "--eps", "2", "--seeds", "0"]
        )
        == 0
    )
    out = capsys.readouterr().out
    assert out.startswith("plan: 1 runs") and "expected wall time" in out


def _fake_run(results, recipe, eps, seed, acc, dataset="mnist"):
    d = results / "runs" / "frontier" / recipe / f"eps{eps:g}_seed{seed}"
    d.mkdir(parents=True)
    (d / "privacy.json").write_text(
        json.dumps(
            {
                "status": "complete",
                "epochs": 40,
                "steps": 600,
                "epsilon_by_accountant": {"pld": {"joint": eps * 0.998}},
            }
        )
    )
    (d / "metrics.csv").write_text(
        "epoch,test_accuracy,sigma,wall_time_s,epoch_time_s\n"
        f"1,0.5,3.0,2.0,2.0\n40,{acc},3.0,80.0,2.0\n"
    )
    (d / "config.yaml").write_text(f"dataset:\n  name: {dataset}\nprivacy:\n  sigma: 3.0\n")


def test_frontier_collect_makes_one_row_per_run(tmp_path):
    from experiments import frontier

    res = tmp_path / "results"
    _fake_run(res, "mnist_scatter_linear", 2.0, 0, 0.985)
    _fake_run(res, "mnist_scatter_linear", 2.0, 1, 0.987)
    _fake_run(res, "fmnist_scatter_linear", 3.0, 0, 0.897, "fashion_mnist")
    (
        res / "runs" / "frontier" / "mnist_scatter_linear" / "eps1.2_seed0"
    ).mkdir()  # unfinished: skipped
    rows = frontier.collect(res)
    assert [(r["recipe"], r["epsilon_target"], r["seed"]) for r in rows] == [
        ("mnist_scatter_linear", 2.0, 0),
        ("mnist_scatter_linear", 2.0, 1),
        ("fmnist_scatter_linear", 3.0, 0),
    ]
    r = rows[0]
    # values copied from the fixture CSV (exact, decimal round trip); ε via pytest's default
    # rel 1e-6
    assert (
        r["test_accuracy"] == 0.985
        and r["epsilon_pld_joint"] == pytest.approx(1.996)
        and r["wall_time_s"] == 80.0
    )
    assert r["run"] == "runs/frontier/mnist_scatter_linear/eps2_seed0" and r["dataset"] == "mnist"
    assert (
        r["command"]
        == "python -m dpsgd.train experiment=mnist_scatter_linear privacy.target_epsilon=2 seed=0"
    )
    frontier.write_csv(rows, res / "frontier.csv")
    assert list(pd.read_csv(res / "frontier.csv").columns) == frontier.COLUMNS
    assert (
        frontier.measured_sec_per_epoch(res, "mnist_scatter_linear") == 2.0
    )  # exact: a median of copied values


def test_frontier_table_and_figure_from_the_fixture(tmp_path):
    from experiments import frontier_figure

    df = pd.read_csv(FIXTURES / "frontier.csv")
    lines = frontier_figure.table_rows(df)
    row = next(l for l in lines if l.startswith("| `mnist_scatter_linear` | MNIST | 2 |"))
    assert "98.60 ± 0.14 % (2)" in row and "98.5 % (Tramèr & Boneh 2021)" in row
    assert (
        "`python -m dpsgd.train experiment=mnist_scatter_linear privacy.target_epsilon=2 "
        "seed=S`, S = 0, 1 |" in row
    )
    one = next(l for l in lines if l.startswith("| `mnist_paper_tight` | MNIST | 2 |"))
    assert "95.10 ± 0.00 % (1)" in one and "95.0 % (Abadi et al. 2016, §5.2)" in one
    assert any("Papernot & Steinke 2022" in l for l in lines)
    paths = frontier_figure.draw(df, tmp_path)
    assert [p.name for p in paths] == ["frontier.png", "frontier.pdf"] and all(
        p.stat().st_size > 1000 for p in paths
    )
    s = frontier_figure.summarise(df)
    # a mean of a few decimal fixture values: pytest's default rel 1e-6, far above its round-off
    assert float(
        s[(s.recipe == "mnist_scatter_linear") & (s.epsilon_target == 1.2)]["mean"].iloc[0]
    ) == pytest.approx(98.2)


def test_a_version_2_checkpoint_without_optimizer_state_is_refused_in_one_line(
    tmp_path, monkeypatch
):
    from dpsgd.run import checkpoint

    monkeypatch.setattr(checkpoint, "FORMAT_VERSION", 2)
    checkpoint.save_checkpoint(tmp_path, {"epoch": 1})
    monkeypatch.undo()
    with pytest.raises(
        checkpoint.CheckpointError,
        match=f"format version 2, this dpsgd reads versions .*{checkpoint.FORMAT_VERSION}",
    ) as e:
        load_checkpoint(tmp_path)
    assert "\n" not in str(e.value)


def test_validation_split_holds_out_training_examples_never_the_test_set(tmp_path):
    c = _cfg(
        "experiment=mnist_scatter_linear",
        "dataset.subset=1500",
        "dataset.validation=300",
        "privacy.lot_size=300",
        "training.epochs=1",
        "device=cpu",
    )
    assert c.N == 1200 and c.dataset.validation == 300
    from dpsgd.run.opening import setup

    (tmp_path / "run").mkdir()
    run = setup(c, tmp_path / "run", [])
    Xtr, ytr, Xval, yval = run.parts.data
    assert len(Xtr) == 1200 and len(Xval) == 300 and run.parts.sampler.q == 300 / 1200
    from dpsgd.data.readers import load_dataset

    _, y_all, _, _ = load_dataset("mnist", None, 1500, None)
    assert torch.equal(yval.cpu(), y_all[1200:]) and torch.equal(ytr.cpu(), y_all[:1200])
    with pytest.raises(ConfigError, match=r"^dataset.validation=1500: must be <= 1499"):
        _cfg("dataset.subset=1500", "dataset.validation=1500")
