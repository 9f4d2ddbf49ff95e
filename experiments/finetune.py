"""Public pretraining, private fine-tuning (Abadi et al. 2016 §5.3's idea, at CPU size): a small ViT
pretrained on Fashion-MNIST (public, not charged) and fine-tuned privately on MNIST at ε ∈ {1, 2, 8}
(δ = 1e-5, Poisson lots, PLD): full fine-tuning, LoRA, head only, and the same ViT from scratch;
3 seeds; accuracy, time per epoch, peak memory; Opacus on the same model and lots beside it.

    python -m experiments.finetune --dry-run             # the plan and the expected wall time only
    python -m experiments.finetune                       # pretrain, tune, run, collect, draw
    python -m experiments.finetune --eps 2 --seeds 0 --only run collect figures
    python -m experiments.finetune --tiny --out /tmp/ft  # every step in seconds (tests)

Steps (``--only``): ``pretrain`` (once: ``outputs/finetune/pretrained_vit_fmnist.pt``, its
accuracy and SHA-256 in ``results/finetune_pretrain.json``), ``tune`` (the learning rate of each
variant chosen at ε = 2, seed 0, on 10 000 MNIST training examples held out of training: the test
set is never seen; the choice is not charged), ``run`` (each (ε, seed, variant) and the Opacus
runs, one at a time, each a child process whose peak RSS ``os.wait4`` measures; a finished run is
not rerun), ``collect`` (``results/finetune.csv``, ``results/finetune_tuning.csv``) and
``figures`` (``results/figures/finetune.png`` and results/README.md). Runs write
``outputs/finetune/<tag>/result.json``; the small files go to ``results/runs/finetune/<tag>/``.
Details and the choices made: docs/FINETUNE.md.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

from .paths import ROOT

EPSILONS = (2.0, 1.0, 8.0)  # in running order: ε = 2 first
SEEDS = (0, 1, 2)
VARIANTS = ("full", "lora", "head", "scratch")
OPACUS = ("full",)  # the variants Opacus runs (seed 0, every ε)
LOT, CLIP, EPOCHS, MOMENTUM = 1000, 1.0, 5, 0.9
LR_GRID = {  # SGD with momentum 0.9 on the noisy mean of clipped gradients (C = 1)
    "full": (0.03, 0.1, 0.3),
    "lora": (0.1, 0.3, 1.0),
    "head": (0.3, 1.0, 3.0),
    "bias": (0.1, 0.3, 1.0),
    "scratch": (0.03, 0.1, 0.3),
}
TUNE_EPS, TUNE_SEED = 2.0, 0
PRETRAIN_EPOCHS = 10
# seconds per epoch of one run measured here (2 shared AMD EPYC cores, load ≈ 4-7), for the plan
SEC_PER_EPOCH = {"full": 90, "lora": 130, "head": 20, "bias": 60, "scratch": 90, "opacus": 150}
TINY = {"lot": 250, "epochs": 1, "subset": 2000, "pretrain_epochs": 1, "pretrain_subset": 2000}


def tag(job: dict) -> str:
    lr = f"_lr{job['lr']:g}" if job["split"] == "val" else ""
    return (
        f"{job['split']}/{job['engine']}_{job['variant']}_eps{job['eps']:g}_seed{job['seed']}{lr}"
    )


def job(variant, eps, seed, lr, split="test", engine="dpsgd", tiny=False, pretrained=None) -> dict:
    j = {
        "variant": variant,
        "engine": engine,
        "eps": float(eps),
        "seed": int(seed),
        "lr": float(lr),
        "momentum": MOMENTUM,
        "clip": CLIP,
        "lot": TINY["lot"] if tiny else LOT,
        "epochs": TINY["epochs"] if tiny else EPOCHS,
        "split": split,
        "pretrained": None if pretrained is None else str(pretrained),
        "subset": TINY["subset"] if tiny else None,
    }
    j["tag"] = tag(j)
    return j


def tuning_jobs(variants, tiny=False, pretrained=None) -> list[dict]:
    return [
        job(v, TUNE_EPS, TUNE_SEED, lr, "val", tiny=tiny, pretrained=pretrained)
        for v in variants
        for lr in (LR_GRID[v][:1] if tiny else LR_GRID[v])
    ]


def chosen_lr(results: Path, variants) -> dict:
    """The learning rate of each variant with the best held-out accuracy (ties: the smaller)."""
    rows = _rows(results, "val")
    best = {}
    for v in variants:
        cand = sorted(
            (r for r in rows if r["variant"] == v), key=lambda r: (-r["accuracy"], r["lr"])
        )
        if not cand:
            raise SystemExit(f"finetune: no tuning run of {v} collected: run --only tune first")
        best[v] = cand[0]["lr"]
    return best


def main_jobs(variants, epsilons, seeds, lrs, opacus, tiny=False, pretrained=None) -> list[dict]:
    """Each ε (in order): every seed × variant on dpsgd, then the Opacus runs (seed 0)."""
    out = []
    for eps in epsilons:
        for seed in seeds:
            out += [job(v, eps, seed, lrs[v], tiny=tiny, pretrained=pretrained) for v in variants]
        out += [
            job(v, eps, seeds[0], lrs[v], engine="opacus", tiny=tiny, pretrained=pretrained)
            for v in opacus
            if v in lrs
        ]
    return out


def run_job(j: dict, out: Path, results: Path) -> bool:
    """One run as a child process (its peak RSS from os.wait4); its result.json, with the peak memory
    and the command, copied to results/runs/finetune/<tag>/. False when it failed."""
    folder = out / j["tag"]
    if (folder / "result.json").is_file():
        _keep(folder, results / "runs" / "finetune" / j["tag"])
        return True
    folder.mkdir(parents=True, exist_ok=True)
    spec = json.dumps({**j, "out": str(out)})
    cmd = [sys.executable, "-m", "experiments.finetune", "one", spec]
    env = dict(os.environ, OMP_NUM_THREADS="1", MKL_NUM_THREADS="1")
    with open(folder / "run.log", "w") as log:
        proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT)
        _, status, usage = os.wait4(proc.pid, 0)
    if os.waitstatus_to_exitcode(status) != 0 or not (folder / "partial.json").is_file():
        print(f"  {j['tag']}: failed (see {folder / 'run.log'})")
        return False
    row = json.loads((folder / "partial.json").read_text())
    row["max_rss_mb"] = usage.ru_maxrss / 1024  # KiB on Linux
    row["command"] = f"python -m experiments.finetune one '{json.dumps(_portable_job(j))}'"
    (folder / "result.json").write_text(json.dumps(row, indent=1))
    _keep(folder, results / "runs" / "finetune" / j["tag"])
    print(f"  {j['tag']}: accuracy {row['accuracy']:.4f}, {row['seconds_per_epoch']:.0f} s/epoch")
    return True


def _portable_job(j: dict) -> dict:
    p = j["pretrained"]
    return {**j, "pretrained": None if p is None else os.path.relpath(p, ROOT)}


def _keep(folder: Path, dest: Path) -> None:
    dest.mkdir(parents=True, exist_ok=True)
    row = json.loads((folder / "result.json").read_text())
    privacy = row.pop("privacy", None)
    (dest / "result.json").write_text(json.dumps(row, indent=1) + "\n")
    if privacy is not None:
        (dest / "privacy.json").write_text(json.dumps(privacy, indent=1) + "\n")


def _rows(results: Path, split: str) -> list[dict]:
    base = results / "runs" / "finetune" / split
    return [json.loads(p.read_text()) for p in sorted(base.glob("*/result.json"))]


def one(spec: str) -> int:
    """The child: run one job, write outputs/finetune/<tag>/partial.json."""
    from .finetune_runs import run

    j = json.loads(spec)
    folder = Path(j.pop("out", ROOT / "outputs" / "finetune")) / j["tag"]
    row = run(j, log=lambda s: print(s, flush=True))
    row["hardware"] = _hardware()
    (folder / "partial.json").write_text(json.dumps(row))
    return 0


def _hardware() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return f"{line.split(':', 1)[1].strip()}, {os.cpu_count()} cores (shared)"
    except OSError:
        pass
    return f"{os.cpu_count()} CPU cores"


def pretrain_step(out: Path, results: Path, tiny: bool) -> Path:
    """The public pretraining, once (module doc)."""
    import hashlib

    weights = out / "pretrained_vit_fmnist.pt"
    info_path = results / ("finetune_pretrain_tiny.json" if tiny else "finetune_pretrain.json")
    if weights.is_file() and info_path.is_file():
        sha = hashlib.sha256(weights.read_bytes()).hexdigest()
        if json.loads(info_path.read_text())["sha256"] == sha:
            return weights
    import torch

    from dpsgd.data.readers import load_dataset

    from .finetune_model import pretrain

    torch.set_num_threads(1)
    X, y, Xt, yt = load_dataset("fashion_mnist", "data")
    epochs = TINY["pretrain_epochs"] if tiny else PRETRAIN_EPOCHS
    if tiny:
        X, y = X[: TINY["pretrain_subset"]], y[: TINY["pretrain_subset"]]
    info = pretrain(X, y, Xt, yt, epochs, 0, weights)
    info |= {"hardware": _hardware(), "command": "python -m experiments.finetune --only pretrain"}
    results.mkdir(parents=True, exist_ok=True)
    info_path.write_text(json.dumps(info, indent=1) + "\n")
    return weights


COLUMNS = [
    "variant",
    "engine",
    "epsilon_target",
    "seed",
    "accuracy",
    "epsilon",
    "sigma",
    "steps",
    "epochs",
    "lr",
    "momentum",
    "clip_norm",
    "lot_size",
    "N",
    "trainable_params",
    "params",
    "seconds_per_epoch",
    "train_seconds",
    "setup_seconds",
    "train_peak_mb",
    "max_rss_mb",
    "mode",
    "hardware",
    "command",
]


def collect(results: Path, variants=None) -> dict[str, int]:
    """results/finetune.csv (test split) and results/finetune_tuning.csv (held-out split, with the
    chosen learning rate of each variant marked) from results/runs/finetune/; rows per file."""
    import csv

    order = {v: i for i, v in enumerate(("full", "lora", "bias", "head", "scratch"))}
    counts = {}
    for split, name in (("test", "finetune.csv"), ("val", "finetune_tuning.csv")):
        rows = []
        for r in _rows(results, split):
            row = {k: r.get(k) for k in COLUMNS}
            row["epsilon_target"] = r["eps"]
            row["epochs"] = round(r["steps"] * r["q"], 3)
            rows.append(row)
        rows.sort(key=lambda r: (r["engine"], r["epsilon_target"], order.get(r["variant"], 9),
                                 r["seed"], r["lr"]))  # fmt: skip
        if split == "val":
            best = chosen_lr(results, sorted({r["variant"] for r in rows})) if rows else {}
            for r in rows:
                r["chosen"] = best.get(r["variant"]) == r["lr"]
        if rows:
            path = results / name
            with open(path, "w", newline="") as f:
                cols = COLUMNS + (["chosen"] if split == "val" else [])
                w = csv.DictWriter(f, cols, lineterminator="\n")
                w.writeheader()
                w.writerows(rows)
        counts[name] = len(rows)
    return counts


def print_plan(jobs: list[dict], out: Path) -> float:
    """Print the jobs and return the expected wall time in seconds (finished runs cost nothing)."""
    total = 0.0
    for j in jobs:
        done = (out / j["tag"] / "result.json").is_file()
        key = "opacus" if j["engine"] == "opacus" else j["variant"]
        sec = 0.0 if done else (j["epochs"] + 0.5) * SEC_PER_EPOCH[key]  # + setup and evaluation
        total += sec
        print(f"  {j['tag']:52s} {'(done)' if done else f'≈ {sec / 60:4.1f} min'}")
    print(
        f"{len(jobs)} runs, expected wall time ≈ {total / 3600:.1f} h (one at a time, one thread; "
        "seconds per epoch measured on 2 shared AMD EPYC cores)"
    )
    return total


def main(argv: list[str] | None = None) -> int:
    if argv is None:
        argv = sys.argv[1:]
    if argv[:1] == ["one"]:
        return one(argv[1])
    ap = argparse.ArgumentParser(description="Public pretraining, private fine-tuning: run, draw.")
    ap.add_argument("--variants", nargs="+", choices=tuple(LR_GRID), default=list(VARIANTS))
    ap.add_argument("--eps", nargs="+", type=float, default=list(EPSILONS))
    ap.add_argument("--seeds", nargs="+", type=int, default=list(SEEDS))
    ap.add_argument("--opacus", nargs="*", choices=tuple(LR_GRID), default=list(OPACUS))
    steps = ("pretrain", "tune", "run", "collect", "figures")
    ap.add_argument("--only", nargs="+", choices=steps)
    ap.add_argument("--results", type=Path, default=ROOT / "results")
    ap.add_argument("--out", type=Path, default=ROOT / "outputs" / "finetune")
    ap.add_argument("--tiny", action="store_true", help="tiny settings (tests): seconds, not hours")
    ap.add_argument("--dry-run", action="store_true", help="print the plan and the estimate only")
    a = ap.parse_args(argv)
    only = set(a.only or steps)
    weights = a.out / "pretrained_vit_fmnist.pt"
    tune = tuning_jobs(a.variants, a.tiny, weights)
    if a.dry_run:
        lrs = {v: LR_GRID[v][1] for v in LR_GRID}  # a placeholder: tuning chooses them
        print(f"pretraining: {PRETRAIN_EPOCHS} epochs of Fashion-MNIST (≈ 15 min, once)")
        print("tuning (ε = 2, seed 0, held-out split):")
        total = print_plan(tune, a.out)
        print("runs (learning rates as tuning chooses them):")
        total += print_plan(main_jobs(a.variants, a.eps, a.seeds, lrs, a.opacus, a.tiny), a.out)
        print(f"in all ≈ {total / 3600 + 0.25:.1f} h")
        return 0
    failed = 0
    t0 = time.perf_counter()
    if only & {"pretrain", "tune", "run"}:
        weights = pretrain_step(a.out, a.results, a.tiny)
    if "tune" in only:
        failed += sum(not run_job(j, a.out, a.results) for j in tune)
    if "run" in only:
        collect(a.results)
        lrs = chosen_lr(a.results, sorted(set(a.variants) | set(a.opacus)))
        jobs = main_jobs(a.variants, a.eps, a.seeds, lrs, a.opacus, a.tiny, weights)
        print_plan(jobs, a.out)
        failed += sum(not run_job(j, a.out, a.results) for j in jobs)
    if "collect" in only:
        print(f"collected: {collect(a.results)}")
    if "figures" in only:
        from .finetune_figure import draw_file

        for p in draw_file(a.results):
            print(f"wrote {p}")
    print(f"finetune: {time.perf_counter() - t0:.0f} s, {failed} failed")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
