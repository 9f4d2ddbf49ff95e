"""``make wheelhouse``: the wheels and archives that ``make gpu-check`` needs on a machine without
network.

    python -m bench.wheelhouse                 # -> .whl/ (git-ignored), then prints its size
    python -m bench.wheelhouse --dest /tmp/w   # elsewhere

A stock CUDA PyTorch image (the GPU machines we target: Python 3.12 with torch, numpy, scipy,
pandas, matplotlib, pytest, joblib, mpmath, absl-py, PyYAML, packaging, wrapt, opt-einsum) lacks the
packages in ``WHEELS``. Each is fetched with ``pip download --no-deps`` (every dependency named
here, none resolved by pip) at the version pinned in requirements.lock (Opacus, not a project
dependency, at ``make bench``'s pin ``OPACUS``), as manylinux x86_64 wheels for CPython 3.12 (the
target image) and 3.11 (this machine, for the CPU rehearsal ``make gpu-check DEVICE=cpu``): a
pure-Python wheel serves both, a compiled one (dm-tree) is fetched once per Python. A package
published only as a source archive (antlr4-python3-runtime 4.9.3) is built here into a pure wheel,
so that the offline install never builds anything. torch is never downloaded: the image's is used
and recorded.

Details: docs/PERFORMANCE.md, "bench/wheelhouse.py".
"""

from __future__ import annotations

import argparse
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
LOCK = REPO / "requirements.lock"
OPACUS = "1.6.0"  # make bench's pin (Makefile); opacus is no dependency of the project
MAX_MIB = 60.0  # wheels + MNIST archives: they travel with the checkout (device tool: 64 MiB)
PYTHONS = ("3.12", "3.11")  # the GPU image's Python, then this machine's (the CPU rehearsal)
PLATFORMS = (
    "manylinux_2_28_x86_64",
    "manylinux_2_27_x86_64",
    "manylinux_2_24_x86_64",
    "manylinux_2_17_x86_64",
    "manylinux2014_x86_64",
    "manylinux1_x86_64",
)
# distribution -> (the import names it provides, why the project needs it)
WHEELS = {
    "hydra-core": (("hydra",), "configuration and command line of every run"),
    "omegaconf": (("omegaconf",), "Hydra's config objects"),
    "antlr4-python3-runtime": (("antlr4",), "Hydra's and OmegaConf's override grammar"),
    "dp-accounting": (("dp_accounting",), "the tests' independent reference accountant"),
    "dm-tree": (("tree",), "dp-accounting's; compiled, one wheel per Python"),
    "attrs": (("attr", "attrs"), "dp-accounting's, which requires attrs < 24"),
    "kymatio": (("kymatio",), "ScatterNet features"),
    "appdirs": (("appdirs",), "kymatio's"),
    "configparser": (
        (),
        "kymatio's; a backport in the namespace backports, the standard library's stays",
    ),
    "opacus": (("opacus",), "the step benchmark's comparison (Opacus hooks and ghost)"),
}
DATA_FILES = (
    "train-images-idx3-ubyte.gz",
    "train-labels-idx1-ubyte.gz",
    "t10k-images-idx3-ubyte.gz",
    "t10k-labels-idx1-ubyte.gz",
)


def canonical(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def pins(lock: Path = LOCK) -> dict[str, str]:
    """``WHEELS``' distribution -> version: requirements.lock's pin (Opacus: ``OPACUS``)."""
    locked = {}
    for line in lock.read_text().splitlines():
        if "==" in line and not line.lstrip().startswith("#"):
            name, version = line.split("#")[0].strip().split("==")
            locked[canonical(name)] = version.strip()
    locked.setdefault("opacus", OPACUS)
    missing = [d for d in WHEELS if d not in locked]
    if missing:
        raise SystemExit(f"error: {lock}: no pin for {', '.join(missing)}")
    return {d: locked[d] for d in WHEELS}


def size_mib(folder: Path) -> float:
    return sum(p.stat().st_size for p in folder.rglob("*") if p.is_file()) / 2**20


def _pip(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "pip", *args], capture_output=True, text=True)


def fetch(dist: str, version: str, dest: Path) -> list[str]:
    """Download the wheels of ``dist==version`` for every Python of ``PYTHONS`` into ``dest`` (a
    pure wheel once), else build a pure wheel from its source archive; returns the files it
    added."""
    spec, before = f"{dist}=={version}", set(dest.iterdir())
    plat = [a for p in PLATFORMS for a in ("--platform", p)]
    for py in PYTHONS:
        r = _pip(
            "download",
            "-q",
            "--no-deps",
            "--only-binary=:all:",
            "--python-version",
            py,
            "--implementation",
            "cp",
            *plat,
            "-d",
            str(dest),
            spec,
        )
        if r.returncode != 0:
            break
    else:
        return sorted(p.name for p in set(dest.iterdir()) - before)
    # no wheel on the index: build one from the source archive (here, with network), pure Python
    # only
    before = set(dest.iterdir())
    r = _pip("wheel", "-q", "--no-deps", "--no-binary", dist, "-w", str(dest), spec)
    built = [p for p in set(dest.iterdir()) - before if p.suffix == ".whl"]
    if r.returncode != 0 or len(built) != 1 or not built[0].name.endswith("-none-any.whl"):
        for p in built:
            p.unlink()
        tail = (r.stderr or r.stdout).strip().splitlines()[-1:] or ["no pure wheel built"]
        raise SystemExit(
            f"error: {spec}: no wheel for CPython {'/'.join(PYTHONS)} manylinux x86_64 on the "
            f"index, and building one from source failed: {tail[0]}"
        )
    return [f"{built[0].name} (built from the source archive)"]


def copy_mnist(dest: Path) -> Path:
    """The MNIST archives, md5-verified in the data root (seeded as ``python -m dpsgd.data mnist``),
    copied to ``dest/data/MNIST/raw``."""
    from dpsgd.data.archives import default_root, ensure_dataset

    print(ensure_dataset("mnist"), flush=True)
    raw = dest / "data" / "MNIST" / "raw"
    raw.mkdir(parents=True)
    for name in DATA_FILES:
        shutil.copyfile(default_root() / "MNIST" / "raw" / name, raw / name)
    return raw


def build(dest: Path) -> float:
    """Build the wheelhouse into ``dest`` (replacing it); returns its size in MiB."""
    versions = pins()
    tmp = dest.with_name(dest.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    for dist, version in versions.items():
        print(
            f"{dist}=={version} ({WHEELS[dist][1]}): {', '.join(fetch(dist, version, tmp))}",
            flush=True,
        )
    (tmp / "requirements.txt").write_text(
        "# written by python -m bench.wheelhouse: bench/gpu_check.py installs these, offline, "
        "--no-deps\n" + "".join(f"{d}=={v}\n" for d, v in versions.items())
    )
    copy_mnist(tmp)
    mib = size_mib(tmp)
    old = dest.with_name(dest.name + ".old")
    shutil.rmtree(old, ignore_errors=True)
    if dest.exists():
        os.replace(dest, old)
    os.replace(tmp, dest)
    shutil.rmtree(old, ignore_errors=True)
    return mib


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(
        prog="python -m bench.wheelhouse", description=__doc__.split("\n\n")[0]
    )
    ap.add_argument(
        "--dest", default=str(REPO / ".whl"), help="the wheelhouse folder (default .whl/)"
    )
    a = ap.parse_args(argv)
    dest = Path(a.dest).resolve()
    mib = build(dest)
    wheels = sorted(p.name for p in dest.glob("*.whl"))
    print(
        f"{dest}: {len(wheels)} wheels + MNIST archives = {mib:.1f} MiB (limit {MAX_MIB:.0f} MiB)"
    )
    if mib >= MAX_MIB:
        print(
            f"error: {dest} is {mib:.1f} MiB, over the {MAX_MIB:.0f} MiB that may travel",
            file=sys.stderr,
        )
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
