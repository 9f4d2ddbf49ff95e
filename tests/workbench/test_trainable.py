"""Parameter-efficient fine-tuning (dpsgd/models/trainable.py): what ``trainable`` selects, frozen
weights bit-identical across noisy DP-SGD steps, LoRA through ``peft`` exact under the ghost engine
(against a float64 batch-of-1 loop, its dropout included), bias-only fine-tuning (BiTFiT), and the
command line's ``model.trainable`` (validated, counted in the calibration's k, run end to end)."""

from __future__ import annotations

import json

import pytest
import torch
from torch import nn

import dpsgd
from dp_reference import assert_close, loop_clipped_sum
from dpsgd.config.schema import ConfigError, validate
from dpsgd.launch.main import compose
from dpsgd.mechanism.clipping import PerExampleClipper
from dpsgd.mechanism.clipping.layers import LinearLayer
from dpsgd.models.trainable import add_lora, default_head, selected, trainable
from tolerances import assert_f64_close, f64_rtol

DT = torch.float64
C = 0.05  # every example clipped


class Net(nn.Module):
    """Linear → LayerNorm → Linear → head, biases everywhere (a tiny pretrained backbone)."""

    def __init__(self, d=6, h=12, classes=4):
        super().__init__()
        self.inp = nn.Linear(d, h)
        self.ln = nn.LayerNorm(h)
        self.mid = nn.Linear(h, h)
        self.head = nn.Linear(h, classes)

    def forward(self, x):
        return self.head(torch.tanh(self.mid(self.ln(torch.tanh(self.inp(x))))))


def data(n=8, d=6, seed=0, dtype=DT):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(n, d, generator=g, dtype=dtype), torch.randint(0, 4, (n,), generator=g)


# -- the selection -------------------------------------------------------------------------------
def test_what_each_part_selects():
    m = Net()
    assert default_head(m) == "head"
    assert selected(m, "bias") == ["inp.bias", "ln.bias", "mid.bias", "head.bias"]
    assert selected(m, "head") == ["head.weight", "head.bias"]
    assert selected(m, "norm") == ["ln.weight", "ln.bias"]
    assert selected(m, "bias+head") == [
        "inp.bias",
        "ln.bias",
        "mid.bias",
        "head.bias",
        "head.weight",
    ]
    assert selected(m, "head", head="mid") == ["mid.weight", "mid.bias"]
    assert trainable(m, "bias") == ["inp.bias", "ln.bias", "mid.bias", "head.bias"]
    assert [n for n, p in m.named_parameters() if not p.requires_grad] == [
        "inp.weight",
        "ln.weight",
        "mid.weight",
        "head.weight",
    ]
    assert len(trainable(m, "all")) == 8  # everything trains again


@pytest.mark.parametrize(
    "which, message",
    [
        ("weights", "'weights' is not one of all, bias, head, norm, lora"),
        ("all+bias", "'all' already selects every parameter"),
        ("bias+bias", "a part is named twice"),
        ("lora", "the model has no lora parameters"),
        ("", "one of all, bias, head, norm, lora"),
    ],
)
def test_a_bad_selection_is_one_line(which, message):
    with pytest.raises(ValueError, match=message) as e:
        trainable(Net(), which)
    assert "\n" not in str(e.value)


def test_a_model_without_biases_or_with_an_unknown_head_is_refused():
    with pytest.raises(ValueError, match="no bias parameters"):
        trainable(nn.Linear(3, 2, bias=False), "bias")
    with pytest.raises(ValueError, match="head='nope' is no module"):
        trainable(Net(), "head", head="nope")


# -- frozen weights never move ---------------------------------------------------------------------
def _lora(m):
    pytest.importorskip("peft")
    add_lora(m, rank=2, alpha=4.0, dropout=0.1)
    return trainable(m, "lora+head")


@pytest.mark.parametrize(
    "select", [lambda m: trainable(m, "bias"), lambda m: trainable(m, "head"), _lora]
)
@pytest.mark.parametrize("clipping", ["global", "per_layer"])
def test_frozen_weights_stay_bit_identical_across_noisy_steps(select, clipping):
    torch.manual_seed(0)
    m = Net()
    names = select(m)
    before = {n: p.detach().clone() for n, p in m.named_parameters()}
    X, y = data(240, dtype=torch.float32)
    tr = dpsgd.PrivateTrainer(
        m, (X, y), lot_size=40, clip_norm=1.0, sigma=2.0, clipping=clipping, lr=0.5, seed=0
    )
    tr.fit(2)
    assert tr.steps == 12 and tr.epsilon > 0
    groups = [n for g in tr.clipper.groups for n in g]
    assert sorted(groups) == sorted(names)  # only the trainable ones are clipped (and noised)
    for n, p in m.named_parameters():
        if n in names:
            assert not torch.equal(p, before[n]), n  # moved: the noise alone moves it
        else:
            assert torch.equal(p, before[n]), n  # bit for bit: no gradient, no noise, no step


def test_per_layer_k_counts_only_the_trained_modules():
    m = Net()
    trainable(m, "bias+head")
    c = PerExampleClipper(m, 1.0, "per_layer")
    assert c.groups == [["inp.bias"], ["ln.bias"], ["mid.bias"], ["head.weight", "head.bias"]]


# -- LoRA through peft, exact under the ghost engine ---------------------------------------------
def _peft_net(dropout=0.0, wrapper=False):
    peft = pytest.importorskip("peft")
    torch.manual_seed(1)
    m = Net().to(DT)
    if wrapper:  # peft's own entry point: the head trained as a module to save
        cfg = peft.LoraConfig(
            r=3, lora_alpha=6, lora_dropout=dropout, target_modules=["inp", "mid"],
            modules_to_save=["head"],
        )  # fmt: skip
        m = peft.get_peft_model(m, cfg)
    else:
        add_lora(m, rank=3, alpha=6.0, dropout=dropout)
        trainable(m, "lora+head")
    with torch.no_grad():  # lora_B starts at 0: make the adapters' gradients all non-trivial
        for n, p in m.named_parameters():
            if "lora_B" in n:
                p.normal_(0, 0.5)
    return m


@pytest.mark.parametrize("wrapper", [False, True])
@pytest.mark.parametrize("clipping", ["global", "per_layer"])
def test_lora_is_exact_on_ghost_rules(wrapper, clipping):
    m = _peft_net(wrapper=wrapper).eval()
    x, y = data()
    ghost = PerExampleClipper(m, C, clipping, "ghost")  # runs only once the proof passed
    assert ghost.native and all(type(l) is LinearLayer for l in ghost._layers)
    trained = {n for n, p in m.named_parameters() if p.requires_grad}
    assert trained and all("lora_" in n or "head" in n for n in trained)
    r = ghost.clipped_sum(x, y)
    ref, ref_norms = loop_clipped_sum(m, x, y, ghost.groups, C)
    assert_close(r.grads, ref)
    assert_f64_close(r.norms, ref_norms, f64_rtol(m))
    assert (ref_norms > C).all()


def test_lora_dropout_in_training_mode_clips_each_examples_own_gradient():
    """With lora_dropout active, the ghost engine's clipped sum is that of the per-example gradients
    of the same forward pass (the same dropout masks: the same RNG state), each clipped; the proof
    itself runs its twin with dropout off."""
    m = _peft_net(dropout=0.3).train()
    x, y = data()
    ghost = PerExampleClipper(m, C, "global", "ghost")
    ghost.prove(x, y)  # the proof first (it leaves the RNG as it was)
    torch.manual_seed(7)
    r = ghost.clipped_sum(x, y)
    named = [(n, p) for n, p in m.named_parameters() if p.requires_grad]
    torch.manual_seed(7)  # the same masks: one forward pass over the batch, as the engine's
    losses = nn.functional.cross_entropy(m(x), y, reduction="none")
    ref = {n: torch.zeros_like(p) for n, p in named}
    for i in range(len(y)):
        g = torch.autograd.grad(losses[i], [p for _, p in named], retain_graph=True)
        norm = torch.sqrt(sum(t.square().sum() for t in g))
        for (n, _), t in zip(named, g):
            ref[n] += t * min(1.0, C / float(norm))
    assert_close(r.grads, ref)
    assert not torch.equal(r.grads[named[0][0]], ghost.clipped_sum(x, y).grads[named[0][0]])


def test_bias_only_fine_tuning_is_exact_and_keeps_no_inputs():
    torch.manual_seed(2)
    m = Net().to(DT)
    trainable(m, "bias")
    x, y = data()
    ghost = PerExampleClipper(m, C, "per_layer", "ghost")
    assert not any(l.needs_input for l in ghost._layers if type(l) is LinearLayer)
    r = ghost.clipped_sum(x, y)
    ref, ref_norms = loop_clipped_sum(m, x, y, ghost.groups, C)
    assert_close(r.grads, ref)
    assert_f64_close(r.norms, ref_norms, f64_rtol(m))


# -- the command line ------------------------------------------------------------------------------
MLP = ["model.bias=true", "model.projection=none", "model.pca_dims=0", "model.hidden=[32]"]


@pytest.mark.parametrize(
    "args, message",
    [
        (["model.trainable=bias"], "model.trainable=bias: the model has no bias parameters"),
        (["model.trainable=weights"], "model.trainable=weights: 'weights' is not one of"),
        ([*MLP, "model.trainable=lora", "model.lora_rank=0"], "model.lora_rank=0: must be >= 1"),
        ([*MLP, "model.trainable=lora", "model.lora_alpha=0"], "model.lora_alpha=0"),
    ],
)
def test_the_command_line_refuses_a_bad_selection_in_one_line(args, message):
    with pytest.raises(ConfigError, match=message) as e:
        validate(compose(args))
    assert "\n" not in str(e.value)


def test_freeze_and_trainable_both_set_are_refused():
    """model.freeze (the cnn's public convolutions, CIFAR only) and model.trainable both choose
    what trains: one of the two (checked on the config group directly: no CIFAR here)."""
    from types import SimpleNamespace

    from dpsgd.config.model import _check_trainable

    m = SimpleNamespace(trainable="bias", freeze="features", lora_rank=8, lora_alpha=16.0)
    with pytest.raises(ConfigError, match="model.freeze=features also chooses what trains"):
        _check_trainable(m, Net())


def test_the_calibrated_sigma_counts_the_trained_groups():
    """privacy.calibrate_sigma's k is the clipper's: per-layer clipping of bias+head on a one-hidden-
    layer MLP clips 2 groups (first bias; head weight and bias), not 2 layers' weights too."""
    from dpsgd.config.calibration import clipping_groups
    from dpsgd.models.networks import build_model

    args = [*MLP, "model.hidden=[32,32]", "model.trainable=bias+head", "privacy.clipping=per_layer"]
    c = validate(compose(args))
    m = build_model(c.model, (1, 28, 28), 10)
    k = clipping_groups(m, "per_layer", c.model.freeze, c.model)
    assert k == len(PerExampleClipper(m, 1.0, "per_layer").groups) == 3


def test_a_lora_run_from_the_command_line(tmp_path):
    pytest.importorskip("peft")
    from dpsgd.train import train

    args = [
        *MLP,
        "model.trainable=lora+head",
        "model.lora_rank=4",
        "dataset.subset=1000",
        "privacy.lot_size=100",
        "privacy.sigma=1.0",
        "privacy.clipping=global",
        "training.max_steps=3",
        "device=cpu",
    ]
    out = train(validate(compose(args)), tmp_path / "run", args)
    assert out["status"] == "complete" and out["steps"] == 3
    st = json.loads((tmp_path / "run" / "privacy.json").read_text())
    trained = st["private_parameters"]
    assert sorted(trained) == sorted(
        ["net.0.lora_A.default.weight", "net.0.lora_B.default.weight", "net.2.weight", "net.2.bias"]
    )
