"""Any torchvision dataset class by name: ``dataset=torchvision dataset.cls=NAME dataset.root=DIR``.

The class is looked up in ``torchvision.datasets`` and built twice, for the training and the test
split: with ``train=True``/``train=False`` (MNIST, FashionMNIST, CIFAR10, KMNIST, …), or, when
``dataset.train_split`` and ``dataset.test_split`` are given, with ``split=`` (SVHN: ``train``,
``test``). Nothing is downloaded unless ``dataset.download=true``. Every example is converted as the
other image datasets are: a PIL image (or array) to float32 [C, H, W] scaled to [0, 1] (uint8 / 255),
its label to int64; the classes are 0 … max label. What was trained on is identified by the SHA-256
of the converted arrays (``dataset.train_sha256``, ``dataset.test_sha256``): a resume or replay whose
data changed is refused, as for your own files (``files.py``).
"""

from __future__ import annotations

import difflib
import functools
import hashlib
from pathlib import Path

import numpy as np

from dpsgd.core.errors import ConfigError


def _class(name):
    try:
        from torchvision import datasets
    except ImportError:  # torchvision is in requirements.txt; a trimmed environment may lack it
        raise ConfigError(
            "dataset=torchvision: torchvision is not installed (pip install torchvision)"
        )
    names = [n for n in getattr(datasets, "__all__", dir(datasets)) if n[:1].isupper()]
    if not isinstance(name, str) or name not in names:
        close = difflib.get_close_matches(str(name), names, n=1)
        hint = f"; did you mean {close[0]}?" if close else f" (one of {', '.join(sorted(names))})"
        raise ConfigError(f"dataset.cls={name}: not a torchvision.datasets class{hint}")
    return getattr(datasets, name)


def _example(img) -> np.ndarray:
    """One image as float32 [C, H, W] in [0, 1] (uint8 / 255; floats kept)."""
    pil = hasattr(img, "convert")
    if pil and img.mode not in ("L", "RGB"):
        img = img.convert("RGB")
    a = img.numpy() if hasattr(img, "numpy") else np.asarray(img)
    if a.ndim == 2:
        a = a[None]
    elif a.ndim == 3 and pil:
        a = a.transpose(2, 0, 1)  # PIL: H × W × C
    return a.astype(np.float32) / 255.0 if a.dtype == np.uint8 else a.astype(np.float32)


def read(d, split: str):
    """(X float32, y int64, SHA-256 of both) of the ``split`` ("train" or "test") of ``d``."""
    return _read(
        d.cls, str(Path(d.root).resolve()), split, d.train_split, d.test_split, bool(d.download)
    )


@functools.lru_cache(maxsize=4)
def _read(name, root, split, train_split, test_split, download):
    cls = _class(name)
    by_split = train_split is not None or test_split is not None
    if by_split and (train_split is None or test_split is None):
        raise ConfigError(
            "dataset.train_split / dataset.test_split: give both (the split names the class "
            "takes, e.g. train and test), or neither (train=True/False)"
        )
    kw = (
        {"split": train_split if split == "train" else test_split}
        if by_split
        else {"train": split == "train"}
    )
    try:
        ds = cls(root=root, download=download, **kw)
    except TypeError as e:
        raise ConfigError(
            f"dataset.cls={name}: {' '.join(str(e).split())}; set dataset.train_split and "
            "dataset.test_split to the split names it takes"
        ) from None
    except RuntimeError as e:  # torchvision: "Dataset not found or corrupted ..."
        raise ConfigError(
            f"dataset.root={root}: torchvision.datasets.{name} found no {split} data there "
            f"({' '.join(str(e).split())}); place its files there, or set dataset.download=true "
            "on a machine with internet"
        ) from None
    xs, ys = [], []
    for img, target in ds:
        xs.append(_example(img))
        ys.append(int(target))
    if not xs:
        raise ConfigError(
            f"dataset.root={root}: torchvision.datasets.{name} has no {split} examples"
        )
    X, y = np.stack(xs), np.asarray(ys, dtype=np.int64)
    if y.min() < 0:
        raise ConfigError(f"dataset.cls={name}: labels must be integers >= 0")
    h = hashlib.sha256(np.ascontiguousarray(X).tobytes())
    h.update(y.tobytes())
    return X, y, h.hexdigest()
