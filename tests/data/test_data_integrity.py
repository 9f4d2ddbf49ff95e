"""Integrity of the data root: every archive md5-verified on every load, caches tied to the
verified archive, one-line refusals for tampered, truncated or unusable roots, failed downloads
cleaned up with their cause.

MNIST cases work on copies of the real archives in tmp_path (never writing into the data root); the
md5 tables are checked against torchvision's own constants (an independent reference).
"""

import gzip
import os
import shutil
import subprocess
import sys
import urllib.error
import urllib.request
from pathlib import Path

import numpy as np
import pytest
import torch

from dpsgd.data.archives import _md5_of, _reason, default_root, default_source, ensure_dataset, main
from dpsgd.data.datasets import EXPECTED_ARCHIVE_MD5, EXPECTED_MD5, DataUnavailable
from dpsgd.data.readers import load_dataset

REPO = Path(__file__).resolve().parents[2]
LABELS = "raw/train-labels-idx1-ubyte.gz"
IMAGES = "raw/train-images-idx3-ubyte.gz"


def _mnist_folder() -> Path:
    for base in (default_root(), default_source()):
        if base is not None and all(
            (base / "MNIST" / rel).is_file() for rel in EXPECTED_MD5["mnist"]
        ):
            return base / "MNIST"
    pytest.skip("no MNIST archives (set DPSGD_DATA_ROOT)")


def _mnist_root(tmp_path: Path, name: str = "root") -> Path:
    """A data root holding copies of the four real MNIST archives (and nothing else)."""
    src, root = _mnist_folder(), tmp_path / name
    (root / "MNIST" / "raw").mkdir(parents=True)
    for rel in EXPECTED_MD5["mnist"]:
        shutil.copyfile(src / rel, root / "MNIST" / rel)
    return root


def _replace(path: Path, content: bytes) -> None:
    """Write a new file over ``path`` (a new inode, as an editor or a re-download would)."""
    tmp = path.with_name(path.name + ".new")
    tmp.write_bytes(content)
    os.replace(tmp, path)


def _shifted_labels_gz(path: Path) -> bytes:
    """The same IDX labels archive with every label moved to the next class: a valid gzip, a wrong
    dataset."""
    raw = bytearray(gzip.decompress(path.read_bytes()))
    raw[8:] = bytes((b + 1) % 10 for b in raw[8:])
    return gzip.compress(bytes(raw))


def _one_line(e) -> str:
    msg = str(e.value)
    assert "\n" not in msg, msg
    return msg


def test_md5_tables_are_torchvisions():
    tvd = pytest.importorskip("torchvision.datasets")
    for name, cls in (("mnist", tvd.MNIST), ("fashion_mnist", tvd.FashionMNIST)):
        assert EXPECTED_MD5[name] == {f"raw/{f}": m for f, m in cls.resources}
    for name, cls in (("cifar10", tvd.CIFAR10), ("cifar100", tvd.CIFAR100)):
        assert EXPECTED_MD5[name] == dict(cls.train_list + cls.test_list)
        assert EXPECTED_ARCHIVE_MD5[name] == (cls.filename, cls.tgz_md5)


def test_valid_gzip_with_shifted_labels_is_refused_by_load_and_cli(tmp_path, capsys):
    root = _mnist_root(tmp_path)
    assert (
        main(["mnist", "--root", str(root), "--source", str(tmp_path / "none"), "--no-download"])
        == 0
    )
    assert "present in" in capsys.readouterr().out
    _replace(root / "MNIST" / LABELS, _shifted_labels_gz(root / "MNIST" / LABELS))
    for call in (
        lambda: ensure_dataset("mnist", root, source=tmp_path / "none", download=False),
        lambda: load_dataset("mnist", root, source=tmp_path / "none", download=False),
    ):
        with pytest.raises(DataUnavailable) as e:
            call()
        msg = _one_line(e)
        assert (
            f"dataset.root={root}: MNIST/{LABELS} fails its md5 check" in msg and "delete it" in msg
        )
    assert (
        main(["mnist", "--root", str(root), "--source", str(tmp_path / "none"), "--no-download"])
        == 2
    )
    out = capsys.readouterr()
    assert out.out == "" and f"MNIST/{LABELS} fails its md5 check" in out.err
    assert (root / "MNIST" / LABELS).is_file()  # refused, never deleted


def test_cli_says_md5_verified(tmp_path, capsys):
    root = _mnist_root(tmp_path)
    assert main(["mnist", "--root", str(root), "--no-download"]) == 0
    assert capsys.readouterr().out.strip() == f"mnist: present in {root}, md5 verified (4 files)"


def test_truncated_archive_is_one_line_naming_it(tmp_path):
    root = _mnist_root(tmp_path)
    path = root / "MNIST" / IMAGES
    _replace(path, path.read_bytes()[: path.stat().st_size // 2])
    with pytest.raises(DataUnavailable) as e:
        load_dataset("mnist", root, download=False)
    assert f"MNIST/{IMAGES} fails its md5 check" in _one_line(e)


def test_unreadable_archive_second_line_of_defence(tmp_path, monkeypatch):
    """Past the md5 check (registered here), decompression and IDX-format errors are still one
    line."""
    root = _mnist_root(tmp_path)
    cases = {
        IMAGES: (root / "MNIST" / IMAGES).read_bytes()[:100000],  # truncated gzip stream
        LABELS: gzip.compress(b"\x00\x00\x08\x01" + (60000).to_bytes(4, "big") + bytes(59999)),
    }  # short
    for rel, content in cases.items():
        _replace(root / "MNIST" / rel, content)
        monkeypatch.setitem(EXPECTED_MD5["mnist"], rel, _md5_of(root / "MNIST" / rel))
    with pytest.raises(DataUnavailable) as e:
        load_dataset("mnist", root, download=False)
    assert str(root / "MNIST" / IMAGES) in _one_line(e) and "cannot be decompressed" in str(e.value)
    shutil.copyfile(_mnist_folder() / IMAGES, root / "MNIST" / IMAGES)
    monkeypatch.setitem(EXPECTED_MD5["mnist"], IMAGES, _md5_of(root / "MNIST" / IMAGES))
    with pytest.raises(DataUnavailable) as e:
        load_dataset("mnist", root, download=False)
    assert str(root / "MNIST" / LABELS) in _one_line(e) and "not a uint8 IDX file" in str(e.value)


def test_archive_changed_after_a_load_in_the_same_process_is_refused(tmp_path):
    """The per-process memory of verified digests is keyed by the file's inode, size and mtime."""
    root = _mnist_root(tmp_path)
    assert "md5 verified" in ensure_dataset("mnist", root, download=False)
    _replace(root / "MNIST" / LABELS, _shifted_labels_gz(root / "MNIST" / LABELS))
    with pytest.raises(DataUnavailable, match="fails its md5 check"):
        ensure_dataset("mnist", root, download=False)


def test_tampered_decompression_cache_is_never_used(tmp_path):
    root = _mnist_root(tmp_path)
    y = load_dataset("mnist", root, download=False)[1]
    raw = root / "MNIST" / "raw"
    caches = sorted(raw.glob(".train-labels-idx1-ubyte.gz*.npy"))
    assert len(caches) == 1
    labels = np.load(caches[0])
    assert np.array_equal(labels, y.numpy())
    buf = tmp_path / "shifted.npy"
    np.save(buf, (labels + 1) % 10)
    _replace(caches[0], buf.read_bytes())
    assert torch.equal(load_dataset("mnist", root, download=False)[1], y)
    assert np.array_equal(np.load(caches[0]), labels)  # rebuilt from the archive


def test_cache_with_the_old_name_is_ignored(tmp_path):
    """A cache not named after the verified archive's md5 (here the former name) is never read."""
    root = _mnist_root(tmp_path)
    raw = root / "MNIST" / "raw"
    labels = np.frombuffer(
        gzip.decompress((raw / "train-labels-idx1-ubyte.gz").read_bytes())[8:], np.uint8
    )
    np.save(raw / ".train-labels-idx1-ubyte.gz.npy", (labels + 1) % 10)  # newer than the archive
    assert np.array_equal(load_dataset("mnist", root, download=False)[1].numpy(), labels)


def test_root_that_is_a_file(tmp_path, monkeypatch):
    source = _mnist_root(tmp_path, "source")
    root = tmp_path / "a_file"
    root.write_text("not a folder\n")
    with pytest.raises(DataUnavailable) as e:
        ensure_dataset("mnist", root, source=source)
    assert _one_line(e) == f"dataset.root={root}: not a directory"
    monkeypatch.setenv("DPSGD_DATA_ROOT", str(root))
    with pytest.raises(DataUnavailable) as e:
        load_dataset("mnist", source=source)
    assert _one_line(e) == f"DPSGD_DATA_ROOT={root}: not a directory"
    assert root.read_text() == "not a folder\n"


def test_root_that_cannot_be_created(tmp_path):
    source = _mnist_root(tmp_path, "source")
    (tmp_path / "a_file").write_text("")
    root = tmp_path / "a_file" / "data"
    with pytest.raises(DataUnavailable) as e:
        ensure_dataset("mnist", root, source=source)
    assert _one_line(e).startswith(f"dataset.root={root}: cannot be created (")


def test_unwritable_root_is_one_line_and_leaves_nothing(tmp_path, monkeypatch):
    """A read-only root (simulated: this suite may run as root, where file modes do not bind)."""
    source = _mnist_root(tmp_path, "source")
    root = tmp_path / "root"
    root.mkdir()

    def refuse(src, dst, **kw):
        raise PermissionError(13, "Permission denied", str(dst))

    monkeypatch.setattr(shutil, "copyfile", refuse)
    with pytest.raises(DataUnavailable) as e:
        ensure_dataset("mnist", root, source=source, download=False)
    msg = _one_line(e)
    assert msg.startswith(f"dataset.root={root}: cannot copy ") and "Permission denied" in msg
    assert list(root.iterdir()) == []  # the MNIST/raw it made is gone


def test_bad_copy_from_source_is_removed_and_named(tmp_path):
    source = _mnist_root(tmp_path, "source")
    _replace(source / "MNIST" / LABELS, _shifted_labels_gz(source / "MNIST" / LABELS))
    before = sorted(p.name for p in (source / "MNIST" / "raw").iterdir())
    root = tmp_path / "new" / "root"
    with pytest.raises(DataUnavailable) as e:
        ensure_dataset("mnist", root, source=source, download=False)
    assert (
        f"{source / 'MNIST' / LABELS} (from DPSGD_DATA_SOURCE={source}) fails its md5 check"
        in _one_line(e)
    )
    assert not (tmp_path / "new").exists()  # everything this attempt made is gone
    assert sorted(p.name for p in (source / "MNIST" / "raw").iterdir()) == before


def test_failed_download_names_its_cause_and_removes_what_it_created(tmp_path, monkeypatch):
    """A real torchvision download through a closed local port (no network needed)."""
    pytest.importorskip("torchvision")
    for k in ("http_proxy", "https_proxy", "HTTP_PROXY", "HTTPS_PROXY"):
        monkeypatch.setenv(k, "http://127.0.0.1:9")
    for k in ("no_proxy", "NO_PROXY"):
        monkeypatch.delenv(k, raising=False)
    monkeypatch.setattr(urllib.request, "_opener", None)  # urlopen's opener reads the proxies anew
    root = tmp_path / "fresh" / "root"
    with pytest.raises(DataUnavailable) as e:
        ensure_dataset("mnist", root, source=tmp_path / "none")
    msg = _one_line(e)
    assert (
        "the download failed (Error downloading train-images-idx3-ubyte.gz: <urlopen error" in msg
    ), msg
    assert not (tmp_path / "fresh").exists()


def test_failed_download_keeps_what_existed(tmp_path, monkeypatch):
    tvd = pytest.importorskip("torchvision.datasets")
    root = tmp_path / "root"
    (root / "MNIST").mkdir(parents=True)
    (root / "MNIST" / "notes.txt").write_text("mine\n")
    (root / "other.txt").write_text("mine too\n")

    class Failing:
        def __init__(self, root, train, download):
            raw = Path(root) / "MNIST" / "raw"
            raw.mkdir(parents=True, exist_ok=True)
            (raw / "train-images-idx3-ubyte.gz").write_bytes(b"\x1f\x8b partial")
            raise RuntimeError("") from urllib.error.URLError("no route to the mirror")

    monkeypatch.setattr(tvd, "MNIST", Failing)
    with pytest.raises(DataUnavailable) as e:
        ensure_dataset("mnist", root, source=tmp_path / "none")
    assert _one_line(e).endswith(
        "needs network)), and the download failed (<urlopen error no route to the mirror>)"
    )
    assert sorted(str(p.relative_to(root)) for p in root.rglob("*")) == [
        "MNIST",
        "MNIST/notes.txt",
        "other.txt",
    ]


@pytest.mark.parametrize(
    "err, expected",
    [
        (
            RuntimeError(
                "Error downloading x.gz:\nTried https://m/, got:\n<urlopen error refused>\n"
            ),
            "Error downloading x.gz: <urlopen error refused>",
        ),
        (RuntimeError("disk full"), "disk full"),
        (RuntimeError(), "RuntimeError"),
    ],
)
def test_reason_is_the_first_informative_line(err, expected):
    assert _reason(err) == expected


def test_reason_walks_cause_and_context():
    try:
        try:
            raise OSError("inner cause")
        except OSError:
            raise RuntimeError("")
    except RuntimeError as e:
        assert _reason(e) == "inner cause"


def test_trainer_refuses_a_truncated_archive_before_making_a_run_dir(tmp_path):
    root = _mnist_root(tmp_path)
    path = root / "MNIST" / IMAGES
    _replace(path, path.read_bytes()[:4096])
    (tmp_path / "empty_source").mkdir()
    env = {k: v for k, v in os.environ.items() if not k.startswith("HYDRA_")}
    env.update(
        DPSGD_DATA_ROOT=str(root),
        DPSGD_DATA_SOURCE=str(tmp_path / "empty_source"),
        PYTHONPATH=str(REPO) + os.pathsep + env.get("PYTHONPATH", ""),
    )
    run = tmp_path / "run"
    res = subprocess.run(
        [
            sys.executable,
            "-m",
            "dpsgd.train",
            "dataset.subset=600",
            "privacy.lot_size=60",
            f"hydra.run.dir={run}",
        ],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=180,
    )
    assert res.returncode == 2, res.stderr[-2000:]
    err = res.stderr.strip().splitlines()
    assert (
        len(err) == 1
        and err[0].startswith("error: dataset.root=")
        and "fails its md5 check" in err[0]
    )
    assert not run.exists()
