"""Progress bars (dpsgd/core/console.py:progress): over the lots of an epoch and over ScatterNet's
batches, drawn on a terminal only, never into run.log or a redirected stream; and the one line that
says how big a written feature cache is."""

from __future__ import annotations

import fcntl
import io
import os
import pty
import struct
import subprocess
import sys
import termios
import time

import torch

from conftest import TINY_RUN, run_train, train_env
from dpsgd.core.console import progress, tee_to
from dpsgd.data import features

BAR = ("lot/s", "0/10 [", "\r")  # what tqdm draws: the rate, the count, the carriage return


class _Terminal(io.StringIO):
    def isatty(self) -> bool:
        return True


def test_the_bar_goes_to_the_terminal_beneath_run_log(tmp_path, monkeypatch):
    term = _Terminal()
    monkeypatch.setattr(sys, "stderr", term)
    with tee_to(tmp_path / "run.log") as log:
        log.release()
        print("a console line", file=sys.stderr)
        with progress(range(3), total=3, desc="epoch 1", unit="lot") as it:
            assert list(it) == [0, 1, 2]
    assert "epoch 1:" in term.getvalue() and "| 0/3 [" in term.getvalue()
    assert (tmp_path / "run.log").read_text() == "a console line\n"


def test_no_bar_when_stderr_is_not_a_terminal_or_when_not_shown(monkeypatch):
    for stream, show in ((io.StringIO(), True), (_Terminal(), False)):
        monkeypatch.setattr(sys, "stderr", stream)
        with progress(range(3), total=3, desc="epoch 1", show=show) as it:
            assert list(it) == [0, 1, 2]
        assert stream.getvalue() == ""


def _run_in_a_pty(args, cwd) -> tuple[int, str]:
    """``python -m dpsgd.train ARGS`` with stdin, stdout and stderr a pseudo-terminal of 100×24;
    (exit code, what it showed)."""
    master, slave = pty.openpty()
    fcntl.ioctl(slave, termios.TIOCSWINSZ, struct.pack("HHHH", 24, 100, 0, 0))
    proc = subprocess.Popen(
        [sys.executable, "-m", "dpsgd.train", *args],
        cwd=cwd,
        env=dict(train_env(), TERM="xterm"),
        stdin=slave,
        stdout=slave,
        stderr=slave,
        close_fds=True,
    )
    os.close(slave)
    out, deadline = b"", time.time() + 240
    while time.time() < deadline:
        try:
            chunk = os.read(master, 65536)
        except OSError:  # EIO: every end of the terminal closed (the child exited)
            break
        if not chunk:
            break
        out += chunk
    os.close(master)
    return proc.wait(timeout=60), out.decode("utf-8", "replace")


def test_a_run_on_a_terminal_shows_the_bar_and_run_log_has_none(tmp_path):
    args = [*TINY_RUN, "training.epochs=2", "hydra.run.dir=run"]
    code, shown = _run_in_a_pty(args, tmp_path)
    assert code == 0, shown
    assert "epoch 1:" in shown and all(b in shown for b in BAR), shown
    log = (tmp_path / "run" / "run.log").read_text()
    assert "epoch    2" in log or "done (epochs_completed)" in log
    assert not any(b in log for b in BAR) and "█" not in log
    # the console's lines are run.log's, the bar aside (the terminal writes \r\n for \n)
    for line in log.splitlines():
        assert line in shown.replace("\r\n", "\n")


def test_a_run_without_a_terminal_prints_no_bar(tmp_path):
    out = run_train([*TINY_RUN, "training.epochs=1", "hydra.run.dir=run"], tmp_path)
    assert out.returncode == 0, out.stderr
    assert not any(b in out.stdout + out.stderr for b in BAR)
    assert out.stdout == (tmp_path / "run" / "run.log").read_text()


def test_a_written_feature_cache_says_its_size_once(tmp_path, capsys):
    X = torch.rand(3, 28 * 28, generator=torch.Generator().manual_seed(0))
    features.cached_scatter(X, "mnist", "train", tmp_path)
    (path,) = (tmp_path / "features").glob("*.pt")
    said = capsys.readouterr()
    size = features.size_text(path.stat().st_size)
    assert said.out == f"features: wrote {size} cache to {path}\n" and said.err == ""
    features.cached_scatter(X, "mnist", "train", tmp_path)  # read back: nothing said
    assert capsys.readouterr().out == ""


def test_sizes_read_as_people_read_them():
    got = [features.size_text(n) for n in (300, 12_345, 3_141_592, 952_000_000, 3_100_000_000)]
    assert got == ["300 B", "12 kB", "3.1 MB", "952 MB", "3.1 GB"]
