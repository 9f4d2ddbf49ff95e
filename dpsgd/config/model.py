"""The ``model.*`` group of the config, checked against the dataset it trains on and the networks of
dpsgd/models/networks.py (whose ``check_input`` says which inputs each network takes).

Besides the types, names and ranges of each value, this refuses what would only fail once training
has started: PCA wider than the input, features with a projection, group counts that do not divide
the feature channels, models over PARAMS_MAX parameters (counted on the meta device, no memory, no
time) or that mix examples (BatchNorm, ...), frozen parameters that are not public ones, and
pretrained weights that do not fit the network.
"""

from __future__ import annotations

import math

from dpsgd.accountant import limits
from dpsgd.core.checks import boolean, choice, fmt, num
from dpsgd.core.errors import ConfigError
from dpsgd.data.datasets import dataset_info, input_shape
from dpsgd.data.features import FEATURE_NORMS, FEATURES, feature_shape
from dpsgd.mechanism.pca import PROJECTIONS
from dpsgd.models.networks import (
    FREEZE,
    INITS,
    MODELS,
    build_model,
    build_unloaded,
    check_dp_compatible,
    check_input,
    frozen_names,
)
from dpsgd.models.trainable import fine_tune, parse

# The largest model validated: 10**9 float32 parameters are 4 GB of weights alone, before gradients,
# noise and optimiser buffers (several times that); beyond what one CPU or GPU run of this repo
# holds.
PARAMS_MAX = 10**9


def validate_model(m, d) -> tuple[int, ...]:
    """The ``model.*`` group (a ``ModelConfig``), checked and coerced in place against the validated
    ``dataset.*`` group ``d``; returns the shape of one example after ``model.features``."""
    if m._target_ is not None:
        return _validate_user_model(m, d)
    if m.args:
        raise ConfigError(
            f"model.args={fmt(m.args)}: the arguments of model._target_, which is unset"
        )
    choice("model.name", m.name, MODELS)
    _check_widths(m)
    m.bias = boolean("model.bias", m.bias)
    choice("model.projection", m.projection, PROJECTIONS)
    choice("model.init", m.init, INITS)
    choice("model.features", m.features, FEATURES)
    choice("model.feature_norm", m.feature_norm, FEATURE_NORMS)
    shape = _features(m, d)
    _check_projection(m, d, shape)
    check_input(m, d.name, shape)
    if d.augment != "none" and m.projection != "none":
        raise ConfigError(
            f"model.projection={m.projection}: a projection is fit on fixed inputs; "
            f"dataset.augment={d.augment} needs model.projection=none"
        )
    choice("model.freeze", m.freeze, FREEZE)
    _check_built(m, d, shape)
    return shape


def _check_widths(m) -> None:
    """``model.hidden``: a list of positive widths, each layer below PARAMS_MAX, within GROUPS_MAX
    layers."""
    if not isinstance(m.hidden, (list, tuple)):
        raise ConfigError(f"model.hidden={fmt(m.hidden)}: must be a list of layer widths")
    if m.name == "mlp" and len(m.hidden) + 1 > limits.GROUPS_MAX:
        raise ConfigError(
            f"model.hidden: {len(m.hidden)} hidden layers; per-layer clipping charges one group "
            f"per layer, at most GROUPS_MAX={limits.GROUPS_MAX} (dpsgd/accountant/limits.py)"
        )
    m.hidden = [num(f"model.hidden[{i}]", h, integer=True, lo=1) for i, h in enumerate(m.hidden)]
    for i, h in enumerate(
        m.hidden
    ):  # a layer of width h has >= h weights (checked before any build)
        if h > PARAMS_MAX:
            raise ConfigError(
                f"model.hidden[{i}]={h}: a layer this wide holds more than "
                f"PARAMS_MAX={PARAMS_MAX:.0e} parameters (4 GB of float32 weights before gradients "
                "and noise)"
            )


def _validate_user_model(m, d) -> tuple[int, ...]:
    """``model._target_``: your own class, built on the meta device with ``model.args`` and checked
    as the presets' networks are (no layer that mixes examples, at most PARAMS_MAX parameters). It
    takes the dataset's examples as they are: no projection, no fixed features, no pretrained
    file."""
    key = f"model._target_={m._target_}"
    if m._target_ == "???":  # model=custom, and no class given (OmegaConf's missing value)
        raise ConfigError(
            "model._target_: model=custom needs your network's class "
            "(model._target_=pkg.module.Class)"
        )
    if not isinstance(m._target_, str) or not m._target_:
        raise ConfigError(f"model._target_={fmt(m._target_)}: must name a class, pkg.module.Class")
    if not isinstance(m.args, dict):
        raise ConfigError(f"model.args={fmt(m.args)}: must be a mapping of keyword arguments")
    for name, off in (("projection", "none"), ("features", "none"), ("freeze", "none")):
        if getattr(m, name) != off and not (name == "projection" and m.pca_dims == 0):
            raise ConfigError(
                f"{key}: your model takes the dataset's examples as they are; set "
                f"model.{name}={off} (or start from model=custom)"
            )
    if m.pretrained is not None:
        raise ConfigError(f"{key}: model.pretrained loads the presets' networks; load yours in it")
    m.projection, m.pca_dims = "none", 0
    shape = input_shape(d, d.crop)
    try:
        model = build_unloaded(m, shape, dataset_info(d).classes)
        check_dp_compatible(model)
    except ValueError as e:
        msg = str(e).splitlines()[0]
        raise ConfigError(msg if msg.startswith(key) else f"{key}: {msg}") from None
    n_params = sum(p.numel() for p in model.parameters())
    if n_params > PARAMS_MAX or not any(p.requires_grad for p in model.parameters()):
        raise ConfigError(f"{key}: {n_params} parameters; need 1 to PARAMS_MAX={PARAMS_MAX:.0e}")
    _check_fit(key, model, shape, dataset_info(d).classes, getattr(d, "dtype", "float32"))
    _check_trainable(m, model)
    return shape


def _check_trainable(m, model) -> None:
    """``model.trainable`` (and the LoRA shape it may use), tried on the meta-device ``model`` (in
    place): each part selects something, and something is left to train."""
    key = f"model.trainable={fmt(m.trainable)}"
    m.lora_rank = num("model.lora_rank", m.lora_rank, integer=True, lo=1)
    m.lora_alpha = num("model.lora_alpha", m.lora_alpha, lo=0, lo_open=True)
    try:
        parts = parse(m.trainable)
    except ValueError as e:
        raise ConfigError(f"{key}: {str(e).split(': ', 1)[1]}") from None
    if parts == ("all",):
        return
    if m.freeze != "none":
        raise ConfigError(
            f"{key}: model.freeze={m.freeze} also chooses what trains; set one of the two "
            "(model.trainable chooses among all the parameters)"
        )
    try:
        fine_tune(model, m.trainable, m.lora_rank, m.lora_alpha)
    except ValueError as e:  # the API's words, said of the key
        msg = str(e).splitlines()[0]
        msg = msg.split(": ", 1)[1] if msg.startswith(("trainable=", "add_lora:")) else msg
        raise ConfigError(f"{key}: {msg}") from None


def _check_fit(key: str, model, shape: tuple[int, ...], classes: int, dtype="float32") -> None:
    """Your network on two examples of the dataset's shape and ``dataset.dtype``, on the meta
    device (no memory, no time; on the CPU for a model built there): it takes them and gives a
    score per class (a tensor, or a Hugging Face output's ``logits``) for every label of the
    training and the test file (cross-entropy); a mismatch found only in training came after its
    set-up, with a folder written and, for the test labels, an epoch of privacy already spent."""
    import torch

    from dpsgd.mechanism.batches import logits_of

    device = next(model.parameters()).device
    try:
        with torch.device(device), torch.no_grad():
            x = torch.zeros((2, *shape), dtype=getattr(torch, dtype))
            out = model(x)
            out = (
                logits_of(out)
                if not isinstance(out, torch.Tensor) and hasattr(out, "logits")
                else out
            )
    except NotImplementedError:  # an operation without a meta kernel: cannot be tried here
        return
    except Exception as e:  # noqa: BLE001 (the user's forward: any failure is a misfit)
        msg = " ".join(str(e).split())[:160] or type(e).__name__
        raise ConfigError(
            f"{key}: does not take the dataset's examples of shape {list(shape)} ({msg})"
        ) from None
    if not isinstance(out, torch.Tensor) or out.ndim != 2 or out.shape[0] != 2:
        got = list(out.shape) if isinstance(out, torch.Tensor) else type(out).__name__
        raise ConfigError(
            f"{key}: gives {got} for 2 examples; the loss (cross-entropy) needs one score per class "
            "for each example, [2, classes]"
        )
    if out.shape[1] < classes:
        raise ConfigError(
            f"{key}: gives {out.shape[1]} scores per example, the dataset's labels need {classes} "
            f"(classes 0..{classes - 1}, training and test files)"
        )


def _features(m, d) -> tuple[int, ...]:
    """The shape of one example after ``model.features`` (the fixed transform replaces any
    projection)."""
    shape = input_shape(d, d.crop)
    if m.features == "none":
        return shape
    try:
        shape = feature_shape(m.features, shape)
    except ValueError as e:
        raise ConfigError(f"model.features={m.features}: {e}") from None
    if m.projection != "none" and m.pca_dims != 0:
        raise ConfigError(
            f"model.projection={m.projection}: the {m.features} features are the input "
            "transform; use model.projection=none"
        )
    m.feature_groups = num("model.feature_groups", m.feature_groups, integer=True, lo=1)
    if m.feature_norm == "group" and shape[0] % m.feature_groups:
        raise ConfigError(
            f"model.feature_groups={m.feature_groups}: must divide the {shape[0]} feature channels"
        )
    return shape


def _check_projection(m, d, shape) -> None:
    """``model.pca_dims`` within the input dimension; 0 means no projection."""
    in_dim = math.prod(shape)
    m.pca_dims = num("model.pca_dims", m.pca_dims, integer=True, lo=0)
    if m.projection != "none" and m.pca_dims > in_dim:
        raise ConfigError(
            f"model.pca_dims={m.pca_dims}: exceeds the input dimension {in_dim} of {d.name}"
        )
    if m.projection != "none" and m.pca_dims == 0:
        m.projection = "none"


def _check_built(m, d, shape) -> None:
    """The network itself, built on the meta device (no memory, no time): at most PARAMS_MAX
    parameters, no layer that mixes examples, something left to train, public frozen weights."""
    import torch

    with torch.device("meta"):
        model = build_model(m, shape, dataset_info(d).classes)
    n_params = sum(p.numel() for p in model.parameters())
    if n_params > PARAMS_MAX:
        raise ConfigError(
            f"model.hidden={list(m.hidden)}: {n_params} parameters ({m.name}), more "
            f"than PARAMS_MAX={PARAMS_MAX:.0e} (4 GB of float32 weights before gradients and noise)"
        )
    try:
        check_dp_compatible(model)
    except ValueError as e:
        raise ConfigError(f"model.name={m.name}: {str(e).splitlines()[0]}") from None
    frozen = frozen_names(model, m.freeze)
    if m.freeze != "none" and not frozen:
        raise ConfigError(f"model.freeze={m.freeze}: the {m.name} model has no such parameters")
    if m.freeze != "none" and m.pretrained is None:
        raise ConfigError(
            f"model.freeze={m.freeze}: freezes public weights; set model.pretrained to their "
            "artifact"
        )
    if len(frozen) == sum(1 for _ in model.parameters()):
        raise ConfigError(f"model.freeze={m.freeze}: nothing left to train")
    _data_before_pretrained(m, d)
    _check_pretrained(m, model, frozen)
    _check_trainable(m, model)


def _data_before_pretrained(m, d) -> None:
    """A missing pretrained artifact is built from CIFAR-100 (python -m dpsgd.pretrain): when the
    run's own dataset is not here either, that comes first, and is said first."""
    import os

    from dpsgd.data.archives import has_local_copy, how_to_provide
    from dpsgd.data.datasets import DATASETS

    if not isinstance(m.pretrained, str) or os.path.exists(m.pretrained):
        return
    missing = [n for n in dict.fromkeys([d.name, "cifar100"])
               if n in DATASETS and not has_local_copy(n, d.root)]  # fmt: skip
    if missing:
        raise ConfigError(
            f"dataset={d.name}: {', '.join(missing)} not in the data root: "
            f"{how_to_provide(missing[0])} (docs/CIFAR.md); then build "
            f"model.pretrained={m.pretrained} (make {m.pretrained})"
        )


def _check_pretrained(m, model, frozen: list[str]) -> None:
    """``model.pretrained``: a hash-checked artifact whose tensors fit the network and hold every
    frozen one."""
    if m.pretrained_sha256 is not None and (
        not isinstance(m.pretrained_sha256, str) or m.pretrained is None
    ):
        raise ConfigError(
            f"model.pretrained_sha256={fmt(m.pretrained_sha256)}: a hex digest, with "
            "model.pretrained"
        )
    if m.pretrained is None:
        return
    if not isinstance(m.pretrained, str) or not m.pretrained:
        raise ConfigError(f"model.pretrained={fmt(m.pretrained)}: must be the path of an artifact")
    from dpsgd.models.pretrained import verify

    tensors, m.pretrained_sha256 = verify(m.pretrained, m.pretrained_sha256)
    shapes = {n: tuple(t.shape) for n, t in model.state_dict().items()}
    for n, shape in tensors.items():
        if shapes.get(n) != shape:
            raise ConfigError(
                f"model.pretrained={m.pretrained}: its tensor {n} {list(shape)} does not fit the "
                f"{m.name} model ({list(shapes[n]) if n in shapes else 'no such tensor'})"
            )
    missing = [n for n in frozen if n not in tensors]
    if missing:
        raise ConfigError(
            f"model.pretrained={m.pretrained}: holds no {missing[0]}, which "
            f"model.freeze={m.freeze} freezes (a frozen tensor must be the public one)"
        )
