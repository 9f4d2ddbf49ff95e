"""The datasets the project serves: their registry, the publishers' md5s, and the ``dataset.*``
checks.

``DATASETS`` names each dataset's folder under the data root (torchvision's layout), its sizes,
classes and the shape of one example as loaded; ``EXPECTED_MD5`` / ``EXPECTED_ARCHIVE_MD5`` are the
publishers' digests every load checks (``dpsgd/data/archives.py`` obtains and verifies the files,
``dpsgd/data/readers.py`` reads them into tensors: ``load_dataset``). ``DataUnavailable`` is the one
error a dataset that cannot be used raises, whichever step fails.
"""

from __future__ import annotations

from typing import NamedTuple

from dpsgd.core.checks import boolean, choice, fmt, num
from dpsgd.core.errors import ConfigError

CROP = 24  # the paper's (and the tutorial's) crop of the 32×32 CIFAR images (dataset.crop)
AUGMENTATION_NAMES = (
    "none",
    "crop_flip",
)  # dataset.augment; the functions: data/augment.py (torch)


class Dataset(NamedTuple):
    folder: str  # under the data root (torchvision's layout)
    n_train: int  # training examples
    n_test: int  # test examples
    classes: int
    shape: tuple[int, ...]  # one example as loaded, before any crop: flat 784, or C×H×W


DATASETS = {  # dataset.name -> Dataset
    "mnist": Dataset("MNIST", 60000, 10000, 10, (784,)),
    "fashion_mnist": Dataset("FashionMNIST", 60000, 10000, 10, (784,)),
    "cifar10": Dataset("cifar-10-batches-py", 50000, 10000, 10, (3, 32, 32)),
    "cifar100": Dataset("cifar-100-python", 50000, 10000, 100, (3, 32, 32)),
}

# Every file the loaders read, by path under the dataset's folder, with its publisher's md5: the
# same constants as torchvision.datasets.MNIST/FashionMNIST.resources and
# CIFAR10/CIFAR100.train_list/test_list. Every load checks them (verified digests are remembered per
# process, keyed by the file's path, size, mtime and inode; a fresh process hashes again). Tests
# that generate small files in these formats register the generated files' md5 here with
# monkeypatch; nothing else skips the check, and no setting does.
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
# The CIFAR tar archives (torchvision's CIFAR10/CIFAR100.filename and tgz_md5), checked when copied
# from a source.
EXPECTED_ARCHIVE_MD5 = {
    "cifar10": ("cifar-10-python.tar.gz", "c58f30108f718f92721af3b95e74349a"),
    "cifar100": ("cifar-100-python.tar.gz", "eb9058c3a382ffc7106e4002c42a8d85"),
}


class DataUnavailable(ValueError):
    """The dataset is not usable: missing everywhere, failing its md5 check, unreadable, or the root
    is unusable."""


def input_shape(name, crop: int | None = CROP) -> tuple[int, ...]:
    """One example's shape after the centre crop; ``name``: a registered name or a ``dataset.*``
    group (files: their shape)."""
    shape = DATASETS[name].shape if isinstance(name, str) else dataset_info(name).shape
    if len(shape) == 3 and crop:
        return (shape[0], int(crop), int(crop))
    return shape


def dataset_info(d) -> Dataset:
    """The ``Dataset`` record of the ``dataset.*`` group: the registry's, or read from the files of
    ``dataset=tensors|csv`` (``dpsgd/data/files.py``)."""
    from dpsgd.data.files import FILE_FORMATS, describe

    return Dataset(*describe(d)) if d.name in FILE_FORMATS else DATASETS[d.name]


def validate_dataset(d) -> None:
    """The ``dataset.*`` group (``DatasetConfig``), checked and coerced in place; ConfigError naming
    the key."""
    from dpsgd.data.files import FILE_FORMATS, check_dtype, check_files

    choice("dataset.name", d.name, (*DATASETS, *FILE_FORMATS))
    if d.name in FILE_FORMATS:
        d.image_size = num("dataset.image_size", d.image_size, integer=True, lo=1, hi=1024)
        check_files(d)
        check_dtype(d)
    else:
        for key in ("train", "test", "train_sha256", "test_sha256", "classes"):
            if getattr(d, key) is not None:
                raise ConfigError(
                    f"dataset.{key}={fmt(getattr(d, key))}: only dataset=tensors|csv read files"
                )
        if getattr(d, "dtype", "float32") != "float32":
            raise ConfigError(f"dataset.dtype={fmt(d.dtype)}: dataset=tensors|csv only (token ids)")
    if d.name != "torchvision":
        for key in ("cls", "train_split", "test_split"):
            if getattr(d, key) is not None:
                raise ConfigError(
                    f"dataset.{key}={fmt(getattr(d, key))}: only dataset=torchvision takes it"
                )
    info = dataset_info(d)
    full_n = info.n_train
    d.subset = num("dataset.subset", d.subset, integer=True, optional=True, lo=1, hi=full_n)
    d.validation = num(
        "dataset.validation",
        d.validation,
        integer=True,
        optional=True,
        lo=1,
        hi=(d.subset or full_n) - 1,
    )
    d.crop = num("dataset.crop", d.crop, integer=True, optional=True, lo=1, hi=32)
    if d.root is not None and not isinstance(d.root, str):
        raise ConfigError(f"dataset.root={fmt(d.root)}: must be a path")
    d.download = boolean("dataset.download", d.download)
    choice("dataset.augment", d.augment, AUGMENTATION_NAMES)
    d.standardize = boolean("dataset.standardize", d.standardize)
    shape = info.shape
    if d.augment != "none" and (len(shape) != 3 or not d.crop or d.crop >= shape[-1]):
        raise ConfigError(
            f"dataset.augment={d.augment}: random crops need images and dataset.crop smaller than "
            f"them ({d.name}, crop={fmt(d.crop)})"
        )
    if d.standardize and len(shape) != 3:
        raise ConfigError(
            "dataset.standardize=true: per-image standardisation is for image datasets, not "
            f"{d.name}"
        )
