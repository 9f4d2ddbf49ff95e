"""Collect Hydra run / multirun folders into the tidy CSVs of results/.

    python -m experiments.collect [--roots outputs multirun] [--results results]

Writes ``figure3.csv``, ``figure4.csv``, ``figure5.csv``, ``summary.csv``, ``figure6.csv`` (when
CIFAR-10 runs exist) and ``runs/<preset>/``, from complete runs only.

Details: docs/DEVELOPMENT.md, "experiments/collect.py".
"""

from __future__ import annotations

import argparse
import math
import shutil
import sys
from dataclasses import dataclass, field
from pathlib import Path

import pandas as pd

from dpsgd.accountant import Ledger
from dpsgd.accountant.ledger import Entry
from dpsgd.core.runtime import describe_hardware

from . import claims, figure6
from .paths import ROOT, repo_relative
from .runs import TINY_OVERRIDES, find_runs, is_complete, is_tiny, override_key, preset_of, run_row

NOT_SWEPT = ("sweep", "seed", "device", "experiment", "name") + TINY_OVERRIDES


def panel_value(panel: str, c: dict, overrides=()):
    """(parameter, value label) of a Figure-5 run from its resolved config (other sweeps:
    overrides)."""
    m, p, t = c.get("model", {}), c.get("privacy", {}), c.get("training", {})
    if panel == "pca_dims":
        if m.get("projection") == "none" or not m.get("pca_dims"):
            return "model.projection/pca_dims", "none"
        return "model.projection/pca_dims", (
            f"random {m['pca_dims']}" if m["projection"] == "random" else str(m["pca_dims"])
        )
    if panel == "hidden_units":
        return "model.hidden", "x".join(str(h) for h in m.get("hidden", []))
    key = claims.FIGURE5_PANELS.get(panel, (None,))[0]
    if key is None:  # a sweep file of the user's own: its swept overrides
        swept = [o.lstrip("+~") for o in overrides if override_key(o) not in NOT_SWEPT]
        return ",".join(o.split("=", 1)[0] for o in swept), ",".join(
            o.split("=", 1)[-1] for o in swept
        )
    group, name = key.split(".", 1)
    val = {"privacy": p, "training": t, "model": m}[group].get(name)
    return key, f"{val:g}" if isinstance(val, (int, float)) else str(val)


# ------------------------------------------------------------------------------------- classify
@dataclass
class Classified:
    """The runs each CSV is made of: one per preset, one per sweep point and seed."""

    presets: dict[str, dict] = field(default_factory=dict)  # §5.2 preset -> run
    cifar: dict[str, dict] = field(default_factory=dict)  # §5.3 (CIFAR-10) preset -> run
    sweeps: dict[tuple, dict] = field(default_factory=dict)  # (panel, value, seed) -> run


def _keep(group: dict, key, r: dict, label: str) -> None:
    if key in group:
        print(f"  {label}: newer run {r['dir']} replaces {group[key]['dir']}")
    group[key] = r


def classify(
    runs: list[dict], include_tiny: bool = False, pinned: dict[str, Path] | None = None
) -> Classified:
    """Sort complete runs into presets and sweep points; of several runs of one, the most recent (or
    the one ``pinned`` names for its preset) is kept. Runs of neither kind are left out."""
    pinned = {k: Path(v).resolve() for k, v in (pinned or {}).items()}
    out = Classified()
    for r in sorted(runs, key=lambda r: r["mtime"]):
        pr, group = preset_of(r, include_tiny), out.presets
        if pr is None:
            pr, group = preset_of(r, include_tiny, presets=claims.CIFAR10_PRESETS), out.cifar
        if pr is not None:
            if pr not in pinned or Path(r["dir"]).resolve() == pinned[pr]:
                _keep(group, pr, r, pr)
        elif r["choices"].get("sweep"):
            panel = r["choices"]["sweep"]
            key = (
                panel,
                panel_value(panel, r["config"], r["overrides"])[1],
                r["config"].get("seed"),
            )
            _keep(out.sweeps, key, r, f"sweep {key}")
    return out


# ------------------------------------------------------------------------------------- Figure 4
def ledger_prefix(entries: list[dict], steps: int) -> list[Entry]:
    """The releases a run had made after its first ``steps`` SGD lots (other releases kept in
    order)."""
    out, left = [], steps
    for e in entries:
        e = Entry(**e)
        if e.label != "sgd":
            out.append(e)
            continue
        n = min(e.count, left)
        if n > 0:
            out.append(Entry(e.q, e.sigma, n, e.groups, e.label))
        left -= n
    return out


def figure4_rows(preset: str, r: dict, deltas=claims.FIGURE4_DELTAS) -> list[dict]:
    entries = r["privacy"]["ledger"]["entries"]
    conv = r["privacy"]["convention"]["configured"]
    rows = []
    for m in r["metrics"].itertuples():
        led = Ledger(ledger_prefix(entries, int(m.steps)))
        eps_pld = dict(
            zip(deltas, led.epsilons(deltas, accountant="pld", convention="joint"))
        )  # composed once
        for delta in deltas:
            base = {
                "preset": preset,
                "epoch": m.epoch,
                "steps": m.steps,
                "q": m.q,
                "sigma": m.sigma,
                "sigma_p": m.sigma_p,
                "train_accuracy": m.train_accuracy,
                "test_accuracy": m.test_accuracy,
                "delta": delta,
            }
            for acc, cv in dict.fromkeys([("moments", conv), ("moments", "joint")]):
                rows.append(
                    {
                        **base,
                        "accountant": acc,
                        "convention": cv,
                        "epsilon": led.epsilon(delta, accountant=acc, convention=cv)[0],
                    }
                )
            rows.append(
                {**base, "accountant": "pld", "convention": "joint", "epsilon": eps_pld[delta]}
            )
    return rows


# ------------------------------------------------------------------------------------- writers
def write_runs(results: Path, presets: dict[str, dict]) -> None:
    """runs/<preset>/: the preset runs' metrics.csv, privacy.json and Hydra config, as training
    wrote them."""
    for p, r in presets.items():
        dst = results / "runs" / p
        dst.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(r["dir"] / "metrics.csv", dst / "metrics.csv")
        shutil.copyfile(r["dir"] / "privacy.json", dst / "privacy.json")
        shutil.copyfile(r["dir"] / ".hydra" / "config.yaml", dst / "config.yaml")


def write_figure3(results: Path, presets: dict[str, dict]) -> int:
    """figure3.csv: the presets' metrics.csv rows, a ``preset`` column first. Returns the rows
    written."""
    if not presets:
        return 0
    f3 = pd.concat([r["metrics"].assign(preset=p) for p, r in presets.items()], ignore_index=True)
    f3 = f3[["preset"] + [c for c in f3.columns if c != "preset"]]
    f3.to_csv(results / "figure3.csv", index=False)
    return len(f3)


def write_figure4(results: Path, presets: dict[str, dict]) -> int:
    """figure4.csv: ε per private preset, epoch, δ and accountant (``figure4_rows``)."""
    f4 = [
        row for p, r in presets.items() if r["privacy"].get("private") for row in figure4_rows(p, r)
    ]
    if f4:
        pd.DataFrame(f4).to_csv(results / "figure4.csv", index=False)
    return len(f4)


def write_figure6(results: Path, cifar: dict[str, dict], hardware: str) -> int:
    """figure6.csv: the CIFAR-10 presets' per-epoch rows (``experiments.figure6.rows``)."""
    if not cifar:
        return 0
    f6 = figure6.rows(cifar, repo_relative, hardware)
    f6.to_csv(results / "figure6.csv", index=False)
    return len(f6)


def figure5_rows(sweeps: dict[tuple, dict], medium: dict | None, hardware: str) -> list[dict]:
    """One row per sweep run, plus the medium preset run as the centre of each panel it shares."""
    f5 = []
    for (panel, value, _seed), r in sweeps.items():
        param, _ = panel_value(panel, r["config"], r["overrides"])
        f5.append(
            {
                "panel": panel,
                "parameter": param,
                "value": value,
                "source": "sweep",
                **run_row(r, hardware),
            }
        )
    if medium is None:
        return f5
    for panel in sorted({row["panel"] for row in f5}):
        if panel == "learning_rate":  # the sweep holds η constant; the preset decays it: no centre
            continue
        param, value = panel_value(panel, medium["config"])
        if not any(row["panel"] == panel and row["value"] == value for row in f5):
            f5.append(
                {
                    "panel": panel,
                    "parameter": param,
                    "value": value,
                    "source": "preset:mnist_medium",
                    **run_row(medium, hardware),
                }
            )
    return f5


def write_figure5(
    results: Path, sweeps: dict[tuple, dict], medium: dict | None, hardware: str
) -> int:
    """figure5.csv: ``figure5_rows`` in the paper's panel order, each panel by value, then seed."""
    f5 = figure5_rows(sweeps, medium, hardware)
    if not f5:
        return 0
    order = {p: i for i, p in enumerate(claims.FIGURE5_PANELS)}
    df5 = pd.DataFrame(f5)
    df5["_o"] = df5["panel"].map(order).fillna(len(order))
    df5["_v"] = pd.to_numeric(df5["value"], errors="coerce").fillna(
        math.inf
    )  # 'none', 'random 60' last
    df5 = df5.sort_values(["_o", "panel", "_v", "value", "seed"]).drop(columns=["_o", "_v"])
    df5.to_csv(results / "figure5.csv", index=False)
    return len(df5)


def write_summary(
    results: Path, presets: dict[str, dict], sweeps: dict[tuple, dict], hardware: str
) -> int:
    """summary.csv: one row per preset and sweep run (``experiments.runs.run_row``)."""
    summ = [
        {"kind": "preset", "preset": p, "panel": None, "value": None, **run_row(r, hardware)}
        for p, r in presets.items()
    ]
    summ += [
        {
            "kind": "sweep",
            "preset": "mnist_medium",
            "panel": panel,
            "value": value,
            **run_row(r, hardware),
        }
        for (panel, value, _seed), r in sweeps.items()
    ]
    if summ:
        pd.DataFrame(summ).to_csv(results / "summary.csv", index=False)
    return len(summ)


# ------------------------------------------------------------------------------------- main
def collect(
    roots: list[Path],
    results: Path,
    include_tiny: bool = False,
    hardware: str | None = None,
    pinned: dict[str, Path] | None = None,
) -> dict:
    """Write the CSVs; ``pinned`` maps a preset to the run folder to use (else the most recent).
    Returns {file: rows written}."""
    hardware = hardware or describe_hardware()
    runs = [r for r in find_runs(roots) if is_complete(r) and (include_tiny or not is_tiny(r))]
    c = classify(runs, include_tiny, pinned)
    results.mkdir(parents=True, exist_ok=True)
    write_runs(results, {**c.presets, **c.cifar})
    written = {
        "figure3.csv": write_figure3(results, c.presets),
        "figure4.csv": write_figure4(results, c.presets),
        "figure6.csv": write_figure6(results, c.cifar, hardware),
        "figure5.csv": write_figure5(results, c.sweeps, c.presets.get("mnist_medium"), hardware),
        "summary.csv": write_summary(results, c.presets, c.sweeps, hardware),
    }
    return {name: n for name, n in written.items() if n}


def _pinned_runs(ap: argparse.ArgumentParser, items: list[str]) -> dict[str, Path]:
    pinned = {}
    known = list(claims.PRESETS) + list(claims.CIFAR10_PRESETS)
    for item in items:
        preset, sep, path = item.partition("=")
        if not sep or preset not in known or not (Path(path) / "metrics.csv").exists():
            ap.error(
                f"--run {item!r}: expected PRESET=DIR with PRESET in {known} "
                "and DIR a run folder holding metrics.csv"
            )
        pinned[preset] = Path(path)
    return pinned


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description="Collect Hydra runs into the tidy CSVs of results/.")
    ap.add_argument(
        "--roots",
        nargs="+",
        type=Path,
        default=[ROOT / "outputs", ROOT / "multirun"],
        help="folders searched for run directories (default: outputs multirun)",
    )
    ap.add_argument("--results", type=Path, default=ROOT / "results")
    ap.add_argument(
        "--include-tiny",
        action="store_true",
        help="also take runs with dataset.subset or training.max_steps (tests)",
    )
    ap.add_argument(
        "--hardware", help="hardware string recorded per run (default: this machine's CPU)"
    )
    ap.add_argument(
        "--run",
        action="append",
        default=[],
        metavar="PRESET=DIR",
        help="use this run folder for a preset (default: its most recent complete run)",
    )
    args = ap.parse_args(argv)
    written = collect(
        args.roots, args.results, args.include_tiny, args.hardware, _pinned_runs(ap, args.run)
    )
    if not written:
        print("no complete runs found under " + ", ".join(map(str, args.roots)))
        return 1
    for name, n in written.items():
        print(f"wrote {args.results / name} ({n} rows)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
