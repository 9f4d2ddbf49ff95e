"""``make wheelhouse`` / ``make gpu-check`` (bench/wheelhouse.py, bench/gpu_check.py).

Fast: the budget logic with a fake clock (a step over what is left is skipped with a line, a failed
step is named, a step that raises fails alone), the pins of the wheelhouse, the guards every child
process runs under (no network, carried packages from the target folder only), the child
environment, and the make targets (gpu-check builds no venv). Slow: the whole CPU rehearsal
(``python -m bench.gpu_check --device cpu``) from ``.whl/`` into a fresh target folder; it never
downloads: without ``make wheelhouse`` it is skipped. Timings are never asserted.
"""

import csv
import os
import re
import shutil
import socket
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from bench import gpu_check, wheelhouse
from bench.gpu_check import Clock, Outcome, Step, run_plan, verdict

REPO = Path(__file__).resolve().parents[2]
WHEELS = REPO / ".whl"


class FakeTime:
    def __init__(self):
        self.t = 100.0

    def __call__(self):
        return self.t


def _step(key, budget, status, takes, now):
    def run(limit):
        assert limit == budget  # each step is given its own budget as its limit
        now.t += takes
        return Outcome(status, f"{key} done")

    return Step(key, f"step {key}", budget, run)


def test_steps_over_what_is_left_are_skipped_and_failures_named():
    now, said = FakeTime(), []
    clock = Clock(100.0, now)
    now.t += 10  # setup
    steps = [
        _step("a", 30, "passed", 20, now),
        _step("b", 50, "failed", 45, now),
        _step("c", 40, "passed", 1, now),
        _step("d", 20, "cannot", 5, now),
    ]
    rows = run_plan(steps, clock, said.append)
    assert [r["status"] for r in rows] == ["passed", "failed", "skipped", "cannot"]
    assert [r["seconds"] for r in rows] == [20, 45, 0, 5]
    assert any(
        line.startswith("(c) step c: skipped, its budget of 40 s is over the 25 s left of 100 s")
        for line in said
    )
    status, line = verdict(rows)
    assert status == 1 and line == "gpu-check: FAILED: (b) step b"
    assert verdict([dict(r, status="passed") if r["status"] == "failed" else r for r in rows]) == (
        0,
        "gpu-check: passed (skipped over budget: (c))",
    )


def test_a_step_that_raises_fails_and_the_next_still_runs():
    now, said = FakeTime(), []

    def broken(limit):
        raise KeyError("no such column")

    rows = run_plan(
        [Step("a", "broken", 10, broken), _step("b", 10, "passed", 1, now)],
        Clock(60, now),
        said.append,
    )
    assert [(r["status"], r["note"]) for r in rows] == [
        ("failed", "KeyError: 'no such column'"),
        ("passed", "b done"),
    ]


def test_every_plan_fits_the_total_budget():
    for device in ("cuda", "cpu"):
        ctx = gpu_check.Ctx(sys.executable, device, {}, None, REPO, REPO)
        steps = gpu_check.plan(ctx)
        assert [s.key for s in steps] == ["a", "b", "c", "d"]
        assert sum(s.budget_s for s in steps) <= gpu_check.TOTAL_S - 45  # and leaves time for setup
        b = gpu_check.BENCH[device]
        assert b["lot_s"] <= steps[1].budget_s


def test_wheelhouse_pins_are_the_lock_and_make_bench():
    lock = {
        wheelhouse.canonical(n): v
        for n, v in (
            ln.split("==")
            for ln in (REPO / "requirements.lock").read_text().splitlines()
            if "==" in ln and not ln.startswith("#")
        )
    }
    pins = wheelhouse.pins()
    assert set(pins) == set(wheelhouse.WHEELS)
    for dist, version in pins.items():
        assert version == (wheelhouse.OPACUS if dist == "opacus" else lock[dist]), dist
    assert re.search(
        rf"pip install -q opacus=={re.escape(wheelhouse.OPACUS)}\b", (REPO / "Makefile").read_text()
    )
    assert "torch" not in pins and "numpy" not in pins  # the image's are used, never downloaded
    assert wheelhouse.PYTHONS[0] == "3.12"  # the GPU image's Python


def _guarded(code, tmp_path, hide="hydra"):
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    env.update(
        PYTHONPATH=str(gpu_check.GUARD),
        DPSGD_GPU_CHECK_SITE=str(tmp_path),
        DPSGD_GPU_CHECK_HIDE=hide,
    )
    return subprocess.run(
        [sys.executable, "-c", textwrap.dedent(code)],
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
    )


def test_guard_refuses_the_network_but_not_this_machine(tmp_path):
    r = _guarded(
        """
        import socket
        for call in (lambda: socket.create_connection(("203.0.113.7", 80), timeout=30),
                     lambda: socket.getaddrinfo("pypi.org", 443)):
            try:
                call()
                print("reached")
            except OSError as e:
                print("refused" if "network disabled" in str(e) else f"other {e}")
        srv = socket.socket()
        srv.bind(("127.0.0.1", 0))
        srv.listen()
        c = socket.create_connection(("localhost", srv.getsockname()[1]), timeout=30)
        print("loopback", c.getpeername()[0])
    """,
        tmp_path,
    )
    assert r.returncode == 0, r.stderr
    assert r.stdout.split("\n")[:3] == ["refused", "refused", "loopback 127.0.0.1"]


def test_guard_takes_carried_packages_from_the_target_folder_only(tmp_path):
    r = _guarded("import hydra", tmp_path)  # this venv holds hydra; the target does not
    assert (
        r.returncode == 1
        and f"No module named 'hydra' in the gpu-check target folder {tmp_path}" in r.stderr
    )
    (tmp_path / "hydra").mkdir()
    (tmp_path / "hydra" / "__init__.py").write_text("WHERE = 'target'\n")
    r = _guarded("import hydra, json; print(hydra.WHERE)", tmp_path)
    assert r.returncode == 0 and r.stdout.strip() == "target", r.stderr
    assert set(wheelhouse.WHEELS["hydra-core"][0]) <= set(gpu_check.hidden_names())
    assert "configparser" not in gpu_check.hidden_names()  # the standard library's stays visible


def test_child_env_has_no_pip_index_and_the_target_first(tmp_path, monkeypatch):
    monkeypatch.setenv("PIP_FIND_LINKS", "/somewhere")
    monkeypatch.setenv("PIP_INDEX_URL", "https://example.invalid/simple")
    env = gpu_check.child_env(tmp_path / "site", ["hydra"], "cpu")
    assert not {"PIP_FIND_LINKS", "PIP_INDEX_URL"} & set(env)
    assert env["PIP_NO_INDEX"] == "1" and env["PIP_CONFIG_FILE"] == os.devnull
    assert env["PYTHONPATH"].split(os.pathsep)[:3] == [
        str(tmp_path / "site"),
        str(gpu_check.GUARD),
        str(REPO),
    ]


@pytest.mark.skipif(not shutil.which("make"), reason="needs GNU make")
def test_make_gpu_check_builds_no_venv(tmp_path):
    def dry(*args):
        return (
            subprocess.run(
                ["make", "--no-print-directory", "-n", "-C", str(REPO), *args],
                capture_output=True,
                text=True,
                timeout=60,
            )
            .stdout.strip()
            .splitlines()
        )

    assert dry("gpu-check", f"VENV={tmp_path / 'none'}") == [
        "python3 -m bench.gpu_check --device cuda"
    ]
    assert dry("gpu-check", "DEVICE=cpu", "GPU_OUT=/tmp/o", "GPU_PYTHON=py") == [
        "py -m bench.gpu_check --device cpu --out-dir /tmp/o"
    ]


def _wheelhouse_for_this_python() -> str | None:
    """Why the rehearsal cannot run here (None when it can)."""
    if not (WHEELS / "requirements.txt").is_file():
        return (
            f"no {WHEELS}: run make wheelhouse first (it needs network; the tests never download)"
        )
    tag = f"cp{sys.version_info.major}{sys.version_info.minor}"
    if not list(WHEELS.glob(f"dm_tree-*-{tag}-*.whl")):
        return (
            f"{WHEELS} has no {tag} wheels: "
            f"make wheelhouse builds them for CPython {wheelhouse.PYTHONS}"
        )
    return None


@pytest.mark.slow
@pytest.mark.skipif(
    _wheelhouse_for_this_python() is not None, reason=str(_wheelhouse_for_this_python())
)
def test_cpu_rehearsal_from_a_fresh_target_folder(tmp_path):
    site, out = tmp_path / "site", tmp_path / "out"
    r = subprocess.run(
        [
            sys.executable,
            "-m",
            "bench.gpu_check",
            "--device",
            "cpu",
            "--work",
            str(tmp_path / "w"),
            "--target",
            str(site),
            "--out-dir",
            str(out),
        ],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=900,
    )
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    assert r.stdout.strip().splitlines()[-2].split("] ", 1)[1].startswith("gpu-check: passed")
    rows = list(csv.DictReader((out / "bench_cpu_check.csv").open()))
    assert [(r["step"], r["status"]) for r in rows] == [(k, "passed") for k in "abcd"]
    assert "2 processes (gloo) = 1 process" in rows[3]["note"]
    bench = list(csv.DictReader((out / "bench_cpu_step.csv").open()))
    assert {b["model"] for b in bench} == set(gpu_check.BENCH["cpu"]["models"].split(","))
    assert {b["method"] for b in bench} == {
        "nonprivate",
        "dpsgd_vmap",
        "dpsgd_ghost",
        "opacus_hooks",
        "opacus_ghost",
    }
    assert {p.name for p in out.iterdir()} == {
        "gpu_check.log",
        "bench_cpu_check.csv",
        "bench_cpu_step.csv",
        "mnist_medium_metrics.csv",
        "mnist_medium_privacy.json",
    }
    assert (site / "hydra").is_dir() and (site / "opacus").is_dir()
    assert not (
        REPO / "results" / "bench_cpu_check.csv"
    ).exists()  # the rehearsal never writes results/


def test_setup_without_a_wheelhouse_fails_first_and_says_what_to_do(tmp_path, capsys):
    status = gpu_check.main(
        ["--device", "cpu", "--wheels", str(tmp_path / "none"), "--work", str(tmp_path / "w")]
    )
    last = capsys.readouterr().out.strip().splitlines()[-1]
    assert status == 1 and "gpu-check: FAILED: setup:" in last and "run make wheelhouse" in last
    assert "FAILED: setup" in (tmp_path / "w" / "gpu_check.log").read_text()


@pytest.mark.parametrize("device, status", [("cuda", "cannot"), ("cpu", "failed")])
def test_nccl_refusing_two_ranks_on_one_gpu_is_a_reason_not_a_failure(
    device, status, tmp_path, monkeypatch
):
    calls = []

    def fake_stream(cmd, env, timeout, log, cwd=REPO):
        calls.append(cmd)
        if "torch.distributed.run" in cmd:
            return 1, [
                "[rank1]: torch.distributed.DistBackendError: NCCL error ... invalid usage",
                (
                    "misc/init.cc:NCCL WARN Duplicate GPU detected : "
                    "rank 1 and rank 0 both on CUDA device 1a000"
                ),
                "torch.distributed.elastic.multiprocessing.errors.ChildFailedError",
            ]
        return 0, ["done"]

    monkeypatch.setattr(gpu_check, "stream", fake_stream)
    ctx = gpu_check.Ctx(sys.executable, device, {}, None, tmp_path, tmp_path)
    out = gpu_check.step_torchrun(ctx, 80.0)
    assert out.status == status and len(calls) == 2
    if device == "cuda":
        assert "Duplicate GPU detected" in out.note


@pytest.mark.parametrize(
    "args, names",
    [
        (["--total-s", "-5"], "--total-s=-5"),
        (["--total-s", "nan"], "--total-s=nan"),
        (["--work", "{file}/w"], "--work="),
    ],
)
def test_bad_options_are_one_line_before_any_work(tmp_path, capsys, args, names):
    """A negative or NaN budget, a work folder that cannot be made: one line, exit 2."""
    (tmp_path / "file").write_text("")
    args = [a.format(file=tmp_path / "file") for a in args]
    try:
        status = gpu_check.main(["--device", "cpu", "--wheels", str(tmp_path / "none"), *args])
    except SystemExit as e:
        status = e.code
    err = capsys.readouterr().err.strip()
    assert (
        status == 2 and len(err.splitlines()) == 1 and err.startswith("error: ") and names in err
    ), err
