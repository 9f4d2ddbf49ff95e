"""Benchmarks (`make bench`): timings go to CSVs under results/, never into test assertions."""
from __future__ import annotations

import csv
import os
from pathlib import Path


def write_csv(rows: list[dict], out: Path, columns: list[str]) -> None:
    """Write rows to out atomically (a temporary file, then a rename): a crash never leaves half a CSV."""
    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_suffix(out.suffix + ".tmp")
    with tmp.open("w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=columns)
        w.writeheader()
        w.writerows(rows)
    os.replace(tmp, out)
