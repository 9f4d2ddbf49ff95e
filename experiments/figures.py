"""Redraw every figure from the committed CSVs in results/ and regenerate results/README.md.

    python -m experiments.figures [--results results] [--no-readme]

No training, no accounting. Writes results/figures/{figure2,figure3,figure4,figure5,figure6,
privacy_utility,frontier,audit,risk,finetune}.{png,pdf} and regenerates results/README.md
(``experiments.readme``, written by this script only). A figure whose CSV is missing is skipped
with a note, so the script also works part-way through a ``make paper`` (and Figure 6 is drawn only once real CIFAR-10 runs have been collected into results/figure6.csv).

The top of the experiments package: it imports the figure modules, which import the shared style
(``experiments.style``) and nothing above them. Every figure states (q, σ, δ) and the accounting
convention in its title, and overlays the numbers the paper states (``experiments.claims``).
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import pandas as pd

from . import (
    audit_figure,
    correlated_figure,
    figure2,
    figure6,
    finetune_figure,
    frontier_figure,
    mnist_figures,
    risk_figure,
)
from .readme import write_readme

# (CSV in results/, function drawing it into results/figures/), in drawing order
DRAWERS = [
    ("figure2.csv", figure2.draw),
    ("figure3.csv", mnist_figures.figure3),
    ("figure4.csv", mnist_figures.figure4),
    ("figure5.csv", mnist_figures.figure5),
    ("figure6.csv", figure6.draw),
    ("summary.csv", mnist_figures.privacy_utility),
    ("frontier.csv", frontier_figure.draw),
    ("audit.csv", audit_figure.draw),
    ("risk.csv", risk_figure.draw),
    ("finetune.csv", finetune_figure.draw),
    ("correlated_noise.csv", correlated_figure.draw),
]
# the figure each CSV gives, where its name is not the CSV's
FIGURE_NAME = {"summary.csv": "privacy_utility"}


def figure_name(csv: str) -> str:
    return FIGURE_NAME.get(csv, csv.removesuffix(".csv"))


def draw_all(results: Path) -> int:
    """Draw every figure whose CSV is in ``results``; returns how many were drawn."""
    out = results / "figures"
    drawn = 0
    for csv, draw in DRAWERS:
        path = results / csv
        if not path.exists():
            src = "experiments.figure2" if csv == "figure2.csv" else "experiments.collect"
            print(f"skip {figure_name(csv)}: {path} not found (run `python -m {src}` first)")
            continue
        df = pd.read_csv(path, dtype={"value": str})
        if df.empty:
            print(f"skip {figure_name(csv)}: {path} has no rows")
            continue
        for p in draw(df, out):
            print(f"wrote {p}")
        drawn += 1
    return drawn


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(
        description="Redraw every figure from the committed CSVs in results/."
    )
    ap.add_argument(
        "--results", type=Path, default=Path("results"), help="results folder (default: results)"
    )
    ap.add_argument("--no-readme", action="store_true", help="do not regenerate results/README.md")
    args = ap.parse_args(argv)
    t0 = time.perf_counter()
    drawn = draw_all(args.results)
    if not args.no_readme:
        print(f"wrote {write_readme(args.results)}")
    print(f"{drawn} figure(s) in {time.perf_counter() - t0:.1f} s")
    return 0 if drawn else 1


if __name__ == "__main__":
    sys.exit(main())
