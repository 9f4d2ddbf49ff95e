"""The privacy–utility frontier: each recipe × target ε × seed, trained, collected, drawn.

    python -m experiments.frontier --dry-run  # the plan and the expected wall time only
    python -m experiments.frontier            # run what is missing, collect, draw (make frontier)
    python -m experiments.frontier --recipes mnist_scatter_linear --eps 2 --seeds 0 1 2
    python -m experiments.frontier --only collect figures

Every run is ``python -m dpsgd.train experiment=<recipe> privacy.target_epsilon=<ε> seed=<s>`` (plus
the recipe's per-ε overrides, ``PER_EPSILON``) in its own folder
``outputs/frontier/<recipe>/eps<ε>_seed<s>``, one at a time with ``DPSGD_THREADS=1``; a folder whose
``privacy.json`` says complete is not rerun. The small files of each finished run (``privacy.json``,
``metrics.csv``, ``config.yaml`` with its data root written relative, ``portable_config``) are
copied to ``results/runs/frontier/<recipe>/eps<ε>_seed<s>/``, which ``collect`` turns into
``results/frontier.csv`` (one row per run); ``python -m experiments.figures`` then draws
``results/figures/frontier.png`` (``experiments.frontier_figure``) and the table of
``results/README.md`` from that CSV only. The expected wall time comes from each run's config as
training composes it (``experiments.planning``).

Details: docs/FRONTIER.md, "experiments/frontier.py".
"""

from __future__ import annotations

import argparse
import csv
import json
import math
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import yaml

from . import figures
from .paths import ROOT, portable
from .planning import composed, epochs_needed

EPSILONS = (0.5, 1.0, 1.2, 2.0, 3.0, 8.0)
SEEDS = (0, 1, 2)
# The recipes, in plotting order: presets of conf/experiment/.
RECIPES = [
    "mnist_paper_tight",
    "mnist_scatter_linear",
    "mnist_scatter_linear_val",
    "mnist_scatter_cnn",
    "fmnist_scatter_linear",
    "mnist_tanh_cnn",
    "fmnist_tanh_cnn",
]
# Recipes run at some ε only: mnist_scatter_linear_val's epochs were chosen on a validation split at
# ε = 1.2.
RECIPE_EPSILONS = {
    "mnist_scatter_linear_val": (1.2,),
    # fixed σ and 40 epochs (Tramèr & Boneh's end-to-end setting), stopped by the budget at ε = 3
    "mnist_tanh_cnn": (3.0,),
    "fmnist_tanh_cnn": (3.0,),
}
# Per-ε overrides: the paper's own (σ, σ_p) where §5.2 gives one for that ε; elsewhere the preset's.
PER_EPSILON = {
    "mnist_paper_tight": {
        0.5: ["privacy.sigma=8.0", "privacy.sigma_p=16.0"],
        8.0: ["privacy.sigma=2.0", "privacy.sigma_p=4.0"],
    },
}
SMALL_FILES = {
    "privacy.json": "privacy.json",
    "metrics.csv": "metrics.csv",
    "config.resolved.yaml": "config.yaml",
}
PATH_KEYS = (
    ("dataset", "root"),
    ("model", "pretrained"),
)  # config entries naming files on this machine
COLUMNS = [
    "recipe",
    "dataset",
    "epsilon_target",
    "epsilon_pld_joint",
    "seed",
    "test_accuracy",
    "epochs",
    "steps",
    "sigma",
    "wall_time_s",
    "run",
    "command",
]
DEFAULT_SEC_PER_EPOCH = {
    "mnist_paper_tight": 1.0,
    "mnist_scatter_linear": 3.0,
    "mnist_scatter_linear_val": 3.0,
    "mnist_scatter_cnn": 15.0,
    "fmnist_scatter_linear": 3.0,
    "mnist_tanh_cnn": 32.0,
    "fmnist_tanh_cnn": 20.0,
}
FEATURE_SECONDS = 150  # scattering features of one dataset, computed once (then cached)


def eps_tag(eps: float) -> str:
    return f"eps{eps:g}"


def run_name(recipe: str, eps: float, seed: int) -> str:
    return f"{recipe}/{eps_tag(eps)}_seed{seed}"


def command(recipe: str, eps: float, seed: int) -> list[str]:
    """The training command of one run (relative paths only)."""
    return (
        [
            "python",
            "-m",
            "dpsgd.train",
            f"experiment={recipe}",
            f"privacy.target_epsilon={eps:g}",
            f"seed={seed}",
        ]
        + PER_EPSILON.get(recipe, {}).get(eps, [])
        + [f"hydra.run.dir=outputs/frontier/{run_name(recipe, eps, seed)}"]
    )


def run_config(recipe: str, eps: float):
    """The composed config (conf/, as training composes it) of a run of ``recipe`` at target
    ``eps``."""
    return composed(
        f"experiment={recipe}",
        f"privacy.target_epsilon={eps:g}",
        *PER_EPSILON.get(recipe, {}).get(eps, []),
    )


def expected_epochs(recipe: str, eps: float) -> float:
    """Epochs a run takes: the preset's epochs, or (fixed σ) the lots within the ε budget under the
    preset's accountant and convention (``experiments.planning.epochs_needed``)."""
    return epochs_needed(run_config(recipe, eps))


def plan(recipes, epsilons, seeds) -> list[dict]:
    return [
        {
            "recipe": r,
            "eps": e,
            "seed": s,
            "name": run_name(r, e, s),
            "cmd": command(r, e, s),
            "epochs": expected_epochs(r, e),
        }
        for r in recipes
        for e in epsilons
        for s in seeds
        if e in RECIPE_EPSILONS.get(r, (e,))
    ]


def measured_sec_per_epoch(results: Path, recipe: str) -> float:
    """Median seconds per epoch of the recipe's committed runs, else DEFAULT_SEC_PER_EPOCH."""
    times = []
    for p in sorted((results / "runs" / "frontier" / recipe).glob("*/metrics.csv")):
        with open(p) as f:
            times += [float(r["epoch_time_s"]) for r in csv.DictReader(f) if r.get("epoch_time_s")]
    if times:
        times.sort()
        return times[len(times) // 2]
    return DEFAULT_SEC_PER_EPOCH.get(recipe, 5.0)


def _complete(run_dir: Path) -> bool:
    try:
        return json.loads((run_dir / "privacy.json").read_text()).get("status") == "complete"
    except (OSError, ValueError):
        return False


def portable_config(text: str) -> str:
    """A resolved config (YAML) with its file paths (data root, pretrained artifact) free of this
    machine's layout (``experiments.paths.portable``); everything else as written."""
    c = yaml.safe_load(text) or {}
    for group, key in PATH_KEYS:
        node = c.get(group) or {}
        if isinstance(node.get(key), str):
            node[key] = portable(node[key])
    return yaml.safe_dump(c, sort_keys=False, allow_unicode=True)


def keep_small_files(run_dir: Path, dest: Path) -> None:
    """Copy a finished run's privacy.json, metrics.csv and resolved config (its paths made
    portable) into results/."""
    dest.mkdir(parents=True, exist_ok=True)
    for src, name in SMALL_FILES.items():
        if not (run_dir / src).is_file():
            continue
        if name == "config.yaml":
            (dest / name).write_text(portable_config((run_dir / src).read_text()))
        else:
            shutil.copyfile(run_dir / src, dest / name)


def run_jobs(jobs: list[dict], results: Path, log_dir: Path) -> int:
    """Run each job not yet complete, one at a time; returns the number that failed."""
    log_dir.mkdir(parents=True, exist_ok=True)
    env = dict(os.environ, DPSGD_THREADS="1", OMP_NUM_THREADS="1", MKL_NUM_THREADS="1")
    failed = 0
    for job in jobs:
        run_dir = ROOT / "outputs" / "frontier" / job["name"]
        dest = results / "runs" / "frontier" / job["name"]
        if not _complete(run_dir):
            log = log_dir / (job["name"].replace("/", "_") + ".log")
            print(
                f"[{time.strftime('%H:%M:%S')}] start {' '.join(job['cmd'])}  (log {log})",
                flush=True,
            )
            t0 = time.time()
            with open(log, "a") as fh:
                rc = subprocess.call(
                    [sys.executable, *job["cmd"][1:]],
                    cwd=ROOT,
                    env=env,
                    stdout=fh,
                    stderr=subprocess.STDOUT,
                )
            print(
                f"[{time.strftime('%H:%M:%S')}] {'done' if rc == 0 else 'FAILED'} {job['name']} "
                f"(exit {rc}) in {(time.time() - t0) / 60:.1f} min",
                flush=True,
            )
            if rc != 0:
                failed += 1
                continue
        if _complete(run_dir):
            keep_small_files(run_dir, dest)
    return failed


def collect(results: Path) -> list[dict]:
    """One row per committed run folder results/runs/frontier/<recipe>/eps<ε>_seed<s>/ →
    frontier.csv."""
    rows = []
    base = results / "runs" / "frontier"
    for st_path in sorted(base.glob("*/*/privacy.json")):
        folder = st_path.parent
        recipe, tag = folder.parent.name, folder.name
        st = json.loads(st_path.read_text())
        if st.get("status") != "complete":
            continue
        with open(folder / "metrics.csv") as f:
            metrics = list(csv.DictReader(f))
        last = metrics[-1] if metrics else {}
        cfg = (
            yaml.safe_load((folder / "config.yaml").read_text())
            if (folder / "config.yaml").is_file()
            else {}
        )
        eps_t = float(tag.split("_seed")[0][3:])
        seed = int(tag.split("_seed")[1])
        rows.append(
            {
                "recipe": recipe,
                "dataset": cfg.get("dataset", {}).get("name", ""),
                "epsilon_target": eps_t,
                "epsilon_pld_joint": st["epsilon_by_accountant"]["pld"]["joint"],
                "seed": seed,
                "test_accuracy": float(last.get("test_accuracy", math.nan)),
                "epochs": st.get("epochs"),
                "steps": st.get("steps"),
                "sigma": cfg.get("privacy", {}).get("sigma", last.get("sigma")),
                "wall_time_s": float(last.get("wall_time_s", math.nan)),
                "run": folder.relative_to(results).as_posix(),
                "command": " ".join(command(recipe, eps_t, seed)[:-1]),
            }
        )
    order = {r: i for i, r in enumerate(RECIPES)}
    rows.sort(
        key=lambda r: (
            order.get(r["recipe"], len(order)),
            r["recipe"],
            r["epsilon_target"],
            r["seed"],
        )
    )
    return rows


def write_csv(rows: list[dict], path: Path, columns=COLUMNS) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "w", newline="") as f:
        w = csv.DictWriter(f, columns, lineterminator="\n")
        w.writeheader()
        w.writerows(rows)


def print_plan(jobs: list[dict], results: Path) -> float:
    """Print the plan and return the expected wall time in seconds (runs already complete cost
    nothing)."""
    total, datasets = 0.0, set()
    print(
        f"plan: {len(jobs)} runs ({len({j['recipe'] for j in jobs})} recipes × ε × seeds), one at "
        "a time"
    )
    for j in jobs:
        done = _complete(ROOT / "outputs" / "frontier" / j["name"])
        sec = 0.0 if done else j["epochs"] * measured_sec_per_epoch(results, j["recipe"])
        c = run_config(j["recipe"], j["eps"])
        if not done and c.model.features != "none":
            datasets.add(c.dataset.name)
        total += sec
        print(
            f"  {j['name']:40s} ≈ {j['epochs']:5.0f} epochs  "
            f"{'(done)' if done else f'≈ {sec / 60:5.1f} min'}  {' '.join(j['cmd'])}"
        )
    total += FEATURE_SECONDS * len(datasets)  # at most: a cached feature set costs nothing
    print(
        f"expected wall time: ≈ {total / 60:.0f} min on this machine (1 thread per run; seconds "
        "per epoch from the committed runs, else defaults; scattering features at most once per "
        "dataset)"
    )
    return total


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description="The privacy–utility frontier: run, collect, draw.")
    ap.add_argument("--recipes", nargs="+", choices=RECIPES, default=RECIPES)
    ap.add_argument("--eps", nargs="+", type=float, default=list(EPSILONS))
    ap.add_argument("--seeds", nargs="+", type=int, default=list(SEEDS))
    ap.add_argument("--only", nargs="+", choices=("run", "collect", "figures"))
    ap.add_argument("--results", type=Path, default=ROOT / "results")
    ap.add_argument("--dry-run", action="store_true", help="print the plan and the estimate only")
    args = ap.parse_args(argv)
    parts = args.only or ["run", "collect", "figures"]
    jobs = plan(args.recipes, args.eps, args.seeds)
    if "run" in parts:
        print_plan(jobs, args.results)
    if args.dry_run:
        return 0
    failed = (
        run_jobs(jobs, args.results, ROOT / "outputs" / "frontier_logs") if "run" in parts else 0
    )
    if "collect" in parts:
        rows = collect(args.results)
        write_csv(rows, args.results / "frontier.csv")
        print(f"{args.results / 'frontier.csv'}: {len(rows)} runs")
    if "figures" in parts:  # every figure and results/README.md (its frontier table among them)
        figures.main(["--results", str(args.results)])
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
