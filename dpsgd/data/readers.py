"""Reading the dataset files into tensors: IDX archives (MNIST, Fashion-MNIST), CIFAR pickles,
``load_dataset``.

``load_dataset(name, root)`` returns ``X_train, y_train, X_test, y_test``:

* ``mnist``, ``fashion_mnist``: float32 in [0, 1] (pixel / 255, as in the paper's code), flattened
  to 784; read straight from the original IDX ``.gz`` archives under ``<root>/MNIST/raw``
  (torchvision's layout).
* ``cifar10``, ``cifar100``: NCHW float32 in [0, 1] from torchvision's pickled layout
  (``cifar-10-batches-py``, ``cifar-100-python``), center-cropped to ``crop`` × ``crop`` (24 in the
  paper's CIFAR setup, §5.3; ``crop=None`` keeps 32 × 32).

It first makes the dataset available under the root, every file md5-verified (``ensure_dataset`` in
``dpsgd/data/archives.py``). The ``.npy`` decompression cache of an IDX archive is named after the
archive's md5 and used only when it re-encodes to the CRC-32 and length recorded in the verified
archive's gzip trailer. A file that cannot be read is one line naming it (``DataUnavailable``).
"""

from __future__ import annotations

import gzip
import io
import os
import pickle
import struct
import zlib
from pathlib import Path

import numpy as np
import torch

from dpsgd.data.archives import _memo, _reason, default_root, ensure_dataset
from dpsgd.data.augment import CROP
from dpsgd.data.datasets import DATASETS, EXPECTED_MD5, DataUnavailable

_IDX = ("mnist", "fashion_mnist")


def _read_idx(path: Path) -> np.ndarray:
    """An IDX file (LeCun et al.'s MNIST format): magic 0 0 8 ndim, dims (big-endian int32), then
    uint8 data."""
    try:
        with gzip.open(path, "rb") as f:
            data = f.read()
    except (OSError, EOFError, zlib.error) as e:  # BadGzipFile is an OSError
        raise DataUnavailable(
            f"{path}: cannot be decompressed ({_reason(e)}); delete it and re-seed "
            "with python -m dpsgd.data"
        ) from None
    ndim = data[3] if len(data) >= 4 and data[:3] == b"\x00\x00\x08" else 0
    dims = (
        np.frombuffer(data, dtype=">i4", count=ndim, offset=4)
        if len(data) >= 4 + 4 * ndim
        else None
    )
    if not ndim or dims is None or len(data) != 4 + 4 * ndim + int(np.prod(dims, dtype=np.int64)):
        raise DataUnavailable(
            f"{path}: not a uint8 IDX file (bad header or length); delete it and re-seed "
            "with python -m dpsgd.data"
        )
    return np.frombuffer(data, dtype=np.uint8, offset=4 + 4 * ndim).reshape(
        tuple(int(d) for d in dims)
    )


def _gzip_trailer(path: Path) -> tuple[int, int]:
    """(CRC-32, length mod 2^32) of the uncompressed data, from the gzip trailer (RFC 1952
    §2.3.1)."""
    with open(path, "rb") as f:
        f.seek(-8, os.SEEK_END)
        return struct.unpack("<II", f.read(8))


def _idx_crc(arr: np.ndarray) -> tuple[int, int]:
    """(CRC-32, length mod 2^32) of the IDX file that holds ``arr``: its header, then its bytes."""
    header = bytes([0, 0, 8, arr.ndim]) + np.asarray(arr.shape, dtype=">i4").tobytes()
    crc = zlib.crc32(memoryview(np.ascontiguousarray(arr)).cast("B"), zlib.crc32(header))
    return crc, (len(header) + arr.nbytes) % (1 << 32)


def _idx_array(path: Path, md5: str) -> np.ndarray:
    """The uint8 array of an md5-verified IDX archive, cached as .npy next to it (decompressing is
    slow).

    The cache is named after the archive's md5 and used only when its array re-encodes to the IDX
    data the archive's gzip trailer describes (CRC-32 and length); otherwise it is rebuilt from the
    archive.
    """
    cache = path.with_name(f".{path.name}.{md5}.npy")
    try:
        expected = _gzip_trailer(path)
    except OSError:  # shorter than a gzip trailer: _read_idx says what is wrong
        return _read_idx(path)
    if cache.is_file():
        try:
            arr = np.load(cache, mmap_mode="r", allow_pickle=False)
            if (
                arr.dtype == np.uint8
                and _memo("idx-crc", cache, lambda _: _idx_crc(arr)) == expected
            ):
                return arr
        except (OSError, ValueError):
            pass
    arr = _read_idx(path)
    if (
        _idx_crc(arr) != expected
    ):  # a multi-member gzip: its trailer covers only the last member; no cache
        return arr
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
    folder = root / DATASETS[name].folder
    out = []
    for split, n in (("train", subset), ("t10k", None)):
        arrays = []
        for kind in ("images-idx3", "labels-idx1"):
            rel = f"raw/{split}-{kind}-ubyte.gz"
            arrays.append(_idx_array(folder / rel, EXPECTED_MD5[name][rel])[:n])
        x, y = arrays
        if len(x) != len(y):
            raise DataUnavailable(
                f"{folder / 'raw'}: {split} images and labels differ in number "
                f"({len(x)} vs {len(y)})"
            )
        pixels = x.reshape(len(x), -1).astype(np.float32)
        pixels /= 255.0  # in place: the same float32 division, one 188 MB buffer fewer
        out += [torch.from_numpy(pixels), torch.from_numpy(y.astype(np.int64))]
    return tuple(out)


def _load_cifar(name: str, root: Path, crop: int | None):
    folder = root / DATASETS[name].folder
    if name == "cifar10":
        train_files, test_files, key = (
            [f"data_batch_{i}" for i in range(1, 6)],
            ["test_batch"],
            b"labels",
        )
    else:
        train_files, test_files, key = ["train"], ["test"], b"fine_labels"

    def read(files):
        xs, ys = [], []
        for f in files:
            try:
                with open(folder / f, "rb") as fh:
                    d = pickle.load(fh, encoding="bytes")
                x = np.asarray(d[b"data"], dtype=np.uint8).reshape(-1, 3, 32, 32)
                y = np.asarray(d[key], dtype=np.int64)
                if y.shape != (len(x),):
                    raise ValueError(f"{len(x)} images but {y.size} labels")
            except (
                OSError,
                EOFError,
                pickle.UnpicklingError,
                KeyError,
                IndexError,
                TypeError,
                ValueError,
                AttributeError,
            ) as e:
                raise DataUnavailable(
                    f"{folder / f}: not a readable CIFAR batch ({_reason(e)}); delete it and "
                    "re-seed with python -m dpsgd.data"
                ) from None
            xs.append(x)
            ys.append(y)
        x = torch.from_numpy(np.concatenate(xs).astype(np.float32) / 255.0)
        if crop:
            if not 1 <= crop <= 32:
                raise ValueError(f"dataset.crop={crop}: must be in [1, 32]")
            off = (32 - crop) // 2
            x = x[:, :, off : off + crop, off : off + crop].contiguous()
        return x, torch.from_numpy(np.concatenate(ys))

    return (*read(train_files), *read(test_files))


def load_dataset(
    name: str,
    root: str | Path | None = None,
    subset: int | None = None,
    crop: int | None = CROP,
    download: bool = True,
    source: str | Path | None = None,
):
    """(X_train, y_train, X_test, y_test) as CPU tensors; ``subset`` keeps the first n training
    examples."""
    ensure_dataset(name, root, source=source, download=download)
    root = Path(root) if root else default_root()
    if name in _IDX:
        xtr, ytr, xte, yte = _load_idx(name, root, subset)
    else:
        xtr, ytr, xte, yte = _load_cifar(name, root, crop)
    if subset is not None:
        xtr, ytr = xtr[:subset].contiguous(), ytr[:subset].contiguous()
    return xtr, ytr, xte, yte
