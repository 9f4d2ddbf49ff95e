"""Augmentation multiplicity (De et al. 2022): K augmented copies per example, gradients averaged
before clipping. K = 1 is the plain step exactly; K > 1 equals a reference loop (for each example:
the mean of its K gradients, clip, sum) in float64, in both engines and for every layer rule; a
clipped example has norm C; the augmentation draws from the given generator."""

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from dp_reference import assert_close, loop_clipped_sum
from dpsgd.mechanism.clipping import PerExampleClipper
from dpsgd.config.schema import ConfigError, validate
from dpsgd.models.networks import MLP, TanhCNN
from dpsgd.mechanism.noise import GaussianNoise
from dpsgd.mechanism.optim import DPSGD
from dpsgd.mechanism.plan import Plan
from tolerances import EPS64, assert_f64_close, f64_rtol

DT = torch.float64


def jitter(x, generator):
    """A deterministic-given-the-generator, per-row random augmentation (tests only)."""
    noise = torch.randn(x.shape, generator=generator, dtype=x.dtype)
    return x + 0.3 * noise


def conv_gn_net():
    return nn.Sequential(
        nn.Conv2d(3, 8, 3, padding=1),
        nn.GroupNorm(4, 8),
        nn.Tanh(),
        nn.MaxPool2d(2),
        nn.Conv2d(8, 16, 3),
        nn.ReLU(),
        nn.Flatten(),
        nn.Linear(16, 10),
    )


def conv_rows_net():
    """≥ 16 input channels: the Conv2d rule's kernel-row products (`_row_products`)."""
    return nn.Sequential(
        nn.Conv2d(3, 16, 3, padding=1),
        nn.Tanh(),
        nn.Conv2d(16, 8, 3, stride=2),
        nn.Flatten(),
        nn.Linear(8 * 3 * 3, 10),
    )


def seq_net():
    """A Linear on 3-D input (the sequence rule), a LayerNorm and an RMSNorm (their rules) and a
    PReLU (no rule: the generic vmap rule)."""

    class Net(nn.Module):
        def __init__(self):
            super().__init__()
            self.inp = nn.Linear(6, 5)
            self.ln = nn.LayerNorm(5)
            self.rms = nn.RMSNorm(5)
            self.act = nn.PReLU()
            self.out = nn.Linear(5 * 4, 10)

        def forward(self, x):
            h = self.act(self.rms(self.ln(torch.tanh(self.inp(x.view(-1, 4, 6))))))
            return self.out(h.flatten(1))

    return Net()


def bias_only_first_layer():
    """The first Linear's weight frozen: its rule reads b alone (no input kept)."""
    model = MLP(20, (30,), 10, bias=True)
    model.net[0].weight.requires_grad_(False)
    return model


MODELS = {  # name -> (model, one example's shape)
    "mlp": (lambda: MLP(20, (30,), 10, bias=True), (20,)),
    "mlp_frozen_weight": (bias_only_first_layer, (20,)),
    "conv_gn": (conv_gn_net, (3, 6, 6)),
    "conv_rows": (conv_rows_net, (3, 7, 7)),
    "sequence_layernorm": (seq_net, (24,)),
    "tanh_cnn_group": (lambda: TanhCNN(norm="group"), (784,)),
}


def make(name, B, K, seed=0):
    torch.manual_seed(seed)
    build, shape = MODELS[name]
    g = torch.Generator().manual_seed(seed)
    return (
        build().to(DT),
        torch.randn(B * K, *shape, generator=g, dtype=DT),
        torch.randint(0, 10, (B,), generator=g),
    )


def reference(model, rows, y, K, groups, C):
    """For each example: the mean of its K copies' gradients (plain autograd), clip per group,
    sum."""
    return loop_clipped_sum(model, rows, y, groups, C, K)


@pytest.mark.parametrize("name", sorted(MODELS))
@pytest.mark.parametrize("clipping", ["global", "per_layer"])
@pytest.mark.parametrize("mode,budget", [("ghost", 0), ("ghost", 2**30), ("vmap", 2**30)])
def test_multiplicity_equals_the_reference_loop(name, clipping, mode, budget):
    K, C = 3, 0.05
    model, rows, y = make(name, 4, K)
    clipper = PerExampleClipper(model, C, clipping, mode, memory_budget_bytes=budget)
    res = clipper.clipped_sum(rows, y, multiplicity=K)
    ref, ref_norms = reference(model, rows, y, K, clipper.groups, C)
    assert clipper.mode == mode
    assert_close(res.grads, ref)
    assert_f64_close(
        res.norms, ref_norms, f64_rtol(model)
    )  # two kernels, float64 (tests/tolerances.py)
    assert (ref_norms > C).any() and res.norms.shape == (4, len(clipper.groups))
    losses = torch.stack(
        [F.cross_entropy(model(rows[i * K : (i + 1) * K]), y[i].expand(K)) for i in range(4)]
    )
    torch.testing.assert_close(res.loss_sum, losses.sum(), rtol=f64_rtol(model), atol=0)


def test_conv_rows_in_chunks_hold_whole_examples(monkeypatch):
    """Chunks of the kernel-row products are a multiple of K rows, even when one row alone fills
    one."""
    import dpsgd.mechanism.clipping.layers as L

    monkeypatch.setattr(L, "CHUNK_BYTES", 1)
    K, C = 3, 0.05
    model, rows, y = make("conv_rows", 4, K)
    clipper = PerExampleClipper(model, C, "per_layer", "ghost", memory_budget_bytes=0)
    ref, ref_norms = reference(model, rows, y, K, clipper.groups, C)
    res = clipper.clipped_sum(rows, y, multiplicity=K)
    assert_close(res.grads, ref)
    assert_f64_close(
        res.norms, ref_norms, f64_rtol(model)
    )  # two kernels, float64 (tests/tolerances.py)


def _dp(model, K=1, augment=None, seed=5):
    clipper = PerExampleClipper(model, 0.1, "per_layer", "auto")
    return DPSGD(
        model,
        clipper,
        GaussianNoise(seed=seed),
        Plan.by_hand(1.0, 0.1, 8),
        lr=0.5,
        augment_multiplicity=K,
        augment=augment,
        augment_generator=torch.Generator().manual_seed(9),
    )


@pytest.mark.parametrize("name", ["mlp", "tanh_cnn_group"])
def test_k1_is_the_plain_step_bit_identical(name):
    model_a, x, y = make(name, 8, 1)
    model_b, _, _ = make(name, 8, 1)
    identity = lambda t, g: t  # takes the multiplicity code path with K = 1
    _dp(model_a).step(x, y, physical_batch_size=3)
    _dp(model_b, 1, identity).step(x, y, physical_batch_size=3)
    for (n, a), (_, b) in zip(model_a.named_parameters(), model_b.named_parameters()):
        assert torch.equal(a, b), n


@pytest.mark.parametrize("mode", ["ghost", "vmap"])
def test_identical_copies_equal_k1(mode):
    """Without augmentation the K copies are equal: their mean gradient is the example's
    gradient."""
    model, x, y = make("conv_gn", 6, 1)
    one = PerExampleClipper(model, 0.05, "per_layer", mode).clipped_sum(x, y)
    four = PerExampleClipper(model, 0.05, "per_layer", mode).clipped_sum(
        x.repeat_interleave(4, 0), y, multiplicity=4
    )
    # the mean of 4 equal gradients is formed by sums and a division (not exact), and the engine
    # sums over 4x the rows: float64 round-off of a model's values (tests/tolerances.py)
    assert_close(four.grads, one.grads, rtol=f64_rtol(model))
    assert_f64_close(four.norms, one.norms, f64_rtol(model))


@pytest.mark.parametrize("mode", ["ghost", "vmap"])
def test_a_clipped_example_has_norm_C(mode):
    model, rows, y = make("tanh_cnn_group", 1, 5)
    C = 1e-3
    res = PerExampleClipper(model, C, "global", mode).clipped_sum(rows, y, multiplicity=5)
    total = torch.sqrt(sum(g.pow(2).sum() for g in res.grads.values()))
    assert res.norms.item() > C
    assert total.item() == pytest.approx(C, rel=f64_rtol(model))  # a norm over the parameters


def test_dpsgd_augments_each_row_from_its_generator():
    """DPSGD.step forms K copies per example, augments them with augment_generator (one draw per
    row) and descends along the clipped sum of the mean-over-copies gradients (σ = 0 here, so the
    update can be replayed exactly from the rows it saw)."""
    K, C, lr, L = 3, 0.1, 0.5, 8
    model, x, y = make("mlp", 8, 1)
    before = _copy(model)
    seen = []

    def augment(t, generator):
        seen.append(jitter(t, generator))
        return seen[-1].clone()

    clipper = PerExampleClipper(model, C, "per_layer", "ghost")
    dp = DPSGD(
        model,
        clipper,
        GaussianNoise(seed=5),
        Plan.by_hand(0.0, C, L),
        lr=lr,
        augment_multiplicity=K,
        augment=augment,
        augment_generator=torch.Generator().manual_seed(9),
    )
    dp.step(x, y, physical_batch_size=5)
    assert [len(s) for s in seen] == [5 * K, 3 * K]
    first = torch.randn((5 * K, 20), generator=torch.Generator().manual_seed(9), dtype=DT)
    # (x + 0.3·n) − 0.3·n: two roundings at the scale of the jittered rows
    torch.testing.assert_close(
        seen[0] - 0.3 * first,
        x[:5].repeat_interleave(K, 0),
        rtol=0,
        atol=4 * EPS64 * float(seen[0].abs().max()),
    )
    ref, _ = reference(before, torch.cat(seen), y, K, clipper.groups, C)
    for n, p in model.named_parameters():
        expected = dict(before.named_parameters())[n].detach() - lr / L * ref[n]
        assert_f64_close(p.detach(), expected, f64_rtol(model))


def _copy(model):
    import copy

    return copy.deepcopy(model)


def test_bad_multiplicity_is_refused():
    model, x, y = make("mlp", 4, 1)
    clipper = PerExampleClipper(model, 1.0)
    with pytest.raises(ValueError, match="multiplicity"):
        clipper.clipped_sum(x, y, multiplicity=0)
    with pytest.raises(ValueError, match="4 rows but y has 4 examples × multiplicity 2"):
        clipper.clipped_sum(x, y, multiplicity=2)
    with pytest.raises(ValueError, match="privacy.augment_multiplicity"):
        _dp(model, K=0)


@pytest.mark.parametrize(
    "value,message",
    [
        (0, "must be >= 1"),
        (2.5, "must be an integer"),
        ("two", "must be an integer"),
        (True, "must be an integer"),
    ],
)
def test_config_refuses_bad_multiplicity(value, message):
    with pytest.raises(ConfigError, match=f"privacy.augment_multiplicity=.*{message}"):
        validate({"privacy": {"augment_multiplicity": value}})
    assert validate({"privacy": {"augment_multiplicity": 4}}).privacy.augment_multiplicity == 4
