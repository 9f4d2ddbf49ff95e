"""What each batch sampler costs: ε per sampler at the paper's MNIST schedule and at one
frontier setting, and the test accuracy of mnist_scatter_linear at ε = 2 under each sampler.

    # results/samplers.csv (accounting only, seconds)
    python -m experiments.samplers measure
    # results/samplers_accuracy.csv from run folders
    python -m experiments.samplers accuracy RUNS...
    python -m experiments.samplers figure             # results/figures/samplers.png from the CSV

ε comes from ``dpsgd.privacy.sampler_epsilon`` (each sampler's own charges, every accountant
that serves it, the smallest valid one); shuffle adds its lower bound (Chua et al. 2024) and the
Poisson number a shuffled run would wrongly report; fixed_size adds the ε one dataset pair with
constant gradients already loses (its lower end) and Poisson's ε under replace-one. Adjacency
differs between samplers (add/remove vs replace-one): the CSV names it on every row.
"""

from __future__ import annotations

import json
import platform
import sys
from pathlib import Path

import pandas as pd

RESULTS = Path(__file__).resolve().parent.parent / "results"
# (setting, N, L, B, σ, lots, δ): the paper's MNIST schedule (mnist_medium: 10751 lots) and a
# frontier point at small σ, where shuffling and Poisson part ways
SETTINGS = [
    ("paper_mnist", 60000, 600, 660, 4.0, 10751, 1e-5),
    ("frontier_sigma1.1", 60000, 600, 660, 1.1, 1000, 1e-5),
]
SAMPLERS = ("poisson", "truncated_poisson", "fixed_size", "balls_in_bins", "shuffle")


def measure(out: Path = RESULTS / "samplers.csv") -> pd.DataFrame:
    from dpsgd.privacy import sampler_epsilon

    rows = []
    for setting, N, L, B, sigma, lots, delta in SETTINGS:
        for name in SAMPLERS:
            r = sampler_epsilon(name, N, L, sigma, lots, delta, B)
            rows.append(
                {
                    "setting": setting,
                    "sampler": name,
                    "N": N,
                    "L": L,
                    "B": B if name == "truncated_poisson" else None,
                    "sigma": sigma,
                    "lots": lots,
                    "delta": delta,
                    "epsilon": r["epsilon"],
                    "accountant": r["accountant"],
                    "adjacency": r["adjacency"],
                    "epsilon_lower": r.get("epsilon_lower"),
                    "epsilon_if_poisson": r.get("epsilon_if_poisson"),
                    "epsilon_poisson_replace_one": r.get("epsilon_poisson_replace_one"),
                    "seconds": round(r["seconds"], 3),
                    "cpu": platform.processor() or platform.machine(),
                }
            )
    df = pd.DataFrame(rows)
    df.to_csv(out, index=False)
    return df


def accuracy(run_dirs, out: Path = RESULTS / "samplers_accuracy.csv") -> pd.DataFrame:
    """One row per finished run folder: sampler, seed, ε, accountant, adjacency, σ, test
    accuracy."""
    rows = []
    for d in map(Path, run_dirs):
        st = json.loads((d / "privacy.json").read_text())
        m = pd.read_csv(d / "metrics.csv")
        rows.append(
            {
                "sampler": st["sampling"]["name"],
                "seed": st["config_fingerprint"].get("seed"),
                "status": st["status"],
                "epsilon": st["epsilon"],
                "accountant": st["accountant"],
                "adjacency": st["sampling"]["neighbouring_relation"],
                "sigma": st["config_fingerprint"].get("privacy.sigma"),
                "max_lot_size": st["sampling"]["max_lot_size"],
                "lots": st["steps"],
                "test_accuracy": float(m["test_accuracy"].iloc[-1]),
                "run": d.name,
            }
        )
    df = pd.DataFrame(rows).sort_values(["sampler", "seed"])
    df.to_csv(out, index=False)
    return df


def figure(
    csv: Path = RESULTS / "samplers.csv", out: Path = RESULTS / "figures" / "samplers.png"
) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    df = pd.read_csv(csv)
    fig, axes = plt.subplots(1, len(SETTINGS), figsize=(5.5 * len(SETTINGS), 4))
    for ax, (setting, N, L, B, sigma, lots, delta) in zip(axes, SETTINGS):
        d = df[df.setting == setting].set_index("sampler").loc[list(SAMPLERS)]
        x = range(len(d))
        ax.bar(x, d.epsilon, color=["C0", "C1", "C2", "C3", "C4"])
        sh = d.loc["shuffle"]
        i = list(SAMPLERS).index("shuffle")
        ax.vlines(i, sh.epsilon_lower, sh.epsilon, color="k", lw=3, label="shuffle [lower, upper]")
        ax.plot(
            [i], [sh.epsilon_if_poisson], "rx", ms=10, label="Poisson ε a shuffled run would report"
        )
        fs, j = d.loc["fixed_size"], list(SAMPLERS).index("fixed_size")
        ax.vlines(
            j,
            fs.epsilon_lower,
            fs.epsilon,
            color="0.3",
            lw=3,
            label="fixed_size [one constant-gradient pair, upper]",
        )
        ax.plot(
            [j], [fs.epsilon_poisson_replace_one], "k+", ms=10, label="Poisson under replace-one"
        )
        ax.set_xticks(list(x), [f"{s}\n({a})" for s, a in zip(d.index, d.adjacency)], fontsize=7)
        ax.set_yscale("log")
        ax.set_ylabel(f"ε at δ={delta:g}")
        ax.set_title(f"N={N}, L={L}, σ={sigma:g}, {lots} lots (B={B})", fontsize=9)
        ax.legend(fontsize=7)
    fig.tight_layout()
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=120)


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if not argv or argv[0] not in ("measure", "accuracy", "figure"):
        print(
            "usage: python -m experiments.samplers measure | accuracy RUN_DIR... | figure",
            file=sys.stderr,
        )
        return 2
    if argv[0] == "measure":
        print(measure().to_string(index=False))
    elif argv[0] == "accuracy":
        print(accuracy(argv[1:]).to_string(index=False))
    else:
        figure()
    return 0


if __name__ == "__main__":
    sys.exit(main())
