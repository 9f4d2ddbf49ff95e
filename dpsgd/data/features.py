"""Fixed input features: the 2-D wavelet scattering transform (ScatterNet) of Tramèr & Boneh 2021.

Tramèr & Boneh, "Differentially Private Learning Needs Better Features (or Much More Data)", ICLR
2021 (arXiv 2011.11660), train linear models and small CNNs on the scattering coefficients of
Oyallon & Mallat 2015 instead of pixels. The transform has no parameters learned from data:

* ``model.features=scatter``: kymatio's ``Scattering2D`` with J = 2 scales and L = 8 orientations;
  a 28×28 image gives 1 + J·L + L²·J(J−1)/2 = 81 channels of 7×7 (each spatially subsampled by 2^J);
* ``model.feature_norm=group``: each example's 81 channels normalised in G groups
  (``model.feature_groups``, Tramèr & Boneh use G = 27) to zero mean and unit variance over the
  group's channels and positions, ``torch.nn.GroupNorm(G, 81, affine=False)``. It uses statistics of
  the example alone, so it is a fixed per-example map like the scattering itself: it costs no
  privacy and is applied here, once.

Privacy: a fixed per-example map of the inputs changes nothing in the analysis of DP-SGD (the
neighbouring datasets still differ in one example); no ledger entry is made.

Details: docs/FRONTIER.md, "dpsgd/data/features.py".
"""

from __future__ import annotations

import hashlib
import io
import json
from pathlib import Path

import torch

from dpsgd.core.console import progress
from dpsgd.core.fileio import atomic_write_bytes

FEATURES = ("none", "scatter")  # model.features
FEATURE_NORMS = ("none", "group")  # model.feature_norm
SCATTER_J, SCATTER_L = 2, 8  # Tramèr & Boneh 2021 (their data.py: Scattering2D(J=2), L = 8 default)
CACHE_FORMAT = 1


def scatter_channels(in_channels: int = 1, J: int = SCATTER_J, L: int = SCATTER_L) -> int:
    """Channels of the order-2 scattering transform: (1 + J·L + L²·J(J−1)/2) per input channel."""
    return in_channels * (1 + J * L + L * L * J * (J - 1) // 2)


def feature_shape(kind: str, image_shape: tuple[int, ...]) -> tuple[int, ...]:
    """The shape of one example after ``model.features`` (``image_shape`` is C×H×W or a flat
    784)."""
    if kind == "none":
        return tuple(image_shape)
    c, h, w = _chw(image_shape)
    return (scatter_channels(c), h // 2**SCATTER_J, w // 2**SCATTER_J)


def _chw(shape) -> tuple[int, int, int]:
    if len(shape) == 1:  # flat MNIST-style images: 784 = 1×28×28
        side = int(round(shape[0] ** 0.5))
        if side * side != shape[0]:
            raise ValueError(
                f"model.features=scatter: a flat input of {shape[0]} values is not a square image"
            )
        return 1, side, side
    if len(shape) != 3:
        raise ValueError(f"model.features=scatter: needs C×H×W images, got shape {tuple(shape)}")
    return tuple(int(s) for s in shape)


def scatter(X: torch.Tensor, batch_size: int = 1000) -> torch.Tensor:
    """Scattering coefficients (n × 81C × H/4 × W/4, float32) of images X (n × C × H × W or n ×
    H·W)."""
    from kymatio.scattering2d.frontend.torch_frontend import (
        ScatteringTorch2D,
    )  # kymatio.torch needs scipy < 1.14

    c, h, w = _chw(tuple(X.shape[1:]))
    X = X.reshape(len(X), c, h, w)
    S = ScatteringTorch2D(J=SCATTER_J, shape=(h, w), L=SCATTER_L)
    out = torch.empty(len(X), scatter_channels(c), h // 4, w // 4)
    starts = range(0, len(X), batch_size)
    # a bar on a terminal only (core/console.py:progress): the full MNIST set takes minutes
    with torch.no_grad(), progress(starts, desc="scatter features", unit="batch") as batches:
        for s in batches:
            xb = X[s : s + batch_size]
            out[s : s + len(xb)] = S(xb.contiguous()).reshape(len(xb), -1, h // 4, w // 4)
    return out


def size_text(n: int) -> str:
    """A byte count as people read it: '952 MB', '3.1 GB', '12 kB', '300 B' (powers of 1000)."""
    for unit, scale in (("GB", 1e9), ("MB", 1e6), ("kB", 1e3)):
        if n >= scale:
            v = n / scale
            return f"{v:.1f} {unit}" if v < 10 else f"{v:.0f} {unit}"
    return f"{n} B"


def group_norm(F: torch.Tensor, groups: int) -> torch.Tensor:
    """Per-example GroupNorm without learned parameters (Tramèr & Boneh's ``nn.GroupNorm(G, K,
    affine=False)``)."""
    return torch.nn.functional.group_norm(F, groups, eps=1e-5)


def cache_key(dataset: str, split: str, n: int) -> dict:
    """What the cached (unnormalised) scattering coefficients of the first n images of a split
    depend on."""
    from kymatio import __version__ as kymatio_version

    from dpsgd.data.datasets import EXPECTED_MD5

    return {
        "format": CACHE_FORMAT,
        "transform": "scattering2d",
        "J": SCATTER_J,
        "L": SCATTER_L,
        "dataset": dataset,
        "archives_md5": dict(sorted(EXPECTED_MD5[dataset].items())),
        "split": split,
        "n": int(n),
        "kymatio": kymatio_version,
    }


def _digest(t: torch.Tensor) -> str:
    return hashlib.sha256(t.contiguous().numpy().tobytes()).hexdigest()


def _cache_path(root: Path, key: dict) -> Path:
    name = hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()[:20]
    return (
        root
        / "features"
        / f"{key['transform']}_{key['dataset']}_{key['split']}{key['n']}_{name}.pt"
    )


def _load_cache(path: Path, key: dict) -> torch.Tensor | None:
    """The features of a cache file whose key and content hash match; None (with a line)
    otherwise."""
    if not path.is_file():
        return None
    try:
        state = torch.load(path, map_location="cpu", weights_only=True)
        ok = state["key"] == key and state["sha256"] == _digest(state["features"])
    except Exception as e:  # noqa: BLE001 (truncated, not a torch file, missing keys: recompute)
        print(f"features: {path}: unreadable ({type(e).__name__}); recomputing", flush=True)
        return None
    if not ok:
        print(f"features: {path}: key or content hash mismatch; recomputing", flush=True)
        return None
    return state["features"]


def _save_cache(path: Path, key: dict, F: torch.Tensor) -> None:
    buf = io.BytesIO()
    torch.save({"key": key, "sha256": _digest(F), "features": F}, buf)
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        atomic_write_bytes(
            path, buf.getvalue()
        )  # a write failing part way leaves no temporary file
    except (
        OSError
    ) as e:  # a read-only data root or a full disk: no cache, the features are still right
        print(f"features: cannot cache to {path} ({e.strerror or e})", flush=True)
        return
    print(f"features: wrote {size_text(buf.getbuffer().nbytes)} cache to {path}", flush=True)


def cached_scatter(X: torch.Tensor, dataset: str, split: str, root: Path | None) -> torch.Tensor:
    """Scattering coefficients of X (the first len(X) images of ``split``), from the cache when it
    holds them (the split's full set sliced, or exactly these), else computed and cached."""
    from dpsgd.data.datasets import DATASETS

    if root is None:
        return scatter(X)
    n_full = DATASETS[dataset].n_train if split == "train" else DATASETS[dataset].n_test
    # a small subset is cheaper to compute than the full split's cache is to load and hash
    for n in dict.fromkeys((len(X),) if 10 * len(X) <= n_full else (len(X), n_full)):
        key = cache_key(dataset, split, n)
        F = _load_cache(_cache_path(Path(root), key), key) if n >= len(X) else None
        if F is not None:
            return F[: len(X)].clone() if n > len(X) else F
    key = cache_key(dataset, split, len(X))
    F = scatter(X)
    _save_cache(_cache_path(Path(root), key), key, F)
    return F


def transform(
    kind: str,
    Xtr: torch.Tensor,
    Xte: torch.Tensor,
    *,
    dataset: str,
    root: Path | None,
    norm: str = "group",
    groups: int = 27,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(train, test) features of ``model.features`` (``none``: the inputs unchanged), cached under
    ``root``."""
    if kind == "none":
        return Xtr, Xte
    if kind != "scatter":
        raise ValueError(f"model.features={kind!r}: must be one of {list(FEATURES)}")
    if norm not in FEATURE_NORMS:
        raise ValueError(f"model.feature_norm={norm!r}: must be one of {list(FEATURE_NORMS)}")
    Ftr, Fte = (
        cached_scatter(X, dataset, split, root) for X, split in ((Xtr, "train"), (Xte, "test"))
    )
    if norm == "group":
        Ftr, Fte = group_norm(Ftr, groups), group_norm(Fte, groups)
    return Ftr, Fte
