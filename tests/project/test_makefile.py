"""`make install` under concurrency and interruption, with a fake interpreter (no real venv, no
pip).

The fake stands in for both the base Python (`-m venv DIR` copies itself to DIR/bin/python) and the
venv's Python (`-m pip ...` is logged with the interpreter that ran it); both sleep, so that two
makes started together overlap. VENV, PYTHON are overridden on the make command line; each
test ~1-3 s.
"""

import os
import shutil
import subprocess
import textwrap
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]

pytestmark = pytest.mark.skipif(
    not (shutil.which("make") and shutil.which("flock")),
    reason="needs GNU make and util-linux flock",
)

FAKE = textwrap.dedent("""\
    #!/usr/bin/env bash
    if [ "$1 $2" = "-m venv" ]; then
        mkdir -p "$3/bin"; sleep 0.4; cp "$0" "$3/bin/python"; echo "venv $3" >> "$FAKE_LOG"; exit 0
    fi
    if [ "$1 $2" = "-m pip" ]; then
        echo "pip $0 ${*: -1}" >> "$FAKE_LOG"; sleep 0.3
        [ "${*: -1}" = "requirements-test.txt" ] && [ -n "$FAKE_PIP_FAIL" ] && exit 1
        exit 0
    fi
    exit 3
""")


@pytest.fixture
def env(tmp_path):
    fake = tmp_path / "python3"
    fake.write_text(FAKE)
    fake.chmod(0o755)
    log = tmp_path / "log"
    log.touch()
    return {"fake": fake, "venv": tmp_path / "venv", "log": log}


def _make(env, **extra):
    return subprocess.Popen(
        [
            "make",
            "--no-print-directory",
            "-C",
            str(REPO),
            "install",
            f"VENV={env['venv']}",
            f"PYTHON={env['fake']}",
        ],
        env={**os.environ, "FAKE_LOG": str(env["log"]), **extra},
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )


def _run(env, **extra):
    p = _make(env, **extra)
    out, _ = p.communicate(timeout=60)
    return p.returncode, out


def _log(env):
    return env["log"].read_text().splitlines()


def _full_build(env):
    vpy = env["venv"] / "bin" / "python"
    return [f"venv {env['venv']}", f"pip {vpy} pip", f"pip {vpy} requirements-test.txt"]


def test_two_concurrent_installs_build_the_venv_once(env):
    procs = [_make(env), _make(env)]
    outs = [p.communicate(timeout=60)[0] for p in procs]
    assert [p.returncode for p in procs] == [0, 0], outs
    # one venv created; every pip ran inside it (never the base interpreter); nothing installed
    # twice
    assert _log(env) == _full_build(env), outs
    assert sum("is up to date" in o for o in outs) == 1, outs
    assert (env["venv"] / ".installed").exists() and (env["venv"] / ".created").exists()
    # a later make finds it finished and runs nothing
    assert _run(env)[0] == 0 and _log(env) == _full_build(env)


def test_half_built_venv_is_rebuilt_not_installed_into(env):
    (env["venv"] / "bin").mkdir(parents=True)  # python -m venv interrupted: no .created
    shutil.copy(env["fake"], env["venv"] / "bin" / "python")
    (env["venv"] / "junk").touch()
    rc, out = _run(env)
    assert rc == 0, out
    assert _log(env) == _full_build(env)
    assert not (env["venv"] / "junk").exists()


def test_failed_install_leaves_no_stamp_and_reuses_the_created_venv(env):
    rc, out = _run(env, FAKE_PIP_FAIL="1")
    assert rc != 0, out
    assert not (env["venv"] / ".installed").exists() and (env["venv"] / ".created").exists()
    env["log"].write_text("")
    rc, out = _run(env)
    assert rc == 0, out
    assert _log(env) == [f"pip {env['venv'] / 'bin' / 'python'} requirements-test.txt"]
    assert (env["venv"] / ".installed").exists()
