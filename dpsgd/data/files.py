"""Your own data from files: ``dataset=tensors`` (``.pt`` or ``.npz``), ``dataset=csv`` and
``dataset=imagefolder``; and any torchvision class (``dataset=torchvision``, ``tvision.py``).

``dataset.train`` and ``dataset.test`` name the files. A ``.pt`` file holds ``(X, y)`` or
``{"X": ..., "y": ...}`` (``torch.save``); an ``.npz`` file arrays ``X`` and ``y``; a CSV a header,
the label column ``dataset.label`` (integer classes) and numeric feature columns; an image folder
one subfolder per class (torchvision's ``ImageFolder`` layout, classes in sorted order), each image
read as RGB, resized to ``dataset.image_size`` squared and scaled to [0, 1]. The classes are
0 … max label; the shape of one example is X's shape after its first dimension.

Privacy depends on which examples a run trained on, so the files are identified by their SHA-256,
recorded in the resolved configuration (``dataset.train_sha256``, ``dataset.test_sha256``) when
they are first read: a resume or a replay whose file changed is refused, as any changed key is.
"""

from __future__ import annotations

import functools
import hashlib
import os
from pathlib import Path

import numpy as np

from dpsgd.core.checks import fmt
from dpsgd.core.errors import ConfigError

# dataset.name values read from the user's files (dataset.train/test), or from a torchvision class
FILE_FORMATS = ("tensors", "csv", "imagefolder", "torchvision")
SUFFIXES = {"tensors": (".pt", ".pth", ".npz"), "csv": (".csv",), "imagefolder": None}


def _files(p: Path) -> list[Path]:
    return sorted(q for q in p.rglob("*") if q.is_file()) if p.is_dir() else [p]


def sha256(path: str) -> str:
    """SHA-256 of a file, or of a folder: every file's relative path and bytes, in sorted order.
    Hashed once per version of the files (their paths, sizes and modification times): validation
    checks it on every call, and reading uses it to remember what it read."""
    p = Path(path).resolve()
    version = tuple((str(f), f.stat().st_size, f.stat().st_mtime_ns) for f in _files(p))
    return _sha256(str(p), version)


@functools.lru_cache(maxsize=16)
def _sha256(path: str, version: tuple) -> str:
    h, p = hashlib.sha256(), Path(path)
    for f in _files(p):
        if p.is_dir():
            h.update(str(f.relative_to(p)).encode() + b"\0")
        with open(f, "rb") as fh:
            for block in iter(lambda: fh.read(1 << 20), b""):
                h.update(block)
    return h.hexdigest()


def read(path: str, fmt_name: str, label: str = "label", image_size: int = 32):
    """(X float32, y int64) numpy arrays of one file (or image folder); ConfigError naming it."""
    return _read(str(Path(path).resolve()), fmt_name, label, image_size, sha256(path))


@functools.lru_cache(maxsize=8)
def _read(path: str, fmt_name: str, label: str, image_size: int, digest: str):
    """``read``, remembered per content (validation and training read the same file)."""
    if fmt_name == "imagefolder":
        X, y = _read_images(path, image_size)
    elif path.endswith(".csv"):
        X, y = _read_csv(path, label)
    elif path.endswith(".npz"):
        with np.load(path) as z:
            if not {"X", "y"} <= set(z.files):
                raise ConfigError(f"dataset: {path} must hold arrays 'X' and 'y' (has {z.files})")
            X, y = z["X"], z["y"]
    else:
        X, y = _read_pt(path)
    X, y = np.asarray(X, dtype=np.float32), np.asarray(y)
    if y.ndim != 1 or X.shape[0] != y.shape[0] or X.shape[0] < 1:
        raise ConfigError(
            f"dataset: {path}: X has {X.shape[0]} rows and y shape {y.shape} (need one label each)"
        )
    if not np.issubdtype(y.dtype, np.integer) or y.min() < 0:
        raise ConfigError(f"dataset: {path}: labels must be integers >= 0 (classes 0..K-1)")
    return X, y.astype(np.int64)


def _read_pt(path: str):
    import torch

    obj = torch.load(path, map_location="cpu", weights_only=True)
    if isinstance(obj, dict) and {"X", "y"} <= set(obj):
        obj = (obj["X"], obj["y"])
    if not (isinstance(obj, (tuple, list)) and len(obj) == 2):
        raise ConfigError(f"dataset: {path} must hold (X, y) or {{'X': ..., 'y': ...}}")
    return tuple(t.numpy() if hasattr(t, "numpy") else np.asarray(t) for t in obj)


def _read_images(path: str, size: int):
    """An ImageFolder tree: one subfolder per class (sorted), each image RGB, size × size, [0,
    1]."""
    from PIL import Image

    classes = sorted(d.name for d in Path(path).iterdir() if d.is_dir())
    if not classes:
        raise ConfigError(f"dataset: {path} holds no class subfolders (ImageFolder layout)")
    xs, ys = [], []
    for k, name in enumerate(classes):
        for f in sorted(q for q in (Path(path) / name).rglob("*") if q.is_file()):
            try:
                with Image.open(f) as im:
                    rgb = im.convert("RGB").resize((size, size), Image.BILINEAR)
            except OSError:
                raise ConfigError(f"dataset: {f} is not an image") from None
            xs.append(np.asarray(rgb, dtype=np.float32).transpose(2, 0, 1) / 255.0)
            ys.append(k)
    if not xs:
        raise ConfigError(f"dataset: {path} holds no images")
    return np.stack(xs), np.asarray(ys, dtype=np.int64)


def _read_csv(path: str, label: str):
    import pandas as pd

    table = pd.read_csv(path)
    if label not in table.columns:
        raise ConfigError(
            f"dataset.label={label}: no such column in {path} (columns: {list(table.columns)})"
        )
    y = table.pop(label).to_numpy()
    bad = [c for c in table.columns if not np.issubdtype(table[c].dtype, np.number)]
    if bad:
        raise ConfigError(f"dataset: {path}: non-numeric feature columns {bad}; encode them first")
    return table.to_numpy(dtype=np.float32), y


def _check_digest(d, split: str, digest: str, what: str) -> None:
    want = getattr(d, f"{split}_sha256")
    if want is not None and want != digest:
        raise ConfigError(
            f"dataset.{split}_sha256={want}: {what} now has SHA-256 {digest}; the data changed"
        )
    setattr(d, f"{split}_sha256", digest)


def _check_torchvision(d) -> None:
    """dataset=torchvision: the class, the root, both splits read; their SHA-256 recorded."""
    from dpsgd.data import tvision

    for key in ("train", "test"):
        if getattr(d, key) is not None:
            raise ConfigError(f"dataset.{key}={fmt(getattr(d, key))}: dataset=torchvision reads "
                              "dataset.root (its files are the class's own)")  # fmt: skip
    if d.cls is None:
        raise ConfigError(
            "dataset.cls: dataset=torchvision needs a torchvision.datasets class name"
        )
    if not isinstance(d.root, str) or not os.path.isdir(d.root):
        raise ConfigError(f"dataset.root={fmt(d.root)}: no such folder (dataset=torchvision)")
    for split in ("train", "test"):
        _check_digest(d, split, tvision.read(d, split)[2], f"torchvision.datasets.{d.cls} {split}")


def check_files(d) -> None:
    """``dataset.train`` / ``dataset.test`` of a file dataset: readable files of its format, their
    SHA-256 recorded (or, when given, checked); dataset=torchvision: its class's two splits."""
    if d.name == "torchvision":
        return _check_torchvision(d)
    for split in ("train", "test"):
        path = getattr(d, split)
        key = f"dataset.{split}"
        if path is None:
            raise ConfigError(f"{key}: dataset={d.name} needs the path of its {split} file")
        folder = d.name == "imagefolder"
        if not isinstance(path, str) or not (os.path.isdir if folder else os.path.isfile)(path):
            raise ConfigError(f"{key}={fmt(path)}: no such {'folder' if folder else 'file'}")
        if not folder and not path.endswith(SUFFIXES[d.name]):
            raise ConfigError(f"{key}={path}: dataset={d.name} reads {', '.join(SUFFIXES[d.name])}")
        _check_digest(d, split, sha256(path), path)


def describe(d) -> tuple[str, int, int, int, tuple[int, ...]]:
    """(folder, training examples, test examples, classes, one example's shape) of a file dataset,
    from its files: the fields of ``datasets.Dataset``."""
    (Xtr, ytr), (Xte, yte) = _both(d)
    if Xtr.shape[1:] != Xte.shape[1:]:
        raise ConfigError(
            f"dataset.test={d.test}: examples of shape {Xte.shape[1:]}, the training examples "
            f"{Xtr.shape[1:]}"
        )
    classes = int(max(ytr.max(), yte.max())) + 1
    folder = d.root if d.name == "torchvision" else str(Path(d.train).parent)
    return folder, len(Xtr), len(Xte), classes, tuple(Xtr.shape[1:])


def _both(d):
    """((X, y) train, (X, y) test) numpy arrays of a file or torchvision dataset."""
    if d.name == "torchvision":
        from dpsgd.data import tvision

        return tuple(tvision.read(d, split)[:2] for split in ("train", "test"))
    return (
        read(d.train, d.name, d.label, d.image_size),
        read(d.test, d.name, d.label, d.image_size),
    )


def load_files(d):
    """(X_train, y_train, X_test, y_test) CPU tensors of a file dataset."""
    import torch

    (Xtr, ytr), (Xte, yte) = _both(d)
    return tuple(torch.from_numpy(a.copy()) for a in (Xtr, ytr, Xte, yte))
