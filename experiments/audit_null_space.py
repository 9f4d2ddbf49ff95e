"""The one-run audit with gradient canaries on the class-sum directions of the softmax output layer
(``audit.placement=null_space``, docs/AUDIT_MATH.md §6), measured on the real trainer.

    python -m experiments.audit_null_space                 # run what is missing, then collect
    # results/audit_null_space.csv from results/runs/audit_null_space/
    python -m experiments.audit_null_space --only collect
    python -m experiments.audit_null_space --rows a,b      # some rows only
    # results/audit_null_space_seeds.csv (validity)
    python -m experiments.audit_null_space seeds [--n 50] [--out F.csv]
    # results/audit_null_space_timing.csv (cost)
    python -m experiments.audit_null_space timing ROW
    # the timed audit becomes the row's committed run
    python -m experiments.audit_null_space adopt ROW

Details: docs/DEVELOPMENT.md, "experiments/audit_null_space.py".
"""

from __future__ import annotations

import argparse
import csv
import io
import json
import os
import shutil
import subprocess
import sys
import time

from . import audit_table
from .audit_table import HARDWARE, SMALL, claim_for_lots
from .paths import ROOT

NS = ["audit.placement=null_space", "audit.normalise=claimed"]
MIXED = ["audit.placement=null_space_dirac", "audit.normalise=claimed"]
SHORT = ["privacy.target_epsilon=null", "training.max_steps=1000"]
VARIANTS = ("correct", "no_clip", "noise_div10", "noise_per_rank", "realised_lot", "loose_group")


def rows() -> dict:
    """{row: (audit overrides, the training run it audits or None)}."""
    scatter = ["experiment=mnist_scatter_linear", "privacy.target_epsilon=2"]
    out = {
        "mnist_scatter_linear_eps2_null_space": (
            scatter + NS + ["audit.gradient_canaries=3970", "audit.input_canaries=1000"],
            scatter,
        )
    }
    for preset in ("mnist_medium", "mnist_small"):
        for name, pl in (("null_space", NS), ("null_space_dirac", MIXED)):
            out[f"{preset}_{name}"] = (
                [
                    f"experiment={preset}",
                    *pl,
                    "audit.gradient_canaries=1000",
                    "audit.input_canaries=1000",
                ],
                [f"experiment={preset}"] if name == "null_space" else None,
            )
    for sigma in (2.0, 4.0, 8.0):
        base = ["experiment=mnist_medium", f"privacy.sigma={sigma}", *SHORT]
        for v in VARIANTS:
            out[f"sigma{sigma:g}_{v}_1000lots_null_space"] = (
                base
                + NS
                + [
                    "audit.gradient_canaries=1000",
                    "audit.input_canaries=1000",
                    f"audit.variant={v}",
                ],
                None,
            )
        out[f"sigma{sigma:g}_shuffle_1000lots_null_space"] = (
            base
            + ["privacy.sampling=shuffle"]
            + NS
            + ["audit.gradient_canaries=1000", "audit.input_canaries=1000"],
            None,
        )
    return out


def _timed(cmd: list[str]) -> float:
    print("$", " ".join(cmd[1:]), flush=True)
    t = time.perf_counter()
    subprocess.run(cmd, check=True, cwd=ROOT, env={**os.environ, "DPSGD_THREADS": "1"})
    return time.perf_counter() - t


def run_row(name: str, overrides: list[str], train: list[str] | None) -> None:
    out, dest = (
        ROOT / "outputs" / "audit_null_space" / name,
        ROOT / "results" / "runs" / "audit_null_space" / name,
    )
    if not (dest / "audit.json").is_file():
        if out.exists():
            shutil.rmtree(out)
        wall = _timed(
            [sys.executable, "-m", "dpsgd.audit", "run", *overrides, f"hydra.run.dir={out}"]
        )
        dest.mkdir(parents=True, exist_ok=True)
        for f in SMALL:
            shutil.copyfile(out / f, dest / f)
        (dest / "wall.json").write_text(json.dumps({"audit_wall_s": round(wall, 1)}) + "\n")
    walls = json.loads((dest / "wall.json").read_text())
    if train is not None and "train_wall_s" not in walls:
        tout = ROOT / "outputs" / "audit_null_space" / f"{name}_train"
        if tout.exists():
            shutil.rmtree(tout)
        walls["train_wall_s"] = round(
            _timed([sys.executable, "-m", "dpsgd.train", *train, f"hydra.run.dir={tout}"]), 1
        )
        walls["train_command"] = "python -m dpsgd.train " + " ".join(train)
        (dest / "wall.json").write_text(json.dumps(walls) + "\n")


COLUMNS = [
    "row",
    "placement",
    "normalise",
    "variant",
    "sampling",
    "sigma",
    "steps",
    "groups",
    "canary_groups_used",
    "m_gradient",
    "eps_claimed",
    "eps_claimed_sgd",
    "family_eps_lb",
    "family_ratio_sgd",
    "verdict_family",
    "order_stats_eps_lb",
    "order_stats_ratio_sgd",
    "order_stats_independence",
    "verdict_order_stats",
    "steinke_eps_lb",
    "steinke_ratio_sgd",
    "gdp_eps_lb",
    "gdp_ratio_sgd",
    "out_var_ratio",
    "noise_ratio",
    "noise_ratio_upper",
    "verdict_noise",
    "eps_cap_k_used",
    "cap_ratio",
    "verdict_channel",
    "audit_wall_s",
    "train_wall_s",
    "wall_ratio",
    "hardware",
    "command",
    "train_command",
]


def _ratio(x, lots):
    return None if x is None or not lots else round(x / lots, 3)


def _cap(a: dict) -> tuple[float, float]:
    """The claim at the σ of the canary groups used alone, and its ratio to the claim."""
    from dpsgd.audit.onerun.stats.family import Claim

    r = a["run"]
    claim = Claim(r["L"] / r["N"], r["sigma"], r["steps"], r["groups"], a["delta"]).validate()
    cap = claim.epsilon(r["sigma"] * (r["groups"] / r["canary_groups_used"]) ** 0.5)
    return round(cap, 4), round(cap / claim.epsilon(), 3)


def collect() -> list[dict]:
    table = []
    for name, (overrides, _) in rows().items():
        d = ROOT / "results" / "runs" / "audit_null_space" / name
        if not (d / "audit.json").is_file():
            continue
        a, walls = (
            json.loads((d / "audit.json").read_text()),
            json.loads((d / "wall.json").read_text()),
        )
        lots = claim_for_lots(json.loads((d / "privacy.json").read_text()))
        wb = next(g for g in a["games"] if g["game"].startswith("white-box"))
        fam = a.get("family") or {}
        osb = fam.get("order_stats") or {}
        pl = a["run"]["canary_placement"]
        row = {
            "row": name,
            "placement": pl["placement"],
            "normalise": pl["normalise"],
            "variant": a["variant"],
            "sampling": a["run"]["sampling"],
            "sigma": a["run"]["sigma"],
            "steps": a["run"]["steps"],
            "groups": a["run"]["groups"],
            "canary_groups_used": a["run"]["canary_groups_used"],
            "m_gradient": a["options"]["gradient_canaries"],
            "eps_claimed": round(a["eps_claimed"], 4),
            "eps_claimed_sgd": round(lots, 4),
            "family_eps_lb": fam.get("eps_lower_bound"),
            "verdict_family": a.get("verdict_family"),
            "order_stats_eps_lb": osb.get("eps_lower_bound"),
            "order_stats_independence": osb.get("independence"),
            "verdict_order_stats": None
            if not osb
            else ("violation" if osb["claim_rejected"] else "consistent"),
            "steinke_eps_lb": wb["eps_lower_bound"],
            "gdp_eps_lb": wb["gdp_eps_lower_bound"],
            "out_var_ratio": None if not fam else fam["interference"]["out_var_ratio"],
            "audit_wall_s": walls["audit_wall_s"],
            "train_wall_s": walls.get("train_wall_s"),
            "hardware": HARDWARE,
            "command": "python -m dpsgd.audit run " + " ".join(overrides),
            "train_command": walls.get("train_command"),
        }
        for k in ("family", "order_stats", "steinke", "gdp"):
            row[f"{k}_ratio_sgd"] = _ratio(row[f"{k}_eps_lb"], lots)
        nt = a.get("noise_test") or {}
        row["noise_ratio"] = None if not nt else round(nt["noise_ratio"], 4)
        row["noise_ratio_upper"] = None if not nt else round(nt["noise_ratio_upper"], 4)
        row["verdict_noise"] = nt.get("verdict")
        row["eps_cap_k_used"] = row["cap_ratio"] = None
        row["verdict_channel"] = (fam.get("channel") or {}).get("verdict_channel")
        if fam and a["run"]["sampling"] == "poisson":
            row["eps_cap_k_used"], row["cap_ratio"] = _cap(a)
        row["wall_ratio"] = (
            None if not row["train_wall_s"] else round(row["audit_wall_s"] / row["train_wall_s"], 2)
        )
        for k in (
            "family_eps_lb",
            "order_stats_eps_lb",
            "steinke_eps_lb",
            "gdp_eps_lb",
            "out_var_ratio",
        ):
            row[k] = None if row[k] is None else round(row[k], 4)
        table.append(row)
    buf = io.StringIO()
    w = csv.DictWriter(buf, COLUMNS, lineterminator="\n")
    w.writeheader()
    w.writerows(table)
    (ROOT / "results" / "audit_null_space.csv").write_text(buf.getvalue())
    print(f"results/audit_null_space.csv: {len(table)} audits")
    write_doc_table(table)
    return table


TINY = [
    "dataset.subset=300",
    "privacy.lot_size=300",
    "model.hidden=[1000]",
    "model.pca_dims=10",
    "training.epochs=6",
    "device=cpu",
    "privacy.sigma=3",
    "privacy.sigma_p=20",
    "training.eval_batch_size=1000",
]


def seeds(n: int, out=ROOT / "results" / "audit_null_space_seeds.csv") -> list[dict]:
    """The real trainer, seeded: ``n`` audits of the correct mechanism (then of ``noise_per_rank``,
    R = 4: noise σC/2) on a small configuration — 300 real MNIST images, 1000 gradient canaries on
    the 1000 class-sum directions of the output layer (1000 hidden units, no bias), L = 300, 24
    lots, σ = 3, k = 2 (the canaries use k_used = 1) — null-space placement, claimed normalisation,
    audit.seed = training seed = 0..n−1. A correct run may be flagged by each test with probability
    ≤ β = 0.05 per audit."""
    from dataclasses import asdict

    from dpsgd.audit.onerun.instrument import AuditOptions
    from dpsgd.audit.onerun.run import ENV, audit_train
    from dpsgd.config.schema import validate
    from dpsgd.launch.cli import compose

    rows = []
    for variant in ("correct", "noise_per_rank"):
        for seed in range(n):
            o = AuditOptions(
                gradient_canaries=1000,
                input_canaries=0,
                variant=variant,
                ranks=4,
                seed=seed,
                placement="null_space",
                normalise="claimed",
            ).validate()
            os.environ[ENV] = json.dumps(asdict(o))
            overrides = TINY + [f"seed={seed}"]
            run_dir = ROOT / "outputs" / "audit_null_space_seeds" / f"{variant}_seed{seed}"
            if run_dir.exists():
                shutil.rmtree(run_dir)
            t = time.perf_counter()
            audit_train(validate(compose(overrides)), run_dir, overrides)
            a = json.loads((run_dir / "audit.json").read_text())
            f = a["family"]
            osb = f["order_stats"]
            rows.append(
                {
                    "variant": variant,
                    "seed": seed,
                    "sigma": a["run"]["sigma"],
                    "lots": a["run"]["steps"],
                    "groups": a["run"]["groups"],
                    "canary_groups_used": a["run"]["canary_groups_used"],
                    "q": round(a["run"]["q"], 6),
                    "m": 1000,
                    "beta": f["beta"],
                    "eps_claimed_lots": round(f["eps_claimed_lots"], 4),
                    "family_eps_lb": round(f["eps_lower_bound"], 4),
                    "verdict_family": f["verdict_family"],
                    "order_stats_eps_lb": round(osb["eps_lower_bound"], 4),
                    "order_stats_independence": osb["independence"],
                    "verdict_order_stats": "violation" if osb["claim_rejected"] else "consistent",
                    "verdict_channel": f["channel"]["verdict_channel"] if "channel" in f else None,
                    "steinke_eps_lb": round(a["eps_lower_bound"], 4),
                    "verdict_steinke_vs_lots": "violation"
                    if a["eps_lower_bound"] > f["eps_claimed_lots"]
                    else "consistent",
                    "out_var_ratio": round(f["interference"]["out_var_ratio"], 4),
                    "noise_ratio": round(a["noise_test"]["noise_ratio"], 5)
                    if "noise_test" in a
                    else None,
                    "noise_p_value": a["noise_test"]["p_value"] if "noise_test" in a else None,
                    "verdict_noise": a["noise_test"]["verdict"] if "noise_test" in a else None,
                    "seconds": round(time.perf_counter() - t, 1),
                    "command": f"python -m experiments.audit_null_space seeds --n {n} --out "
                    f"{out.name}",
                }
            )
            print(rows[-1], flush=True)
            _write(rows, out)
    return rows


def _write(rows: list[dict], out) -> None:
    buf = io.StringIO()
    w = csv.DictWriter(buf, list(rows[0]), lineterminator="\n")
    w.writeheader()
    w.writerows(rows)
    out.write_text(buf.getvalue())


BEGIN, END = (
    "<!-- audit-null-space:begin (python -m experiments.audit_null_space --only collect) -->",
    "<!-- audit-null-space:end -->",
)


def _f(x, digits=3) -> str:
    return "–" if x is None or x == "" else f"{float(x):.{digits}f}"


def doc_table(table: list[dict]) -> str:
    """The markdown table of docs/AUDIT.md from the rows of results/audit_null_space.csv."""
    lines = [
        "| audit | placement (k_used / k) | mechanism | σ | lots | m | lots' claim | order stats "
        "ε_lb (/ claim) | family ε_lb (/ claim) | Steinke ε_lb (/ claim) | verdicts: order "
        "stats, family, Steinke | out_var_ratio | noise / σC (≤ at 1 − β): verdict | cap "
        "(k_used) | own channel (k_used groups at σ) | wall: audit / train |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in table:
        mech = (
            r["variant"] if r["sampling"] == "poisson" else f"{r['variant']}, {r['sampling']} lots"
        )
        osb = (
            "–"
            if r["order_stats_eps_lb"] is None
            else (
                f"{_f(r['order_stats_eps_lb'])} ({_f(r['order_stats_ratio_sgd'], 2)}, "
                f"{r['order_stats_independence']})"
            )
        )
        fam = (
            "–"
            if r["family_eps_lb"] is None
            else f"{_f(r['family_eps_lb'])} ({_f(r['family_ratio_sgd'], 2)})"
        )
        st_v = "violation" if r["steinke_eps_lb"] > r["eps_claimed_sgd"] else "consistent"
        verdicts = ", ".join(
            ("**V**" if v == "violation" else "c")
            for v in (r["verdict_order_stats"], r["verdict_family"], st_v)
            if v is not None
        )
        noise = (
            "–"
            if r["noise_ratio"] is None
            else (
                f"{r['noise_ratio']:.3f} (≤ {r['noise_ratio_upper']:.3f}): "
                + ("**V**" if r["verdict_noise"] == "violation" else "c")
            )
        )
        channel = {"violation": "**V**", "consistent": "c"}.get(r["verdict_channel"], "–")
        wall = f"{r['audit_wall_s']:.0f} s" + (
            f" / {r['train_wall_s']:.0f} s" if r["train_wall_s"] else ""
        )
        lines.append(
            f"| {r['row']} | {r['placement']} ({r['canary_groups_used']} / {r['groups']}) | "
            f"{mech} | {float(r['sigma']):.3g} | {r['steps']} | {r['m_gradient']} | "
            f"{_f(r['eps_claimed_sgd'])} | {osb} | {fam} | {_f(r['steinke_eps_lb'])} "
            f"({_f(r['steinke_ratio_sgd'], 2)}) | {verdicts} | {_f(r['out_var_ratio'])} | {noise} "
            f"| {_f(r['cap_ratio'], 2)} | {channel} | {wall} |"
        )
    return "\n".join(lines)


def write_doc_table(table: list[dict]) -> None:
    audit_table.write_doc_table(table, doc_table(table), BEGIN, END)


def timing(name: str, out=ROOT / "results" / "audit_null_space_timing.csv") -> dict:
    """The audit of row ``name`` and the training run it audits, started together as two processes
    (``DPSGD_THREADS=1`` each), so that both see the same load on a shared machine; wall time of
    each."""
    overrides, train = rows()[name]
    base = ROOT / "outputs" / "audit_null_space_timing"
    procs, t0 = {}, time.perf_counter()
    for kind, cmd in (
        ("audit", ["-m", "dpsgd.audit", "run", *overrides]),
        ("train", ["-m", "dpsgd.train", *train]),
    ):
        d = base / f"{name}_{kind}"
        if d.exists():
            shutil.rmtree(d)
        procs[kind] = subprocess.Popen(
            [sys.executable, *cmd, f"hydra.run.dir={d}"],
            cwd=ROOT,
            stdout=subprocess.DEVNULL,
            env={**os.environ, "DPSGD_THREADS": "1"},
        )
    walls = {}
    while len(walls) < 2:
        for kind, p in procs.items():
            if kind not in walls and p.poll() is not None:
                if p.returncode:
                    raise SystemExit(f"{kind} exited {p.returncode}")
                walls[kind] = round(time.perf_counter() - t0, 1)
        time.sleep(0.5)
    row = {
        "row": name,
        "audit_wall_s": walls["audit"],
        "train_wall_s": walls["train"],
        "wall_ratio": round(walls["audit"] / walls["train"], 3),
        "started": "together, DPSGD_THREADS=1 each",
        "hardware": HARDWARE,
        "command": "python -m dpsgd.audit run " + " ".join(overrides),
        "train_command": "python -m dpsgd.train " + " ".join(train),
    }
    old = list(csv.DictReader(out.open())) if out.is_file() else []
    _write(old + [row], out)
    print(row, flush=True)
    return row


def adopt(name: str, timings=ROOT / "results" / "audit_null_space_timing.csv") -> None:
    """Row ``name``'s committed run replaced by its latest timed audit (``timing``): the same
    command, its small files, and both wall times from the measurement where audit and training
    started together."""
    t = [r for r in csv.DictReader(timings.open()) if r["row"] == name][-1]
    src, dest = (
        ROOT / "outputs" / "audit_null_space_timing" / f"{name}_audit",
        ROOT / "results" / "runs" / "audit_null_space" / name,
    )
    dest.mkdir(parents=True, exist_ok=True)
    for f in SMALL:
        shutil.copyfile(src / f, dest / f)
    (dest / "wall.json").write_text(
        json.dumps(
            {
                "audit_wall_s": float(t["audit_wall_s"]),
                "train_wall_s": float(t["train_wall_s"]),
                "train_command": t["train_command"],
                "timing": t["started"],
            }
        )
        + "\n"
    )


def main(argv: list[str] | None = None) -> None:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["adopt"]:
        adopt(argv[1])
        return
    if argv[:1] == ["timing"]:
        timing(argv[1])
        return
    if argv[:1] == ["seeds"]:
        n = int(argv[2]) if argv[1:2] == ["--n"] else 50
        seeds(n, *([ROOT / "results" / argv[4]] if argv[3:4] == ["--out"] else []))
        return
    ap = argparse.ArgumentParser(prog="python -m experiments.audit_null_space")
    ap.add_argument("--rows", default="all", help="all | a comma-separated list of row names")
    ap.add_argument("--only", choices=["run", "collect"], default=None)
    a = ap.parse_args(argv)
    table = rows()
    chosen = list(table) if a.rows == "all" else a.rows.split(",")
    unknown = [r for r in chosen if r not in table]
    if unknown:
        ap.error(f"--rows: unknown rows {unknown}; one of {sorted(table)}")
    if a.only != "collect":
        for r in chosen:
            run_row(r, *table[r])
    if a.only != "run":
        collect()


if __name__ == "__main__":
    main()
