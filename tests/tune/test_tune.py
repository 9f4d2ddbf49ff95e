"""``python -m dpsgd.tune`` (dpsgd/tune/): bad input refused before any work, the plan reproducible
from its seed, the statement never below what ran (ledgers, aborted attempts, failures), and (slow)
a whole sweep: same winner from the same seed, and a killed sweep resumed without charging less."""

from __future__ import annotations

import errno
import functools
import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from dpsgd.accountant import Ledger, selection
from dpsgd.accountant.events import Poisson
from dpsgd.launch.sweeps import SWEEP_CLAIM
from dpsgd.tune import cli, sweep
from dpsgd.tune.space import Point
from tolerances import chain_rel_tol

REPO = Path(__file__).resolve().parents[2]
TINY = [
    "dataset.subset=600",
    "privacy.lot_size=60",
    "model.hidden=[8]",
    "model.projection=none",
    "training.eval_batch_size=1000",
    "device=cpu",
]
LAW = ["--distribution", "truncated_negative_binomial", "--eta", "1", "--gamma", "0.5"]


def _args(d: Path, *extra) -> list[str]:
    return ["--sweep-dir", str(d), "--target-epsilon", "4", "--validation", "100", *LAW, *extra]


@pytest.mark.parametrize(
    "flags,overrides,name",
    [
        (["--distribution", "poisson"], [], "--mu"),
        (["--gamma", "1.5"], [], "gamma"),
        (["--mu", "2"], [], "--mu"),
        (["--target-epsilon", "-1"], [], "--target-epsilon"),
        (["--score-sigma", "0"], [], "--score-sigma"),
        (["--validation", "0"], [], "--validation"),
        ([], ["privacy.sigma=1,2"], "privacy.sigma"),
        ([], ["training.epochs=1,x"], "training.epochs"),
    ],
)
def test_bad_input_one_line_exit_2_nothing_written(tmp_path, capsys, flags, overrides, name):
    d = tmp_path / "sweep"
    with pytest.raises(SystemExit) as e:
        cli.main(_args(d, *flags) + TINY + (overrides or ["training.epochs=1,2"]))
    err = capsys.readouterr().err.strip()
    assert e.value.code == 2 and "\n" not in err and name in err, err
    assert not d.exists()


@pytest.mark.parametrize(
    "extra,name",
    [(["--seed", "3"], "--seed"), (["training.epochs=1,2"], "--overrides"), ([], "--resume")],
)
def test_resume_takes_its_plan_alone(tmp_path, capsys, extra, name):
    with pytest.raises(SystemExit) as e:
        cli.main(["--resume", str(tmp_path)] + extra)
    assert e.value.code == 2 and name in capsys.readouterr().err


def test_a_used_sweep_dir_is_refused(tmp_path, capsys):
    d = tmp_path / "sweep"
    d.mkdir()
    (d / "x").write_text("")
    with pytest.raises(SystemExit) as e:
        cli.main(_args(d) + TINY + ["training.epochs=1,2"])
    assert e.value.code == 2 and "--sweep-dir" in capsys.readouterr().err


@functools.lru_cache(maxsize=4)
def _cached_plan(seed: int) -> str:
    pts = [
        Point({"training.epochs": str(e)}, (f"training.epochs={e}",), 0.08192, 12 * e, 1)
        for e in (10, 20)
    ]
    args = {
        "target_epsilon": 1.2,
        "delta": 1e-5,
        "xtol": 1e-2,
        "score_sigma": 20.0,
        "validation": 100,
        "search_space": {"fixed": [], "choices": {"training.epochs": ["1", "2"]}},
    }
    law = selection.KDistribution("truncated_negative_binomial", eta=1.0, gamma=0.3)
    return json.dumps(sweep.plan(pts, law, seed, args))


def _plan(seed: int) -> dict:
    return json.loads(_cached_plan(seed))


def test_plan_is_reproducible_from_its_seed():
    _cached_plan.cache_clear()
    a = _plan(3)
    _cached_plan.cache_clear()
    assert _plan(3) == a
    assert [c["seed"] for c in _plan(4)["candidates"]] != [c["seed"] for c in a["candidates"]]
    assert a["K"] == len(a["candidates"]) >= 1
    assert a["base"]["planned_total"]["epsilon"] <= 1.2


def _privacy(d: Path, lots: int, sigma: float) -> None:
    d.mkdir(parents=True)
    led = Ledger()
    led.record(Poisson(0.1, sigma), lots)
    (d / "privacy.json").write_text(json.dumps({"ledger": led.to_dict()}))


def test_statement_covers_everything_that_ran(tmp_path):
    t = _plan(3)
    t["candidates"] = t["candidates"][:1] + [dict(t["candidates"][0], index=1, run_dir="c01")]
    t["K"] = 2
    for c in t["candidates"]:
        c["status"], c["score"] = "failed", None  # failed before writing anything: planned curve
    planned = sweep.statement(tmp_path, t)["epsilon"]
    assert planned == pytest.approx(t["base"]["planned_total"]["epsilon"], rel=chain_rel_tol(8))
    g = t["grid"][t["candidates"][0]["point"]]
    _privacy(tmp_path / "c00", 3 * g["lots"], g["sigma"])  # a ledger above the plan (more lots)
    more = sweep.statement(tmp_path, t)["epsilon"]
    assert more > planned
    t["candidates"][1]["aborted_attempts"] = 2
    assert sweep.statement(tmp_path, t)["epsilon"] >= more
    assert "K=2" in sweep.statement(tmp_path, t)["covers"]


def _scores(t: dict) -> list:
    return [(c["choice"], c["status"], c["score"]) for c in t["candidates"]]


@pytest.mark.slow
def test_sweep_reproducible_and_resumed_without_charging_less(tmp_path, capsys):
    argv = lambda d: (
        [
            "--sweep-dir",
            str(d),
            "--target-epsilon",
            "4",
            "--validation",
            "100",
            "--distribution",
            "fixed",
            "--k",
            "2",
            "--seed",
            "1",
        ]
        + TINY
        + ["training.epochs=1,2"]
    )
    cli.main(argv(tmp_path / "a"))
    a = sweep.load(tmp_path / "a")
    assert a["status"] == "complete" and a["winner"] is not None and a["privacy"]["meets_target"]
    # a killed sweep: the plan is written, c00 finished, c01 died before its first checkpoint
    cli.main(argv(tmp_path / "b") + ["--plan-only"])
    b = sweep.load(tmp_path / "b")
    sweep.run_one(tmp_path / "b", b, b["candidates"][0], log=lambda *_: None)
    (tmp_path / "b" / "c01").mkdir()
    (tmp_path / "b" / "c01" / "metrics.csv").write_text("epoch\n")
    b["candidates"][1]["status"] = "running"
    sweep.save(tmp_path / "b", b)
    cli.main(["--resume", str(tmp_path / "b")])
    b = sweep.load(tmp_path / "b")
    assert (tmp_path / "b" / "c01.aborted1").is_dir() and b["candidates"][1][
        "aborted_attempts"
    ] == 1
    assert _scores(b) == _scores(a) and b["winner"] == a["winner"]  # exact: same seeds, same runs
    assert b["privacy"]["epsilon"] > a["privacy"]["epsilon"]  # the aborted attempt is charged
    assert np.isfinite(b["privacy"]["epsilon"])


# ---------------------------------------------------------- the tuning folder, claimed like a sweep
def _one_line(capsys, code: int, e) -> str:
    err = capsys.readouterr().err
    assert e.value.code == code and err.count("\n") == 1 and "Traceback" not in err, err
    return err.strip()


def _snapshot(root: Path) -> dict:
    return {
        str(p.relative_to(root)): (p.read_bytes() if p.is_file() else "<dir>")
        for p in sorted(root.rglob("*"))
    }


def test_a_tune_into_a_folder_another_tune_holds_is_refused(tmp_path, capsys):
    """A live claim (``SweepClaim``, held by another process, as a running tune or sweep holds it)
    refuses a new tune into the folder and a --resume of it: one line, exit 2, nothing written."""
    d = tmp_path / "sweep"
    holder = subprocess.Popen(
        [
            sys.executable,
            "-c",
            "import time; from dpsgd.launch.sweeps import SweepClaim; "
            f"SweepClaim({str(d)!r}, '--sweep-dir'); print('held', flush=True); time.sleep(600)",
        ],
        stdout=subprocess.PIPE,
        text=True,
        cwd=REPO,
    )
    try:
        assert holder.stdout.readline().strip() == "held"
        before = _snapshot(tmp_path)
        with pytest.raises(SystemExit) as e:
            cli.main(_args(d) + TINY + ["training.epochs=1,2"])
        assert _one_line(capsys, 2, e).startswith(
            f"error: --sweep-dir={d}: another sweep holds this folder"
        )
        (d / sweep.TUNING).write_text("{}")
        before = _snapshot(tmp_path)
        with pytest.raises(SystemExit) as e:
            cli.main(["--resume", str(d)])
        assert _one_line(capsys, 2, e).startswith(
            f"error: --resume={d}: another sweep holds this folder"
        )
        assert _snapshot(tmp_path) == before
    finally:
        holder.kill()
        holder.wait(30)


def _written_plan(d: Path, overrides: list[str] | None = None) -> dict:
    """A plan (``_plan``) written into ``d`` as a tune writes it; with ``overrides``, candidate 0 is
    a run of these (its σ and seed added as the driver adds them)."""
    from dpsgd.tune.space import run_overrides

    t = _plan(3)
    if overrides is not None:
        c = t["candidates"][0]
        c["overrides"] = list(overrides) + run_overrides(t["validation"], c["sigma"], c["seed"])
    d.mkdir(parents=True)
    sweep.save(d, t)
    return t


def test_the_claim_is_released_and_a_killed_tunes_claim_is_stale(tmp_path, capsys):
    d = tmp_path / "sweep"
    _written_plan(d)
    (d / SWEEP_CLAIM).write_text(
        "pid 1 on host since then (dead)\n"
    )  # left by a SIGKILL: no lock held
    cli.main(["--resume", str(d), "--plan-only"])
    assert "removed a stale sweep claim" in capsys.readouterr().err
    assert not (d / SWEEP_CLAIM).exists()  # claimed anew, released at the end


def _train(run: Path, overrides: list[str]) -> None:
    from dpsgd.config.schema import validate
    from dpsgd.launch.cli import compose
    from dpsgd.train import train

    train(validate(compose(overrides)), run, overrides)


def test_a_candidate_folder_holding_another_run_is_never_adopted(tmp_path, capsys):
    """c00 holds a checkpoint of another run (another plan's candidate: other σ, other seed):
    --resume stops with one line naming the folder and the first differing key, exit 2, before any
    candidate runs; the candidate's own checkpoint is accepted."""
    d = tmp_path / "sweep"
    t = _written_plan(d, TINY + ["training.epochs=1"])
    c = t["candidates"][0]
    other = [o if not o.startswith("seed=") else f"seed={c['seed'] + 1}" for o in c["overrides"]]
    _train(d / "c00", other)
    c["status"] = "running"
    sweep.save(d, t)
    before = _snapshot(tmp_path)
    with pytest.raises(SystemExit) as e:
        cli.main(["--resume", str(d)])
    err = _one_line(capsys, 2, e)
    assert err.startswith(f"error: {d / 'c00'}: its checkpoint is not candidate 0's run (seed="), (
        err
    )
    assert _snapshot(tmp_path) == before
    (d / "c00").rename(tmp_path / "foreign")
    _train(d / "c00", list(c["overrides"]))
    sweep.check_candidate_folders(d, t)  # its own run: resumed


@pytest.mark.parametrize("name", ["it's", "a=b", "a,b", "a b", "all of ' = , \\ "])
def test_candidate_folders_are_handed_to_hydra_quoted(name, tmp_path):
    """Each candidate's folder reaches Hydra as that folder, whatever its name holds."""
    from dpsgd.launch.cli import compose, literal_value

    d = tmp_path / name / "c00"
    c = {"overrides": TINY + ["seed=1"]}
    cmd = sweep.candidate_command(d, c)
    assert cmd[-1].startswith("hydra.run.dir=")
    assert compose(cmd[3:], hydra_config=True).hydra.run.dir == str(d)
    d.mkdir(parents=True)
    (d / "checkpoint.pt").write_bytes(b"")
    (arg,) = sweep.candidate_command(d, c)[3:]
    assert literal_value(arg) == str(d)
    cli.literal_for_hydra(tmp_path / name)


def test_a_sweep_dir_hydra_would_interpolate_is_refused(tmp_path, capsys):
    d = tmp_path / "${oc.env:HOME}"
    with pytest.raises(SystemExit) as e:
        cli.main(_args(d) + TINY + ["training.epochs=1,2"])
    assert "--sweep-dir=" in _one_line(capsys, 2, e) and not d.exists()


def test_no_candidate_finished_is_one_line_exit_1(tmp_path, monkeypatch, capsys):
    """Every candidate failed: no winner, nothing released; the command says so in one line
    (exit 1), and tuning.json still states what was spent."""
    monkeypatch.setattr(sweep.subprocess, "call", lambda *a, **k: 1)
    d = tmp_path / "sweep"
    K = _written_plan(d)["K"]
    with pytest.raises(SystemExit) as e:
        cli.main(["--resume", str(d)])
    err = _one_line(capsys, 1, e)
    ran = ", ".join(f"c{j:02d} failed (exit 1)" for j in range(K))
    assert err.startswith(
        f"error: no candidate finished ({ran}; their logs: {d / 'logs'}): nothing is released; "
        f"the privacy spent is stated in {d / sweep.TUNING} (ε="
    ), err
    t = sweep.load(d)
    assert t["winner"] is None and t["privacy"]["epsilon"] > 0 and not (d / SWEEP_CLAIM).exists()


def _broken(t: dict, how: str):
    if how == "not json":
        return '{"format": '
    if how == "not a plan":
        return []
    t = json.loads(json.dumps(t))
    if how == "no candidates":
        del t["candidates"]
    elif how == "K a string":
        t["K"] = str(t["K"])
    elif how == "run_dir outside":
        t["candidates"][0]["run_dir"] = "../elsewhere"
    elif how == "short curve":
        t["base"]["planned_curve"] = t["base"]["planned_curve"][:3]
    elif how == "no such point":
        t["candidates"][0]["point"] = 99
    return t


@pytest.mark.parametrize(
    "how,says",
    [
        ("not json", "not valid JSON"),
        ("not a plan", "format: not dpsgd.tuning/1"),
        ("no candidates", "lacks 'candidates'"),
        ("K a string", "K='"),
        ("run_dir outside", "run_dir '../elsewhere' must be 0 and c00"),
        ("short curve", "base.planned_curve"),
        ("no such point", "point=99"),
    ],
)
def test_a_malformed_tuning_json_is_one_line_on_resume(how, says, tmp_path, capsys):
    d = tmp_path / "sweep"
    d.mkdir()
    (d / sweep.TUNING).write_text(json.dumps(_plan(3)))
    sweep.load(d)  # whole, as written
    bad = _broken(_plan(3), how)
    (d / sweep.TUNING).write_text(bad if isinstance(bad, str) else json.dumps(bad))
    capsys.readouterr()
    before = _snapshot(tmp_path)
    with pytest.raises(SystemExit) as e:
        cli.main(["--resume", str(d)])
    err = _one_line(capsys, 2, e)
    assert err.startswith(f"error: --resume={d}: {d / sweep.TUNING}: ") and says in err, err
    assert _snapshot(tmp_path) == before


def test_a_sweep_dir_name_longer_than_the_file_system_takes(tmp_path, capsys):
    d = tmp_path / ("a" * 300) / "sweep"
    with pytest.raises(SystemExit) as e:
        cli.main(_args(d) + TINY + ["training.epochs=1,2"])
    assert _one_line(capsys, 2, e).startswith(
        f"error: --sweep-dir={d}: a folder name is 300 bytes, longer than the file system's"
    )
    with pytest.raises(SystemExit) as e:
        cli.main(["--resume", str(d)])
    assert _one_line(capsys, 2, e).startswith(f"error: --resume={d}: a folder name is 300 bytes")
    assert list(tmp_path.iterdir()) == []


def test_a_read_only_sweep_dir_is_one_line_exit_2(tmp_path, monkeypatch, capsys):
    """The folder cannot be written (a read-only mount; as root a chmod would not stop the writes,
    so the file system's refusal is simulated): one line naming --sweep-dir, exit 2, nothing
    written."""
    d, old = tmp_path / "sweep", tmp_path / "old"
    d.mkdir()
    old.mkdir()
    (old / sweep.TUNING).write_text(json.dumps(_plan(3)))
    before = _snapshot(tmp_path)
    real = os.open

    def read_only(path, flags, *a, **k):
        if str(path).startswith(str(tmp_path)) and flags & (os.O_WRONLY | os.O_RDWR | os.O_CREAT):
            raise OSError(errno.EROFS, os.strerror(errno.EROFS), str(path))
        return real(path, flags, *a, **k)

    monkeypatch.setattr(os, "open", read_only)
    with pytest.raises(SystemExit) as e:
        cli.main(_args(d, "--xtol", "1") + TINY + ["training.epochs=1"])  # one point: a quick plan
    assert (
        _one_line(capsys, 2, e)
        == f"error: --sweep-dir={d}: cannot be claimed (Read-only file system)"
    )
    with pytest.raises(SystemExit) as e:
        cli.main(["--resume", str(old)])
    assert (
        _one_line(capsys, 2, e)
        == f"error: --resume={old}: cannot be claimed (Read-only file system)"
    )
    assert _snapshot(tmp_path) == before


@pytest.mark.skipif(not Path("/proc/self/fd").is_dir(), reason="names an fd's file through /proc")
def test_a_full_disk_is_one_line_naming_the_file(tmp_path, monkeypatch, capsys):
    """tuning.json cannot be written (ENOSPC): one line naming it, exit 1 (a disk error), and the
    folder the claim made is removed again; nothing half-written is left."""
    real = os.fsync

    def fsync(fd):
        if sweep.TUNING in os.readlink(f"/proc/self/fd/{fd}"):
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        return real(fd)

    monkeypatch.setattr(os, "fsync", fsync)
    d = tmp_path / "new" / "sweep"
    with pytest.raises(SystemExit) as e:
        cli.main(_args(d, "--xtol", "1") + TINY + ["training.epochs=1"])  # one point: a quick plan
    assert _one_line(capsys, 1, e) == f"error: {d / sweep.TUNING}: No space left on device"
    assert list(tmp_path.iterdir()) == []


# two real tunes, one of them training a candidate (~20 s, more on a loaded machine)
@pytest.mark.slow
def test_two_tunes_started_together_into_a_folder_whose_name_hydra_would_split(tmp_path):
    """Real processes into ``it's a=b,c``: exactly one tune runs (its candidate trains in that very
    folder, and it names a winner); the other exits 2 with one line and its plan is never
    written."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("HYDRA_")}
    env["PYTHONPATH"] = str(REPO) + os.pathsep + env.get("PYTHONPATH", "")
    d = tmp_path / "it's a=b,c"
    cmd = [
        sys.executable,
        "-m",
        "dpsgd.tune",
        "--sweep-dir",
        str(d),
        "--target-epsilon",
        "4",
        "--validation",
        "100",
        "--distribution",
        "fixed",
        "--k",
        "1",
        "--xtol",
        "1",
        *TINY,
        "training.epochs=1",
    ]
    procs = [
        subprocess.Popen(
            cmd, cwd=tmp_path, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
        )
        for _ in range(2)
    ]
    outs = [(p.wait(timeout=600), *p.communicate()) for p in procs]
    assert sorted(code for code, _, _ in outs) == [0, 2], outs
    _, out, _ = next(o for o in outs if o[0] == 0)
    _, _, err = next(o for o in outs if o[0] == 2)
    assert err.count("\n") == 1 and err.startswith(f"error: --sweep-dir={d}: "), err
    assert "python -m dpsgd.tune: winner {}; the released winner" in out, out
    t = sweep.load(d)
    assert t["candidates"][0]["status"] == "complete" and (d / "c00" / "checkpoint.pt").is_file()
    assert sorted(p.name for p in d.iterdir()) == ["c00", "logs", sweep.TUNING]


def test_every_argument_error_in_one_line():
    from dpsgd.core.errors import ConfigError
    from dpsgd.tune.cli import check, parser

    a = parser().parse_args(["--target-epsilon", "-1", "--delta", "2", "--seed", "-1", "x=1"])
    with pytest.raises(ConfigError) as e:
        check(a)
    msg = str(e.value)
    assert "\n" not in msg and all(
        k in msg for k in ("--sweep-dir", "--target-epsilon=-1.0", "--delta=2.0", "--seed=-1")
    )
