"""The membership-inference risk of the paper's three MNIST presets: the f-DP trade-off curve.

    python -m experiments.risk_figure      # results/risk.csv (accounting only), then the figure

For each preset (q = 0.01, its lots, σ/√2: the joint charge of its two clipped groups, the DP-PCA
release left out, as in docs/ACCOUNTING.md, "Why accountants disagree"), the highest true-positive
rate of any membership test at each false-positive rate that the composed PLD allows
(``dpsgd.accountant.risk``: the envelope of the supporting lines (ε(δ), δ) over its δ grid).
``draw`` redraws results/figures/risk.{png,pdf} from the CSV (``python -m experiments.figures``).
"""

from __future__ import annotations

import math
from pathlib import Path

import numpy as np

from .style import plt, save

RESULTS = Path(__file__).resolve().parent.parent / "results"
# (preset, σ of the run, lots): the paper's three MNIST presets
PRESETS = [("mnist_small", 2.0, 35318), ("mnist_medium", 4.0, 10751), ("mnist_large", 8.0, 1450)]
FPR = np.logspace(-4, 0, 81)


def measure(out: Path = RESULTS / "risk.csv") -> None:
    import pandas as pd

    from dpsgd.accountant import Ledger, risk
    from dpsgd.accountant.events import Poisson

    rows = []
    for preset, sigma, lots in PRESETS:
        led = Ledger()
        led.record(Poisson(0.01, sigma / math.sqrt(2)), lots, preset)
        eps, deltas = risk.curve(led)
        e_1e5 = led.epsilon(1e-5, "pld")[0]
        for a, t in zip(FPR, risk.tpr_bound(eps, deltas, FPR)):
            rows.append({"preset": preset, "sigma": sigma, "lots": lots, "epsilon_at_1e-5": e_1e5,
                         "fpr": float(a), "tpr": float(t)})  # fmt: skip
    pd.DataFrame(rows).to_csv(out, index=False)


def draw(df, out: Path) -> list[Path]:
    """TPR against FPR (log–log) per preset, with chance (TPR = FPR) and the reported FPRs."""
    fig, ax = plt.subplots(figsize=(4.8, 3.6))
    for preset, d in df.groupby("preset", sort=False):
        r = d.iloc[0]
        label = f"{preset} (σ = {r.sigma:g}, ε = {r['epsilon_at_1e-5']:.2f} at δ = 1e-5)"
        ax.plot(d.fpr, d.tpr, label=label)
    ax.plot(FPR, FPR, "k:", lw=1, label="chance (TPR = FPR)")
    for a in (0.001, 0.01, 0.1):
        ax.axvline(a, color="0.85", lw=0.8, zorder=0)
    ax.set_xscale("log")
    ax.set_yscale("log")
    ax.set_xlim(1e-4, 1)
    ax.set_ylim(1e-4, 1.05)
    ax.set_xlabel("false-positive rate of a membership test")
    ax.set_ylabel("highest true-positive rate allowed")
    ax.set_title("Membership risk of the paper's presets (PLD, q = 0.01, joint σ/√2)", fontsize=8)
    ax.legend(fontsize=6, loc="lower right")
    return save(fig, out, "risk")


if __name__ == "__main__":
    import pandas as pd

    measure()
    print("\n".join(str(p) for p in draw(pd.read_csv(RESULTS / "risk.csv"), RESULTS / "figures")))
