"""Sweeps through Hydra launchers (dpsgd/launch/launchers.py, experiments/jobs.py): real tiny
multiruns through joblib and submitit_local (distinct folders, every job complete, collected), a
failed job that does not stop its siblings, the launcher checks, how many jobs share the cores, and
the experiment scripts' launcher commands."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pandas as pd
import pytest

from dpsgd.core.errors import ConfigError
from dpsgd.launch.main import compose
from dpsgd.launch.prepare import prepare_launch
from dpsgd.launch.launchers import Launch, check, parallel_jobs, share_cores, usable_cores
from dpsgd.launch.sweeps import resolve_sweep
from dpsgd.core.runtime import physical_cores
from experiments import collect, paper, seeds

REPO = Path(__file__).resolve().parents[2]
TINY = [
    "dataset.subset=3000",
    "privacy.lot_size=150",
    "privacy.physical_batch_size=150",
    "model.hidden=[50]",
    "model.pca_dims=20",
    "training.epochs=1",
    "training.max_steps=2",
    "training.eval_batch_size=3000",
    "device=cpu",
]


def _sweep(tmp_path, launcher, *args):
    """A real multirun through ``launcher``; the jobs choose their own threads (no thread variables
    set)."""
    env = {
        k: v
        for k, v in os.environ.items()
        if k not in ("OMP_NUM_THREADS", "DPSGD_THREADS", "DPSGD_PARALLEL_JOBS")
        and not k.startswith("HYDRA_")
    }
    env["PYTHONPATH"] = str(REPO) + os.pathsep + env.get("PYTHONPATH", "")
    cmd = [
        sys.executable,
        "-m",
        "dpsgd.train",
        "-m",
        *args,
        *TINY,
        f"hydra/launcher={launcher}",
        f"hydra.sweep.dir={tmp_path / 'mr'}",
    ]
    return subprocess.run(cmd, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)


def _runs(sweep_dir: Path) -> list[Path]:
    return sorted(p.parent for p in sweep_dir.rglob("privacy.json"))


@pytest.mark.parametrize(
    "launcher", ["joblib", pytest.param("submitit_local", marks=pytest.mark.slow)]
)
def test_two_job_sweep_through_a_launcher_completes_in_distinct_folders(tmp_path, launcher):
    """2 jobs at once (worker processes or submitit jobs): each in its own folder under the sweep
    folder, both complete, their threads a share of the cores, and experiments.collect takes
    both."""
    r = _sweep(tmp_path, launcher, "+sweep=clip_norm", "privacy.clip_norm=1,2")
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-3000:]
    runs = _runs(tmp_path / "mr")
    assert len(runs) == 2 and len(set(runs)) == 2 and {p.parent for p in runs} == {tmp_path / "mr"}
    assert sorted(p.name.split("_")[0] for p in runs) == ["0", "1"]  # ${hydra.job.num}
    for run in runs:
        st = json.loads((run / "privacy.json").read_text())
        assert (
            st["status"] == "complete"
            and (run / "metrics.csv").is_file()
            and (run / "checkpoint.pt").is_file()
        )
        policy = st["runtime"]["threads_policy"]
        if min(usable_cores(), 2) == 2:  # 2 jobs at once share the cores: cores // 2 threads each
            assert "DPSGD_PARALLEL_JOBS=2" in policy, policy
            cores = min(physical_cores() or usable_cores(), usable_cores())
            assert st["runtime"]["threads"] == max(1, cores // 2), policy
    written = collect.collect(
        [tmp_path / "mr"], tmp_path / "res", include_tiny=True, hardware="test"
    )
    f5 = pd.read_csv(tmp_path / "res" / "figure5.csv")
    assert written["figure5.csv"] == 2 and f5["run"].is_unique
    assert set(f5["panel"]) == {"clip_norm"} and sorted(f5["value"].astype(float)) == [1.0, 2.0]
    assert (f5["stop_reason"] == "max_steps").all()


@pytest.mark.slow  # a third real multirun (~15 s on a loaded 2-core machine): make test-all
def test_a_refused_job_in_a_worker_does_not_stop_its_siblings(tmp_path):
    """joblib: job 0 is refused (σ < 0) in its worker; job 1 still completes; the command exits with
    the refused job's code (2) and names it; the refused job's fresh folder is removed."""
    r = _sweep(tmp_path, "joblib", "privacy.sigma=-1,4")
    assert r.returncode == 2, r.stderr[-3000:]
    assert "error: privacy.sigma=-1.0: must be >= 0" in r.stderr  # the worker's own line
    assert "error: sweep job 0 (" in r.stderr and "Traceback" not in r.stderr
    runs = _runs(tmp_path / "mr")
    assert len(runs) == 1 and runs[0].name.startswith("1_")
    assert json.loads((runs[0] / "privacy.json").read_text())["status"] == "complete"
    assert not any(p.name.startswith("0_") for p in (tmp_path / "mr").iterdir())


def test_a_bad_launcher_is_one_line_and_exit_2(tmp_path):
    r = subprocess.run(
        [sys.executable, "-m", "dpsgd.train", "-m", "hydra/launcher=slurmm", "seed=0,1"],
        cwd=tmp_path,
        env=dict(os.environ, PYTHONPATH=str(REPO)),
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert r.returncode == 2 and len(r.stderr.strip().splitlines()) == 1, r.stderr
    assert (
        r.stderr.startswith("error: ")
        and "hydra/launcher/slurmm" in r.stderr
        and "joblib" in r.stderr
    )
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize(
    "args, key",
    [
        (["hydra/launcher=joblib", "hydra.launcher.n_jobs=0"], "hydra.launcher.n_jobs"),
        (
            ["hydra/launcher=submitit_local", "hydra.launcher.timeout_min=0"],
            "hydra.launcher.timeout_min",
        ),
        (
            ["hydra/launcher=slurm", "hydra.launcher.tasks_per_node=2"],
            "hydra.launcher.tasks_per_node",
        ),
        (["hydra/launcher=submitit_slurm", "hydra.launcher.nodes=2"], "hydra.launcher.nodes"),
        (
            ["hydra/launcher=slurm", "hydra.launcher.cpus_per_task=0"],
            "hydra.launcher.cpus_per_task",
        ),
        (
            ["hydra/launcher=slurm", "hydra.launcher.gpus_per_task=-1"],
            "hydra.launcher.gpus_per_task",
        ),
    ],
)
def test_launcher_settings_are_checked_before_anything_is_written(args, key, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    with pytest.raises(ConfigError) as e:
        prepare_launch([*args, "seed=0,1"], multirun=True)
    assert str(e.value).startswith(key) and "\n" not in str(e.value)
    assert list(tmp_path.iterdir()) == []


def test_the_cluster_config_is_the_slurm_launcher_with_its_documented_settings():
    hc = compose(["hydra/launcher=slurm"], hydra_config=True).hydra
    assert check(hc) == "submitit_slurm"
    assert {"partition", "gpus_per_task", "cpus_per_task", "timeout_min", "mem_gb"} <= set(
        hc.launcher
    )
    assert (
        hc.launcher.tasks_per_node == 1
        and hc.launcher.nodes == 1
        and hc.launcher.max_num_timeout == 0
    )
    text = (REPO / "conf" / "hydra" / "launcher" / "slurm.yaml").read_text()
    assert "WHAT YOU CHANGE" in text and "partition" in text
    assert check(compose([], hydra_config=True).hydra) == "basic"


def test_sweep_size_and_jobs_at_once():
    def jobs(*args):
        return len(resolve_sweep(list(args)).subdirs)

    assert jobs("+sweep=clip_norm") == 3  # the sweep file's 1,2,8
    assert (
        jobs("+sweep=clip_norm", "privacy.clip_norm=1,2", "seed=0,1,2") == 6
    )  # the command line wins a key
    assert jobs("seed=range(0,5)", "experiment=mnist_small,mnist_medium") == 10
    joblib = {"n_jobs": -1}
    assert parallel_jobs("joblib", joblib, 3, cores=16) == 3  # never more than the sweep's jobs
    assert parallel_jobs("joblib", joblib, 40, cores=16) == 16  # -1: one per usable core
    assert parallel_jobs("joblib", {"n_jobs": -2}, 40, cores=16) == 15
    assert parallel_jobs("joblib", {"n_jobs": 4}, 40, cores=16) == 4
    assert parallel_jobs("submitit_local", {}, 5) == 5  # all at once
    assert parallel_jobs("submitit_slurm", {}, 50) == 1  # each on its own allocation
    assert parallel_jobs("basic", {}, 50) == 1
    plan = prepare_launch(
        ["+sweep=noise", "hydra/launcher=joblib", "hydra.launcher.n_jobs=2"], multirun=True
    )
    assert (plan.launcher, plan.jobs, plan.parallel) == ("joblib", 3, 2)


def test_jobs_share_the_cores_unless_the_user_chose_the_threads():
    env = {}
    assert share_cores(Launch([], "joblib", 4, 4), env) and env == {"DPSGD_PARALLEL_JOBS": "4"}
    env = {}
    assert not share_cores(Launch([], "basic", 4, 1), env) and env == {}
    for chosen in ({"OMP_NUM_THREADS": "2"}, {"DPSGD_THREADS": "3"}):
        env = dict(chosen)
        assert not share_cores(Launch([], "joblib", 4, 4), env) and env == chosen


# --------------------------------------------------------------------------- experiment scripts
# ~12 s: every group's multirun through a launcher (the sweep above covers one, fast)
@pytest.mark.slow
def test_paper_with_a_launcher_runs_one_multirun_per_group(capsys):
    assert paper.main(["--dry-run", "--sec-per-epoch", "2", "--launcher", "joblib"]) == 0
    out = capsys.readouterr().out
    assert "hydra/launcher=joblib, 1 multirun(s) at a time" in out
    presets = next(line for line in out.splitlines() if line.strip().startswith("presets"))
    assert "-m experiment=mnist_small,mnist_medium,mnist_large,mnist_nonprivate" in presets
    assert "+sweep=lot_size hydra/launcher=joblib" in out
    jobs = paper.plan_jobs(paper.PRESETS, paper.SWEEPS, "joblib")
    for j, args in zip(jobs, paper.commands(jobs, "joblib")):
        plan = prepare_launch(args[1:], multirun=True)  # every command passes dpsgd's own checks
        assert plan.jobs == len(j["each"]), j["name"]
    # a cluster runs every point at once: the longest point is the wall time
    assert paper.wall_epochs(jobs, len(jobs), "slurm") == max(e for j in jobs for e in j["each"])


def test_experiment_scripts_refuse_a_bad_launcher_in_one_line(capsys):
    with pytest.raises(SystemExit) as e:
        paper.main(["--dry-run", "--launcher", "slurmm"])
    assert e.value.code == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("error: --launcher slurmm:")


def test_seeds_with_a_launcher_is_one_multirun_over_presets_and_seeds(monkeypatch):
    ran = []
    monkeypatch.setattr(seeds.subprocess, "run", lambda cmd, **kw: ran.append(cmd))
    seeds.run(["mnist_small", "mnist_large"], [0, 1, 2], "cpu", launcher="joblib")
    (cmd,) = ran
    args = cmd[cmd.index("dpsgd.train") + 1 :]
    plan = prepare_launch(args[1:], multirun=True)
    assert args[0] == "-m" and (plan.launcher, plan.jobs) == ("joblib", 6)
    assert "name=seeds" in args and any(
        a.startswith("hydra.sweep.dir=outputs/seeds/") for a in args
    )
