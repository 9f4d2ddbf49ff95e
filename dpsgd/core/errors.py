"""The errors a run ends with, each turned by the command line (dpsgd/launch/cli.py) into one line
on stderr and an exit code: bad input (2: a bad value, or a model whose examples mix), divergence
(1), an interrupting signal (128 + its number)."""

import signal


class ConfigError(ValueError):
    """A bad configuration value, flag or run directory; str(e) is one line naming the key."""


class NotPerExample(ValueError):
    """A model whose examples are not independent, or whose per-example structure an engine cannot
    prove (dpsgd/mechanism/clipping/proof.py); str(e) is one line naming what was seen."""


class Interrupted(Exception):
    """Ctrl-C, SIGTERM or SIGHUP during training (the run's privacy.json says 'interrupted')."""

    def __init__(self, signum: int):
        super().__init__(signal.Signals(signum).name)
        self.signum, self.run_dir = signum, None


class Diverged(RuntimeError):
    """A non-finite loss or parameter stopped the run (status 'diverged', no model released)."""


def one_line(e: BaseException) -> str:
    """An exception as one line (Hydra's long "Config search path" tail cut off)."""
    msg = " ".join(s.strip() for s in str(e).splitlines() if s.strip()) or type(e).__name__
    return msg.split(" Config search path:")[0]
