"""dataset=torchvision (dpsgd/data/tvision.py): a torchvision class by name, on files in its own
on-disk format (MNIST's idx files, generated here), through validation, training and privacy.json;
and the one-line refusals."""

from __future__ import annotations

import json
import struct
import sys
import textwrap

import numpy as np
import pytest

from dpsgd.config.schema import ConfigError, validate
from dpsgd.launch.main import compose
from dpsgd.train import train

NET = textwrap.dedent(
    """
    from torch import nn

    class Flat(nn.Module):
        def __init__(self, pixels, classes=10):
            super().__init__()
            self.fc = nn.Linear(pixels, classes)

        def forward(self, x):
            return self.fc(x.flatten(1))
    """
)
SIDE = 6  # MNIST's idx format holds any image size; 6 × 6 keeps the test small


def _idx(path, arr: np.ndarray) -> None:
    """torchvision's MNIST format: magic (0, 0, 8 = ubyte, ndim), big-endian dims, then bytes."""
    head = bytes([0, 0, 8, arr.ndim]) + b"".join(struct.pack(">i", d) for d in arr.shape)
    path.write_bytes(head + arr.astype(np.uint8).tobytes())


@pytest.fixture
def mnist_root(tmp_path, monkeypatch):
    raw = tmp_path / "tv" / "MNIST" / "raw"
    raw.mkdir(parents=True)
    rng = np.random.default_rng(0)
    for prefix, n in (("train", 64), ("t10k", 16)):
        _idx(raw / f"{prefix}-images-idx3-ubyte", rng.integers(0, 256, (n, SIDE, SIDE)))
        _idx(raw / f"{prefix}-labels-idx1-ubyte", rng.integers(0, 10, n))
    (tmp_path / "tv_nets.py").write_text(NET)
    monkeypatch.syspath_prepend(str(tmp_path))
    yield tmp_path
    sys.modules.pop("tv_nets", None)


def _args(root, *more):
    return [
        "model=custom",
        "model._target_=tv_nets.Flat",
        f"+model.args.pixels={SIDE * SIDE}",
        "dataset=torchvision",
        "dataset.cls=MNIST",
        f"dataset.root={root / 'tv'}",
        "privacy.lot_size=16",
        "privacy.sigma=1.0",
        "privacy.clipping=global",
        "privacy.clip_norm=1",
        "training.epochs=2",
        "device=cpu",
        *more,
    ]


def test_a_torchvision_class_by_name_trains_and_is_hashed(mnist_root):
    args = _args(mnist_root)
    c = validate(compose(args))
    assert len(c.dataset.train_sha256) == 64 and c.dataset.train_sha256 != c.dataset.test_sha256
    out = train(c, mnist_root / "run", args)
    st = json.loads((mnist_root / "run" / "privacy.json").read_text())
    assert out["status"] == st["status"] == "complete" and st["sampling"]["N"] == 64
    assert "cls: MNIST" in (mnist_root / "run" / "config.resolved.yaml").read_text()


def test_the_examples_are_scaled_images_with_their_labels(mnist_root):
    from dpsgd.data import tvision

    c = validate(compose(_args(mnist_root)))
    X, y, _ = tvision.read(c.dataset, "train")
    raw = (mnist_root / "tv" / "MNIST" / "raw" / "train-images-idx3-ubyte").read_bytes()[16:]
    want = np.frombuffer(raw, np.uint8).reshape(64, 1, SIDE, SIDE) / np.float32(255)
    assert X.dtype == np.float32 and np.array_equal(X, want.astype(np.float32))  # exact: u8/255
    assert y.dtype == np.int64 and len(y) == 64


@pytest.mark.parametrize(
    "change, message",
    [
        (
            ["dataset.cls=MNST"],
            r"^dataset.cls=MNST: not a torchvision.datasets class; did you mean MNIST\?",
        ),
        (
            ["dataset.cls=FashionMNIST"],
            r"^dataset.root=.*: torchvision.datasets.FashionMNIST found no train data",
        ),
        (["dataset.train_split=train"], r"^dataset.train_split / dataset.test_split: give both"),
        (["dataset.train_sha256=00"], r"^dataset.train_sha256=00: .* the data changed"),
    ],
)
def test_bad_torchvision_settings_are_refused_in_one_line(mnist_root, change, message):
    with pytest.raises(ConfigError, match=message) as e:
        validate(compose(_args(mnist_root, *change)))
    assert "\n" not in str(e.value)


def test_torchvision_keys_belong_to_dataset_torchvision_only():
    with pytest.raises(ConfigError, match=r"^dataset.cls=MNIST: only dataset=torchvision takes it"):
        validate(compose(["+dataset.cls=MNIST", "device=cpu"]))
