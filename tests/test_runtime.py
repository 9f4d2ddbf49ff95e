"""The allocator tuning changes speed only: it applies on Linux/glibc and is idempotent."""
import sys

import pytest

from dpsgd.runtime import tune_allocator


def test_tune_allocator_applies_and_is_idempotent(monkeypatch):
    first = tune_allocator()
    assert tune_allocator() == first
    if sys.platform.startswith("linux"):
        assert first is True
    monkeypatch.setenv("DPSGD_TUNE_MALLOC", "0")
    assert tune_allocator() is False
