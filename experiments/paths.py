"""Where the repository, its configs and its results are, and how a path is written into results/.

Nothing committed under results/ names a folder of the machine that made it: a path inside the
repository is written relative to it, any other by its last component (``portable``).
"""

from __future__ import annotations

from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
CONF = ROOT / "conf"
RESULTS = ROOT / "results"


def repo_relative(path: Path | str) -> str:
    """``path`` relative to the repository when it lies inside it, else as given (resolved)."""
    path = Path(path).resolve()
    return str(path.relative_to(ROOT)) if path.is_relative_to(ROOT) else str(path)


def portable(path: Path | str) -> str:
    """A path free of this machine's layout: relative to the repository when inside it, else its
    last component (the data root ``/any/where/data`` is written ``data``, as the default
    ``<repo>/data``)."""
    p = Path(path)
    if not p.is_absolute():
        return p.as_posix()
    p = p.resolve()
    return p.relative_to(ROOT).as_posix() if p.is_relative_to(ROOT) else p.name
