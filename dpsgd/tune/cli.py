"""``python -m dpsgd.tune``: a private hyperparameter selection (Papernot & Steinke 2022).

    python -m dpsgd.tune --sweep-dir runs/tune/a --target-epsilon 1.2 --delta 1e-5 \\
        --distribution truncated_negative_binomial --eta 0 --gamma 0.2 --validation 10000 \\
        --seed 0 experiment=mnist_scatter_linear training.epochs=10,15,20,40,60
    python -m dpsgd.tune --resume runs/tune/a   (a killed sweep: same plan, nothing charged less)

The overrides are Hydra-style (``key=a,b,c`` is a choice; the rest are fixed). Every candidate is a
``python -m dpsgd.train`` run in its own folder of the sweep, at the σ that makes the whole
selection spend at most ``--target-epsilon`` (docs/TUNING.md). Bad input: one line naming the
parameter, exit 2, before anything is written.
"""

from __future__ import annotations

import argparse
import math
import os
import signal
import sys
from pathlib import Path

from dpsgd.accountant import limits, selection
from dpsgd.core.errors import ConfigError
from dpsgd.core.errors import one_line
from dpsgd.launch.cli import check_name_lengths, compose, fail, fresh_dir, hydra_quoted
from dpsgd.launch.sweeps import SweepClaim, unclaimed
from dpsgd.tune import space, sweep

PROG = "python -m dpsgd.tune"


class _Parser(argparse.ArgumentParser):
    def error(self, message):  # one line, exit 2 (argparse would print the usage too)
        fail(f"{PROG}: {message}", 2)


def parser() -> argparse.ArgumentParser:
    p = _Parser(
        prog=PROG, description="Private hyperparameter selection (Papernot & Steinke 2022)."
    )
    p.add_argument("--sweep-dir", type=Path, help="the sweep folder (new or empty)")
    p.add_argument(
        "--resume", type=Path, help="continue the sweep in this folder (its tuning.json)"
    )
    p.add_argument("--target-epsilon", type=float, help="total ε of the released winner")
    p.add_argument("--delta", type=float, default=limits.DELTA_DEFAULT)
    p.add_argument(
        "--distribution", choices=selection.DISTRIBUTIONS, default="truncated_negative_binomial"
    )
    p.add_argument("--k", type=int, help="fixed: the number of candidates")
    p.add_argument("--mu", type=float, help="poisson: the mean of K")
    p.add_argument(
        "--eta", type=float, help="truncated_negative_binomial: η (1 geometric, 0 logarithmic)"
    )
    p.add_argument("--gamma", type=float, help="truncated_negative_binomial: γ in (0, 1)")
    p.add_argument(
        "--seed", type=int, default=0, help="K, the candidates, their seeds and score noise"
    )
    p.add_argument("--validation", type=int, help="training rows held out to score the candidates")
    p.add_argument(
        "--score-sigma",
        type=float,
        default=20.0,
        help="std of the Gaussian noise on each candidate's count of correct validation "
        "predictions",
    )
    p.add_argument(
        "--xtol", type=float, default=1e-3, help="tolerance on the base ε of the inverse search"
    )
    p.add_argument(
        "--test-accuracy",
        action="store_true",
        help="after the selection, evaluate the winner's model on the test set once",
    )
    p.add_argument("--plan-only", action="store_true", help="write the plan (tuning.json) and stop")
    p.add_argument("overrides", nargs="*", help="Hydra-style overrides; key=a,b,c is a choice")
    return p


def _dist(a) -> selection.KDistribution:
    given = {"k": a.k, "mu": a.mu, "eta": a.eta, "gamma": a.gamma}
    need = {"fixed": ("k",), "poisson": ("mu",), "truncated_negative_binomial": ("eta", "gamma")}[
        a.distribution
    ]
    for key, v in given.items():
        if v is not None and key not in need:
            raise ConfigError(f"--{key}: not a parameter of --distribution={a.distribution}")
        if v is None and key in need:
            raise ConfigError(f"--{key}: needed by --distribution={a.distribution}")
    try:
        return selection.KDistribution(a.distribution, **{k: given[k] for k in need})
    except ValueError as e:
        raise ConfigError(f"--{str(e).split(' ', 1)[0]}: {e}") from None


def check(a) -> tuple[selection.KDistribution, list]:
    """Every argument, before any work: one ConfigError line naming every bad one (a user fixing
    the first should not find the next only on the next try)."""
    bad = []
    if a.sweep_dir is None:
        bad.append("--sweep-dir: needed (or --resume <sweep dir>)")
    eps_ok = a.target_epsilon is not None and 0 < a.target_epsilon <= limits.EPSILON_MAX
    if not eps_ok:
        bad.append(f"--target-epsilon={a.target_epsilon}: must be in (0, {limits.EPSILON_MAX:g}]")
    if not (limits.DELTA_MIN <= a.delta < 1):
        bad.append(f"--delta={a.delta}: must be in [{limits.DELTA_MIN:g}, 1)")
    if a.seed < 0:
        bad.append(f"--seed={a.seed}: must be >= 0")
    if a.validation is None or a.validation < 1:
        bad.append(
            f"--validation={a.validation}: the number of training rows that score the candidates "
            "(>= 1; never the test set)"
        )
    if not (math.isfinite(a.score_sigma) and a.score_sigma > 0):
        bad.append(
            f"--score-sigma={a.score_sigma}: must be > 0 (the score is charged as a Gaussian count)"
        )
    if not (math.isfinite(a.xtol) and 0 < a.xtol < (a.target_epsilon if eps_ok else math.inf)):
        bad.append(f"--xtol={a.xtol}: must be in (0, --target-epsilon)")
    if not a.overrides:
        bad.append("overrides: give the runs' config, e.g. experiment=... training.epochs=10,20")
    try:
        _dist(a)
    except ConfigError as e:
        bad.append(str(e))
    if bad:
        raise ConfigError("; ".join(bad))
    dist = _dist(a)
    check_name_lengths("--sweep-dir", a.sweep_dir)
    unclaimed(str(a.sweep_dir), "--sweep-dir")  # held by a running tune or sweep: says so
    fresh_dir("--sweep-dir", a.sweep_dir)
    literal_for_hydra(a.sweep_dir)
    pts = space.points(a.overrides, a.validation)
    return dist, pts


def literal_for_hydra(d: Path) -> None:
    """A candidate's folder ``d/c00``, handed to Hydra quoted, is that folder (not an interpolation
    of it); ConfigError naming ``--sweep-dir`` otherwise."""
    folder = str(d / "c00")
    try:
        got = str(
            compose([f"hydra.run.dir={hydra_quoted(folder)}"], hydra_config=True).hydra.run.dir
        )
    except Exception as e:
        raise ConfigError(
            f"--sweep-dir={d}: cannot be handed to Hydra as a folder ({one_line(e)})"
        ) from None
    if got != folder:
        raise ConfigError(
            f"--sweep-dir={d}: Hydra reads it as {got} (pick a folder name without '${{')"
        )


def start(a, held: list) -> tuple[Path, dict]:
    """The new sweep: every argument checked, the plan made, the folder claimed (``SweepClaim``: of
    two tunes started together into one folder one proceeds, the other is refused), the plan
    written."""
    dist, pts = check(a)
    fixed, choices = space.split(a.overrides)
    args = {
        "target_epsilon": a.target_epsilon,
        "delta": a.delta,
        "xtol": a.xtol,
        "score_sigma": a.score_sigma,
        "validation": a.validation,
        "search_space": {"fixed": fixed, "choices": choices},
    }
    try:
        t = sweep.plan(pts, dist, a.seed, args)
    except ValueError as e:
        raise ConfigError(f"--target-epsilon={a.target_epsilon}: {one_line(e)}") from None
    t["command"] = " ".join([PROG] + sys.argv[1:])
    held.append(SweepClaim(str(a.sweep_dir), "--sweep-dir"))
    sweep.save(a.sweep_dir, t)
    return a.sweep_dir, t


def resume(a, held: list) -> tuple[Path, dict]:
    """The sweep of ``--resume``: claimed (not while another tune or sweep holds it), its plan read
    and checked (one line naming the file when it is not a whole plan)."""
    _resume_alone(a)
    check_name_lengths("--resume", a.resume)
    if not (a.resume / sweep.TUNING).is_file():
        raise ConfigError(f"--resume={a.resume}: no {sweep.TUNING} there")
    held.append(SweepClaim(str(a.resume), "--resume", fresh=False))
    return a.resume, sweep.load(a.resume)


def _resume_alone(a) -> None:
    """--resume takes the plan from tuning.json: a plan argument beside it is refused, named."""
    p = parser()
    for key in (
        "sweep_dir",
        "target_epsilon",
        "delta",
        "distribution",
        "k",
        "mu",
        "eta",
        "gamma",
        "seed",
        "validation",
        "score_sigma",
        "xtol",
        "overrides",
    ):
        if getattr(a, key) != p.get_default(key) and not (key == "overrides" and not a.overrides):
            raise ConfigError(
                f"--{key.replace('_', '-')}: not with --resume (the plan is in its {sweep.TUNING})"
            )


def _term(signum, frame):
    raise KeyboardInterrupt


def main(argv: list[str] | None = None) -> None:
    """The selection; every expected failure is one line on stderr: 2 bad input (nothing written), 1
    a disk error or no candidate finished, 130 interrupted. The folder is claimed until the end."""
    a = parser().parse_args(argv)
    held, d = [], a.resume if a.resume is not None else a.sweep_dir
    try:
        _main(a, held)
    except OSError as e:
        hint = (
            f" (resume with: {PROG} --resume {d})"
            if d is not None and os.path.isfile(d / sweep.TUNING)
            else ""
        )
        fail(f"{e.filename + ': ' if e.filename else ''}{e.strerror or e}{hint}", 1)
    finally:
        for claim in held:
            claim.release()


def _main(a, held: list) -> None:
    try:
        d, t = resume(a, held) if a.resume is not None else start(a, held)
    except ConfigError as e:
        fail(one_line(e), 2)
    print(
        f"{PROG}: K={t['K']} candidates, each DP-SGD run at base ε={t['base']['epsilon_rdp']:.4f} "
        f"(RDP), planned total ε={t['base']['planned_total']['epsilon']:.4f}; {d / sweep.TUNING}",
        flush=True,
    )
    if a.plan_only:
        return
    signal.signal(signal.SIGTERM, _term)
    try:
        t = sweep.run_all(d, t)
    except KeyboardInterrupt:
        fail(f"interrupted: resume with {PROG} --resume {d}", 130)
    except ConfigError as e:
        fail(one_line(e), 2)
    if a.test_accuracy and t["winner"] is not None:
        from dpsgd.tune.winner import test_accuracy

        w = t["winner"]
        t["after_selection"] = {
            "winner_test_accuracy": test_accuracy(d / w["run_dir"], w["overrides"]),
            "note": "the winner's released model on the test set, evaluated once after the "
            "selection; never used to select",
        }
        sweep.save(d, t)
    if t["winner"] is not None:
        print(f"{PROG}: winner {t['winner']['choice']}; {t['privacy']['statement']}", flush=True)
    elif t["K"] == 0:
        print(
            f"{PROG}: K=0 was drawn: no candidate ran and nothing is released; "
            f"{t['privacy']['statement']}",
            flush=True,
        )
    else:
        ran = ", ".join(
            f"{c['run_dir']} {c['status']}" + (f" (exit {c['rc']})" if c.get("rc") else "")
            for c in t["candidates"]
        )
        fail(
            f"no candidate finished ({ran}; their logs: {d / 'logs'}): nothing is released; the "
            f"privacy spent is stated in {d / sweep.TUNING} (ε={t['privacy']['epsilon']:.4f})",
            1,
        )
