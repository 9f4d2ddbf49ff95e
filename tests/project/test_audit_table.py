"""The committed one-run audit table (results/audit.csv, docs/AUDIT.md) reproduces from the committed runs."""
from pathlib import Path

import pandas as pd

from experiments import audit_table

ROOT = Path(__file__).resolve().parents[2]


def test_committed_audit_table_reproduces_from_its_runs():
    table = audit_table.table_from_runs()
    assert table, "results/runs/audit/ holds the table's audits"
    assert (ROOT / "results" / "audit.csv").read_text() == audit_table.csv_text(table)
    assert audit_table.doc_table(table) in (ROOT / "docs" / "AUDIT.md").read_text()


def test_every_committed_verdict_matches_its_numbers():
    df = pd.read_csv(ROOT / "results" / "audit.csv")
    lb = df[["eps_lb_white_box", "eps_lb_black_box"]].max(axis=1)
    assert ((lb > df["eps_claimed"]) == (df["verdict"] == "violation")).all()
    # the correct mechanism is never flagged; noise ÷ 10 always is
    assert (df.loc[df["variant"] == "correct", "verdict"] == "consistent").all()
    assert (df.loc[df["variant"] == "noise_div10", "verdict"] == "violation").all()


def test_quick_rows_are_a_subset_of_the_table(tmp_path):
    rows = audit_table.rows()
    assert {r for r, (_, quick) in rows.items() if quick} <= set(rows)
    assert all(any(a.startswith("audit.") for a in ov) for ov, _ in rows.values())
