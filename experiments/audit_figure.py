"""results/figures/audit.png from results/audit.csv only: what the one-run audit certifies against
what is claimed.

Left: the full-schedule audits (paper presets σ = 8, 4, 2 and a frontier recipe): claimed ε,
white-box and black-box ε_lb (95 %), and the last-iterate heuristic ε. Right: the paper's MNIST
network, 1000 lots at σ = 2, 4, 8, each mechanism (correct and broken): white-box ε_lb over claimed
ε — above 1 is a caught violation.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pandas as pd

from .paths import ROOT
from .style import COLUMN_DPI, COLUMN_RC, COLUMN_WIDTH_IN, plt, save

VARIANT_ORDER = [
    "correct",
    "no_clip",
    "noise_div10",
    "noise_per_rank",
    "realised_lot",
    "loose_group",
    "shuffle",
]


def draw(df: pd.DataFrame | None = None, out: Path | None = None) -> list[Path]:
    """results/figures/audit.{png,pdf} from the rows of results/audit.csv (column width, as Figures
    3–6)."""
    df = pd.read_csv(ROOT / "results" / "audit.csv") if df is None else df
    out = out or ROOT / "results" / "figures"
    with plt.rc_context(COLUMN_RC):
        return _draw(df, out)


def _draw(df: pd.DataFrame, out: Path) -> list[Path]:
    fig, (ax1, ax2) = plt.subplots(
        1, 2, figsize=(COLUMN_WIDTH_IN, 3.4), gridspec_kw={"width_ratios": [1, 1.3]}
    )
    full = df[df["row"].str.endswith("_full")]
    x = np.arange(len(full))
    for j, (col, label) in enumerate(
        [
            ("eps_claimed", "claimed ε (valid, PLD)"),
            ("eps_last_iterate_heuristic", "last-iterate heuristic ε"),
            ("eps_lb_white_box", "white-box ε_lb (95 %)"),
            ("eps_lb_black_box", "black-box ε_lb (95 %)"),
        ]
    ):
        ax1.bar(x + (j - 1.5) * 0.2, full[col].fillna(0), 0.2, label=label)
    ax1.set_xticks(
        x, [r.replace("_full", "").replace("_", "\n", 1) for r in full["row"]], fontsize=6
    )
    ax1.set_ylabel("ε (δ = 1e-5)")
    ax1.set_title("full training runs")
    ax1.legend(fontsize=6)
    ax1.grid(alpha=0.3)
    short = df[~df["row"].str.endswith("_full")].copy()
    short["mech"] = np.where(short["sampling"] == "shuffle", "shuffle", short["variant"])
    for sigma, marker in zip(sorted(short["sigma"].unique()), "osd"):
        s = short[short["sigma"] == sigma].set_index("mech").reindex(VARIANT_ORDER)
        # a shuffled run is held to the Poisson claim it would (wrongly) make
        claim = s["eps_claimed"].where(s.index != "shuffle", s["eps_claimed_as_if_poisson"])
        ax2.plot(
            range(len(VARIANT_ORDER)), s["eps_lb_white_box"] / claim, marker, label=f"σ = {sigma:g}"
        )
    ax2.axhline(1.0, color="k", lw=0.8, ls="--")
    ax2.set_xticks(
        range(len(VARIANT_ORDER)),
        [
            v.replace("_", "\n") if v != "shuffle" else "shuffle\nvs Poisson\nclaim"
            for v in VARIANT_ORDER
        ],
        fontsize=7,
    )
    ax2.set_ylabel("white-box ε_lb / claimed ε")
    ax2.set_title("paper network, 1000 lots: above 1 = caught")
    ax2.legend(fontsize=6)
    ax2.grid(alpha=0.3)
    fig.tight_layout()
    return save(fig, out, "audit", dpi=COLUMN_DPI)
