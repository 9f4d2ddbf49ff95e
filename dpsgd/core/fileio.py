"""Atomic file I/O: nothing written is ever half-written.

Every file is replaced atomically (write a temporary file in the same folder, fsync it, ``os.replace``
it over the target, fsync the folder), so a process killed at any moment (SIGKILL included) leaves
either the old or the new version; a failed write (disk full, read-only folder) leaves no temporary
file behind.
"""
from __future__ import annotations

import json
import os
from pathlib import Path


def fsync_dir(path: Path) -> None:
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:  # pragma: no cover (platforms without directory fds)
        return
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def atomic_write_bytes(path: str | Path, data: bytes) -> None:
    """Replace ``path`` by ``data`` atomically; on failure (disk full, read-only) no temp file is left."""
    path = Path(path)
    tmp = path.with_name(f".{path.name}.tmp{os.getpid()}")
    try:
        with open(tmp, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    fsync_dir(path.parent)


def atomic_write_text(path: str | Path, text: str) -> None:
    atomic_write_bytes(path, text.encode())


def write_json(path: str | Path, obj) -> None:
    atomic_write_text(path, json.dumps(obj, indent=2, sort_keys=False, default=json_default) + "\n")


def json_default(o):
    """numpy / torch scalars and arrays as plain JSON values."""
    if hasattr(o, "item"):
        return o.item()
    if hasattr(o, "tolist"):
        return o.tolist()
    raise TypeError(f"not JSON serialisable: {type(o).__name__}")


def plain(obj):
    """JSON-like structure of plain python values (safe for torch.load(weights_only=True))."""
    return json.loads(json.dumps(obj, default=json_default))
