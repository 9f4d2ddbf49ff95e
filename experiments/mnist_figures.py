"""Figures 3, 4, 5 and the privacy–utility plot: the MNIST runs of §5.2, drawn from results/ CSVs.

- ``figure3`` (figure3.csv): train/test accuracy vs epochs per preset, ε on a second axis;
- ``figure4`` (figure4.csv): test accuracy vs ε for several δ, per accountant and convention;
- ``figure5`` (figure5.csv): one parameter varied from the medium preset per panel;
- ``privacy_utility`` (summary.csv): final test accuracy vs ε for every run.

Each states (q, σ, δ) and the accounting convention in its title and overlays the numbers the paper
states (``experiments.claims``); style and saving: ``experiments.style``.
"""

from __future__ import annotations

import math
from pathlib import Path

import pandas as pd

from . import claims
from .style import (
    COLUMN_DPI,
    COLUMN_RC,
    COLUMN_WIDTH_IN,
    CONVENTION_TEXT,
    convention,
    fmt_delta,
    fmt_value,
    grid,
    legend_below,
    log_x,
    plt,
    save,
)

PRESET_COLOR = {
    "mnist_small": "tab:green",
    "mnist_medium": "tab:blue",
    "mnist_large": "tab:red",
    "mnist_nonprivate": "tab:gray",
}
DELTA_STYLE = [
    ("#0072B2", "o", "-"),
    ("#E69F00", "s", "--"),
    ("#009E73", "^", "-."),
    ("#CC79A7", "D", ":"),
]  # Okabe–Ito colours, one marker and dash per δ; cycled past four
ROW_LABEL = {
    ("moments", "per_tensor"): "moments, per-tensor\n(paper's accounting)",
    ("moments", "joint"): "moments, joint (σ/√k)",
    ("pld", "joint"): "PLD, joint (tight)",
}


# ---------------------------------------------------------------------------------------- Figure 3
def _figure3_panel(ax, d: pd.DataFrame, preset: str, letter: str, delta: str) -> None:
    paper = claims.PRESETS[preset]
    r = d.iloc[0]
    ax.plot(d["epoch"], 100 * d["train_accuracy"], color="tab:blue", label="train accuracy")
    ax.plot(d["epoch"], 100 * d["test_accuracy"], color="tab:orange", label="test accuracy")
    ax.axhline(100 * paper["accuracy"], color="k", ls=":", lw=1, label="paper's test accuracy")
    ax.set_xlabel("epoch")
    ax.set_ylabel("accuracy (%)")
    ax.set_ylim(80, 100)
    ax.grid(alpha=0.3)
    stated = f"paper: {100 * paper['accuracy']:g} % at ε = {fmt_value(paper['epsilon'])}"
    if preset == "mnist_nonprivate" or not d["epsilon"].notna().any():
        ax.set_title(
            f"({letter}) {claims.PRESET_LABEL[preset]}: q = {r['q']:.3g}, no noise, "
            f"no clipping\n{stated} (no privacy guarantee)"
        )
        return
    ax2 = ax.twinx()
    ax2.plot(
        d["epoch"], d["epsilon"], color="tab:red", ls="--", label="ε, moments (run's convention)"
    )
    if "epsilon_pld_joint" in d and d["epsilon_pld_joint"].notna().any():
        ax2.plot(
            d["epoch"],
            d["epsilon_pld_joint"],
            color="tab:green",
            ls="-.",
            label="ε, PLD joint (tight)",
        )
    ax2.axhline(paper["epsilon"], color="tab:red", ls=":", lw=1, label="paper's ε")
    ax2.set_ylabel(f"ε (δ = {delta})", color="tab:red")
    ax2.tick_params(axis="y", colors="tab:red")
    ax2.set_ylim(0, 1.25 * max(paper["epsilon"], d["epsilon"].max()))
    ax.set_title(
        f"({letter}) {claims.PRESET_LABEL[preset]}: q = {r['q']:.3g}, σ = {r['sigma']:g}, "
        f"σ_p = {r['sigma_p']:g}\n{stated}"
    )


def figure3(df: pd.DataFrame, out: Path) -> list[Path]:
    """Train/test accuracy vs epochs per preset, ε (δ = 1e-5) on a second axis (paper Figure 3), 2 ×
    2."""
    presets = [p for p in claims.PRESETS if p in set(df["preset"])]
    private = df[df["preset"] != "mnist_nonprivate"]
    delta = fmt_delta(df["delta"].dropna().iloc[0]) if df["delta"].notna().any() else "n/a"
    with plt.rc_context(COLUMN_RC):
        fig, axes = grid(len(presets), 2 if len(presets) > 1 else 1, 2.45, 1.0)
        for i, (ax, preset) in enumerate(zip(axes.flat, presets)):
            _figure3_panel(
                ax, df[df["preset"] == preset].sort_values("epoch"), preset, "abcd"[i], delta
            )
        legend_below(fig, axes, ncol=2)
        fig.suptitle(
            f"Figure 3 — MNIST accuracy vs epochs (60-d PCA, 1000 hidden units, L = 600, C = 4)\n"
            f"ε at δ = {delta}: moments accountant, {convention(private)}, DP-PCA charged; "
            "PLD: joint charge"
        )
        return save(fig, out, "figure3", dpi=COLUMN_DPI)


# ---------------------------------------------------------------------------------------- Figure 4
def _figure4_panel(ax, d: pd.DataFrame, deltas: list, preset: str) -> None:
    for i, delta in enumerate(deltas):
        color, marker, ls = DELTA_STYLE[i % len(DELTA_STYLE)]
        dd = d[d["delta"] == delta].sort_values("epsilon")
        ax.plot(
            dd["epsilon"],
            100 * dd["test_accuracy"],
            color=color,
            ls=ls,
            lw=1.2,
            marker=marker,
            ms=4,
            mfc="white",
            mew=1,
            markevery=0.12,
            label=f"δ = {fmt_delta(delta)}",
        )
    p = claims.PRESETS[preset]
    ax.plot(
        [p["epsilon"]],
        [100 * p["accuracy"]],
        marker="*",
        ms=10,
        color="k",
        ls="none",
        label=f"paper (δ = {fmt_delta(claims.DELTA)}, its accounting)",
    )
    ax.grid(alpha=0.3, which="both")
    ax.margins(0.06)


def figure4(df: pd.DataFrame, out: Path) -> list[Path]:
    """Test accuracy vs ε for several δ (paper Figure 4): a row per accountant/convention, a column
    per preset, one curve per δ (one point per epoch; markers spaced evenly along each curve)."""
    keys = list(df.groupby(["accountant", "convention"], sort=False).groups)
    presets = [p for p in claims.PRESETS if p in set(df["preset"])]
    deltas = sorted(df["delta"].unique())
    with plt.rc_context(COLUMN_RC):
        fig, axes = plt.subplots(
            len(keys),
            len(presets),
            figsize=(COLUMN_WIDTH_IN, 1.95 * len(keys) + 1.0),
            squeeze=False,
            sharex="col",
            sharey="col",
            layout="constrained",
        )
        for row, (acc, conv) in zip(axes, keys):
            for ax, preset in zip(row, presets):
                d = df[
                    (df["accountant"] == acc)
                    & (df["convention"] == conv)
                    & (df["preset"] == preset)
                ]
                _figure4_panel(ax, d, deltas, preset)
        for j, preset in enumerate(presets):
            r = df[df["preset"] == preset].iloc[0]
            axes[0, j].set_title(
                f"{claims.PRESET_LABEL[preset]}: σ = {r['sigma']:g}, σ_p = {r['sigma_p']:g}"
            )
            log_x(axes[-1, j], ticks=(0.1, 0.25, 0.5, 1, 2, 4, 8, 16, 32))
            axes[-1, j].set_xlabel("ε (log scale)")
        for i, key in enumerate(keys):
            label = ROW_LABEL.get(key, f"{key[0]}, {CONVENTION_TEXT.get(key[1], key[1])}")
            axes[i, 0].set_ylabel(f"{label}\ntest accuracy (%)")
        legend_below(fig, axes, ncol=len(deltas) + 1)
        q = df["q"].iloc[0] if "q" in df else float("nan")
        fig.suptitle(
            "Figure 4 — test accuracy vs ε at δ ∈ "
            f"{{{', '.join(map(fmt_delta, claims.FIGURE4_DELTAS))}}}, q = {q:.3g}, one point per "
            "epoch\n"
            "rows: accountant and charge (DP-PCA charged); columns: the paper's presets"
        )
        return save(fig, out, "figure4", dpi=COLUMN_DPI)


# ---------------------------------------------------------------------------------------- Figure 5
def _panel_x(d: pd.DataFrame) -> tuple[list, list[str], bool]:
    """x positions and tick labels; categorical when values are not all numbers (e.g. 'none',
    'random')."""
    vals = list(d["value"])
    try:
        xs = [float(v) for v in vals]
        return xs, [f"{v:g}" for v in xs], True
    except (TypeError, ValueError):
        return list(range(len(vals))), [str(v) for v in vals], False


def _pca_order(v) -> tuple:
    s = str(v)
    if s.startswith("random"):
        return (2, s)
    if s in ("none", "0"):
        return (1, s)
    try:
        return (0, float(s))
    except ValueError:
        return (3, s)


def _figure5_claims(ax, panel: str, xs: list, labels: list[str], numeric: bool) -> None:
    """The paper's statements about one panel: a line at its best value, a star, or a legend
    entry."""
    for c in claims.FIGURE5_CLAIMS:
        if c["panel"] != panel:
            continue
        if c["kind"] == "argmax" and numeric:
            ax.axvline(c["value"], color="k", ls=":", lw=1, label=f"paper: {c['paper']}")
        elif (
            c["kind"] == "random_projection"
            and not numeric
            and any(l.startswith("random") for l in labels)
        ):
            i = next(i for i, l in enumerate(labels) if l.startswith("random"))
            ax.plot(
                [xs[i]],
                [100 * c["value"]],
                marker="*",
                ms=13,
                color="k",
                ls="none",
                label=f"paper: {c['paper']}",
            )
        else:
            ax.plot([], [], ls="none", label=f"paper: {c['paper']}")


def _figure5_panel(ax, df: pd.DataFrame, panel: str, letter: str) -> None:
    d = df[df["panel"] == panel].copy()
    # a sweep of the user's own: its swept keys (collect.panel_value) label the axis
    xlabel = (
        claims.FIGURE5_PANELS[panel][1]
        if panel in claims.FIGURE5_PANELS
        else d["parameter"].iloc[0]
    )
    d = (
        d.iloc[sorted(range(len(d)), key=lambda i: _pca_order(d["value"].iloc[i]))]
        if panel == "pca_dims"
        else d.assign(_v=pd.to_numeric(d["value"], errors="coerce")).sort_values("_v")
    )
    agg = (
        d.groupby("value", sort=False)
        .agg(
            train=("train_accuracy", "mean"),
            test=("test_accuracy", "mean"),
            n=("test_accuracy", "size"),
        )
        .reset_index()
    )
    xs, labels, numeric = _panel_x(agg)
    ax.plot(xs, 100 * agg["train"], marker="o", color="tab:blue", label="train accuracy")
    ax.plot(xs, 100 * agg["test"], marker="s", color="tab:orange", label="test accuracy")
    if not numeric:
        ax.set_xticks(xs, labels)
    elif panel in ("lot_size", "learning_rate", "hidden_units"):
        ax.set_xscale("log")
        ax.set_xticks(xs, labels)
        ax.minorticks_off()
    _figure5_claims(ax, panel, xs, labels, numeric)
    ax.set_xlabel(xlabel)
    ax.set_ylabel("accuracy (%)")
    lo = min(80.0, 100 * agg[["train", "test"]].min().min() - 2)
    ax.set_ylim(lo, 100)
    ax.grid(alpha=0.3)
    centre = d[d["source"].astype(str).str.startswith("preset")] if "source" in d else d.iloc[:0]
    if len(centre):
        i = list(agg["value"]).index(centre["value"].iloc[0])
        ax.plot(
            [xs[i]],
            [100 * agg["test"].iloc[i]],
            marker="D",
            ms=10,
            mfc="none",
            mec="k",
            ls="none",
            label="medium preset run (shared centre)",
        )
    ax.legend(fontsize=7, loc="lower right")
    ax.set_title(f"({letter}) {xlabel}", fontsize=10)


def _figure5_stops(df: pd.DataFrame) -> str:
    """What the runs did, from the CSV: the budget they all stopped at, or each stop and ε range."""
    r = df.iloc[0]
    if (df["stop_reason"] == "target_epsilon_reached").all() and df[
        "epsilon_budget"
    ].nunique() == 1:
        return f"each run stopped at (ε, δ) = ({r['epsilon_budget']:g}, {r['delta']:g})"
    stops = ", ".join(f"{n}× {why}" for why, n in df["stop_reason"].value_counts().items())
    eps = df["epsilon"]
    return f"stops: {stops}; ε {eps.min():.3g}–{eps.max():.3g} at δ = {r['delta']:g}"


def figure5(df: pd.DataFrame, out: Path) -> list[Path]:
    """One panel per swept parameter: the paper's six (one parameter varied from the medium
    preset) and any sweep of the user's own; only the panels the CSV has are drawn."""
    known = [p for p in claims.FIGURE5_PANELS if p in set(df["panel"])]
    panels = known + sorted(set(df["panel"]) - set(known))
    cols = min(3, len(panels))
    rows = -(-len(panels) // cols)
    fig, axes = plt.subplots(rows, cols, figsize=(14 * cols / 3, 4 * rows), squeeze=False)
    for i, (ax, panel) in enumerate(zip(axes.flat, panels)):
        _figure5_panel(ax, df, panel, "abcdefghijklmnopqrstuvwxyz"[i % 26])
    r = df.iloc[0]
    conv = CONVENTION_TEXT.get(r["convention"], r["convention"])
    for ax in list(axes.flat)[len(panels) :]:
        ax.axis("off")
    what = (
        "one parameter varied from the medium preset (σ = 4, σ_p = 7, C = 4, L = 600, "
        "q = L/N = 0.01 unless varied)"
        if len(known) == len(panels)
        else "swept parameters: " + ", ".join(panels)
    )
    fig.suptitle(
        f"Figure 5 — {what}, {_figure5_stops(df)}\n{r['accountant']} accountant, {conv}, "
        "DP-PCA charged; mean over seeds where several",
        fontsize=10.5,
    )
    fig.tight_layout()
    return save(fig, out, "figure5")


# ---------------------------------------------------------------------------------------- every run
def _ours(ax, priv: pd.DataFrame) -> None:
    """Our preset runs: ε as claimed (filled) and ε joint by PLD (open), one colour per preset."""
    for preset, d in priv[priv["kind"] == "preset"].groupby("preset"):
        color = PRESET_COLOR.get(preset, "k")
        ax.plot(
            d["epsilon"],
            100 * d["test_accuracy"],
            ls="none",
            marker="D",
            ms=8,
            color=color,
            label=f"ours: {claims.PRESET_LABEL.get(preset, preset)}",
        )
        if (
            "epsilon_pld_joint" in d
        ):  # the same run under the correct joint charge, tight accountant
            ax.plot(
                d["epsilon_pld_joint"],
                100 * d["test_accuracy"],
                ls="none",
                marker="D",
                ms=8,
                mfc="none",
                mec=color,
            )
    if (priv["kind"] == "preset").any() and "epsilon_pld_joint" in priv:
        ax.plot(
            [],
            [],
            ls="none",
            marker="D",
            mfc="none",
            mec="k",
            label="same runs: ε joint, PLD (tight)",
        )


def privacy_utility(df: pd.DataFrame, out: Path) -> list[Path]:
    """Final test accuracy vs ε for every run, the paper's points overlaid."""
    fig, ax = plt.subplots(figsize=(7.5, 5))
    priv = df[df["epsilon"].notna() & (df["epsilon"] > 0) & df["epsilon"].apply(math.isfinite)]
    sweeps = priv[priv["kind"] == "sweep"]
    if len(sweeps):
        for panel, d in sweeps.groupby("panel"):
            ax.plot(
                d["epsilon"],
                100 * d["test_accuracy"],
                ls="none",
                marker="o",
                ms=5,
                alpha=0.7,
                label=f"Figure 5 sweep: {panel}",
            )
    _ours(ax, priv)
    for preset, p in claims.PRESETS.items():
        if math.isfinite(p["epsilon"]):
            ax.plot([p["epsilon"]], [100 * p["accuracy"]], marker="*", ms=14, color="k", ls="none")
    ax.plot(
        [], [], marker="*", ms=10, color="k", ls="none", label="paper (90/95/97 % at ε = 0.5/2/8)"
    )
    nonpriv = df[df["preset"] == "mnist_nonprivate"]
    if len(nonpriv):
        ax.axhline(
            100 * nonpriv["test_accuracy"].iloc[0],
            color="tab:gray",
            ls="--",
            label=f"ours: non-private {100 * nonpriv['test_accuracy'].iloc[0]:.2f} %",
        )
    ax.axhline(
        100 * claims.PRESETS["mnist_nonprivate"]["accuracy"],
        color="k",
        ls=":",
        label="paper: non-private 98.3 %",
    )
    log_x(ax)
    ax.set_xlabel("ε at δ = 1e-5 (log scale)")
    ax.set_ylabel("final test accuracy (%)")
    lo = min(85.0, 100 * priv["test_accuracy"].min() - 2) if len(priv) else 85.0
    ax.set_ylim(lo, 100)
    ax.grid(alpha=0.3, which="both")
    ax.legend(fontsize=7, loc="lower right")
    conv = convention(priv) if len(priv) else "n/a"
    ax.set_title(
        f"Privacy–utility: every run (MNIST, δ = 1e-5, q = L/N, σ per run)\n"
        f"moments accountant, {conv}, DP-PCA charged",
        fontsize=9.5,
    )
    return save(fig, out, "privacy_utility")
