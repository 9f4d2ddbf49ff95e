"""Models of Abadi et al. 2016 (arXiv 1607.00133) and the DP-compatibility check.

- MNIST (paper §5.2): a fixed 60-d PCA projection (applied to the data, outside the model), one
  hidden layer of 1000 ReLU units, 10 logits; the paper's network has no biases.
- ``linear`` and ``scatter_cnn``: Tramèr & Boneh 2021 (arXiv 2011.11660) on ScatterNet features
  (``dpsgd/data/features.py``): a linear classifier, and their small tanh CNN for MNIST.
- CIFAR-10 (paper §5.3): 24×24×3 crops, two 5×5×64 convolutions (stride 1, ReLU, 2×2 max-pool),
  two fully connected layers of 384 ReLU units and a softmax layer ("SAME" padding, as in the
  TensorFlow CIFAR tutorial model the paper starts from: 24 → 12 → 6).
- Beyond the paper, MNIST / Fashion-MNIST end to end: `TanhCNN`, the CNN with tanh ("tempered
  sigmoid") activations of Papernot et al. 2021 (arXiv 2007.14191) in the layout of Tramèr & Boneh
  2021 (arXiv 2011.11660, ftramer/Handcrafted-DP `models.py:MNIST_CNN`), optionally with GroupNorm.

`check_dp_compatible` refuses layers that mix examples: per-example sensitivity (the C in
Algorithm 1) only holds if example i's gradient depends on example i alone. `check_input` holds the
inputs each network takes (the rest of the ``model.*`` group is checked in dpsgd/config/model.py).
"""

from __future__ import annotations

import math
from typing import Sequence

import torch
from torch import nn

from dpsgd.core.checks import choice
from dpsgd.core.errors import ConfigError


class MLP(nn.Module):
    """Fully connected ReLU network returning logits.

    The paper's MNIST net is ``MLP(60, (1000,), 10, bias=False)`` on PCA-projected input.
    """

    def __init__(
        self,
        in_features: int,
        hidden: Sequence[int] = (1000,),
        num_classes: int = 10,
        bias: bool = False,
        init: str = "paper",
    ):
        super().__init__()
        if in_features < 1:
            raise ValueError(f"in_features must be >= 1, got {in_features}")
        if num_classes < 1:
            raise ValueError(f"num_classes must be >= 1, got {num_classes}")
        hidden = tuple(int(h) for h in hidden)
        if any(h < 1 for h in hidden):
            raise ValueError(f"hidden sizes must be >= 1, got {hidden}")
        widths = (int(in_features),) + hidden
        layers: list[nn.Module] = []
        for w_in, w_out in zip(widths[:-1], widths[1:]):
            layers += [nn.Linear(w_in, w_out, bias=bias), nn.ReLU()]
        layers.append(nn.Linear(widths[-1], num_classes, bias=bias))
        self.net = nn.Sequential(*layers)
        self.in_features = int(in_features)
        init_weights(self, init)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x.flatten(1))


def init_weights(model: nn.Module, init: str) -> None:
    """``init="paper"``: the original code's initialisation (TF ``utils.BuildNetwork``): weights
    from a normal truncated at ±2 std with std 1/√fan_in, biases zero. ``init="torch"``: PyTorch's
    default."""
    if init not in INITS:
        raise ValueError(f"model.init={init!r}: must be one of {list(INITS)}")
    if init == "torch":
        return
    for m in model.modules():
        if isinstance(m, (nn.Linear, nn.Conv2d)):
            std = 1.0 / (m.weight[0].numel() ** 0.5)
            with torch.no_grad():
                nn.init.trunc_normal_(m.weight, std=std, a=-2 * std, b=2 * std)
                if m.bias is not None:
                    m.bias.zero_()


class CifarCNN(nn.Module):
    """The paper's CIFAR-10 network: input 3×24×24 → logits."""

    def __init__(self, num_classes: int = 10, bias: bool = True, init: str = "paper"):
        super().__init__()
        self.features = nn.Sequential(
            nn.Conv2d(3, 64, kernel_size=5, stride=1, padding=2, bias=bias),
            nn.ReLU(),
            nn.MaxPool2d(2),  # 24 -> 12
            nn.Conv2d(64, 64, kernel_size=5, stride=1, padding=2, bias=bias),
            nn.ReLU(),
            nn.MaxPool2d(2),  # 12 -> 6
        )
        self.classifier = nn.Sequential(
            nn.Flatten(),
            nn.Linear(64 * 6 * 6, 384, bias=bias),
            nn.ReLU(),
            nn.Linear(384, 384, bias=bias),
            nn.ReLU(),
            nn.Linear(384, num_classes, bias=bias),
        )
        init_weights(self, init)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.shape[1:] != (3, 24, 24):
            raise ValueError(f"CifarCNN expects input of shape [B, 3, 24, 24], got {list(x.shape)}")
        return self.classifier(self.features(x))


class TanhCNN(nn.Module):
    """End-to-end CNN for 1×28×28 images with tanh activations (Papernot et al. 2021; the MNIST /
    Fashion-MNIST network of Tramèr & Boneh 2021, ftramer/Handcrafted-DP ``MNIST_CNN``):

        conv 16 8×8 stride 2 pad 2 → tanh → maxpool 2 stride 1      28 → 13 → 12
        conv 32 4×4 stride 2       → tanh → maxpool 2 stride 1      12 →  5 →  4
        flatten 512 → linear 32 → tanh → linear 10

    ``norm="group"`` puts a GroupNorm (NORM_GROUPS groups, affine) after each convolution, before
    its tanh (not in Tramèr & Boneh's end-to-end net; GroupNorm normalises each example on its own,
    so per-example clipping stays exact; the ghost engine has a rule for it)."""

    NORM_GROUPS = 4

    def __init__(
        self, num_classes: int = 10, bias: bool = True, init: str = "torch", norm: str = "none"
    ):
        super().__init__()
        if norm not in NORMS:
            raise ValueError(f"model.norm={norm!r}: must be one of {list(NORMS)}")

        def block(cin, cout, k, stride, pad):
            conv = nn.Conv2d(cin, cout, kernel_size=k, stride=stride, padding=pad, bias=bias)
            gn = [nn.GroupNorm(self.NORM_GROUPS, cout)] if norm == "group" else []
            return [conv, *gn, nn.Tanh(), nn.MaxPool2d(2, stride=1)]

        self.features = nn.Sequential(*block(1, 16, 8, 2, 2), *block(16, 32, 4, 2, 0))
        self.classifier = nn.Sequential(
            nn.Flatten(),
            nn.Linear(32 * 4 * 4, 32, bias=bias),
            nn.Tanh(),
            nn.Linear(32, num_classes, bias=bias),
        )
        init_weights(self, init)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.dim() == 2 and x.shape[1] == 28 * 28:
            x = x.view(-1, 1, 28, 28)
        if x.shape[1:] != (1, 28, 28):
            raise ValueError(f"TanhCNN expects input of shape [B, 1, 28, 28], got {list(x.shape)}")
        return self.classifier(self.features(x))


class Linear(nn.Module):
    """A linear classifier on the flattened input: Tramèr & Boneh 2021's ``ScatterLinear`` (their
    ``models.py``) once the fixed features and their normalisation are applied outside the model."""

    def __init__(
        self, in_features: int, num_classes: int = 10, bias: bool = True, init: str = "torch"
    ):
        super().__init__()
        self.fc = nn.Linear(int(in_features), num_classes, bias=bias)
        init_weights(self, init)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc(x.flatten(1))


class ScatterCNN(nn.Module):
    """Tramèr & Boneh 2021's CNN on ScatterNet features for MNIST (their ``models.py`` ``MNIST_CNN``
    with ``in_channels`` = 81): conv 3×3/2 (16) → tanh → conv 3×3/1 (32) → tanh → FC 32 → tanh → FC.

    Input: K × 7 × 7 scattering coefficients (K = in_features / 49), already normalised."""

    SIDE = 7

    def __init__(
        self,
        in_features: int,
        num_classes: int = 10,
        bias: bool = True,
        init: str = "torch",
        channels: tuple[int, int] = (16, 32),
        hidden: int = 32,
    ):
        super().__init__()
        if in_features % (self.SIDE * self.SIDE):
            raise ValueError(f"ScatterCNN expects K x 7 x 7 inputs, got {in_features} features")
        self.K = in_features // (self.SIDE * self.SIDE)
        c1, c2 = channels
        self.features = nn.Sequential(
            nn.Conv2d(self.K, c1, kernel_size=3, stride=2, padding=1, bias=bias),
            nn.Tanh(),  # 7 -> 4
            nn.Conv2d(c1, c2, kernel_size=3, stride=1, padding=1, bias=bias),
            nn.Tanh(),  # 4 -> 4
        )
        self.classifier = nn.Sequential(
            nn.Flatten(),
            nn.Linear(c2 * 4 * 4, hidden, bias=bias),
            nn.Tanh(),
            nn.Linear(hidden, num_classes, bias=bias),
        )
        init_weights(self, init)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.classifier(self.features(x.reshape(len(x), self.K, self.SIDE, self.SIDE)))


INITS = ("paper", "torch")
NORMS = ("none", "group")  # model.norm: normalisation after the convolutions (tanh_cnn)
# model.freeze -> prefix of the parameters frozen (public weights, e.g. CIFAR-100-pretrained convs)
FREEZE = {
    "none": "",
    "features": "features.",
}
# model.name -> network for (input features after any projection, hidden widths, classes)
MODELS = {
    "mlp": lambda in_features, hidden, num_classes, bias, init, **_: MLP(
        in_features, hidden, num_classes, bias, init
    ),
    "cnn": lambda in_features, hidden, num_classes, bias, init, **_: CifarCNN(
        num_classes, bias, init
    ),
    "tanh_cnn": lambda in_features, hidden, num_classes, bias, init, norm="none", **_: TanhCNN(
        num_classes, bias, init, norm
    ),
    "linear": lambda in_features, hidden, num_classes, bias, init, **_: Linear(
        in_features, num_classes, bias, init
    ),
    "scatter_cnn": lambda in_features, hidden, num_classes, bias, init, **_: ScatterCNN(
        in_features, num_classes, bias, init
    ),
}


def _mixes_examples(module: nn.Module) -> str | None:
    """Why `module` mixes examples within a batch, or None if it does not."""
    if isinstance(
        module, nn.modules.batchnorm._BatchNorm
    ):  # BatchNorm1d/2d/3d, Lazy*, SyncBatchNorm
        return "batch normalisation uses statistics of the whole batch"
    if isinstance(module, nn.modules.instancenorm._InstanceNorm) and module.track_running_stats:
        return "running statistics (track_running_stats=True) are averaged over the batch"
    if isinstance(module, nn.modules.batchnorm._NormBase) and module.track_running_stats:
        return "running statistics are averaged over the batch"
    if isinstance(module, nn.Embedding | nn.EmbeddingBag) and module.scale_grad_by_freq:
        return (
            "scale_grad_by_freq=True scales each token's gradient by its count in the whole batch"
        )
    return None


def _changes_weights(module: nn.Module) -> str | None:
    """Why `module` changes its own weights in the forward pass, outside the DP update."""
    if isinstance(module, nn.Embedding | nn.EmbeddingBag) and module.max_norm is not None:
        return (
            f"max_norm={module.max_norm} renormalises, in place, the rows each lot looks up: a "
            "change of the weights that depends on the private tokens and is not noised; set "
            "max_norm=None (or normalise in forward, e.g. F.normalize of the looked-up rows)"
        )
    return None


def check_dp_compatible(model: nn.Module) -> None:
    """Raise ValueError naming the first module that mixes examples (BatchNorm, an Embedding
    with ``scale_grad_by_freq``, ...) or changes its weights in the forward pass (an Embedding with
    ``max_norm``).

    GroupNorm, LayerNorm and InstanceNorm without running statistics normalise each example on its
    own and are accepted; so are Dropout, pooling and all per-example layers. What no module type
    shows (``h - h.mean(0)`` in a forward) the clipper's proof finds
    (dpsgd/mechanism/clipping/proof.py).
    """
    for name, module in model.named_modules():
        label = name or "<root>"
        changes = _changes_weights(module)
        if changes is not None:
            raise ValueError(f"module '{label}' ({type(module).__name__}): {changes}")
        reason = _mixes_examples(module)
        if reason is not None:
            raise ValueError(
                f"module '{label}' ({type(module).__name__}) mixes examples: {reason}; "
                "per-example gradient clipping (DP-SGD) needs each example's gradient to depend "
                "on that example only. Replace it, e.g. with nn.GroupNorm or nn.LayerNorm."
            )


TANH_CNN_DATASETS = ("mnist", "fashion_mnist")  # 1×28×28 images


def check_input(m, dataset: str, shape: tuple[int, ...]) -> None:
    """Refuse a network of ``model.*`` (a ``ModelConfig``) that cannot take the inputs of
    ``dataset`` (``shape``: one example after ``model.features``): the image models take images (no
    projection) of their size, and only ``tanh_cnn`` has a normalisation option (``model.norm``)."""
    dims = "x".join(map(str, shape))
    if m.name == "cnn":
        if shape != (3, 24, 24):
            raise ConfigError(
                f"model.name=cnn: needs 3x24x24 images (cifar10/cifar100 with dataset.crop=24), "
                f"{dataset} gives {dims}"
            )
        if m.projection != "none":
            raise ConfigError(
                f"model.projection={m.projection}: the cnn model takes images; use none"
            )
    choice("model.norm", m.norm, NORMS)
    if m.name == "tanh_cnn":
        if dataset not in TANH_CNN_DATASETS:
            raise ConfigError(
                f"model.name=tanh_cnn: needs 1x28x28 images ({', '.join(TANH_CNN_DATASETS)}), "
                f"{dataset} gives {dims}"
            )
        if m.projection != "none":
            raise ConfigError(
                f"model.projection={m.projection}: the tanh_cnn model takes images; use none"
            )
    elif m.norm != "none":
        raise ConfigError(
            f"model.norm={m.norm}: only model.name=tanh_cnn has a normalisation option"
        )


def build_model(m, shape, classes: int):
    """The network of ``model.*`` (a ``ModelConfig``) for inputs of ``shape`` (after any
    projection); with ``model._target_``, the user's class built by Hydra's instantiate with
    ``model.args``."""
    if getattr(m, "_target_", None):
        return user_model(m._target_, m.args)
    in_features = (
        m.pca_dims if m.projection != "none" and m.features == "none" else math.prod(shape)
    )
    return MODELS[m.name](
        in_features=in_features,
        hidden=tuple(m.hidden),
        num_classes=classes,
        bias=m.bias,
        init=m.init,
        norm=m.norm,
    )


def build_unloaded(m, shape, classes: int):
    """``build_model`` on the meta device (no memory, no time: for counting and checking); on the
    CPU where the class refuses the meta device (a ``from_pretrained`` loads its weights)."""
    import torch

    try:
        with torch.device("meta"):
            return build_model(m, shape, classes)
    except ValueError as e:
        if "meta" not in str(e):
            raise
    return build_model(m, shape, classes)


def frozen_names(model, freeze: str) -> list[str]:
    """The parameters ``model.freeze`` freezes (requires_grad=False: public, neither clipped nor
    noised)."""
    return (
        [n for n, _ in model.named_parameters() if n.startswith(FREEZE[freeze])]
        if FREEZE[freeze]
        else []
    )


def user_model(target: str, args: dict):
    """``target(**args)`` through ``hydra.utils.instantiate``; ValueError naming ``model._target_``
    when it cannot be imported, built, or is not an ``nn.Module``."""
    from hydra.errors import InstantiationException
    from hydra.utils import instantiate

    try:
        model = instantiate({"_target_": target, **dict(args)})
    except InstantiationException as e:
        # the call and its cause (a from_pretrained's own refusal), on one line
        why = " ".join(str(e).split()).split(" Set the environment variable HYDRA_FULL_ERROR")[0]
        raise ValueError(
            f"model._target_={target}: {why.split(', set env var HYDRA_FULL')[0]}"
        ) from None
    except Exception as e:  # noqa: BLE001 (an omegaconf error, the user's own __init__)
        first = (str(e).strip().splitlines() or [type(e).__name__])[0]
        raise ValueError(f"model._target_={target}: {first}") from None
    if not isinstance(model, nn.Module):
        raise ValueError(
            f"model._target_={target}: built a {type(model).__name__}, not an nn.Module"
        )
    return model
