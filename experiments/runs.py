"""Finding training runs on disk and reading what they are: the run discovery of ``collect`` and
``seeds``.

A run folder holds ``metrics.csv``, ``privacy.json`` and Hydra's ``.hydra/`` (config, choices,
overrides); ``load_run`` reads it into one dict, ``find_runs`` walks folders for them, ``preset_of``
says which preset a run is (if any) and ``run_row`` is its one-line summary.
"""

from __future__ import annotations

import json
from pathlib import Path

import pandas as pd
import yaml

from . import claims
from .paths import repo_relative

PRESET_OVERRIDES_OK = ("experiment", "seed", "device")
TINY_OVERRIDES = ("dataset.subset", "training.max_steps")


def _yaml(path: Path):
    return yaml.safe_load(path.read_text()) if path.exists() else None


def load_run(run_dir: Path) -> dict | None:
    """A run folder's metrics, privacy statement, resolved config, Hydra choices and overrides; None
    for a folder that is not a finished-or-running training run, or is an audit run (``audit_run``
    in privacy.json)."""
    hy = run_dir / ".hydra"
    if (
        not (run_dir / "metrics.csv").exists()
        or not (run_dir / "privacy.json").exists()
        or not hy.is_dir()
    ):
        return None
    privacy = json.loads((run_dir / "privacy.json").read_text())
    if privacy.get(
        "audit_run"
    ):  # an audit's run trained with its canaries: never a result (docs/AUDIT.md)
        return None
    metrics = pd.read_csv(run_dir / "metrics.csv")
    hydra = _yaml(hy / "hydra.yaml") or {}
    choices = (hydra.get("hydra", {}).get("runtime", {}) or {}).get("choices", {}) or {}
    return {
        "dir": run_dir,
        "privacy": privacy,
        "metrics": metrics,
        "config": _yaml(hy / "config.yaml") or {},
        "choices": choices,
        "overrides": _yaml(hy / "overrides.yaml") or [],
        "mtime": (run_dir / "privacy.json").stat().st_mtime,
    }


def find_runs(roots: list[Path]) -> list[dict]:
    """Every run folder below the roots (``load_run``), in path order."""
    runs = []
    for root in roots:
        if not root.exists():
            continue
        for m in sorted(root.rglob("metrics.csv")):
            r = load_run(m.parent)
            if r is not None:
                runs.append(r)
    return runs


def is_tiny(r: dict) -> bool:
    """A test-sized run: a subset of the data or a cap on the lots."""
    c = r["config"]
    return (
        bool((c.get("dataset") or {}).get("subset"))
        or (c.get("training") or {}).get("max_steps") is not None
    )


def is_complete(r: dict) -> bool:
    return r["privacy"].get("status") == "complete"


def override_key(override: str) -> str:
    """The key of a command-line override (``+``/``~`` prefixes dropped)."""
    return override.split("=", 1)[0].lstrip("+~")


def preset_of(
    r: dict, include_tiny: bool = False, allowed=PRESET_OVERRIDES_OK, presets=claims.PRESETS
) -> str | None:
    """The preset (of ``presets``: §5.2's by default) a run is, or None (sweeps and runs with
    overrides outside ``allowed`` are not)."""
    exp = r["choices"].get("experiment")
    if exp not in presets or r["choices"].get("sweep"):
        return None
    ok = tuple(allowed) + (TINY_OVERRIDES if include_tiny else ())
    if any(override_key(o) not in ok for o in r["overrides"]):
        return None
    return exp


def run_row(r: dict, hardware: str) -> dict:
    """The summary of one run: final accuracies, ε (run's accountant and convention; joint PLD),
    time."""
    last, c, st = r["metrics"].iloc[-1], r["config"], r["privacy"]
    p = c.get("privacy", {})
    N = int(round(last["L"] / last["q"])) if last["q"] > 0 else claims.MNIST_N
    return {
        "run": repo_relative(r["dir"]),
        "train_accuracy": last["train_accuracy"],
        "test_accuracy": last["test_accuracy"],
        "epsilon": last["epsilon"],
        "epsilon_moments_joint": last["epsilon_moments_joint"],
        "epsilon_pld_joint": last["epsilon_pld_joint"],
        "epsilon_budget": p.get("target_epsilon"),
        "delta": last["delta"],
        "accountant": last["accountant"],
        "convention": last["convention"],
        "sigma": last["sigma"],
        "sigma_p": last["sigma_p"],
        "q": last["q"],
        "lot_size": last["L"],
        "clip_norm": last["C"],
        "epochs": round(int(last["steps"]) * last["L"] / N, 3),
        "steps": int(last["steps"]),
        "stop_reason": st.get("stop_reason"),
        "seed": c.get("seed"),
        "wall_time_s": last["wall_time_s"],
        "sec_per_epoch": float(r["metrics"]["epoch_time_s"].median()),
        "engine": last["grad_sample_mode"],
        "device": c.get("device"),
        "hardware": (st.get("runtime") or {}).get("hardware") or hardware,
    }
