"""Training end to end (Algorithm 1 on real MNIST), outputs, budget stop, shuffle accounting,
Hydra."""

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest

from conftest import metrics_rows
from dpsgd.config.schema import validate
from dpsgd.launch.main import compose
from dpsgd.run.report import COLUMNS
from dpsgd.run.state import derive_seed
from dpsgd.train import lr_at, train

REPO = Path(__file__).resolve().parents[2]
TINY = [
    "dataset.subset=3000",
    "privacy.lot_size=150",
    "privacy.physical_batch_size=150",
    "model.hidden=[200]",
    "device=cpu",
]


def _cfg(*overrides):
    return validate(compose(list(overrides)))


def test_lr_schedule_is_the_papers():
    t = _cfg().training
    # decimal schedule values through a few float64 ops: pytest's default rel 1e-6
    assert lr_at(t, 0) == pytest.approx(0.1)
    assert lr_at(t, 9) == pytest.approx(0.052)
    assert lr_at(t, 10) == lr_at(t, 500) == pytest.approx(0.052)
    assert lr_at(t, 3) == pytest.approx(0.1 - 0.048 * 3 / 9)


def test_seed_streams_are_distinct():
    seeds = {derive_seed(0, s) for s in ("pca", "model", "sampler", "noise")}
    assert len(seeds) == 4 and derive_seed(1, "pca") != derive_seed(0, "pca")


def test_short_mnist_run_far_above_chance(tmp_path):
    # 5 000 real MNIST images, DP-PCA to 60 dims, 1000 hidden units, per-layer clipping, σ = 1:
    # 10 epochs × 20 lots = 200 steps.
    c = _cfg(
        "dataset.subset=5000",
        "privacy.lot_size=250",
        "privacy.sigma=1.0",
        "privacy.sigma_p=4",
        "training.epochs=10",
        "device=cpu",
    )
    st = train(c, tmp_path / "run")
    rows = metrics_rows(tmp_path / "run")
    assert [r["epoch"] for r in rows] == [str(i) for i in range(1, 11)]
    assert set(COLUMNS) <= set(rows[0])
    last = rows[-1]
    assert int(last["steps"]) == 200
    assert float(last["test_accuracy"]) > 0.75  # chance is 0.10
    assert float(last["train_accuracy"]) > 0.75
    eps = [float(r["epsilon"]) for r in rows]
    assert all(a < b for a, b in zip(eps, eps[1:]))  # ε grows every epoch
    for r in rows:  # configured = joint here; pld ≤ moments
        assert float(r["epsilon_moments"]) == float(
            r["epsilon_moments_joint"]
        )  # exact: the same value, written twice
        assert float(r["epsilon_pld"]) <= float(
            r["epsilon_moments"]
        )  # PLD tighter by far more than round-off
    assert last["convention"] == "joint" and float(last["epsilon"]) == pytest.approx(
        float(last["epsilon_moments_joint"])
    )
    # q = L/N through the CSV's decimal round trip: pytest's default rel 1e-6
    assert float(last["q"]) == pytest.approx(250 / 5000) and last["sampling"] == "poisson"
    js = json.loads((tmp_path / "run" / "privacy.json").read_text())
    assert js["status"] == "complete" and js["stop_reason"] == "epochs_completed"
    assert js["steps"] == 200 and js["epochs"] == 10 and js["delta"] == 1e-5
    # the same ε written to two files (JSON, CSV): decimal round trips, default rel 1e-6
    assert js["epsilon"] == pytest.approx(eps[-1])
    by = js["epsilon_by_accountant"]  # k = 2 groups: per-tensor under-states ε
    assert (
        by["moments"]["per_tensor"] < by["moments"]["joint"]
        and by["pld"]["per_tensor"] < by["pld"]["joint"]
    )
    assert js["sampling"]["amplification_by_sampling"] is True
    labels = json.dumps(js["ledger"])
    assert "pca" in labels and "sgd" in labels
    assert st["status"] == "complete"


def test_budget_stop_before_the_lot_that_would_exceed_the_target(tmp_path):
    from dpsgd.accountant import Ledger
    from dpsgd.accountant.events import Poisson

    target = 1.2
    c = _cfg(
        *TINY,
        "privacy.sigma=1.5",
        f"privacy.target_epsilon={target}",
        "training.epochs=500",
        "privacy.convention=per_tensor",
    )
    st = train(c, tmp_path / "run")
    assert st["stop_reason"] == "target_epsilon_reached"
    rows = metrics_rows(tmp_path / "run")
    assert max(float(r["epsilon"]) for r in rows) <= target
    assert st["epsilon"] <= target
    # one more lot would have exceeded it
    led = Ledger.from_dict(st["ledger"])
    led.record(Poisson(150 / 3000, 1.5, 2), 1, "sgd")
    assert led.epsilon(1e-5, accountant="moments", convention="per_tensor")[0] > target


def test_shuffle_is_charged_once_per_epoch_without_amplification(tmp_path):
    from dpsgd.accountant import Ledger
    from dpsgd.accountant.events import Gaussian

    c = _cfg(
        *TINY,
        "privacy.sampling=shuffle",
        "model.projection=random",
        "training.epochs=3",
        "privacy.clipping=global",
    )
    st = train(c, tmp_path / "run")
    rows = metrics_rows(tmp_path / "run")
    assert int(rows[-1]["steps"]) == 3 * (3000 // 150) and float(rows[-1]["q"]) == 1.0
    ref = Ledger()
    ref.record(Gaussian(c.privacy.sigma / 2), 3, "sgd")
    assert st["epsilon"] == pytest.approx(
        ref.epsilon(1e-5, accountant="moments", convention="joint")[0]
    )
    assert (
        "substitution" in st["sampling"]["adjacency"]
        and st["sampling"]["amplification_by_sampling"] is False
    )


def test_nonprivate_run_states_not_private(tmp_path):
    c = _cfg(*TINY, "experiment=mnist_nonprivate", "training.epochs=1")
    st = train(c, tmp_path / "run")
    assert st["private"] is False and "NOT PRIVATE" in st["statement"]
    assert math.isinf(float(metrics_rows(tmp_path / "run")[-1]["epsilon"]))


def _cli(args, cwd, timeout=300):
    env = dict(os.environ, PYTHONPATH=str(REPO))
    return subprocess.run(
        [sys.executable, "-m", "dpsgd.train", *args],
        cwd=cwd,
        env=env,
        capture_output=True,
        text=True,
        timeout=timeout,
    )


def test_hydra_run_and_multirun_dirs_never_collide(tmp_path):
    r = _cli([*TINY, "training.max_steps=2", "training.epochs=1"], tmp_path)
    assert r.returncode == 0, r.stderr
    runs = list((tmp_path / "outputs" / "run").glob("*/*"))
    assert len(runs) == 1 and runs[0].name.endswith("_seed0")
    assert {p.name for p in runs[0].iterdir()} >= {
        ".hydra",
        "metrics.csv",
        "privacy.json",
        "checkpoint.pt",
    }
    assert "results:" in r.stdout and "metrics.csv" in r.stdout
    # a versioned sweep file (conf/sweep/<name>.yaml form), found through an extra config dir
    extra = tmp_path / "extra_conf" / "sweep"
    extra.mkdir(parents=True)
    (extra / "tiny.yaml").write_text(
        "# @package _global_\ntraining:\n  max_steps: 2\n"
        "hydra:\n  sweeper:\n    params:\n      seed: 0,1\n"
    )
    r = _cli(
        ["-m", "-cd", str(tmp_path / "extra_conf"), "+sweep=tiny", *TINY, "training.epochs=1"],
        tmp_path,
    )
    assert r.returncode == 0, r.stderr
    jobs = sorted((tmp_path / "multirun" / "run").glob("*/*/*"))
    jobs = [j for j in jobs if j.is_dir()]
    assert len(jobs) == 2 and jobs[0] != jobs[1]
    assert all((j / "metrics.csv").is_file() for j in jobs)


def test_multirun_refusal_leaves_no_job_dir(tmp_path):
    r = _cli(["-m", *TINY, "privacy.sigma=-1"], tmp_path)
    assert r.returncode == 2 and "error: privacy.sigma=-1.0: must be >= 0" in r.stderr
    assert not any(p.is_file() for p in tmp_path.rglob("*"))


def test_a_joblib_sweep_ends_with_its_table_and_report_reproduces_it(tmp_path):
    sweep = tmp_path / "sweep"
    joblib = ["hydra/launcher=joblib", "hydra.launcher.n_jobs=2", f"hydra.sweep.dir={sweep}"]
    args = ["-m", *TINY, "training.max_steps=2", "training.epochs=1", "seed=0,1,2", *joblib]
    r = _cli(args, tmp_path)
    assert r.returncode == 0, r.stderr
    table = r.stdout[r.stdout.index("sweep: 3 run(s) in ") :].split("\n", 1)[1]
    assert len(table.strip().splitlines()) == 4  # the header and one row per job
    again = subprocess.run([sys.executable, "-m", "dpsgd.report", str(sweep)], cwd=tmp_path,
                           env=dict(os.environ, PYTHONPATH=str(REPO)), capture_output=True,
                           text=True, check=True)  # fmt: skip
    assert again.stdout == table
