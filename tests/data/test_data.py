"""Datasets: MNIST from the original archives, root seeding from a local source, CIFAR layout.

CIFAR cases use small generated files in torchvision's pickled layout; generated files cannot
match the publisher's md5, so each test registers their md5 in
``dpsgd.data.datasets.EXPECTED_MD5`` (monkeypatch, test only).
"""

import os
import pickle
import tarfile
from pathlib import Path

import numpy as np
import pytest
import torch

import dpsgd.data.datasets as data
from dpsgd.data.archives import _md5_of, default_source, ensure_dataset, main
from dpsgd.data.datasets import DataUnavailable
from dpsgd.data.readers import load_dataset


def test_mnist_tensors_shapes_and_range():
    Xtr, ytr, Xte, yte = load_dataset("mnist")
    assert Xtr.shape == (60000, 784) and Xte.shape == (10000, 784)
    assert Xtr.dtype == torch.float32 and ytr.dtype == torch.int64
    assert Xtr.min() == 0.0 and Xtr.max() == 1.0
    assert ytr[:10].tolist() == [5, 0, 4, 1, 9, 2, 1, 3, 1, 4]  # the well-known first labels
    assert torch.bincount(yte).tolist() == [980, 1135, 1032, 1010, 982, 892, 958, 1028, 974, 1009]
    sub = load_dataset("mnist", subset=100)
    assert sub[0].shape == (100, 784) and torch.equal(sub[0], Xtr[:100])


@pytest.mark.skipif(default_source() is None, reason="no local data source")
def test_seeds_root_from_source_without_writing_into_it(tmp_path):
    src = default_source()
    before = {p: p.stat().st_mtime for p in src.rglob("*")}
    msg = ensure_dataset("mnist", tmp_path / "root", download=False)
    assert "copied 4 files" in msg and "md5 verified" in msg
    assert sorted(os.listdir(tmp_path / "root" / "MNIST" / "raw")) == sorted(
        os.listdir(src / "MNIST" / "raw")
    )
    assert {p: p.stat().st_mtime for p in src.rglob("*")} == before
    assert "present" in ensure_dataset("mnist", tmp_path / "root", download=False)


def test_missing_data_without_network_is_a_one_line_error(tmp_path):
    empty = tmp_path / "empty_source"
    empty.mkdir()
    with pytest.raises(DataUnavailable) as e:
        ensure_dataset("fashion_mnist", tmp_path / "root", source=empty, download=False)
    msg = str(e.value)
    assert "\n" not in msg and "dataset.root=" in msg and "DPSGD_DATA_SOURCE=" in msg


def test_cli_seeds_and_reports(tmp_path, capsys, monkeypatch):
    empty = tmp_path / "src"
    empty.mkdir()
    assert (
        main(["mnist", "--root", str(tmp_path / "r"), "--source", str(empty), "--no-download"]) == 2
    )
    assert "error: dataset.root=" in capsys.readouterr().err


def _write_cifar(root: Path, name: str, n: int, seed: int = 0):
    rng = np.random.default_rng(seed)
    if name == "cifar10":
        d, files, key = (
            root / "cifar-10-batches-py",
            [f"data_batch_{i}" for i in range(1, 6)] + ["test_batch"],
            b"labels",
        )
    else:
        d, files, key = root / "cifar-100-python", ["train", "test"], b"fine_labels"
    d.mkdir(parents=True)
    written = {}
    for f in files:
        data = rng.integers(0, 256, size=(n, 3072), dtype=np.uint8)
        labels = rng.integers(0, 10 if name == "cifar10" else 100, size=n).tolist()
        with open(d / f, "wb") as fh:
            pickle.dump({b"data": data, key: labels, b"batch_label": b"synthetic"}, fh)
        written[f] = (data, labels)
    return written


def _trust(monkeypatch, name: str, root: Path) -> None:
    """Register the md5 of generated files as expected (the test-only way past the integrity
    check)."""
    folder = root / data.DATASETS[name][0]
    for rel in data.EXPECTED_MD5[name]:
        monkeypatch.setitem(data.EXPECTED_MD5[name], rel, _md5_of(folder / rel))


@pytest.mark.parametrize("name", ["cifar10", "cifar100"])
def test_cifar_layout_nchw_center_crop(tmp_path, name, monkeypatch):
    written = _write_cifar(tmp_path, name, n=4)
    _trust(monkeypatch, name, tmp_path)
    Xtr, ytr, Xte, yte = load_dataset(
        name, tmp_path, crop=24, download=False, source=tmp_path / "none"
    )
    n_train = 20 if name == "cifar10" else 4
    assert Xtr.shape == (n_train, 3, 24, 24) and Xte.shape == (4, 3, 24, 24)
    assert Xtr.dtype == torch.float32 and 0 <= Xtr.min() and Xtr.max() <= 1
    first = "data_batch_1" if name == "cifar10" else "train"
    raw, labels = written[first]
    img = raw[0].reshape(3, 32, 32).astype(np.float32) / 255.0  # CHW, row-major, as published
    assert np.allclose(Xtr[0].numpy(), img[:, 4:28, 4:28])
    assert ytr[:4].tolist() == labels
    full = load_dataset(name, tmp_path, crop=None, download=False, source=tmp_path / "none")[0]
    assert full.shape[1:] == (3, 32, 32) and np.allclose(full[0].numpy(), img)


@pytest.mark.parametrize("name", ["cifar10", "cifar100"])
def test_cifar_files_failing_md5_are_refused(tmp_path, name, capsys):
    """Unregistered generated files are not the publisher's: refused, named, kept."""
    _write_cifar(tmp_path, name, n=2)
    with pytest.raises(DataUnavailable) as e:
        load_dataset(name, tmp_path, download=False, source=tmp_path / "none")
    msg = str(e.value)
    folder = data.DATASETS[name][0]
    first = "data_batch_1" if name == "cifar10" else "train"
    assert "\n" not in msg and f"{folder}/{first}" in msg and "fail their md5 check" in msg
    assert (
        main([name, "--root", str(tmp_path), "--source", str(tmp_path / "none"), "--no-download"])
        == 2
    )
    assert "md5 check" in capsys.readouterr().err
    assert (tmp_path / folder / first).is_file()


def test_cifar_unreadable_batch_is_one_line(tmp_path, monkeypatch):
    _write_cifar(tmp_path, "cifar100", n=2)
    path = tmp_path / "cifar-100-python" / "train"
    path.write_bytes(path.read_bytes()[:500])  # truncated pickle
    _trust(monkeypatch, "cifar100", tmp_path)
    with pytest.raises(DataUnavailable) as e:
        load_dataset("cifar100", tmp_path, download=False, source=tmp_path / "none")
    assert str(e.value).startswith(f"{path}: not a readable CIFAR batch (") and "\n" not in str(
        e.value
    )


def test_cifar_copied_from_local_source(tmp_path, monkeypatch):
    _write_cifar(tmp_path / "src", "cifar10", n=2)
    _trust(monkeypatch, "cifar10", tmp_path / "src")
    msg = ensure_dataset("cifar10", tmp_path / "root", source=tmp_path / "src", download=False)
    assert "copied" in msg and "md5 verified (6 files)" in msg
    assert load_dataset("cifar10", tmp_path / "root", download=False)[0].shape == (10, 3, 24, 24)


def _tar_source(tmp_path: Path, name: str) -> Path:
    """A source holding only the CIFAR tar archive, built from generated files."""
    _write_cifar(tmp_path / "gen", name, n=2)
    src = tmp_path / "src"
    src.mkdir()
    archive, _ = data.EXPECTED_ARCHIVE_MD5[name]
    with tarfile.open(src / archive, "w:gz") as tar:
        tar.add(tmp_path / "gen" / data.DATASETS[name][0], arcname=data.DATASETS[name][0])
    return src


def test_cifar_tar_md5_checked_when_copied(tmp_path, monkeypatch):
    src = _tar_source(tmp_path, "cifar10")
    archive, _ = data.EXPECTED_ARCHIVE_MD5["cifar10"]
    root = tmp_path / "root"
    root.mkdir()
    with pytest.raises(DataUnavailable) as e:
        ensure_dataset("cifar10", root, source=src, download=False)
    assert f"{src / archive} (from DPSGD_DATA_SOURCE={src}) fails its md5 check" in str(e.value)
    assert list(root.iterdir()) == []  # bad copy removed, nothing extracted
    monkeypatch.setitem(data.EXPECTED_ARCHIVE_MD5, "cifar10", (archive, _md5_of(src / archive)))
    _trust(monkeypatch, "cifar10", tmp_path / "gen")
    msg = ensure_dataset("cifar10", root, source=src, download=False)
    assert msg.startswith(f"cifar10: copied {src / archive} to {root} and extracted it")
    assert load_dataset("cifar10", root, download=False)[0].shape == (10, 3, 24, 24)


def test_cifar_tar_already_in_root_is_verified_then_extracted(tmp_path, monkeypatch):
    root = _tar_source(tmp_path, "cifar100")  # a root holding only the tar
    archive, _ = data.EXPECTED_ARCHIVE_MD5["cifar100"]
    with pytest.raises(DataUnavailable, match=f"{archive} fails its md5 check"):
        ensure_dataset("cifar100", root, source=tmp_path / "none", download=False)
    assert sorted(p.name for p in root.iterdir()) == [archive]  # refused, kept, nothing extracted
    monkeypatch.setitem(data.EXPECTED_ARCHIVE_MD5, "cifar100", (archive, _md5_of(root / archive)))
    _trust(monkeypatch, "cifar100", tmp_path / "gen")
    assert ensure_dataset("cifar100", root, source=tmp_path / "none", download=False).startswith(
        f"cifar100: extracted {root / archive}, md5 verified (2 files)"
    )
