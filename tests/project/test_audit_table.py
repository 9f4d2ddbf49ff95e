"""The committed one-run audit table (results/audit.csv, docs/AUDIT.md) reproduces from the
committed runs."""

from pathlib import Path

import pandas as pd
import pytest

from experiments import audit_table
from tolerances import ledger_pld_epsilon_tol, rdp_series_rtol

ROOT = Path(__file__).resolve().parents[2]


RECOMPUTED = (
    "eps_claimed_sgd",
    "ratio_white_box_sgd",
)  # charged anew from the run's ledger (accountants)


def _claim_tol(privacy: dict, value: float) -> float:
    """How far a claim recomputed from a committed ledger may be from the committed value on another
    CPU: two PLD grid steps of the lots' composition, and the RDP series' round-off (the claim is
    the smallest over the run's accountants)."""
    from dpsgd.accountant import Ledger

    ledger = Ledger.from_dict(privacy["ledger"])
    return ledger_pld_epsilon_tol(ledger) + rdp_series_rtol() * abs(value)


def test_committed_audit_table_reproduces_from_its_runs():
    """Every column copied from the runs is reproduced exactly; the claim for the lots alone,
    charged anew from each run's ledger, within the accountants' tolerance (the rest of the row,
    exactly)."""
    import json

    table = audit_table.table_from_runs()
    assert table, "results/runs/audit/ holds the table's audits"
    committed = pd.read_csv(
        ROOT / "results" / "audit.csv", dtype=str, keep_default_na=False
    ).set_index("row")
    for r in table:
        p = json.loads(
            (ROOT / "results" / "runs" / "audit" / r["row"] / "privacy.json").read_text()
        )
        old = float(committed.loc[r["row"], "eps_claimed_sgd"])
        assert abs(r["eps_claimed_sgd"] - old) <= _claim_tol(p, old), r["row"]
        for k in RECOMPUTED:  # the committed values, so that the rest compares exactly
            r[k] = None if committed.loc[r["row"], k] == "" else float(committed.loc[r["row"], k])
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


def test_claim_for_the_lots_alone_comes_from_the_committed_ledger():
    """eps_claimed_sgd: the run's ledger without its DP-PCA entry, charged as epsilon_valid is. The
    same charge of the whole ledger gives back epsilon_valid; the lots alone claim less, and the
    same where there is no DP-PCA release (mnist_scatter_linear); PLD of the lots alone agrees with
    the family test's claim (dpsgd/audit/onerun/stats/family.py:Claim.epsilon)."""
    import json

    from dpsgd.accountant import Ledger
    from dpsgd.audit.onerun.stats.family import Claim

    df = pd.read_csv(ROOT / "results" / "audit.csv").set_index("row")
    for row in ("mnist_small_full", "mnist_scatter_linear_eps2_full", "sigma4_correct_1000lots"):
        p = json.loads((ROOT / "results" / "runs" / "audit" / row / "privacy.json").read_text())
        whole = min(
            Ledger.from_dict(p["ledger"]).epsilon(p["delta"], accountant=a, convention="joint")[0]
            for a in p["sampling"]["accountants"]
        )
        assert abs(whole - p["epsilon_valid"]) <= _claim_tol(
            p, whole
        )  # the same charge, on another CPU
        lots = audit_table.claim_for_lots(p)
        assert abs(df.loc[row, "eps_claimed_sgd"] - lots) <= _claim_tol(p, lots)
        has_pca = any(e["label"].startswith("pca") for e in p["ledger"]["entries"])
        assert (lots < whole) if has_pca else (lots == whole)
        s = p["sampling"]
        assert Claim(
            s["L"] / s["N"], p["ledger"]["entries"][-1]["sigma"], p["steps"], p["k"], p["delta"]
        ).epsilon() == pytest.approx(lots, rel=2e-3)
