"""Your own model and data from the command line: ``model=custom model._target_=...`` and
``dataset=tensors|csv``, through the same validation, training, stop and privacy.json as a
preset."""

from __future__ import annotations

import json
import sys
import textwrap

import numpy as np
import pytest
import torch

from dpsgd.config.schema import ConfigError, validate
from dpsgd.launch.cli import short_name
from dpsgd.launch.main import compose
from dpsgd.train import train

NETS = textwrap.dedent(
    """
    import torch
    from torch import nn

    class SmallCNN(nn.Module):
        def __init__(self, width=8, classes=10):
            super().__init__()
            self.conv, self.norm = nn.Conv2d(3, width, 3, padding=1), nn.GroupNorm(2, width)
            self.fc = nn.Linear(width * 4 * 4, classes)

        def forward(self, x):
            x = nn.functional.max_pool2d(torch.relu(self.norm(self.conv(x))), 2)
            return self.fc(x.flatten(1))

    class Tabular(nn.Module):
        def __init__(self, features, classes=2):
            super().__init__()
            self.net = nn.Sequential(nn.Linear(features, 16), nn.ReLU(), nn.Linear(16, classes))

        def forward(self, x):
            return self.net(x)

    class BagOfTokens(nn.Module):
        def __init__(self, vocab=50, classes=2):
            super().__init__()
            self.emb, self.fc = nn.Embedding(vocab, 8), nn.Linear(8, classes)

        def forward(self, ids):
            return self.fc(self.emb(ids).mean(1))

    class WithBatchNorm(nn.Module):
        def __init__(self):
            super().__init__()
            self.c, self.bn = nn.Conv2d(3, 4, 3), nn.BatchNorm2d(4)

        def forward(self, x):
            return self.bn(self.c(x)).flatten(1)[:, :10]

    class CentredOverBatch(nn.Module):
        def __init__(self):
            super().__init__()
            self.fc = nn.Linear(3 * 8 * 8, 10)

        def forward(self, x):
            h = self.fc(x.flatten(1))
            return h - h.mean(0)  # mixes examples: no module type shows it
    """
)
RUN = ["privacy.lot_size=50", "privacy.clipping=global", "privacy.clip_norm=1", "device=cpu"]


@pytest.fixture
def user(tmp_path, monkeypatch):
    """A user's package (user_nets.py) on the path, and tensors in .pt, .npz and .csv files."""
    (tmp_path / "user_nets.py").write_text(NETS)
    monkeypatch.syspath_prepend(str(tmp_path))
    g = torch.Generator().manual_seed(0)
    X, y = torch.randn(600, 3, 8, 8, generator=g), torch.randint(0, 10, (600,), generator=g)
    torch.save((X[:500], y[:500]), tmp_path / "train.pt")
    np.savez(tmp_path / "test.npz", X=X[500:].numpy(), y=y[500:].numpy())
    rng = np.random.default_rng(0)
    for name, n in (("train", 400), ("test", 100)):
        feats = rng.normal(size=(n, 4))
        rows = ["a,b,c,d,target"] + [
            ",".join(f"{v:.6f}" for v in f) + f",{int(f.sum() > 0)}" for f in feats
        ]
        (tmp_path / f"{name}.csv").write_text("\n".join(rows) + "\n")
    yield tmp_path
    sys.modules.pop("user_nets", None)


def _cnn(user):
    return [
        "model=custom",
        "model._target_=user_nets.SmallCNN",
        "+model.args.width=4",
        "dataset=tensors",
        f"dataset.train={user / 'train.pt'}",
        f"dataset.test={user / 'test.npz'}",
        *RUN,
    ]


def test_a_user_cnn_on_tensors_stops_at_its_epsilon(user):
    args = [*_cnn(user), "privacy.sigma=1.5", "privacy.target_epsilon=1.5", "training.epochs=30"]
    out = train(validate(compose(args)), user / "run", args)
    st = json.loads((user / "run" / "privacy.json").read_text())
    assert out["stop_reason"] == st["stop_reason"] == "target_epsilon_reached"
    assert st["status"] == "complete" and 0 < st["steps"] and st["epsilon_valid"] <= 1.5
    cfg = (user / "run" / "config.resolved.yaml").read_text()
    assert "train_sha256:" in cfg and "user_nets.SmallCNN" in cfg


def test_a_user_model_on_a_csv_table(user):
    args = [
        "model=custom",
        "model._target_=user_nets.Tabular",
        "+model.args.features=4",
        "dataset=csv",
        f"dataset.train={user / 'train.csv'}",
        f"dataset.test={user / 'test.csv'}",
        "dataset.label=target",
        "privacy.sigma=1.0",
        "training.epochs=2",
        *RUN,
    ]
    c = validate(compose(args))
    assert c.dataset.label == "target" and c.privacy.lot_size == 50
    out = train(c, user / "run", args)
    assert out["status"] == "complete" and out["steps"] > 0


@pytest.mark.parametrize(
    "change, message",
    [
        (["model._target_=user_nets.WithBatchNorm"], r"WithBatchNorm: module 'bn' \(BatchNorm2d\)"),
        (["model._target_=user_nets.Missing"], r"model._target_=user_nets.Missing: Error locating"),
        (["model=mlp"], r"set model.projection=none"),
        (["dataset.label=nope"], r"dataset.label=nope: only|dataset.label=nope"),
        (["dataset.train_sha256=00"], r"dataset.train_sha256=00: .* the data changed"),
    ],
)
def test_a_bad_user_model_or_file_is_refused_in_one_line(user, change, message):
    args = [a for a in _cnn(user) if not a.startswith("+model.args")] + change
    if "dataset.label=nope" in change:  # a csv without that column
        args = [a.replace("train.pt", "train.csv").replace("test.npz", "test.csv") for a in args]
        args = [a.replace("dataset=tensors", "dataset=csv") for a in args]
    with pytest.raises(ConfigError, match=message) as e:
        validate(compose(args))
    assert "\n" not in str(e.value)


def test_a_model_whose_forward_mixes_examples_is_refused_before_any_write(user):
    """The clipper's proof on the first training examples (dpsgd/mechanism/clipping/proof.py):
    one line, exit 2, nothing in the run folder."""
    from dpsgd.launch.cli import failure

    args = [a for a in _cnn(user) if not a.startswith("+model.args")]
    args = [a.replace("SmallCNN", "CentredOverBatch") for a in args] + ["privacy.sigma=1.0"]
    msg, code = failure(train, validate(compose(args)), user / "run", args)
    assert code == 2 and "\n" not in msg
    assert msg.startswith("the model mixes examples: changing ")
    assert not [p.name for p in (user / "run").iterdir() if not p.name.startswith(".")]


def test_sweep_folder_names_hold_no_path_separator():
    a, b = short_name("dataset.train=/x/a.pt"), short_name("dataset.train=_x_a.pt")
    assert "/" not in a and a != b and short_name("seed=1") == "seed=1"


def test_a_user_cnn_on_an_image_folder(user):
    from PIL import Image

    rng = np.random.default_rng(1)
    for split, n in (("train", 60), ("test", 10)):
        for k in range(3):
            folder = user / "images" / split / f"class_{k}"
            folder.mkdir(parents=True)
            for i in range(n // 3):
                pixels = rng.integers(0, 256, size=(12, 10, 3), dtype=np.uint8)
                Image.fromarray(pixels).save(folder / f"{i}.png")
    args = [
        "model=custom",
        "model._target_=user_nets.SmallCNN",
        "+model.args.classes=3",
        "dataset=imagefolder",
        f"dataset.train={user / 'images' / 'train'}",
        f"dataset.test={user / 'images' / 'test'}",
        "dataset.image_size=8",
        "privacy.sigma=1.0",
        "training.epochs=1",
        *[a.replace("lot_size=50", "lot_size=20") for a in RUN],
    ]
    c = validate(compose(args))
    assert c.dataset.train_sha256 and len(c.dataset.test_sha256) == 64
    out = train(c, user / "run", args)
    assert out["status"] == "complete" and out["sampling"]["N"] == 60


@pytest.mark.slow
def test_a_sweep_and_an_audit_run_on_a_user_model(user):
    """The same user CNN through a 2-job `-m` sweep (its table closes it) and a short one-run audit
    (subprocesses, as a user runs them)."""
    import os
    import subprocess

    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(user), os.getcwd()]))
    common = [*_cnn(user), "privacy.sigma=1.5", "training.epochs=2"]
    sweep = subprocess.run(
        [sys.executable, "-m", "dpsgd.train", "-m", *common, "seed=0,1"],
        cwd=user, env=env, capture_output=True, text=True, timeout=600,
    )  # fmt: skip
    assert sweep.returncode == 0, sweep.stderr[-2000:]
    assert "sweep: 2 run(s)" in sweep.stdout and sweep.stdout.count(" complete ") >= 2
    audit = subprocess.run(
        [sys.executable, "-m", "dpsgd.audit", "run", *common, "audit.input_canaries=100",
         "audit.gradient_canaries=100"],
        cwd=user, env=env, capture_output=True, text=True, timeout=600,
    )  # fmt: skip
    assert audit.returncode == 0, audit.stderr[-2000:]
    assert "audit [correct]: CONSISTENT" in audit.stdout


def test_scatter_features_of_your_own_images_are_computed_uncached(tmp_path):
    # the feature cache is keyed by the registry's archives; your own files are transformed, not
    # cached (this crashed with a KeyError before)
    g = torch.Generator().manual_seed(0)
    X, y = torch.rand(60, 1, 28, 28, generator=g), torch.randint(0, 10, (60,), generator=g)
    torch.save((X[:50], y[:50]), tmp_path / "tr.pt")
    torch.save((X[50:], y[50:]), tmp_path / "te.pt")
    args = ["dataset=tensors", f"dataset.train={tmp_path / 'tr.pt'}",
            f"dataset.test={tmp_path / 'te.pt'}", "model.features=scatter", "model.name=linear",
            "model.projection=none", "privacy.lot_size=10", "privacy.sigma=1",
            "training.epochs=1", "device=cpu"]  # fmt: skip
    out = train(validate(compose(args)), tmp_path / "run", args)
    assert out["status"] == "complete" and not list(tmp_path.rglob("scatter*.pt"))


# ------------------------------------------------------------------ your files: one line each
class AnObject:
    """A Python object: torch.load(weights_only=True) refuses a file that holds one."""


def _bad_files(user):
    """name -> (dataset overrides, model overrides, message): each file or misfit that was a
    traceback (several only after set-up, with a folder written)."""
    X, y = torch.load(user / "train.pt")
    torch.save({"X": X, "y": y, "extra": AnObject()}, user / "objects.pt")
    np.savez(user / "objects.npz", X=np.array([object()] * 5, dtype=object), y=np.arange(5))
    (user / "text.csv").write_text("a,b,target\n1,x,0\n2,y,1\n3,z,0\n")
    (user / "empty.csv").write_text("")
    (user / "holes.csv").write_text("a,b,target\n1,,0\n2,3,1\n")
    torch.save((X, y + 20), user / "labels30.pt")
    torch.save((torch.randn(100, 3, 12, 12), y[:100]), user / "wide.pt")
    torch.save((X[:100], y[:100] + 20), user / "test_labels30.pt")
    pt = lambda f, t="test.npz": ["dataset=tensors", f"dataset.train={user / f}",  # noqa: E731
                                  f"dataset.test={user / t}"]  # fmt: skip
    csv_ = lambda f: ["dataset=csv", f"dataset.train={user / f}",  # noqa: E731
                      f"dataset.test={user / 'test.csv'}", "dataset.label=target"]  # fmt: skip
    cnn = ["model=custom", "model._target_=user_nets.SmallCNN"]
    tab = ["model=custom", "model._target_=user_nets.Tabular", "+model.args.features=2"]
    return {
        "weights_only": (pt("objects.pt"), cnn, r"refused by torch.load\(weights_only=True\)"),
        "object arrays": (pt("train.pt", "objects.npz"), cnn, r"holds Python objects"),
        "text column": (csv_("text.csv"), tab, r"non-numeric feature columns \['b'\]"),
        "empty csv": (csv_("empty.csv"), tab, r"not a readable CSV table"),
        "missing values": (csv_("holes.csv"), tab, r"missing values in columns \['b'\]"),
        "train labels": (pt("labels30.pt"), cnn, r"the dataset's labels need 30"),
        "test labels": (pt("train.pt", "test_labels30.pt"), cnn, r"labels need 30"),
        "shape": (pt("wide.pt", "wide.pt"), cnn, r"does not take the dataset's examples of shape"),
        "no _target_": (pt("train.pt"), ["model=custom"], r"model=custom needs your network's"),
    }


CASES = ["weights_only", "object arrays", "text column", "empty csv", "missing values",
         "train labels", "test labels", "shape", "no _target_"]  # fmt: skip


@pytest.mark.parametrize("case", CASES)
def test_a_bad_file_or_a_model_that_does_not_fit_is_one_line_before_any_folder(
    user, case, monkeypatch
):
    from dpsgd.launch.prepare import prepare

    data, model, message = _bad_files(user)[case]
    monkeypatch.chdir(user)
    before = sorted(p.name for p in user.iterdir())
    with pytest.raises(ConfigError, match=message) as e:
        prepare([*model, *data, *RUN, "hydra.run.dir=run"])
    assert "\n" not in str(e.value) and sorted(p.name for p in user.iterdir()) == before


def _tree(root, classes: dict) -> None:
    from PIL import Image

    rng = np.random.default_rng(0)
    for name, n in classes.items():
        (root / name).mkdir(parents=True)
        for i in range(n):
            Image.fromarray(rng.integers(0, 256, (6, 6, 3), dtype=np.uint8)).save(
                root / name / f"{i}.png"
            )


def _images(user, train: dict, test: dict) -> list[str]:
    _tree(user / "tr", train)
    _tree(user / "te", test)
    return ["model=custom", "model._target_=user_nets.SmallCNN", "dataset=imagefolder",
            f"dataset.train={user / 'tr'}", f"dataset.test={user / 'te'}",
            "dataset.image_size=8", "privacy.sigma=1.0",
            *[a.replace("=50", "=4") for a in RUN]]  # fmt: skip


def test_image_folders_are_matched_by_class_name_and_the_names_recorded(user):
    """train {a, b, c} and test {a, c}: test's c is class 2 (it was 1: paired by position)."""
    from dpsgd.data.files import load_files

    c = validate(compose(_images(user, {"a": 4, "b": 4, "c": 4}, {"a": 2, "c": 3})))
    assert c.dataset.classes == ["a", "b", "c"]
    _, _, _, yte = load_files(c.dataset)
    assert yte.tolist() == [0, 0, 2, 2, 2]


@pytest.mark.parametrize(
    "train, test, message",
    [
        ({"a": 3, "aa": 0, "b": 3}, {"a": 2, "b": 2}, r"tr/aa: a class folder with no image"),
        ({"a": 3, "b": 3}, {"a": 2, "z": 2}, r"class\(es\) \['z'\] are not classes of"),
    ],
)
def test_image_folders_that_do_not_pair_by_name_are_refused_in_one_line(user, train, test, message):
    with pytest.raises(ConfigError, match=message) as e:
        validate(compose(_images(user, train, test)))
    assert "\n" not in str(e.value)


def test_text_labels_are_classes_matched_by_name(user):
    from dpsgd.data.files import load_files

    for name, rows in (("tr", ["1,2,cat", "2,1,dog", "3,3,cat", "0,1,eel"]),
                       ("te", ["1,1,eel", "2,2,cat"])):  # fmt: skip
        (user / f"{name}.csv").write_text("a,b,kind\n" + "\n".join(rows) + "\n")
    args = ["model=custom", "model._target_=user_nets.Tabular", "+model.args.features=2",
            "+model.args.classes=3", "dataset=csv", f"dataset.train={user / 'tr.csv'}",
            f"dataset.test={user / 'te.csv'}", "dataset.label=kind", "privacy.sigma=1.0",
            *RUN]  # fmt: skip
    args = [a.replace("lot_size=50", "lot_size=2") for a in args]
    c = validate(compose(args))
    assert c.dataset.classes == ["cat", "dog", "eel"]
    _, ytr, _, yte = load_files(c.dataset)
    assert ytr.tolist() == [0, 1, 0, 2] and yte.tolist() == [2, 0]
    changed = [*args, "dataset.classes=[cat,dog]"]
    with pytest.raises(ConfigError, match=r"dataset.classes=\['cat', 'dog'\]: .* the data changed"):
        validate(compose(changed))


def test_a_custom_model_inherits_no_paper_setting_and_gets_sigma_from_its_target(user):
    """model=custom: global clipping at C = 1, a constant learning rate, PLD, and σ calibrated
    from privacy.target_epsilon over training.epochs (the API's search); without a target, σ is
    asked for in one line; a σ given is kept and stops the run at the target."""
    from dpsgd.config.calibration import sigma_for_lots
    from dpsgd.mechanism.sampling import make_sampler

    base = [a for a in _cnn(user) if not a.startswith(("privacy.clipping", "privacy.clip_norm"))]
    c = validate(compose([*base, "privacy.target_epsilon=3", "training.epochs=5"]))
    p = c.privacy
    assert (p.clipping, p.clip_norm, c.training.schedule, c.accountant.name) == (
        "global", 1.0, "constant", "pld")  # fmt: skip
    sampler = make_sampler("poisson", c.N, p.lot_size)
    lots = 5 * sampler.lots_per_epoch()
    assert p.calibrate_sigma and p.sigma == sigma_for_lots(sampler, 3.0, p.delta, lots, "pld", 1)
    with pytest.raises(ConfigError, match=r"privacy.sigma=null: give σ .* privacy.target_epsilon"):
        validate(compose(base))
    given = validate(compose([*base, "privacy.sigma=2", "privacy.target_epsilon=3"]))
    assert given.privacy.sigma == 2.0 and not given.privacy.calibrate_sigma
    preset = validate(compose(["experiment=mnist_medium"]))  # the presets keep the paper's
    assert (preset.privacy.clipping, preset.accountant.name, preset.training.schedule) == (
        "per_layer", "moments", "paper")  # fmt: skip
    assert preset.optimizer.name == "sgd" and preset.training.precision == "fp32"


def test_adamw_from_the_command_line_resumes_bit_for_bit(user):
    """optimizer=adamw with a cosine schedule: a run checkpointed after epoch 1 and resumed to
    epoch 3 ends with the model of one that ran 3 epochs straight (AdamW's moments come back from
    the checkpoint); the optimizer cannot change on resume."""
    from dpsgd.launch.prepare import prepare_resume
    from dpsgd.run.checkpoint import load_checkpoint

    args = [*_cnn(user), "privacy.sigma=1.0", "optimizer=adamw", "training.lr=0.01",
            "training.schedule=cosine", "training.lr_end=0.001"]  # fmt: skip
    ref, run = user / "ref", user / "run"
    train(validate(compose([*args, "training.epochs=3"])), ref, [*args, "training.epochs=3"])
    train(validate(compose([*args, "training.epochs=1"])), run, [*args, "training.epochs=1"])
    c, rd, rest = prepare_resume([f"resume={run}", "training.epochs=3"])
    train(c, rd, rest)
    a, b = load_checkpoint(ref), load_checkpoint(run)
    assert all(torch.equal(a["model"][k], b["model"][k]) for k in a["model"])  # bit-identical
    assert a["optimizer"]["torch_class"] == "AdamW" and a["optimizer"]["torch"]["state"]
    with pytest.raises(ConfigError, match="optimizer.name"):
        prepare_resume([f"resume={run}", "training.epochs=4", "optimizer=adam"])


def test_the_learning_rate_schedules():
    from types import SimpleNamespace

    from dpsgd.config.optimizer import lr_at
    from tolerances import chain_rel_tol

    t = SimpleNamespace(lr=0.1, lr_end=0.01, epochs=11, lr_saturate_epochs=10)
    near = lambda x: pytest.approx(x, rel=chain_rel_tol(8))  # noqa: E731 (a few float ops, cos)
    # exact at epoch 0: lr − (lr − lr_end)·0 and cos(0) = 1
    assert [lr_at(SimpleNamespace(**vars(t), schedule="constant"), e) for e in (0, 10)] == [0.1] * 2
    lin = SimpleNamespace(**vars(t), schedule="linear")
    assert lr_at(lin, 0) == 0.1 and lr_at(lin, 10) == lr_at(lin, 20) == near(0.01)
    cos = SimpleNamespace(**vars(t), schedule="cosine")
    assert lr_at(cos, 0) == 0.1 and lr_at(cos, 5) == near(0.055) and lr_at(cos, 10) == near(0.01)
    paper = SimpleNamespace(**vars(t), schedule="paper")
    assert lr_at(paper, 9) == near(0.01) and lr_at(paper, 3) == near(0.07)


def test_token_ids_are_read_as_integers_and_other_values_refused(user):
    from dpsgd.data.files import load_files

    torch.save((torch.randint(0, 50, (60, 7)), torch.randint(0, 2, (60,))), user / "ids.pt")
    ids = [*_cnn(user), "privacy.sigma=1"]
    ids = [a.replace("train.pt", "ids.pt").replace("test.npz", "ids.pt") for a in ids]
    ids = [a for a in ids if not a.startswith(("model.", "+model"))]
    ids += ["model._target_=user_nets.BagOfTokens", "dataset.dtype=int64"]
    c = validate(compose(ids))
    X = load_files(c.dataset)[0]
    assert X.dtype == torch.int64 and c.dataset.dtype == "int64"
    with pytest.raises(ConfigError, match=r"dataset.dtype=int64: dataset.train=.* not integers"):
        validate(compose([*_cnn(user), "privacy.sigma=1", "dataset.dtype=int64"]))
