"""Obtaining the dataset files: seeding the data root, md5 verification, and ``python -m
dpsgd.data``.

The data root is ``dataset.root`` in the config, else ``$DPSGD_DATA_ROOT``, else ``<repo>/data``.
When it lacks the archives and a local source holds them (``$DPSGD_DATA_SOURCE``, else
``<repo>/../shared/data`` when that exists) they are copied in (the source is only read); otherwise
torchvision downloads them. ``python -m dpsgd.data`` (``main``) seeds the root and reports what it
verified (without names: MNIST and Fashion-MNIST, and CIFAR-10/100 when the root or the source
already holds them). A dataset found nowhere is one line naming it and both ways to provide it
(``how_to_provide``).

Integrity: every file the loaders read is checked against its publisher's md5 (``EXPECTED_MD5`` in
``dpsgd/data/datasets.py``) on every load (a fresh process hashes again; within one process a
verified digest is remembered while the file keeps its inode, size and mtime). A file in the root
that fails is refused with one line naming it, never replaced. A copy is atomic (temporary file,
fsync, rename), and a failed copy, extraction or download removes what it created under the root,
and only that (``_Undo``).
"""

from __future__ import annotations

import argparse
import hashlib
import os
import shutil
import sys
import tarfile
import zlib
from pathlib import Path

from dpsgd.data.datasets import DATASETS, EXPECTED_ARCHIVE_MD5, EXPECTED_MD5, DataUnavailable

REPO = Path(__file__).resolve().parents[2]


def default_root() -> Path:
    return Path(os.environ.get("DPSGD_DATA_ROOT") or REPO / "data")


def default_source() -> Path | None:
    src = os.environ.get("DPSGD_DATA_SOURCE")
    if src:
        return Path(src)
    shared = REPO.parent / "shared" / "data"
    return shared if shared.is_dir() else None


_DIGESTS: dict[
    tuple, object
] = {}  # (kind, path, device, inode, size, mtime_ns) -> digest, this process only


def _memo(kind: str, path: Path, compute):
    """``compute(path)``, remembered for this process while the file keeps its inode, size and
    mtime."""
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
    return DataUnavailable(
        f"{label}={root}: {files} {verb} md5 check (truncated, corrupted or altered); delete "
        f"{'it' if len(bad) == 1 else 'them'} and re-seed with python -m dpsgd.data {name}"
    )


def _verified(name: str, root: Path, label: str) -> list[str]:
    """The expected files missing under ``root``; raises if one that is there fails its md5
    check."""
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
    """One line for a failure: its first message line, completed (when that line only announces what
    follows, e.g. torchvision's "Error downloading x.gz:") by the first detail below it, in the
    message's later lines or along ``__cause__`` / ``__context__`` (e.g. the URLError's reason)."""
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
    """Removes what a failed seeding attempt created under the data root, and nothing that existed
    before it."""

    def __init__(self, name: str, root: Path):
        self.top = None  # the highest folder on the way to ``root`` that does not exist yet
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
                    p.rmdir()  # created by the attempt; holds only what the attempt created
                else:
                    p.unlink()
            except OSError:
                pass


def _copy_verified(
    name: str, src: Path, dst: Path, md5: str, label: str, root: Path, source: Path
) -> None:
    try:
        _copy_atomic(src, dst)
    except OSError as e:
        raise DataUnavailable(f"{label}={root}: cannot copy {src} there ({_reason(e)})") from None
    if _md5(dst) != md5:
        dst.unlink()
        raise DataUnavailable(
            f"{label}={root}: {src} (from DPSGD_DATA_SOURCE={source}) fails its md5 check; "
            f"replace it in the source, then run python -m dpsgd.data {name}"
        )


def _extract(archive: Path, md5: str, label: str, root: Path) -> None:
    """Extract a CIFAR tar archive that passes its md5 check (one that fails is refused, never
    replaced)."""
    if _md5(archive) != md5:
        raise DataUnavailable(
            f"{label}={root}: {archive.name} fails its md5 check (truncated, corrupted or "
            "altered); delete it and re-seed with python -m dpsgd.data"
        )
    try:
        with tarfile.open(archive, "r:gz") as tar:
            tar.extractall(root, filter="data")
    except (OSError, EOFError, zlib.error, tarfile.TarError) as e:
        raise DataUnavailable(f"{label}={root}: cannot extract {archive} ({_reason(e)})") from None


def _seed(
    name: str, root: Path, source: Path | None, download: bool, label: str, missing: list[str]
) -> str | None:
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
                _copy_verified(
                    name,
                    source / folder / rel,
                    root / folder / rel,
                    EXPECTED_MD5[name][rel],
                    label,
                    root,
                    source,
                )
            return f"copied {len(missing)} files from {source / folder} to {root / folder}"
        if name in EXPECTED_ARCHIVE_MD5 and (source / EXPECTED_ARCHIVE_MD5[name][0]).is_file():
            archive_name, md5 = EXPECTED_ARCHIVE_MD5[name]
            if not (root / archive_name).is_file():
                _copy_verified(
                    name, source / archive_name, root / archive_name, md5, label, root, source
                )
            _extract(root / archive_name, md5, label, root)
            return f"copied {source / archive_name} to {root} and extracted it"
    if not download:
        return None
    try:
        import torchvision.datasets as tvd

        cls = {
            "mnist": tvd.MNIST,
            "fashion_mnist": tvd.FashionMNIST,
            "cifar10": tvd.CIFAR10,
            "cifar100": tvd.CIFAR100,
        }[name]
        cls(str(root), train=True, download=True)
        cls(str(root), train=False, download=True)
    except Exception as e:  # no network, mirror down, disk full, ...
        raise DataUnavailable(
            f"{label}={root}: {name} not found there, nor under DPSGD_DATA_SOURCE={source} "
            f"({how_to_provide(name)}), and the download failed ({_reason(e)})"
        ) from None
    return f"downloaded to {root}"


def how_to_provide(name: str) -> str:
    """The two ways to provide ``name``, in one clause (for the one-line 'not found' errors)."""
    folder = DATASETS[name].folder
    what = (
        f"{EXPECTED_ARCHIVE_MD5[name][0]} or its {folder}/ folder"
        if name in EXPECTED_ARCHIVE_MD5
        else f"its {folder}/raw/*.gz archives"
    )
    return (
        f"put {what} under $DPSGD_DATA_SOURCE or the data root, or allow the download "
        "(dataset.download=true, needs network)"
    )


def has_local_copy(
    name: str, root: str | Path | None = None, source: str | Path | None = None
) -> bool:
    """Whether the root or the source holds ``name`` (its folder or archive), unverified: what
    ``python -m dpsgd.data`` without names seeds besides MNIST (CIFAR only when present locally)."""
    places = [Path(root) if root else default_root()]
    src = Path(source) if source else default_source()
    places += [src] if src is not None else []
    names = [DATASETS[name].folder] + (
        [EXPECTED_ARCHIVE_MD5[name][0]] if name in EXPECTED_ARCHIVE_MD5 else []
    )
    return any((p / n).exists() for p in places for n in names)


def ensure_dataset(
    name: str,
    root: str | Path | None = None,
    source: str | Path | None = None,
    download: bool = True,
) -> str:
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
    raise DataUnavailable(
        f"{label}={root}: {name} not found there, nor under DPSGD_DATA_SOURCE={source}"
        + ("" if download else ", and downloads are off (dataset.download=false)")
        + f"; {how_to_provide(name)}"
    )


def main(argv=None) -> int:
    p = argparse.ArgumentParser(
        prog="python -m dpsgd.data",
        description="Seed the data root from a local source (or download) and verify its md5s.",
    )
    p.add_argument(
        "names",
        nargs="*",
        metavar="NAME",
        help=f"datasets among {sorted(DATASETS)} (default: mnist fashion_mnist, and cifar10 "
        "cifar100 when the root or the source holds them)",
    )
    p.add_argument(
        "--root", default=None, help="data root (default $DPSGD_DATA_ROOT or <repo>/data)"
    )
    p.add_argument(
        "--source", default=None, help="local source (default $DPSGD_DATA_SOURCE or ../shared/data)"
    )
    p.add_argument("--no-download", action="store_true", help="never use the network")
    a = p.parse_args(argv)
    status = 0
    names = a.names or ["mnist", "fashion_mnist"] + [
        n for n in ("cifar10", "cifar100") if has_local_copy(n, a.root, a.source)
    ]
    for name in names:
        if name not in DATASETS:
            print(
                f"error: {name!r}: unknown dataset, must be one of {sorted(DATASETS)}",
                file=sys.stderr,
            )
            status = 2
            continue
        try:
            print(ensure_dataset(name, a.root, a.source, download=not a.no_download))
        except DataUnavailable as e:
            print(f"error: {e}", file=sys.stderr)
            status = 2
    return status
