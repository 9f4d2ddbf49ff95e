"""The CIFAR-10 path of the paper (Abadi et al. 2016, §5.3) end to end, on generated data in the
exact torchvision formats (tests/cifar_fixture.py): CIFAR-100 pretraining → frozen
convolutions → DP-SGD on CIFAR-10; the artifact's hash checks; the per-example augmentation; no
data → one line, exit 2.

The real CIFAR archives are not used (they are not available offline); the accuracy asserted here is
on the generated classes, never a result.
"""

import json
import math
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
import torch

from cifar_fixture import trust, write_cifar10, write_cifar100
from dpsgd.models import pretrained
from dpsgd.data.augment import (
    AUGMENTATIONS,
    LotTransform,
    center_crop,
    crop_flip,
    lot_generator,
    per_image_standardization,
)
from dpsgd.run.checkpoint import load_checkpoint
from dpsgd.config.schema import validate
from dpsgd.data.archives import main as data_main
from dpsgd.core.errors import ConfigError
from dpsgd.launch.main import compose, train_main
from dpsgd.launch.prepare import prepare_resume
from dpsgd.pretrain import pretrain
from dpsgd.train import train
from tolerances import reduction_rtol

REPO = Path(__file__).resolve().parents[2]
FEATURES = ["features.0.weight", "features.0.bias", "features.3.weight", "features.3.bias"]
DENSE = [f"classifier.{i}.{w}" for i in (1, 3, 5) for w in ("weight", "bias")]


@pytest.fixture(scope="module")
def pipeline(tmp_path_factory):
    """Pretrain on the generated CIFAR-100, then DP-train the paper's preset (on a small subset,
    σ = 1, two epochs of four lots, no target ε) on the generated CIFAR-10 with the convolutions
    frozen."""
    mp = pytest.MonkeyPatch()
    tmp = tmp_path_factory.mktemp("cifar")
    root = tmp / "data"
    write_cifar10(root, n_train=600, n_test=300)
    write_cifar100(root, n_train=300, n_test=100)
    trust(mp, root)
    common = [f"dataset.root={root}", "dataset.download=false", "device=cpu"]
    artifact = tmp / "pretrained" / "convs.pt"
    meta = pretrain(
        common + ["training.epochs=1", "privacy.lot_size=100"], artifact, tmp / "pretrain_run"
    )
    args = [
        "experiment=cifar10_eps2",
        *common,
        f"model.pretrained={artifact}",
        "privacy.lot_size=150",
        "privacy.sigma=1.0",
        "privacy.target_epsilon=null",
        "training.epochs=2",
    ]
    run = tmp / "run"
    train(validate(compose(args)), run, args)
    yield {"root": root, "artifact": artifact, "meta": meta, "run": run, "args": args, "tmp": tmp}
    mp.undo()


def test_pretrain_freeze_dp_train(pipeline):
    run, artifact = pipeline["run"], pipeline["artifact"]
    side = json.loads(pretrained.sidecar(artifact).read_text())
    assert side["sha256"] == pipeline["meta"]["sha256"] and sorted(side["tensors"]) == sorted(
        FEATURES
    )
    assert (
        side["config"]["dataset"]["name"] == "cifar100"
        and side["config"]["privacy"]["private"] is False
    )
    js = json.loads((run / "privacy.json").read_text())
    assert js["status"] == "complete"
    pub = js["public_parameters"]
    assert (
        pub["tensors"] == FEATURES
        and pub["sha256"] == side["sha256"]
        and "CIFAR-100" in pub["source"]
    )
    assert js["private_parameters"] == DENSE
    assert js["k"] == 3 == js["convention"]["groups"]  # per-layer: the three dense layers
    assert js["clipping_groups"] == [
        DENSE[i : i + 2] for i in (0, 2, 4)
    ]  # k counts trained groups only
    assert {e["label"] for e in js["ledger"]["entries"]} == {
        "sgd"
    }  # the pretraining is not charged
    assert all(e["groups"] == 3 for e in js["ledger"]["entries"])
    final = load_checkpoint(run)["model"]
    public = torch.load(artifact, weights_only=True)
    for n in FEATURES:  # frozen: bit-identical
        assert torch.equal(final[n], public[n]), n
    rows = (run / "metrics.csv").read_text().splitlines()
    last = dict(zip(rows[0].split(","), rows[-1].split(",")))
    assert float(last["test_accuracy"]) > 0.5  # chance: 0.1
    assert last["groups"] == "3"
    resolved = (run / "config.resolved.yaml").read_text()
    assert f"pretrained_sha256: {side['sha256']}" in resolved and "augment: crop_flip" in resolved


def test_changed_or_missing_artifact_is_refused(pipeline, tmp_path):
    artifact, run = pipeline["artifact"], pipeline["run"]
    copy = tmp_path / "convs.pt"
    shutil.copy(artifact, copy)
    shutil.copy(pretrained.sidecar(artifact), pretrained.sidecar(copy))
    base = [a for a in pipeline["args"] if not a.startswith("model.pretrained=")]
    assert (
        validate(compose(base + [f"model.pretrained={copy}"])).model.pretrained_sha256
        == pipeline["meta"]["sha256"]
    )
    with pytest.raises(ConfigError, match=r"^model.pretrained_sha256=0+: differs"):
        validate(
            compose(base + [f"model.pretrained={copy}", "model.pretrained_sha256=" + "0" * 64])
        )
    data = bytearray(copy.read_bytes())
    data[len(data) // 2] ^= 1  # altered after its sidecar was written
    copy.write_bytes(bytes(data))
    with pytest.raises(
        ConfigError, match=r"^model.pretrained=\S+: SHA-256 \w+… differs from its sidecar's"
    ):
        validate(compose(base + [f"model.pretrained={copy}"]))
    with pytest.raises(
        ConfigError, match=r"^model.pretrained=\S+: no such file; build it with make"
    ):
        validate(compose(base + [f"model.pretrained={tmp_path / 'none.pt'}"]))
    with pytest.raises(ConfigError, match=r"^model.freeze=features: freezes public weights"):
        validate(compose(base + ["model.pretrained=null"]))
    # a resume whose artifact changed (a consistent new artifact at the same path) is refused
    moved = tmp_path / "original"
    moved.mkdir()
    for p in (artifact, pretrained.sidecar(artifact)):
        shutil.move(p, moved / p.name)
    try:
        state = torch.load(moved / artifact.name, weights_only=True)
        pretrained.save(artifact, {n: t + 1 for n, t in state.items()}, {})
        with pytest.raises(
            ConfigError, match=r"^resume: model.pretrained_sha256=\w+ differs from the run's"
        ):
            prepare_resume([f"resume={run}"])
    finally:
        for p in (artifact, pretrained.sidecar(artifact)):
            p.unlink(missing_ok=True)
            shutil.move(moved / p.name, p)


def test_pretrain_refuses_before_writing(pipeline, tmp_path):
    common = [f"dataset.root={pipeline['root']}", "dataset.download=false", "device=cpu"]
    with pytest.raises(ConfigError, match=r"^--out=\S+: \S+ already exists; never overwritten"):
        pretrain(common, pipeline["artifact"], tmp_path / "run")
    with pytest.raises(ConfigError, match=r"^privacy.private=true: pretraining uses public data"):
        pretrain(
            common + ["privacy.private=true", "privacy.sigma=1"],
            tmp_path / "a.pt",
            tmp_path / "run",
        )
    assert list(tmp_path.iterdir()) == []


def test_resumed_run_replays_the_augmented_lots_bit_identically(pipeline):
    """Crops and flips are drawn from (seed, lot index): one epoch, then a resume to two, ends with
    the very model of an uninterrupted two-epoch run."""
    tmp = pipeline["tmp"]
    args = [
        a for a in pipeline["args"] if not a.startswith(("privacy.lot_size=", "training.epochs="))
    ]
    args += ["dataset.subset=120", "privacy.lot_size=40", "seed=5"]
    whole, part = tmp / "whole", tmp / "part"
    train(validate(compose(args + ["training.epochs=2"])), whole, args + ["training.epochs=2"])
    train(validate(compose(args + ["training.epochs=1"])), part, args + ["training.epochs=1"])
    c, rd, rest = prepare_resume([f"resume={part}", "training.epochs=2"])
    train(c, rd, rest)
    a, b = load_checkpoint(whole)["model"], load_checkpoint(part)["model"]
    assert load_checkpoint(part)["steps"] == load_checkpoint(whole)["steps"] == 6
    for n in a:
        assert torch.equal(a[n], b[n]), n


def test_augmentation_multiplicity_augments_each_copy_inside_the_step(pipeline):
    """privacy.augment_multiplicity=K with dataset.augment=crop_flip: the lot reaches the DP step as
    stored (32×32) and each of the K copies of an example gets its own crop from the lot's generator
    (De et al. 2022); a resumed run replays those crops bit-identically."""
    tmp = pipeline["tmp"]
    args = [
        a for a in pipeline["args"] if not a.startswith(("privacy.lot_size=", "training.epochs="))
    ]
    args += [
        "dataset.subset=120",
        "privacy.lot_size=40",
        "seed=7",
        "privacy.augment_multiplicity=2",
    ]
    seen = []
    from dpsgd.mechanism import optim

    real = optim.DPSGD._rows

    def spy(self, xb, generator=None):
        rows = real(self, xb, generator)
        seen.append((tuple(xb.shape), tuple(rows.shape), rows))
        return rows

    mp = pytest.MonkeyPatch()
    mp.setattr(optim.DPSGD, "_rows", spy)
    try:
        whole, part = tmp / "k2_whole", tmp / "k2_part"
        train(validate(compose(args + ["training.epochs=2"])), whole, args + ["training.epochs=2"])
    finally:
        mp.undo()
    assert seen and all(x[1:] == (3, 32, 32) and r == (2 * x[0], 3, 24, 24) for x, r, _ in seen)
    rows = seen[0][2]
    assert not torch.equal(rows[0::2], rows[1::2])  # the two copies were cropped differently
    train(validate(compose(args + ["training.epochs=1"])), part, args + ["training.epochs=1"])
    c, rd, rest = prepare_resume([f"resume={part}", "training.epochs=2"])
    train(c, rd, rest)
    a, b = load_checkpoint(whole)["model"], load_checkpoint(part)["model"]
    for n in a:
        assert torch.equal(a[n], b[n]), n


def test_crop_flip_takes_a_window_of_each_example():
    x = torch.arange(12 * 3 * 32 * 32, dtype=torch.float64).reshape(12, 3, 32, 32)
    out = crop_flip(x, torch.Generator().manual_seed(0))
    assert out.shape == (12, 3, 24, 24)
    flips = 0
    for i in range(5):  # each output is one 24×24 window of its own example, maybe mirrored
        hits = [
            (t, l, f)
            for t in range(9)
            for l in range(9)
            for f in (False, True)
            if torch.equal(
                out[i], (lambda w: w.flip(-1) if f else w)(x[i, :, t : t + 24, l : l + 24])
            )
        ]
        assert len(hits) == 1, i
        flips += hits[0][2]
    assert 0 < flips < 12  # both branches drawn for this seed
    again = crop_flip(x, torch.Generator().manual_seed(0))
    assert torch.equal(out, again)  # a function of the generator only
    assert torch.equal(center_crop(x), x[:, :, 4:28, 4:28])  # data.py's offset (32 − 24) // 2
    assert set(AUGMENTATIONS) == {"none", "crop_flip"} and AUGMENTATIONS["none"](x, None) is x


def test_lot_generator_is_seed_and_step_only():
    draw = lambda s, t: torch.rand(4, generator=lot_generator(s, t))  # noqa: E731
    assert torch.equal(draw(0, 7), draw(0, 7))
    assert not torch.equal(draw(0, 7), draw(0, 8)) and not torch.equal(draw(0, 7), draw(1, 7))
    tf = LotTransform("crop_flip", True, 24, seed=3)
    x = torch.rand(6, 3, 32, 32)
    assert torch.equal(tf.train(x, 11), tf.train(x.clone(), 11))
    assert (
        LotTransform().identity and LotTransform().train(x, 0) is x and LotTransform().eval(x) is x
    )


def test_per_image_standardization_matches_tf_formula():
    """(x − mean) / max(std, 1/√n) per image, population std (TF per_image_standardization), in
    float64 against numpy; a constant image has std 0 < 1/√n and maps to exactly 0."""
    rng = np.random.default_rng(0)
    x = rng.uniform(0, 1, size=(4, 3, 24, 24))
    x[3] = 0.25
    n = 3 * 24 * 24
    ref = np.stack([(xi - xi.mean()) / max(xi.std(), 1 / math.sqrt(n)) for xi in x])
    out = per_image_standardization(torch.from_numpy(x)).numpy()
    # mean and std are reductions over the n values of an image (torch's and numpy's orders differ);
    # outputs are O(1), so n·eps64 is also the absolute floor
    tol = reduction_rtol(n) * np.abs(out).max()
    np.testing.assert_allclose(out, ref, rtol=reduction_rtol(n), atol=tol)
    np.testing.assert_allclose(out[:3].reshape(3, -1).mean(1), 0, atol=tol)
    np.testing.assert_allclose(out[:3].reshape(3, -1).std(1), 1, rtol=reduction_rtol(n))
    assert np.all(out[3] == 0)


def test_bad_cifar_keys_are_one_line():
    for args, msg in (
        (["dataset.augment=crop_flip"], r"^dataset.augment=crop_flip: random crops need images"),
        (["dataset.augment=rotate"], r"^dataset.augment=rotate: unknown"),
        (
            ["dataset.standardize=true"],
            r"^dataset.standardize=true: per-image standardisation is for image",
        ),
        (
            ["model.freeze=features"],
            r"^model.freeze=features: the mlp model has no such parameters",
        ),
        (["model.freeze=all"], r"^model.freeze=all: unknown"),
    ):
        with pytest.raises(ConfigError, match=msg):
            validate(compose(args))


def _env(tmp_path):
    root, src = tmp_path / "root", tmp_path / "src"
    src.mkdir()
    return dict(
        os.environ, PYTHONPATH=str(REPO), DPSGD_DATA_ROOT=str(root), DPSGD_DATA_SOURCE=str(src)
    )


def test_make_cifar10_without_data_fails_fast_in_one_line(tmp_path):
    """`make cifar10` with neither CIFAR in the root nor in the source and downloads off
    (DOWNLOAD=0): one line naming cifar10 and both ways to provide it, exit 2, nothing written, and
    it stops at the data check (no pretraining, no training: fast by construction; the time is
    printed, not asserted). (A throwaway VENV whose python runs this interpreter; its stamp is never
    remade.)"""
    if not shutil.which("make"):
        pytest.skip("needs GNU make")
    venv = tmp_path / "venv"
    (venv / "bin").mkdir(parents=True)
    (venv / "bin" / "python").write_text(f'#!/bin/sh\nexec "{sys.executable}" "$@"\n')
    (venv / "bin" / "python").chmod(0o755)
    (venv / ".installed").touch()
    env = _env(tmp_path)
    t0 = time.time()
    p = subprocess.run(
        [
            "make",
            "--no-print-directory",
            "-C",
            str(REPO),
            "cifar10",
            f"VENV={venv}",
            "-o",
            f"{venv}/.installed",
            "DOWNLOAD=0",
        ],
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
    )
    took = time.time() - t0
    errors = [ln for ln in p.stderr.splitlines() if ln.startswith("error:")]
    assert p.returncode == 2 and len(errors) == 1, p.stderr
    assert "cifar10 not found there" in errors[0] and "cifar-10-python.tar.gz" in errors[0]
    assert "$DPSGD_DATA_SOURCE or the data root" in errors[0] and "allow the download" in errors[0]
    assert "dpsgd.pretrain" not in p.stdout and "dpsgd.train" not in p.stdout  # stopped at the data
    assert not (tmp_path / "root").exists() and not list((tmp_path / "src").iterdir())
    print(f"make cifar10 without data: exit {p.returncode} after {took:.1f} s")


def test_missing_artifact_stops_before_any_run_folder(tmp_path, monkeypatch, capsys):
    """The command line refuses before Hydra starts (so in-process here: hydra.main is never
    reached)."""
    monkeypatch.chdir(tmp_path)
    run = tmp_path / "run"
    with pytest.raises(SystemExit) as e:
        train_main(
            [
                "experiment=cifar10_eps2",
                f"model.pretrained={tmp_path / 'none.pt'}",
                f"hydra.run.dir={run}",
            ]
        )
    err = capsys.readouterr().err
    assert e.value.code == 2 and err.count("\n") == 1, err
    # the CIFAR data are named first where they are missing too (the artifact is built from them)
    assert err.startswith(f"error: model.pretrained={tmp_path / 'none.pt'}: no such file") or (
        err.startswith("error: dataset=cifar10: ") and f"model.pretrained={tmp_path}" in err
    )
    assert list(tmp_path.iterdir()) == []


def test_data_cli_seeds_cifar_only_when_present_locally(tmp_path, monkeypatch, capsys):
    src, root = tmp_path / "src", tmp_path / "root"
    write_cifar10(src, n_train=10, n_test=5)
    trust(monkeypatch, src, ("cifar10",))
    monkeypatch.setenv("DPSGD_DATA_ROOT", str(root))
    monkeypatch.setattr("dpsgd.data.archives.ensure_dataset", lambda name, *a, **k: f"{name}: ok")
    assert data_main(["--source", str(src), "--no-download"]) == 0
    assert capsys.readouterr().out.split() == [
        "mnist:",
        "ok",
        "fashion_mnist:",
        "ok",
        "cifar10:",
        "ok",
    ]
