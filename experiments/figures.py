"""Redraw every figure from the committed CSVs in results/ — no training, no accounting.

    python -m experiments.figures [--results results]

Writes results/figures/{figure2,figure3,figure4,figure5,privacy_utility}.{png,pdf} and regenerates
results/README.md (``experiments.readme``). A figure whose CSV is missing is skipped with a note,
so the script also works part-way through a ``make paper``.

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


def figure3(df: pd.DataFrame, out: Path) -> list[Path]:
    """Train/test accuracy vs epochs per preset, ε (δ = 1e-5) on a second axis (paper Figure 3)."""
    presets = [p for p in claims.PRESETS if p in set(df["preset"])]
    fig, axes = plt.subplots(1, len(presets), figsize=(4.4 * len(presets), 4.2), squeeze=False)
    for ax, preset in zip(axes[0], presets):
        d = df[df["preset"] == preset].sort_values("epoch")
        paper = claims.PRESETS[preset]
        ax.plot(d["epoch"], 100 * d["train_accuracy"], color="tab:blue", label="train accuracy")
        ax.plot(d["epoch"], 100 * d["test_accuracy"], color="tab:orange", label="test accuracy")
        ax.axhline(100 * paper["accuracy"], color="k", ls=":", lw=1,
                   label=f"paper: {100 * paper['accuracy']:g} % at ε = {_fmt(paper['epsilon'])}")
        ax.set_xlabel("epoch")
        ax.set_ylabel("accuracy (%)")
        ax.set_ylim(80, 100)
        ax.grid(alpha=0.3)
        r = d.iloc[0]
        if preset != "mnist_nonprivate" and d["epsilon"].notna().any():
            ax2 = ax.twinx()
            ax2.plot(d["epoch"], d["epsilon"], color="tab:red", ls="--", label="ε, moments (run's convention)")
            if "epsilon_pld_joint" in d and d["epsilon_pld_joint"].notna().any():
                ax2.plot(d["epoch"], d["epsilon_pld_joint"], color="tab:green", ls="-.",
                         label="ε, PLD joint (tight)")
            ax2.axhline(paper["epsilon"], color="tab:red", ls=":", lw=0.8)
            ax2.set_ylabel("ε (at δ = 1e-5)", color="tab:red")
            ax2.set_ylim(0, 1.6 * max(paper["epsilon"], d["epsilon"].max()))
            h1, l1 = ax.get_legend_handles_labels()
            h2, l2 = ax2.get_legend_handles_labels()
            ax2.legend(h1 + h2, l1 + l2, fontsize=7, loc="lower right", framealpha=0.9)
            ax.set_title(f"{claims.PRESET_LABEL[preset]}: q = {r['q']:.3g}, σ = {r['sigma']:g}, "
                         f"σ_p = {r['sigma_p']:g}, δ = {r['delta']:g}\nmoments accountant, "
                         f"{_convention(d)}, DP-PCA charged", fontsize=8.5)
        else:
            ax.legend(fontsize=7, loc="lower right")
            ax.set_title(f"{claims.PRESET_LABEL[preset]}: q = {r['q']:.3g}, no noise, no clipping\n"
                         "(no privacy guarantee)", fontsize=8.5)
    fig.suptitle("Figure 3 — MNIST accuracy vs epochs (60-d PCA, 1000 hidden units, L = 600, C = 4)",
                 fontsize=11)
    fig.tight_layout()
    return _save(fig, out, "figure3")


def figure4(df: pd.DataFrame, out: Path) -> list[Path]:
    """Test accuracy vs ε for several δ (paper Figure 4), one panel per accountant/convention."""
    keys = list(df.groupby(["accountant", "convention"], sort=False).groups)
    fig, axes = plt.subplots(1, len(keys), figsize=(5.6 * len(keys), 4.4), squeeze=False)
    markers = {"mnist_small": "o", "mnist_medium": "s", "mnist_large": "^"}
    for ax, (acc, conv) in zip(axes[0], keys):
        d = df[(df["accountant"] == acc) & (df["convention"] == conv)]
        cmap = plt.get_cmap("viridis")
        deltas = sorted(d["delta"].unique())
        for i, delta in enumerate(deltas):
            color = cmap(i / max(1, len(deltas) - 1))
            label = f"δ = {delta:g}"
            for preset, m in markers.items():
                dd = d[(d["delta"] == delta) & (d["preset"] == preset)].sort_values("epsilon")
                if len(dd):
                    ax.plot(dd["epsilon"], 100 * dd["test_accuracy"], color=color, marker=m, ms=2.5,
                            lw=1, label=label)
                    label = None
        for preset, m in markers.items():
            p = claims.PRESETS[preset]
            ax.plot([p["epsilon"]], [100 * p["accuracy"]], marker="*", ms=13, color="k", ls="none")
            ax.plot([], [], marker=m, color="gray", ls="none", label=claims.PRESET_LABEL[preset])
        ax.plot([], [], marker="*", ms=10, color="k", ls="none", label="paper (δ = 1e-5, its accounting)")
        _log_x(ax)
        ax.set_xlabel("ε (log scale)")
        ax.set_ylabel("test accuracy (%)")
        ax.set_ylim(80, 100)
        ax.grid(alpha=0.3, which="both")
        ax.legend(fontsize=7, loc="lower right", ncol=2)
        ax.set_title(f"{acc} accountant, {CONVENTION_TEXT.get(conv, conv)}, DP-PCA charged", fontsize=9)
    q = df["q"].iloc[0] if "q" in df else float("nan")
    fig.suptitle(f"Figure 4 — test accuracy vs ε at δ ∈ {{{', '.join(f'{x:g}' for x in claims.FIGURE4_DELTAS)}}}: "
                 f"small/medium/large presets (q = {q:.3g}, σ = 2/4/8), one point per epoch", fontsize=10)
    fig.tight_layout()
    return _save(fig, out, "figure4")


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


# ----------------------------------------------------------------------------------------------
DRAWERS = [("figure2.csv", figure2), ("figure3.csv", figure3), ("figure4.csv", figure4),
           ("figure5.csv", figure5), ("summary.csv", privacy_utility)]


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
