"""The one error type for bad input: a configuration value, a command-line flag, a run directory that
cannot be used. ``str(e)`` is one line naming the key; the command line prints it and exits with 2."""


class ConfigError(ValueError):
    """A bad configuration value; str(e) is one line naming the key."""
