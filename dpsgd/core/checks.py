"""Checks of one config value, each refusing with a ``ConfigError`` in one line that names the key.

Every config group's validator uses them (``dpsgd/config/schema.py:validate`` calls the groups in
turn): a number in a range (bools, strings, NaN/inf and fractional integers refused), true/false,
one of a list of choices (the list defined where the choice is implemented).
"""

from __future__ import annotations

import math
from typing import Any

from dpsgd.core.errors import ConfigError


def fmt(v: Any) -> str:
    """A value as the config spells it (None is ``null``)."""
    return "null" if v is None else str(v)


def num(
    key: str,
    v: Any,
    *,
    integer: bool = False,
    optional: bool = False,
    lo=None,
    lo_open=False,
    hi=None,
    hi_open=False,
):
    """Coerce a number, refusing bools, strings, NaN/inf and (for integers) fractional values."""
    if v is None:
        if optional:
            return None
        raise ConfigError(f"{key}=null: a value is required")
    what = "an integer" if integer else "a number"
    if isinstance(v, bool) or not isinstance(v, (int, float)):
        raise ConfigError(f"{key}={fmt(v)}: must be {what}")
    if not math.isfinite(v):
        raise ConfigError(f"{key}={fmt(v)}: must be a finite number")
    if integer:
        if isinstance(v, float) and not v.is_integer():
            raise ConfigError(f"{key}={fmt(v)}: must be an integer")
        v = int(v)
    else:
        v = float(v)
    if lo is not None and (v <= lo if lo_open else v < lo):
        raise ConfigError(f"{key}={fmt(v)}: must be {'>' if lo_open else '>='} {lo}")
    if hi is not None and (v >= hi if hi_open else v > hi):
        raise ConfigError(f"{key}={fmt(v)}: must be {'<' if hi_open else '<='} {hi}")
    return v


def typed_number(text: str):
    """A number as typed on a command line (int if it reads as one, else float); anything else is
    returned as it is, for ``num`` to refuse with the key's name."""
    for convert in (int, float):
        try:
            return convert(text)
        except ValueError:
            pass
    return text


def boolean(key: str, v: Any) -> bool:
    if not isinstance(v, bool):
        raise ConfigError(f"{key}={fmt(v)}: must be true or false")
    return v


def choice(key: str, v: Any, options) -> str:
    """``v`` if it is one of ``options`` (a config key's choices:
    dpsgd/config/schema.py:CHOICES)."""
    allowed = sorted(
        options
    )  # a list: an unhashable value (a list, a dict) is refused, not a TypeError
    if v not in allowed:
        raise ConfigError(f"{key}={fmt(v)}: unknown, must be one of {allowed}")
    return v
