"""Checkpoint/resume: a run killed with SIGKILL resumes to the identical final model and ε
history."""

import json
import re
import signal
import time

import pytest
import torch

from conftest import metrics_row_count, metrics_rows
from dpsgd.run.checkpoint import load_checkpoint
from dpsgd.config.schema import ConfigError
from dpsgd.config.schema import validate
from dpsgd.launch.main import compose
from dpsgd.launch.prepare import prepare_resume
from dpsgd.train import train
from conftest import run_train as _run, start_train as _start_and_wait

ARGS = [
    "dataset.subset=3000",
    "privacy.lot_size=100",
    "privacy.physical_batch_size=100",
    "model.hidden=[100]",
    "training.epochs=8",
    "privacy.sigma=2",
    "device=cpu",
    "seed=3",
]


def _final_params(run):
    return load_checkpoint(run)["model"]


def test_sigkill_then_resume_equals_uninterrupted_run(tmp_path):
    ref, run = tmp_path / "ref", tmp_path / "run"
    train(validate(compose(ARGS)), ref)  # the uninterrupted run (same code path, in-process)
    # kill mid-training: just after epoch 2's row (before or after its checkpoint, whichever comes)
    proc = _start_and_wait([*ARGS, f"hydra.run.dir={run}"], tmp_path, run, rows=2)
    time.sleep(0.05)
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    assert proc.returncode == -signal.SIGKILL
    assert json.loads((run / "privacy.json").read_text())["status"] == "running"
    assert metrics_row_count(run) < 8
    r = _run([f"resume={run}"], tmp_path)
    assert r.returncode == 0, r.stderr
    a, b = _final_params(ref), _final_params(run)
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    ra, rb = metrics_rows(ref), metrics_rows(run)
    assert [r["epoch"] for r in rb] == [
        str(i) for i in range(1, 9)
    ]  # no duplicated or missing epoch
    for col in ("steps", "test_accuracy", "train_loss"):  # the replay: bit-identical
        assert [r[col] for r in ra] == [r[col] for r in rb], col
    st = json.loads((run / "privacy.json").read_text())
    assert st["status"] == "complete" and st["stop_reason"] == "epochs_completed"
    assert len(st["resumes"]) == 1
    # every replayed lot proved by its digest is charged once; the lots the killed process had
    # reserved but not digested (the lot in flight, the rest of its reservation) are charged as lost
    led, want = (
        st["ledger"]["entries"],
        json.loads((ref / "privacy.json").read_text())["ledger"]["entries"],
    )
    count = lambda entries, labels: sum(e["count"] for e in entries if e["label"] in labels)  # noqa: E731
    lost = count(led, ("lost",))
    assert (
        count(led, ("sgd",)) == count(want, ("sgd",))
        and lost == st["resumes"][0]["lost_lots_charged"]
    )
    assert lost <= st["steps"] // 8 + 16  # at most an epoch and a chunk
    for col in ("epsilon", "epsilon_moments", "epsilon_pld", "epsilon_pld_joint"):
        assert all(float(y[col]) >= float(x[col]) for x, y in zip(ra, rb)), col
        assert (lost == 0) == ([r[col] for r in ra] == [r[col] for r in rb]), col
    assert r.stdout.count("epoch ") >= 1


def test_resume_with_different_privacy_values_is_refused_untouched(tmp_path):
    run = tmp_path / "run"
    assert _run([*ARGS, "training.epochs=2", f"hydra.run.dir={run}"], tmp_path).returncode == 0
    before = {p.name: p.stat().st_mtime_ns for p in run.iterdir()}
    for bad, key in [
        ("privacy.sigma=3", "privacy.sigma"),
        ("privacy.lot_size=120", "privacy.lot_size"),
        ("privacy.delta=1e-6", "privacy.delta"),
        ("dataset=fashion_mnist", "dataset.name"),
        ("privacy.clipping=global", "privacy.clipping"),
        ("privacy.sigma_p=2", "privacy.sigma_p"),
        ("privacy.convention=per_tensor", "privacy.convention"),
        ("privacy.sampling=shuffle", "privacy.sampling"),
        ("model.hidden=[50]", "model.hidden"),
        ("dataset.subset=2000", "dataset.subset"),
    ]:
        with pytest.raises(ConfigError, match=re.escape(key)):
            prepare_resume([f"resume={run}", "training.epochs=4", bad])
    r = _run([f"resume={run}", "training.epochs=4", "privacy.sigma=3"], tmp_path)  # the real CLI
    assert r.returncode == 2
    assert r.stderr.strip().splitlines() == [
        "error: resume: privacy.sigma=3.0 differs from the run's privacy.sigma=2.0; "
        "privacy-relevant values cannot change on resume"
    ]
    assert {p.name: p.stat().st_mtime_ns for p in run.iterdir()} == before
    # extending a finished run with more epochs is allowed and appends
    r = _run([f"resume={run}", "training.epochs=3"], tmp_path)
    assert r.returncode == 0, r.stderr
    assert [r["epoch"] for r in metrics_rows(run)] == ["1", "2", "3"]


def test_sigint_marks_the_run_interrupted(tmp_path):
    run = tmp_path / "run"
    proc = _start_and_wait(
        [*ARGS, "training.epochs=50", f"hydra.run.dir={run}"], tmp_path, run, rows=1
    )
    proc.send_signal(signal.SIGINT)
    proc.wait(timeout=60)
    assert proc.returncode != 0
    st = json.loads((run / "privacy.json").read_text())
    assert st["status"] == "interrupted" and st["stop_reason"] == "interrupted"
