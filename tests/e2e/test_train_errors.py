"""The train command's failures outside the sweep machinery end in one line naming the parameter or
the file, with the exit code of its kind (2 bad input, 1 a disk error), and nothing already written
is lost: an augmentation multiplicity too large for memory (dpsgd/config/privacy.py), a pretrained
artifact with non-finite weights (dpsgd/models/pretrained.py), a full disk during a write
(dpsgd/core/fileio.py) or during a resumed run. In-process.
"""

from __future__ import annotations

import errno
import hashlib
import io
import json
import os
from pathlib import Path

import pytest
import torch

from conftest import TINY_RUN, snapshot
from dpsgd import train as training
from dpsgd.launch.main import train_main
from dpsgd.config.privacy import AUGMENT_MULTIPLICITY_MAX, ROWS_PER_PASS_MAX
from dpsgd.config.schema import ConfigError, validate
from dpsgd.core import fileio
from dpsgd.core.errors import Diverged
from dpsgd.launch import main as T
from dpsgd.models import pretrained
from dpsgd.models.networks import CifarCNN

TINY = TINY_RUN
_snapshot = snapshot


def _main(capsys, argv: list[str]) -> tuple[int, str]:
    with pytest.raises(SystemExit) as e:
        train_main(argv)
    return e.value.code, capsys.readouterr().err


# ------------------------------------------------------------------ huge augmentation multiplicity
@pytest.mark.parametrize(
    "args, expect",
    [
        (
            ["privacy.augment_multiplicity=1000000"],
            f"privacy.augment_multiplicity=1000000: must be <= {AUGMENT_MULTIPLICITY_MAX}",
        ),
        (
            [f"privacy.augment_multiplicity={AUGMENT_MULTIPLICITY_MAX}", "privacy.lot_size=6000"],
            (
                f"more than ROWS_PER_PASS_MAX={ROWS_PER_PASS_MAX}; "
                "set a smaller privacy.physical_batch_size"
            ),
        ),
    ],
)
def test_a_huge_augmentation_multiplicity_is_refused_before_any_work(
    args, expect, tmp_path, monkeypatch, capsys
):
    monkeypatch.chdir(tmp_path)
    code, err = _main(capsys, [*args, f"hydra.run.dir={tmp_path / 'run'}"])
    assert (
        code == 2
        and err.count("\n") == 1
        and err.startswith("error: privacy.augment_multiplicity=")
    ), err
    assert expect in err
    assert list(tmp_path.iterdir()) == []


def test_a_large_multiplicity_in_small_physical_batches_is_accepted():
    c = validate(
        T.compose(
            [
                f"privacy.augment_multiplicity={AUGMENT_MULTIPLICITY_MAX}",
                "privacy.lot_size=6000",
                "privacy.physical_batch_size=64",
            ]
        )
    )
    assert c.privacy.augment_multiplicity == AUGMENT_MULTIPLICITY_MAX


# ----------------------------------------------------------- pretrained weights that are not finite
@pytest.mark.parametrize("bad", [float("nan"), float("inf")])
def test_a_pretrained_artifact_with_non_finite_weights_is_refused(
    bad, tmp_path, monkeypatch, capsys
):
    """Its hash matches its sidecar, but a tensor holds NaN or inf: refused at validation (before
    any folder) and again at load (the file is re-read), in one line naming model.pretrained and the
    file."""
    monkeypatch.chdir(tmp_path)
    state = {n: t for n, t in CifarCNN().state_dict().items() if n.startswith("features.")}
    state["features.3.weight"] = state["features.3.weight"].clone()
    state["features.3.weight"][0, 0, 0, 0] = bad
    artifact = tmp_path / "art" / "convs.pt"
    with pytest.raises(
        Diverged, match=r"convs.pt: tensor features.3.weight holds 1 non-finite value\(s\)"
    ):
        pretrained.save(artifact, state, {})  # pretraining never writes one ...
    assert not artifact.parent.exists() or not any(artifact.parent.iterdir())
    _write_artifact(artifact, state)  # ... but one can arrive from elsewhere, hash intact
    before = _snapshot(tmp_path)
    code, err = _main(
        capsys,
        [
            "experiment=cifar10_eps2",
            f"model.pretrained={artifact}",
            f"hydra.run.dir={tmp_path / 'run'}",
        ],
    )
    assert code == 2 and err.count("\n") == 1, err
    assert err.startswith(
        f"error: model.pretrained={artifact}: tensor features.3.weight holds 1 non-finite"
    ), err
    model = CifarCNN()
    weights = {n: t.clone() for n, t in model.state_dict().items()}
    sha = json.loads(pretrained.sidecar(artifact).read_text())["sha256"]
    with pytest.raises(
        ConfigError, match=r"^model.pretrained=\S+convs.pt: tensor features.3.weight holds 1 "
    ):
        pretrained.load(model, artifact, sha, [])
    assert all(
        torch.equal(weights[n], t) for n, t in model.state_dict().items()
    )  # exact: nothing copied
    assert _snapshot(tmp_path) == before


def _write_artifact(path, state) -> None:
    """An artifact and its sidecar written by hand (not by ``pretrained.save``), its hash intact."""
    buf = io.BytesIO()
    torch.save(state, buf)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(buf.getvalue())
    side = {
        "sha256": hashlib.sha256(buf.getvalue()).hexdigest(),
        "tensors": {n: list(t.shape) for n, t in state.items()},
    }
    pretrained.sidecar(path).write_text(json.dumps(side))


# ----------------------------------------------------------------------- a full disk names the file
def _enospc_on(monkeypatch, name: str) -> None:
    """fsync of a file whose name contains ``name`` fails as a full disk does (ENOSPC, no file
    name)."""
    real = os.fsync

    def fsync(fd):
        if name in os.readlink(f"/proc/self/fd/{fd}"):
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        return real(fd)

    monkeypatch.setattr(os, "fsync", fsync)


@pytest.mark.skipif(not Path("/proc/self/fd").is_dir(), reason="names an fd's file through /proc")
def test_a_full_disk_names_the_file_and_keeps_the_old_one(tmp_path, monkeypatch):
    target = tmp_path / "privacy.json"
    target.write_text("old\n")
    _enospc_on(monkeypatch, ".privacy.json.tmp")
    with pytest.raises(OSError) as e:
        fileio.write_json(target, {"new": 1})
    assert (e.value.errno, e.value.filename) == (errno.ENOSPC, str(target))
    assert target.read_text() == "old\n" and sorted(p.name for p in tmp_path.iterdir()) == [
        "privacy.json"
    ]
    monkeypatch.undo()
    with pytest.raises(FileExistsError) as e:  # the type follows the errno, as before
        fileio.atomic_write_text(target, "x", exclusive=True)
    assert e.value.filename == str(target)


@pytest.mark.skipif(not Path("/proc/self/fd").is_dir(), reason="names an fd's file through /proc")
@pytest.mark.parametrize("name", ["checkpoint.pt", "metrics.csv", "lots.reserved"])
def test_a_full_disk_during_a_run_is_one_line_naming_the_file(name, tmp_path, monkeypatch, capsys):
    """A resumed run whose next write finds the disk full: one line ``error: <file>: No space left
    on device``, exit 1, and the checkpoint it could resume from again is the one it started
    from."""
    run = tmp_path / "run"
    args = [*TINY, "training.epochs=1"]
    training.train(validate(T.compose(args)), run, args)
    ckpt = (run / "checkpoint.pt").read_bytes()
    _enospc_on(monkeypatch, name if name != "checkpoint.pt" else ".checkpoint.pt.tmp")
    with pytest.raises(SystemExit) as e:
        T.run_or_exit(T._resume, training.train, [f"resume={run}", "training.epochs=2"])
    monkeypatch.undo()
    err = capsys.readouterr().err
    assert e.value.code == 1 and err.count("\n") == 1, err
    assert err == f"error: {run / name}: No space left on device\n"
    assert (run / "checkpoint.pt").read_bytes() == ckpt and not list(run.glob(".*.tmp*"))
