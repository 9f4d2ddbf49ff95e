"""Process-level CPU tuning that changes speed, never results.

glibc returns freed blocks above ``M_MMAP_THRESHOLD`` / at the top of the heap above
``M_TRIM_THRESHOLD`` to the operating system. A DP-SGD step allocates and frees the same
megabyte-sized activation and gradient buffers every lot, so by default every step pays fresh page
faults for them (visible as high system time). Keeping freed memory in the heap removes that churn:
steps of the paper's MNIST model ran about 20 % faster on the 2-core CPU of the README
(0.90 s vs 1.14 s for 100 lots, one thread). Opt out with ``DPSGD_TUNE_MALLOC=0``.
"""
from __future__ import annotations

import ctypes
import os
import sys

_M_TRIM_THRESHOLD, _M_TOP_PAD, _M_MMAP_THRESHOLD = -1, -2, -3


def tune_allocator() -> bool:
    """Ask glibc to keep freed memory (Linux/glibc only; a no-op elsewhere). Returns True if applied."""
    if os.environ.get("DPSGD_TUNE_MALLOC", "1") == "0" or not sys.platform.startswith("linux"):
        return False
    try:
        libc = ctypes.CDLL("libc.so.6")
        mallopt = libc.mallopt
    except (OSError, AttributeError):
        return False
    ok = mallopt(_M_MMAP_THRESHOLD, 1 << 30)
    ok &= mallopt(_M_TRIM_THRESHOLD, 1 << 30)
    ok &= mallopt(_M_TOP_PAD, 64 << 20)
    return bool(ok)
