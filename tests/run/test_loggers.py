"""Loggers (``logger=csv|tensorboard|wandb``, dpsgd/core/loggers.py): each epoch's metrics.csv row,
sent on with the epoch as the step, into the run folder; a missing package refused in one line.

tensorboard is a test dependency (requirements-test.txt): its own ``EventAccumulator`` reads the
event file back. wandb is not installed: a fake module records what the logger calls."""

from __future__ import annotations

import csv
import math
import os
import subprocess
import sys
import types

import pytest

from conftest import TINY_RUN, metrics_rows, train_env
from dpsgd.config.fingerprint import config_fingerprint
from dpsgd.config.schema import ConfigError, validate
from dpsgd.launch.main import compose
from dpsgd.train import train


def _cfg(*overrides):
    return validate(compose([*TINY_RUN, "training.epochs=3", *overrides]))


def _numeric(rows: list[dict]) -> list[str]:
    """The metrics.csv columns whose values are numbers (the text ones: sampling, clipping, ...)."""

    def number(v: str) -> bool:
        try:
            float(v)
            return True
        except ValueError:
            return False

    return [k for k in rows[0] if all(number(r[k]) for r in rows)]


def test_tensorboard_gets_every_numeric_metrics_column_once_per_epoch(tmp_path):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    run = tmp_path / "run"
    train(_cfg("logger=tensorboard"), run)
    rows = metrics_rows(run)
    ea = EventAccumulator(str(run / "tb"))
    ea.Reload()
    columns = _numeric(rows)
    assert {"epsilon", "epsilon_pld", "test_accuracy", "lot_loss", "lr", "steps"} <= set(columns)
    assert set(ea.Tags()["scalars"]) == set(columns)
    for k in columns:
        got = ea.Scalars(k)
        assert [e.step for e in got] == [1, 2, 3]
        for e, r in zip(got, rows):  # float32 in the event file: its resolution, NaN as NaN
            want = float(r[k])
            assert math.isnan(e.value) if math.isnan(want) else e.value == pytest.approx(want)


def test_logger_none_is_the_default_and_not_in_the_fingerprint():
    c, tb = _cfg(), _cfg("logger=tensorboard")
    assert c.logger.name == "none" and tb.logger.name == "tensorboard"
    # privacy.json holds the fingerprint: a logger changes no lot, and no preset's statement
    assert config_fingerprint(c) == config_fingerprint(tb)


def test_csv_logger_writes_log_csv_with_the_metrics_rows(tmp_path):
    run = tmp_path / "run"
    train(_cfg("logger=csv"), run)
    metrics = (run / "metrics.csv").read_text().splitlines()
    logged = (run / "log.csv").read_text().splitlines()
    assert len(logged) == 4 and logged[0] == metrics[0]
    drop = {"epoch_time_s", "wall_time_s"}  # the same rows (timings aside: rounded the same way)
    for a, b in zip(metrics_rows(run), csv.DictReader(logged)):
        assert {k: v for k, v in a.items() if k not in drop} == {
            k: v for k, v in b.items() if k not in drop
        }


def _fake_wandb(calls: list):
    w = types.ModuleType("wandb")
    w.init = lambda **kw: calls.append(("init", kw)) or object()
    w.log = lambda row, step=None: calls.append(("log", dict(row), step))
    w.finish = lambda: calls.append(("finish",))
    return w


def test_wandb_logs_each_epoch_offline_into_the_run_folder(tmp_path, monkeypatch):
    calls = []
    monkeypatch.setitem(sys.modules, "wandb", _fake_wandb(calls))
    monkeypatch.delenv("WANDB_MODE", raising=False)
    run = tmp_path / "run"
    train(_cfg("logger=wandb", "logger.project=mine"), run)
    assert os.environ["WANDB_MODE"] == "offline"
    init, *logs, fin = calls
    assert init[0] == "init" and fin == ("finish",)
    assert init[1]["project"] == "mine" and init[1]["dir"] == str(run)
    assert init[1]["config"]["logger"]["name"] == "wandb"
    rows = metrics_rows(run)
    assert [s for _, _, s in logs] == [1, 2, 3]
    assert all(list(row) == list(rows[0]) for _, row, _ in logs)
    assert [row["epsilon"] for _, row, _ in logs] == [float(r["epsilon"]) for r in rows]


def test_wandb_keeps_a_mode_the_user_set(tmp_path, monkeypatch):
    calls = []
    monkeypatch.setitem(sys.modules, "wandb", _fake_wandb(calls))
    monkeypatch.setenv("WANDB_MODE", "disabled")
    train(_cfg("logger=wandb", "training.epochs=1"), tmp_path / "run")
    assert os.environ["WANDB_MODE"] == "disabled" and calls[-1] == ("finish",)


@pytest.mark.parametrize(
    "name, pin", [("tensorboard", "tensorboard==2.21.0"), ("wandb", "wandb==0.31.0")]
)
def test_a_missing_logger_package_is_one_line_naming_the_install(monkeypatch, name, pin):
    monkeypatch.setitem(sys.modules, name, None)  # import name fails: as if not installed
    with pytest.raises(ConfigError, match=rf"^logger.name={name}: .*\(pip install {pin}"):
        _cfg(f"logger={name}")


def test_bad_logger_values_are_refused_naming_the_key():
    with pytest.raises(ConfigError, match=r"^logger.name=mlflow: unknown"):
        _cfg("logger.name=mlflow")
    with pytest.raises(ConfigError, match=r"^logger.project=a/b: must be"):
        _cfg("logger.project=a/b")


def test_cli_without_the_package_exits_2_before_any_work(tmp_path):
    """The command line: one line on stderr, exit code 2, no run folder."""
    code = (
        "import sys; sys.modules['tensorboard'] = None; from dpsgd.launch.main import train_main; "
        "train_main(sys.argv[1:])"
    )
    out = subprocess.run(
        [sys.executable, "-c", code, *TINY_RUN, "logger=tensorboard", "hydra.run.dir=run"],
        cwd=tmp_path,
        env=train_env(),
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert out.returncode == 2, out.stderr
    lines = out.stderr.strip().splitlines()
    assert len(lines) == 1 and "pip install tensorboard==2.21.0" in lines[0]
    assert not (tmp_path / "run").exists()


def test_private_trainer_takes_a_logger():
    import torch

    import dpsgd

    got = []

    class Recorder:
        def log(self, row, step):
            got.append((step, row))

    g = torch.Generator().manual_seed(0)
    X, y = torch.randn(200, 5, generator=g), torch.randint(0, 2, (200,), generator=g)
    t = dpsgd.PrivateTrainer(
        torch.nn.Linear(5, 2), (X, y), lot_size=20, sigma=1.0, seed=0, logger=Recorder()
    )
    t.fit(2)
    assert [s for s, _ in got] == [1, 2]
    assert got[-1][1]["epsilon"] == t.epsilon and got[-1][1]["steps"] == t.steps == 20
