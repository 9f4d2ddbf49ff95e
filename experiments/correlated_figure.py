"""The correlated-noise figure, from ``results/correlated_noise.csv`` only.

    python -m experiments.correlated_figure      # results/figures/correlated_noise.{png,pdf}
    (also drawn by ``make figures``)

Per setting, test accuracy against the target ε for DP-SGD, BandMF and BLT (mean ± sd over seeds,
equal ε and equal lots), and beside it the noise each carries: the per-step std (in units of the
DP-SGD run's σC) and the expected workload error relative to DP-SGD (σ × the strategy's error
ratio, the quantity the bands were chosen by).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import matplotlib.ticker
import pandas as pd

from .style import plt, save

TITLES = {
    "mnist_paper_tight": "paper network (DP-PCA + MLP), MNIST",
    "mnist_scatter_linear": "ScatterNet + linear, MNIST",
}
STYLE = {
    "dpsgd": ("DP-SGD (independent noise, Poisson)", "tab:gray", "o"),
    "bandmf": ("BandMF (cyclic Poisson, amplified)", "tab:blue", "s"),
    "blt": ("BLT (b-min-separation, not amplified)", "tab:red", "^"),
}


def summarise(df: pd.DataFrame) -> pd.DataFrame:
    """Mean and sd (ddof = 1) of accuracy (%) and the medians of the rest, per setting, ε, method."""
    g = df.assign(acc=100 * df["test_accuracy"]).groupby(
        ["setting", "epsilon_target", "method"], sort=False
    )
    return g.agg(
        mean=("acc", "mean"),
        sd=("acc", "std"),
        n=("acc", "size"),
        pred=("predicted_error_vs_dpsgd", "median"),
        std=("noise_std_per_step", "median"),
        wall=("wall_time_s", "median"),
        rss=("max_rss_mb", "median"),
        cpu=("cpu_time_s", "median"),
        state=("noise_state_mb", "max"),
        bands=("bands", "first"),
        buffers=("buffers", "first"),
        sigma=("sigma", "median"),
        eps=("epsilon_spent", "max"),
        lots=("lots", "max"),
        seeds=("seed", lambda v: ", ".join(str(int(x)) for x in sorted(v))),
    ).reset_index()


def table_rows(df: pd.DataFrame) -> list[str]:
    """The results/README.md section: per setting and ε, each method's accuracy (mean ± sd, n
    seeds), σ, noise std per step, predicted error vs DP-SGD, CPU time and peak memory."""
    s = summarise(df)
    lines = [
        "## Correlated noise: DP-SGD against BandMF and BLT at equal ε and equal lots",
        "",
        "`python -m experiments.correlated_noise` (docs/CORRELATED_NOISE.md): DP-SGD is the preset "
        "(Poisson, independent noise); BandMF (cyclic Poisson over b parts, b chosen before any "
        "run by σ_b × expected error) and BLT (b-min-separation, not amplified, at most 4 "
        "buffers) run the same lots at the σ that spends the same target ε (PLD, joint, δ = "
        "1e-5, DP-PCA included where the preset has it). Noise std per step: the per-coordinate "
        "std added at a late lot, σC × ‖row of the noise matrix‖; predicted error: σ × "
        "‖A·C⁻¹‖_F / ‖A‖_F relative to DP-SGD's (A the SGD or momentum workload). CPU time: "
        "user + system seconds of the whole run (one thread); memory: its peak RSS (the data "
        "dominate it) and, in brackets, the correlated noise's buffers.",
        "",
        "| setting | ε | method | test accuracy, mean ± sd (n) | σ | noise std per step | "
        "predicted error vs DP-SGD | lots | ε spent (max) | CPU time per run | peak RSS |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for _, r in s.iterrows():
        what = {
            "dpsgd": "DP-SGD",
            "bandmf": f"BandMF, b = {int(r['bands']) if r['bands'] == r['bands'] else '?'}",
            "blt": f"BLT, {int(r['buffers'])} buffers",
        }[r["method"]]
        lines.append(
            f"| `{r['setting']}` | {r['epsilon_target']:g} | {what} | {r['mean']:.2f} ± "
            f"{0.0 if r['sd'] != r['sd'] else r['sd']:.2f} % ({int(r['n'])}) | {r['sigma']:.4g} | "
            f"{r['std']:.3g} | ×{r['pred']:.3f} | {int(r['lots'])} | {r['eps']:.3f} | "
            f"{r['cpu'] / 60:.1f} min | {r['rss']:.0f} MB ({r['state']:.2f} MB) |"
        )
    return lines + [""]


def draw(df: pd.DataFrame, out: Path) -> list[Path]:
    """correlated_noise.png and .pdf in ``out``: a row per setting, accuracy | predicted error."""
    s = summarise(df)
    settings = [t for t in TITLES if t in set(s["setting"])]
    fig, axes = plt.subplots(
        len(settings), 2, figsize=(10, 3.6 * len(settings)), squeeze=False, layout="constrained"
    )
    for row, setting in zip(axes, settings):
        d = s[s["setting"] == setting]
        for m, (label, color, marker) in STYLE.items():
            dm = d[d["method"] == m].sort_values("epsilon_target")
            if not len(dm):
                continue
            n = (
                f"{int(dm['n'].min())}–{int(dm['n'].max())}"
                if dm["n"].nunique() > 1
                else (f"{int(dm['n'].iloc[0])}")
            )
            row[0].errorbar(
                dm["epsilon_target"],
                dm["mean"],
                yerr=dm["sd"].fillna(0),
                color=color,
                marker=marker,
                ms=4,
                capsize=3,
                label=f"{label} (n = {n} seeds)",
            )
            row[1].plot(dm["epsilon_target"], dm["pred"], color=color, marker=marker, label=label)
        for ax in row:
            ax.set_xscale("log")
            ax.set_xticks(sorted(set(d["epsilon_target"])))
            ax.xaxis.set_major_formatter(matplotlib.ticker.FormatStrFormatter("%g"))
            ax.xaxis.set_minor_locator(matplotlib.ticker.NullLocator())
            ax.set_xlabel("target ε (δ = 1e-5, PLD, joint convention)")
            ax.grid(alpha=0.3)
        row[0].set_ylabel("test accuracy (%)")
        row[0].set_title(f"{TITLES[setting]}: equal ε, equal lots")
        row[1].axhline(1.0, color="k", lw=0.5)
        row[1].set_ylabel("expected workload error / DP-SGD's")
        row[1].set_title("σ × ‖A·C⁻¹‖_F / ‖A‖_F, relative to DP-SGD")
        row[0].legend(fontsize=7)
    return save(fig, out, "correlated_noise")


def draw_file(results: Path) -> list[Path]:
    path = results / "correlated_noise.csv"
    if not path.exists():
        print(
            f"skip correlated_noise: {path} not found (run python -m experiments.correlated_noise)"
        )
        return []
    return draw(pd.read_csv(path), results / "figures")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--results", type=Path, default=Path(__file__).resolve().parents[1] / "results")
    a = ap.parse_args(argv)
    for p in draw_file(a.results):
        print(p)
    return 0


if __name__ == "__main__":
    sys.exit(main())
