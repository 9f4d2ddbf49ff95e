"""Atomic file I/O: nothing written is ever half-written.

Every file is replaced atomically (write a temporary file in the same folder, fsync it,
``os.replace`` it over the target, fsync the folder), so a process killed at any moment (SIGKILL
included) leaves either the old or the new version; a failed write (disk full, read-only folder)
leaves no temporary file behind, and its OSError names the file it was writing (``error: <path>: No
space left on device``), whichever call failed (``naming``).

Every JSON file is strict JSON (RFC 8259): ``json_text`` refuses NaN and ±Infinity
(``allow_nan=False``) and names where one sits, so a writer states a non-finite value as ``null``
with words beside it (docs/PRIVACY_STATEMENT.md) instead of writing ``Infinity``, which no strict
parser reads.
"""

from __future__ import annotations

import json
import math
import os
from contextlib import contextmanager
from pathlib import Path


@contextmanager
def naming(path: str | Path):
    """An OSError raised inside (a write, an fsync, a rename: they may not say which file) re-raised
    with ``path`` as its file name; the type follows its errno as before (FileExistsError stays
    one)."""
    try:
        yield
    except OSError as e:
        if e.errno is None or e.filename == str(path):
            raise
        raise OSError(e.errno, e.strerror or str(e), str(path)) from e


def fsync_dir(path: Path) -> None:
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:  # pragma: no cover (platforms without directory fds)
        return
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def atomic_write_bytes(path: str | Path, data: bytes, *, exclusive: bool = False) -> None:
    """Replace ``path`` by ``data`` atomically; on failure (disk full, read-only) no temp file is
    left. ``exclusive``: never replace an existing file (FileExistsError), the new one still appears
    whole."""
    path = Path(path)
    tmp = path.with_name(f".{path.name}.tmp{os.getpid()}")
    with naming(path):
        try:
            with open(tmp, "wb") as f:
                f.write(data)
                f.flush()
                os.fsync(f.fileno())
            if exclusive:
                _link_new(tmp, path, data)
                tmp.unlink()
            else:
                os.replace(tmp, path)
        except BaseException:
            tmp.unlink(missing_ok=True)
            raise
        fsync_dir(path.parent)


def _link_new(tmp: Path, path: Path, data: bytes) -> None:
    """``tmp`` appears as ``path`` unless ``path`` exists (FileExistsError); without hard links, an
    exclusive create and write."""
    try:
        os.link(tmp, path)
    except FileExistsError:
        raise
    except OSError:  # pragma: no cover (file systems without hard links)
        with open(path, "xb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())


def atomic_write_text(path: str | Path, text: str, *, exclusive: bool = False) -> None:
    atomic_write_bytes(path, text.encode(), exclusive=exclusive)


def json_text(obj, indent: int | None = 2) -> str:
    """``obj`` as strict JSON text; ValueError naming the first NaN or ±Infinity (``epsilon:
    inf``)."""
    try:
        return json.dumps(
            obj, indent=indent, sort_keys=False, allow_nan=False, default=json_default
        )
    except ValueError:
        where = non_finite(plain(obj))
        if where is None:
            raise
        raise ValueError(
            f"not strict JSON: {where[0] or '<top>'}: {where[1]} (write null and say why)"
        ) from None


def non_finite(obj, at: str = ""):
    """(key path, value) of the first NaN or ±Infinity float in a JSON-like structure, else None."""
    if isinstance(obj, float) and not math.isfinite(obj):
        return at, obj
    items = (
        obj.items()
        if isinstance(obj, dict)
        else enumerate(obj)
        if isinstance(obj, (list, tuple))
        else ()
    )
    for k, v in items:
        found = non_finite(v, f"{at}.{k}" if at else str(k))
        if found is not None:
            return found
    return None


def write_json(path: str | Path, obj, *, exclusive: bool = False) -> None:
    """``obj`` as strict JSON (``json_text``), written atomically (``exclusive``: never over a
    file)."""
    atomic_write_text(path, json_text(obj) + "\n", exclusive=exclusive)


def json_default(o):
    """numpy / torch scalars and arrays as plain JSON values."""
    if hasattr(o, "item"):
        return o.item()
    if hasattr(o, "tolist"):
        return o.tolist()
    raise TypeError(f"not JSON serialisable: {type(o).__name__}")


def plain(obj):
    """JSON-like structure of plain python values (safe for torch.load(weights_only=True)); not a
    file writer: NaN and ±Infinity stay floats (a checkpoint keeps metrics rows as they are)."""
    return json.loads(json.dumps(obj, default=json_default))
