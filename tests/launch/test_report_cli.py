"""python -m dpsgd.report: one table of any runs, from their own files."""

from __future__ import annotations

import csv
import io

import pytest

from conftest import TINY_RUN
from dpsgd.config.schema import validate
from dpsgd.launch.main import compose
from dpsgd.report import main as report_main
from dpsgd.train import train


def test_a_table_of_runs_from_their_folders(tmp_path, capsys):
    for seed in (0, 1):
        args = [*TINY_RUN, "training.epochs=2", f"seed={seed}"]
        train(validate(compose(args)), tmp_path / "sweep" / f"job{seed}", args)
    capsys.readouterr()  # the runs' own lines
    assert report_main([str(tmp_path / "sweep"), "--format", "csv"]) == 0
    rows = list(csv.DictReader(io.StringIO(capsys.readouterr().out)))
    assert [r["run"] for r in rows] == ["job0", "job1"]
    assert all(r["status"] == "complete" and r["lots"] == "20" for r in rows)
    assert float(rows[0]["epsilon_valid"]) <= float(rows[0]["epsilon"])
    assert (
        report_main([str(tmp_path), "--format", "markdown", "--plot", str(tmp_path / "p.png")]) == 0
    )
    out = capsys.readouterr().out
    assert "| sweep/job0 |" in out and (tmp_path / "p.png").stat().st_size > 0


def test_nothing_to_report_is_one_line_and_exit_2(tmp_path, capsys):
    assert report_main([str(tmp_path)]) == 2
    assert capsys.readouterr().err.count("\n") == 1


def _run(folder, eps_valid, eps=None, acc=0.35):
    """A run folder with a statement and one metrics row, written by hand (no training)."""
    import json

    folder.mkdir(parents=True)
    st = {"status": "complete", "stop_reason": "epochs_completed", "steps": 10, "epochs": 1,
          "epsilon_valid": eps_valid, "epsilon": eps or eps_valid, "delta": 1e-5}  # fmt: skip
    (folder / "privacy.json").write_text(json.dumps(st))
    (folder / "metrics.csv").write_text(f"epoch,steps,test_accuracy\n1,10,{acc}\n")
    return folder


def test_the_table_rounds_epsilon_up_as_the_statement_does(tmp_path, capsys):
    """0.28120535 was shown as 0.2812 (to nearest); the statement and the console say 0.2813."""
    _run(tmp_path / "a", 0.28120535, 0.41111)
    for fmt in ("terminal", "markdown"):
        assert report_main([str(tmp_path), "--format", fmt]) == 0
        out = capsys.readouterr().out
        assert "0.2813" in out and "0.4112" in out and "0.2812" not in out
    assert report_main([str(tmp_path), "--format", "csv"]) == 0
    assert "0.28120535" in capsys.readouterr().out  # csv: the exact float


@pytest.mark.parametrize("bad", ["", "{not json", "[1, 2]"])
def test_a_corrupt_statement_is_skipped_with_one_line(tmp_path, capsys, bad):
    _run(tmp_path / "good", 0.5)
    (_run(tmp_path / "torn", 0.7) / "privacy.json").write_text(bad)
    assert report_main([str(tmp_path), "--format", "csv"]) == 0
    out, err = capsys.readouterr()
    assert [r["run"] for r in csv.DictReader(io.StringIO(out))] == ["good"]
    assert err.count("\n") == 1 and err.startswith("report: skipped ") and "torn" in err


@pytest.mark.parametrize(
    "flag, where, message",
    [
        ("--out", "nowhere/table.md", "no folder"),
        ("--out", ".", "is a folder"),
        ("--plot", "plot.txt", "must end in one of .png"),
        ("--plot", ".", "is a folder"),
    ],
)
def test_a_bad_out_or_plot_is_one_line_and_exit_2_before_anything(
    tmp_path, capsys, flag, where, message
):
    _run(tmp_path / "runs" / "a", 0.5)
    target = tmp_path / where
    assert report_main([str(tmp_path / "runs"), flag, str(target)]) == 2
    out, err = capsys.readouterr()
    assert out == "" and err.count("\n") == 1 and message in err and flag in err
