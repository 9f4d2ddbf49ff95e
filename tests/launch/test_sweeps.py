"""Sweep folders are resolved, then checked, then claimed atomically; resume paths are taken
literally.

Every job's folder is resolved the way Hydra will resolve it (dpsgd/launch/sweeps.py:resolve_sweep)
and must lie inside the sweep folder, differ from every other job's and vary with the job number
(``check_job_folders``); the sweep folder is claimed with an exclusive create (``SweepClaim``), so
two sweeps started together into one folder never both run. A long override list gives a short,
stable, unique folder name (dpsgd/launch/cli.py:short_name). In-process where the behaviour is about
values; real processes only for two sweeps started together.
"""

from __future__ import annotations

import multiprocessing
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from dpsgd import train as training
from dpsgd.launch.main import train_main
from dpsgd.core.errors import ConfigError
from dpsgd.config.schema import validate
from dpsgd.launch.cli import SHORT_BYTES, compose, hydra_quoted, literal_value, short_name
from dpsgd.launch.prepare import prepare_launch
from dpsgd.launch.sweeps import SWEEP_CLAIM, SweepClaim, check_job_folders, resolve_sweep
from conftest import TINY_RUN, snapshot

REPO = Path(__file__).resolve().parents[2]
TINY = TINY_RUN
_snapshot = snapshot


def _refused(capsys, *argv) -> str:
    """The one stderr line of a command refused with exit 2."""
    with pytest.raises(SystemExit) as e:
        train_main(list(argv))
    err = capsys.readouterr().err.strip()
    assert e.value.code == 2 and len(err.splitlines()) == 1 and err.startswith("error: "), err
    return err


@pytest.fixture
def other_run(tmp_path):
    """A folder that looks like a finished run (Hydra's files and privacy.json), beside the
    sweep's."""
    run = tmp_path / "other"
    (run / ".hydra").mkdir(parents=True)
    (run / ".hydra" / "config.yaml").write_text("privacy:\n  sigma: 4.0\n")
    (run / "privacy.json").write_text("{}\n")
    return run


# ---------------------------------------------------------------- job folders, resolved and checked
@pytest.mark.parametrize(
    "subdir,env",
    [
        ("${oc.env:DPSGD_TEST_DIR}", "{other}"),  # another run's folder itself
        ("${oc.env:DPSGD_TEST_DIR}/${hydra.job.num}", "{other}"),  # a new folder inside another run
        (
            "${hydra.job.num}/${oc.env:DPSGD_TEST_DIR}",
            "../../other",
        ),  # '..' hidden in an interpolation
        ("${hydra.runtime.cwd}/${hydra.job.num}", ""),  # absolute, outside the sweep folder
    ],
)
def test_an_interpolated_subdir_outside_the_sweep_is_refused_before_anything_is_written(
    subdir, env, tmp_path, other_run, capsys, monkeypatch
):
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("DPSGD_TEST_DIR", env.format(other=other_run))
    before = _snapshot(tmp_path)
    err = _refused(
        capsys,
        "-m",
        *TINY,
        "seed=0,1",
        f"hydra.sweep.dir={tmp_path / 'sweep'}",
        f"hydra.sweep.subdir={subdir}",
    )
    assert "hydra.sweep.subdir" in err and "not inside the sweep folder" in err, err
    assert _snapshot(tmp_path) == before  # the other run's .hydra/config.yaml included


def test_a_sweep_folder_inside_another_run_is_refused_through_a_symlink(
    tmp_path, other_run, capsys, monkeypatch
):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "link").symlink_to(other_run)
    before = _snapshot(other_run)
    err = _refused(capsys, "-m", *TINY, "seed=0", f"hydra.sweep.dir={tmp_path / 'link' / 'sweep'}")
    assert "hydra.sweep.dir" in err and str(other_run) in err, err
    assert _snapshot(other_run) == before


@pytest.mark.parametrize(
    "args,expect",
    [
        (["seed=0,1", "hydra.sweep.subdir=same"], "jobs 0 and 1 would share"),
        (
            ["seed=0,1", "hydra.sweep.subdir=s${seed}"],
            "does not vary with the job number",
        ),  # distinct, yet
        (["seed=0", "hydra.sweep.subdir=${seed}"], "does not vary with the job number"),  # one job
        (["seed=0,1", "hydra.sweep.subdir=a${hydra.job.num}/.."], "not inside the sweep folder"),
        (["+tag=a,a/b", "hydra.sweep.subdir=${tag}"], "lies inside job 0's folder"),
        (
            ["seed=0", "hydra.sweep.subdir=${hydra.job.num}_" + "x" * 300],
            "longer than the file system's",
        ),
        (["seed=0", "hydra.sweep.subdir=${hydra.job.num}_${nope}"], "nope"),
    ],
)
def test_job_folders_must_be_new_distinct_and_vary_with_the_job(
    args, expect, tmp_path, monkeypatch
):
    monkeypatch.chdir(tmp_path)
    with pytest.raises(ConfigError) as e:
        prepare_launch([*TINY, *args, f"hydra.sweep.dir={tmp_path / 'sweep'}"], multirun=True)
    msg = str(e.value)
    assert "\n" not in msg and msg.startswith("hydra.sweep.subdir=") and expect in msg, msg
    assert list(tmp_path.iterdir()) == []


def test_job_folders_are_resolved_as_hydra_resolves_them(tmp_path):
    """Each job's subdir with its own overrides and number; ${now:...} in the sweep folder resolved
    once and handed to Hydra literally."""
    sweep = resolve_sweep(["+sweep=noise", "seed=0,1", f"hydra.sweep.dir={tmp_path}/s_${{now:%f}}"])
    assert sweep.subdirs == [
        f"{n}_seed{s}_privacy.sigma={sigma}"
        for n, (sigma, s) in enumerate((a, b) for a in (2, 3, 6) for b in (0, 1))
    ]
    assert sweep.pin == f"hydra.sweep.dir='{sweep.dir}'" and "${" not in sweep.dir
    check_job_folders(sweep)


# ----------------------------------------------------------------- long override lists
def test_a_long_override_list_gives_a_short_stable_unique_name(tmp_path):
    long = [f"+extra.key_{i:02d}_with_a_long_name=value_{i}_{'v' * 20}" for i in range(12)]
    a = resolve_sweep([*long, "seed=0,1", f"hydra.sweep.dir={tmp_path}"])
    assert len(",".join(long)) > 255  # the full override list would not fit
    assert all(
        len(s.encode()) <= 255 and s.startswith(f"{n}_seed{n}_+extra.key_00")
        for n, s in enumerate(a.subdirs)
    )
    check_job_folders(a)
    assert (
        resolve_sweep([*long, "seed=0,1", f"hydra.sweep.dir={tmp_path}"]).subdirs == a.subdirs
    )  # stable
    b = resolve_sweep([*long[:-1], long[-1] + "w", "seed=0,1", f"hydra.sweep.dir={tmp_path}"])
    assert [s.rsplit("_", 1)[1] for s in a.subdirs] != [
        s.rsplit("_", 1)[1] for s in b.subdirs
    ]  # unique


def test_short_name():
    assert short_name("privacy.sigma=4") == "privacy.sigma=4"
    head = "k=" + "é" * 200
    s1, s2 = short_name(head + "1"), short_name(head + "2")
    assert len(s1.encode()) <= SHORT_BYTES and s1 != s2 and s1[:-12] == s2[:-12]
    assert s1 == short_name(head + "1")
    s1.encode("utf-8")  # never a broken character


# ----------------------------------------------------------------- one sweep per folder
def _claim(folder: str, barrier, results, done) -> None:
    barrier.wait()
    try:
        SweepClaim(folder)
        results.put("claimed")
    except ConfigError as e:
        results.put(str(e))
    done.wait()  # alive until every process has tried (an ended launcher's claim is stale)


def test_exactly_one_of_many_simultaneous_claims_wins(tmp_path):
    ctx = multiprocessing.get_context("fork")
    barrier, results, done = ctx.Barrier(6), ctx.Queue(), ctx.Event()
    procs = [
        ctx.Process(target=_claim, args=(str(tmp_path / "a" / "sweep"), barrier, results, done))
        for _ in range(6)
    ]
    for p in procs:
        p.start()
    out = sorted(results.get(timeout=60) for _ in procs)
    done.set()
    for p in procs:
        p.join(60)
    assert out.count("claimed") == 1 and all(
        "another sweep hold" in o for o in out if o != "claimed"
    ), out
    assert [p.name for p in (tmp_path / "a" / "sweep").iterdir()] == [SWEEP_CLAIM]


def test_a_claim_is_released_and_refuses_a_folder_that_is_not_empty(tmp_path):
    folder = tmp_path / "new" / "sweep"
    claim = SweepClaim(str(folder))
    with pytest.raises(ConfigError, match="another sweep holds this folder"):
        SweepClaim(str(folder))
    claim.release()
    assert not (tmp_path / "new").exists()  # the folders it created, left empty
    (tmp_path / "used").mkdir()
    (tmp_path / "used" / "multirun.yaml").write_text("x")
    with pytest.raises(ConfigError, match="not empty"):
        SweepClaim(str(tmp_path / "used"))
    assert [p.name for p in (tmp_path / "used").iterdir()] == ["multirun.yaml"]


def test_the_claim_of_a_killed_launcher_is_stale_and_a_live_one_is_not(tmp_path, capsys):
    """A launcher killed with SIGKILL never releases its claim, but its flock dies with it: the next
    sweep into the (otherwise empty) folder removes the claim with a note and claims the folder. A
    claim whose process lives, or that another process has not finished writing, is refused."""
    folder = tmp_path / "sweep"
    holder = subprocess.Popen(
        [
            sys.executable,
            "-c",
            "import sys, time; from dpsgd.launch.sweeps import SweepClaim; "
            f"SweepClaim({str(folder)!r}); print('held', flush=True); time.sleep(600)",
        ],
        stdout=subprocess.PIPE,
        text=True,
        cwd=REPO,
    )
    try:
        assert holder.stdout.readline().strip() == "held"
        with pytest.raises(ConfigError, match="another sweep holds this folder"):
            SweepClaim(str(folder))  # alive: held
        text = (folder / SWEEP_CLAIM).read_text()
        assert text.startswith(f"pid {holder.pid} on ")
    finally:
        holder.kill()
        holder.wait(30)
    assert (folder / SWEEP_CLAIM).read_text() == text  # SIGKILL: the claim is left behind
    capsys.readouterr()
    claim = SweepClaim(str(folder))  # ... and is stale
    assert (
        f"removed a stale sweep claim ({text.strip()}; its launching process has ended)"
        in capsys.readouterr().err
    )
    assert (folder / SWEEP_CLAIM).read_text() == claim.token
    claim.release()
    (tmp_path / "half").mkdir()
    (tmp_path / "half" / SWEEP_CLAIM).write_text(
        "pid 1"
    )  # not yet written whole by its creator: held
    with pytest.raises(ConfigError, match="another sweep holds this folder"):
        SweepClaim(str(tmp_path / "half"))
    assert (tmp_path / "half" / SWEEP_CLAIM).read_text() == "pid 1"


def test_two_sweeps_started_together_into_one_folder(tmp_path):
    """Real processes: exactly one sweep runs, the other exits 2 with one line and writes
    nothing."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("HYDRA_")}
    env["PYTHONPATH"] = str(REPO) + os.pathsep + env.get("PYTHONPATH", "")
    env["DPSGD_THREADS"] = "1"
    cmd = [
        sys.executable,
        "-m",
        "dpsgd.train",
        "-m",
        *TINY,
        "training.max_steps=1",
        "seed=0",
        f"hydra.sweep.dir={tmp_path / 'sweep'}",
    ]
    procs = [
        subprocess.Popen(
            cmd, cwd=tmp_path, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
        )
        for _ in range(2)
    ]
    outs = [(p.wait(timeout=300), p.communicate()[1].strip()) for p in procs]
    codes = sorted(code for code, _ in outs)
    assert codes == [0, 2], outs
    err = next(e for code, e in outs if code == 2)
    assert len(err.splitlines()) == 1 and err.startswith("error: hydra.sweep.dir="), err
    names = sorted(p.name for p in (tmp_path / "sweep").iterdir())
    assert len(names) == 2 and names[1] == "multirun.yaml" and names[0].startswith("0_seed0_"), (
        names
    )
    assert (tmp_path / "sweep" / names[0] / "privacy.json").is_file()


@pytest.mark.parametrize("kind", ["folder", "symlink", "dangling symlink"])
def test_a_claim_that_is_not_a_file_is_refused_without_being_read(kind, tmp_path, capsys):
    """A .sweep.claim that is a folder or a symlink was made by no launcher: the sweep is refused in
    one line naming hydra.sweep.dir and what the claim is; a symlink is never followed (its target's
    text is not printed), and nothing is removed or written."""
    folder = tmp_path / "sweep"
    folder.mkdir()
    secret = tmp_path / "secret.txt"
    secret.write_text("pid 7 the contents of another file\n")
    claim = folder / SWEEP_CLAIM
    if kind == "folder":
        claim.mkdir()
    else:
        claim.symlink_to(secret if kind == "symlink" else tmp_path / "nowhere")
    before = _snapshot(tmp_path)
    what = "a folder" if kind == "folder" else "a symlink"
    with pytest.raises(ConfigError) as e:
        SweepClaim(str(folder))
    assert str(e.value) == (
        f"hydra.sweep.dir={folder}: {claim} is {what}, not a sweep claim; remove it if no "
        "sweep runs there"
    )
    err = _refused(capsys, "-m", *TINY, "seed=0", f"hydra.sweep.dir={folder}")
    assert err == f"error: {e.value}" and "contents" not in err
    assert _snapshot(tmp_path) == before


def test_a_sweep_folder_name_longer_than_the_file_system_takes(tmp_path, capsys):
    folder = tmp_path / ("a" * 300)
    err = _refused(capsys, "-m", *TINY, "seed=0", f"hydra.sweep.dir={folder}")
    assert err.startswith(
        f"error: hydra.sweep.dir={folder}: a folder name is 300 bytes, longer than the file "
        "system's"
    ), err
    err = _refused(capsys, "-m", *TINY, "seed=0", "name=" + "b" * 300)
    assert err.startswith(f"error: name={'b' * 300}: a folder name is 300 bytes"), err
    assert list(tmp_path.iterdir()) == []


# ----------------------------------------------------------------- resume paths taken literally
def test_literal_value():
    assert literal_value("resume=/r/run'") == "/r/run'"
    assert literal_value('resume=/r/run"') == '/r/run"'
    assert literal_value("resume='/r/run'") == "/r/run"  # one Hydra quoted string
    assert literal_value("resume=/r/a,b") == "/r/a,b"
    for name in ["/r/it's", "/r/x\\", "/r/a b"]:
        assert literal_value("resume=" + hydra_quoted(name)) == name


@pytest.mark.parametrize("quote", ["'", '"'])
def test_a_run_whose_name_ends_in_a_quote_resumes_itself_not_its_sibling(quote, tmp_path):
    run = tmp_path / "run"
    args = [*TINY, "training.epochs=1"]
    training.train(validate(compose(args)), run, args)
    quoted = tmp_path / f"run{quote}"
    shutil.copytree(run, quoted)
    before = _snapshot(run)
    train_main([f"resume={quoted}", "training.epochs=2"])
    assert len((quoted / "metrics.csv").read_text().splitlines()) == 3  # header + 2 epochs
    assert _snapshot(run) == before


@pytest.mark.parametrize("target", ["nowhere", "loop"])
def test_a_sweep_folder_that_is_a_dangling_or_looping_symlink_is_refused(
    target, tmp_path, monkeypatch
):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "loop").symlink_to(tmp_path / "sweep")
    (tmp_path / "sweep").symlink_to(tmp_path / target)
    before = _snapshot(tmp_path)
    with pytest.raises(ConfigError, match="hydra.sweep.dir=") as e:
        prepare_launch([*TINY, "seed=0", f"hydra.sweep.dir={tmp_path / 'sweep'}"], multirun=True)
    assert "\n" not in str(e.value)
    assert _snapshot(tmp_path) == before
