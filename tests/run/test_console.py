"""What a run says while it works: the plan (forecast) first, each epoch of ≈K with an ETA, and
every console line kept in the run folder's run.log; driven in a pseudo-terminal, as a user sees
it."""

from __future__ import annotations

import os
import pty
import subprocess
import sys

from conftest import TINY_RUN, train_env


def _in_a_terminal(args, cwd) -> str:
    """``python -m dpsgd.train ARGS`` with its stdout and stderr on a pseudo-terminal."""
    leader, follower = pty.openpty()
    proc = subprocess.Popen([sys.executable, "-m", "dpsgd.train", *args], cwd=cwd,
                            env=train_env(), stdout=follower, stderr=follower)  # fmt: skip
    os.close(follower)
    out = b""
    while True:
        try:
            chunk = os.read(leader, 4096)
        except OSError:  # the child closed the terminal
            break
        if not chunk:
            break
        out += chunk
    proc.wait(timeout=300)
    os.close(leader)
    assert proc.returncode == 0, out.decode(errors="replace")
    return out.decode().replace("\r\n", "\n")


def test_the_plan_the_eta_and_run_log(tmp_path):
    run = tmp_path / "run"
    seen = _in_a_terminal([*TINY_RUN, "training.epochs=3", f"hydra.run.dir={run}"], tmp_path)
    lines = seen.splitlines()
    plan = next(ln for ln in lines if ln.startswith("plan: "))
    assert plan == "plan: ≈ 3 epoch(s) of 10 lots (≈ 30 lots): training.epochs = 3"
    epochs = [ln for ln in lines if ln.startswith("epoch ")]
    assert len(epochs) == 3 and all(" | of ≈3, eta " in ln for ln in epochs)
    log = (run / "run.log").read_text().splitlines()
    assert plan in log and epochs == [ln for ln in log if ln.startswith("epoch ")]
    assert any(ln.startswith("done (epochs_completed)") for ln in log)


def test_a_target_epsilon_is_forecast_in_lots_and_epochs(tmp_path):
    run = tmp_path / "run"
    args = [*TINY_RUN, "training.epochs=50", "privacy.target_epsilon=3", f"hydra.run.dir={run}"]
    seen = _in_a_terminal(args, tmp_path)
    plan = next(ln for ln in seen.splitlines() if ln.startswith("plan: "))
    assert "the target ε = 3 (moments, joint) allows " in plan and "more lot(s)" in plan
