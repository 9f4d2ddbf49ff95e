"""A private selection's sweep folder: the plan written ahead, the candidate runs, the winner, the
statement.

    <sweep>/tuning.json        K, its law, the seed, every candidate (overrides, run dir, status,
                               score), the winner and the privacy statement (rewritten atomically
                               after each step)
    <sweep>/c00, c01, ...      each candidate's own run directory (metrics.csv, privacy.json,
                               checkpoint.pt)
    <sweep>/logs/c00.log       its output

Details: docs/TUNING.md, "dpsgd/tune/sweep.py".
"""

from __future__ import annotations

import csv
import json
import math
import os
import subprocess
import sys
from pathlib import Path

import numpy as np

from dpsgd.accountant import compose, rdp, selection
from dpsgd.accountant.ledger import Ledger
from dpsgd.config.fingerprint import config_fingerprint
from dpsgd.config.overrides import override_key
from dpsgd.config.schema import validate
from dpsgd.core.errors import ConfigError
from dpsgd.core.fileio import write_json
from dpsgd.run.checkpoint import CHECKPOINT, load_checkpoint
from dpsgd.core.errors import one_line
from dpsgd.launch.cli import compose as compose_config, hydra_quoted
from dpsgd.tune.space import Point, run_overrides

FORMAT = "dpsgd.tuning/1"
TUNING = "tuning.json"


def plan(points: list[Point], dist: selection.KDistribution, seed: int, args: dict) -> dict:
    """The write-ahead plan: σ per grid point (``selection.plan_sigmas``), K ~ dist, K candidates
    drawn uniformly from the grid, a seed each; all from ``seed`` (numpy PCG64)."""
    eps_b, sigmas, curve, (eps, order) = selection.plan_sigmas(
        [(p.q, p.lots, p.groups) for p in points],
        args["target_epsilon"],
        args["delta"],
        dist,
        args["xtol"],
        args["score_sigma"],
    )
    rng = np.random.default_rng(seed)
    K = dist.sample(rng)
    idx = [int(i) for i in rng.integers(len(points), size=K)]
    seeds = [int(s) for s in rng.integers(0, 2**31 - 1, size=K)]
    grid = [
        {
            "choice": p.choice,
            "overrides": list(p.overrides),
            "q": p.q,
            "lots": p.lots,
            "groups": p.groups,
            "sigma": s,
        }
        for p, s in zip(points, sigmas)
    ]
    cands = [
        {
            "index": j,
            "point": i,
            "choice": points[i].choice,
            "seed": seeds[j],
            "sigma": sigmas[i],
            "overrides": list(points[i].overrides)
            + run_overrides(args["validation"], sigmas[i], seeds[j]),
            "run_dir": f"c{j:02d}",
            "status": "pending",
            "aborted_attempts": 0,
        }
        for j, i in enumerate(idx)
    ]
    return {
        "format": FORMAT,
        "status": "planned",
        "seed": seed,
        "distribution": dist.to_dict(),
        "K": K,
        **{k: args[k] for k in ("target_epsilon", "delta", "xtol", "score_sigma", "validation")},
        "search_space": args["search_space"],
        "grid": grid,
        "base": {
            "epsilon_rdp": eps_b,
            "planned_total": {"epsilon": eps, "order": order},
            "curve_orders": list(rdp.DEFAULT_ORDERS),
            "planned_curve": [float(x) for x in curve],
        },
        "candidates": cands,
        "winner": None,
        "privacy": None,
    }


def dist_of(t: dict) -> selection.KDistribution:
    d = {k: v for k, v in t["distribution"].items() if k != "mean"}
    return selection.KDistribution(**d)


def save(sweep: Path, t: dict) -> None:
    write_json(sweep / TUNING, t)


def load(sweep: Path, key: str = "--resume") -> dict:
    """The plan in ``sweep``'s tuning.json, its structure checked (``check_plan``); ConfigError in
    one line naming ``key`` and the file when it cannot be read, is not JSON or is not a whole
    plan."""
    path = sweep / TUNING
    try:
        t = json.loads(path.read_text())
    except OSError as e:
        raise ConfigError(f"{key}={sweep}: {path}: cannot be read ({e.strerror or e})") from None
    except ValueError as e:  # JSONDecodeError, or bytes that are not UTF-8
        raise ConfigError(
            f"{key}={sweep}: {path}: not valid JSON ({one_line(e)}); it cannot be resumed"
        ) from None
    try:
        check_plan(t)
    except (KeyError, TypeError, ValueError, IndexError) as e:
        why = f"lacks {e.args[0]!r}" if isinstance(e, KeyError) else one_line(e)
        raise ConfigError(
            f"{key}={sweep}: {path}: {why} (not a whole {FORMAT} plan); it cannot be resumed"
        ) from None
    return t


_STATUSES = ("pending", "running", "complete", "failed")


def _is(value, kind, what: str):
    """``value`` if it is of ``kind`` (a bool is no number), else ValueError naming ``what``."""
    if isinstance(value, bool) and kind is not bool or not isinstance(value, kind):
        raise ValueError(f"{what}={value!r}: of the wrong type")
    if isinstance(value, float) and not math.isfinite(value):
        raise ValueError(f"{what}={value!r}: not finite")
    return value


def check_plan(t) -> None:
    """Every field of a tuning.json that ``--resume`` reads, of its type (KeyError naming a missing
    key, ValueError a wrong one): the law of K, the grid, the base curve, K candidates in order,
    each in its own folder ``cNN`` of the sweep."""
    num = (int, float)
    if not isinstance(t, dict) or t.get("format") != FORMAT:
        raise ValueError(f"format: not {FORMAT}")
    _is(t["distribution"], dict, "distribution")
    dist_of(t)
    for k in ("target_epsilon", "delta", "xtol", "score_sigma"):
        _is(t[k], num, k)
    for k in ("seed", "validation", "K"):
        _is(t[k], int, k)
    grid = _is(t["grid"], list, "grid")
    for i, g in enumerate(grid):
        for k, kind in (
            ("q", num),
            ("sigma", num),
            ("lots", int),
            ("groups", int),
            ("overrides", list),
        ):
            _is(_is(g, dict, f"grid[{i}]")[k], kind, f"grid[{i}].{k}")
    base = _is(t["base"], dict, "base")
    _is(base["epsilon_rdp"], num, "base.epsilon_rdp")
    _is(
        _is(base["planned_total"], dict, "base.planned_total")["epsilon"],
        num,
        "base.planned_total.epsilon",
    )
    curve = _is(base["planned_curve"], list, "base.planned_curve")
    if len(curve) != len(rdp.DEFAULT_ORDERS) or not all(
        _is(x, num, "base.planned_curve[]") >= 0 for x in curve
    ):
        raise ValueError(f"base.planned_curve: not {len(rdp.DEFAULT_ORDERS)} values >= 0")
    cands = _is(t["candidates"], list, "candidates")
    if len(cands) != t["K"]:
        raise ValueError(f"candidates: {len(cands)} of them, K={t['K']}")
    for j, c in enumerate(cands):
        w = f"candidates[{j}]"
        _is(c, dict, w)
        if c["index"] != j or c["run_dir"] != f"c{j:02d}":
            raise ValueError(
                f"{w}: index {c['index']!r} and run_dir {c['run_dir']!r} must be {j} and c{j:02d}"
            )
        if _is(c["point"], int, f"{w}.point") not in range(len(grid)):
            raise ValueError(f"{w}.point={c['point']}: no such grid point")
        if c["status"] not in _STATUSES:
            raise ValueError(f"{w}.status={c['status']!r}: not one of {', '.join(_STATUSES)}")
        if _is(c["aborted_attempts"], int, f"{w}.aborted_attempts") < 0:
            raise ValueError(f"{w}.aborted_attempts={c['aborted_attempts']}: must be >= 0")
        _is(c["seed"], int, f"{w}.seed"), _is(c["sigma"], num, f"{w}.sigma")
        if not all(isinstance(o, str) for o in _is(c["overrides"], list, f"{w}.overrides")):
            raise ValueError(f"{w}.overrides: must be strings")
        if c["status"] == "complete" and c.get("score") is not None:
            _is(c["score"], num, f"{w}.score")


def run_all(sweep: Path, t: dict, log=print) -> dict:
    """Run (or resume) every candidate not yet finished, in order, then pick the winner. Every
    candidate folder to be resumed is checked first (``check_candidate_folders``)."""
    check_candidate_folders(sweep, t)
    t["status"] = "running"
    save(sweep, t)
    for c in t["candidates"]:
        if c["status"] in ("complete", "failed"):
            continue
        run_one(sweep, t, c, log)
    return finish(sweep, t)


def run_one(sweep: Path, t: dict, c: dict, log=print) -> None:
    """One candidate as an ordinary run of ``python -m dpsgd.train`` in its own folder."""
    d = sweep / c["run_dir"]
    if d.exists() and not (d / "checkpoint.pt").is_file() and any(d.iterdir()):
        c["aborted_attempts"] += 1  # killed before its first checkpoint: set aside, charged in full
        d.rename(sweep / f"{c['run_dir']}.aborted{c['aborted_attempts']}")
    cmd = candidate_command(d, c)
    c["status"], c["command"] = "running", " ".join(cmd[1:])
    save(sweep, t)
    log(
        f"candidate {c['index']}: {c['choice']} σ={c['sigma']:.4f} seed={c['seed']} -> "
        f"{c['run_dir']}"
    )
    (sweep / "logs").mkdir(exist_ok=True)
    with open(sweep / "logs" / f"{c['run_dir']}.log", "a") as out:
        rc = subprocess.call(cmd, stdout=out, stderr=subprocess.STDOUT, cwd=os.getcwd())
    if rc < 0 or rc >= 128 and rc - 128 in (2, 15, 1):  # the sweep itself was interrupted
        raise KeyboardInterrupt
    c["rc"] = rc
    c["status"] = "complete" if rc == 0 else "failed"
    c["validation_accuracy"], c["score"] = score(d, c, t) if rc == 0 else (None, None)
    c["run_epsilon"] = run_epsilon(d)
    save(sweep, t)


def candidate_command(d: Path, c: dict) -> list[str]:
    """``python -m dpsgd.train`` for candidate ``c`` in its folder ``d``: a resume of its
    checkpoint, else a new run there. The folder is handed to Hydra quoted (``hydra_quoted``), so
    that any name (a quote, ``=``, ``,``, a space) is that folder."""
    if (d / CHECKPOINT).is_file():
        return [sys.executable, "-m", "dpsgd.train", f"resume={hydra_quoted(str(d))}"]
    return [
        sys.executable,
        "-m",
        "dpsgd.train",
        *c["overrides"],
        f"hydra.run.dir={hydra_quoted(str(d))}",
    ]


def check_candidate_folders(sweep: Path, t: dict) -> None:
    """Every unfinished candidate whose folder holds a checkpoint is resumed only if that checkpoint
    is this candidate's run: its configuration's fingerprint (every key a resume may not change) and
    its overrides are the plan's for that candidate. ConfigError naming the folder otherwise
    (another plan's run, or a folder copied in): it is never adopted as this candidate."""
    for c in t["candidates"]:
        d = sweep / c["run_dir"]
        if c["status"] in ("complete", "failed") or not (d / CHECKPOINT).is_file():
            continue
        ckpt = load_checkpoint(d)
        want = config_fingerprint(validate(compose_config(list(c["overrides"]))))
        got = ckpt["fingerprint"]
        key = next((k for k in [*want, *got] if want.get(k) != got.get(k)), None)
        saved = [o for o in ckpt["overrides"] if override_key(o) != "resume"]
        if key is None and saved != list(c["overrides"]):  # a key a resume may change (its length)
            key = "overrides"
            want, got = {key: " ".join(c["overrides"])}, {key: " ".join(saved)}
        if key is not None:
            raise ConfigError(
                f"{d}: its checkpoint is not candidate {c['index']}'s run ({key}={got.get(key)!r} "
                f"there, {want.get(key)!r} in the plan); never resumed as this candidate (move "
                f"the folder out of the sweep to start the candidate anew)"
            )


def run_epsilon(d: Path) -> float | None:
    """The candidate run's own ε (its privacy.json: its configured accountant, DP-SGD alone), if
    any."""
    try:
        return json.loads((d / "privacy.json").read_text()).get("epsilon")
    except (OSError, ValueError):
        return None


def score(d: Path, c: dict, t: dict) -> tuple[float | None, float | None]:
    """(validation accuracy, score): the last evaluated epoch of metrics.csv (with
    dataset.validation its test_accuracy column is the held-out training rows), and the noisy score
    (correct count + N(0, score_sigma²)) / n_val from a generator seeded by (sweep seed, 2,
    index)."""
    acc = None
    with open(d / "metrics.csv", newline="") as f:
        for row in csv.DictReader(f):
            if row.get("test_accuracy") not in (None, "", "nan"):
                acc = float(row["test_accuracy"])
    if acc is None or not math.isfinite(acc):
        return None, None
    n = t["validation"]
    count = round(acc * n)
    noise = 0.0
    if t["score_sigma"] is not None:
        noise = float(
            np.random.default_rng([t["seed"], 2, c["index"]]).normal(0.0, t["score_sigma"])
        )
    return acc, (count + noise) / n


def charged_curve(sweep: Path, t: dict, c: dict) -> np.ndarray:
    """What candidate ``c`` is charged at every order: its ledger (joint convention; its grid
    point's planned curve if it left none), its aborted attempts (a planned curve each) and its
    score."""
    g = t["grid"][c["point"]]
    planned = selection.candidate_curve(g["q"], g["sigma"], g["lots"], g["groups"])
    curve = planned
    p = sweep / c["run_dir"] / "privacy.json"
    if p.is_file():
        led = Ledger.from_dict(json.loads(p.read_text())["ledger"])
        curve = np.asarray(
            compose.total("rdp", compose.mechanisms(led.entries, "joint")), dtype=float
        )
        curve = curve if np.ndim(curve) else np.zeros_like(planned)
    return curve + c["aborted_attempts"] * planned + selection.score_rdp(t["score_sigma"])


def statement(sweep: Path, t: dict) -> dict:
    """The privacy statement of the released winner (Papernot & Steinke's theorem for t's K law)."""
    dist = dist_of(t)
    orders = rdp.DEFAULT_ORDERS
    curves = [np.asarray(t["base"]["planned_curve"])] + [
        charged_curve(sweep, t, c) for c in t["candidates"]
    ]
    base = selection.base_curve(curves)
    eps, order = selection.selection_epsilon(orders, base, dist, t["delta"])
    base_eps, base_order = rdp.rdp_to_epsilon(orders, base, t["delta"])
    theorem = {
        "fixed": "composition of k runs (Mironov 2017, Prop. 1); the best is post-processing",
        "poisson": "Papernot & Steinke 2022, Theorem 6 (K ~ Poisson(mu))",
        "truncated_negative_binomial": "Papernot & Steinke 2022, Theorem 2 (K ~ truncated negative "
        "binomial(eta, gamma))",
    }[dist.name]
    return {
        "epsilon": eps,
        "delta": t["delta"],
        "order": order,
        "theorem": theorem,
        "accountant": "rdp",
        "conversion": "improved",
        "base_epsilon_rdp": base_eps,
        "base_order": base_order,
        "target_epsilon": t["target_epsilon"],
        "meets_target": eps <= t["target_epsilon"],
        "covers": f"all K={t['K']} candidates (failed and aborted ones included), each charged its "
        "ledger, its aborted attempts and its noisy score",
        "statement": f"the released winner (model, hyperparameters, score) is ({eps:.4f}, "
        f"{t['delta']:g})-DP by {theorem}; each candidate run is at most ({base_eps:.4f}, "
        f"{t['delta']:g})-DP (RDP)",
    }


def finish(sweep: Path, t: dict) -> dict:
    """Pick the winner (highest score among complete candidates; ties: the first), state the
    privacy."""
    done = [c for c in t["candidates"] if c["status"] == "complete" and c["score"] is not None]
    best = max(done, key=lambda c: c["score"], default=None)
    t["winner"] = (
        None
        if best is None
        else {
            "index": best["index"],
            "run_dir": best["run_dir"],
            "choice": best["choice"],
            "score": best["score"],
            "overrides": best["overrides"],
            "model": f"{best['run_dir']}/checkpoint.pt: model (its weights only; the file's "
            "generator states are not part of the release)",
        }
    )
    t["privacy"] = statement(sweep, t)
    t["status"] = "complete"
    save(sweep, t)
    return t
