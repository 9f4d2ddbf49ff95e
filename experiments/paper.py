"""Rerun every experiment of the paper, then collect results/ and redraw every figure.

    python -m experiments.paper                       # everything (hours on a 2-core CPU)
    python -m experiments.paper --only presets        # the four §5.2 presets
    python -m experiments.paper --only sweeps --sweeps lot_size noise
    python -m experiments.paper --only figure2|collect|figures
    python -m experiments.paper --dry-run             # print the plan and the expected wall time
    # sweeps through a Hydra launcher (make paper LAUNCHER=joblib)
    python -m experiments.paper --launcher joblib

Details: docs/DEVELOPMENT.md, "experiments/paper.py".
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import time
from pathlib import Path

from . import claims
from .jobs import LOCAL, checked_launcher, commands, default_parallel, launcher_kind, run_jobs
from .paths import CONF, ROOT
from .planning import composed, epochs_needed, sweep_points

PRESETS = list(claims.PRESETS)
SWEEPS = sorted(p.stem for p in (CONF / "sweep").glob("*.yaml"))
PARTS = ("figure2", "presets", "sweeps", "collect", "figures")
DEFAULT_SEC_PER_EPOCH = 2.5  # used only when results/ holds no measured medium-preset run


# Seconds per epoch relative to the medium preset's network (60-d DP-PCA, 1000 hidden units), by
# input dimension (784: no projection) and in proportion to the hidden units: for the estimate only.
INPUT_COST = {784: 3.0, 200: 1.3}


def cost_scale(c) -> float:
    """An epoch of the composed config ``c`` in medium-preset epochs (the MNIST MLP's size)."""
    dims = c.model.pca_dims if c.model.projection != "none" and c.model.pca_dims else 784
    return INPUT_COST.get(dims, 1.0) * sum(c.model.hidden) / 1000


def epoch_equivalents(*overrides: str) -> float:
    """Medium-preset epochs a run of these overrides takes (its epochs within budget × its cost)."""
    c = composed(*overrides)
    return epochs_needed(c) * cost_scale(c)


PRESETS_SWEEP_DIR = "hydra.sweep.dir=multirun/presets/${now:%Y-%m-%d}/${now:%H-%M-%S.%f}"
PRESETS_SUBDIR = (
    "hydra.sweep.subdir=${hydra.job.num}_${hydra.runtime.choices.experiment}_seed${seed}"
)


def plan_jobs(presets: list[str], sweeps: list[str], launcher: str | None = None) -> list[dict]:
    """[{name, args, epochs, each}] — ``epochs`` in medium-preset epoch equivalents (for the
    estimate), ``each`` the epochs of every run the job makes. With a launcher the presets are one
    multirun. Every run's config is composed from conf/ as training will compose it
    (``experiments.planning``)."""
    jobs = []
    for p in presets:
        ep = epoch_equivalents(f"experiment={p}")
        jobs.append({"name": p, "args": [f"experiment={p}"], "epochs": ep, "each": [ep]})
    if launcher is not None and presets:
        each = [e for j in jobs for e in j["each"]]
        jobs = [
            {
                "name": "presets",
                "args": [
                    "-m",
                    f"experiment={','.join(presets)}",
                    PRESETS_SWEEP_DIR,
                    PRESETS_SUBDIR,
                ],
                "epochs": sum(each),
                "each": each,
            }
        ]
    for s in sweeps:
        each = [epoch_equivalents(f"+sweep={s}", *point) for point in sweep_points(s)]
        jobs.append(
            {"name": f"sweep_{s}", "args": ["-m", f"+sweep={s}"], "epochs": sum(each), "each": each}
        )
    return jobs


def wall_epochs(jobs: list[dict], n_parallel: int, launcher: str | None) -> float:
    """Expected wall time in epoch equivalents. Own processes: ``n_parallel`` jobs at a time, each
    running its points in sequence. A local launcher: its multiruns one after another (n_parallel
    of them at once), each point-parallel over the jobs it runs at once. A cluster launcher: every
    point at once (queue waits not counted)."""
    if launcher is None:
        return max(
            sum(j["epochs"] for j in jobs) / n_parallel,
            max((j["epochs"] for j in jobs), default=0.0),
        )
    from dpsgd.launch.launchers import parallel_jobs

    kind, params = launcher_kind(launcher)
    if kind not in LOCAL:
        return max((e for j in jobs for e in j["each"]), default=0.0)
    walls = [
        max(j["epochs"] / parallel_jobs(kind, params, len(j["each"])), max(j["each"], default=0.0))
        for j in jobs
    ]
    return max(sum(walls) / n_parallel, max(walls, default=0.0))


def measured_sec_per_epoch(results: Path) -> float | None:
    """Median seconds per epoch of the committed medium-preset run, if any."""
    p = results / "runs" / "mnist_medium" / "metrics.csv"
    if not p.exists():
        return None
    import pandas as pd

    d = pd.read_csv(p)
    return float(d["epoch_time_s"].median()) if len(d) else None


def _parser() -> argparse.ArgumentParser:
    """The options of experiments.paper."""
    ap = argparse.ArgumentParser(description="Rerun every experiment, then collect and redraw.")
    ap.add_argument(
        "--only", choices=PARTS, nargs="+", help="run only these parts (default: all, in order)"
    )
    ap.add_argument("--presets", nargs="+", choices=PRESETS, default=PRESETS)
    ap.add_argument("--sweeps", nargs="+", choices=SWEEPS, default=SWEEPS)
    ap.add_argument(
        "--jobs",
        type=int,
        help="training commands at a time (default 2; with a local launcher 1, "
        "with a cluster launcher all)",
    )
    ap.add_argument(
        "--launcher",
        help="run each multirun through this hydra/launcher (joblib, submitit_local, "
        "submitit_slurm, slurm; default: own processes)",
    )
    ap.add_argument(
        "--sec-per-epoch", type=float, help="seconds per epoch for the wall-time estimate"
    )
    ap.add_argument("--results", type=Path, default=ROOT / "results")
    ap.add_argument("--dry-run", action="store_true", help="print the plan and the estimate only")
    ap.add_argument(
        "overrides",
        nargs="*",
        help="extra Hydra overrides for every training job (e.g. device=cuda)",
    )
    return ap


def main(argv: list[str] | None = None) -> int:
    ap = _parser()
    args = ap.parse_args(argv)
    if args.jobs is not None and args.jobs < 1:
        ap.error("--jobs must be >= 1")
    launcher = checked_launcher(args.launcher)
    parts = args.only or list(PARTS)
    jobs = (plan_jobs(args.presets, [], launcher) if "presets" in parts else []) + (
        plan_jobs([], args.sweeps, launcher) if "sweeps" in parts else []
    )
    n_parallel = args.jobs or default_parallel(launcher, len(jobs))
    spe = args.sec_per_epoch or measured_sec_per_epoch(args.results) or DEFAULT_SEC_PER_EPOCH
    total = sum(j["epochs"] for j in jobs)
    wall = wall_epochs(jobs, n_parallel, launcher) * spe
    print(f"plan: {', '.join(parts)}" + (f" (hydra/launcher={launcher})" if launcher else ""))
    for args_, j in zip(commands(jobs, launcher), jobs):
        print(
            f"  {j['name']:22s} ≈ {j['epochs']:6.0f} epoch-equivalents  python -m dpsgd.train "
            f"{' '.join(args_)}"
        )
    how = (
        f"hydra/launcher={launcher}, {n_parallel} multirun(s) at a time"
        if launcher
        else f"own processes, {n_parallel} at a time"
    )
    print(
        f"expected wall time: ≈ {wall / 3600:.1f} h for training ({total:.0f} epoch-equivalents at "
        f"{spe:.2f} s/epoch, {how}) + ~1 min for figure2, collect and figures"
    )
    if args.dry_run:
        return 0
    t0 = time.time()
    if "figure2" in parts:
        subprocess.run(
            [
                sys.executable,
                "-m",
                "experiments.figure2",
                "--out",
                str(args.results / "figure2.csv"),
            ],
            cwd=ROOT,
            check=True,
        )
    failed = (
        run_jobs(jobs, n_parallel, ROOT / "outputs" / "paper_logs", args.overrides, launcher)
        if jobs
        else 0
    )
    if "collect" in parts:
        subprocess.run(
            [sys.executable, "-m", "experiments.collect", "--results", str(args.results)],
            cwd=ROOT,
            check=True,
        )
    if "figures" in parts:
        subprocess.run(
            [sys.executable, "-m", "experiments.figures", "--results", str(args.results)],
            cwd=ROOT,
            check=True,
        )
    print(
        f"experiments.paper: done in {(time.time() - t0) / 60:.1f} min, {failed} training job(s) "
        "failed"
    )
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
