"""Figure 2 of Abadi et al. 2016: ε vs epochs for q = 0.01, σ = 4, δ = 1e-5 — accountant only.

    python -m experiments.figure2 [--max-epochs 400] [--out results/figure2.csv]

``compute`` writes the CSV; ``draw`` (called by ``python -m experiments.figures``) draws
results/figures/figure2.{png,pdf} from it, with the paper's stated values (``experiments.claims``).

Curves (one tidy row per (curve, epoch)):
- ``moments``: the paper's moments accountant (§3.2, Theorem 2: λ = 1..32, tail bound);
- ``strong_composition_paper``: the paper's comparator (advanced composition, Dwork–Rothblum–Vadhan
  2010, with the *linear* amplification ε' = qε0). At the paper's point ε0 ≈ 1.46 the linear
  amplification does not hold, so this curve is NOT a valid privacy bound (``valid_bound = False``);
- ``strong_composition_valid``: the same with the correct amplification ε' = log(1 + q(e^ε0 − 1));
- ``rdp_improved``: RDP of the Poisson-subsampled Gaussian (Mironov, Talwar, Zhang 2019) with the
  improved RDP → (ε, δ) conversion (Balle et al. 2020);
- ``pld``: the privacy loss distribution, FFT composition, pessimistic discretisation (an upper
  bound).

Details: docs/DEVELOPMENT.md, "experiments/figure2.py".
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import numpy as np
import pandas as pd

from dpsgd.accountant import Ledger
from dpsgd.accountant.events import Poisson
from dpsgd.accountant import strong_composition as sc
from dpsgd.accountant.calibrate import lots_for_epochs

from . import claims
from .style import plt, save

Q, SIGMA, DELTA = 0.01, 4.0, 1e-5

CURVES = {  # curve -> (accountant, conversion, valid_bound)
    "moments": ("moments", "tail bound, λ = 1..32 (paper)", True),
    "rdp_improved": ("rdp", "improved (Balle et al. 2020)", True),
    "pld": ("pld", "PLD, pessimistic discretisation", True),
    "strong_composition_paper": (
        "strong_composition",
        "paper variant: linear amplification qε0",
        False,
    ),
    "strong_composition_valid": (
        "strong_composition",
        "valid amplification log(1+q(e^ε0−1)), exact Gaussian ε0 (Balle & Wang 2018)",
        True,
    ),
}
CURVE_STYLE = {  # curve -> (label, colour, linestyle)
    "moments": ("moments accountant (paper: λ ≤ 32, tail bound)", "tab:blue", "-"),
    "rdp_improved": ("RDP, improved conversion (Balle et al. 2020)", "tab:purple", "-."),
    "pld": ("PLD, tight (pessimistic discretisation)", "tab:green", ":"),
    "strong_composition_paper": (
        "strong composition, paper variant (NOT a valid bound)",
        "tab:red",
        "--",
    ),
    "strong_composition_valid": ("strong composition, valid amplification", "tab:orange", "-"),
}


def _ledger(steps: int, q: float, sigma: float) -> Ledger:
    led = Ledger()
    led.record(Poisson(q, sigma), int(steps), "sgd")
    return led


def epsilon(
    curve: str, steps: int, q: float = Q, sigma: float = SIGMA, delta: float = DELTA
) -> tuple[float, float]:
    """(ε, order) of one curve after ``steps`` lots; order is λ* / the RDP order, NaN otherwise."""
    accountant = CURVES[curve][0]
    if accountant == "strong_composition":
        variant = "paper" if curve.endswith("paper") else "valid"
        return float(
            sc.epsilon(q=q, sigma=sigma, steps=int(steps), delta=delta, variant=variant)
        ), float("nan")
    eps, order = _ledger(steps, q, sigma).epsilon(delta, accountant=accountant, convention="joint")
    return float(eps), float("nan") if order is None else float(order)


def compute(
    max_epochs: int = 400,
    every: int = 1,
    pld_every: int = 1,
    q: float = Q,
    sigma: float = SIGMA,
    delta: float = DELTA,
    curves: tuple[str, ...] = tuple(CURVES),
) -> pd.DataFrame:
    rows = []
    for curve in curves:
        step = pld_every if curve == "pld" else every
        epochs = np.arange(step, max_epochs + 1, step)
        if curve == "pld" and 1 not in epochs:
            epochs = np.concatenate([[1, 2, 5], epochs])
        t0 = time.perf_counter()
        for e in epochs:
            steps = lots_for_epochs(e, 1, q)  # q = L/N: N/L = 1/q lots an epoch
            eps, order = epsilon(curve, steps, q, sigma, delta)
            acc, conv, valid = CURVES[curve]
            rows.append(
                {
                    "epoch": int(e),
                    "steps": steps,
                    "q": q,
                    "sigma": sigma,
                    "delta": delta,
                    "curve": curve,
                    "accountant": acc,
                    "conversion": conv,
                    "valid_bound": valid,
                    "epsilon": eps,
                    "order": order,
                }
            )
        print(
            f"  {curve:26s} {len(epochs):4d} points in {time.perf_counter() - t0:6.1f} s",
            flush=True,
        )
    # the origin: nothing released, ε = 0
    for curve in curves:
        acc, conv, valid = CURVES[curve]
        rows.append(
            {
                "epoch": 0,
                "steps": 0,
                "q": q,
                "sigma": sigma,
                "delta": delta,
                "curve": curve,
                "accountant": acc,
                "conversion": conv,
                "valid_bound": valid,
                "epsilon": 0.0,
                "order": float("nan"),
            }
        )
    return pd.DataFrame(rows).sort_values(["curve", "epoch"]).reset_index(drop=True)


def draw(df: pd.DataFrame, out: Path) -> list[Path]:
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
            ax.annotate(
                f"paper {eps:g}",
                (epochs, eps),
                textcoords="offset points",
                xytext=(-58, 6) if epochs >= df["epoch"].max() else (6, -12),
                fontsize=8,
                color=color,
            )
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
    fig.suptitle(
        f"Figure 2 — ε vs epochs: q = {s['q']:g}, σ = {s['sigma']:g}, δ = {s['delta']:g}; "
        "one clipped group (k = 1, conventions coincide), Poisson sampling",
        fontsize=11,
    )
    return save(fig, out, "figure2")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--max-epochs", type=int, default=400)
    ap.add_argument("--every", type=int, default=1, help="epoch grid for the cheap curves")
    ap.add_argument("--pld-every", type=int, default=1, help="epoch grid for the PLD curve")
    ap.add_argument("--out", type=Path, default=Path("results/figure2.csv"))
    args = ap.parse_args(argv)
    for name in ("max_epochs", "every", "pld_every"):
        if getattr(args, name) < 1:
            ap.error(f"--{name.replace('_', '-')} must be >= 1")
    print(f"Figure 2: q = {Q}, σ = {SIGMA}, δ = {DELTA}, epochs 0..{args.max_epochs}")
    df = compute(args.max_epochs, args.every, args.pld_every)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    df.to_csv(args.out, index=False)
    for e in (100, 400):
        d = df[df["epoch"] == e]
        if len(d):
            print(f"  E = {e}: " + ", ".join(f"{r.curve} {r.epsilon:.3f}" for r in d.itertuples()))
    print(f"wrote {args.out} ({len(df)} rows)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
