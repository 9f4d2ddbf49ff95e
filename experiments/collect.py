"""Collect Hydra run / multirun folders into the tidy CSVs of results/.

    python -m experiments.collect [--roots outputs multirun] [--results results]

Reads every run folder holding ``metrics.csv`` + ``privacy.json`` + ``.hydra/`` and writes
- ``figure3.csv``: the per-epoch rows of the four §5.2 presets (``preset`` column added);
- ``figure4.csv``: for each private preset and epoch, ε at δ ∈ {1e-5, 1e-4, 1e-3, 1e-2}, recomputed
  from the run's ledger (privacy.json) truncated to that epoch's lots: moments accountant under the
  run's convention (the paper's per-tensor charges) and joint, and the tight PLD (joint);
- ``figure5.csv``: one row per Figure-5 sweep run (panel, parameter, value, accuracies, ε, δ,
  epochs, lots, stop reason, seed), plus the medium preset run as the centre point of each panel
  whose parameter it shares (``source = preset:mnist_medium``);
- ``summary.csv``: one row per run (presets and sweeps), with wall time and hardware;
- ``figure6.csv``: the per-epoch rows of the CIFAR-10 presets (§5.3, ``experiment=cifar10_*``;
  ``experiments.figure6``), written only when such runs exist;
- ``runs/<preset>/{metrics.csv,privacy.json,config.yaml}``: the preset runs as training wrote them.

Only complete runs are taken (privacy.json ``status == "complete"``). Preset runs count only when
nothing but ``experiment=``, ``seed=`` or ``device=`` was overridden; tiny runs (``dataset.subset``,
``training.max_steps``) are skipped unless ``--include-tiny``. With several runs of one preset or
sweep point and seed, the most recent wins (listed on the console) unless ``--run PRESET=DIR`` pins one.
"""
from __future__ import annotations

import argparse
import json
import math
import shutil
import sys
from pathlib import Path

import pandas as pd
import yaml

from dpsgd.accountant import Ledger
from dpsgd.accountant.ledger import Entry
from dpsgd.runtime import describe_hardware

from . import claims, figure6

ROOT = Path(__file__).resolve().parent.parent
PRESET_OVERRIDES_OK = ("experiment", "seed", "device")
TINY_OVERRIDES = ("dataset.subset", "training.max_steps")
NOT_SWEPT = ("sweep", "seed", "device", "experiment", "name") + TINY_OVERRIDES


# ------------------------------------------------------------------------------------- runs
def _yaml(path: Path):
    return yaml.safe_load(path.read_text()) if path.exists() else None


def load_run(run_dir: Path) -> dict | None:
    """A run folder's metrics, privacy statement, resolved config, Hydra choices and overrides."""
    hy = run_dir / ".hydra"
    if not (run_dir / "metrics.csv").exists() or not (run_dir / "privacy.json").exists() or not hy.is_dir():
        return None
    privacy = json.loads((run_dir / "privacy.json").read_text())
    metrics = pd.read_csv(run_dir / "metrics.csv")
    hydra = _yaml(hy / "hydra.yaml") or {}
    choices = (hydra.get("hydra", {}).get("runtime", {}) or {}).get("choices", {}) or {}
    return {"dir": run_dir, "privacy": privacy, "metrics": metrics, "config": _yaml(hy / "config.yaml") or {},
            "choices": choices, "overrides": _yaml(hy / "overrides.yaml") or [],
            "mtime": (run_dir / "privacy.json").stat().st_mtime}


def find_runs(roots: list[Path]) -> list[dict]:
    runs = []
    for root in roots:
        if not root.exists():
            continue
        for m in sorted(root.rglob("metrics.csv")):
            r = load_run(m.parent)
            if r is not None:
                runs.append(r)
    return runs


def _is_tiny(r: dict) -> bool:
    c = r["config"]
    return bool((c.get("dataset") or {}).get("subset")) or (c.get("training") or {}).get("max_steps") is not None


def _override_keys(r: dict) -> list[str]:
    return [o.split("=", 1)[0].lstrip("+~") for o in r["overrides"]]


def preset_of(r: dict, include_tiny: bool = False, allowed=PRESET_OVERRIDES_OK,
              presets=claims.PRESETS) -> str | None:
    """The preset (of ``presets``: §5.2's by default) a run is, or None (sweeps and runs with
    overrides outside ``allowed`` are not)."""
    exp = r["choices"].get("experiment")
    if exp not in presets or r["choices"].get("sweep"):
        return None
    ok = tuple(allowed) + (TINY_OVERRIDES if include_tiny else ())
    if any(k not in ok for k in _override_keys(r)):
        return None
    return exp


def panel_value(panel: str, c: dict, overrides=()):
    """(parameter, value label) of a Figure-5 run from its resolved config (other sweeps: overrides)."""
    m, p, t = c.get("model", {}), c.get("privacy", {}), c.get("training", {})
    if panel == "pca_dims":
        if m.get("projection") == "none" or not m.get("pca_dims"):
            return "model.projection/pca_dims", "none"
        return "model.projection/pca_dims", (f"random {m['pca_dims']}" if m["projection"] == "random"
                                              else str(m["pca_dims"]))
    if panel == "hidden_units":
        return "model.hidden", "x".join(str(h) for h in m.get("hidden", []))
    key = claims.FIGURE5_PANELS.get(panel, (None,))[0]
    if key is None:   # a sweep file of the user's own: its swept overrides
        swept = [o.lstrip("+~") for o in overrides if o.split("=", 1)[0].lstrip("+~") not in NOT_SWEPT]
        return ",".join(o.split("=", 1)[0] for o in swept), ",".join(o.split("=", 1)[-1] for o in swept)
    group, name = key.split(".", 1)
    val = {"privacy": p, "training": t, "model": m}[group].get(name)
    return key, f"{val:g}" if isinstance(val, (int, float)) else str(val)


def _last(metrics: pd.DataFrame) -> pd.Series:
    return metrics.iloc[-1]


def run_row(r: dict, hardware: str) -> dict:
    """The summary of one run: final accuracies, ε (run's accountant and convention; joint PLD), time."""
    last, c, st = _last(r["metrics"]), r["config"], r["privacy"]
    p = c.get("privacy", {})
    N = int(round(last["L"] / last["q"])) if last["q"] > 0 else claims.MNIST_N
    return {
        "run": _rel(r["dir"]),
        "train_accuracy": last["train_accuracy"], "test_accuracy": last["test_accuracy"],
        "epsilon": last["epsilon"], "epsilon_moments_joint": last["epsilon_moments_joint"],
        "epsilon_pld_joint": last["epsilon_pld_joint"], "epsilon_budget": p.get("target_epsilon"),
        "delta": last["delta"], "accountant": last["accountant"], "convention": last["convention"],
        "sigma": last["sigma"], "sigma_p": last["sigma_p"], "q": last["q"], "lot_size": last["L"],
        "clip_norm": last["C"], "epochs": round(int(last["steps"]) * last["L"] / N, 3),
        "steps": int(last["steps"]), "stop_reason": st.get("stop_reason"), "seed": c.get("seed"),
        "wall_time_s": last["wall_time_s"], "sec_per_epoch": float(r["metrics"]["epoch_time_s"].median()),
        "engine": last["grad_sample_mode"], "device": c.get("device"),
        "hardware": (st.get("runtime") or {}).get("hardware") or hardware,
    }


def _rel(path: Path) -> str:
    path = Path(path).resolve()
    return str(path.relative_to(ROOT)) if path.is_relative_to(ROOT) else str(path)


# ------------------------------------------------------------------------------------- Figure 4
def ledger_prefix(entries: list[dict], steps: int) -> list[Entry]:
    """The releases a run had made after its first ``steps`` SGD lots (other releases kept in order)."""
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
        eps_pld = dict(zip(deltas, led.epsilons(deltas, accountant="pld", convention="joint")))  # composed once
        for delta in deltas:
            base = {"preset": preset, "epoch": m.epoch, "steps": m.steps, "q": m.q, "sigma": m.sigma,
                    "sigma_p": m.sigma_p, "train_accuracy": m.train_accuracy, "test_accuracy": m.test_accuracy,
                    "delta": delta}
            for acc, cv in dict.fromkeys([("moments", conv), ("moments", "joint")]):
                rows.append({**base, "accountant": acc, "convention": cv,
                             "epsilon": led.epsilon(delta, accountant=acc, convention=cv)[0]})
            rows.append({**base, "accountant": "pld", "convention": "joint", "epsilon": eps_pld[delta]})
    return rows


# ------------------------------------------------------------------------------------- main
def collect(roots: list[Path], results: Path, include_tiny: bool = False, hardware: str | None = None,
            pinned: dict[str, Path] | None = None) -> dict:
    """Write the CSVs; ``pinned`` maps a preset to the run folder to use (else the most recent)."""
    hardware = hardware or describe_hardware()
    runs = [r for r in find_runs(roots) if r["privacy"].get("status") == "complete"
            and (include_tiny or not _is_tiny(r))]
    presets: dict[str, dict] = {}
    cifar: dict[str, dict] = {}
    pinned = {k: Path(v).resolve() for k, v in (pinned or {}).items()}
    sweeps: dict[tuple, dict] = {}
    for r in sorted(runs, key=lambda r: r["mtime"]):
        pr = preset_of(r, include_tiny)
        group = presets
        if pr is None:
            pr, group = preset_of(r, include_tiny, presets=claims.CIFAR10_PRESETS), cifar
        if pr is not None:
            if pr in pinned and Path(r["dir"]).resolve() != pinned[pr]:
                continue
            if pr in group:
                print(f"  {pr}: newer run {r['dir']} replaces {group[pr]['dir']}")
            group[pr] = r
        elif r["choices"].get("sweep"):
            panel = r["choices"]["sweep"]
            key = (panel, panel_value(panel, r["config"], r["overrides"])[1], r["config"].get("seed"))
            if key in sweeps:
                print(f"  sweep {key}: newer run {r['dir']} replaces {sweeps[key]['dir']}")
            sweeps[key] = r
    results.mkdir(parents=True, exist_ok=True)
    written = {}

    # presets: figure3, runs/<preset>/, figure4
    for p, r in {**presets, **cifar}.items():
        dst = results / "runs" / p
        dst.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(r["dir"] / "metrics.csv", dst / "metrics.csv")
        shutil.copyfile(r["dir"] / "privacy.json", dst / "privacy.json")
        shutil.copyfile(r["dir"] / ".hydra" / "config.yaml", dst / "config.yaml")
    if presets:
        f3 = pd.concat([r["metrics"].assign(preset=p) for p, r in presets.items()], ignore_index=True)
        f3 = f3[["preset"] + [c for c in f3.columns if c != "preset"]]
        f3.to_csv(results / "figure3.csv", index=False)
        written["figure3.csv"] = len(f3)
        f4 = [row for p, r in presets.items() if r["privacy"].get("private") for row in figure4_rows(p, r)]
        if f4:
            pd.DataFrame(f4).to_csv(results / "figure4.csv", index=False)
            written["figure4.csv"] = len(f4)

    # CIFAR-10 presets (§5.3): figure6
    if cifar:
        f6 = figure6.rows(cifar, _rel, hardware)
        f6.to_csv(results / "figure6.csv", index=False)
        written["figure6.csv"] = len(f6)

    # sweeps: figure5 (+ the medium preset as each panel's centre point)
    f5 = []
    for (panel, value, seed), r in sweeps.items():
        param, _ = panel_value(panel, r["config"], r["overrides"])
        f5.append({"panel": panel, "parameter": param, "value": value, "source": "sweep",
                   **run_row(r, hardware)})
    medium = presets.get("mnist_medium")
    if medium is not None:
        for panel in sorted({row["panel"] for row in f5}):
            if panel == "learning_rate":   # the sweep holds η constant; the preset decays it: no centre
                continue
            param, value = panel_value(panel, medium["config"])
            if not any(row["panel"] == panel and row["value"] == value for row in f5):
                f5.append({"panel": panel, "parameter": param, "value": value, "source": "preset:mnist_medium",
                           **run_row(medium, hardware)})
    if f5:
        order = {p: i for i, p in enumerate(claims.FIGURE5_PANELS)}
        df5 = pd.DataFrame(f5)
        df5["_o"] = df5["panel"].map(order).fillna(len(order))
        df5["_v"] = pd.to_numeric(df5["value"], errors="coerce").fillna(math.inf)   # 'none', 'random 60' last
        df5 = df5.sort_values(["_o", "panel", "_v", "value", "seed"]).drop(columns=["_o", "_v"])
        df5.to_csv(results / "figure5.csv", index=False)
        written["figure5.csv"] = len(df5)

    # summary: one row per run
    summ = [{"kind": "preset", "preset": p, "panel": None, "value": None, **run_row(r, hardware)}
            for p, r in presets.items()]
    summ += [{"kind": "sweep", "preset": "mnist_medium", "panel": panel, "value": value, **run_row(r, hardware)}
             for (panel, value, seed), r in sweeps.items()]
    if summ:
        pd.DataFrame(summ).to_csv(results / "summary.csv", index=False)
        written["summary.csv"] = len(summ)
    return written


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description="Collect Hydra runs into the tidy CSVs of results/.")
    ap.add_argument("--roots", nargs="+", type=Path, default=[ROOT / "outputs", ROOT / "multirun"],
                    help="folders searched for run directories (default: outputs multirun)")
    ap.add_argument("--results", type=Path, default=ROOT / "results")
    ap.add_argument("--include-tiny", action="store_true",
                    help="also take runs with dataset.subset or training.max_steps (tests)")
    ap.add_argument("--hardware", help="hardware string recorded per run (default: this machine's CPU)")
    ap.add_argument("--run", action="append", default=[], metavar="PRESET=DIR",
                    help="use this run folder for a preset (default: its most recent complete run)")
    args = ap.parse_args(argv)
    pinned = {}
    for item in args.run:
        preset, sep, path = item.partition("=")
        known = list(claims.PRESETS) + list(claims.CIFAR10_PRESETS)
        if not sep or preset not in known or not (Path(path) / "metrics.csv").exists():
            ap.error(f"--run {item!r}: expected PRESET=DIR with PRESET in {known} "
                     "and DIR a run folder holding metrics.csv")
        pinned[preset] = Path(path)
    written = collect(args.roots, args.results, args.include_tiny, args.hardware, pinned)
    if not written:
        print("no complete runs found under " + ", ".join(map(str, args.roots)))
        return 1
    for name, n in written.items():
        print(f"wrote {args.results / name} ({n} rows)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
