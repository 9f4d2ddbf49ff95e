"""Your own data from files: ``dataset=tensors`` (``.pt`` or ``.npz``), ``dataset=csv`` and
``dataset=imagefolder``; and any torchvision class (``dataset=torchvision``, ``tvision.py``).

``dataset.train`` and ``dataset.test`` name the files. A ``.pt`` file holds ``(X, y)`` or
``{"X": ..., "y": ...}`` (``torch.save``, read with ``weights_only=True``); an ``.npz`` file arrays
``X`` and ``y`` (numeric, read without pickle); a CSV a header, the label column ``dataset.label``
and numeric feature columns; an image folder one subfolder per class (torchvision's
``ImageFolder`` layout), each image read as RGB, resized to ``dataset.image_size`` squared and
scaled to [0, 1]. The shape of one example is X's shape after its first dimension.

Classes: integer labels are the classes 0 … max label, the same numbers in both files. Named
classes (an image folder's subfolders, a CSV's or an array's text labels) are matched by *name*
across the training and the test file, numbered in the sorted order of the training file's names,
and recorded in the resolved configuration (``dataset.classes``); a test class the training file
lacks, and a class folder without an image, are refused in one line (trees with different class
lists were paired by position: a class's test images scored against another class). A file that
cannot be read (refused by ``weights_only``, object arrays, text feature columns, an empty table,
missing values) is one line naming it, never a traceback.

Privacy depends on which examples a run trained on, so the files are identified by their SHA-256,
recorded in the resolved configuration (``dataset.train_sha256``, ``dataset.test_sha256``) when
they are first read: a resume or a replay whose file changed is refused, as any changed key is.
"""

from __future__ import annotations

import functools
import hashlib
import os
import re
from pathlib import Path

import numpy as np

from dpsgd.core.checks import choice, fmt
from dpsgd.core.errors import ConfigError

# dataset.name values read from the user's files (dataset.train/test), or from a torchvision class
FILE_FORMATS = ("tensors", "csv", "imagefolder", "torchvision")
DTYPES = ("float32", "int64")  # dataset.dtype: X as read (int64: token ids)
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
    """(X float32, y, names) numpy arrays of one file (or image folder): y int64 classes, indices
    into ``names`` (a tuple of class names) where the classes are named, else their own numbers
    (``names`` None); ConfigError naming the file."""
    return _read(str(Path(path).resolve()), fmt_name, label, image_size, sha256(path))


@functools.lru_cache(maxsize=8)
def _read(path: str, fmt_name: str, label: str, image_size: int, digest: str):
    """``read``, remembered per content (validation and training read the same file)."""
    if fmt_name == "imagefolder":
        X, y = _read_images(path, image_size)
    elif path.endswith(".csv"):
        X, y = _read_csv(path, label)
    elif path.endswith(".npz"):
        X, y = _read_npz(path)
    else:
        X, y = _read_pt(path)
    try:
        X = np.asarray(X, dtype=np.float32)
    except (TypeError, ValueError):
        raise ConfigError(f"dataset: {path}: X is not an array of numbers") from None
    y = np.asarray(y)
    if y.ndim != 1 or X.ndim < 2 or X.shape[0] != y.shape[0] or X.shape[0] < 1:
        raise ConfigError(
            f"dataset: {path}: X has shape {X.shape} and y shape {y.shape} (need one label per "
            "example, and at least one example)"
        )
    if not np.isfinite(X).all():
        raise ConfigError(f"dataset: {path}: X holds NaN or infinite values")
    y, names = _labels(path, y)
    return X, y, names


def _labels(path: str, y: np.ndarray):
    """(classes int64, names or None): text labels named (sorted), integers as they are."""
    if y.dtype.kind in "USO":
        if y.dtype.kind == "O" and not all(isinstance(v, str) for v in y):
            raise ConfigError(f"dataset: {path}: labels must be integers >= 0 or class names")
        names, idx = np.unique(y.astype(str), return_inverse=True)
        return idx.astype(np.int64), tuple(str(n) for n in names)
    if y.dtype.kind == "f" and np.all(np.isfinite(y)) and np.all(y == np.round(y)):
        y = y.astype(np.int64)  # 0.0, 1.0, ...: integers written as floats
    if not np.issubdtype(y.dtype, np.integer) or y.min() < 0:
        raise ConfigError(f"dataset: {path}: labels must be integers >= 0 (classes 0..K-1)")
    return y.astype(np.int64), None


def _read_pt(path: str):
    import pickle

    import torch

    try:
        obj = torch.load(path, map_location="cpu", weights_only=True)
    except pickle.UnpicklingError as e:
        what = re.search(r"Unsupported global: GLOBAL (\S+)", str(e))
        held = f"it holds {what.group(1)}" if what else "it holds Python objects"
        raise ConfigError(
            f"dataset: {path}: refused by torch.load(weights_only=True) ({held}); save plain "
            "tensors: torch.save((X, y), path)"
        ) from None
    except (RuntimeError, EOFError, OSError, ValueError) as e:
        why = " ".join(str(e).split())[:100] or type(e).__name__
        raise ConfigError(f"dataset: {path}: not a readable torch file ({why})") from None
    if isinstance(obj, dict) and {"X", "y"} <= set(obj):
        obj = (obj["X"], obj["y"])
    if not (isinstance(obj, (tuple, list)) and len(obj) == 2):
        raise ConfigError(f"dataset: {path} must hold (X, y) or {{'X': ..., 'y': ...}}")
    return tuple(t.numpy() if hasattr(t, "numpy") else np.asarray(t) for t in obj)


def _read_npz(path: str):
    import zipfile

    try:
        with np.load(path, allow_pickle=False) as z:
            if not {"X", "y"} <= set(z.files):
                raise ConfigError(f"dataset: {path} must hold arrays 'X' and 'y' (has {z.files})")
            return z["X"], z["y"]
    except ValueError as e:
        if "allow_pickle" not in str(e):
            raise ConfigError(f"dataset: {path}: not a readable .npz ({e})") from None
        raise ConfigError(
            f"dataset: {path}: X or y holds Python objects, which are not loaded (pickle is "
            "off); save numeric arrays (or text labels)"
        ) from None
    except (OSError, EOFError, zipfile.BadZipFile) as e:
        raise ConfigError(f"dataset: {path}: not a readable .npz ({type(e).__name__})") from None


def _read_images(path: str, size: int):
    """An ImageFolder tree: one subfolder per class, each image RGB, size × size, [0, 1]; the
    labels are the class names (matched by name across trees: ``_both``)."""
    from PIL import Image

    classes = sorted(d.name for d in Path(path).iterdir() if d.is_dir())
    if not classes:
        raise ConfigError(f"dataset: {path} holds no class subfolders (ImageFolder layout)")
    xs, ys = [], []
    for name in classes:
        files = sorted(q for q in (Path(path) / name).rglob("*") if q.is_file())
        if not files:
            raise ConfigError(
                f"dataset: {Path(path) / name}: a class folder with no image (remove it, or add "
                "its images)"
            )
        for f in files:
            try:
                with Image.open(f) as im:
                    rgb = im.convert("RGB").resize((size, size), Image.BILINEAR)
            except OSError:
                raise ConfigError(f"dataset: {f} is not an image") from None
            xs.append(np.asarray(rgb, dtype=np.float32).transpose(2, 0, 1) / 255.0)
            ys.append(name)
    return np.stack(xs), np.asarray(ys, dtype=str)


def _read_csv(path: str, label: str):
    import pandas as pd

    try:
        table = pd.read_csv(path)
    except (pd.errors.EmptyDataError, pd.errors.ParserError, UnicodeDecodeError) as e:
        why = " ".join(str(e).split())[:100]
        raise ConfigError(f"dataset: {path}: not a readable CSV table ({why})") from None
    if label not in table.columns:
        raise ConfigError(
            f"dataset.label={label}: no such column in {path} (columns: {list(table.columns)})"
        )
    if table.empty:
        raise ConfigError(f"dataset: {path}: the table holds no rows")
    y = table.pop(label)
    bad = [
        c
        for c in table.columns
        if not pd.api.types.is_numeric_dtype(table[c]) or pd.api.types.is_bool_dtype(table[c])
    ]
    if bad:
        raise ConfigError(f"dataset: {path}: non-numeric feature columns {bad}; encode them first")
    missing = [c for c in [*table.columns, label] if (y if c == label else table[c]).isna().any()]
    if missing:
        raise ConfigError(f"dataset: {path}: missing values in columns {missing}")
    labels = y.to_numpy(dtype=str) if not pd.api.types.is_numeric_dtype(y) else y.to_numpy()
    return table.to_numpy(dtype=np.float32), labels


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
    names = _both(d)[2]  # read (and remembered), the classes matched by name
    given = None if d.classes is None else [str(c) for c in d.classes]
    if given is not None and given != (None if names is None else list(names)):
        raise ConfigError(
            f"dataset.classes={given}: the files' classes are "
            f"{None if names is None else list(names)}; the data changed"
        )
    d.classes = None if names is None else list(names)


def describe(d) -> tuple[str, int, int, int, tuple[int, ...]]:
    """(folder, training examples, test examples, classes, one example's shape) of a file dataset,
    from its files: the fields of ``datasets.Dataset``."""
    (Xtr, ytr), (Xte, yte), names = _both(d)
    if Xtr.shape[1:] != Xte.shape[1:]:
        raise ConfigError(
            f"dataset.test={d.test}: examples of shape {Xte.shape[1:]}, the training examples "
            f"{Xtr.shape[1:]}"
        )
    classes = len(names) if names is not None else int(max(ytr.max(), yte.max())) + 1
    folder = d.root if d.name == "torchvision" else str(Path(d.train).parent)
    return folder, len(Xtr), len(Xte), classes, tuple(Xtr.shape[1:])


def _both(d):
    """((X, y) train, (X, y) test, class names or None) numpy arrays of a file or torchvision
    dataset, the test labels numbered as the training file's classes (by name where named)."""
    if d.name == "torchvision":
        from dpsgd.data import tvision

        return (*(tvision.read(d, split)[:2] for split in ("train", "test")), None)
    Xtr, ytr, ntr = read(d.train, d.name, d.label, d.image_size)
    Xte, yte, nte = read(d.test, d.name, d.label, d.image_size)
    if (ntr is None) != (nte is None):
        kind = lambda n: "class names" if n is not None else "integer classes"  # noqa: E731
        raise ConfigError(
            f"dataset.test={d.test}: its labels are {kind(nte)}, the training file's "
            f"{kind(ntr)}; give both the same kind"
        )
    if ntr is not None:
        unknown = sorted(set(nte) - set(ntr))
        if unknown:
            raise ConfigError(
                f"dataset.test={d.test}: class(es) {unknown} are not classes of dataset.train "
                f"({list(ntr)}); classes are matched by name"
            )
        index = {n: i for i, n in enumerate(ntr)}
        yte = np.asarray([index[nte[k]] for k in yte], dtype=np.int64)
    return (Xtr, ytr), (Xte, yte), ntr


def load_files(d):
    """(X_train, y_train, X_test, y_test) CPU tensors of a file dataset; X as ``dataset.dtype``
    (int64: token ids, read exactly: every value an integer below 2^24, checked)."""
    import torch

    (Xtr, ytr), (Xte, yte), _ = _both(d)
    if getattr(d, "dtype", "float32") == "int64":
        Xtr, Xte = (X.astype(np.int64) for X in (Xtr, Xte))
    return tuple(torch.from_numpy(a.copy()) for a in (Xtr, ytr, Xte, yte))


def check_dtype(d) -> None:
    """``dataset.dtype``: float32, or int64 for examples that are integers (token ids), each
    exact in the float32 the files are read as (|x| < 2^24)."""
    choice("dataset.dtype", d.dtype, DTYPES)
    if d.dtype == "float32":
        return
    if d.name not in ("tensors", "csv"):
        raise ConfigError(f"dataset.dtype={d.dtype}: dataset=tensors|csv only (token ids)")
    for split, (X, _) in zip(("train", "test"), _both(d)[:2]):
        if not (np.all(X == np.round(X)) and np.all(np.abs(X) < 2**24)):
            raise ConfigError(
                f"dataset.dtype=int64: dataset.{split}={getattr(d, split)} holds values that are "
                "not integers below 2^24 (token ids)"
            )
