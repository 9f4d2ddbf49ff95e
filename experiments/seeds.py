"""Seed spread of the §5.2 presets: how far one run's accuracy is from another's.

    python -m experiments.seeds run [--presets mnist_small,mnist_medium] [--seeds 0-4] \\
        [--device cuda]
                                    [--launcher joblib|submitit_local|submitit_slurm|slurm]
    python -m experiments.seeds collect [--roots outputs/seeds ...] [--hardware "..."]

``run`` trains each preset once per seed, in sequence (``python -m dpsgd.train experiment=<preset>
seed=<s> name=seeds``; outputs under ``outputs/seeds/``, which ``experiments.collect`` does not take
as the canonical preset runs). With ``--launcher`` (``make seeds LAUNCHER=joblib``) they are one
multirun over presets × seeds through that Hydra launcher (experiments/jobs.py), its folders under
``outputs/seeds/<date>/<time>/`` too. ``collect`` reads every complete, full-size preset run under
the roots (overrides limited to experiment / seed / device / name) and merges one row per run into
``results/seeds.csv`` (a later run of the same preset, seed and hardware replaces the earlier one),
copying its ``metrics.csv`` and ``privacy.json`` to ``results/seeds/<hardware>/<preset>_seed<s>/``.
A run's hardware is the one its privacy statement records; older runs without it take
``--hardware`` (default: this machine). The ``run`` column names the run without this machine's
paths (``run_label``). ``results/README.md`` tabulates mean ± sd per preset.
"""

from __future__ import annotations

import argparse
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pandas as pd

from dpsgd.core.fileio import atomic_write_text
from dpsgd.core.runtime import describe_hardware

from . import claims
from .jobs import checked_launcher
from .paths import ROOT
from .runs import PRESET_OVERRIDES_OK, find_runs, is_complete, is_tiny, preset_of, run_row

OK_OVERRIDES = PRESET_OVERRIDES_OK + ("name",)
KEY = ["preset", "seed", "hardware"]


def parse_seeds(text: str) -> list[int]:
    """'0-4' or '0,3,7' → list of seeds."""
    out = []
    for part in text.split(","):
        lo, _, hi = part.partition("-")
        out += list(range(int(lo), int(hi) + 1)) if hi else [int(lo)]
    return out


SWEEP_DIR = "hydra.sweep.dir=outputs/seeds/${now:%Y-%m-%d}/${now:%H-%M-%S.%f}"
SUBDIR = "hydra.sweep.subdir=${hydra.job.num}_${hydra.runtime.choices.experiment}_seed${seed}"


def run(presets: list[str], seeds: list[int], device: str, launcher: str | None = None) -> None:
    if launcher is not None:  # one multirun over presets × seeds, run by the launcher
        cmd = [
            sys.executable,
            "-m",
            "dpsgd.train",
            "-m",
            f"experiment={','.join(presets)}",
            f"seed={','.join(map(str, seeds))}",
            f"device={device}",
            "name=seeds",
            SWEEP_DIR,
            SUBDIR,
            f"hydra/launcher={launcher}",
        ]
        print("+", " ".join(cmd[1:]), flush=True)
        subprocess.run(cmd, cwd=ROOT, check=True)
        return
    for preset in presets:
        for s in seeds:
            cmd = [
                sys.executable,
                "-m",
                "dpsgd.train",
                f"experiment={preset}",
                f"seed={s}",
                f"device={device}",
                "name=seeds",
            ]
            print("+", " ".join(cmd[1:]), flush=True)
            subprocess.run(cmd, cwd=ROOT, check=True)


def _slug(text: str) -> str:
    return re.sub(r"[^a-z0-9]+", "-", text.lower()).strip("-")


def run_label(run_dir: Path, roots: list[Path]) -> str:
    """The ``run`` column: where the run came from, free of this machine's layout. Inside the
    repository, its path relative to the repository (``outputs/seeds/...``); elsewhere, its path
    below the parent of the deepest root it was found under (root ``/any/where/runs`` →
    ``runs/mnist_small_seed0``)."""
    d = Path(run_dir).resolve()
    if d.is_relative_to(ROOT):
        return d.relative_to(ROOT).as_posix()
    under = [Path(r).resolve() for r in roots if d.is_relative_to(Path(r).resolve())]
    if not under:
        return d.name
    root = max(under, key=lambda r: len(r.parts))
    return (Path(root.name) / d.relative_to(root)).as_posix()


def rows_from(roots: list[Path], hardware: str) -> list[tuple[dict, Path]]:
    out = []
    for r in find_runs(roots):
        exp = preset_of(r, allowed=OK_OVERRIDES)
        if exp is None or is_tiny(r) or not is_complete(r):
            continue
        row = {**run_row(r, hardware), "run": run_label(r["dir"], roots)}
        m = r["metrics"]["test_accuracy"].dropna()
        out.append(
            (
                {
                    "preset": exp,
                    **row,
                    "best_test_accuracy": float(m.max()),
                    "best_epoch": int(r["metrics"].loc[m.idxmax(), "epoch"]),
                },
                r["dir"],
            )
        )
    return out


def collect(roots: list[Path], results: Path, hardware: str | None = None) -> Path:
    hardware = hardware or describe_hardware()
    new = rows_from(roots, hardware)
    path = results / "seeds.csv"
    old = pd.read_csv(path) if path.exists() else pd.DataFrame()
    df = pd.DataFrame([row for row, _ in new])
    if len(df):  # the same run found twice: keep one
        df = df.drop_duplicates(KEY, keep="last")
    if len(old):
        keep = ~old.set_index(KEY).index.isin(df.set_index(KEY).index) if len(df) else slice(None)
        df = pd.concat([old[keep], df], ignore_index=True)
    for row, src in new:
        dst = results / "seeds" / _slug(row["hardware"]) / f"{row['preset']}_seed{row['seed']}"
        dst.mkdir(parents=True, exist_ok=True)
        for f in ("metrics.csv", "privacy.json"):
            shutil.copy2(Path(src) / f, dst / f)
    order = {p: i for i, p in enumerate(claims.PRESETS)}
    df = df.sort_values(
        ["preset", "hardware", "seed"], key=lambda s: s.map(order) if s.name == "preset" else s
    )
    atomic_write_text(path, df.to_csv(index=False))
    print(f"{len(new)} run(s) merged; {len(df)} rows in {path}")
    return path


def spread(df: pd.DataFrame) -> pd.DataFrame:
    """Per preset and hardware: n, mean, sd, min, max of the final test accuracy; runs ≥ the
    paper."""
    rows = []
    for (preset, hw), d in df.groupby(["preset", "hardware"], sort=False):
        acc = d["test_accuracy"].astype(float)
        paper = claims.PRESETS[preset]["accuracy"]
        rows.append(
            {
                "preset": preset,
                "hardware": hw,
                "n": len(acc),
                "mean": acc.mean(),
                "sd": acc.std(ddof=1) if len(acc) > 1 else float("nan"),
                "min": acc.min(),
                "max": acc.max(),
                "at_or_above_paper": int((acc >= paper - 1e-12).sum()),
                "paper": paper,
                "epsilon": d["epsilon"].astype(float).max(),
                "seeds": ",".join(str(s) for s in sorted(d["seed"])),
            }
        )
    return pd.DataFrame(rows)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = ap.add_subparsers(dest="cmd", required=True)
    r = sub.add_parser("run", help="train presets over seeds")
    r.add_argument("--presets", default=",".join(claims.PRESETS))
    r.add_argument("--seeds", default="0-4", help="e.g. 0-4 or 0,2,5")
    r.add_argument("--device", default="auto")
    r.add_argument(
        "--launcher",
        help="one multirun through this hydra/launcher (default: one run after another)",
    )
    c = sub.add_parser("collect", help="merge runs into results/seeds.csv")
    c.add_argument("--roots", nargs="+", type=Path, default=[ROOT / "outputs" / "seeds"])
    c.add_argument("--results", type=Path, default=ROOT / "results")
    c.add_argument("--hardware", help="for runs whose privacy.json does not record it")
    args = ap.parse_args(argv)
    if args.cmd == "run":
        presets = [p for p in args.presets.split(",") if p]
        bad = [p for p in presets if p not in claims.PRESETS]
        if bad:
            ap.error(f"--presets: unknown {bad}; choose from {list(claims.PRESETS)}")
        run(presets, parse_seeds(args.seeds), args.device, checked_launcher(args.launcher))
    else:
        collect(args.roots, args.results, args.hardware)
    return 0


if __name__ == "__main__":
    sys.exit(main())
