"""Table any runs: ``python -m dpsgd.report RUN_OR_SWEEP... [--format terminal|markdown|csv]
[--out FILE] [--plot FILE.png]``.

A run is any folder holding a ``privacy.json`` (a training run, an audit's run, a sweep's job);
a folder given is searched for them. One row per run, from its own files only: the folder, the
overrides it was started with (``.hydra/overrides.yaml``), status and stop reason, lots, epochs,
the last measured test accuracy (``metrics.csv``), the valid ε (the smallest sound one) and the
configured accountant's ε, at its δ; both ε rounded up (4 significant digits, as the statement and
the console print them: never below the computed value; ``--format csv`` keeps the exact floats).
A folder whose privacy.json cannot be read is skipped with one line on stderr saying so; a bad
``--out`` or ``--plot`` is one line and exit 2, before anything is read. ``--plot`` draws test
accuracy against valid ε and against epoch for the runs listed, and its title says what they did.
"""

from __future__ import annotations

import argparse
import csv
import io
import json
import math
import os
import sys
from pathlib import Path

COLUMNS = ["run", "overrides", "status", "stop_reason", "lots", "epochs", "test_accuracy",
           "epsilon_valid", "epsilon", "delta"]  # fmt: skip


def find_runs(paths) -> list[Path]:
    """Every folder at or under ``paths`` holding a privacy.json, sorted, each once."""
    found = set()
    for p in map(Path, paths):
        if not p.exists():
            raise FileNotFoundError(f"report: {p}: no such folder")
        found |= {q.parent for q in ([p / "privacy.json"] if (p / "privacy.json").is_file() else
                                     p.rglob("privacy.json"))}  # fmt: skip
    return sorted(found)


def _overrides(run: Path) -> str:
    f = run / ".hydra" / "overrides.yaml"
    if not f.is_file():
        return ""
    items = [ln[2:].strip() for ln in f.read_text().splitlines() if ln.startswith("- ")]
    return " ".join(items)


def _last_accuracy(run: Path) -> tuple[float, list[tuple[int, float]]]:
    """(last measured test accuracy, [(epoch, accuracy), ...]) of metrics.csv (NaN when none)."""
    f = run / "metrics.csv"
    if not f.is_file():
        return math.nan, []
    with open(f, newline="") as fh:
        rows = [(int(r["epoch"]), float(r["test_accuracy"])) for r in csv.DictReader(fh)
                if r.get("test_accuracy") not in (None, "", "nan")]  # fmt: skip
    rows = [(e, a) for e, a in rows if not math.isnan(a)]
    return (rows[-1][1] if rows else math.nan), rows


class Unreadable(ValueError):
    """A run folder whose privacy.json (or metrics.csv) cannot be read; str: one line."""


def _statement(run: Path) -> dict:
    try:
        st = json.loads((run / "privacy.json").read_text())
    except (OSError, UnicodeDecodeError, ValueError) as e:
        why = getattr(e, "strerror", None) or " ".join(str(e).split())[:80] or type(e).__name__
        raise Unreadable(f"{run / 'privacy.json'}: unreadable ({why})") from None
    if not isinstance(st, dict):
        raise Unreadable(f"{run / 'privacy.json'}: not a privacy statement")
    return st


def rows_of(runs, base: Path | None = None) -> tuple[list[Path], list[dict]]:
    """(runs, their rows), each run whose files cannot be read skipped with one line on stderr."""
    kept, rows = [], []
    for r in runs:
        try:
            rows.append(row(r, base))
            kept.append(r)
        except Unreadable as e:
            print(f"report: skipped {e}", file=sys.stderr, flush=True)
    return kept, rows


def row(run: Path, base: Path | None = None) -> dict:
    """One table row of ``run`` (its folder relative to ``base`` when under it); Unreadable (one
    line) when its privacy.json or metrics.csv cannot be read."""
    st = _statement(run)
    try:
        acc, _ = _last_accuracy(run)
    except (OSError, UnicodeDecodeError, ValueError, KeyError, csv.Error) as e:
        raise Unreadable(f"{run / 'metrics.csv'}: unreadable ({type(e).__name__})") from None
    name = run.relative_to(base) if base is not None and run.is_relative_to(base) else run
    return {
        "run": str(name),
        "overrides": _overrides(run),
        "status": st.get("status"),
        "stop_reason": st.get("stop_reason"),
        "lots": st.get("steps"),
        "epochs": st.get("epochs"),
        "test_accuracy": acc,
        "epsilon_valid": st.get("epsilon_valid"),
        "epsilon": st.get("epsilon"),
        "delta": st.get("delta"),
    }


def _cell(v, column: str = "") -> str:
    if column == "delta" and isinstance(v, float):
        return f"{v:g}"
    if column.startswith("epsilon") and isinstance(v, (int, float)) and not isinstance(v, bool):
        from dpsgd.run.report import eps_up  # rounded up, as the statement prints it

        return eps_up(float(v))
    if isinstance(v, float):
        return "nan" if math.isnan(v) else f"{v:.4f}"
    return "" if v is None else str(v)


def render(rows: list[dict], fmt: str) -> str:
    """The table as ``terminal`` (aligned columns), ``markdown`` or ``csv`` text."""
    if fmt == "csv":
        buf = io.StringIO()
        w = csv.DictWriter(buf, COLUMNS, lineterminator="\n")
        w.writeheader()
        w.writerows(rows)
        return buf.getvalue()
    cells = [COLUMNS] + [[_cell(r[c], c) for c in COLUMNS] for r in rows]
    if fmt == "markdown":
        lines = ["| " + " | ".join(c) + " |" for c in cells]
        return "\n".join([lines[0], "|" + "---|" * len(COLUMNS), *lines[1:]]) + "\n"
    width = [max(len(c[i]) for c in cells) for i in range(len(COLUMNS))]
    return "\n".join("  ".join(c[i].ljust(width[i]) for i in range(len(COLUMNS))).rstrip()
                     for c in cells) + "\n"  # fmt: skip


def plot(runs: list[Path], rows: list[dict], out: Path) -> Path:
    """Test accuracy against valid ε (one point per run) and against epoch (one line per run)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (a1, a2) = plt.subplots(1, 2, figsize=(11, 4.2))
    for run, r in zip(runs, rows):
        _, curve = _last_accuracy(run)
        if curve:
            a2.plot([e for e, _ in curve], [100 * a for _, a in curve], label=r["run"], lw=1)
        if r["epsilon_valid"] is not None and not math.isnan(r["test_accuracy"]):
            a1.plot(r["epsilon_valid"], 100 * r["test_accuracy"], "o")
            a1.annotate(r["run"][-24:], (r["epsilon_valid"], 100 * r["test_accuracy"]), fontsize=6)
    a1.set(xlabel="ε (valid) at each run's δ", ylabel="test accuracy (%)")
    a2.set(xlabel="epoch", ylabel="test accuracy (%)")
    if len(runs) <= 12:
        a2.legend(fontsize=6)
    stops = sorted({str(r["stop_reason"]) for r in rows})
    deltas = sorted({r["delta"] for r in rows if r["delta"] is not None})
    fig.suptitle(f"{len(rows)} run(s); stopped by: {', '.join(stops)}; δ = "
                 f"{', '.join(f'{d:g}' for d in deltas)}", fontsize=9)  # fmt: skip
    fig.tight_layout()
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=120)
    plt.close(fig)
    return out


PLOT_FORMATS = ("png", "pdf", "svg", "jpg", "jpeg")


def _check_outputs(a) -> None:
    """--out and --plot: files this process can write (a folder that exists, not a folder itself),
    --plot of a format matplotlib draws; ValueError in one line, before anything is read."""
    for flag, path in (("--out", a.out), ("--plot", a.plot)):
        if path is None:
            continue
        if path.is_dir():
            raise ValueError(f"{flag}={path}: is a folder; give a file name")
        if not path.parent.is_dir() and flag == "--out":
            raise ValueError(f"{flag}={path}: no folder {path.parent}")
        if flag == "--plot" and path.suffix.lower().lstrip(".") not in PLOT_FORMATS:
            raise ValueError(
                f"--plot={path}: the file name must end in one of "
                f"{', '.join('.' + f for f in PLOT_FORMATS)}"
            )
        if path.exists() and not os.access(path, os.W_OK):
            raise ValueError(f"{flag}={path}: not writable")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m dpsgd.report", description=__doc__.splitlines()[0])
    ap.add_argument("paths", nargs="+", help="run folders, or folders holding runs (sweeps)")
    ap.add_argument("--format", choices=("terminal", "markdown", "csv"), default="terminal")
    ap.add_argument("--out", type=Path, help="write the table here instead of printing it")
    ap.add_argument("--plot", type=Path, help="draw accuracy against ε and epoch into this file")
    a = ap.parse_args(argv)
    try:
        _check_outputs(a)
        runs = find_runs(a.paths)
    except (FileNotFoundError, ValueError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    if not runs:
        print(f"error: report: no run (privacy.json) under {' '.join(a.paths)}", file=sys.stderr)
        return 2
    base = Path(a.paths[0]) if len(a.paths) == 1 and Path(a.paths[0]).is_dir() else None
    runs, rows = rows_of(runs, base)
    if not rows:
        print("error: report: no run could be read", file=sys.stderr)
        return 2
    text = render(rows, a.format)
    try:
        if a.out:
            a.out.write_text(text)
            print(f"report: {len(rows)} run(s) -> {a.out}")
        else:
            print(text, end="")
        if a.plot:
            print(f"report: plot -> {plot(runs, rows, a.plot)}")
    except OSError as e:
        print(f"error: {e.filename or ''}: {e.strerror or e}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    raise SystemExit(main())


class SweepTable:
    """A Hydra callback (conf/config.yaml ``hydra.callbacks``): the table of a ``-m`` sweep's runs,
    printed when the sweep ends, the same as ``python -m dpsgd.report <sweep folder>``."""

    def on_run_start(self, config, **kwargs) -> None:
        pass

    def on_run_end(self, config, **kwargs) -> None:
        pass

    def on_multirun_start(self, config, **kwargs) -> None:
        pass

    def on_job_start(self, config, **kwargs) -> None:
        pass

    def on_job_end(self, config, job_return, **kwargs) -> None:
        pass

    def on_multirun_end(self, config, **kwargs) -> None:
        folder = Path(str(config.hydra.sweep.dir))
        runs = find_runs([folder]) if folder.is_dir() else []
        runs, rows = rows_of(runs, folder)
        if runs:
            print(f"sweep: {len(runs)} run(s) in {folder} (python -m dpsgd.report {folder})")
            print(render(rows, "terminal"), end="", flush=True)
