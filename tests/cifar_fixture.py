"""Small CIFAR-10 / CIFAR-100 datasets in the exact on-disk formats torchvision reads.

``cifar-10-batches-py/``: ``data_batch_1`` … ``data_batch_5``, ``test_batch`` (pickled dicts with
``b'batch_label'``, ``b'labels'`` (list of int), ``b'data'`` (uint8 N×3072, row-major RGB planes of
32×32), ``b'filenames'``) and ``batches.meta`` (``b'num_cases_per_batch'``, ``b'label_names'``,
``b'num_vis'``). ``cifar-100-python/``: ``train``, ``test`` (``b'filenames'``, ``b'batch_label'``,
``b'fine_labels'``, ``b'coarse_labels'``, ``b'data'``) and ``meta`` (``b'fine_label_names'``,
``b'coarse_label_names'``). Pickle protocol 2 with bytes keys, as the publisher's Python-2 pickles
load with ``encoding="bytes"``.

Classes are learnable by a small network after random 24×24 crops, flips and per-image
standardisation: class c has its own colour (the ratio of the RGB planes) and horizontal stripes of
its own period, plus pixel noise. Generated files cannot match the publisher's md5: ``trust``
registers theirs in ``dpsgd.data.datasets.EXPECTED_MD5`` (monkeypatch, the documented test-only
escape hatch).
"""

from __future__ import annotations

import pickle
from pathlib import Path

import numpy as np

from dpsgd.data import datasets as data
from dpsgd.data.archives import _md5_of


def images(labels: np.ndarray, classes: int, rng: np.random.Generator) -> np.ndarray:
    """uint8 [N, 3072] images of the given labels (class structure as in the module docstring)."""
    palette = np.random.default_rng(1234).uniform(0.15, 0.85, size=(classes, 3))
    period = 3 + np.arange(classes) % 7  # stripes every 3..9 rows
    rows = np.arange(32)
    stripes = (np.sin(2 * np.pi * rows[None, :] / period[:, None]) > 0).astype(
        np.float64
    )  # [classes, 32]
    img = (
        palette[labels][:, :, None, None]
        * (0.6 + 0.4 * stripes[labels][:, None, :, None])
        * np.ones((1, 1, 1, 32))
    )
    img = img + rng.normal(0, 0.08, size=img.shape)
    return (np.clip(img, 0, 1) * 255).round().astype(np.uint8).reshape(len(labels), 3072)


def _dump(path: Path, obj: dict) -> None:
    with open(path, "wb") as f:
        pickle.dump(obj, f, protocol=2)


def write_cifar10(root: Path, n_train: int = 1000, n_test: int = 500, seed: int = 0) -> Path:
    """``root/cifar-10-batches-py`` with n_train examples over the five training batches."""
    rng = np.random.default_rng(seed)
    folder = Path(root) / "cifar-10-batches-py"
    folder.mkdir(parents=True, exist_ok=True)
    sizes = [n_train // 5 + (i < n_train % 5) for i in range(5)]
    for name, n in [(f"data_batch_{i + 1}", s) for i, s in enumerate(sizes)] + [
        ("test_batch", n_test)
    ]:
        labels = rng.integers(0, 10, size=n)
        _dump(
            folder / name,
            {
                b"batch_label": f"{name} (synthetic)".encode(),
                b"labels": labels.tolist(),
                b"data": images(labels, 10, rng),
                b"filenames": [f"synthetic_{name}_{i}.png".encode() for i in range(n)],
            },
        )
    _dump(
        folder / "batches.meta",
        {
            b"num_cases_per_batch": sizes[0],
            b"num_vis": 3072,
            b"label_names": [f"class{c}".encode() for c in range(10)],
        },
    )
    return folder


def write_cifar100(root: Path, n_train: int = 500, n_test: int = 200, seed: int = 1) -> Path:
    """``root/cifar-100-python`` (fine labels 0..99, coarse label = fine // 5)."""
    rng = np.random.default_rng(seed)
    folder = Path(root) / "cifar-100-python"
    folder.mkdir(parents=True, exist_ok=True)
    for name, n in (("train", n_train), ("test", n_test)):
        fine = rng.integers(0, 100, size=n)
        _dump(
            folder / name,
            {
                b"filenames": [f"synthetic_{name}_{i}.png".encode() for i in range(n)],
                b"batch_label": f"{name} (synthetic)".encode(),
                b"fine_labels": fine.tolist(),
                b"coarse_labels": (fine // 5).tolist(),
                b"data": images(fine, 100, rng),
            },
        )
    _dump(
        folder / "meta",
        {
            b"fine_label_names": [f"fine{c}".encode() for c in range(100)],
            b"coarse_label_names": [f"coarse{c}".encode() for c in range(20)],
        },
    )
    return folder


def trust(monkeypatch, root: Path, names=("cifar10", "cifar100")) -> None:
    """Register the generated files' md5 in dpsgd.data.datasets.EXPECTED_MD5 (this test only)."""
    for name in names:
        folder = Path(root) / data.DATASETS[name][0]
        for rel in data.EXPECTED_MD5[name]:
            monkeypatch.setitem(data.EXPECTED_MD5[name], rel, _md5_of(folder / rel))
