"""The end-to-end tanh CNN (Papernot et al. 2021; Tramèr & Boneh 2021): shape, parameters,
ghost = vmap, config validation, the presets, and a tiny run through dpsgd.train with GroupNorm,
augmentation multiplicity and EMA."""

import json

import pytest
import torch
from torch import nn

from conftest import metrics_rows
from dpsgd.mechanism.clipping import PerExampleClipper
from dpsgd.config.schema import ConfigError, validate
from dpsgd.launch.main import compose
from dpsgd.models.networks import TanhCNN
from dpsgd.train import train
from tolerances import assert_f64_close, f64_rtol

DT = torch.float64


def test_architecture_is_tramer_bonehs_mnist_cnn():
    m = TanhCNN()
    convs = [l for l in m.modules() if isinstance(l, nn.Conv2d)]
    assert [(c.out_channels, c.kernel_size, c.stride, c.padding) for c in convs] == [
        (16, (8, 8), (2, 2), (2, 2)),
        (32, (4, 4), (2, 2), (0, 0)),
    ]
    assert sum(isinstance(l, nn.Tanh) for l in m.modules()) == 3
    assert sum(p.numel() for p in m.parameters()) == 26010  # 1040 + 8224 + 16416 + 330
    assert m(torch.zeros(3, 784)).shape == m(torch.zeros(3, 1, 28, 28)).shape == (3, 10)
    g = TanhCNN(norm="group")
    assert [l.num_channels for l in g.modules() if isinstance(l, nn.GroupNorm)] == [16, 32]
    with pytest.raises(ValueError, match="model.norm"):
        TanhCNN(norm="batch")
    with pytest.raises(ValueError, match=r"\[B, 1, 28, 28\]"):
        m(torch.zeros(2, 3, 28, 28))


@pytest.mark.parametrize("norm", ["none", "group"])
@pytest.mark.parametrize("clipping", ["global", "per_layer"])
def test_ghost_equals_vmap(norm, clipping):
    torch.manual_seed(0)
    model = TanhCNN(norm=norm).to(DT)
    x, y = torch.rand(6, 784, dtype=DT), torch.randint(0, 10, (6,))
    ghost = PerExampleClipper(model, 0.1, clipping, "ghost")
    assert PerExampleClipper(model, 0.1, clipping, "auto").mode == "ghost"
    rg, rv = (
        ghost.clipped_sum(x, y),
        PerExampleClipper(model, 0.1, clipping, "vmap").clipped_sum(x, y),
    )
    rtol = f64_rtol(model)  # two kernels, float64 (tests/tolerances.py)
    for n in rv.grads:
        assert_f64_close(rg.grads[n], rv.grads[n], rtol)
    assert_f64_close(rg.norms, rv.norms, rtol)
    assert len(ghost.groups) == (1 if clipping == "global" else 4 + 2 * (norm == "group"))


@pytest.mark.parametrize(
    "overrides,message",
    [
        (["model=tanh_cnn", "dataset=cifar10"], "model.name=tanh_cnn: needs 1x28x28 images"),
        (["model=tanh_cnn", "model.projection=pca", "model.pca_dims=60"], "model.projection=pca"),
        (["model.norm=group"], "model.norm=group: only model.name=tanh_cnn"),
        (["model=tanh_cnn", "model.norm=batch"], "model.norm=batch: unknown"),
    ],
)
def test_config_refusals(overrides, message):
    with pytest.raises(ConfigError, match=message):
        validate(compose(overrides))


@pytest.mark.parametrize(
    "preset,dataset,L,lr,sigma",
    [
        ("mnist_tanh_cnn", "mnist", 512, 0.5, 1.23),
        ("fmnist_tanh_cnn", "fashion_mnist", 2048, 4.0, 2.15),
    ],
)
def test_presets_compose(preset, dataset, L, lr, sigma):
    c = validate(compose([f"experiment={preset}"]))
    assert (c.dataset.name, c.model.name, c.privacy.lot_size, c.training.lr, c.privacy.sigma) == (
        dataset,
        "tanh_cnn",
        L,
        lr,
        sigma,
    )
    assert (
        c.privacy.clip_norm == 0.1
        and c.privacy.clipping == "global"
        and c.privacy.sampling == "poisson"
    )
    assert (
        c.accountant.name == "pld" and c.privacy.convention == "joint" and c.privacy.delta == 1e-5
    )
    assert c.training.epochs == 40 and c.privacy.target_epsilon == 3.0


def test_tiny_end_to_end_run(tmp_path):
    """600 real MNIST images, tanh CNN + GroupNorm, K = 2 augmented (identical) copies, EMA: two
    epochs through dpsgd.train, with the EMA weights evaluated and released."""
    from dpsgd.run.checkpoint import load_checkpoint
    from dpsgd.run.evaluate import evaluate

    args = [
        "model=tanh_cnn",
        "model.norm=group",
        "dataset.subset=600",
        "privacy.lot_size=100",
        "privacy.sigma=1.0",
        "privacy.clip_norm=0.1",
        "privacy.clipping=global",
        "training.lr=0.5",
        "training.lr_saturate_epochs=0",
        "training.epochs=2",
        "training.eval_every=2",
        "device=cpu",
        "privacy.augment_multiplicity=2",
        "training.ema_decay=0.9",
        "accountant=pld",
    ]
    st = train(validate(compose(args)), tmp_path / "run", args)
    assert st["status"] == "complete" and st["steps"] == 12
    assert st["weights"]["evaluated"] == "ema" and st["weights"]["ema_decay"] == 0.9
    assert "augmentation multiplicity K=2" in st["mechanism"]
    rows = metrics_rows(tmp_path / "run")
    assert [r["epoch"] for r in rows] == ["1", "2"] and rows[-1]["grad_sample_mode"] == "ghost"
    ck = load_checkpoint(tmp_path / "run")
    assert ck["ema"]["updates"] == 12 and ck["ema"]["decay"] == 0.9
    model = TanhCNN(norm="group")
    model.load_state_dict(ck["ema"]["weights"])
    from dpsgd.data.readers import load_dataset

    Xtr, ytr, _, _ = load_dataset("mnist", None, 600, None, download=False)
    loss, acc = evaluate(model, Xtr, ytr, 10000)  # the EMA weights are the ones evaluated
    # the same float32 evaluation replayed (same weights and batches); 1e-6 ≈ 8·eps32 allows
    # another reduction order
    assert float(rows[-1]["train_loss"]) == pytest.approx(loss, rel=1e-6)
    assert float(rows[-1]["train_accuracy"]) == acc  # exact: an integer count over 600
    model.load_state_dict(ck["model"])  # the training weights differ from the EMA
    assert any(
        not torch.equal(a, b) for a, b in zip(ck["model"].values(), ck["ema"]["weights"].values())
    )
    assert (
        json.loads((tmp_path / "run" / "privacy.json").read_text())["weights"]["evaluated"] == "ema"
    )
