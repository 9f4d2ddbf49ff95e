"""The examples in examples/ run as a user runs them, on a small size, and claim what they spent."""

from __future__ import annotations

import importlib.util
import math
from pathlib import Path

import pytest

EXAMPLES = Path(__file__).resolve().parents[2] / "examples"


def _load(name: str):
    spec = importlib.util.spec_from_file_location(name, EXAMPLES / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_cnn_on_tensors_stops_within_its_target(capsys):
    s = _load("cnn_on_tensors").main(["--n", "200", "--epochs", "2", "--epsilon", "3"])
    assert s["steps"] == 40 and s["epsilon"] <= 3.0 and s["groups"] == 1
    assert "epochs_completed: 40 lots" in capsys.readouterr().out


def test_tabular_csv_trains_from_a_label_column(tmp_path, capsys):
    s = _load("tabular_csv").main(["--make", str(tmp_path / "t.csv"), "--epochs", "1"])
    assert s["accountant"] == "pld" and s["steps"] == 30 and math.isfinite(s["epsilon"])
    assert 0.0 <= s["train_accuracy"] <= 1.0 and "(pld)" in capsys.readouterr().out


def test_a_wrong_label_column_is_named(tmp_path):
    m = _load("tabular_csv")
    m.make_csv(str(tmp_path / "t.csv"), n=50)
    with pytest.raises(KeyError, match="label"):
        m.main([str(tmp_path / "t.csv"), "--label", "label"])
