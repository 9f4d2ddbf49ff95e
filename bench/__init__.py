"""Benchmarks (`make bench`): timings go to CSVs under results/, never into test assertions."""

from __future__ import annotations

import csv
import io
from pathlib import Path

from dpsgd.core.fileio import atomic_write_text


def write_csv(rows: list[dict], out: Path, columns: list[str]) -> None:
    """Write rows to out atomically: a crash never leaves half a CSV."""
    buf = io.StringIO()
    w = csv.DictWriter(buf, fieldnames=columns)
    w.writeheader()
    w.writerows(rows)
    Path(out).parent.mkdir(parents=True, exist_ok=True)
    atomic_write_text(out, buf.getvalue())
