"""Every JSON file the project writes is strict JSON (RFC 8259: no NaN, no Infinity), and the
privacy statement says what it does not cover.

A non-private run's ε is unbounded: privacy.json writes ``"epsilon": null`` beside
``"private": false`` and the words of its statement (docs/PRIVACY_STATEMENT.md). The training-set
columns of metrics.csv are computed on the private data without noise: ``not_covered`` names them,
and ``training.train_metrics=false`` leaves them empty.
"""

import json
import math
import subprocess
from pathlib import Path

import pytest

from conftest import metrics_rows
from dpsgd.config.schema import validate
from dpsgd.core.fileio import json_text, write_json
from dpsgd.launch.main import compose
from dpsgd.run.report import COLUMNS, TRAIN_METRICS, epsilons, not_covered
from dpsgd.train import train

REPO = Path(__file__).resolve().parents[2]
TINY = [
    "dataset.subset=3000",
    "privacy.lot_size=150",
    "privacy.physical_batch_size=150",
    "model.hidden=[200]",
    "model.projection=random",
    "device=cpu",
    "training.epochs=1",
    "training.max_steps=3",
]


def strict_loads(text: str):
    """json.loads refusing NaN, Infinity and -Infinity, as a strict parser does."""

    def refuse(constant):
        raise ValueError(f"not strict JSON: {constant}")

    return json.loads(text, parse_constant=refuse)


def _json_files(run: Path) -> list[Path]:
    return sorted(p for p in run.rglob("*.json"))


def _run(tmp_path, name, *overrides) -> Path:
    train(validate(compose([*TINY, *overrides])), tmp_path / name)
    return tmp_path / name


def test_tiny_runs_write_strict_json(tmp_path):
    nonprivate = _run(tmp_path, "nonprivate", "experiment=mnist_nonprivate")
    private = _run(tmp_path, "private", "training.train_metrics=false")
    for run in (nonprivate, private):
        files = _json_files(run)
        assert [f.name for f in files] == ["privacy.json"]
        for f in files:
            strict_loads(f.read_text())
        for line in (
            (run / "lots.reserved").read_text().splitlines()
            if (run / "lots.reserved").exists()
            else []
        ):
            strict_loads(line)
    st = strict_loads((nonprivate / "privacy.json").read_text())
    assert st["private"] is False and st["statement"].startswith("NOT PRIVATE")
    assert st["epsilon"] is None and st["epsilon_valid"] is None
    assert math.isinf(float(metrics_rows(nonprivate)[-1]["epsilon"]))  # the CSV keeps inf
    # private, training-set metrics left out: columns stable, values nan, the statement says so
    st = strict_loads((private / "privacy.json").read_text())
    assert st["private"] is True and st["epsilon"] > 0 and st["epsilon_valid"] > 0
    (metrics,) = [e for e in st["not_covered"] if e["columns"] == list(TRAIN_METRICS)]
    assert metrics["computed"] is False and "not computed" in metrics["why"]
    rows = metrics_rows(private)
    assert list(rows[0]) == COLUMNS
    assert all(
        math.isnan(float(r[k])) for r in rows for k in TRAIN_METRICS
    )  # as an epoch not evaluated and float(rows[-1]["test_accuracy"]) > 0


def test_not_covered_names_the_training_set_columns():
    c = validate(compose([*TINY, "dataset.validation=500"]))

    entries = {e["what"]: e for e in not_covered(c, object())}
    m = entries["training-set loss and accuracy"]
    assert m["computed"] is True and m["columns"] == ["lot_loss", "train_loss", "train_accuracy"]
    assert (
        "without noise" in m["why"]
        and "Figure 3" in m["why"]
        and "training.train_metrics=false" in m["why"]
    )
    assert entries["timings"]["columns"] == ["epoch_time_s", "wall_time_s"]
    assert "dataset.validation=500" in entries["validation accuracy"]["why"]
    json_text(not_covered(c, object()))


def test_committed_results_json_is_strict():
    files = subprocess.run(
        ["git", "ls-files", "*.json"], cwd=REPO, capture_output=True, text=True, check=True
    ).stdout.split()
    assert len(files) > 50
    nonprivate = 0
    for f in files:
        st = strict_loads((REPO / f).read_text())
        if isinstance(st, dict) and st.get("private") is False:
            nonprivate += 1
            assert st["epsilon"] is None and st["statement"].startswith("NOT PRIVATE"), f
    assert nonprivate >= 9


def test_writer_refuses_non_finite_and_names_it(tmp_path):
    out = tmp_path / "x.json"
    for bad in (math.inf, -math.inf, math.nan):
        with pytest.raises(ValueError, match=r"a\.1\.b"):
            write_json(out, {"a": [1, {"b": bad}]})
    assert list(tmp_path.iterdir()) == []  # nothing half-written, no temporary file
    write_json(out, {"a": None})
    with pytest.raises(FileExistsError):
        write_json(out, {"a": 2}, exclusive=True)  # never over an earlier file
    assert strict_loads(out.read_text()) == {"a": None} and [
        p.name for p in tmp_path.iterdir()
    ] == ["x.json"]


def test_an_unbounded_accountant_is_a_refusal(monkeypatch):
    """An accountant answering ε = inf gives no bound: recorded as refused (null in
    privacy.json)."""
    from dpsgd.accountant import Ledger
    from dpsgd.accountant.events import Poisson

    c = validate({"privacy": {"sigma": 4.0, "lot_size": 600}})
    led = Ledger()
    led.record(Poisson(0.01, 4.0, 2), 10, "sgd")
    real = Ledger.epsilon
    monkeypatch.setattr(
        Ledger,
        "epsilon",
        lambda self, d, accountant="moments", convention="joint", **kw: (
            (math.inf, None) if accountant == "pld" else real(self, d, accountant, convention, **kw)
        ),
    )
    eps = epsilons(led, c)
    assert (
        eps["by"]["pld"]["joint"] == (None, None)
        and "no finite ε" in eps["refused"]["pld"]["joint"]
    )
    assert eps["valid_accountant"] in ("rdp", "moments") and math.isfinite(eps["epsilon_valid"])
