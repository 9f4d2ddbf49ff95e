"""Redraw every figure from the committed CSVs in results/ — no training, no accounting.

    python -m experiments.figures [--results results]

Writes results/figures/{figure2,figure3,figure4,figure5,figure6,privacy_utility}.{png,pdf} and
regenerates results/README.md (``experiments.readme``). A figure whose CSV is missing is skipped with
a note, so the script also works part-way through a ``make paper`` (and Figure 6 is drawn only once
real CIFAR-10 runs have been collected into results/figure6.csv).

Every figure states (q, σ, δ) and the accounting convention in its title, and overlays the numbers
the paper states (``experiments.claims``).
"""
from __future__ import annotations

import argparse
import math
import sys
import time
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
import pandas as pd  # noqa: E402

from . import claims  # noqa: E402

PRESET_COLOR = {"mnist_small": "tab:green", "mnist_medium": "tab:blue", "mnist_large": "tab:red",
                "mnist_nonprivate": "tab:gray"}
CURVE_STYLE = {   # figure2 curve -> (label, colour, linestyle)
    "moments": ("moments accountant (paper: λ ≤ 32, tail bound)", "tab:blue", "-"),
    "rdp_improved": ("RDP, improved conversion (Balle et al. 2020)", "tab:purple", "-."),
    "pld": ("PLD, tight (pessimistic discretisation)", "tab:green", ":"),
    "strong_composition_paper": ("strong composition, paper variant (NOT a valid bound)", "tab:red", "--"),
    "strong_composition_valid": ("strong composition, valid amplification", "tab:orange", "-"),
}
CONVENTION_TEXT = {"per_tensor": "per-tensor charges (paper's code)", "joint": "joint charge (σ/√k)"}


# Byte-reproducible files: the same CSVs give the same bytes on every run, so `make figures` leaves
# git clean. matplotlib stamps a PDF with its creation time (now, or SOURCE_DATE_EPOCH when set) unless
# the entry is None, and a PNG with a "Software" text chunk; both are left out. Everything else in the
# files (fonts subset to the glyphs used, object order) is a function of the figure alone; the bytes
# still depend on the matplotlib and FreeType builds, pinned in requirements.lock.
PDF_METADATA = {"CreationDate": None}
PNG_METADATA = {"Software": None}


def _save(fig, out: Path, name: str, dpi: int = 130) -> list[Path]:
    out.mkdir(parents=True, exist_ok=True)
    paths = [out / f"{name}.png", out / f"{name}.pdf"]
    fig.savefig(paths[0], dpi=dpi, bbox_inches="tight", metadata=PNG_METADATA)
    fig.savefig(paths[1], bbox_inches="tight", metadata=PDF_METADATA)
    plt.close(fig)
    return paths


def _convention(df: pd.DataFrame) -> str:
    vals = sorted(set(df["convention"].dropna())) if "convention" in df else []
    return ", ".join(CONVENTION_TEXT.get(v, v) for v in vals) or "n/a"


def _log_x(ax, ticks=(0.125, 0.25, 0.5, 1, 2, 4, 8, 16, 32)) -> None:
    """Log-scale x axis with plain-number ticks (no 2×10^0 style minor labels)."""
    from matplotlib.ticker import FixedLocator, NullFormatter, StrMethodFormatter
    ax.set_xscale("log")
    lo, hi = ax.get_xlim()
    ax.xaxis.set_major_locator(FixedLocator([t for t in ticks if lo <= t <= hi] or list(ticks)))
    ax.xaxis.set_major_formatter(StrMethodFormatter("{x:g}"))
    ax.xaxis.set_minor_formatter(NullFormatter())


def _delta(x: float) -> str:
    """δ as the paper writes it: 1e-5, 1e-4 (not 1e-05, 0.0001)."""
    mantissa, exponent = f"{float(x):e}".split("e")
    return f"{mantissa.rstrip('0').rstrip('.')}e{int(exponent)}"


def _fmt(x: float) -> str:
    return "∞" if x is None or (isinstance(x, float) and math.isinf(x)) else f"{x:g}"


# ----------------------------------------------------------------------------------------------
def figure2(df: pd.DataFrame, out: Path) -> list[Path]:
    """ε vs epochs for q = 0.01, σ = 4, δ = 1e-5 (paper Figure 2), two views: linear and log."""
    s = claims.FIGURE2_SETTING
    fig, axes = plt.subplots(1, 2, figsize=(12, 4.6))
    for ax, log in zip(axes, (False, True)):
        for curve, (label, color, ls) in CURVE_STYLE.items():
            d = df[df["curve"] == curve].sort_values("epoch")
            if len(d):
                ax.plot(d["epoch"], d["epsilon"], color=color, ls=ls, lw=1.8, label=label)
        for epochs, curve, eps, _src in claims.FIGURE2:
            color = CURVE_STYLE[curve][1]
            ax.plot([epochs], [eps], marker="o", ms=8, mfc="none", mec=color, mew=2, ls="none")
            ax.annotate(f"paper {eps:g}", (epochs, eps), textcoords="offset points",
                        xytext=(-58, 6) if epochs >= df["epoch"].max() else (6, -12),
                        fontsize=8, color=color)
        ax.plot([], [], marker="o", mfc="none", mec="k", ls="none", label="paper's stated values")
        ax.set_xlabel("epochs E (lots T = E/q)")
        ax.set_ylabel("ε (at δ = 1e-5)")
        ax.set_xlim(0, df["epoch"].max())
        if log:
            ax.set_yscale("log")
            ax.set_title("log scale")
        else:
            ymax = df[df["curve"] == "strong_composition_paper"]["epsilon"].max()
            ax.set_ylim(0, 1.15 * ymax if ymax == ymax else None)
            ax.set_title("linear scale (as in the paper)")
        ax.grid(alpha=0.3)
    axes[0].legend(fontsize=7.5, loc="upper left")
    fig.suptitle(f"Figure 2 — ε vs epochs: q = {s['q']:g}, σ = {s['sigma']:g}, δ = {s['delta']:g}; "
                 "one clipped group (k = 1, conventions coincide), Poisson sampling", fontsize=11)
    return _save(fig, out, "figure2")


# Figures 3 and 4 are laid out to be read at a paper's text width (7 in: a one-column paper's column,
# a two-column paper's figure*), printed at that size: text 7-9 pt, one legend outside the panels.
COLUMN_WIDTH_IN = 7.0
COLUMN_DPI = 200
COLUMN_RC = {"font.size": 8, "axes.titlesize": 8, "axes.labelsize": 8, "xtick.labelsize": 7.5,
             "ytick.labelsize": 7.5, "legend.fontsize": 7.5, "figure.titlesize": 9, "lines.linewidth": 1.3}
DELTA_STYLE = [("#0072B2", "o", "-"), ("#E69F00", "s", "--"), ("#009E73", "^", "-."),
               ("#CC79A7", "D", ":")]   # Okabe–Ito colours, one marker and dash per δ; cycled past four
ROW_LABEL = {("moments", "per_tensor"): "moments, per-tensor\n(paper's accounting)",
             ("moments", "joint"): "moments, joint (σ/√k)", ("pld", "joint"): "PLD, joint (tight)"}


def _grid(n: int, ncols: int, panel_h: float, extra_h: float, **kw):
    nrows = max(1, math.ceil(n / ncols))
    fig, axes = plt.subplots(nrows, ncols, figsize=(COLUMN_WIDTH_IN, panel_h * nrows + extra_h),
                             squeeze=False, layout="constrained", **kw)
    for ax in axes.flat[n:]:
        ax.axis("off")
    return fig, axes


def _legend_below(fig, axes, ncol: int) -> None:
    """One legend for the figure, below the panels: each label once, in first-drawn order."""
    seen = {}
    for ax in fig.axes:
        for h, label in zip(*ax.get_legend_handles_labels()):
            seen.setdefault(label, h)
    fig.legend(list(seen.values()), list(seen), loc="outside lower center", ncol=ncol, frameon=False)


def figure3(df: pd.DataFrame, out: Path) -> list[Path]:
    """Train/test accuracy vs epochs per preset, ε (δ = 1e-5) on a second axis (paper Figure 3), 2 × 2."""
    presets = [p for p in claims.PRESETS if p in set(df["preset"])]
    private = df[df["preset"] != "mnist_nonprivate"]
    delta = _delta(df["delta"].dropna().iloc[0]) if df["delta"].notna().any() else "n/a"
    with plt.rc_context(COLUMN_RC):
        fig, axes = _grid(len(presets), 2 if len(presets) > 1 else 1, 2.45, 1.0)
        for i, (ax, preset) in enumerate(zip(axes.flat, presets)):
            d = df[df["preset"] == preset].sort_values("epoch")
            paper = claims.PRESETS[preset]
            r = d.iloc[0]
            ax.plot(d["epoch"], 100 * d["train_accuracy"], color="tab:blue", label="train accuracy")
            ax.plot(d["epoch"], 100 * d["test_accuracy"], color="tab:orange", label="test accuracy")
            ax.axhline(100 * paper["accuracy"], color="k", ls=":", lw=1, label="paper's test accuracy")
            ax.set_xlabel("epoch")
            ax.set_ylabel("accuracy (%)")
            ax.set_ylim(80, 100)
            ax.grid(alpha=0.3)
            stated = f"paper: {100 * paper['accuracy']:g} % at ε = {_fmt(paper['epsilon'])}"
            if preset != "mnist_nonprivate" and d["epsilon"].notna().any():
                ax2 = ax.twinx()
                ax2.plot(d["epoch"], d["epsilon"], color="tab:red", ls="--",
                         label="ε, moments (run's convention)")
                if "epsilon_pld_joint" in d and d["epsilon_pld_joint"].notna().any():
                    ax2.plot(d["epoch"], d["epsilon_pld_joint"], color="tab:green", ls="-.",
                             label="ε, PLD joint (tight)")
                ax2.axhline(paper["epsilon"], color="tab:red", ls=":", lw=1, label="paper's ε")
                ax2.set_ylabel(f"ε (δ = {delta})", color="tab:red")
                ax2.tick_params(axis="y", colors="tab:red")
                ax2.set_ylim(0, 1.25 * max(paper["epsilon"], d["epsilon"].max()))
                title = (f"({'abcd'[i]}) {claims.PRESET_LABEL[preset]}: q = {r['q']:.3g}, σ = {r['sigma']:g}, "
                         f"σ_p = {r['sigma_p']:g}\n{stated}")
            else:
                title = (f"({'abcd'[i]}) {claims.PRESET_LABEL[preset]}: q = {r['q']:.3g}, no noise, "
                         f"no clipping\n{stated} (no privacy guarantee)")
            ax.set_title(title)
        _legend_below(fig, axes, ncol=2)
        fig.suptitle(f"Figure 3 — MNIST accuracy vs epochs (60-d PCA, 1000 hidden units, L = 600, C = 4)\n"
                     f"ε at δ = {delta}: moments accountant, {_convention(private)}, DP-PCA charged; "
                     "PLD: joint charge")
        return _save(fig, out, "figure3", dpi=COLUMN_DPI)


def figure4(df: pd.DataFrame, out: Path) -> list[Path]:
    """Test accuracy vs ε for several δ (paper Figure 4): a row per accountant/convention, a column per
    preset, one curve per δ (one point per epoch; markers spaced evenly along each curve)."""
    keys = list(df.groupby(["accountant", "convention"], sort=False).groups)
    presets = [p for p in claims.PRESETS if p in set(df["preset"])]
    deltas = sorted(df["delta"].unique())
    with plt.rc_context(COLUMN_RC):
        fig, axes = plt.subplots(len(keys), len(presets), figsize=(COLUMN_WIDTH_IN, 1.95 * len(keys) + 1.0),
                                 squeeze=False, sharex="col", sharey="col", layout="constrained")
        for row, (acc, conv) in zip(axes, keys):
            for ax, preset in zip(row, presets):
                d = df[(df["accountant"] == acc) & (df["convention"] == conv) & (df["preset"] == preset)]
                for i, delta in enumerate(deltas):
                    color, marker, ls = DELTA_STYLE[i % len(DELTA_STYLE)]
                    dd = d[d["delta"] == delta].sort_values("epsilon")
                    ax.plot(dd["epsilon"], 100 * dd["test_accuracy"], color=color, ls=ls, lw=1.2, marker=marker,
                            ms=4, mfc="white", mew=1, markevery=0.12, label=f"δ = {_delta(delta)}")
                p = claims.PRESETS[preset]
                ax.plot([p["epsilon"]], [100 * p["accuracy"]], marker="*", ms=10, color="k", ls="none",
                        label=f"paper (δ = {_delta(claims.DELTA)}, its accounting)")
                ax.grid(alpha=0.3, which="both")
                ax.margins(0.06)
        for j, preset in enumerate(presets):
            r = df[df["preset"] == preset].iloc[0]
            axes[0, j].set_title(f"{claims.PRESET_LABEL[preset]}: σ = {r['sigma']:g}, σ_p = {r['sigma_p']:g}")
            _log_x(axes[-1, j], ticks=(0.1, 0.25, 0.5, 1, 2, 4, 8, 16, 32))
            axes[-1, j].set_xlabel("ε (log scale)")
        for i, key in enumerate(keys):
            label = ROW_LABEL.get(key, f"{key[0]}, {CONVENTION_TEXT.get(key[1], key[1])}")
            axes[i, 0].set_ylabel(f"{label}\ntest accuracy (%)")
        _legend_below(fig, axes, ncol=len(deltas) + 1)
        q = df["q"].iloc[0] if "q" in df else float("nan")
        fig.suptitle(f"Figure 4 — test accuracy vs ε at δ ∈ {{{', '.join(map(_delta, claims.FIGURE4_DELTAS))}}}, "
                     f"q = {q:.3g}, one point per epoch\nrows: accountant and charge (DP-PCA charged); "
                     "columns: the paper's presets")
        return _save(fig, out, "figure4", dpi=COLUMN_DPI)


def _panel_x(d: pd.DataFrame) -> tuple[list, list[str], bool]:
    """x positions and tick labels; categorical when values are not all numbers (e.g. 'none', 'random')."""
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


def figure5(df: pd.DataFrame, out: Path) -> list[Path]:
    """Six panels: one parameter varied from the medium preset, each run to (ε, δ) = (2, 1e-5)."""
    panels = [p for p in claims.FIGURE5_PANELS if p in set(df["panel"])]
    fig, axes = plt.subplots(2, 3, figsize=(14, 8))
    for ax, panel in zip(axes.flat, panels):
        _key, xlabel, _default = claims.FIGURE5_PANELS[panel]
        d = df[df["panel"] == panel].copy()
        d = d.iloc[sorted(range(len(d)), key=lambda i: _pca_order(d["value"].iloc[i]))] if panel == "pca_dims" \
            else d.assign(_v=pd.to_numeric(d["value"], errors="coerce")).sort_values("_v")
        agg = d.groupby("value", sort=False).agg(train=("train_accuracy", "mean"),
                                                   test=("test_accuracy", "mean"),
                                                   n=("test_accuracy", "size")).reset_index()
        xs, labels, numeric = _panel_x(agg)
        ax.plot(xs, 100 * agg["train"], marker="o", color="tab:blue", label="train accuracy")
        ax.plot(xs, 100 * agg["test"], marker="s", color="tab:orange", label="test accuracy")
        if not numeric:
            ax.set_xticks(xs, labels)
        elif panel in ("lot_size", "learning_rate", "hidden_units"):
            ax.set_xscale("log")
            ax.set_xticks(xs, labels)
            ax.minorticks_off()
        for c in claims.FIGURE5_CLAIMS:
            if c["panel"] != panel:
                continue
            if c["kind"] == "argmax" and numeric:
                ax.axvline(c["value"], color="k", ls=":", lw=1, label=f"paper: {c['paper']}")
            elif c["kind"] == "random_projection" and not numeric and any(l.startswith("random") for l in labels):
                i = next(i for i, l in enumerate(labels) if l.startswith("random"))
                ax.plot([xs[i]], [100 * c["value"]], marker="*", ms=13, color="k", ls="none",
                        label=f"paper: {c['paper']}")
            else:
                ax.plot([], [], ls="none", label=f"paper: {c['paper']}")
        ax.set_xlabel(xlabel)
        ax.set_ylabel("accuracy (%)")
        lo = min(80.0, 100 * agg[["train", "test"]].min().min() - 2)
        ax.set_ylim(lo, 100)
        ax.grid(alpha=0.3)
        centre = d[d["source"].astype(str).str.startswith("preset")] if "source" in d else d.iloc[:0]
        if len(centre):
            i = list(agg["value"]).index(centre["value"].iloc[0])
            ax.plot([xs[i]], [100 * agg["test"].iloc[i]], marker="D", ms=10, mfc="none", mec="k", ls="none",
                    label="medium preset run (shared centre)")
        ax.legend(fontsize=7, loc="lower right")
        letter = "abcdef"[list(claims.FIGURE5_PANELS).index(panel)]
        ax.set_title(f"({letter}) {xlabel}", fontsize=10)
    r = df.iloc[0]
    conv = CONVENTION_TEXT.get(r["convention"], r["convention"])
    for ax in list(axes.flat)[len(panels):]:
        ax.axis("off")
    fig.suptitle("Figure 5 — one parameter varied from the medium preset (σ = 4, σ_p = 7, C = 4, L = 600, "
                 f"q = L/N = 0.01 unless varied), each run stopped at (ε, δ) = ({r['epsilon_budget']:g}, "
                 f"{r['delta']:g})\n{r['accountant']} accountant, {conv}, DP-PCA charged; "
                 "mean over seeds where several", fontsize=10.5)
    fig.tight_layout()
    return _save(fig, out, "figure5")


def privacy_utility(df: pd.DataFrame, out: Path) -> list[Path]:
    """Final test accuracy vs ε for every run, the paper's points overlaid."""
    fig, ax = plt.subplots(figsize=(7.5, 5))
    priv = df[df["epsilon"].notna() & (df["epsilon"] > 0) & df["epsilon"].apply(math.isfinite)]
    sweeps = priv[priv["kind"] == "sweep"]
    if len(sweeps):
        for panel, d in sweeps.groupby("panel"):
            ax.plot(d["epsilon"], 100 * d["test_accuracy"], ls="none", marker="o", ms=5, alpha=0.7,
                    label=f"Figure 5 sweep: {panel}")
    for preset, d in priv[priv["kind"] == "preset"].groupby("preset"):
        color = PRESET_COLOR.get(preset, "k")
        ax.plot(d["epsilon"], 100 * d["test_accuracy"], ls="none", marker="D", ms=8,
                color=color, label=f"ours: {claims.PRESET_LABEL.get(preset, preset)}")
        if "epsilon_pld_joint" in d:   # the same run under the correct joint charge, tight accountant
            ax.plot(d["epsilon_pld_joint"], 100 * d["test_accuracy"], ls="none", marker="D", ms=8, mfc="none",
                    mec=color)
    if (priv["kind"] == "preset").any() and "epsilon_pld_joint" in priv:
        ax.plot([], [], ls="none", marker="D", mfc="none", mec="k", label="same runs: ε joint, PLD (tight)")
    for preset, p in claims.PRESETS.items():
        if math.isfinite(p["epsilon"]):
            ax.plot([p["epsilon"]], [100 * p["accuracy"]], marker="*", ms=14, color="k", ls="none")
    ax.plot([], [], marker="*", ms=10, color="k", ls="none", label="paper (90/95/97 % at ε = 0.5/2/8)")
    nonpriv = df[df["preset"] == "mnist_nonprivate"]
    if len(nonpriv):
        ax.axhline(100 * nonpriv["test_accuracy"].iloc[0], color="tab:gray", ls="--",
                   label=f"ours: non-private {100 * nonpriv['test_accuracy'].iloc[0]:.2f} %")
    ax.axhline(100 * claims.PRESETS["mnist_nonprivate"]["accuracy"], color="k", ls=":",
               label="paper: non-private 98.3 %")
    _log_x(ax)
    ax.set_xlabel("ε at δ = 1e-5 (log scale)")
    ax.set_ylabel("final test accuracy (%)")
    lo = min(85.0, 100 * priv["test_accuracy"].min() - 2) if len(priv) else 85.0
    ax.set_ylim(lo, 100)
    ax.grid(alpha=0.3, which="both")
    ax.legend(fontsize=7, loc="lower right")
    conv = _convention(priv) if len(priv) else "n/a"
    ax.set_title(f"Privacy–utility: every run (MNIST, δ = 1e-5, q = L/N, σ per run)\n"
                 f"moments accountant, {conv}, DP-PCA charged", fontsize=9.5)
    return _save(fig, out, "privacy_utility")


def figure6(df: pd.DataFrame, out: Path) -> list[Path]:
    """CIFAR-10 accuracy vs epochs per ε (paper Figure 6): `experiments/figure6.py:draw`."""
    from .figure6 import draw
    return draw(df, out)


def frontier(df: pd.DataFrame, out: Path) -> list[Path]:
    from .frontier_figure import draw
    return draw(df, out)


# ----------------------------------------------------------------------------------------------
DRAWERS = [("figure2.csv", figure2), ("figure3.csv", figure3), ("figure4.csv", figure4),
           ("figure5.csv", figure5), ("figure6.csv", figure6), ("summary.csv", privacy_utility),
           ("frontier.csv", frontier)]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description="Redraw every figure from the committed CSVs in results/.")
    ap.add_argument("--results", type=Path, default=Path("results"), help="results folder (default: results)")
    ap.add_argument("--no-readme", action="store_true", help="do not regenerate results/README.md")
    args = ap.parse_args(argv)
    t0 = time.perf_counter()
    out = args.results / "figures"
    drawn = 0
    for csv, draw in DRAWERS:
        path = args.results / csv
        if not path.exists():
            src = "experiments.figure2" if csv == "figure2.csv" else "experiments.collect"
            print(f"skip {draw.__name__}: {path} not found (run `python -m {src}` first)")
            continue
        df = pd.read_csv(path, dtype={"value": str})
        if df.empty:
            print(f"skip {draw.__name__}: {path} has no rows")
            continue
        for p in draw(df, out):
            print(f"wrote {p}")
        drawn += 1
    if not args.no_readme:
        from .readme import write_readme
        print(f"wrote {write_readme(args.results)}")
    print(f"{drawn} figure(s) in {time.perf_counter() - t0:.1f} s")
    return 0 if drawn else 1


if __name__ == "__main__":
    sys.exit(main())
