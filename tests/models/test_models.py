"""The paper's networks (Abadi et al. 2016 §5.2, §5.3) and the DP-compatibility check."""

import pytest
import torch
from torch import nn

from dpsgd.models.networks import MLP, CifarCNN, check_dp_compatible


def test_mnist_paper_model_shape_and_size():
    model = MLP(60, (1000,), 10, bias=False)
    assert sum(p.numel() for p in model.parameters()) == 60 * 1000 + 1000 * 10
    assert all("bias" not in n for n, _ in model.named_parameters())
    assert model(torch.randn(5, 60)).shape == (5, 10)
    assert model(torch.randn(0, 60)).shape == (0, 10)


def test_mlp_hidden_layers_and_bias():
    model = MLP(784, (30, 20), 7, bias=True)
    linears = [m for m in model.modules() if isinstance(m, nn.Linear)]
    assert [(l.in_features, l.out_features) for l in linears] == [(784, 30), (30, 20), (20, 7)]
    assert all(l.bias is not None for l in linears)
    assert sum(isinstance(m, nn.ReLU) for m in model.modules()) == 2
    assert model(torch.randn(2, 1, 28, 28)).shape == (2, 7)  # flattens image input


@pytest.mark.parametrize(
    "kwargs",
    [dict(in_features=0), dict(in_features=4, hidden=(0,)), dict(in_features=4, num_classes=0)],
)
def test_mlp_bad_arguments(kwargs):
    with pytest.raises(ValueError):
        MLP(**kwargs)


def test_cifar_paper_model():
    model = CifarCNN()
    convs = [m for m in model.modules() if isinstance(m, nn.Conv2d)]
    assert [(c.in_channels, c.out_channels, c.kernel_size, c.stride) for c in convs] == [
        (3, 64, (5, 5), (1, 1)),
        (64, 64, (5, 5), (1, 1)),
    ]
    linears = [m for m in model.modules() if isinstance(m, nn.Linear)]
    assert [(l.in_features, l.out_features) for l in linears] == [
        (2304, 384),
        (384, 384),
        (384, 10),
    ]
    assert sum(isinstance(m, nn.MaxPool2d) for m in model.modules()) == 2
    assert model(torch.randn(4, 3, 24, 24)).shape == (4, 10)
    assert CifarCNN(num_classes=100, bias=False)(torch.randn(1, 3, 24, 24)).shape == (1, 100)
    with pytest.raises(ValueError, match="24, 24"):
        model(torch.randn(1, 3, 32, 32))


def test_paper_models_are_dp_compatible():
    check_dp_compatible(MLP(60))
    check_dp_compatible(CifarCNN())
    check_dp_compatible(
        nn.Sequential(
            nn.Linear(3, 4), nn.LayerNorm(4), nn.GroupNorm(2, 4), nn.InstanceNorm1d(4), nn.Dropout()
        )
    )


@pytest.mark.parametrize(
    "layer",
    [
        nn.BatchNorm1d(4),
        nn.BatchNorm2d(4),
        nn.LazyBatchNorm1d(),
        nn.SyncBatchNorm(4),
        nn.BatchNorm1d(4, track_running_stats=False),
        nn.InstanceNorm2d(4, track_running_stats=True),
    ],
)
def test_layers_mixing_examples_refused(layer):
    model = nn.Sequential(nn.Linear(3, 4), nn.Sequential(nn.ReLU(), layer))
    with pytest.raises(ValueError, match=rf"'1\.1' \({type(layer).__name__}\)"):
        check_dp_compatible(model)
