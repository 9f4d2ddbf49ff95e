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
``<repo>/../shared/data`` when that exists) they are copied in (the source is only read); otherwise
torchvision downloads them. ``python -m dpsgd.data`` seeds the root and reports what it verified (without
names: MNIST and Fashion-MNIST, and CIFAR-10/100 when the root or the source already holds them). A
dataset found nowhere is one line naming it and both ways to provide it (``how_to_provide``).

Integrity: every file the loaders read is checked against its publisher's md5 on every load (a fresh
process hashes again; within one process a verified digest is remembered while the file keeps its inode,
size and mtime). A file in the root that fails is refused with one line naming it, never replaced. The
``.npy`` decompression cache of an IDX archive is named after the archive's md5 and used only when it
re-encodes to the CRC-32 and length recorded in the verified archive's gzip trailer.
"""
from __future__ import annotations

import argparse
import gzip
import hashlib
import io
import os
import pickle
import shutil
import struct
import sys
import tarfile
import zlib
from pathlib import Path
from typing import NamedTuple

import numpy as np
import torch

from dpsgd.core.checks import boolean, choice, fmt, num
from dpsgd.core.errors import ConfigError
from dpsgd.data.augment import AUGMENTATIONS, CROP

REPO = Path(__file__).resolve().parents[2]



class Dataset(NamedTuple):
    folder: str                  # under the data root (torchvision's layout)
    n_train: int                 # training examples
    n_test: int                  # test examples
    classes: int
    shape: tuple[int, ...]       # one example as loaded, before any crop: flat 784, or C×H×W


DATASETS = {   # dataset.name -> Dataset
    "mnist": Dataset("MNIST", 60000, 10000, 10, (784,)),
    "fashion_mnist": Dataset("FashionMNIST", 60000, 10000, 10, (784,)),
    "cifar10": Dataset("cifar-10-batches-py", 50000, 10000, 10, (3, 32, 32)),
    "cifar100": Dataset("cifar-100-python", 50000, 10000, 100, (3, 32, 32)),
}

# Every file the loaders read, by path under the dataset's folder, with its publisher's md5: the same
# constants as torchvision.datasets.MNIST/FashionMNIST.resources and CIFAR10/CIFAR100.train_list/test_list.
# Every load checks them (verified digests are remembered per process, keyed by the file's path, size,
# mtime and inode; a fresh process hashes again). Tests that generate small files in these formats register
# the generated files' md5 here with monkeypatch; nothing else skips the check, and no setting does.
EXPECTED_MD5 = {
    "mnist": {
        "raw/train-images-idx3-ubyte.gz": "f68b3c2dcbeaaa9fbdd348bbdeb94873",
        "raw/train-labels-idx1-ubyte.gz": "d53e105ee54ea40749a09fcbcd1e9432",
        "raw/t10k-images-idx3-ubyte.gz": "9fb629c4189551a2d022fa330f9573f3",
        "raw/t10k-labels-idx1-ubyte.gz": "ec29112dd5afa0611ce80d1b7f02629c",
    },
    "fashion_mnist": {
        "raw/train-images-idx3-ubyte.gz": "8d4fb7e6c68d591d4c3dfef9ec88bf0d",
        "raw/train-labels-idx1-ubyte.gz": "25c81989df183df01b3e8a0aad5dffbe",
        "raw/t10k-images-idx3-ubyte.gz": "bef4ecab320f06d8554ea6380940ec79",
        "raw/t10k-labels-idx1-ubyte.gz": "bb300cfdad3c16e7a12a480ee83cd310",
    },
    "cifar10": {
        "data_batch_1": "c99cafc152244af753f735de768cd75f",
        "data_batch_2": "d4bba439e000b95fd0a9bffe97cbabec",
        "data_batch_3": "54ebc095f3ab1f0389bbae665268c751",
        "data_batch_4": "634d18415352ddfa80567beed471001a",
        "data_batch_5": "482c414d41f54cd18b22e5b47cb7c3cb",
        "test_batch": "40351d587109b95175f43aff81a1287e",
    },
    "cifar100": {
        "train": "16019d7e3df5f24257cddd939b257f8d",
        "test": "f0ef6b0ae62326f3e7ffdfab6717acfc",
    },
}
# The CIFAR tar archives (torchvision's CIFAR10/CIFAR100.filename and tgz_md5), checked when copied from a source.
EXPECTED_ARCHIVE_MD5 = {
    "cifar10": ("cifar-10-python.tar.gz", "c58f30108f718f92721af3b95e74349a"),
    "cifar100": ("cifar-100-python.tar.gz", "eb9058c3a382ffc7106e4002c42a8d85"),
}
_IDX = ("mnist", "fashion_mnist")


class DataUnavailable(ValueError):
    """The dataset is not usable: missing everywhere, failing its md5 check, unreadable, or the root is unusable."""


def dataset_info(name: str) -> dict:
    return DATASETS[name]._asdict()


def input_shape(name: str, crop: int | None = CROP) -> tuple[int, ...]:
    shape = DATASETS[name].shape
    if len(shape) == 3 and crop:
        return (shape[0], int(crop), int(crop))
    return shape


def validate_dataset(d) -> None:
    """The ``dataset.*`` group (``DatasetConfig``), checked and coerced in place; ConfigError naming the key."""
    choice("dataset.name", d.name, DATASETS)
    full_n = DATASETS[d.name].n_train
    d.subset = num("dataset.subset", d.subset, integer=True, optional=True, lo=1, hi=full_n)
    d.validation = num("dataset.validation", d.validation, integer=True, optional=True, lo=1,
                       hi=(d.subset or full_n) - 1)
    d.crop = num("dataset.crop", d.crop, integer=True, optional=True, lo=1, hi=32)
    if d.root is not None and not isinstance(d.root, str):
        raise ConfigError(f"dataset.root={fmt(d.root)}: must be a path")
    d.download = boolean("dataset.download", d.download)
    choice("dataset.augment", d.augment, AUGMENTATIONS)
    d.standardize = boolean("dataset.standardize", d.standardize)
    shape = DATASETS[d.name].shape
    if d.augment != "none" and (len(shape) != 3 or not d.crop or d.crop >= shape[-1]):
        raise ConfigError(f"dataset.augment={d.augment}: random crops need images and dataset.crop smaller than "
                          f"them ({d.name}, crop={fmt(d.crop)})")
    if d.standardize and len(shape) != 3:
        raise ConfigError(f"dataset.standardize=true: per-image standardisation is for image datasets, not {d.name}")


def default_root() -> Path:
    return Path(os.environ.get("DPSGD_DATA_ROOT") or REPO / "data")


def default_source() -> Path | None:
    src = os.environ.get("DPSGD_DATA_SOURCE")
    if src:
        return Path(src)
    shared = REPO.parent / "shared" / "data"
    return shared if shared.is_dir() else None


_DIGESTS: dict[tuple, object] = {}   # (kind, path, device, inode, size, mtime_ns) -> digest, this process only


def _memo(kind: str, path: Path, compute):
    """``compute(path)``, remembered for this process while the file keeps its inode, size and mtime."""
    st = path.stat()
    key = (kind, str(path.absolute()), st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns)
    if key not in _DIGESTS:
        _DIGESTS[key] = compute(path)
    return _DIGESTS[key]


def _md5_of(path: Path) -> str:
    with open(path, "rb") as f:
        return hashlib.file_digest(f, lambda: hashlib.md5(usedforsecurity=False)).hexdigest()


def _md5(path: Path) -> str:
    return _memo("md5", path, _md5_of)


def _refused(label: str, root: Path, name: str, bad: list[str]) -> DataUnavailable:
    files = ", ".join(f"{DATASETS[name].folder}/{rel}" for rel in bad)
    verb = "fails its" if len(bad) == 1 else "fail their"
    return DataUnavailable(f"{label}={root}: {files} {verb} md5 check (truncated, corrupted or altered); delete "
                           f"{'it' if len(bad) == 1 else 'them'} and re-seed with python -m dpsgd.data {name}")


def _verified(name: str, root: Path, label: str) -> list[str]:
    """The expected files missing under ``root``; raises if one that is there fails its md5 check."""
    folder = root / DATASETS[name].folder
    missing, bad = [], []
    for rel, md5 in EXPECTED_MD5[name].items():
        path = folder / rel
        if not path.is_file():
            missing.append(rel)
        elif _md5(path) != md5:
            bad.append(rel)
    if bad:
        raise _refused(label, root, name, bad)
    return missing


def _copy_atomic(src: Path, dst: Path) -> None:
    dst.parent.mkdir(parents=True, exist_ok=True)
    tmp = dst.with_name(f".{dst.name}.tmp{os.getpid()}")
    try:
        shutil.copyfile(src, tmp)
        with open(tmp, "rb+") as f:
            os.fsync(f.fileno())
        os.replace(tmp, dst)
    finally:
        tmp.unlink(missing_ok=True)


def _reason(e: BaseException) -> str:
    """One line for a failure: its first message line, completed (when that line only announces what follows,
    e.g. torchvision's "Error downloading x.gz:") by the first detail below it, in the message's later lines
    or along ``__cause__`` / ``__context__`` (e.g. the URLError's reason)."""
    lines, seen, err = [], set(), e
    while err is not None and id(err) not in seen:
        seen.add(id(err))
        lines += [ln.strip() for ln in str(err).splitlines() if ln.strip()]
        err = err.__cause__ or err.__context__
    if not lines:
        return type(e).__name__
    head = lines[0]
    if head.endswith(":"):
        detail = next((ln for ln in lines[1:] if not ln.endswith(":")), "")
        head = f"{head} {detail}" if detail else head.rstrip(":")
    return head


class _Undo:
    """Removes what a failed seeding attempt created under the data root, and nothing that existed before it."""

    def __init__(self, name: str, root: Path):
        self.top = None          # the highest folder on the way to ``root`` that does not exist yet
        p = root
        while not p.exists() and p != p.parent:
            self.top, p = p, p.parent
        self.watched = [root / DATASETS[name].folder]
        if name in EXPECTED_ARCHIVE_MD5:
            self.watched.append(root / EXPECTED_ARCHIVE_MD5[name][0])
        self.before = self._paths()

    def _paths(self) -> set[Path]:
        out = set()
        for w in self.watched:
            if w.is_symlink() or w.exists():
                out.add(w)
                if w.is_dir() and not w.is_symlink():
                    out.update(w.rglob("*"))
        return out

    def __call__(self) -> None:
        if self.top is not None:
            shutil.rmtree(self.top, ignore_errors=True)
            return
        for p in sorted(self._paths() - self.before, key=lambda p: len(p.parts), reverse=True):
            try:
                if p.is_dir() and not p.is_symlink():
                    p.rmdir()        # created by the attempt; holds only what the attempt created
                else:
                    p.unlink()
            except OSError:
                pass


def _copy_verified(name: str, src: Path, dst: Path, md5: str, label: str, root: Path, source: Path) -> None:
    try:
        _copy_atomic(src, dst)
    except OSError as e:
        raise DataUnavailable(f"{label}={root}: cannot copy {src} there ({_reason(e)})") from None
    if _md5(dst) != md5:
        dst.unlink()
        raise DataUnavailable(f"{label}={root}: {src} (from DPSGD_DATA_SOURCE={source}) fails its md5 check; "
                              f"replace it in the source, then run python -m dpsgd.data {name}")


def _extract(archive: Path, md5: str, label: str, root: Path) -> None:
    """Extract a CIFAR tar archive that passes its md5 check (one that fails is refused, never replaced)."""
    if _md5(archive) != md5:
        raise DataUnavailable(f"{label}={root}: {archive.name} fails its md5 check (truncated, corrupted or "
                              "altered); delete it and re-seed with python -m dpsgd.data")
    try:
        with tarfile.open(archive, "r:gz") as tar:
            tar.extractall(root, filter="data")
    except (OSError, EOFError, zlib.error, tarfile.TarError) as e:
        raise DataUnavailable(f"{label}={root}: cannot extract {archive} ({_reason(e)})") from None


def _seed(name: str, root: Path, source: Path | None, download: bool, label: str, missing: list[str]) -> str | None:
    """Copy the missing files from ``source``, else download them; None when neither applies."""
    folder = DATASETS[name].folder
    try:
        root.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise DataUnavailable(f"{label}={root}: cannot be created ({_reason(e)})") from None
    if name in EXPECTED_ARCHIVE_MD5 and (root / EXPECTED_ARCHIVE_MD5[name][0]).is_file():
        _extract(root / EXPECTED_ARCHIVE_MD5[name][0], EXPECTED_ARCHIVE_MD5[name][1], label, root)
        return f"extracted {root / EXPECTED_ARCHIVE_MD5[name][0]}"
    if source is not None and source.resolve() != root.resolve():
        if all((source / folder / rel).is_file() for rel in missing):
            for rel in missing:
                _copy_verified(name, source / folder / rel, root / folder / rel, EXPECTED_MD5[name][rel],
                               label, root, source)
            return f"copied {len(missing)} files from {source / folder} to {root / folder}"
        if name in EXPECTED_ARCHIVE_MD5 and (source / EXPECTED_ARCHIVE_MD5[name][0]).is_file():
            archive_name, md5 = EXPECTED_ARCHIVE_MD5[name]
            if not (root / archive_name).is_file():
                _copy_verified(name, source / archive_name, root / archive_name, md5, label, root, source)
            _extract(root / archive_name, md5, label, root)
            return f"copied {source / archive_name} to {root} and extracted it"
    if not download:
        return None
    try:
        import torchvision.datasets as tvd
        cls = {"mnist": tvd.MNIST, "fashion_mnist": tvd.FashionMNIST,
               "cifar10": tvd.CIFAR10, "cifar100": tvd.CIFAR100}[name]
        cls(str(root), train=True, download=True)
        cls(str(root), train=False, download=True)
    except Exception as e:  # no network, mirror down, disk full, ...
        raise DataUnavailable(f"{label}={root}: {name} not found there, nor under DPSGD_DATA_SOURCE={source} "
                              f"({how_to_provide(name)}), and the download failed ({_reason(e)})") from None
    return f"downloaded to {root}"


def how_to_provide(name: str) -> str:
    """The two ways to provide ``name``, in one clause (for the one-line 'not found' errors)."""
    folder = DATASETS[name].folder
    what = (f"{EXPECTED_ARCHIVE_MD5[name][0]} or its {folder}/ folder" if name in EXPECTED_ARCHIVE_MD5
            else f"its {folder}/raw/*.gz archives")
    return (f"put {what} under $DPSGD_DATA_SOURCE or the data root, or allow the download "
            "(dataset.download=true, needs network)")


def has_local_copy(name: str, root: str | Path | None = None, source: str | Path | None = None) -> bool:
    """Whether the root or the source holds ``name`` (its folder or archive), unverified: what
    ``python -m dpsgd.data`` without names seeds besides MNIST (CIFAR only when present locally)."""
    places = [Path(root) if root else default_root()]
    src = Path(source) if source else default_source()
    places += [src] if src is not None else []
    names = [DATASETS[name].folder] + ([EXPECTED_ARCHIVE_MD5[name][0]] if name in EXPECTED_ARCHIVE_MD5 else [])
    return any((p / n).exists() for p in places for n in names)


def ensure_dataset(name: str, root: str | Path | None = None, source: str | Path | None = None,
                   download: bool = True) -> str:
    """Make ``name`` available under ``root``, every file md5-verified; returns a one-line account.

    Files already in the root are never replaced or deleted: one that fails its md5 check is refused
    (DataUnavailable naming it). A failed copy or download removes what it created, and only that.
    """
    if name not in DATASETS:
        raise ValueError(f"dataset.name={name!r}: must be one of {sorted(DATASETS)}")
    label = "dataset.root" if root or not os.environ.get("DPSGD_DATA_ROOT") else "DPSGD_DATA_ROOT"
    root = Path(root) if root else default_root()
    source = Path(source) if source else default_source()
    if root.exists() and not root.is_dir():
        raise DataUnavailable(f"{label}={root}: not a directory")
    n = len(EXPECTED_MD5[name])
    missing = _verified(name, root, label)
    if not missing:
        return f"{name}: present in {root}, md5 verified ({n} files)"
    undo = _Undo(name, root)
    try:
        done = _seed(name, root, source, download, label, missing)
        if done is not None:
            missing = _verified(name, root, label)
    except BaseException:
        undo()
        raise
    if done is not None and not missing:
        return f"{name}: {done}, md5 verified ({n} files)"
    undo()
    raise DataUnavailable(f"{label}={root}: {name} not found there, nor under DPSGD_DATA_SOURCE={source}"
                          + ("" if download else ", and downloads are off (dataset.download=false)")
                          + f"; {how_to_provide(name)}")


def _read_idx(path: Path) -> np.ndarray:
    """An IDX file (LeCun et al.'s MNIST format): magic 0 0 8 ndim, dims (big-endian int32), then uint8 data."""
    try:
        with gzip.open(path, "rb") as f:
            data = f.read()
    except (OSError, EOFError, zlib.error) as e:   # BadGzipFile is an OSError
        raise DataUnavailable(f"{path}: cannot be decompressed ({_reason(e)}); delete it and re-seed "
                              "with python -m dpsgd.data") from None
    ndim = data[3] if len(data) >= 4 and data[:3] == b"\x00\x00\x08" else 0
    dims = np.frombuffer(data, dtype=">i4", count=ndim, offset=4) if len(data) >= 4 + 4 * ndim else None
    if not ndim or dims is None or len(data) != 4 + 4 * ndim + int(np.prod(dims, dtype=np.int64)):
        raise DataUnavailable(f"{path}: not a uint8 IDX file (bad header or length); delete it and re-seed "
                              "with python -m dpsgd.data")
    return np.frombuffer(data, dtype=np.uint8, offset=4 + 4 * ndim).reshape(tuple(int(d) for d in dims))


def _gzip_trailer(path: Path) -> tuple[int, int]:
    """(CRC-32, length mod 2^32) of the uncompressed data, from the gzip trailer (RFC 1952 §2.3.1)."""
    with open(path, "rb") as f:
        f.seek(-8, os.SEEK_END)
        return struct.unpack("<II", f.read(8))


def _idx_crc(arr: np.ndarray) -> tuple[int, int]:
    """(CRC-32, length mod 2^32) of the IDX file that holds ``arr``: its header, then its bytes."""
    header = bytes([0, 0, 8, arr.ndim]) + np.asarray(arr.shape, dtype=">i4").tobytes()
    crc = zlib.crc32(memoryview(np.ascontiguousarray(arr)).cast("B"), zlib.crc32(header))
    return crc, (len(header) + arr.nbytes) % (1 << 32)


def _idx_array(path: Path, md5: str) -> np.ndarray:
    """The uint8 array of an md5-verified IDX archive, cached as .npy next to it (decompressing is slow).

    The cache is named after the archive's md5 and used only when its array re-encodes to the IDX data the
    archive's gzip trailer describes (CRC-32 and length); otherwise it is rebuilt from the archive.
    """
    cache = path.with_name(f".{path.name}.{md5}.npy")
    try:
        expected = _gzip_trailer(path)
    except OSError:              # shorter than a gzip trailer: _read_idx says what is wrong
        return _read_idx(path)
    if cache.is_file():
        try:
            arr = np.load(cache, mmap_mode="r", allow_pickle=False)
            if arr.dtype == np.uint8 and _memo("idx-crc", cache, lambda _: _idx_crc(arr)) == expected:
                return arr
        except (OSError, ValueError):
            pass
    arr = _read_idx(path)
    if _idx_crc(arr) != expected:   # a multi-member gzip: its trailer covers only the last member; no cache
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
            raise DataUnavailable(f"{folder / 'raw'}: {split} images and labels differ in number "
                                  f"({len(x)} vs {len(y)})")
        pixels = x.reshape(len(x), -1).astype(np.float32)
        pixels /= 255.0              # in place: the same float32 division, one 188 MB buffer fewer
        out += [torch.from_numpy(pixels), torch.from_numpy(y.astype(np.int64))]
    return tuple(out)


def _load_cifar(name: str, root: Path, crop: int | None):
    folder = root / DATASETS[name].folder
    if name == "cifar10":
        train_files, test_files, key = [f"data_batch_{i}" for i in range(1, 6)], ["test_batch"], b"labels"
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
            except (OSError, EOFError, pickle.UnpicklingError, KeyError, IndexError, TypeError, ValueError,
                    AttributeError) as e:
                raise DataUnavailable(f"{folder / f}: not a readable CIFAR batch ({_reason(e)}); delete it and "
                                      "re-seed with python -m dpsgd.data") from None
            xs.append(x)
            ys.append(y)
        x = torch.from_numpy(np.concatenate(xs).astype(np.float32) / 255.0)
        if crop:
            if not 1 <= crop <= 32:
                raise ValueError(f"dataset.crop={crop}: must be in [1, 32]")
            off = (32 - crop) // 2
            x = x[:, :, off:off + crop, off:off + crop].contiguous()
        return x, torch.from_numpy(np.concatenate(ys))

    return (*read(train_files), *read(test_files))


def load_dataset(name: str, root: str | Path | None = None, subset: int | None = None,
                 crop: int | None = CROP, download: bool = True, source: str | Path | None = None):
    """(X_train, y_train, X_test, y_test) as CPU tensors; ``subset`` keeps the first n training examples."""
    ensure_dataset(name, root, source=source, download=download)
    root = Path(root) if root else default_root()
    if name in _IDX:
        xtr, ytr, xte, yte = _load_idx(name, root, subset)
    else:
        xtr, ytr, xte, yte = _load_cifar(name, root, crop)
    if subset is not None:
        xtr, ytr = xtr[:subset].contiguous(), ytr[:subset].contiguous()
    return xtr, ytr, xte, yte


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m dpsgd.data",
                                description="Seed the data root from a local source (or download) and verify its md5s.")
    p.add_argument("names", nargs="*", metavar="NAME",
                   help=f"datasets among {sorted(DATASETS)} (default: mnist fashion_mnist, and cifar10 "
                        "cifar100 when the root or the source holds them)")
    p.add_argument("--root", default=None, help="data root (default $DPSGD_DATA_ROOT or <repo>/data)")
    p.add_argument("--source", default=None, help="local source (default $DPSGD_DATA_SOURCE or ../shared/data)")
    p.add_argument("--no-download", action="store_true", help="never use the network")
    a = p.parse_args(argv)
    status = 0
    names = a.names or ["mnist", "fashion_mnist"] + [n for n in ("cifar10", "cifar100")
                                                     if has_local_copy(n, a.root, a.source)]
    for name in names:
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
