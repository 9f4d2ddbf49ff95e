"""Public pretrained weights as a hash-checked artifact (Abadi et al. 2016, §5.3).

The paper's CIFAR-10 run trains its convolutional layers on CIFAR-100, "treated as public", and then
trains only the fully connected layers with DP-SGD. ``python -m dpsgd.pretrain`` writes that
artifact:

    <name>.pt     a ``torch.save`` of {parameter name: tensor} (e.g. ``features.0.weight``)
    <name>.json   its sidecar: {"sha256": SHA-256 of <name>.pt, "tensors": {name: shape}, "source",
                  "config" (the pretraining run's resolved config), accuracies, ...}

A DP run names it with ``model.pretrained=<name>.pt``; ``verify`` (called by ``config.validate``,
before anything is written) refuses a missing file, a missing sidecar and a file whose SHA-256
differs from its sidecar's or from ``model.pretrained_sha256``, and tensors holding NaN or ±inf,
each in one line naming the key. The hash enters
the run's fingerprint, so a resume with a changed artifact is refused. ``load`` hashes the very
bytes it deserialises again (the file may have changed since ``verify``).
"""

from __future__ import annotations

import hashlib
import io
import json
import math
import os
from pathlib import Path

import torch

from dpsgd.core.errors import ConfigError, Diverged
from dpsgd.core.fileio import atomic_write_bytes, atomic_write_text, json_text

SOURCE = "pretrained on CIFAR-100, treated as public as in the paper §5.3 (its cost is not charged)"


def sidecar(path: str | Path) -> Path:
    return Path(path).with_suffix(".json")


def relative(path: str | Path) -> str:
    """``path`` as results record it: relative to the working directory when it lies below it."""
    p = Path(path)
    try:
        return str(p.resolve().relative_to(Path.cwd().resolve()))
    except ValueError:
        return str(p)


def _read(
    path: str | Path, expected: str | None, key: str = "model.pretrained"
) -> tuple[bytes, str]:
    """The artifact's bytes and SHA-256, checked against its sidecar and ``expected``; else
    ConfigError."""
    p = Path(path)
    hint = "build it with make data/pretrained/cifar100_convs.pt (python -m dpsgd.pretrain)"
    if not p.is_file():
        raise ConfigError(f"{key}={path}: no such file; {hint}")
    try:
        data = p.read_bytes()
        meta = json.loads(sidecar(p).read_text())
        recorded = meta["sha256"]
    except FileNotFoundError:
        raise ConfigError(
            f"{key}={path}: no sidecar {sidecar(p).name} recording its SHA-256; {hint}"
        ) from None
    except (OSError, ValueError, KeyError, TypeError) as e:
        raise ConfigError(
            f"{key}={path}: unreadable artifact or sidecar ({type(e).__name__}: {e})"
        ) from None
    sha = hashlib.sha256(data).hexdigest()
    if sha != recorded:
        raise ConfigError(
            f"{key}={path}: SHA-256 {sha[:12]}… differs from its sidecar's {str(recorded)[:12]}… "
            f"(changed or truncated); {hint}"
        )
    if expected is not None and sha != expected:
        raise ConfigError(
            f"model.pretrained_sha256={expected}: differs from {path}'s SHA-256 {sha}"
        )
    return data, sha


def _tensors(data: bytes, path) -> dict[str, torch.Tensor]:
    try:
        state = torch.load(io.BytesIO(data), map_location="cpu", weights_only=True)
    except Exception as e:  # not a torch file, pickled code refused by weights_only, ...
        raise ConfigError(
            f"model.pretrained={path}: not a tensor artifact ({str(e).splitlines()[0]})"
        ) from None
    if (
        not isinstance(state, dict)
        or not state
        or not all(isinstance(k, str) and isinstance(v, torch.Tensor) for k, v in state.items())
    ):
        raise ConfigError(
            f"model.pretrained={path}: must hold a non-empty {{parameter name: tensor}} dict"
        )
    for n, t in state.items():  # a matching hash says the file is unchanged, not that it is usable
        if (t.is_floating_point() or t.is_complex()) and not bool(torch.isfinite(t).all()):
            bad = int((~torch.isfinite(t)).sum())
            raise ConfigError(
                f"model.pretrained={path}: tensor {n} holds {bad} non-finite value(s) (NaN or "
                "±inf); rebuild the artifact (python -m dpsgd.pretrain)"
            )
    return state


def verify(path: str | Path, expected: str | None = None) -> tuple[dict[str, tuple], str]:
    """({tensor name: shape}, SHA-256) of a verified artifact; ConfigError in one line otherwise."""
    data, sha = _read(path, expected)
    return {n: tuple(t.shape) for n, t in _tensors(data, path).items()}, sha


def load(model: torch.nn.Module, path: str | Path, sha256: str, frozen: list[str]) -> None:
    """Copy the artifact's tensors into ``model`` (hash re-checked) and freeze ``frozen``
    (requires_grad=False: the clipper then neither clips nor noises them, and k excludes them)."""
    state = _tensors(_read(path, sha256)[0], path)
    target = model.state_dict(keep_vars=True)  # parameters and buffers, by name
    params = dict(model.named_parameters())
    with torch.no_grad():
        for n, t in state.items():
            target[n].copy_(t)
    for n in frozen:
        params[n].requires_grad_(False)


def save(path: str | Path, tensors: dict[str, torch.Tensor], meta: dict) -> str:
    """Write the artifact and (after it) its sidecar, atomically; returns the SHA-256. Non-finite
    weights are refused (``Diverged``) before anything is written: ``load`` would refuse them
    anyway."""
    for n, t in tensors.items():
        if (t.is_floating_point() or t.is_complex()) and not bool(torch.isfinite(t).all()):
            raise Diverged(
                f"{path}: tensor {n} holds {int((~torch.isfinite(t)).sum())} non-finite value(s) "
                "(NaN or ±inf); not written (lower training.lr and pretrain again)"
            )
    buf = io.BytesIO()
    torch.save({n: t.detach().cpu().clone() for n, t in tensors.items()}, buf)
    data = buf.getvalue()
    sha = hashlib.sha256(data).hexdigest()
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    atomic_write_bytes(Path(path), data)
    meta = {
        k: None if isinstance(v, float) and not math.isfinite(v) else v for k, v in meta.items()
    }  # nan: not measured
    side = {
        "sha256": sha,
        "tensors": {n: list(t.shape) for n, t in tensors.items()},
        "source": SOURCE,
        **meta,
    }
    atomic_write_text(sidecar(path), json_text(side) + os.linesep)  # strict JSON
    return sha
