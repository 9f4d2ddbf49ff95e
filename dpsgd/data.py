"""Datasets as in-memory tensors, and seeding of the project's data root.

``load_dataset(name, root)`` returns ``X_train, y_train, X_test, y_test``:

* ``mnist``, ``fashion_mnist``: float32 in [0, 1] (pixel / 255, as in the paper's code), flattened to
  784; read straight from the original IDX ``.gz`` archives under ``<root>/MNIST/raw`` (torchvision's
  layout).
* ``cifar10``, ``cifar100``: NCHW float32 in [0, 1] from torchvision's pickled layout
  (``cifar-10-batches-py``, ``cifar-100-python``), center-cropped to ``crop`` × ``crop`` (24 in the
  paper's CIFAR setup, §5.3; ``crop=None`` keeps 32 × 32).

The data root is ``dataset.root`` in the config, else ``$DPSGD_DATA_ROOT``, else ``<repo>/data``.
When it lacks the archives and a local source holds them (``$DPSGD_DATA_SOURCE``, else
``<repo>/../shared/data`` when that exists) they are copied in (md5-checked; the source is only
read); otherwise torchvision downloads them. ``python -m dpsgd.data`` seeds the root.
"""
from __future__ import annotations

import argparse
import gzip
import hashlib
import io
import os
import pickle
import shutil
import sys
import tarfile
from pathlib import Path

import numpy as np
import torch

REPO = Path(__file__).resolve().parent.parent

# name -> (folder under root, train size, test size, classes, input shape)
DATASETS = {
    "mnist": ("MNIST", 60000, 10000, 10, (784,)),
    "fashion_mnist": ("FashionMNIST", 60000, 10000, 10, (784,)),
    "cifar10": ("cifar-10-batches-py", 50000, 10000, 10, (3, 32, 32)),
    "cifar100": ("cifar-100-python", 50000, 10000, 100, (3, 32, 32)),
}

# The original archives and their publishers' md5 (the same as torchvision.datasets.MNIST.resources).
_IDX_FILES = {
    "mnist": {
        "train-images-idx3-ubyte.gz": "f68b3c2dcbeaaa9fbdd348bbdeb94873",
        "train-labels-idx1-ubyte.gz": "d53e105ee54ea40749a09fcbcd1e9432",
        "t10k-images-idx3-ubyte.gz": "9fb629c4189551a2d022fa330f9573f3",
        "t10k-labels-idx1-ubyte.gz": "ec29112dd5afa0611ce80d1b7f02629c",
    },
    "fashion_mnist": {
        "train-images-idx3-ubyte.gz": "8d4fb7e6c68d591d4c3dfef9ec88bf0d",
        "train-labels-idx1-ubyte.gz": "25c81989df183df01b3e8a0aad5dffbe",
        "t10k-images-idx3-ubyte.gz": "bef4ecab320f06d8554ea6380940ec79",
        "t10k-labels-idx1-ubyte.gz": "bb300cfdad3c16e7a12a480ee83cd310",
    },
}
_CIFAR_ARCHIVES = {"cifar10": "cifar-10-python.tar.gz", "cifar100": "cifar-100-python.tar.gz"}


class DataUnavailable(ValueError):
    """The dataset is neither in the data root, nor in a local source, nor downloadable."""


def dataset_info(name: str) -> dict:
    folder, n_train, n_test, classes, shape = DATASETS[name]
    return {"folder": folder, "n_train": n_train, "n_test": n_test, "classes": classes, "shape": shape}


def input_shape(name: str, crop: int | None = 24) -> tuple[int, ...]:
    shape = DATASETS[name][4]
    if len(shape) == 3 and crop:
        return (shape[0], int(crop), int(crop))
    return shape


def default_root() -> Path:
    return Path(os.environ.get("DPSGD_DATA_ROOT") or REPO / "data")


def default_source() -> Path | None:
    src = os.environ.get("DPSGD_DATA_SOURCE")
    if src:
        return Path(src)
    shared = REPO.parent / "shared" / "data"
    return shared if shared.is_dir() else None


def _md5(path: Path) -> str:
    h = hashlib.md5()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def _copy_atomic(src: Path, dst: Path) -> None:
    dst.parent.mkdir(parents=True, exist_ok=True)
    tmp = dst.with_name(f".{dst.name}.tmp{os.getpid()}")
    shutil.copyfile(src, tmp)
    with open(tmp, "rb+") as f:
        os.fsync(f.fileno())
    os.replace(tmp, dst)


def _present(name: str, root: Path) -> bool:
    folder = root / DATASETS[name][0]
    if name in _IDX_FILES:
        return all((folder / "raw" / f).is_file() for f in _IDX_FILES[name])
    need = ["data_batch_1", "data_batch_5", "test_batch"] if name == "cifar10" else ["train", "test"]
    return all((folder / f).is_file() for f in need)


def ensure_dataset(name: str, root: str | Path | None = None, source: str | Path | None = None,
                   download: bool = True) -> str:
    """Make ``name`` available under ``root``; returns a one-line account of what was done."""
    if name not in DATASETS:
        raise ValueError(f"dataset.name={name!r}: must be one of {sorted(DATASETS)}")
    root = Path(root) if root else default_root()
    source = Path(source) if source else default_source()
    if _present(name, root):
        return f"{name}: present in {root}"
    folder = DATASETS[name][0]
    if source is not None and source.resolve() != root.resolve():
        if name in _IDX_FILES:
            src = source / folder / "raw"
            if all((src / f).is_file() for f in _IDX_FILES[name]):
                for f, md5 in _IDX_FILES[name].items():
                    dst = root / folder / "raw" / f
                    if not dst.is_file():
                        _copy_atomic(src / f, dst)
                    if _md5(dst) != md5:
                        dst.unlink()
                        raise DataUnavailable(f"dataset.root={root}: {f} copied from DPSGD_DATA_SOURCE={source} "
                                              "fails its md5 check")
                return f"{name}: copied {len(_IDX_FILES[name])} archives from {src} to {root / folder / 'raw'}"
        else:
            if (source / folder).is_dir() and _present(name, source):
                shutil.copytree(source / folder, root / folder, dirs_exist_ok=True)
                return f"{name}: copied {source / folder} to {root / folder}"
            archive = source / _CIFAR_ARCHIVES[name]
            if archive.is_file():
                _copy_atomic(archive, root / archive.name)
                with tarfile.open(root / archive.name, "r:gz") as tar:
                    tar.extractall(root, filter="data")
                return f"{name}: copied {archive} to {root} and extracted it"
    if download:
        try:
            import torchvision.datasets as tvd
            cls = {"mnist": tvd.MNIST, "fashion_mnist": tvd.FashionMNIST,
                   "cifar10": tvd.CIFAR10, "cifar100": tvd.CIFAR100}[name]
            cls(str(root), train=True, download=True)
            cls(str(root), train=False, download=True)
        except Exception as e:  # no network, mirror down, ...
            reason = str(e).splitlines()[0] if str(e) else type(e).__name__
            raise DataUnavailable(
                f"dataset.root={root}: {name} not found there, nor under DPSGD_DATA_SOURCE={source}, "
                f"and the download failed ({reason})") from None
        if _present(name, root):
            return f"{name}: downloaded to {root}"
    raise DataUnavailable(f"dataset.root={root}: {name} not found there, nor under DPSGD_DATA_SOURCE={source}"
                          + ("" if download else ", and downloads are off (dataset.download=false)"))


def _read_idx(path: Path) -> np.ndarray:
    """An IDX file (LeCun et al.'s MNIST format): magic, dims (big-endian int32), then uint8 data."""
    with gzip.open(path, "rb") as f:
        data = f.read()
    ndim = data[3]
    dims = np.frombuffer(data, dtype=">i4", count=ndim, offset=4)
    return np.frombuffer(data, dtype=np.uint8, offset=4 + 4 * ndim).reshape(tuple(int(d) for d in dims))


def _idx_array(path: Path) -> np.ndarray:
    """The uint8 array of an IDX archive, cached as .npy next to it (decompressing takes seconds)."""
    cache = path.with_name(f".{path.name}.npy")
    if cache.is_file() and cache.stat().st_mtime >= path.stat().st_mtime:
        try:
            return np.load(cache, mmap_mode="r")
        except (OSError, ValueError):
            pass
    arr = _read_idx(path)
    try:
        buf = io.BytesIO()
        np.save(buf, arr)
        tmp = cache.with_name(cache.name + f".tmp{os.getpid()}")
        tmp.write_bytes(buf.getvalue())
        os.replace(tmp, cache)
    except OSError:  # a read-only root: no cache
        pass
    return arr


def _load_idx(name: str, root: Path, subset: int | None = None):
    raw = root / DATASETS[name][0] / "raw"
    out = []
    for split, n in (("train", subset), ("t10k", None)):
        x = _idx_array(raw / f"{split}-images-idx3-ubyte.gz")[:n]
        y = _idx_array(raw / f"{split}-labels-idx1-ubyte.gz")[:n]
        out += [torch.from_numpy(x.reshape(len(x), -1).astype(np.float32) / 255.0),
                torch.from_numpy(y.astype(np.int64))]
    return tuple(out)


def _load_cifar(name: str, root: Path, crop: int | None):
    folder = root / DATASETS[name][0]
    if name == "cifar10":
        train_files, test_files, key = [f"data_batch_{i}" for i in range(1, 6)], ["test_batch"], b"labels"
    else:
        train_files, test_files, key = ["train"], ["test"], b"fine_labels"

    def read(files):
        xs, ys = [], []
        for f in files:
            with open(folder / f, "rb") as fh:
                d = pickle.load(fh, encoding="bytes")
            xs.append(np.asarray(d[b"data"], dtype=np.uint8).reshape(-1, 3, 32, 32))
            ys.append(np.asarray(d[key], dtype=np.int64))
        x = torch.from_numpy(np.concatenate(xs).astype(np.float32) / 255.0)
        if crop:
            if not 1 <= crop <= 32:
                raise ValueError(f"dataset.crop={crop}: must be in [1, 32]")
            off = (32 - crop) // 2
            x = x[:, :, off:off + crop, off:off + crop].contiguous()
        return x, torch.from_numpy(np.concatenate(ys))

    return (*read(train_files), *read(test_files))


def load_dataset(name: str, root: str | Path | None = None, subset: int | None = None,
                 crop: int | None = 24, download: bool = True, source: str | Path | None = None):
    """(X_train, y_train, X_test, y_test) as CPU tensors; ``subset`` keeps the first n training examples."""
    root = Path(root) if root else default_root()
    ensure_dataset(name, root, source=source, download=download)
    if name in _IDX_FILES:
        xtr, ytr, xte, yte = _load_idx(name, root, subset)
    else:
        xtr, ytr, xte, yte = _load_cifar(name, root, crop)
    if subset is not None:
        xtr, ytr = xtr[:subset].contiguous(), ytr[:subset].contiguous()
    return xtr, ytr, xte, yte


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m dpsgd.data",
                                description="Seed the data root from a local source (or download).")
    p.add_argument("names", nargs="*", metavar="NAME",
                   help=f"datasets among {sorted(DATASETS)} (default: mnist fashion_mnist)")
    p.add_argument("--root", default=None, help="data root (default $DPSGD_DATA_ROOT or <repo>/data)")
    p.add_argument("--source", default=None, help="local source (default $DPSGD_DATA_SOURCE or ../shared/data)")
    p.add_argument("--no-download", action="store_true", help="never use the network")
    a = p.parse_args(argv)
    status = 0
    for name in a.names or ["mnist", "fashion_mnist"]:
        if name not in DATASETS:
            print(f"error: {name!r}: unknown dataset, must be one of {sorted(DATASETS)}", file=sys.stderr)
            status = 2
            continue
        try:
            print(ensure_dataset(name, a.root, a.source, download=not a.no_download))
        except DataUnavailable as e:
            print(f"error: {e}", file=sys.stderr)
            status = 2
    return status


if __name__ == "__main__":
    sys.exit(main())
