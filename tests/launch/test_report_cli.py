"""python -m dpsgd.report: one table of any runs, from their own files."""

from __future__ import annotations

import csv
import io

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
