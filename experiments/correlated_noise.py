"""DP-SGD against correlated noise (BandMF, BLT) at equal (ε, δ) and equal compute, 3 seeds each.

    python -m experiments.correlated_noise --dry-run   # the plan: b chosen, σ, lots, expected time
    python -m experiments.correlated_noise             # run what is missing, collect, draw
    python -m experiments.correlated_noise --settings mnist_paper_tight --eps 2 --seeds 0
    python -m experiments.correlated_noise --only collect figures

For each setting (a preset) and target ε, DP-SGD is the preset itself (``experiments.frontier``'s
command: the paper's network with its fixed σ stopped by the budget, or the ScatterNet recipe with
σ calibrated for its 40 epochs); it runs n lots. BandMF and BLT run the same n lots (equal compute:
``training.max_steps=n``) at the σ that makes those n lots (and DP-PCA, where the preset has it)
spend the same target ε under the preset's accountant and convention: BandMF under cyclic Poisson
sampling with the number of bands b chosen before any run, data-independently, as the b among the
divisors of the lots per epoch (b·L <= N) that minimises σ_b × the strategy's expected workload
error (``dpsgd.mechanism.correlated.strategy.expected_error_ratio``), the criterion of
Choquette-Choo et al. 2023; BLT under b-min-separation (cyclic parts, one per lot, each visited once per epoch), not amplified.

Each run is ``python -m dpsgd.train`` in ``outputs/correlated/<setting>/<method>_eps<ε>_seed<s>``,
one at a time with one thread; its peak memory (the child's ru_maxrss) and CPU time go to
``resources.json`` beside it. The small files are copied to ``results/runs/correlated/``;
``collect`` writes ``results/correlated_noise.csv`` and ``experiments.correlated_figure`` draws
``results/figures/correlated_noise.png`` from it. Details: docs/CORRELATED_NOISE.md.
"""

from __future__ import annotations

import argparse
import csv
import functools
import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

from . import frontier
from .frontier import PER_EPSILON, keep_small_files, measured_sec_per_epoch
from .paths import ROOT

SETTINGS = {"mnist_paper_tight": (0.5, 2.0, 8.0), "mnist_scatter_linear": (1.0, 2.0, 3.0)}
METHODS = ("dpsgd", "bandmf", "blt")
SEEDS = (0, 1, 2)
BLT_BUFFERS = 4
OVERHEAD = {"dpsgd": 1.0, "bandmf": 1.1, "blt": 1.1}  # planning only: measured in the CSV
COLUMNS = [
    "setting",
    "epsilon_target",
    "method",
    "seed",
    "bands",
    "buffers",
    "sigma",
    "noise_multiplier_per_step",
    "noise_std_per_step",
    "expected_error_ratio",
    "predicted_error_vs_dpsgd",
    "epsilon_spent",
    "lots",
    "epochs",
    "test_accuracy",
    "wall_time_s",
    "cpu_time_s",
    "max_rss_mb",
    "noise_state_mb",
    "run",
    "command",
]


def tag(method: str, eps: float, seed: int) -> str:
    return f"{method}_eps{eps:g}_seed{seed}"


# evaluation only where it is reported (the last epoch: a run evaluates its final model whatever
# eval_every says), no training-set metrics: the lots, the noise and the weights are those of the
# preset (evaluation draws nothing), at a fraction of the CPU time
EVAL = ["training.train_metrics=false", "training.eval_every=100000"]


def base_overrides(setting: str, eps: float) -> list[str]:
    return [
        f"experiment={setting}",
        f"privacy.target_epsilon={eps:g}",
        *PER_EPSILON.get(setting, {}).get(eps, []),
        *EVAL,
    ]


def _validated(overrides: tuple[str, ...]):
    """The validated config of these overrides and k, its clipping groups (as a run builds them)."""
    import torch

    from dpsgd.config.calibration import clipping_groups
    from dpsgd.config.model import validate_model
    from dpsgd.config.schema import validate
    from dpsgd.data.datasets import dataset_info
    from dpsgd.launch.main import compose
    from dpsgd.models.networks import build_model

    c = validate(compose(list(overrides)))
    shape = validate_model(c.model, c.dataset)
    with torch.device("meta"):
        model = build_model(c.model, shape, dataset_info(c.dataset).classes)
    return c, clipping_groups(model, c.privacy.clipping, c.model.freeze)


def _ledger(c):
    """A ledger holding what a run charges before its first lot (DP-PCA, where it has it)."""
    from dpsgd.accountant import Ledger
    from dpsgd.mechanism.pca import charge_pca

    led = Ledger()
    if c.model.projection == "pca" and c.privacy.private:
        charge_pca(led, c.privacy.sigma_p, c.privacy.pca_fraction)
    return led


def _sampler(c, bands=None):
    from dpsgd.mechanism.cyclic import make_run_sampler

    p = c.privacy
    return make_run_sampler(p.noise, p.sampling, c.N, p.lot_size, None, p.max_lot_size, bands)


def sigma_for(c, k: int, noise: str, bands, lots: int) -> float:
    """The σ at which ``lots`` lots of ``noise`` (its cyclic sampler) and the DP-PCA charge spend at
    most the target ε (within 0.2 % below it) under the config's accountant and convention."""
    from dpsgd.accountant.calibrate import smallest_sigma
    from dpsgd.mechanism.cyclic import make_run_sampler
    from dpsgd.mechanism.sampling import record_lots

    p = c.privacy
    sampler = make_run_sampler(noise, "poisson", c.N, p.lot_size, None, None, bands)

    def eps(sigma: float) -> float:
        led = _ledger(c)
        record_lots(led, sampler, sigma, lots, 0, k)
        return led.epsilon(p.delta, c.accountant.name, p.convention)[0]

    return smallest_sigma(eps, p.target_epsilon, 0.002, f"{noise} b={bands}")


def dpsgd_lots(c, k: int) -> int:
    """n, the lots the DP-SGD preset runs: its epochs (or max_steps), or fewer where the target ε
    stops it (its budget after DP-PCA)."""
    from dpsgd.workbench.build import planned_lots

    p, t, s = c.privacy, c.training, _sampler(c)
    lots = t.epochs * s.lots_per_epoch()
    lots = lots if t.max_steps is None else min(lots, t.max_steps)
    return planned_lots(
        s, p.sigma, k, lots, p.target_epsilon, p.delta, c.accountant.name, p.convention, _ledger(c)
    )


def choose_bands(c, k: int, lots: int) -> tuple[int, float, float]:
    """(b, σ_b, predicted error relative to DP-SGD) minimising σ_b·expected_error_ratio(b) over the
    divisors b of the lots per epoch with b·L <= N (data-independent: the accountant and the
    strategy only)."""
    from dpsgd.mechanism.correlated.strategy import banded, expected_error_ratio

    p, lpe = c.privacy, _sampler(c).lots_per_epoch()
    best = None
    for b in (b for b in range(1, lpe + 1) if lpe % b == 0 and b * p.lot_size <= c.N):
        s_b = sigma_for(c, k, "bandmf", b, lots)
        score = s_b * expected_error_ratio(banded(b, lots, c.training.momentum))
        if best is None or score < best[1]:
            best = (b, score, s_b)
    return best[0], best[2], best[1] / p.sigma


@functools.lru_cache(maxsize=None)
def setting_plan(setting: str, eps: float, extra: tuple[str, ...] = ()) -> dict:
    """Per method: the overrides of its runs, σ, the lots and the predicted error vs DP-SGD."""
    from dpsgd.mechanism.correlated.strategy import blt, expected_error_ratio

    base = tuple(base_overrides(setting, eps)) + extra
    c, k = _validated(base)
    n = dpsgd_lots(c, k)
    b, s_b, pred_b = choose_bands(c, k, n)
    s_t = sigma_for(c, k, "blt", None, n)
    t = _sampler(c).lots_per_epoch()  # the preset's lots per epoch: BLT's separation, too
    pred_t = (
        s_t * expected_error_ratio(blt(BLT_BUFFERS, n, t, c.training.momentum)) / c.privacy.sigma
    )
    length = [f"training.max_steps={n}", f"training.epochs={-(-n // t) + 1}"]
    fixed = ["privacy.calibrate_sigma=false"]
    return {
        "lots": n,
        "lots_per_epoch": t,
        "dpsgd": {"overrides": list(base), "sigma": c.privacy.sigma, "pred": 1.0},
        "bandmf": {
            "overrides": [
                *base,
                "privacy.noise=bandmf",
                f"privacy.bands={b}",
                *length,
                *fixed,
                f"privacy.sigma={s_b!r}",
            ],
            "sigma": s_b,
            "bands": b,
            "pred": pred_b,
        },
        "blt": {
            "overrides": [
                *base,
                "privacy.noise=blt",
                f"privacy.blt_buffers={BLT_BUFFERS}",
                *length,
                *fixed,
                f"privacy.sigma={s_t!r}",
            ],
            "sigma": s_t,
            "pred": pred_t,
        },
    }


def plan(settings, epsilons, seeds, methods, extra=()) -> list[dict]:
    jobs = []
    for setting in settings:
        for eps in SETTINGS[setting]:
            if epsilons and eps not in epsilons:
                continue
            sp = setting_plan(setting, eps, tuple(extra))
            for seed in seeds:
                for m in methods:
                    name = f"{setting}/{tag(m, eps, seed)}"
                    jobs.append(
                        {
                            "setting": setting,
                            "eps": eps,
                            "seed": seed,
                            "method": m,
                            "name": name,
                            "lots": sp["lots"],
                            "epochs": sp["lots"] / sp["lots_per_epoch"],
                            "cmd": [
                                "python",
                                "-m",
                                "dpsgd.train",
                                *sp[m]["overrides"],
                                f"seed={seed}",
                            ],
                            **{k: v for k, v in sp[m].items() if k != "overrides"},
                        }
                    )
    return jobs


def _complete(run_dir: Path) -> bool:
    try:
        return json.loads((run_dir / "privacy.json").read_text()).get("status") == "complete"
    except (OSError, ValueError):
        return False


def run_one(job: dict, run_dir: Path, log: Path) -> int:
    """One training run as a child process; its peak RSS and CPU time into resources.json."""
    env = dict(os.environ, DPSGD_THREADS="1", OMP_NUM_THREADS="1", MKL_NUM_THREADS="1")
    t0 = time.time()
    with open(log, "a") as fh:
        proc = subprocess.Popen(
            [sys.executable, *job["cmd"][1:], f"hydra.run.dir={run_dir}"],
            cwd=ROOT,
            env=env,
            stdout=fh,
            stderr=subprocess.STDOUT,
        )
        _, status, usage = os.wait4(proc.pid, 0)
    proc.returncode = os.waitstatus_to_exitcode(status)
    if proc.returncode == 0:
        (run_dir / "resources.json").write_text(
            json.dumps(
                {
                    "max_rss_mb": usage.ru_maxrss / 1024.0,  # Linux: kilobytes
                    "cpu_time_s": usage.ru_utime + usage.ru_stime,
                    "wall_time_s": time.time() - t0,
                    "threads": 1,
                },
                indent=1,
            )
        )
    return proc.returncode


def run_jobs(jobs: list[dict], results: Path, out: Path) -> int:
    """Run each job not yet complete, one at a time; returns the number that failed."""
    failed = 0
    for job in jobs:
        run_dir = out / job["name"]
        dest = results / "runs" / "correlated" / job["name"]
        if not _complete(run_dir):
            if run_dir.exists():  # a run that did not finish: set aside, never overwritten
                run_dir.rename(run_dir.with_name(run_dir.name + f".failed{int(time.time())}"))
            log = out / "logs" / (job["name"].replace("/", "_") + ".log")
            log.parent.mkdir(parents=True, exist_ok=True)
            print(f"[{time.strftime('%H:%M:%S')}] start {job['name']}  (log {log})", flush=True)
            t0 = time.time()
            rc = run_one(job, run_dir, log)
            print(
                f"[{time.strftime('%H:%M:%S')}] {'done' if rc == 0 else 'FAILED'} {job['name']} "
                f"(exit {rc}) in {(time.time() - t0) / 60:.1f} min",
                flush=True,
            )
            if rc != 0:
                failed += 1
                continue
        keep_small_files(run_dir, dest)
        if (run_dir / "resources.json").is_file():
            shutil.copyfile(run_dir / "resources.json", dest / "resources.json")
    return failed


def _row(folder: Path, results: Path) -> dict | None:
    """One CSV row of a committed run folder (None: not complete)."""
    st = json.loads((folder / "privacy.json").read_text())
    if st.get("status") != "complete":
        return None
    with open(folder / "metrics.csv") as f:
        last = list(csv.DictReader(f))[-1]
    res = (
        json.loads((folder / "resources.json").read_text())
        if (folder / "resources.json").is_file()
        else {}
    )
    method, rest = folder.name.split("_eps")
    eps, seed = rest.split("_seed")
    cn = st.get("correlated_noise") or {}
    sigma, C = float(last["sigma"]), float(last["C"])
    mult = cn.get("noise_multiplier_per_step", 1.0)
    floats = cn.get("buffer_floats") or 0
    return {
        "setting": folder.parent.name,
        "epsilon_target": float(eps),
        "method": method,
        "seed": int(seed),
        "bands": cn.get("bands") if method == "bandmf" else None,
        "buffers": cn.get("buffers", 0),
        "sigma": sigma,
        "noise_multiplier_per_step": mult,
        "noise_std_per_step": mult * sigma * C,
        "expected_error_ratio": cn.get("expected_error_ratio", 1.0),
        "predicted_error_vs_dpsgd": None,  # filled per (setting, ε) in collect
        "epsilon_spent": st["epsilon_valid"],
        "lots": st["steps"],
        "epochs": st["epochs"],
        "test_accuracy": float(last["test_accuracy"]),
        "wall_time_s": float(last["wall_time_s"]),
        "cpu_time_s": res.get("cpu_time_s"),
        "max_rss_mb": res.get("max_rss_mb"),
        "noise_state_mb": floats * 4 / 2**20,  # float32 buffers
        "run": folder.relative_to(results).as_posix(),
        "command": _command(folder),
    }


def _command(folder: Path) -> str:
    """The command the run was started with (command.txt, written beside its small files)."""
    f = folder / "command.txt"
    return f.read_text().strip() if f.is_file() else ""


def collect(results: Path) -> list[dict]:
    """One row per committed run under results/runs/correlated/<setting>/<tag>/."""
    rows = [
        r
        for p in sorted((results / "runs" / "correlated").glob("*/*/privacy.json"))
        if (r := _row(p.parent, results)) is not None
    ]
    sig = {(r["setting"], r["epsilon_target"]): r["sigma"] for r in rows if r["method"] == "dpsgd"}
    for r in rows:
        base = sig.get((r["setting"], r["epsilon_target"]))
        if base:
            r["predicted_error_vs_dpsgd"] = r["sigma"] * r["expected_error_ratio"] / base
    order = {m: i for i, m in enumerate(METHODS)}
    rows.sort(key=lambda r: (r["setting"], r["epsilon_target"], order[r["method"]], r["seed"]))
    return rows


def write_csv(rows: list[dict], path: Path) -> None:
    frontier.write_csv(rows, path, COLUMNS)


def print_plan(jobs: list[dict], results: Path, out: Path) -> float:
    """The plan: per (setting, ε) n, b and σ of each method, and the expected wall time."""
    total = 0.0
    for j in jobs:
        done = _complete(out / j["name"])
        sec = (
            0.0
            if done
            else (
                j["epochs"] * measured_sec_per_epoch(results, j["setting"]) * OVERHEAD[j["method"]]
            )
        )
        total += sec
        extra = f"b={j['bands']} " if "bands" in j else ""
        print(
            f"  {j['name']:48s} {j['lots']:6d} lots  σ={j['sigma']:.4g} {extra}"
            f"predicted error ×{j['pred']:.3f} of DP-SGD  "
            f"{'(done)' if done else f'≈ {sec / 60:5.1f} min'}"
        )
    print(f"{len(jobs)} runs, expected wall time ≈ {total / 60:.0f} min (1 thread, one at a time)")
    return total


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description="DP-SGD vs BandMF/BLT at equal ε: run, collect, draw.")
    ap.add_argument("--settings", nargs="+", choices=list(SETTINGS), default=list(SETTINGS))
    ap.add_argument("--eps", nargs="+", type=float, default=[])
    ap.add_argument("--seeds", nargs="+", type=int, default=list(SEEDS))
    ap.add_argument("--methods", nargs="+", choices=METHODS, default=list(METHODS))
    ap.add_argument("--only", nargs="+", choices=("run", "collect", "figures"))
    ap.add_argument("--dry-run", action="store_true", help="print the plan only")
    ap.add_argument("--extra", nargs="*", default=[], help="overrides added to every run (tests)")
    ap.add_argument("--out", type=Path, default=ROOT / "outputs" / "correlated")
    ap.add_argument("--results", type=Path, default=ROOT / "results")
    a = ap.parse_args(argv)
    only = set(a.only or ("run", "collect", "figures"))
    jobs = plan(a.settings, a.eps, a.seeds, a.methods, a.extra)
    print_plan(jobs, a.results, a.out)
    if a.dry_run:
        return 0
    failed = 0
    if "run" in only:
        for j in jobs:
            (a.out / j["name"]).parent.mkdir(parents=True, exist_ok=True)
        failed = run_jobs(jobs, a.results, a.out)
        for j in jobs:  # the command each committed run was started with
            dest = a.results / "runs" / "correlated" / j["name"]
            if dest.is_dir():
                (dest / "command.txt").write_text(" ".join(j["cmd"]) + "\n")
    if "collect" in only:
        rows = collect(a.results)
        write_csv(rows, a.results / "correlated_noise.csv")
        print(f"{len(rows)} rows → {a.results / 'correlated_noise.csv'}")
    if "figures" in only:
        from .correlated_figure import draw_file

        draw_file(a.results)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
