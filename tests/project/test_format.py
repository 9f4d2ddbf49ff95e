"""The code is formatted by the pinned ruff (pyproject.toml: 100 columns): `ruff format --check`.

Run `.venv/bin/ruff format .` to fix a failure; the version is pinned in requirements-test.txt.
"""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def _ruff() -> str:
    here = Path(sys.executable).parent / "ruff"
    found = str(here) if here.exists() else shutil.which("ruff")
    assert found, "ruff is not installed: make install (requirements-test.txt pins it)"
    return found


def test_code_is_formatted():
    out = subprocess.run(
        [_ruff(), "format", "--check", "."], cwd=ROOT, capture_output=True, text=True
    )
    assert out.returncode == 0, "run `.venv/bin/ruff format .`:\n" + out.stdout + out.stderr
