"""``python -m lot_logger ARGS``: ``python -m dpsgd.train ARGS`` with every lot that runs logged to
$DPSGD_LOT_LOG as "S DIGEST" (its position and the digest of the weights it produced, before the run
charges it), and the process SIGKILL'd right after lot $DPSGD_KILL_AT ran (0: never), before the run
charged or digested it. Used by tests/run/test_replay.py to count the releases of real processes."""
import os
import signal
import sys

from dpsgd import train
from dpsgd.run import state
from dpsgd.run.replay import digest

LOG, KILL_AT = os.environ["DPSGD_LOT_LOG"], int(os.environ.get("DPSGD_KILL_AT", "0"))
_charge = state.Run.charge


def charge(run, release):
    S = run.progress.steps + 1
    with open(LOG, "a") as f:
        f.write(f"{S} {digest(run.parts.model)}\n")
    if S == KILL_AT:
        os.kill(os.getpid(), signal.SIGKILL)
    _charge(run, release)


state.Run.charge = charge
if __name__ == "__main__":
    train.main(sys.argv[1:])
