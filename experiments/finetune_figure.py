"""The fine-tuning figure and table, from ``results/finetune.csv`` only.

    python -m experiments.finetune_figure     # results/figures/finetune.{png,pdf}
    (also drawn by ``make figures``, which writes results/README.md's table with ``table_rows``)

Left: MNIST test accuracy against the target ε (δ = 1e-5, Poisson, PLD) for each variant, mean ±
sd over seeds (dpsgd), Opacus's runs of the same model and lots as hollow markers. Right: seconds
per training epoch and peak memory (the run's peak RSS) of each variant at ε = 2, dpsgd beside
Opacus where Opacus ran.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import pandas as pd

from .style import plt, save

LABELS = {
    "full": "full fine-tuning",
    "lora": "LoRA (r = 8) + head",
    "bias": "bias terms + head",
    "head": "head only",
    "scratch": "from scratch",
}
COLORS = {
    "full": "tab:blue",
    "lora": "tab:green",
    "bias": "tab:purple",
    "head": "tab:orange",
    "scratch": "tab:gray",
}


def summarise(df: pd.DataFrame) -> pd.DataFrame:
    """Per engine, variant and target ε: accuracy (%) mean, sd (ddof 1; 0 for one seed), n, and
    the medians of σ, epochs, seconds per epoch and peak RSS."""
    g = df.assign(acc=100 * df["accuracy"]).groupby(
        ["engine", "variant", "epsilon_target"], sort=False
    )
    out = g.agg(
        mean=("acc", "mean"),
        sd=("acc", "std"),
        n=("acc", "size"),
        eps=("epsilon", "max"),
        sigma=("sigma", "median"),
        epochs=("epochs", "median"),
        lr=("lr", "first"),
        sec=("seconds_per_epoch", "median"),
        rss=("max_rss_mb", "median"),
        train_mb=("train_peak_mb", "median"),
        trainable=("trainable_params", "first"),
        seeds=("seed", lambda v: ", ".join(str(int(x)) for x in sorted(v))),
    ).reset_index()
    out["sd"] = out["sd"].fillna(0.0)
    order = {v: i for i, v in enumerate(LABELS)}
    return out.sort_values(
        ["engine", "epsilon_target", "variant"],
        key=lambda c: c.map(order) if c.name == "variant" else c,
    )


def draw(df: pd.DataFrame, out: Path) -> list[Path]:
    """finetune.png and finetune.pdf in ``out``."""
    s = summarise(df)
    fig, (ax, bx) = plt.subplots(1, 2, figsize=(10.4, 4.2), gridspec_kw={"width_ratios": [3, 2]})
    for v in LABELS:
        d = s[(s["engine"] == "dpsgd") & (s["variant"] == v)].sort_values("epsilon_target")
        if len(d):
            n = "–".join(sorted({str(int(x)) for x in d["n"]}))
            ax.errorbar(d["epsilon_target"], d["mean"], yerr=d["sd"], color=COLORS[v], marker="o",
                        ms=4, capsize=3, label=f"{LABELS[v]} (n = {n} seeds)")  # fmt: skip
        o = s[(s["engine"] == "opacus") & (s["variant"] == v)]
        if len(o):
            ax.plot(o["epsilon_target"], o["mean"], ls="none", marker="D", mfc="none", ms=8,
                    color=COLORS[v], label=f"Opacus, {LABELS[v]} (seed {o['seeds'].iloc[0]})")  # fmt: skip
    ax.set_xscale("log")
    ax.set_xticks([1, 2, 8])
    ax.set_xticklabels(["1", "2", "8"])
    ax.minorticks_off()
    ax.set_xlabel("target ε at δ = 1e-5 (Poisson lots, PLD; log scale)")
    ax.set_ylabel("MNIST test accuracy (%)")
    ax.set_title("ViT pretrained on Fashion-MNIST, fine-tuned privately on MNIST", fontsize=10)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7, loc="lower right")
    _cost_panel(bx, s)
    fig.tight_layout()
    return save(fig, out, "finetune")


def _cost_panel(bx, s: pd.DataFrame) -> None:
    eps = 2.0 if (s["epsilon_target"] == 2.0).any() else float(s["epsilon_target"].iloc[0])
    d = s[s["epsilon_target"] == eps]
    names = [v for v in LABELS if v in set(d["variant"])]
    for k, engine in enumerate(("dpsgd", "opacus")):
        e = d[d["engine"] == engine].set_index("variant")
        xs = [i + (k - 0.5) * 0.38 for i, v in enumerate(names) if v in e.index]
        vals = [e.loc[v, "sec"] for v in names if v in e.index]
        bars = bx.bar(xs, vals, width=0.36, color=[COLORS[v] for v in names if v in e.index],
                      alpha=1.0 if engine == "dpsgd" else 0.45, hatch=None if engine == "dpsgd" else "//",
                      label=engine)  # fmt: skip
        for b, v in zip(bars, [v for v in names if v in e.index]):
            bx.annotate(f"+{e.loc[v, 'train_mb']:.0f} MB", (b.get_x() + b.get_width() / 2, b.get_height()),
                        ha="center", va="bottom", fontsize=6)  # fmt: skip
    bx.set_xticks(range(len(names)))
    bx.set_xticklabels([LABELS[v].split(" (")[0] for v in names], rotation=20, fontsize=7)
    bx.set_ylabel("seconds per training epoch (1 thread)")
    bx.set_title(
        f"cost at ε = {eps:g}: dpsgd (solid), Opacus (hatched);\n"
        "label: peak memory of training above the loaded data and model",
        fontsize=8,
    )
    bx.grid(alpha=0.3, axis="y")


def _acc(r) -> str:
    """Mean ± sd % (n seeds); one seed has no spread to state."""
    if int(r["n"]) == 1:
        return f"{r['mean']:.2f} % (1)"
    return f"{r['mean']:.2f} ± {r['sd']:.2f} % ({int(r['n'])})"


def table_rows(df: pd.DataFrame) -> list[str]:
    """The results/README.md section: one row per engine, variant and ε."""
    s = summarise(df)
    hw = "; ".join(sorted(set(df["hardware"].astype(str))))
    lines = [
        "## Public pretraining, private fine-tuning (§5.3's idea at CPU size)",
        "",
        "A 139 k-parameter ViT (16 patches of 7 × 7, d = 64, 4 blocks) pretrained non-privately on "
        "Fashion-MNIST (public; `finetune_pretrain.json`), then fine-tuned on MNIST with DP-SGD "
        "(Poisson lots L = 1000, C = 1, momentum 0.9, 5 epochs, σ calibrated by PLD to spend the "
        "target ε at δ = 1e-5; ghost clipping); learning rates chosen at ε = 2 on 10 000 "
        "training examples held out (`finetune_tuning.csv`, not charged). Opacus runs the same "
        "model, lots, σ and momentum (hooks). Mean ± sd over seeds; seconds per epoch, training "
        "memory (the peak RSS while training above the RSS with data and model loaded) and the "
        f"process's peak RSS are medians, measured on {hw}, one thread, under other jobs' load. "
        "Rows: "
        "`finetune.csv`; figure: `figures/finetune.png`; rerun: `make finetune` "
        "(docs/FINETUNE.md).",
        "",
        "| engine | variant | ε | test accuracy (n seeds) | ε spent | σ | lr | trained params "
        "| s / epoch | training memory | peak RSS |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for _, r in s.iterrows():
        lines.append(
            f"| {r['engine']} | {LABELS.get(r['variant'], r['variant'])} | "
            f"{r['epsilon_target']:g} | {_acc(r)} | "
            f"{r['eps']:.3f} | {r['sigma']:.3f} | {r['lr']:g} | {int(r['trainable']):,} | "
            f"{r['sec']:.0f} | +{r['train_mb']:.0f} MB | {r['rss']:.0f} MB |"
        )
    return lines + [""]


def draw_file(results: Path) -> list[Path]:
    path = results / "finetune.csv"
    if not path.exists() or pd.read_csv(path).empty:
        print(f"skip finetune: {path} has no runs (run `python -m experiments.finetune` first)")
        return []
    return draw(pd.read_csv(path), results / "figures")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description="Draw results/figures/finetune.png.")
    ap.add_argument("--results", type=Path, default=Path("results"))
    paths = draw_file(ap.parse_args(argv).results)
    for p in paths:
        print(f"wrote {p}")
    return 0 if paths else 1


if __name__ == "__main__":
    sys.exit(main())
