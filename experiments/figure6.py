"""Figure 6 (Abadi et al. 2016, §5.3): CIFAR-10 accuracy vs epochs per ε, with ε on a second axis.

Collected from real CIFAR-10 run folders (runs of
``experiment=cifar10_eps2|cifar10_eps4|cifar10_eps8|cifar10_nonprivate``) into ``results/figure6.csv`` by ``python -m experiments.collect``
(`experiments/collect.py:collect` calls `rows`), and drawn from that CSV only by
``python -m experiments.figures`` (`draw`). Without the CSV nothing is drawn: no CIFAR-10 number of
this repository exists that was not measured on CIFAR-10.

ε per epoch is the run's own: ``epsilon`` under the paper's accounting (moments accountant, the
per-tensor charges its presets stop on) and ``epsilon_pld_joint``, the valid joint charge under the
tight PLD accountant. The paper's final accuracies (67 / 70 / 73 % at ε = 2 / 4 / 8, 80 % without
privacy) are drawn as reference lines (`experiments.claims.CIFAR10_PRESETS`).
"""

from __future__ import annotations

import math
from pathlib import Path

import pandas as pd

from . import claims
from .style import COLUMN_DPI, COLUMN_RC, fmt_delta, grid, legend_below, plt, save

# one row per run and epoch: the run's metrics.csv columns Figure 6 and the README need, plus where
# the run came from (relative path, hardware, why it stopped)
METRICS = [
    "epoch",
    "steps",
    "train_accuracy",
    "test_accuracy",
    "epsilon",
    "epsilon_pld_joint",
    "epsilon_valid",
    "delta",
    "q",
    "L",
    "sigma",
    "C",
    "groups",
    "accountant",
    "convention",
    "epoch_time_s",
    "wall_time_s",
]
COLUMNS = ["preset"] + METRICS + ["stop_reason", "hardware", "run"]
ACC_COLOR, TRAIN_COLOR, EPS_COLOR, PLD_COLOR = "tab:orange", "tab:blue", "tab:red", "tab:green"


def rows(presets: dict[str, dict], run_label, hardware: str) -> pd.DataFrame:
    """The per-epoch rows of the CIFAR-10 preset runs, in the paper's panel order.

    ``presets`` maps a preset to its run (as `experiments/runs.py:load_run` returns it);
    ``run_label(dir)`` names the run folder (a path relative to the repository)."""
    out = []
    for preset in [p for p in claims.CIFAR10_PRESETS if p in presets]:
        r = presets[preset]
        m = r["metrics"].reindex(columns=METRICS)
        m.insert(0, "preset", preset)
        m["stop_reason"] = r["privacy"].get("stop_reason")
        m["hardware"] = (r["privacy"].get("runtime") or {}).get("hardware") or hardware
        m["run"] = run_label(r["dir"])
        out.append(m)
    return pd.concat(out, ignore_index=True)[COLUMNS] if out else pd.DataFrame(columns=COLUMNS)


def final(df: pd.DataFrame) -> dict[str, pd.Series]:
    """preset -> its run's last row (the released model), in the paper's order."""
    return {
        p: df[df["preset"] == p].sort_values("steps").iloc[-1]
        for p in claims.CIFAR10_PRESETS
        if p in set(df["preset"])
    }


def _configured(r: pd.Series) -> str:
    """Legend label of the run's configured ε (the column ``epsilon``)."""
    if (r["accountant"], r["convention"]) == ("moments", "per_tensor"):
        return "ε, moments, per-tensor (paper's accounting)"
    return f"ε, {r['accountant']}, {r['convention']} (run's accounting)"


def draw(df: pd.DataFrame, out: Path) -> list[Path]:
    """Test (and train) accuracy vs epochs, one panel per preset; ε (paper's accounting, and the
    valid joint PLD) on the second axis; the paper's accuracy and ε as dotted lines. 1 × 3, or 2 × 2
    with the non-private run."""
    from matplotlib.ticker import MaxNLocator

    presets = [p for p in claims.CIFAR10_PRESETS if p in set(df["preset"])]
    ncols = 2 if len(presets) == 4 else max(1, len(presets))
    acc = 100 * df["test_accuracy"].dropna()
    lo = max(0.0, 10 * math.floor((acc.min() - 5) / 10)) if len(acc) else 0.0
    delta = fmt_delta(df["delta"].dropna().iloc[0]) if df["delta"].notna().any() else "n/a"
    sep = "\n" if ncols > 2 else " "  # narrow panels: the settings on a line of their own
    with plt.rc_context(COLUMN_RC):
        fig, axes = grid(len(presets), ncols, 2.45 if ncols <= 2 else 2.2, 1.0)
        for i, (ax, preset) in enumerate(zip(axes.flat, presets)):
            d = df[df["preset"] == preset].sort_values("steps")
            paper, r = claims.CIFAR10_PRESETS[preset], d.iloc[-1]
            ok = d["test_accuracy"].notna()
            ax.plot(
                d["epoch"][ok],
                100 * d["train_accuracy"][ok],
                color=TRAIN_COLOR,
                lw=0.9,
                alpha=0.7,
                label="train accuracy",
            )
            ax.plot(
                d["epoch"][ok], 100 * d["test_accuracy"][ok], color=ACC_COLOR, label="test accuracy"
            )
            ax.axhline(
                100 * paper["accuracy"], color="k", ls=":", lw=1, label="paper's test accuracy"
            )
            ax.set_xlabel("epoch")
            ax.xaxis.set_major_locator(MaxNLocator(nbins=5, integer=True))
            ax.set_ylabel("accuracy (%)")
            ax.set_ylim(lo, 100)
            ax.grid(alpha=0.3)
            letter = "abcd"[i]
            if math.isfinite(paper["epsilon"]) and d["epsilon"].notna().any():
                ax2 = ax.twinx()
                ax2.plot(d["epoch"], d["epsilon"], color=EPS_COLOR, ls="--", label=_configured(r))
                if d["epsilon_pld_joint"].notna().any():
                    ax2.plot(
                        d["epoch"],
                        d["epsilon_pld_joint"],
                        color=PLD_COLOR,
                        ls="-.",
                        label="ε, PLD joint (valid, tight)",
                    )
                ax2.axhline(paper["epsilon"], color=EPS_COLOR, ls=":", lw=1, label="paper's ε")
                ax2.set_ylabel(f"ε (δ = {delta})", color=EPS_COLOR)
                ax2.tick_params(axis="y", colors=EPS_COLOR)
                ax2.set_ylim(
                    0,
                    1.25 * max(paper["epsilon"], d["epsilon"].max(), d["epsilon_pld_joint"].max()),
                )
                ax.set_title(
                    f"({letter}) {preset}: L = {int(r['L'])},{sep}q = {r['q']:.3g}, σ = "
                    f"{r['sigma']:g}, C = {r['C']:g}, k = {int(r['groups'])}\n"
                    f"paper: {100 * paper['accuracy']:g} % at ε = {paper['epsilon']:g}, L = "
                    f"{paper['lot_size']}"
                )
            else:
                ax.set_title(
                    f"({letter}) {preset}: L = {int(r['L'])}, no noise, no clipping\n"
                    f"paper: ≈ {100 * paper['accuracy']:g} % (no privacy guarantee)"
                )
        legend_below(fig, axes, ncol=3)
        fig.suptitle(
            "Figure 6 — CIFAR-10 accuracy vs epochs, convolutions pretrained on CIFAR-100 and "
            "frozen\n"
            f"ε at δ = {delta}: moments, per-tensor charges (paper's accounting); PLD, joint "
            "charge"
        )
        return save(fig, out, "figure6", dpi=COLUMN_DPI)
