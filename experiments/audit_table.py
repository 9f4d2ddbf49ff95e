"""The one-run audit table (docs/AUDIT.md): each row one ``python -m dpsgd.audit run`` of a real
configuration.

    # the quick rows (make audit): run what is missing, collect
    python -m experiments.audit_table
    python -m experiments.audit_table --rows all      # every row of the committed table
    # results/audit.csv from results/runs/audit/ only
    python -m experiments.audit_table --only collect

Each row trains in ``outputs/audit_table/<row>`` (one at a time, ``DPSGD_THREADS=1``); a folder that
already holds an audit.json is not rerun. Its small files (audit.json, audit_scores.csv,
privacy.json, metrics.csv) are copied to ``results/runs/audit/<row>/``, which ``collect`` turns into
``results/audit.csv`` (one row per audit) and ``results/figures/audit.png`` (ε_lb beside the claimed
and the heuristic ε).
"""

from __future__ import annotations

import argparse
import csv
import io
import json
import os
import shutil
import subprocess
import sys

from .paths import ROOT

CANARIES = ["audit.gradient_canaries=5000", "audit.input_canaries=1000"]
SHORT = ["training.max_steps=1000"]  # variants: 1000 lots, the claim for what ran
PRESETS = {"mnist_large": 8.0, "mnist_medium": 4.0, "mnist_small": 2.0}
VARIANTS = ("correct", "no_clip", "noise_div10", "noise_per_rank", "realised_lot", "loose_group")


def rows() -> dict:
    """{row: (overrides, quick)} — the committed table."""
    out = {}
    for preset, sigma in PRESETS.items():
        out[f"{preset}_full"] = ([f"experiment={preset}", *CANARIES], preset == "mnist_large")
    out["mnist_scatter_linear_eps2_full"] = (
        ["experiment=mnist_scatter_linear", "privacy.target_epsilon=2", *CANARIES],
        False,
    )
    for sigma in PRESETS.values():
        for v in VARIANTS:
            out[f"sigma{sigma:g}_{v}_1000lots"] = (
                [
                    "experiment=mnist_medium",
                    f"privacy.sigma={sigma}",
                    "privacy.target_epsilon=null",
                    *SHORT,
                    *CANARIES,
                    f"audit.variant={v}",
                ],
                sigma == 4.0,
            )
        out[f"sigma{sigma:g}_shuffle_1000lots"] = (
            [
                "experiment=mnist_medium",
                f"privacy.sigma={sigma}",
                "privacy.target_epsilon=null",
                "privacy.sampling=shuffle",
                *SHORT,
                *CANARIES,
            ],
            sigma == 4.0,
        )
    return out


COLUMNS = [
    "row",
    "variant",
    "sampling",
    "sigma",
    "steps",
    "m_gradient",
    "m_input",
    "eps_claimed",
    "eps_lb_white_box",
    "eps_lb_black_box",
    "ratio_white_box",
    "eps_claimed_sgd",
    "ratio_white_box_sgd",
    "eps_last_iterate_heuristic",
    "eps_claimed_as_if_poisson",
    "verdict",
    "verdict_as_if_poisson",
    "confidence",
    "seconds",
    "hardware",
    "command",
]
SMALL = ("audit.json", "audit_scores.csv", "privacy.json", "metrics.csv")
HARDWARE = os.environ.get("DPSGD_HARDWARE", "AMD EPYC, 2 cores")


def run_row(name: str, overrides: list[str]) -> None:
    out = ROOT / "outputs" / "audit_table" / name
    if not (out / "audit.json").is_file():
        if out.exists():
            shutil.rmtree(out)  # an unfinished audit is not resumed: run it again
        cmd = [sys.executable, "-m", "dpsgd.audit", "run", *overrides, f"hydra.run.dir={out}"]
        print("$", " ".join(cmd[1:]), flush=True)
        subprocess.run(cmd, check=True, cwd=ROOT, env={**os.environ, "DPSGD_THREADS": "1"})
    dest = ROOT / "results" / "runs" / "audit" / name
    dest.mkdir(parents=True, exist_ok=True)
    for f in SMALL:
        shutil.copyfile(out / f, dest / f)


def claim_for_lots(privacy: dict) -> float:
    """The claim for the DP-SGD lots alone (``eps_claimed_sgd``), from a run's committed
    privacy.json: its ledger without the DP-PCA release (entries labelled ``pca...``), charged as
    ``epsilon_valid`` is (the smallest ε of the run's accountants, under
    ``epsilon_valid_convention``, at the run's δ). Gradient canaries see only the lots, so this is
    the claim their ε_lb is held to; the whole claim stays ``eps_claimed``."""
    from dpsgd.accountant import Ledger

    ledger = privacy["ledger"]
    lots = Ledger.from_dict(
        {**ledger, "entries": [e for e in ledger["entries"] if not e["label"].startswith("pca")]}
    )
    return min(
        float(
            lots.epsilon(
                privacy["delta"], accountant=acc, convention=privacy["epsilon_valid_convention"]
            )[0]
        )
        for acc in privacy["sampling"]["accountants"]
    )


def _game(a: dict, prefix: str):
    return next((g["eps_lower_bound"] for g in a["games"] if g["game"].startswith(prefix)), None)


def csv_text(table: list[dict]) -> str:
    buf = io.StringIO()
    w = csv.DictWriter(buf, COLUMNS, lineterminator="\n")
    w.writeheader()
    w.writerows(table)
    return buf.getvalue()


def collect() -> list[dict]:
    """results/audit.csv and the table of docs/AUDIT.md from results/runs/audit/."""
    table = table_from_runs()
    path = ROOT / "results" / "audit.csv"
    path.write_text(csv_text(table))
    print(f"{path}: {len(table)} audits")
    write_doc_table(table)
    return table


def table_from_runs() -> list[dict]:
    """One row per committed audit (results/runs/audit/<row>/audit.json), in the table's order."""
    table = []
    for name, (overrides, _) in rows().items():
        f = ROOT / "results" / "runs" / "audit" / name / "audit.json"
        if not f.is_file():
            continue
        a = json.loads(f.read_text())
        wb, claimed = _game(a, "white-box"), a["eps_claimed"]
        lots = claim_for_lots(json.loads((f.parent / "privacy.json").read_text()))
        table.append(
            {
                "row": name,
                "variant": a["variant"],
                "sampling": a["run"]["sampling"],
                "sigma": a["run"]["sigma"],
                "steps": a["run"]["steps"],
                "m_gradient": a["options"]["gradient_canaries"],
                "m_input": a["options"]["input_canaries"],
                "eps_claimed": claimed,
                "eps_lb_white_box": wb,
                "eps_lb_black_box": _game(a, "black-box"),
                "ratio_white_box": None if wb is None or not claimed else wb / claimed,
                "eps_claimed_sgd": lots,
                "ratio_white_box_sgd": None if wb is None or not lots else wb / lots,
                "eps_last_iterate_heuristic": a["eps_last_iterate_heuristic"],
                "eps_claimed_as_if_poisson": a.get("eps_claimed_as_if_poisson"),
                "verdict": a["verdict"],
                "verdict_as_if_poisson": a.get("verdict_as_if_poisson"),
                "confidence": a["confidence"],
                "seconds": a["seconds"],
                "hardware": HARDWARE,
                "command": "python -m dpsgd.audit run " + " ".join(overrides),
            }
        )
    return table


BEGIN, END = (
    "<!-- audit-table:begin (python -m experiments.audit_table --only collect) -->",
    "<!-- audit-table:end -->",
)


def _f(x, digits=3) -> str:
    return "–" if x is None or x == "" else f"{float(x):.{digits}f}"


def doc_table(table: list[dict]) -> str:
    """The markdown table of docs/AUDIT.md, from the rows of results/audit.csv."""
    lines = [
        "| audit | mechanism | σ | lots | m (grad. / input) | claimed ε | claimed ε, lots only | "
        "white-box ε_lb | black-box ε_lb | ε_lb / claimed | ε_lb / lots' claim | heuristic ε | "
        "verdict | wall time |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in table:
        mech = (
            r["variant"] if r["sampling"] == "poisson" else f"{r['variant']}, {r['sampling']} lots"
        )
        verdict = r["verdict"] + (
            f" (vs Poisson claim {_f(r['eps_claimed_as_if_poisson'])}: "
            f"{r['verdict_as_if_poisson']})"
            if r["eps_claimed_as_if_poisson"] not in (None, "")
            else ""
        )
        lines.append(
            f"| {r['row']} | {mech} | {float(r['sigma']):g} | {r['steps']} | {r['m_gradient']} / "
            f"{r['m_input']} | {_f(r['eps_claimed'])} | {_f(r['eps_claimed_sgd'])} | "
            f"{_f(r['eps_lb_white_box'])} | {_f(r['eps_lb_black_box'])} | "
            f"{_f(r['ratio_white_box'], 2)} | {_f(r['ratio_white_box_sgd'], 2)} | "
            f"{_f(r['eps_last_iterate_heuristic'])} | {verdict} | {float(r['seconds']) / 60:.1f} "
            "min |"
        )
    return "\n".join(lines)


def write_doc_table(table: list[dict], body=None, begin: str = BEGIN, end: str = END) -> None:
    """Replace what lies between ``begin`` and ``end`` in docs/AUDIT.md with ``body`` (default: this
    module's table of ``table``); nothing happens when the markers are missing."""
    doc = ROOT / "docs" / "AUDIT.md"
    text = doc.read_text()
    if begin in text and end in text:
        head, rest = text.split(begin, 1)
        table_text = doc_table(table) if body is None else body
        doc.write_text(head + begin + "\n" + table_text + "\n" + end + rest.split(end, 1)[1])


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(prog="python -m experiments.audit_table")
    ap.add_argument(
        "--rows", default="quick", help="quick | all | a comma-separated list of row names"
    )
    ap.add_argument("--only", choices=["run", "collect"], default=None)
    a = ap.parse_args(argv)
    table = rows()
    if a.rows not in ("quick", "all"):
        unknown = [r for r in a.rows.split(",") if r not in table]
        if unknown:
            ap.error(f"--rows: unknown rows {unknown}; one of {sorted(table)}")
    chosen = [
        r
        for r, (_, quick) in table.items()
        if a.rows == "all" or (a.rows == "quick" and quick) or r in a.rows.split(",")
    ]
    if a.only != "collect":
        for r in chosen:
            run_row(r, table[r][0])
    if a.only != "run":
        collect()
        from .audit_figure import draw

        draw()


if __name__ == "__main__":
    main()
